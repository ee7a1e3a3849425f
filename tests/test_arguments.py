"""litespark-train's command line: Megatron-LM's parser and defaults, presets and --config files read as flags,
--spec names, and one clear error for each configuration that cannot run (checked before any process group)."""
import argparse
import importlib.util
import os

import pytest

from litespark_megatron import arguments
from litespark_megatron.arguments import PRESETS, ConfigError
from litespark_megatron.platform import Platform
from litespark_megatron.spec_choice import LITESPARK_SPEC, SpecChoice

CPU = Platform("cpu", "gloo", False, False, "cpu")
GPU_TE = Platform("cuda", "nccl", True, True, "NVIDIA H200")
GPU_NO_TE = Platform("cuda", "nccl", False, False, "NVIDIA H200")


def resolve(argv, plat=CPU):
    return arguments.resolve(argv, plat)


def check(argv, plat=CPU):
    args = resolve(argv, plat)
    arguments.check(args, plat)
    return args


def _have_apex() -> bool:
    from megatron.core.models.gpt import gpt_layer_specs

    return gpt_layer_specs.HAVE_APEX


RUN = ["--micro-batch-size", "2", "--train-iters", "2", "--eval-interval", "10"]
TINY = ["--model", "tiny", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "2",
        "--eval-interval", "10"]


def test_presets_are_megatron_lm_flags_of_llama_shapes():
    args = resolve(["--model", "llama-3b"])
    assert (args.hidden_size, args.num_layers, args.ffn_hidden_size, args.num_attention_heads,
            args.num_query_groups, args.vocab_size) == (3072, 28, 8192, 24, 8, 128256)
    assert args.group_query_attention and args.swiglu and args.normalization == "RMSNorm"
    assert not args.add_bias_linear and args.position_embedding_type == "rope" and args.hidden_dropout == 0.0
    mha = resolve(["--model", "llama-30b"])
    assert not mha.group_query_attention  # 52 KV heads = MHA: no --group-query-attention
    for name in PRESETS:
        check(["--model", name, "--mock-data", "--lr", "1e-3", *RUN])


def test_megatron_lm_defaults_stay_where_nothing_is_given():
    """A flag the preset and the command line leave alone has Megatron-LM's default (here: its dropout, weight
    decay, betas, LR decay and tying, which litespark-train's own trainer used to change)."""
    args = resolve(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"])
    assert (args.hidden_dropout, args.weight_decay, args.adam_beta2, args.lr_decay_style) == (0.1, 0.01, 0.999,
                                                                                            "linear")
    assert args.untie_embeddings_and_output_weights is False and args.normalization == "LayerNorm"


def test_flags_win_over_config_file_over_preset(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model: llama-3b\nnum-layers: 4\nlr: 0.001\nsequence_parallel: true\nbf16: true\n"
                   "data-path: [0.7, a, 0.3, b]\n")
    args = resolve(["--config", str(cfg), "--lr", "0.002"])
    assert args.hidden_size == 3072 and args.num_layers == 4  # preset, then file
    assert args.lr == 0.002 and args.sequence_parallel is True and args.bf16 is True  # flag beats file
    assert args.data_path == ["0.7", "a", "0.3", "b"]


@pytest.mark.parametrize("text, message", [
    ("nmu-layers: 4\n", "unknown flag 'nmu-layers'"),
    ("bf16: 'false'\n", "'bf16' is a switch: write true or false, not 'false'"),
    ("lr: true\n", "'lr' takes a value"),
    ("seq-length: [1, 2]\n", "'seq-length' takes one value, not a list"),
    ("- 1\n- 2\n", "expected a mapping of flag names to values, got a list"),
    ("a: [\n", "not valid YAML"),
])
def test_config_file_errors(tmp_path, text, message):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=None) as e:
        resolve(["--config", str(cfg)])
    assert message in str(e.value)


