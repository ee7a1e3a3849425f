"""Parameter-efficient fine-tuning (--peft lora|dora|freeze) on the Litespark layer, from a base that is a
`litespark-convert import` of a tiny transformers Llama (GQA, untied, a vocabulary TP pads):

- the adapted model starts as its base bit for bit (B = 0), in TP1, TP2+SP and PP2 (tests/workers/peft_worker.py);
- HF peft is the oracle: the adapter `litespark-convert export-adapter` writes, loaded by peft onto the base's HF
  model, gives the trainer's logits, loss and gradient of every adapter parameter: LoRA (TP1, two of the four
  linears) and DoRA with RSLoRA's scaling in TP1, TP2+SP and PP2 (fp32);
- TP2+SP and PP2 take the single-process optimizer steps (DoRA, RSLoRA, LoRA-plus), the optimizer holds the
  adapters alone and LoRA-plus gives B its learning rate;
- litespark-train: the base's tensors stay bit for bit those of --peft-base, the optimizer state is the adapters',
  resume is bit-exact (saving the adapters alone: --save-adapters-only, whose merged export reads the base from
  --peft-base), the merged HF export computes what HF peft computes with the adapter, and a checkpoint with adapters
  neither exports nor loads as a plain model;
- --peft freeze --trainable-layers 1 under PP2 with the distributed optimizer (the first stage has nothing to
  train) trains the last layer alone and saves;
- bad flags are one line.

The runs are shared (forked from the test worker's zygote): one import, four worker runs, a training run and its
resumption, and one conversion process.
"""
import json
from types import SimpleNamespace

import pytest
import torch

from conftest import WORKER_DIR, forked, made_once, ok, parity_run
from test_hf_convert import VOCAB, make_hf_llama


SEQ = 32
TRAIN = ["--mock-data", "--seq-length", SEQ, "--micro-batch-size", 2, "--global-batch-size", 4, "--lr", "1e-2",
         "--min-lr", "1e-3", "--train-iters", 3, "--eval-iters", 0, "--eval-interval", 100, "--seed", 5]
# DoRA (its row norm is summed over TP for proj and fc2), RSLoRA's scaling, LoRA-plus.
DORA = ["--peft", "dora", "--lora-scaling", "rs", "--lora-rank", 4, "--lora-alpha", 8, "--lora-plus-ratio", 4]
LORA = ["--peft", "lora", "--lora-targets", "linear_qkv", "linear_fc2"]  # rank 8, alpha 16 (the defaults)
WORKERS = {  # name -> (processes, flags)
    "lora-tp1": (1, LORA),
    "dora-rs-tp1": (1, DORA),
    "dora-rs-tp2-sp": (2, DORA + ["--tensor-model-parallel-size", 2, "--sequence-parallel"]),
    # full recompute too: a reentrant checkpoint after a frozen embedding (peft.apply's hook)
    "dora-rs-pp2": (2, DORA + ["--pipeline-model-parallel-size", 2, "--recompute-granularity", "full",
                               "--recompute-method", "uniform", "--recompute-num-layers", 1]),
}
HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def convert(*argv):
    return forked(1, "litespark_megatron.hf_convert", *argv, "--quiet", module=True)


def convert_many(tmp, *commands):
    """[(exit code, last stderr line)] of several litespark-convert commands, in one process."""
    argv = [token for command in commands for token in ("--", *map(str, command))]
    ok(forked(1, WORKER_DIR / "convert_many.py", tmp / "converted.json", *argv))
    return json.loads((tmp / "converted.json").read_text())


def model_flags(base):
    return ["--config", base[1] / "model.yaml", "--peft-base", base[1]]


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def peft_model(hf_dir, adapter):
    from peft import PeftModel

    return PeftModel.from_pretrained(hf_model(hf_dir), adapter, is_trainable=True)


def close(ours, reference, tolerance=1e-5):
    """Equal within fp32 rounding: `tolerance` relative to the reference's largest value (at least 1)."""
    return (ours - reference).abs().max().item() <= tolerance * max(1.0, reference.abs().max().item())


