"""Presets, flag/YAML resolution, and one clear error for each configuration that cannot run."""
import pytest

from litespark_megatron.config import PRESETS, ConfigError, padded_vocab_size, resolve, validate


def check(argv, world=1, cuda=False, te=False, fp8_capable=False):
    validate(resolve(argv), world, cuda=cuda, te=te, fp8_capable=fp8_capable)


def test_presets_have_the_documented_shapes():
    p = PRESETS["llama-3b"]
    assert (p.hidden_size, p.num_layers, p.ffn_hidden_size, p.num_attention_heads, p.num_query_groups,
            p.vocab_size) == (3072, 28, 8192, 24, 8, 128256)
    assert {"tiny", "llama-1b", "llama-3b", "llama-30b", "llama3-8b"} <= set(PRESETS)
    for name in PRESETS:  # every preset is valid on one process
        check(["--model", name])


def test_flags_override_preset_and_yaml(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: llama-3b\nnum-layers: 4\nlr: 0.001\nsequence_parallel: true\n")
    args = resolve(["--config", str(cfg), "--lr", "0.002"])
    assert args.hidden_size == 3072 and args.num_layers == 4  # preset, then file
    assert args.lr == 0.002 and args.sequence_parallel is True  # flag beats file
    assert args.lr_decay_iters == args.train_iters


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("nmu-layers: 4\n")
    with pytest.raises(ConfigError, match="unknown key 'nmu-layers'"):
        resolve(["--config", str(bad)])
    with pytest.raises(ConfigError, match="no such file"):
        resolve(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("argv, world, message", [
    (["--tensor-model-parallel-size", "2"], 3, "world size 3 is not divisible by TP x PP x CP"),
    (["--tensor-model-parallel-size", "8"], 8, "--num-attention-heads 4 is not divisible"),
    (["--model", "llama-3b", "--tensor-model-parallel-size", "3"], 3, "--num-query-groups (KV heads) 8 is not"),
    (["--pipeline-model-parallel-size", "3"], 3, "--num-layers 4 is not divisible by --pipeline-model"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     "not divisible by PP x layers per virtual stage"),
    (["--sequence-parallel"], 1, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--context-parallel-size", "2", "--spec", "stock-local"], 2,
     "--context-parallel-size > 1: the stock-local spec's attention (megatron-core's DotProductAttention) has no"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "--seq-length 30 must be divisible by 2 x CP = 4"),
    (["--fp8-format", "hybrid"], 1, "FP8 (--fp8-format) needs Transformer Engine"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 is not divisible"),
    (["--bf16", "--fp16"], 1, "--bf16 and --fp16 are exclusive"),
    (["--spec", "stock-te"], 1, "--spec stock-te needs Transformer Engine"),
    (["--profile"], 1, "--profile writes its files into the run directory: give --save or --tensorboard-dir"),
    (["--profile", "--save", "ckpt", "--profile-step-start", "5", "--profile-step-end", "5"], 1,
     "--profile-step-start 5 and --profile-step-end 5 must satisfy 0 <= start < end <= --train-iters 100"),
    (["--profile", "--save", "ckpt", "--profile-step-end", "101"], 1, "--profile-step-end 101 must satisfy"),
    (["--profile", "--save", "ckpt", "--profile-ranks", "0", "2"], 2,
     "--profile-ranks 2: no such rank in a world of 2 (ranks 0..1)"),
])
def test_bad_configuration_is_refused(argv, world, message):
    with pytest.raises(ConfigError) as e:
        check(argv, world)
    assert message in str(e.value)


def test_fp8_needs_a_gpu_and_fp8_hardware():
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        check(["--fp8-format", "e4m3"], te=True, cuda=False)
    with pytest.raises(ConfigError, match="FP8 tensor cores"):
        check(["--fp8-format", "e4m3", "--bf16"], te=True, cuda=True, fp8_capable=False)
    check(["--fp8-format", "e4m3", "--bf16"], te=True, cuda=True, fp8_capable=True)


def test_unknown_preset_spec_and_backend():
    with pytest.raises(ConfigError, match="unknown model preset 'llama-7b'; choose one of: tiny"):
        resolve(["--model", "llama-7b"])
    with pytest.raises(ConfigError, match="unknown --spec 'fast'"):
        resolve(["--spec", "fast"])
    with pytest.raises(ConfigError, match="--transformer-impl te: Transformer Engine is not importable"):
        check(["--transformer-impl", "te"])


def test_megatron_spelling_of_transformer_impl():
    assert resolve(["--transformer-impl", "transformer_engine"]).backend == "te"
    assert resolve(["--transformer-impl", "local"]).backend == "local"


def test_vocab_padding_is_independent_of_tp():
    assert padded_vocab_size(128256, 128) == 128256
    assert padded_vocab_size(4097, 128) == 4224


def test_kernel_fusion_flags():
    from litespark_megatron.model import transformer_config

    args = resolve(["--model", "tiny"])
    assert args.gradient_accumulation_fusion is True and args.cross_entropy_loss_fusion is False
    assert args.rope_fusion is True and resolve(["--model", "tiny", "--no-rope-fusion"]).rope_fusion is False
    assert transformer_config(args, "local", "cpu").apply_rope_fusion is False  # TE's kernel needs TE and a GPU
    assert args.cross_entropy_fusion_impl == "native"
    args = resolve(["--model", "tiny", "--no-gradient-accumulation-fusion", "--cross-entropy-loss-fusion"])
    assert args.gradient_accumulation_fusion is False
    cfg = transformer_config(args, "local", "cpu")
    assert cfg.cross_entropy_loss_fusion is True and cfg.cross_entropy_fusion_impl == "native"
    assert cfg.gradient_accumulation_fusion is False  # only TE modules on CUDA fuse it
    args = resolve(["--model", "tiny", "--bf16", "--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "te"])
    with pytest.raises(ConfigError, match="--cross-entropy-fusion-impl te needs Transformer Engine"):
        validate(args, 1, cuda=False, te=False)
    validate(resolve(["--model", "tiny", "--bf16", "--cross-entropy-loss-fusion"]), 1, cuda=False, te=False)
    for precision in ([], ["--fp16"]):
        args = resolve(["--model", "tiny", "--cross-entropy-loss-fusion"] + precision)
        with pytest.raises(ConfigError, match="native needs --bf16: megatron-core's fused kernel rounds the logits "
                                              "gradient to bf16"):
            validate(args, 1, cuda=False, te=False)