def test_config_file_values_are_typed_as_on_the_command_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("micro-batch-size: 2.5\n")
    with pytest.raises(SystemExit) as e:
        resolve(["--config", str(cfg)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["litespark-train: error: argument --micro-batch-size: invalid int value: '2.5'"]
    with pytest.raises(ConfigError, match="no such file"):
        resolve(["--config", str(tmp_path / "missing.yaml")])


def test_spec_names():
    lit = resolve(["--model", "tiny"])
    assert lit.spec == ["litespark_megatron.specs", "litespark_layer_spec"] and lit.litespark_spec == "litespark"
    stock = resolve(["--model", "tiny", "--spec", "stock-local"])
    assert stock.spec is None and stock.transformer_impl == "local"
    custom = resolve(["--model", "tiny", "--spec", "my.module", "my_spec"])
    assert custom.spec == ["my.module", "my_spec"] and custom.litespark_spec == "custom"
    with pytest.raises(ConfigError, match="--spec nope: name one of litespark, stock, stock-te, stock-local"):
        resolve(["--model", "tiny", "--spec", "nope"])
    with pytest.raises(ConfigError, match="--spec stock-te means --transformer-impl transformer_engine, not local"):
        resolve(["--model", "tiny", "--spec", "stock-te", "--transformer-impl", "local"], GPU_TE)


@pytest.mark.parametrize("flags, choice, impl, megatron_spec", [
    ([], SpecChoice.LITESPARK, "local", LITESPARK_SPEC),
    (["--spec", "litespark"], SpecChoice.LITESPARK, "local", LITESPARK_SPEC),
    (["--spec", "stock"], SpecChoice.STOCK, "local", None),
    (["--spec", "stock-local"], SpecChoice.STOCK_LOCAL, "local", None),
    (["--spec", "stock-te", "--no-rope-fusion"], SpecChoice.STOCK_TE, "transformer_engine", None),
    (["--spec", *LITESPARK_SPEC], SpecChoice.LITESPARK, "local", LITESPARK_SPEC),
    (["--spec", "my.module", "my_spec"], SpecChoice.CUSTOM, "local", ["my.module", "my_spec"]),
], ids=["default", "litespark", "stock", "stock-local", "stock-te", "litespark-pair", "custom"])
def test_every_spec_resolves_to_its_choice(flags, choice, impl, megatron_spec):
    """--spec, a name or Megatron-LM's module and function, resolves once to a SpecChoice (kept by its name, which
    the run record prints), the backend it means and Megatron-LM's --spec; Litespark's own pair is its layer."""
    args = resolve(["--model", "tiny", *flags], GPU_TE if choice is SpecChoice.STOCK_TE else CPU)
    assert SpecChoice.of(args) is choice and args.litespark_spec == choice.value
    assert (args.transformer_impl, args.spec) == (impl, megatron_spec)


def test_what_each_spec_choice_decides():
    assert SpecChoice.names() == ["litespark", "stock", "stock-te", "stock-local"]
    assert [c for c in SpecChoice if c.is_stock] == [SpecChoice.STOCK, SpecChoice.STOCK_TE, SpecChoice.STOCK_LOCAL]
    assert [c for c in SpecChoice if c.is_litespark] == [SpecChoice.LITESPARK]
    te = "transformer_engine"
    assert [c for c in SpecChoice if c.uses_te_attention(te, "sdpa")] == \
        [SpecChoice.STOCK, SpecChoice.STOCK_TE, SpecChoice.STOCK_LOCAL]  # (stock-local never runs on te)
    assert [c for c in SpecChoice if c.uses_te_attention(te, "te")] == \
        [SpecChoice.LITESPARK, SpecChoice.STOCK, SpecChoice.STOCK_TE, SpecChoice.STOCK_LOCAL]
    assert not any(c.uses_te_attention("local", "te") for c in SpecChoice)
    # names in run records and benchmark rows: the HF baselines' names no choice
    assert SpecChoice.named("stock-te") is SpecChoice.STOCK_TE
    assert SpecChoice.named("hf-ddp") is None and SpecChoice.named(None) is None


def test_checkpoint_args_resolve_the_spec_choice_again():
    """--use-checkpoint-args: the checkpoint's --spec (a module and a function; none from a stock run) decides."""
    for saved, choice in ((list(LITESPARK_SPEC), SpecChoice.LITESPARK), (["my.module", "my_spec"], SpecChoice.CUSTOM),
                          (None, SpecChoice.STOCK_LOCAL)):
        args = resolve(TINY + ["--spec", "stock-local", "--no-persist-layer-norm"])
        args.spec = saved  # what Megatron-LM's loader leaves
        arguments.follow_checkpoint_args(args)
        assert SpecChoice.of(args) is choice and args.litespark_spec == choice.value
    args = resolve(TINY + ["--spec", "my.module", "my_spec"])
    args.spec = list(LITESPARK_SPEC)
    arguments.follow_checkpoint_args(args)
    assert SpecChoice.of(args) is SpecChoice.LITESPARK


def test_cpu_platform_flags_and_gpu_defaults():
    cpu = resolve(["--model", "tiny"])
    assert (cpu.distributed_backend, cpu.transformer_impl, cpu.gradient_accumulation_fusion,
            cpu.apply_rope_fusion) == ("gloo", "local", False, False)
    gpu = resolve(["--model", "tiny"], GPU_TE)
    assert (gpu.distributed_backend, gpu.transformer_impl, gpu.gradient_accumulation_fusion,
            gpu.apply_rope_fusion) == ("nccl", "transformer_engine", True, True)


def test_mla_replaces_the_presets_grouped_query_attention():
    args = resolve(["--model", "tiny", "--multi-latent-attention"])
    assert args.multi_latent_attention and not args.group_query_attention


@pytest.mark.parametrize("argv, world, plat, message", [
    (["--tensor-model-parallel-size", "2"], 3, CPU, "world size 3 is not divisible by TP x PP x CP = 2 x 1 x 1"),
    (["--tensor-model-parallel-size", "8"], 8, CPU, "--num-attention-heads 4 is not divisible"),
    (["--model", "llama-3b", "--tensor-model-parallel-size", "3"], 3, CPU, "--num-query-groups (KV heads) 8 is not"),
    (["--pipeline-model-parallel-size", "3"], 3, CPU, "--num-layers 4 is not divisible by --pipeline-model"),
    (["--transformer-impl", "transformer_engine"], 1, CPU, "needs Transformer Engine, which is not importable on "
     "a CPU: use --transformer-impl local"),
    (["--fp8-format", "hybrid"], 1, CPU, "--fp8-format needs a GPU with FP8 tensor cores"),
    (["--cuda-graph-impl", "transformer_engine"], 1, CPU, "--cuda-graph-impl transformer_engine captures the step's "
     "CUDA kernels into graphs: it needs a GPU; drop it on a CPU"),
    (["--use-distributed-optimizer", "--use-precision-aware-optimizer"], 1, CPU, "--use-precision-aware-optimizer "
     "runs Transformer Engine's FusedAdam, which is not importable on a CPU: drop it"),
    (["--transformer-impl", "local", "--use-distributed-optimizer", "--use-precision-aware-optimizer"], 1, GPU_NO_TE,
     "FusedAdam, which is not importable here: pip install -e '.[te]'"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tp-comm-overlap"], 2, CPU,
     "--tp-comm-overlap runs Transformer Engine's userbuffers, which is not importable on a CPU: drop it"),
    (["--cuda-graph-impl", "local"], 1, CPU, "--cuda-graph-impl local captures the step's CUDA kernels"),
    (["--enable-cuda-graph"], 1, CPU, "--cuda-graph-impl local captures the step's CUDA kernels"),
    (["--transformer-impl", "local", "--cuda-graph-impl", "transformer_engine"], 1, GPU_NO_TE, "--cuda-graph-impl transformer_engine captures with "
     "Transformer Engine's make_graphed_callables, and Transformer Engine is not importable here"),
    (["--spec", "stock-local", "--context-parallel-size", "2"], 2, CPU, "the stock local spec's attention"),
    (["--spec", "stock", "--context-parallel-size", "2"], 2, CPU, "the stock local spec's attention"),
    (["--normalization", "LayerNorm"], 1, CPU, "--spec litespark computes a Llama layer"),
    pytest.param(["--spec", "stock-local"], 1, GPU_TE, "megatron-core's local layer without Apex uses torch's "
                 "LayerNorm, which has no persistent kernel: add --no-persist-layer-norm",
                 marks=pytest.mark.skipif(_have_apex(), reason="with Apex the stock local layer persists its norm")),
    (["--save", "ckpt"], 1, CPU, "--save needs --save-interval N"),
    (["--save", "ckpt", "--save-interval", "5", "--keep-last-checkpoints", "0"], 1, CPU,
     "--keep-last-checkpoints 0: keep at least 1 checkpoint"),
    (["--keep-last-checkpoints", "2"], 1, CPU, "--keep-last-checkpoints needs --save"),
    (["--hang-timeout-factor", "1"], 1, CPU, "--hang-timeout-factor 1: a step is hung when it takes F times"),
    (["--max-skipped-steps", "0"], 1, CPU, "--max-skipped-steps 0: give the skipped steps in a row"),
    (["--loss-spike-factor", "1"], 1, CPU, "--loss-spike-factor 1: a spike is a loss F times the recent median"),
    (["--hang-timeout-factor", "10", "--hang-timeout-min-seconds", "0"], 1, CPU,
     "--hang-timeout-min-seconds 0: give seconds > 0"),
    (["--exit-duration-in-mins", "-1"], 1, CPU, "--exit-duration-in-mins -1: give the minutes of training"),
    (["--async-save"], 1, CPU, "--async-save needs --save"),
    (["--async-save", "--save", "ckpt", "--save-interval", "5"], 1, CPU,
     "--async-save needs --use-persistent-ckpt-worker"),
    pytest.param(["--async-save", "--use-persistent-ckpt-worker", "--save", "ckpt", "--save-interval", "5"], 1, CPU,
                 "--async-save with --async-strategy nvrx (Megatron-LM's default) needs nvidia-resiliency-ext",
                 marks=pytest.mark.skipif(importlib.util.find_spec("nvidia_resiliency_ext") is not None,
                                          reason="nvidia-resiliency-ext is installed here")),
    (["--overlap-moe-expert-parallel-comm"], 1, GPU_TE, "--overlap-moe-expert-parallel-comm runs megatron-core's "
     "combined 1F1B schedule, which asks the forward step for the model's schedule plan, and litespark-train's "
     "forward step builds none: drop the flag"),
    (["--profile", "--profile-step-start", "1"], 1, CPU, "--profile without --use-pytorch-profiler starts CUDA's "
     "profiler (for nsys) at "
     "--profile-step-start, and there is no GPU here: add --use-pytorch-profiler (torch.profiler) or drop --profile"),
    (["--profile", "--use-pytorch-profiler"], 1, GPU_TE, "--profile --use-pytorch-profiler writes its trace to "
     "torch_profile/ beside --tensorboard-dir: give --tensorboard-dir"),
    (["--log-memory-to-tensorboard", "--tensorboard-dir", "tb"], 1, CPU, "--log-memory-to-tensorboard logs CUDA's "
     "memory statistics, and there is no GPU here: drop it"),
    (["--log-energy"], 1, CPU, "--log-energy reads the GPUs' energy counters through NVML, and there is no GPU "
     "here: drop it"),
    (["--wandb-project", "p"], 1, CPU, "--wandb-project: megatron.training logs to W&B only what it writes to "
     "TensorBoard, so without --tensorboard-dir nothing would be logged: add --tensorboard-dir"),
    (["--wandb-project", "p", "--tensorboard-dir", "tb"], 1, CPU, "--wandb-project keeps W&B's files in --save's "
     "wandb/ unless --wandb-save-dir is given: give one of them"),
    pytest.param(["--wandb-project", "p", "--tensorboard-dir", "tb", "--wandb-save-dir", "w"], 1, CPU,
                 "--wandb-project logs to Weights & Biases, and the wandb package is not installed: pip install wandb",
                 marks=pytest.mark.skipif(importlib.util.find_spec("wandb") is not None,
                                          reason="wandb is installed here")),
    (["--sample-prompt", "def "], 1, CPU, "--sample-prompt needs a text tokenizer"),
    (["--sample-prompt", "def ", "--pipeline-model-parallel-size", "2"], 2, CPU,
     "--sample-prompt runs without pipeline, context or sequence parallelism"),
])
def test_bad_configuration_is_refused(argv, world, plat, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    with pytest.raises(ConfigError) as e:
        check(TINY + argv, plat)
    assert message in str(e.value)


@pytest.mark.parametrize("freq, shown", [("[1,0]", "[1, 0]"), ("[1,2,0,1]", "[1, 2, 0, 1]"), ("0", "0")],
                         ids=["short-list", "not-0-1", "zero"])
def test_a_moe_layer_freq_megatron_cannot_read_is_refused(freq, shown):
    """megatron-core reads --moe-layer-freq as every N-th layer MoE, or one 0/1 per layer; anything else crashed the
    FLOP count at the start of training (a ValueError traceback, exit 1)."""
    moe = TINY + ["--num-experts", "4", "--moe-router-topk", "2"]
    with pytest.raises(ConfigError) as e:
        check(moe + ["--moe-layer-freq", freq])
    assert str(e.value) == (f"--moe-layer-freq {shown}: give N >= 1 (every N-th layer MoE) or a list of 0/1, one per "
                            "layer (4)")
    check(moe + ["--moe-layer-freq", "2"])
    check(moe + ["--moe-layer-freq", "([1]+[0])*2"])


def test_a_padded_vocabulary_tp_cannot_split_is_refused(monkeypatch):
    """--padded-vocab-size is the output layer's rows as given (Megatron-LM pads no further): TP splits them evenly,
    and megatron-core asserted it mid-setup ("385 is not divisible by 2")."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    tp2 = TINY + ["--vocab-size", "256", "--tensor-model-parallel-size", "2", "--padded-vocab-size"]
    with pytest.raises(ConfigError) as e:
        check(tp2 + ["385"])
    assert str(e.value) == ("--padded-vocab-size 385 is not divisible by --tensor-model-parallel-size 2: every TP "
                            "rank holds an equal slice of the output layer; give a multiple of 2, or a TP that "
                            "divides 385")
    check(tp2 + ["386"])


def test_no_pad_vocab_size_needs_the_models_size():
    """--no-pad-vocab-size only stops Megatron-LM from padding a --padded-vocab-size it is given; without one the
    run had no vocabulary size and megatron.training's FLOP count crashed on None (a TypeError traceback)."""
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--no-pad-vocab-size"])
    assert str(e.value) == ("--no-pad-vocab-size needs --padded-vocab-size N, the model's vocabulary rows, which "
                            "Megatron-LM then builds unpadded (without N it has no vocabulary size for the model): "
                            "give N, or drop the flag")
    check(TINY + ["--no-pad-vocab-size", "--padded-vocab-size", "4100"])


def test_model_vocab_size_is_a_given_padded_size(tmp_path):
    """What megatron.training builds: the tokenizer's vocabulary padded for TP, unless --padded-vocab-size gives the
    rows (as an imported model's model.yaml does, with --no-pad-vocab-size, for more rows than tokens)."""
    assert arguments.model_vocab_size(check(TINY + ["--vocab-size", "300"])) == 384
    cfg = tmp_path / "model.yaml"
    cfg.write_text("padded-vocab-size: 320\nno-pad-vocab-size: true\n")
    assert arguments.model_vocab_size(check(TINY + ["--vocab-size", "300", "--config", str(cfg)])) == 320
    assert arguments.model_vocab_size(check(TINY + ["--vocab-size", "300", "--padded-vocab-size", "320"])) == 320


def test_profiling_on_a_cpu_is_torch_profilers():
    """What the --profile refusal on a CPU points to passes: torch.profiler, its trace in torch_profile/ beside
    --tensorboard-dir."""
    check(TINY + ["--profile", "--use-pytorch-profiler", "--tensorboard-dir", "tb"], CPU)


@pytest.mark.parametrize("flags", [["--profile-step-start", "2"], ["--profile-step-start", "1", "--exit-interval", "1"]],
                         ids=["after-the-last-step", "after-the-exit-interval"])
def test_cudas_profiler_a_run_never_starts_is_not_refused_on_a_cpu(flags):
    """Megatron-LM's Llama-3 8B example passes --profile from step 4; a CPU run of it that ends sooner (TINY: 2 steps)
    never starts CUDA's profiler, and runs as the example asks."""
    check(TINY + ["--profile", *flags], CPU)


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--mock-data"], "--micro-batch-size is not set"),
    (["--model", "tiny", "--mock-data", "--micro-batch-size", "2"], "--lr is not set"),
    (["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--lr", "1e-3"], "--train-iters is not set"),
    (["--model", "tiny", "--mock-data", "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "2"],
     "--eval-interval is not set"),
    (["--model", "tiny", "--lr", "1e-3", *RUN], "no data: give --data-path"),
    (["--num-layers", "2", "--hidden-size", "64", "--mock-data", "--lr", "1"], "--num-attention-heads is not set"),
    (["--model", "tiny", "--lr", "1e-3", "--data-path", "x", *RUN], "no --tokenizer-type"),
])
def test_missing_settings_are_named(argv, message):
    with pytest.raises(ConfigError) as e:
        check(argv)
    assert message in str(e.value)


def test_megatron_lm_asserts_become_one_line():
    args = resolve(TINY + ["--save", "ckpt"])
    with pytest.raises(ConfigError) as e:
        arguments.megatron_validate(args)  # Megatron-LM asserts a --save-interval, without a message
    assert str(e.value).startswith("Megatron-LM refuses these arguments: assert args.save_interval is not None")


def test_litespark_flags_are_in_the_help():
    text = arguments.full_parser().format_help()
    for flag in ("--model", "--config", "--embedded-corpus", "--metrics-file", "--peak-tflops", "--sample-prompt"):
        assert flag in text
    assert isinstance(arguments.full_parser(), argparse.ArgumentParser)


NSA_GPU = ["--model", "eff-0.5b", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "2",
           "--eval-interval", "10", "--attention-variant", "nsa", "--transformer-impl", "transformer_engine"]


def test_fp8_attention_reaches_the_config_and_is_refused_where_it_would_do_nothing():
    """--fp8-attention sets megatron-core's fp8_dot_product_attention (which Megatron-LM has no flag for) on the
    stock TE layer in FP8; without FP8, on the Litespark layer (torch SDPA) or with a recipe megatron-core gives no
    FP8 attention to, one line says why (checked with a GPU platform value)."""
    from megatron.training.argument_utils import core_transformer_config_from_args

    stock_fp8 = TINY + ["--spec", "stock-te", "--fp8-format", "hybrid", "--fp8-attention"]
    check(stock_fp8, GPU_TE)
    # megatron.training's own derivation of the layer config (which copies args by field name); without TE here
    # its fused RoPE cannot be asked for
    args = resolve(stock_fp8 + ["--no-rope-fusion"], GPU_TE)
    arguments.check_run(args, GPU_TE, 1)
    assert core_transformer_config_from_args(args).fp8_dot_product_attention is True
    args = resolve(TINY + ["--spec", "stock-te", "--fp8-format", "hybrid", "--no-rope-fusion"], GPU_TE)
    arguments.check_run(args, GPU_TE, 1)
    assert core_transformer_config_from_args(args).fp8_dot_product_attention is False
    for argv, message in [
        (TINY + ["--spec", "stock-te", "--fp8-attention"], "--fp8-attention needs --fp8-format (attention joins the "
                                                          "FP8 recipe of the GEMMs): add --fp8-format hybrid"),
        (TINY + ["--transformer-impl", "transformer_engine", "--fp8-format", "hybrid", "--fp8-attention"],
         "--fp8-attention needs Transformer Engine's DotProductAttention: --spec stock-te, or --spec litespark "
         "--core-attention te; --spec litespark's core attention here has no FP8 path, so the flag would change "
         "nothing"),
        (stock_fp8 + ["--fp8-recipe", "blockwise"], "--fp8-attention with --fp8-recipe blockwise: megatron-core "
                                                    "gives FP8 attention to the delayed, tensorwise and mxfp8 "
                                                    "recipes only; use one of them"),
    ]:
        with pytest.raises(ConfigError) as e:
            check(argv, GPU_TE)
        assert str(e.value) == message


def test_core_attention_te_builds_tes_attention_into_the_litespark_layer(monkeypatch):
    """--core-attention te: the Litespark layer of the built model config has Transformer Engine's
    DotProductAttention as its core attention (with FP8 attention when asked), the default keeps torch SDPA; where
    it cannot apply, one line says why (checked with GPU and CPU platform values)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer import transformer_block, transformer_layer
    from megatron.training.argument_utils import core_transformer_config_from_args

    from litespark_megatron.layers import LitesparkCoreAttention
    from litespark_megatron.model import model_config_from_args

    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: 2)  # no PP
    monkeypatch.setattr(transformer_layer, "get_transformer_layer_offset", lambda config, vp_stage=None: 0)

    def core_attention(argv):
        args = resolve(argv + ["--no-rope-fusion"], GPU_TE)  # no TE here: its fused RoPE cannot be asked for
        arguments.check_run(args, GPU_TE, 1)
        config = model_config_from_args(args)
        blocks = config.transformer_layer_spec(config)
        return args, blocks.layer_specs[0].submodules.self_attention.submodules.core_attention

    te = TINY + ["--transformer-impl", "transformer_engine", "--core-attention", "te"]
    assert core_attention(te)[1] is TEDotProductAttention
    assert core_attention(TINY + ["--transformer-impl", "transformer_engine"])[1] is LitesparkCoreAttention
    args, attention = core_attention(te + ["--fp8-format", "hybrid", "--fp8-attention"])
    assert attention is TEDotProductAttention
    assert core_transformer_config_from_args(args).fp8_dot_product_attention is True
    for argv, plat, message in [
        (TINY + ["--spec", "stock-te", "--core-attention", "te"], GPU_TE,
         "--core-attention chooses the Litespark layer's attention kernel; --spec stock-te runs its own: drop the "
         "flag or use --spec litespark"),
        (NSA_GPU + ["--core-attention", "te"], GPU_TE,
         "--core-attention te with --attention-variant nsa: native sparse attention has kernels of its own; drop one "
         "of them"),
        (TINY + ["--transformer-impl", "local", "--core-attention", "te"], GPU_TE,
         "--core-attention te is Transformer Engine's DotProductAttention: it needs --transformer-impl "
         "transformer_engine"),
        (TINY + ["--transformer-impl", "local", "--core-attention", "te"], CPU,
         "--core-attention te is Transformer Engine's DotProductAttention: it needs --transformer-impl "
         "transformer_engine, and Transformer Engine, not importable here"),
    ]:
        with pytest.raises(ConfigError) as e:
            check(argv, plat)
        assert str(e.value) == message


def test_core_attention_auto_takes_tes_ring_attention_under_context_parallelism(monkeypatch):
    """The default --core-attention auto: the Litespark layer's dense attention on the te backend under context
    parallelism is Transformer Engine's DotProductAttention (its ring attention measured faster than the
    all-gather); one GPU, the local backend, MLA, stock's own layer and an explicit --core-attention sdpa keep
    their attention. The model config built from the arguments carries the choice (checked with GPU platform
    values: no TE here)."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    from megatron.core.transformer import transformer_block, transformer_layer

    from litespark_megatron.layers import LitesparkCoreAttention
    from litespark_megatron.model import model_config_from_args

    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: 2)  # no PP
    monkeypatch.setattr(transformer_layer, "get_transformer_layer_offset", lambda config, vp_stage=None: 0)
    te, cp2 = ["--transformer-impl", "transformer_engine"], ["--context-parallel-size", "2"]

    def checked(argv, world=2):
        args = resolve(TINY + argv + ["--no-rope-fusion"], GPU_TE)  # no TE here: its fused RoPE cannot be asked for
        arguments.check_run(args, GPU_TE, world)
        return args

    def chosen(argv, world=2):
        return checked(argv, world).core_attention

    def built(args):
        config = model_config_from_args(args)
        return config.transformer_layer_spec(config).layer_specs[0].submodules.self_attention.submodules.core_attention

    assert resolve(TINY).core_attention == "sdpa"  # resolved as the arguments are read: "auto" never reaches a model
    assert chosen(te + cp2) == "te"
    assert built(checked(te + cp2)) is TEDotProductAttention
    assert built(checked(te, world=1)) is LitesparkCoreAttention
    assert chosen(te, world=1) == "sdpa"
    assert chosen(te + cp2 + ["--core-attention", "sdpa"]) == "sdpa"
    assert chosen(["--transformer-impl", "local"] + cp2) == "sdpa"
    assert chosen(te + cp2 + ["--spec", "stock-te"]) == "sdpa"  # stock's own attention; nothing refused
    mla = ["--multi-latent-attention", "--kv-lora-rank", "32", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16",
           "--v-head-dim", "32"]
    assert chosen(te + cp2 + mla) == "sdpa"