def checkpoint_tensors(directory):
    """Every tensor of a torch_dist checkpoint directory (the tracker's checkpoint), whole."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    it = (directory / "latest_checkpointed_iteration.txt").read_text().strip()
    directory = directory / ("release" if it == "release" else f"iter_{int(it):07d}")
    out = directory.parent / f"{directory.name}.pt"
    if not out.exists():
        dcp_to_torch_save(directory, out)
    return {k: v for k, v in torch.load(out, weights_only=False).items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    def build(tmp):
        hf = make_hf_llama(tmp / "hf", tied=False)
        ok(convert("import", hf, tmp / "ckpt"))
        return hf, tmp / "ckpt"
    return made_once(tmp_path_factory, "peft-base", build)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def runs(base, tokens, tmp_path_factory):
    """The worker runs (their reports and HF peft adapters), the DoRA training run in one process (saved at steps 2
    and 3), and its conversions: HF peft adapter, merged export, plain export (refused)."""
    def build(tmp):
        (tmp / "tokens.json").write_text(json.dumps({"tokens": tokens.tolist()}))
        reports, conversions = {}, []
        for name, (nproc, flags) in WORKERS.items():
            argv = [WORKER_DIR / "peft_worker.py", tmp / "tokens.json", tmp / f"{name}.pt", "--",
                    *model_flags(base), *flags, "--mock-data", "--lr", "5e-3", "--min-lr", "5e-4",
                    "--train-iters", 3, "--eval-iters", 0, "--eval-interval", 10, "--save", tmp / name,
                    "--save-interval", 1]
            ok(forked(nproc, *argv))  # (one process sets up a world of one itself)
            reports[name] = torch.load(tmp / f"{name}.pt")
            conversions.append(["export-adapter", tmp / name, tmp / f"{name}.adapter", "--base-model", base[0]])
        dora = model_flags(base) + DORA + TRAIN
        training = parity_run(tmp, 1, dora + ["--save", tmp / "trained", "--save-interval", 2])
        # resumed from step 2, saving the adapters alone
        resumed = parity_run(tmp, 1, dora + ["--load", tmp / "trained", "--ckpt-step", 2, "--save", tmp / "resumed",
                                             "--save-interval", 2, "--save-adapters-only"])
        conversions += [["export-adapter", tmp / "trained", tmp / "trained.adapter"],
                        ["export", tmp / "trained", tmp / "trained.merged", "--merge-adapters"],
                        ["export", tmp / "resumed", tmp / "resumed.merged", "--merge-adapters"],
                        ["export", tmp / "trained", tmp / "trained.plain"]]
        converted = convert_many(tmp, *conversions)
        assert [code for code, _ in converted] == [0] * (len(WORKERS) + 3) + [2], converted
        return SimpleNamespace(reports=reports, adapters={name: tmp / f"{name}.adapter" for name in WORKERS},
                               training=training, ckpt=tmp / "trained", adapter=tmp / "trained.adapter",
                               merged=tmp / "trained.merged", plain_export=converted[-1][1], resumed=resumed,
                               resumed_ckpt=tmp / "resumed", resumed_merged=tmp / "resumed.merged")
    return made_once(tmp_path_factory, "peft-runs", build)


# --------------------------------------------------------------------------------------------- the oracle
@pytest.mark.parametrize("variant", list(WORKERS))
def test_adapters_start_as_the_base_and_hf_peft_computes_what_the_trainer_computes(variant, runs, base, tokens):
    report, adapter = runs.reports[variant], runs.adapters[variant]
    assert report["identity"], "with B = 0 the adapted model's logits are not its base's bit for bit"

    config = json.loads((adapter / "adapter_config.json").read_text())
    dora = "dora" in variant
    assert (config["use_dora"], config["use_rslora"]) == (dora, dora)
    assert (config["r"], config["lora_alpha"]) == ((4, 8) if dora else (8, 16))
    assert sorted(config["target_modules"]) == (sorted(HF_MODULES) if dora else
                                                ["down_proj", "k_proj", "q_proj", "v_proj"])

    model = peft_model(base[0], adapter)
    model.train()  # dropout 0; peft's DoRA then runs its training path
    logits = model(tokens[:, :-1]).logits
    ours = report["logits"][..., :VOCAB]
    assert close(ours, logits.detach()), (ours - logits).abs().max()
    assert (ours - report["base_logits"][..., :VOCAB]).abs().max() > 0.1  # the adapters change the model
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    assert abs(loss.item() - report["losses"][0]) <= 1e-5, (loss.item(), report["losses"][0])
    loss.backward()
    kinds = {"lora_A": "lora_A.default.weight", "lora_B": "lora_B.default.weight",
             "magnitude": "lora_magnitude_vector.default.weight"}
    assert len(report["grads"]) == len([p for p in model.parameters() if p.requires_grad]) > 0
    for name, grad in report["grads"].items():  # decoder.layers.<i>.<module>.<linear>.adapter.<kind>.<proj>
        parts = name.split(".")
        layer, kind, proj = parts[2], parts[-2], parts[-1]
        theirs = model.get_parameter(f"base_model.model.model.layers.{layer}.{HF_MODULES[proj]}.{proj}."
                                     f"{kinds[kind]}").grad
        assert theirs.abs().max() > 0, name
        assert (grad - theirs).abs().max() <= 1e-5 * theirs.abs().max(), (name, (grad - theirs).abs().max())


@pytest.mark.parametrize("layout", ["dora-rs-tp2-sp", "dora-rs-pp2"])
def test_layouts_take_the_single_process_steps(layout, runs):
    got, reference = runs.reports[layout], runs.reports["dora-rs-tp1"]
    assert len(got["losses"]) == 3 and reference["losses"][-1] < reference["losses"][0]  # it learns
    for step, (a, b) in enumerate(zip(got["losses"], reference["losses"])):
        assert abs(a - b) <= 1e-5, f"{layout} step {step}: loss {a} != single-process {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], reference["grad_norms"])):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), f"{layout} step {step}: grad norm {a} != {b}"


def test_the_optimizer_holds_the_adapters_and_lora_plus_gives_b_its_learning_rate(runs):
    """--lora-plus-ratio 4 with --lr 5e-3 --min-lr 5e-4: B and DoRA's magnitudes get 2e-2 and 2e-3 (megatron-core's
    per-parameter overrides, through the whole schedule), A the run's own; without LoRA-plus, all the run's."""
    for variant, ratio in (("dora-rs-tp2-sp", 4), ("lora-tp1", 1)):
        report = runs.reports[variant]
        assert sorted(report["learning_rates"]) == sorted(report["grads"])  # the adapters, nothing of the base
        for name, rates in report["learning_rates"].items():
            expected = 1 if ".lora_A." in name else ratio
            assert rates == pytest.approx((5e-3 * expected, 5e-4 * expected)), (variant, name, rates)


# --------------------------------------------------------------------------------------------- litespark-train
def test_training_leaves_the_base_as_it_was_and_the_optimizer_state_is_the_adapters(runs, base):
    assert runs.training["losses"][-1] < runs.training["losses"][0]
    after, before = checkpoint_tensors(runs.ckpt), checkpoint_tensors(base[1])
    assert len(before) == 9  # embedding, the layers' six tensors, final norm, output layer
    for key, tensor in before.items():
        assert torch.equal(after[key][:tensor.shape[0]], tensor), key  # (the vocabulary TP1 pads: the import's rows)
    adapters = [k for k in after if ".adapter." in k and not k.startswith("optimizer.")]
    assert len(adapters) == 3 * 7 and all(after[k].abs().max() > 0 for k in adapters)  # A, B and m of 7 projections
    # the run record counts what trains (the FLOP counter's count) and names the FLOP convention of its MFU
    record = runs.training["run"]
    assert record["trainable_params"] == sum(after[k].numel() for k in adapters)
    assert record["flops_convention"] == "peft" and record["trainable_params"] < record["params"]
    state = [k for k in after if k.startswith("optimizer.state.")]
    assert len(state) == 2 * len(adapters) and all(".adapter." in k for k in state), state[:5]


def test_resume_is_bit_exact_and_saves_the_adapters_alone(runs, base):
    """Resumed at step 2 with --save-adapters-only: step 3 as the uninterrupted run, its checkpoint the adapters and
    their optimizer state alone, bit for bit those of the uninterrupted run, and its merged export (the base read
    from --peft-base) the uninterrupted run's, bit for bit."""
    from safetensors.torch import load_file

    assert runs.resumed["losses"] == runs.training["losses"][2:]
    ours, theirs = checkpoint_tensors(runs.resumed_ckpt), checkpoint_tensors(runs.ckpt)
    assert sorted(ours) == sorted(k for k in theirs if ".adapter." in k)  # nothing of the base
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    merged, resumed = load_file(runs.merged / "model.safetensors"), load_file(runs.resumed_merged / "model.safetensors")
    assert sorted(merged) == sorted(resumed) and all(torch.equal(merged[k], resumed[k]) for k in merged)


