"""--rope-scaling-factor reaches the model: megatron-core 0.19.2's gpt_config_from_args builds the model config
without it, so every run computed Llama 3's RoPE scaling with factor 8 (its default) whatever the flag said; a
Llama 3.2 import (factor 32) trained with 8 and was exported as 32. test_hf_convert's models all have factor 8, which
cannot show it."""
import json

import torch

from conftest import ok
from test_hf_convert import VOCAB, assert_same_logits, convert, hf_logits, make_hf_llama, megatron_logits

SEQ = 256  # positions far enough for the scaled (low) frequencies to set factor 8's logits apart from factor 32's


def test_a_factor_32_import_gives_transformers_logits(tmp_path):
    """A tied Llama-3.2-style model (RoPE factor 32) imported and loaded gives transformers' logits over enough
    positions for the factor to matter."""
    hf = make_hf_llama(tmp_path / "hf", tied=True)
    config = json.loads((hf / "config.json").read_text())
    config["rope_parameters"]["factor"] = 32.0
    (hf / "config.json").write_text(json.dumps(config))
    ckpt = tmp_path / "ckpt"
    ok(convert("import", hf, ckpt))
    assert "rope-scaling-factor: 32.0" in (ckpt / "model.yaml").read_text()
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(3))
    assert_same_logits(megatron_logits(tmp_path, ckpt, tokens, 1), hf_logits(hf, tokens))


def test_megatron_core_still_drops_the_factor():
    """megatron.training's gpt_config_from_args leaves the model config's rope_scaling_factor at its default (8);
    platform.pass_rope_scaling_factor passes the flag's. When the first assert fails, megatron-core passes it
    itself and the patch can go."""
    from megatron.training import argument_utils

    from litespark_megatron import arguments, platform

    cpu = platform.Platform("cpu", "gloo", False, False, "cpu")
    args = arguments.resolve(["--model", "tiny", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "1",
                              "--train-iters", "1", "--eval-interval", "10", "--use-rope-scaling",
                              "--rope-scaling-factor", "32"], cpu)
    arguments.check_run(args, cpu, 1)
    library = getattr(argument_utils.gpt_config_from_args, "__wrapped__", argument_utils.gpt_config_from_args)
    assert library(args).rope_scaling_factor == 8.0, "megatron-core passes --rope-scaling-factor now: drop the patch"
    platform.pass_rope_scaling_factor()
    config = argument_utils.gpt_config_from_args(args)
    assert config.rope_scaling is True and config.rope_scaling_factor == 32.0