def test_checkpoint_args_decide_the_automatic_core_attention_again():
    """--use-checkpoint-args can replace the spec (Megatron-LM takes the checkpoint's): the spec's name and an
    automatic core attention follow it, an explicit one stays (what the loader leaves is set by hand here; the
    end-to-end run is in test_checkpoints)."""
    te_cp2 = TINY + ["--transformer-impl", "transformer_engine", "--no-rope-fusion", "--context-parallel-size", "2"]
    args = resolve(te_cp2 + ["--spec", "stock-te"], GPU_TE)
    assert (args.litespark_spec, args.core_attention) == ("stock-te", "sdpa")
    args.spec = list(arguments.LITESPARK_SPEC)  # a Litespark checkpoint's --spec
    arguments.follow_checkpoint_args(args)
    assert (args.litespark_spec, args.core_attention) == ("litespark", "te")
    args = resolve(te_cp2 + ["--spec", "stock-te", "--core-attention", "sdpa"], GPU_TE)
    args.spec = list(arguments.LITESPARK_SPEC)
    arguments.follow_checkpoint_args(args)
    assert (args.litespark_spec, args.core_attention) == ("litespark", "sdpa")


def test_a_checkpoint_without_tes_core_attention_state_is_loadable_where_the_run_has_it():
    """A checkpoint of the Litespark layer's SDPA attention has no `_extra_state` of TE's core attention; a run that
    has TE's (stock's layer, or --core-attention te: the default under CP) lists it as state it may start fresh."""
    key = "decoder.layers.self_attention.core_attention._extra_state"
    te = ["--transformer-impl", "transformer_engine", "--no-rope-fusion"]
    assert key not in arguments._te_only_state(resolve(TINY + te, GPU_TE))
    assert key in arguments._te_only_state(resolve(TINY + te + ["--context-parallel-size", "2"], GPU_TE))
    assert key in arguments._te_only_state(resolve(TINY + te + ["--core-attention", "te"], GPU_TE))
    assert key in arguments._te_only_state(resolve(TINY + ["--spec", "stock-te", "--no-rope-fusion"], GPU_TE))