def test_the_merged_export_computes_what_hf_peft_computes_with_the_adapter(runs, base, tokens):
    with torch.no_grad():
        merged = hf_model(runs.merged).eval()(tokens).logits
        with_adapter = peft_model(base[0], runs.adapter).eval()
        adapted = with_adapter(tokens).logits
        unloaded = with_adapter.merge_and_unload()(tokens).logits
        plain = hf_model(base[0]).eval()(tokens).logits
    assert close(merged, adapted) and close(merged, unloaded)
    assert (merged - plain).abs().max() > 1e-2  # the adapters are in it
    assert json.loads((runs.merged / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_a_checkpoint_with_adapters_neither_exports_nor_loads_as_a_plain_model(runs, base):
    assert runs.plain_export.startswith("litespark-convert: error: ") and "add --merge-adapters" in \
        runs.plain_export, runs.plain_export
    from litespark_megatron import arguments
    from litespark_megatron.errors import ConfigError
    from litespark_megatron.platform import Platform

    cpu = Platform("cpu", "gloo", False, False, "cpu")
    flags = [str(f) for f in ["--config", base[1] / "model.yaml", "--load", runs.ckpt] + TRAIN]
    with pytest.raises(ConfigError, match="holds a --peft dora run .*: resume it with the same --peft flags"):
        arguments.check_checkpoints(arguments.resolve(flags, cpu))
    peft = [str(f) for f in model_flags(base) + ["--peft", "dora", "--lora-rank", 8]]
    with pytest.raises(ConfigError, match="holds adapters of --peft dora, rank 4, .* this run builds --peft dora, "
                                          "rank 8"):
        arguments.check_checkpoints(arguments.resolve(flags + peft, cpu))
    alone = [str(f) for f in ["--config", base[1] / "model.yaml", "--load", runs.resumed_ckpt] + TRAIN +
             model_flags(base) + DORA]
    with pytest.raises(ConfigError, match="holds the adapters alone .*: resume it with --save-adapters-only"):
        arguments.check_checkpoints(arguments.resolve(alone, cpu))


# --------------------------------------------------------------------------------------------- freeze
def test_freeze_trains_the_last_layer_alone_with_a_pipeline_stage_that_has_nothing_to_train(base, tmp_path):
    save = tmp_path / "ckpt"
    result = parity_run(tmp_path, 2, model_flags(base) + ["--peft", "freeze", "--trainable-layers", 1] + TRAIN +
                        ["--pipeline-model-parallel-size", 2, "--use-distributed-optimizer", "--save", save,
                         "--save-interval", 3])
    assert result["losses"][-1] < result["losses"][0]
    after, before = checkpoint_tensors(save), checkpoint_tensors(base[1])
    for key, tensor in before.items():
        if key.startswith("decoder.layers."):  # stacked [layer, ...]: the last layer trained
            assert torch.equal(after[key][:3], tensor[:3]) and not torch.equal(after[key][3], tensor[3]), key
        else:
            assert torch.equal(after[key][:tensor.shape[0]], tensor), key
    record = result["run"]
    assert record["trainable_params"] == sum(after[k][3].numel() for k in before if k.startswith("decoder.layers."))
    assert record["flops_convention"] == "peft"


# --------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("flags, message", [
    (["--peft", "lora"], "--peft lora fine-tunes a base model: give --peft-base CKPT"),
    (["--lora-rank", "4"], "--lora-rank sets the adapters of --peft lora or dora; this run has no --peft"),
    (["--peft", "freeze", "--peft-base", "{base}", "--trainable-layers", "1", "--save-adapters-only"],
     "--save-adapters-only saves the adapters of --peft lora or dora alone"),
    (["--peft", "lora", "--peft-base", "{base}", "--save-adapters-only", "--ckpt-format", "torch"],
     "--save-adapters-only with --ckpt-format torch: it leaves the base out of torch_dist checkpoints"),
    (["--peft", "freeze", "--peft-base", "{base}"], "--peft freeze trains the last layers of the model: give "
                                                    "--trainable-layers K (1 to 4)"),
    (["--peft", "freeze", "--peft-base", "{base}", "--trainable-layers", "5"], "--trainable-layers 5: give 1 to 4"),
    (["--peft", "freeze", "--peft-base", "{base}", "--trainable-layers", "1", "--save", "{other}",
      "--save-interval", "2"], "--peft freeze --trainable-layers 1 with --save: megatron-core's plain optimizer "
                               "cannot save the state of some layers of a stack; add --use-distributed-optimizer"),
    (["--peft", "lora", "--peft-base", "{base}", "--trainable-layers", "1"], "--trainable-layers K trains the last "
                                                                             "K layers of --peft freeze"),
    (["--peft", "lora", "--peft-base", "{base}", "--lora-targets", "linear_q"], "--lora-targets linear_q: not a "
                                                                                "linear of the Litespark layer"),
    (["--peft", "lora", "--peft-base", "{base}", "--lora-rank", "0"], "--lora-rank 0: give a rank >= 1"),
    (["--peft", "dora", "--peft-base", "{base}", "--lora-plus-ratio", "0"], "--lora-plus-ratio 0: give B's learning "
                                                                            "rate over A's, > 0"),
    (["--peft", "lora", "--peft-base", "{base}", "--spec", "stock-local"],
     "the adapters live in the Litespark layer; --spec stock-local builds another"),
    (["--peft", "lora", "--peft-base", "{base}", "--num-experts", "4"], "--peft lora with --num-experts: adapters "
                                                                        "are written for the dense Llama layer"),
    (["--peft", "lora", "--peft-base", "{base}", "--load", "{base}"], "--load is --peft-base's directory"),
    (["--peft", "lora", "--peft-base", "{base}", "--pretrained-checkpoint", "{other}"], "--pretrained-checkpoint "
                                                                                      "with --peft"),
    (["--peft", "lora", "--peft-base", "{other}"], "no checkpoint there"),
    (["--peft", "lora", "--peft-base", "{base}", "--num-layers", "2"], "--peft-base {base}: the checkpoint holds "
                                                                       "another model than these flags build"),
])
def test_bad_flags_are_refused_in_one_line(flags, message, base, tmp_path):
    """Refused before any work (pretrain.main prints a UserError as `litespark-train: error: ...`, exit 2)."""
    from litespark_megatron import arguments
    from litespark_megatron.errors import UserError
    from litespark_megatron.platform import Platform

    other = tmp_path / "other"
    other.mkdir()
    fill = lambda s: s.replace("{base}", str(base[1])).replace("{other}", str(other))  # noqa: E731
    cpu = Platform("cpu", "gloo", False, False, "cpu")
    argv = ["--config", str(base[1] / "model.yaml")] + [str(f) for f in TRAIN] + [fill(f) for f in flags]
    with pytest.raises(UserError) as refused:
        args = arguments.resolve(argv, cpu)
        arguments.check(args, cpu, world=1)
        arguments.check_checkpoints(args)
    assert fill(message) in str(refused.value) and "\n" not in str(refused.value)