def test_nsa_on_a_gpu_needs_fla_core_and_a_shape_its_kernels_run(monkeypatch):
    """Checked with a GPU platform value: without fla-core the run is refused with the install command; with it,
    eff-0.5b's 4 query heads per KV head are refused (fla-core's kernels need 16, a power of 2) with the flag that
    fixes it, which then passes; a block smaller than twice the selected blocks is refused."""
    from litespark_megatron.layers import nsa

    with pytest.raises(ConfigError, match=r"runs fla-core's kernels, which are not importable here: pip install -e "
                                          r"'\.\[nsa\]'"):
        check(NSA_GPU, GPU_TE)
    monkeypatch.setattr(nsa, "fla_available", lambda: True)
    with pytest.raises(ConfigError, match=r"16 query heads over 4 KV heads is 4 per KV head; fla-core's kernels need "
                                          r"a power of 2 >= 16 \(e\.g\. --num-query-groups 1\)"):
        check(NSA_GPU, GPU_TE)
    check(NSA_GPU + ["--num-query-groups", "1"], GPU_TE)
    with pytest.raises(ConfigError, match="--nsa-block-size 16 < 2 x --nsa-selected-blocks 16"):
        check(NSA_GPU + ["--num-query-groups", "1", "--nsa-block-size", "16"], GPU_TE)


def test_fp8_parameters_with_the_precision_aware_optimizer_are_refused_under_delayed_scaling():
    """--fp8-param-gather puts the weights in FP8, which Transformer Engine's FP8 Adam kernel updates under delayed
    scaling; it asserts fp32 master weights and moments, and the precision-aware optimizer hands it 16-bit master
    remainders (and bf16 moments if asked): both failed at the first step on an H100 (TE 2.20.2). Refused before
    training; each flag alone, and the other FP8 recipes (not measured), pass."""
    fp8 = TINY + ["--spec", "stock-te", "--fp8-format", "hybrid", "--use-distributed-optimizer"]
    pao = ["--use-precision-aware-optimizer", "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    check(fp8 + ["--fp8-param-gather"], GPU_TE)
    check(fp8 + pao, GPU_TE)
    check(fp8 + pao + ["--fp8-param-gather", "--fp8-recipe", "tensorwise"], GPU_TE)
    for moments in (pao, pao[:1]):  # bf16 moments, and fp32 ones: the master remainders fail alike
        with pytest.raises(ConfigError) as e:
            check(fp8 + moments + ["--fp8-param-gather"], GPU_TE)
        assert str(e.value) == ("--fp8-param-gather with --use-precision-aware-optimizer under delayed scaling: "
                                "Transformer Engine's Adam for FP8 parameters needs fp32 master weights and moments, "
                                "and megatron-core keeps the master weights as 16-bit remainders, so the first step "
                                "would fail; use one of the two flags")


def _save_tiny(tmp_path_factory, *flags):
    from conftest import made_once, ok, train

    def build(directory):
        ok(train(1, *TINY[:-4], "--vocab-size", "256", "--seq-length", "32", "--global-batch-size", "8",
                 "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "4", "--eval-interval", "100",
                 "--eval-iters", "0", "--save", directory / "ckpt", "--save-interval", "100", *flags))
        return directory / "ckpt"
    return made_once(tmp_path_factory, "tiny-checkpoint" + "".join(flags), build)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint of the tiny model (vocabulary 256, 4 steps of 8 sequences), saved by litespark-train."""
    return _save_tiny(tmp_path_factory)


@pytest.fixture(scope="module")
def tiny_1p_checkpoint(tmp_path_factory):
    """The same with zero-centered norm weights (--apply-layernorm-1p: the norms scale by 1 + weight)."""
    return _save_tiny(tmp_path_factory, "--apply-layernorm-1p")


RESUME = TINY[:-4] + ["--vocab-size", "256", "--seq-length", "32", "--global-batch-size", "8", "--lr", "3e-3",
                      "--lr-warmup-iters", "2", "--train-iters", "4", "--eval-interval", "100"]


@pytest.mark.parametrize("flags, differences", [
    (["--hidden-size", "64"], "--hidden-size 128 there, 64 here"),
    (["--num-layers", "2", "--num-query-groups", "4"], "--num-layers 4 there, 2 here; --num-query-groups 2 there, "
                                                       "4 here"),
    (["--kv-channels", "16"], "--kv-channels 32 there, 16 here"),
    (["--position-embedding-type", "none", "--qk-layernorm"], "--qk-layernorm not set there, set here; "
                                                               "--position-embedding-type rope there, none here"),
    (["--vocab-size", "200"], "--vocab-size 256 there, 200 here"),
    (["--vocab-size", "200", "--finetune"], "--vocab-size 256 there, 200 here"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p not set there, set here"),
], ids=["hidden", "layers-groups", "kv-channels", "switches", "vocab", "finetune", "layernorm-1p"])
def test_a_checkpoint_of_another_model_is_refused_before_any_process_group(tiny_checkpoint, flags, differences):
    """megatron.training stores the run's arguments in the checkpoint's common state; a --load of another shape
    failed after the process groups were up (a 67-line CheckpointingException, --save already created). The model
    flags of the checkpoint are compared with the run's before anything starts, every difference named with both
    values; --finetune loads the same weights, so the shapes must match there too."""
    with pytest.raises(ConfigError) as e:
        arguments.parse_checked(RESUME + flags + ["--load", str(tiny_checkpoint)], CPU)
    assert str(e.value) == (f"--load {tiny_checkpoint}: the checkpoint holds another model than these flags build "
                            f"({differences}); give the model flags of the run that saved it, or "
                            "--use-checkpoint-args to take them from the checkpoint")


def test_the_checkpoints_own_model_loads_and_checkpoint_args_are_compared_too(tiny_checkpoint):
    """The same model passes (resumed, fine-tuned, or with TP: its vocabulary padding differs, the vocabulary
    does not); --use-checkpoint-args takes the shape from the checkpoint, so the shape flags can be left out, but
    one given on the command line wins over the checkpoint's in Megatron-LM and is refused where it differs."""
    load = ["--load", str(tiny_checkpoint)]
    arguments.parse_checked(RESUME + load, CPU)
    arguments.parse_checked(RESUME + load + ["--finetune", "--train-iters", "8"], CPU)
    arguments.parse_checked(RESUME + load + ["--make-vocab-size-divisible-by", "96"], CPU)
    bare = ["--mock-data", "--lr", "3e-3", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
            "4", "--lr-warmup-iters", "2", "--eval-interval", "100", "--vocab-size", "256", "--use-checkpoint-args"]
    args = arguments.parse_checked(bare + load, CPU)
    assert (args.num_layers, args.hidden_size, args.num_query_groups) == (4, 128, 2)
    with pytest.raises(ConfigError) as e:
        arguments.parse_checked(bare + load + ["--num-layers", "2"], CPU)
    assert str(e.value) == (f"--load {tiny_checkpoint}: the checkpoint holds another model than these flags build "
                            "(--num-layers 4 there, 2 here); give the model flags of the run that saved it")


def test_a_checkpoint_of_zero_centered_norms_is_refused_without_the_flag(tiny_1p_checkpoint):
    """megatron-core 0.19.2 keeps --apply-layernorm-1p as layernorm_zero_centered_gamma, and the comparison read
    the name of earlier Megatron-LM versions (still read from a checkpoint that has it): norms of the other
    convention (weights near 0 read as scales) loaded without a word."""
    with pytest.raises(ConfigError) as e:
        arguments.parse_checked(RESUME + ["--load", str(tiny_1p_checkpoint)], CPU)
    assert str(e.value) == (f"--load {tiny_1p_checkpoint}: the checkpoint holds another model than these flags build "
                            "(--apply-layernorm-1p set there, not set here); give the model flags of the run that "
                            "saved it, or --use-checkpoint-args to take them from the checkpoint")
    earlier = argparse.Namespace(apply_layernorm_1p=True)
    assert arguments._model_arguments(earlier)["layernorm_zero_centered_gamma"] is True


def test_checkpoint_args_take_zero_centered_norms(tiny_1p_checkpoint):
    """megatron.training's --use-checkpoint-args reads the name of earlier Megatron-LM versions too
    (apply_layernorm_1p): a run that took its model from a checkpoint of zero-centered norms built norms of the
    other convention. It takes the checkpoint's, into the model's config."""
    from megatron.training.arguments import core_transformer_config_from_args

    bare = ["--mock-data", "--lr", "3e-3", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters",
            "4", "--lr-warmup-iters", "2", "--eval-interval", "100", "--vocab-size", "256", "--use-checkpoint-args"]
    args = arguments.parse_checked(bare + ["--load", str(tiny_1p_checkpoint)], CPU)
    assert args.layernorm_zero_centered_gamma is True
    assert core_transformer_config_from_args(args).layernorm_zero_centered_gamma is True


SCHEDULE_FLAGS = ("add --override-opt_param-scheduler to follow this run's schedule from the checkpoint's step on, "
                  "or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")


@pytest.mark.parametrize("flags, differences", [
    (["--train-iters", "8"], "LR decay over 32 samples there, 64 here; weight-decay increment over 32 samples "
                             "there, 64 here"),
    (["--lr", "1e-3", "--lr-decay-style", "cosine"], "--lr 0.003 there, 0.001 here; --lr-decay-style linear there, "
                                                     "cosine here"),
], ids=["train-iters", "lr"])
def test_a_resume_with_another_learning_rate_schedule_names_megatron_lms_two_flags(tiny_checkpoint, flags,
                                                                                   differences):
    """megatron-core's OptimizerParamScheduler asserts that a resumed run's schedule is the checkpoint's unless told
    which one to follow: a traceback after the process groups were up. The run's schedule (megatron.training's own
    builder) is compared with the checkpoint's before anything starts."""
    with pytest.raises(ConfigError) as e:
        arguments.parse_checked(RESUME + flags + ["--load", str(tiny_checkpoint)], CPU)
    assert str(e.value) == (f"--load {tiny_checkpoint}: its learning-rate schedule is not this run's ({differences}), "
                            f"and megatron-core refuses to resume it so: {SCHEDULE_FLAGS}")
    longer = RESUME + flags + ["--load", str(tiny_checkpoint)]
    for chosen in (["--override-opt_param-scheduler"], ["--use-checkpoint-opt_param-scheduler"], ["--finetune"],
                   ["--no-load-optim"]):  # told which to follow; or the checkpoint's schedule is not loaded
        arguments.parse_checked(longer + chosen, CPU)


def test_a_schedule_megatron_core_cannot_build_is_one_line():
    """A warmup as long as the decay is megatron-core's bare assert in OptimizerParamScheduler, after the process
    groups were up."""
    with pytest.raises(ConfigError) as e:
        arguments.parse_checked(TINY + ["--lr-warmup-iters", "2"], CPU)
    assert str(e.value) == ("Megatron-LM refuses this learning-rate schedule: assert self.lr_warmup_steps < "
                            "self.lr_decay_steps (optimizer_param_scheduler.py)")


def test_tp_and_cp_are_checked_with_the_one_work_queue_the_launchers_give_them(monkeypatch):
    """Megatron-LM asserts CUDA_DEVICE_MAX_CONNECTIONS=1 under TP or CP before Blackwell; scripts/pretrain.sh and
    tools/layout_sweep.py set it for the run after checking the layout, and litespark-plan's commands carry it. A
    check of a run not started yet (check_run: the launchers' and the plan's) is made with that value, so a Hopper
    node without it exported does not refuse every TP and CP layout (each was refused on a four-H200 machine); a
    value the user set is Megatron-LM's to judge, and this process's environment is left as it was."""
    from megatron.training import arguments as megatron_arguments

    from litespark_megatron.platform import apply_cpu_shims

    apply_cpu_shims()  # (which default the variable on a CPU: dropped below, as on a GPU node)
    monkeypatch.setattr(megatron_arguments, "get_device_arch_version", lambda: 9)  # Hopper
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    for layout in (["--tensor-model-parallel-size", "2"], ["--context-parallel-size", "2"]):
        arguments.check_run(resolve(TINY + layout), CPU, 2)
        assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with pytest.raises(ConfigError, match="Megatron-LM refuses these arguments: Using tensor model parallelism or "
                                          "context parallelism require setting the environment variable "
                                          "CUDA_DEVICE_MAX_CONNECTIONS to 1"):
        arguments.check_run(resolve(TINY + ["--tensor-model-parallel-size", "2"]), CPU, 2)
    assert arguments.launch_environment(2, 1, True, {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}) == {}  # the user's
    assert arguments.launch_environment(1, 2, True, {}) == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    assert arguments.launch_environment(1, 1, True, {}) == {}
    assert arguments.launch_environment(2, 1, False, {}) == {}  # Blackwell orders them itself
