"""litespark-train's command line: Megatron-LM's own arguments with Megatron-LM's defaults, plus Litespark's few.

A run's argv is expanded into Megatron-LM flags before megatron.training parses it, in this order (later wins):

    --spec litespark               the product's layer (Megatron-LM's --spec; a name here, see specs.py)
    platform flags                 on a CPU only: what it cannot do (gloo, local modules, no CUDA fusions)
    --model PRESET                 a preset is data: the Megatron-LM flags of a Llama shape
    --config FILE.yaml             keys are flag names, values typed exactly as on the command line
    --embedded-corpus stdlib       the prepared corpus as --data-path and tokenizer flags
    --embedded-sft stdlib          the prepared SFT set as --sft-data, --sft-valid-data and tokenizer flags
    the command line itself

so a preset or a file is nothing but flags, and the command line overrides them. Litespark's own flags
(`add_litespark_args`, megatron.training's extra_args_provider) are few; every other flag, default and check is
Megatron-LM's. `check()` adds the checks Megatron-LM makes with bare asserts or not at all, one clear line each,
before any work.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import traceback
from typing import Dict, List, Optional, Sequence

from .data import megatron_tokenizer as _megatron_tokenizer
from .errors import PROG, ConfigError, UserError  # noqa: F401  (UserError: callers of the parser take it from here)
from .platform.library_gaps import escape_bare_percent_in_help, read_config_docstrings_once
from .presets import PRESETS, preset
from .spec_choice import LITESPARK_SPEC, SpecChoice  # noqa: F401  (LITESPARK_SPEC: callers take it from here)

DEFAULT_FLAGS = {"spec": "litespark"}
# On a CPU-only torch: what megatron.training's defaults assume of a GPU, switched off.
CPU_FLAGS = {"distributed-backend": "gloo", "transformer-impl": "local", "no-gradient-accumulation-fusion": True,
             "no-rope-fusion": True, "no-persist-layer-norm": True, "no-masked-softmax-fusion": True,
             "no-bias-dropout-fusion": True, "no-bias-swiglu-fusion": True}
EMBEDDED_CORPORA = ("stdlib",)
EMBEDDED_SFT_SETS = ("stdlib",)  # stdlib_sft.EMBEDDED_SFT_SETS, without importing the corpus code to parse a flag


# --------------------------------------------------------------------------------------------- the parser
def add_litespark_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """megatron.training's extra_args_provider: Litespark's own flags. It also makes a bad flag one line on stderr
    (argparse's usage block would list Megatron-LM's ~900 flags before the message)."""
    g = parser.add_argument_group("litespark")
    g.add_argument("--model", default=None, choices=list(PRESETS),
                   help="a preset, the Megatron-LM flags of a Llama shape (" +
                        "; ".join(f"{k}: {p.description}" for k, p in PRESETS.items()) + "); flags win over it")
    g.add_argument("--config", default=None, metavar="FILE.yaml",
                   help="a YAML mapping of flag names (dashes or underscores) to values, read as flags before the "
                        "command line (which wins): true gives a switch, false leaves it out")
    g.add_argument("--embedded-corpus", default=None, choices=EMBEDDED_CORPORA,
                   help="train on a corpus every machine has offline: 'stdlib', the Python standard library's "
                        "source with a byte-level BPE trained on it (prepared once, cached under $LITESPARK_CACHE); "
                        "it sets --data-path and the tokenizer")
    g.add_argument("--embedded-sft", default=None, choices=EMBEDDED_SFT_SETS,
                   help="fine-tune on a set every machine has offline: 'stdlib', the Python standard library's "
                        "functions, the signature and docstring as the prompt and the body as the response, held-out "
                        "files for validation (built once, cached under $LITESPARK_CACHE); it sets --sft-data, "
                        "--sft-valid-data and the embedded corpus's tokenizer")
    g.add_argument("--sft-data", default=None, metavar="FILE.jsonl",
                   help="supervised fine-tuning: train on these JSONL rows, {\"prompt\": str, \"response\": str} or "
                        "{\"messages\": [{\"role\": str, \"content\": str}, ...]}, one right-padded example per "
                        "sequence, the loss on the response (the assistant turns) alone; the text tokenizer "
                        "(--tokenizer-model) formats them with its chat template where it has one (sft_data.py)")
    g.add_argument("--sft-valid-data", default=None, metavar="FILE.jsonl",
                   help="the validation rows of --sft-data, in its format (without it: no validation, --eval-iters 0)")
    g.add_argument("--metrics-file", default=None,
                   help="one JSON record per log interval, evaluation and run (default: metrics.jsonl in --save, "
                        "else beside --tensorboard-dir)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="dense TFLOP/s per GPU for MFU, instead of the GPU's datasheet peak")
    g.add_argument("--sample-prompt", default=None,
                   help="after training, print the model's greedy continuation of this prompt (a text tokenizer "
                        "and pipeline-parallel size 1 needed)")
    g.add_argument("--sample-tokens", type=int, default=64, help="tokens to generate for --sample-prompt")
    g.add_argument("--data-seed", type=int, default=None, metavar="N",
                   help="the seed of the data order (the datasets' shuffle); default: --seed. Runs that differ in "
                        "--seed alone then also differ in their data; the same --data-seed keeps it")
    g.add_argument("--core-attention", choices=("auto", "sdpa", "te"), default="auto",
                   help="the Litespark layer's attention kernel: 'sdpa', torch's scaled_dot_product_attention "
                        "(cuDNN or flash attention on a GPU; runs anywhere; its own all-gather context "
                        "parallelism), or 'te', Transformer Engine's DotProductAttention as the stock TE layer runs "
                        "it (cuDNN fused attention without permutes, FP8 with --fp8-attention, TE's context "
                        "parallelism; --transformer-impl transformer_engine). Default 'auto': te under context "
                        "parallelism on the te backend (TE's ring attention was 6-9%% faster than the all-gather), "
                        "sdpa otherwise")
    g.add_argument("--fp8-attention", dest="fp8_dot_product_attention", action="store_true",
                   help="attention in FP8 as well: Transformer Engine's FP8 dot-product attention (Hopper), with "
                        "--fp8-format, on --spec stock-te or --spec litespark --core-attention te (megatron-core's "
                        "config field fp8_dot_product_attention, which Megatron-LM sets from no flag)")
    g.add_argument("--chunked-output-loss", type=int, default=None, metavar="N",
                   help="compute the output layer and the loss in N chunks of the sequence, recomputing each chunk's "
                        "logits in the backward: the micro-batch's logits (fp32 in the fused loss) are never whole "
                        "in memory, for the output layer's GEMM and the loss's forward once more (output_loss.py; "
                        "what it saves and costs: docs/benchmarks/)")
    auto = (" Left out: on where it was measured to train as megatron-core's path does, and faster (a GPU with "
            "Triton, --spec litespark on the te backend, BF16 or FP8, pretraining without CP), off elsewhere; the "
            "run's health record names what ran")
    g.add_argument("--litespark-cross-entropy", action=argparse.BooleanOptionalAction, default=None,
                   help="compute the loss with Litespark's vocab-parallel cross-entropy (kernels/cross_entropy.py; "
                        "Triton on a GPU, its plain-torch reference elsewhere) instead of megatron-core's: no fp32 "
                        "copy of the logits, whose memory takes their gradient in the backward; with "
                        "--chunked-output-loss each chunk's loss runs it." + auto)
    g.add_argument("--litespark-rmsnorm", action=argparse.BooleanOptionalAction, default=None,
                   help="the Litespark layer's RMSNorms run Litespark's kernels (kernels/rms_norm.py; Triton on a GPU, "
                        "its plain-torch reference elsewhere), any hidden size at full bandwidth, instead of "
                        "Transformer Engine's norm inside its norm+GEMM module (te backend) or a compiled norm "
                        "(local backend); checkpoints keep their keys." + auto + " (in BF16 only: under FP8 TE's "
                        "norm writes the GEMM's FP8 input)")
    g.add_argument("--litespark-rope", action=argparse.BooleanOptionalAction, default=None,
                   help="the Litespark attention splits the QKV projection's output and applies RoPE with "
                        "Litespark's kernels (kernels/qkv_rope.py; Triton on a GPU, its plain-torch reference "
                        "elsewhere): one read and one write each way, instead of megatron-core's split, Transformer "
                        "Engine's RoPE kernels, the value's copy and the gradients' concatenation." + auto)
    g.add_argument("--litespark-rope-fp8-grad", action=argparse.BooleanOptionalAction, default=None,
                   help="with --litespark-rope under FP8 (delayed scaling, te backend): the RoPE kernel's backward "
                        "writes the QKV GEMM's FP8 output gradient, row- and column-major in one pass, instead of a "
                        "bf16 gradient that Transformer Engine reads again to cast (kernels/qkv_rope.py; layers kept "
                        "in BF16 take the bf16 one). Off unless given: correct, not faster than the bf16 gradient and "
                        "TE's cast yet (docs/benchmarks/)")
    g.add_argument("--litespark-swiglu", action=argparse.BooleanOptionalAction, default=None,
                   help="under FP8 (delayed scaling, te backend) the Litespark MLP's SwiGLU runs Litespark's kernels "
                        "(kernels/swiglu_fp8.py): it writes fc2's FP8 input, and in the backward fc1's FP8 output "
                        "gradient, row- and column-major in one pass, instead of a bf16 tensor that Transformer "
                        "Engine casts again (layers kept in BF16 run TE's SwiGLU)." + auto + " (under FP8 with "
                        "delayed scaling only)")
    g.add_argument("--litespark-fp8-output-layer", action=argparse.BooleanOptionalAction, default=None,
                   help="the output layer's GEMM and both of its backward GEMMs in FP8 (current scaling), the loss's "
                        "gradient written in FP8 straight from the logits (kernels/fp8_logits.py; Triton and FP8 "
                        "GEMMs on a GPU of compute capability 8.9 or more, its plain-torch reference elsewhere); "
                        "megatron-core keeps the output layer in BF16 under every FP8 recipe. It computes the loss "
                        "itself. Off unless given: FP8 logits change the model's numerics")
    g.add_argument("--litespark-adam", action=argparse.BooleanOptionalAction, default=None,
                   help="megatron-core's Adam (Transformer Engine's FusedAdam, its states and checkpoints unchanged) "
                        "steps with Litespark's kernel (kernels/adam.py): the same update, every tensor read and "
                        "written once in wide loads, one launch per kind of tensors, where TE's kernel loads two bytes "
                        "at a time; megatron-core's gradient-clipping coefficient is applied in the step instead of "
                        "a pass that scales every gradient in place. Off unless given (docs/benchmarks/)")
    g.add_argument("--attention-variant", choices=("dense", "nsa"), default="dense",
                   help="the Litespark layer's core attention: 'dense' causal attention, or 'nsa', native sparse "
                        "attention (compressed, selected and sliding-window branches mixed by learned gates; "
                        "fla-core's kernels on a GPU: pip install -e '.[nsa]')")
    g.add_argument("--nsa-block-size", type=int, default=64, metavar="N",
                   help="NSA: tokens per compressed and per selected block; must divide --seq-length (default 64)")
    g.add_argument("--nsa-selected-blocks", type=int, default=16, metavar="N",
                   help="NSA: blocks each query selects, its first, own and previous block included; a power of 2 "
                        ">= 4 (default 16)")
    g.add_argument("--nsa-window", type=int, default=512, metavar="N",
                   help="NSA: tokens of the sliding-window branch, the query's own included (default 512)")
    g.add_argument("--hang-timeout-factor", type=float, default=None, metavar="F",
                   help="stop the run (exit 1, with each thread's stack of the rank) when a training step takes F "
                        "times the median step and at least --hang-timeout-min-seconds; default: off (NCCL's "
                        "--distributed-timeout-minutes only)")
    g.add_argument("--hang-timeout-min-seconds", type=float, default=60.0, metavar="S",
                   help="the least time a step may take before --hang-timeout-factor calls it hung (default 60)")
    g.add_argument("--max-skipped-steps", type=int, default=None, metavar="N",
                   help="stop the run (exit 1) when N steps in a row are skipped for inf/NaN gradients (fp16 loss "
                        "scaling that cannot recover); default: off, as in Megatron-LM")
    g.add_argument("--loss-spike-factor", type=float, default=None, metavar="F",
                   help="a step whose loss is more than F times the median loss of the last 100 steps is a spike "
                        "(checked on every step, every rank agreeing); default: off (Megatron-LM's "
                        "--check-for-spiky-loss compares with the largest of the first 100 losses instead)")
    g.add_argument("--loss-spike-action", choices=("warn", "stop"), default="warn",
                   help="on a spike: 'warn' prints one line and trains on; 'stop' ends the run (exit 1) before "
                        "the spiked step is saved, so the last checkpoint predates it (default: warn)")
    g.add_argument("--keep-last-checkpoints", type=int, default=None, metavar="K",
                   help="keep the K newest complete checkpoints in --save and delete older ones once a newer save "
                        "is complete (the one the tracker names is never deleted); default: keep all")
    g.add_argument("--peft", choices=("lora", "dora", "freeze"), default=None,
                   help="parameter-efficient fine-tuning of --peft-base: 'lora' (LoRA adapters on the layer's "
                        "linears), 'dora' (weight-decomposed LoRA), 'freeze' (only the last --trainable-layers K "
                        "layers train); only those parameters get gradients and optimizer state")
    g.add_argument("--peft-base", default=None, metavar="CKPT",
                   help="the base model of --peft: a Megatron-LM checkpoint directory (litespark-convert import, or "
                        "a pretraining run's --save), read at every start; --load stays this run's own checkpoints")
    g.add_argument("--lora-rank", type=int, default=None, metavar="R", help="the adapters' rank (default 8)")
    g.add_argument("--lora-alpha", type=float, default=None, metavar="A",
                   help="the adapters' alpha: B A is scaled by alpha / rank (default: twice the rank)")
    g.add_argument("--lora-dropout", type=float, default=None, metavar="P",
                   help="dropout on the adapters' input (default 0)")
    g.add_argument("--lora-targets", nargs="+", default=None, metavar="LINEAR",
                   help="the linears that get adapters, of linear_qkv, linear_proj, linear_fc1, linear_fc2 (default: "
                        "all four; HF's q/k/v, o, gate/up and down projections)")
    g.add_argument("--lora-scaling", choices=("standard", "rs"), default=None,
                   help="'standard': B A scaled by alpha / rank; 'rs': rank-stabilized LoRA, alpha / sqrt(rank) "
                        "(HF peft's use_rslora) (default: standard)")
    g.add_argument("--lora-plus-ratio", type=float, default=None, metavar="F",
                   help="LoRA-plus: B's learning rate (and DoRA's magnitudes') is F times --lr (and --min-lr) "
                        "through the whole schedule")
    g.add_argument("--save-adapters-only", action="store_true",
                   help="--peft lora|dora: checkpoints hold the adapters and their optimizer state alone, not the "
                        "frozen base (read from --peft-base at every start, and by litespark-convert)")
    g.add_argument("--trainable-layers", type=int, default=None, metavar="K",
                   help="--peft freeze: the last K layers train; the embedding, the other layers, the final norm and "
                        "the output layer stay frozen")

    def error(message):
        print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)

    escape_bare_percent_in_help(parser)  # a gap of megatron-core's parser (platform.library_gaps)
    parser.prog = PROG
    parser.error = error
    return parser


@functools.lru_cache(maxsize=None)
def full_parser() -> argparse.ArgumentParser:
    """Megatron-LM's parser with Litespark's flags: what every flag is (switch or value), for presets and files."""
    from megatron.training.arguments import add_megatron_arguments

    read_config_docstrings_once()  # (platform.library_gaps)
    return add_litespark_args(add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)))


def _switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def as_flags(mapping: Dict[str, object], where: str) -> List[str]:
    """{flag name: value} -> argv tokens, each checked against what the flag is. A switch takes true (given) or
    false (left out); a flag with values takes a scalar or, if it takes several, a list."""
    parser = full_parser()
    tokens: List[str] = []
    for key, value in mapping.items():
        option = "--" + str(key).strip().lstrip("-").replace("_", "-")
        action = parser._option_string_actions.get(option) or \
            parser._option_string_actions.get(option.replace("-", "_").replace("__", "--", 1))
        if action is None or option == "--config":
            raise ConfigError(f"{where}: unknown flag '{key}' (the flags of {PROG} --help are its keys)")
        if _switch(action):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: '{key}' is a switch: write true or false, not {value!r}")
            if isinstance(action, argparse.BooleanOptionalAction):  # left out means "auto": false says off
                tokens += [option if value else "--no-" + option[2:]]
            else:
                tokens += [option] if value else []
            continue
        if value is None or isinstance(value, bool) or isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' takes a value ({action.metavar or action.dest}), not {value!r}")
        if isinstance(value, (list, tuple)):
            if action.nargs not in ("*", "+") and not (isinstance(action.nargs, int) and action.nargs > 1):
                raise ConfigError(f"{where}: '{key}' takes one value, not a list")
            tokens += [option, *map(str, value)]
        else:
            tokens += [option, str(value)]
    return tokens


def load_config_file(path: str) -> Dict[str, object]:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values, got a "
                          f"{type(data).__name__}")
    return data


def _pre_parse(argv: Sequence[str]):
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for name in ("--model", "--config", "--embedded-corpus", "--embedded-sft"):
        pre.add_argument(name)
    known, _ = pre.parse_known_args(list(argv))
    return known


def expand(argv: Sequence[str], cpu: bool) -> List[str]:
    """argv -> the full list of Megatron-LM flags (see the module docstring for the order)."""
    known = _pre_parse(argv)
    tokens = as_flags(DEFAULT_FLAGS, "defaults")
    if cpu:
        tokens += as_flags(CPU_FLAGS, "CPU platform")
    file_flags = load_config_file(known.config) if known.config else {}
    model = known.model or file_flags.get("model")
    if model is not None:
        flags = dict(preset(model).flags)
        if "--multi-latent-attention" in argv or file_flags.get("multi-latent-attention") or \
                file_flags.get("multi_latent_attention"):
            # MLA replaces the preset's attention: its grouped KV heads mean nothing there (and Megatron-LM
            # refuses the two together), while the switch could not be taken back on the command line.
            flags.pop("group-query-attention", None)
            flags.pop("num-query-groups", None)
        tokens += as_flags(flags, f"--model {model}")
    if file_flags:
        tokens += as_flags(file_flags, f"--config {known.config}")
    corpus = known.embedded_corpus or file_flags.get("embedded-corpus") or file_flags.get("embedded_corpus")
    if corpus is not None:
        tokens += as_flags(embedded_corpus_flags(corpus), f"--embedded-corpus {corpus}")
    sft = known.embedded_sft or file_flags.get("embedded-sft") or file_flags.get("embedded_sft")
    if sft is not None:
        tokens += as_flags(embedded_sft_flags(sft), f"--embedded-sft {sft}")
    return tokens + list(argv)


def embedded_corpus_flags(name: str) -> Dict[str, object]:
    """The embedded corpus's data flags: where it is kept, built or not (the run builds it:
    corpus.prepare_embedded_corpus)."""
    if name not in EMBEDDED_CORPORA:
        raise ConfigError(f"unknown --embedded-corpus '{name}'; choose one of: {', '.join(EMBEDDED_CORPORA)}")
    from .corpus import stdlib_corpus_dir, stdlib_corpus_layout

    prefix, tokenizer_dir, vocab_size = stdlib_corpus_layout(stdlib_corpus_dir())
    # megatron's NullTokenizer carries the vocabulary size; the text tokenizer (tokenizer-model) is ours, for
    # --sample-prompt and the end-of-run summary.
    return {"data-path": [prefix], "tokenizer-type": "NullTokenizer", "vocab-size": vocab_size,
            "tokenizer-model": tokenizer_dir}


def embedded_sft_flags(name: str) -> Dict[str, object]:
    """The embedded SFT set's flags: its rows and the embedded corpus's tokenizer, built or not (the run builds them:
    stdlib_sft.prepare_embedded_sft)."""
    if name not in EMBEDDED_SFT_SETS:
        raise ConfigError(f"unknown --embedded-sft '{name}'; choose one of: {', '.join(EMBEDDED_SFT_SETS)}")
    from .stdlib_sft import stdlib_sft_layout

    layout = stdlib_sft_layout()
    return {"sft-data": layout["train"], "sft-valid-data": layout["valid"], "tokenizer-type": "NullTokenizer",
            "vocab-size": layout["vocab_size"], "tokenizer-model": layout["tokenizer_dir"]}


# --------------------------------------------------------------------------------------------- resolution
def resolve_spec(args, user_argv: Sequence[str] = ()) -> None:
    """--spec -> the run's SpecChoice (kept by its name, args.litespark_spec: spec_choice.py says why), and what
    Megatron-LM's --spec means: a (module, function) pair, or None for megatron-core's own layer (TE or local by
    --transformer-impl). A pair given by the user is kept as Megatron-LM keeps it."""
    choice = SpecChoice.from_flag(args.spec)
    impl = choice.transformer_impl
    if impl is not None:
        if args.transformer_impl != impl and "--transformer-impl" in user_argv:
            raise ConfigError(f"--spec {choice.value} means --transformer-impl {impl}, not {args.transformer_impl}")
        args.transformer_impl = impl
    args.litespark_spec = choice.value
    args.spec = choice.megatron_spec(args.spec)


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check(args, plat, world: Optional[int] = None) -> None:
    """The checks Megatron-LM makes with bare asserts (or not at all), with a message that says what to do. Run
    before Megatron-LM's own validation. `world`: the number of processes (default: WORLD_SIZE)."""
    for name in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(args, name) is None:
            raise ConfigError(f"--{name.replace('_', '-')} is not set: give the model's shape, or a preset with "
                              f"--model ({', '.join(PRESETS)})")
    if args.seq_length is None:
        raise ConfigError("--seq-length is not set")
    if args.micro_batch_size is None:
        raise ConfigError("--micro-batch-size is not set: the sequences per forward pass on one GPU (Megatron-LM "
                          "has no default for it; --global-batch-size defaults to it x data-parallel size)")
    if args.lr is None and not args.skip_train:
        raise ConfigError("--lr is not set: the peak learning rate (Megatron-LM has no default for it)")
    if not args.skip_train:
        if args.train_iters is None and args.train_samples is None:
            raise ConfigError("--train-iters is not set: the number of training steps (or --train-samples)")
        if args.eval_interval is None and not args.full_validation:
            raise ConfigError("--eval-interval is not set: the iterations between evaluations (Megatron-LM has no "
                              "default for it; with --eval-iters 0 it only sizes the validation set, e.g. 1000)")
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    world = world or world_size()
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                          f"{args.num_attention_heads} (or give the head size with --kv-channels)")
    if world % (tp * pp * cp):
        raise ConfigError(f"world size {world} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
                          f"start a multiple of {tp * pp * cp} processes or change the layout")
    dp, mbs, gbs = world // (tp * pp * cp), args.micro_batch_size, args.global_batch_size
    if gbs is not None and gbs % (mbs * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by micro-batch x data-parallel = {mbs} x {dp} = "
                          f"{mbs * dp}: every data-parallel rank runs whole micro-batches; change the batch sizes or "
                          f"the layout")
    groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if groups % tp:
        raise ConfigError(f"--num-query-groups (KV heads) {groups} is not divisible by --tensor-model-parallel-size "
                          f"{tp}: every TP rank holds whole KV heads; use a TP that divides {groups}")
    if args.num_layers % pp and args.num_layers_per_virtual_pipeline_stage is None:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.transformer_impl == "transformer_engine" and not plat.te:
        where = "a CPU" if plat.device_type == "cpu" else "this GPU machine (pip install -e '.[te]')"
        raise ConfigError(f"--transformer-impl transformer_engine (Megatron-LM's default) needs Transformer Engine, "
                          f"which is not importable on {where}: use --transformer-impl local")
    spec = SpecChoice.of(args)
    if spec.is_stock and args.transformer_impl == "local" and not args.no_persist_layer_norm:
        from megatron.core.models.gpt import gpt_layer_specs

        if not gpt_layer_specs.HAVE_APEX:  # megatron-core's stock local layer then norms with torch, which asserts
            raise ConfigError("megatron-core's local layer without Apex uses torch's LayerNorm, which has no "
                              "persistent kernel: add --no-persist-layer-norm")
    if args.fp8 and not plat.fp8_capable:
        raise ConfigError("--fp8-format needs a GPU with FP8 tensor cores (compute capability >= 8.9, e.g. "
                          "H100/H200) and Transformer Engine; use --bf16")
    _check_cuda_graphs(args, plat)
    _check_logging(args, plat)
    if args.overlap_moe_expert_parallel_comm:
        raise ConfigError("--overlap-moe-expert-parallel-comm runs megatron-core's combined 1F1B schedule, which asks "
                          "the forward step for the model's schedule plan, and litespark-train's forward step builds "
                          "none: drop the flag")
    if not plat.te:  # options that exist only as Transformer Engine kernels; megatron-core fails on them mid-setup
        where = "on a CPU: drop it" if plat.device_type == "cpu" else "here: pip install -e '.[te]'"
        if args.use_precision_aware_optimizer:
            raise ConfigError("--use-precision-aware-optimizer runs Transformer Engine's FusedAdam, which is not "
                              f"importable {where}")
        if args.tp_comm_overlap:
            raise ConfigError("--tp-comm-overlap runs Transformer Engine's userbuffers, which is not importable "
                              f"{where}")
    if args.core_attention != "sdpa":
        _check_core_attention(args, plat)
    if args.use_transformer_engine_op_fuser and spec.is_litespark:
        _check_op_fuser(args)
    if args.use_transformer_engine_op_fuser and args.fp8 and args.fp8_recipe == "delayed" and args.save and \
            os.environ.get("RANK", "0") == "0":
        # Measured: such a run stopped and resumed differs from the uninterrupted one from the first resumed step.
        print(f"{PROG}: note: under --use-transformer-engine-op-fuser the MLP's FP8 delayed-scaling state (its amax "
              "history) is not in the checkpoints (megatron-core keeps the fused ops outside the module tree): a "
              "resumed run starts that history again, and is not bit-exact with an uninterrupted one", flush=True)
    if args.fp8_dot_product_attention:
        _check_fp8_attention(args)
    if args.chunked_output_loss is not None:
        _check_chunked_output_loss(args, tp, cp)
    resolve_kernels_auto(args, plat)
    if args.litespark_cross_entropy:
        _check_litespark_cross_entropy(args, plat)
    if args.litespark_rmsnorm:
        _check_litespark_rmsnorm(args, plat)
    if args.litespark_rope:
        _check_litespark_rope(args, plat)
    if args.litespark_swiglu:
        _check_litespark_swiglu(args, plat)
    if args.litespark_rope_fp8_grad:
        _check_litespark_rope_fp8_grad(args)
    if args.litespark_fp8_output_layer:
        _check_litespark_fp8_output_layer(args, plat, tp, cp)
    if args.litespark_adam:
        _check_litespark_adam(args, plat)
    if args.fp8 and args.fp8_param_gather and args.use_precision_aware_optimizer:
        _check_fp8_parameters_optimizer(args)
    from .peft import check as check_peft

    check_peft(args)
    if spec.is_litespark:
        llama = args.swiglu and args.normalization == "RMSNorm" and not args.add_bias_linear and \
            args.position_embedding_type in ("rope", "none")
        if not llama:
            raise ConfigError("--spec litespark computes a Llama layer (RMSNorm, SwiGLU, no biases, RoPE or none): "
                              "add --swiglu --normalization RMSNorm --disable-bias-linear --position-embedding-type "
                              "rope, use a preset (--model), or --spec stock")
    if args.num_experts:
        _check_moe(args, plat, world)
    if args.attention_variant == "nsa":
        _check_nsa(args, plat)
    if args.multi_latent_attention and args.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
    if args.moe_grouped_gemm and not plat.te:
        raise ConfigError("--moe-grouped-gemm needs Transformer Engine (TEGroupedMLP), not importable here: drop it "
                          "(the experts then run one after another as megatron-core's SequentialMLP)")
    if args.multi_latent_attention and args.transformer_impl == "local":
        if tp > 1:
            raise ConfigError("--multi-latent-attention with --tensor-model-parallel-size > 1 needs "
                              "--transformer-impl transformer_engine: without TE, megatron-core splits MLA's down "
                              "projections over TP and does not sum the gradient of the RoPE key all heads share, so "
                              "TP trains another model than one GPU (measured: 1e-3 loss drift by step 3)")
        if args.qk_layernorm and args.q_lora_rank is None:
            raise ConfigError("--multi-latent-attention with --qk-layernorm on --transformer-impl local needs "
                              "--q-lora-rank: without query compression megatron-core puts the query norm inside a "
                              "TE norm+linear, which the local modules do not have")
    if spec.is_stock and args.transformer_impl == "local" and cp > 1:
        raise ConfigError("--context-parallel-size > 1: the stock local spec's attention (megatron-core's "
                          "DotProductAttention) has no context parallelism; use --spec litespark or stock-te")
    if args.sft_data or args.sft_valid_data:
        _check_sft(args)
    elif not args.mock_data and not args.data_path and not args.train_data_path:
        raise ConfigError("no data: give --data-path (an indexed dataset; tools/preprocess_data.py makes one), "
                          "--embedded-corpus stdlib, --sft-data FILE.jsonl, or --mock-data")
    default_tokenizer(args)
    if args.tokenizer_type is None:
        raise ConfigError("no --tokenizer-type: the data's tokenizer, e.g. HuggingFaceTokenizer --tokenizer-model "
                          "DIR, or NullTokenizer --vocab-size N for pre-tokenized data")
    if args.tokenizer_type == "NullTokenizer" and args.vocab_size is None:
        raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size (the model's vocabulary)")
    if args.padded_vocab_size is not None and args.padded_vocab_size % tp:
        # Megatron-LM builds a given size as it is, and megatron-core asserted the split mid-setup
        raise ConfigError(f"--padded-vocab-size {args.padded_vocab_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}: every TP rank holds an equal slice of the output "
                          f"layer; give a multiple of {tp}, or a TP that divides {args.padded_vocab_size}")
    if not args.pad_vocab_size and args.padded_vocab_size is None:
        # the flag only keeps a given size unpadded; without one megatron.training's FLOP count failed on None
        raise ConfigError("--no-pad-vocab-size needs --padded-vocab-size N, the model's vocabulary rows, which "
                          "Megatron-LM then builds unpadded (without N it has no vocabulary size for the model): "
                          "give N, or drop the flag")
    _check_run_control(args)
    if args.save and args.save_interval is None:
        raise ConfigError("--save needs --save-interval N: the iterations between checkpoints (Megatron-LM also "
                          "saves when training ends)")
    if args.sample_prompt is not None:
        from .sample import why_not

        reason = why_not(args)
        if reason:
            raise ConfigError(reason)
    if args.load:
        from megatron.training.checkpointing import checkpoint_exists

        same = args.save and os.path.abspath(args.load) == os.path.abspath(args.save)
        if not checkpoint_exists(args.load) and not same:
            raise ConfigError(f"--load {args.load}: no checkpoint there (no latest_checkpointed_iteration.txt); point "
                              "--load at the --save directory of an earlier run (the same directory as --save "
                              "starts fresh when it holds none yet)")
    for directory in (args.load, args.pretrained_checkpoint, args.peft_base):
        _check_checkpoint(args, directory)
    from .legacy_checkpoint import check as check_legacy_checkpoint

    check_legacy_checkpoint(args)


def _check_sft(args) -> None:
    """--sft-data: what an SFT run reads (its rows alone) and what of megatron.training's data options it leaves
    out. The rows themselves are read by the run (sft_data.prepare)."""
    if not args.sft_data:
        raise ConfigError("--sft-valid-data needs --sft-data, the training rows")
    other = [flag for flag, given in (("--embedded-corpus", args.embedded_corpus), ("--data-path", args.data_path),
                                      ("--train-data-path", args.train_data_path),
                                      ("--valid-data-path", args.valid_data_path),
                                      ("--test-data-path", args.test_data_path),
                                      ("--mock-data", args.mock_data)) if given]
    if other:
        raise ConfigError(f"--sft-data trains on its JSONL rows alone, not on {other[0]}: drop {other[0]} (pretrain "
                          "first, then fine-tune the checkpoint: --peft-base, or --load with --finetune)")
    if args.sft:
        raise ConfigError("--sft is megatron.training's packed SFT (its own JSONL reader, Transformer Engine's "
                          "attention on a GPU); --sft-data is litespark-train's (one example per sequence, any "
                          "attention, the CPU too): give one of them")
    if not args.tokenizer_model:
        raise ConfigError("--sft-data is text and needs the text tokenizer: give --tokenizer-model (a tokenizer "
                          "directory or tokenizer.json), with --tokenizer-type HuggingFaceTokenizer, or NullTokenizer "
                          "and the model's --vocab-size")
    packed = [flag for flag, given in (("--reset-position-ids", args.reset_position_ids),
                                       ("--reset-attention-mask", args.reset_attention_mask),
                                       ("--eod-mask-loss", args.eod_mask_loss)) if given]
    if packed:
        raise ConfigError(f"{packed[0]} is for documents packed into sequences; --sft-data puts one example in a "
                          "sequence and masks its prompt and padding itself: drop it")
    if args.dataloader_type not in (None, "single"):
        raise ConfigError(f"--dataloader-type {args.dataloader_type} with --sft-data: the SFT dataset shuffles its "
                          "rows every epoch itself and megatron.training reads it in order (single, the default)")
    if not args.sft_valid_data and args.eval_iters and not args.skip_train:
        raise ConfigError(f"--eval-iters {args.eval_iters} but no --sft-valid-data: give the validation rows, or "
                          "--eval-iters 0 to train without validation")


def _check_nsa(args, plat) -> None:
    """--attention-variant nsa: what the Litespark NSA layer and, on a GPU, fla-core's kernels can run."""
    from .layers.nsa import NSASettings, fla_available, fused_group_problem

    spec = SpecChoice.of(args)
    if not spec.is_litespark:
        raise ConfigError(f"--attention-variant nsa is a Litespark layer: it needs --spec litespark, not "
                          f"{spec.value}")
    if args.multi_latent_attention:
        raise ConfigError("--attention-variant nsa and --multi-latent-attention are two attentions: choose one")
    if args.context_parallel_size > 1:
        raise ConfigError("--attention-variant nsa has no context parallelism (its selection needs every earlier "
                          "block of the sequence on one rank): use --context-parallel-size 1")
    for name in ("nsa_block_size", "nsa_selected_blocks", "nsa_window"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: give a positive number")
    if args.seq_length % args.nsa_block_size:
        raise ConfigError(f"--nsa-block-size {args.nsa_block_size} does not divide --seq-length {args.seq_length}: "
                          "NSA compresses whole blocks; choose a block size that divides the sequence")
    selected = args.nsa_selected_blocks
    if selected < 4 or selected & (selected - 1):
        raise ConfigError(f"--nsa-selected-blocks {selected}: give a power of 2 >= 4 (the first, own and previous "
                          "blocks are always selected; fla-core's kernels round the count up to a power of 2)")
    if plat.device_type == "cuda":
        if not fla_available():
            raise ConfigError("--attention-variant nsa on a GPU runs fla-core's kernels, which are not importable "
                              "here: pip install -e '.[nsa]'")
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        head_dim = args.kv_channels or args.hidden_size // args.num_attention_heads
        problem = fused_group_problem(args.num_attention_heads // args.tensor_model_parallel_size,
                                      groups // args.tensor_model_parallel_size, head_dim,
                                      NSASettings(args.nsa_block_size, selected, args.nsa_window))
        if problem:
            raise ConfigError(f"--attention-variant nsa: {problem}")


def cuda_graph_impl(args) -> str:
    """The CUDA-graph implementation a run asks for: 'none', 'local' or 'transformer_engine' (Megatron-LM's
    deprecated spellings of the two included)."""
    impl = getattr(args, "cuda_graph_impl", None) or "none"
    if impl == "none":
        impl = "local" if getattr(args, "enable_cuda_graph", False) else \
            "transformer_engine" if getattr(args, "external_cuda_graph", False) else "none"
    return impl


def cuda_graph_capture_step(args) -> Optional[int]:
    """The training step (counted from 1) at whose start megatron.training captures the run's CUDA graphs
    (--cuda-graph-warmup-steps + 1), None without graphs: a window that times steps must start after it."""
    return None if cuda_graph_impl(args) == "none" else args.cuda_graph_warmup_steps + 1


def _check_cuda_graphs(args, plat) -> None:
    """CUDA graphs where they cannot be captured: megatron-core would fail inside its setup (on a CPU with an
    AttributeError on a CUDA stream)."""
    impl = cuda_graph_impl(args)
    if impl == "none":
        return
    if plat.device_type != "cuda":
        raise ConfigError(f"--cuda-graph-impl {impl} captures the step's CUDA kernels into graphs: it needs a GPU; "
                          "drop it on a CPU")
    if impl == "transformer_engine" and not plat.te:
        raise ConfigError("--cuda-graph-impl transformer_engine captures with Transformer Engine's "
                          "make_graphed_callables, and Transformer Engine is not importable here: install it "
                          "(pip install -e '.[te]') or use --cuda-graph-impl local")


def _reaches_step(args, step: int) -> bool:
    """Whether a run started from scratch begins its training step `step` (0-based: megatron.training's loop asks
    `iteration == step` before each step) before --train-iters (or --train-samples' steps) or --exit-interval ends
    it. Unknown lengths count as reached."""
    if args.train_iters:
        last = args.train_iters
    elif args.train_samples and args.global_batch_size:
        last = args.train_samples // args.global_batch_size
    else:
        return True
    if args.exit_interval:
        last = min(last, args.exit_interval)
    return step < last


def _check_logging(args, plat) -> None:
    """Megatron-LM's profiling and logging flags where megatron.training would fail with them mid-run (CUDA's
    profiler, memory statistics and NVML on a CPU), or run and log nothing (W&B without TensorBoard)."""
    if args.profile and args.use_pytorch_profiler and not args.tensorboard_dir:
        # megatron.training writes the trace to f"{tensorboard_dir}/../torch_profile": without one, into ./None/..
        raise ConfigError("--profile --use-pytorch-profiler writes its trace to torch_profile/ beside "
                          "--tensorboard-dir: give --tensorboard-dir")
    if plat.device_type == "cpu":
        if args.profile and not args.use_pytorch_profiler and _reaches_step(args, args.profile_step_start):
            raise ConfigError("--profile without --use-pytorch-profiler starts CUDA's profiler (for nsys) at "
                              "--profile-step-start, and there is no GPU here: add --use-pytorch-profiler "
                              "(torch.profiler) or drop --profile")
        if args.log_memory_to_tensorboard:
            raise ConfigError("--log-memory-to-tensorboard logs CUDA's memory statistics, and there is no GPU here: "
                              "drop it")
        if args.log_energy:
            raise ConfigError("--log-energy reads the GPUs' energy counters through NVML, and there is no GPU here: "
                              "drop it")
    if args.wandb_project:
        if not args.tensorboard_dir:
            raise ConfigError("--wandb-project: megatron.training logs to W&B only what it writes to TensorBoard, so "
                              "without --tensorboard-dir nothing would be logged: add --tensorboard-dir")
        if not args.save and not args.wandb_save_dir:
            raise ConfigError("--wandb-project keeps W&B's files in --save's wandb/ unless --wandb-save-dir is given: "
                              "give one of them")
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise ConfigError("--wandb-project logs to Weights & Biases, and the wandb package is not installed: pip "
                              "install wandb")


def _check_run_control(args) -> None:
    """Checkpoint and exit flags Megatron-LM takes without a word and then does something else with."""
    if args.keep_last_checkpoints is not None:
        if args.keep_last_checkpoints < 1:
            raise ConfigError(f"--keep-last-checkpoints {args.keep_last_checkpoints}: keep at least 1 checkpoint "
                              "(leave the flag out to keep them all)")
        if not args.save:
            raise ConfigError("--keep-last-checkpoints needs --save: it prunes the checkpoints of --save")
    if args.hang_timeout_factor is not None and not args.hang_timeout_factor > 1:
        raise ConfigError(f"--hang-timeout-factor {args.hang_timeout_factor:g}: a step is hung when it takes F times "
                          "the median step; give F > 1 (e.g. 10)")
    if args.max_skipped_steps is not None and args.max_skipped_steps < 1:
        raise ConfigError(f"--max-skipped-steps {args.max_skipped_steps}: give the skipped steps in a row that stop "
                          "the run, a number >= 1")
    if args.loss_spike_factor is not None and not args.loss_spike_factor > 1:
        raise ConfigError(f"--loss-spike-factor {args.loss_spike_factor:g}: a spike is a loss F times the recent "
                          "median; give F > 1 (e.g. 3)")
    if not args.hang_timeout_min_seconds > 0:
        raise ConfigError(f"--hang-timeout-min-seconds {args.hang_timeout_min_seconds:g}: give seconds > 0")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise ConfigError(f"--exit-duration-in-mins {args.exit_duration_in_mins}: give the minutes of training "
                          "after which the run saves and exits, a number > 0")
    if args.async_save:
        if not args.save:
            raise ConfigError("--async-save needs --save: it saves checkpoints in the background, and without "
                              "--save there are none")
        if not args.use_persistent_ckpt_worker:
            # megatron-core 0.19 would switch --async-save off with a warning, and every save would block.
            raise ConfigError("--async-save needs --use-persistent-ckpt-worker (megatron-core's background writer; "
                              "without it megatron-core turns --async-save off)")
        if args.async_strategy == "nvrx":
            import importlib.util

            if importlib.util.find_spec("nvidia_resiliency_ext") is None:
                raise ConfigError("--async-save with --async-strategy nvrx (Megatron-LM's default) needs "
                                  "nvidia-resiliency-ext, which is not installed: add --async-strategy mcore "
                                  "(megatron-core's own writer), or pip install nvidia-resiliency-ext")


def _check_moe(args, plat, world: int) -> None:
    """An MoE model against the layout: what megatron-core would otherwise find after the process groups exist, or
    in the first training step."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    etp = args.expert_tensor_parallel_size or tp
    e, k = args.num_experts, args.moe_router_topk
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk must be between 1 and --num-experts ({e}), got {k}")
    if e % ep:
        raise ConfigError(f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}: every expert-"
                          f"parallel rank holds the same number of experts")
    if world % (etp * ep * pp):
        raise ConfigError(f"world size {world} is not divisible by expert-TP x EP x PP = {etp} x {ep} x {pp} = "
                          f"{etp * ep * pp} (the experts' layout); start a multiple of {etp * ep * pp} processes or "
                          f"lower --expert-model-parallel-size")
    freq, layers = args.moe_layer_freq, args.num_layers
    if not ((isinstance(freq, int) and freq >= 1) or
            (isinstance(freq, list) and len(freq) == layers and all(x in (0, 1) for x in freq))):
        # megatron-core reads it so; anything else failed in the FLOP count at the start of training
        raise ConfigError(f"--moe-layer-freq {freq}: give N >= 1 (every N-th layer MoE) or a list of 0/1, one per "
                          f"layer ({layers})")
    if tp > 1 and not args.sequence_parallel:
        raise ConfigError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's MoE "
                          "layer refuses to train without it, in the first step: every TP rank would route the "
                          "same tokens)")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        v = getattr(args, name)
        if v is not None and v % etp:
            raise ConfigError(f"--{name.replace('_', '-')} {v} is not divisible by the expert tensor-parallel size "
                              f"{etp}: every rank holds an equal slice of each expert")
    if args.moe_token_dispatcher_type == "alltoall" and etp > 1 and plat.device_type == "cpu":
        raise ConfigError("--moe-token-dispatcher-type alltoall with tensor-parallel experts gathers uneven token "
                          "counts over the TP group, which gloo (the CPU backend) cannot do: use "
                          "--moe-token-dispatcher-type allgather here (NCCL on GPUs can)")


def megatron_validate(args) -> None:
    """Megatron-LM's validate_args, its asserts turned into one line (the assert's message, else its source)."""
    from megatron.training.arguments import validate_args

    try:
        validate_args(args, {})
    except (AssertionError, ValueError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else None
        if message is None:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            message = f"{frame.line} ({os.path.basename(frame.filename)}:{frame.lineno})"
        raise ConfigError(f"Megatron-LM refuses these arguments: {message}") from None


def model_config_check(args) -> None:
    """megatron-core's TransformerConfig checks the model's fields (MoE routing, MLA dims, ...) only when the model
    is built, after the process groups: build it once here, its ValueError as one line."""
    from megatron.training.arguments import core_transformer_config_from_args

    try:
        core_transformer_config_from_args(args)
    except (AssertionError, ValueError) as e:
        raise ConfigError(f"the model cannot be built: {str(e).strip().splitlines()[0]}") from None


def resolve_core_attention(args) -> None:
    """--core-attention auto -> the kernel this run takes: TE's DotProductAttention where the Litespark layer runs
    dense GQA/MHA attention on the te backend under context parallelism (TE's ring attention, as stock runs it,
    was faster than the Litespark all-gather attention: docs/benchmarks/2026-11-26-cp-tp-overlap-hf-best-2xh200.md),
    torch SDPA everywhere else (as fast as TE's without CP: docs/benchmarks/2026-11-25-best-stock-graphs-h100-memory.md;
    and it runs on every backend)."""
    if args.core_attention != "auto" and not getattr(args, "core_attention_auto", False):
        return
    args.core_attention_auto = True  # decided again if --use-checkpoint-args changes what it depends on
    te_ring = SpecChoice.of(args).is_litespark and args.transformer_impl == "transformer_engine" and \
        args.context_parallel_size > 1 and args.attention_variant == "dense" and not args.multi_latent_attention
    args.core_attention = "te" if te_ring else "sdpa"


def _check_core_attention(args, plat) -> None:
    """--core-attention te: Transformer Engine's DotProductAttention in the Litespark layer."""
    spec = SpecChoice.of(args)
    if not spec.is_litespark:
        raise ConfigError(f"--core-attention chooses the Litespark layer's attention kernel; --spec "
                          f"{spec.value} runs its own: drop the flag or use --spec litespark")
    if args.attention_variant == "nsa":
        raise ConfigError("--core-attention te with --attention-variant nsa: native sparse attention has kernels of "
                          "its own; drop one of them")
    if args.transformer_impl != "transformer_engine":
        raise ConfigError("--core-attention te is Transformer Engine's DotProductAttention: it needs "
                          "--transformer-impl transformer_engine" + ("" if plat.te else
                                                                     ", and Transformer Engine, not importable here"))


def _check_op_fuser(args) -> None:
    """--use-transformer-engine-op-fuser in the Litespark layer: its MLP (norm, fc1, SwiGLU, fc2) runs as one
    sequence of Transformer Engine ops, as stock's TEFusedMLP."""
    if args.transformer_impl != "transformer_engine":
        raise ConfigError("--use-transformer-engine-op-fuser runs the MLP as Transformer Engine ops: it needs "
                          "--transformer-impl transformer_engine")
    if getattr(args, "peft", None) in ("lora", "dora"):
        raise ConfigError(f"--use-transformer-engine-op-fuser with --peft {args.peft}: the fused MLP reads fc1's and "
                          "fc2's weights itself, past their adapters; drop one")


def _check_fp8_attention(args) -> None:
    if not args.fp8:
        raise ConfigError("--fp8-attention needs --fp8-format (attention joins the FP8 recipe of the GEMMs): add "
                          "--fp8-format hybrid")
    spec = SpecChoice.of(args)
    if not spec.uses_te_attention(args.transformer_impl, args.core_attention):
        raise ConfigError(f"--fp8-attention needs Transformer Engine's DotProductAttention: --spec stock-te, or "
                          f"--spec litespark --core-attention te; --spec {spec.value}'s core attention here "
                          f"has no FP8 path, so the flag would change nothing")
    if args.fp8_recipe not in ("delayed", "tensorwise", "mxfp8"):
        raise ConfigError(f"--fp8-attention with --fp8-recipe {args.fp8_recipe}: megatron-core gives FP8 attention "
                          "to the delayed, tensorwise and mxfp8 recipes only; use one of them")


def _check_chunked_output_loss(args, tp: int, cp: int) -> None:
    n = args.chunked_output_loss
    if n < 1:
        raise ConfigError(f"--chunked-output-loss {n}: give the number of chunks, 1 or more")
    local = args.seq_length // cp // (tp if args.sequence_parallel else 1)
    if local % n:
        raise ConfigError(f"--chunked-output-loss {n} does not divide the {local} sequence positions each rank holds "
                          f"(--seq-length / CP{' / TP under --sequence-parallel' if args.sequence_parallel else ''}); "
                          f"use a divisor of {local}")
    if args.mtp_num_layers:
        raise ConfigError("--chunked-output-loss with --mtp-num-layers: multi-token prediction computes its own "
                          "logits; the two are not tested together, drop one")


def _check_litespark_cross_entropy(args, plat) -> None:
    """Where a GPU runs the kernel, and nothing else computes the loss."""
    _check_triton("--litespark-cross-entropy", plat)
    if args.cross_entropy_loss_fusion:
        raise ConfigError("--litespark-cross-entropy with --cross-entropy-loss-fusion: two cross-entropy kernels; "
                          "drop one")
    if args.mtp_num_layers:
        raise ConfigError("--litespark-cross-entropy with --mtp-num-layers: multi-token prediction computes its "
                          "losses with megatron-core's cross-entropy; drop one")


def _check_litespark_rmsnorm(args, plat) -> None:
    """Where the flag has a layer to act on, and a GPU runs the kernel."""
    if not SpecChoice.of(args).is_litespark:
        raise ConfigError("--litespark-rmsnorm builds the Litespark layer's norms; it needs --spec litespark")
    _check_triton("--litespark-rmsnorm", plat)
    if args.fp8 and args.transformer_impl == "transformer_engine":
        _check_fp8_rmsnorm(args)
    if args.multi_latent_attention:
        raise ConfigError("--litespark-rmsnorm with --multi-latent-attention: MLA's latent norms stay inside "
                          "Transformer Engine's up projections; drop one")
    if args.use_transformer_engine_op_fuser:
        raise ConfigError("--litespark-rmsnorm with --use-transformer-engine-op-fuser: the fused MLP runs its norm as "
                          "one of Transformer Engine's ops; drop one")


def _check_fp8_rmsnorm(args) -> None:
    """Under FP8 on the te backend the norm writes the next GEMM's FP8 input under delayed scaling (layers/norm.py):
    where that GEMM takes its input as it is, and nothing else owns the norm's output or its scaling state."""
    recomputed = args.recompute_granularity == "full" or (
        args.recompute_granularity == "selective" and "layernorm" in (getattr(args, "recompute_modules", None) or ()))
    refusals = (
        (args.fp8_recipe != "delayed", f"with --fp8-format on the te backend writes delayed-scaling FP8 (--fp8-recipe "
                                       f"delayed), and the recipe is {args.fp8_recipe}: Transformer Engine's norm "
                                       f"writes that recipe's FP8 input itself; drop the flag"),
        (args.sequence_parallel, "with --fp8-format and --sequence-parallel: the QKV and fc1 GEMMs all-gather their "
                                 "input, which Transformer Engine then casts itself; drop one"),
        (recomputed, "with --fp8-format and the norms recomputed (--recompute-granularity full, or selective with "
                     "layernorm): Transformer Engine keeps its own copy of the FP8 scaling state for the recompute; "
                     "drop one"),
        (getattr(args, "peft", None) in ("lora", "dora"), "with --fp8-format and --peft lora|dora: the adapters "
                                                          "read the norm's output in bf16; drop one"),
    )
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"--litespark-rmsnorm {reason}")


def _check_litespark_rope(args, plat) -> None:
    """Where the flag has a layer to act on, the kernel covers the model's RoPE, and a GPU runs it."""
    # (A TP that splits a query group over ranks, where megatron-core gathers the group's heads and the kernel would
    # see the whole group, is refused for every run already.)
    head = args.kv_channels or args.hidden_size // args.num_attention_heads
    refusals = (
        (not SpecChoice.of(args).is_litespark, "builds the Litespark attention's query, key and value; it "
                                               "needs --spec litespark"),
        (args.position_embedding_type != "rope", f"applies RoPE, and --position-embedding-type is "
                                                 f"{args.position_embedding_type}; drop the flag"),
        (args.multi_latent_attention, "with --multi-latent-attention: MLA splits and rotates its own latents; drop "
                                      "one"),
        (getattr(args, "attention_variant", "dense") != "dense", "with --attention-variant nsa: native sparse "
                                                                 "attention builds its own query, key and value; "
                                                                 "drop one"),
        (args.qk_layernorm, "with --qk-layernorm: the norms sit between the split and RoPE; drop one"),
        (args.rotary_interleaved, "with --rotary-interleaved: the kernel rotates halves (Llama's layout); drop one"),
        (args.rotary_percent != 1.0, f"with --rotary-percent {args.rotary_percent:g}: the kernel rotates the whole "
                                     f"head; drop one"),
        (head & (head - 1) != 0, f"with a head size of {head}: the kernel takes a power of two; drop the flag"),
        (args.context_parallel_size > 1, "with --context-parallel-size > 1: not tested together yet; drop one"),
    )
    _refuse_first("--litespark-rope", refusals)
    _check_triton("--litespark-rope", plat)


def _check_litespark_rope_fp8_grad(args) -> None:
    """Where the RoPE kernel runs and the QKV GEMM's output gradient is Transformer Engine's delayed-scaling FP8, with
    nothing else owning that gradient (checked after --litespark-rope's own refusals)."""
    recomputed = args.recompute_granularity == "full"
    refusals = (
        (not args.litespark_rope, "is the RoPE kernel's backward: it needs --litespark-rope (on by default where the "
                                  "kernels were measured)"),
        (args.transformer_impl != "transformer_engine" or not args.fp8,
         "writes Transformer Engine's FP8 tensors: it needs --fp8-format on the te backend (--transformer-impl "
         "transformer_engine)"),
        (args.fp8_recipe != "delayed", f"writes delayed-scaling FP8 (--fp8-recipe delayed), and the recipe is "
                                       f"{args.fp8_recipe}; drop one"),
        (args.tensor_model_parallel_size > 1, "with --tensor-model-parallel-size > 1: not tested together yet; drop "
                                              "one"),
        (recomputed, "with --recompute-granularity full: not tested together yet; drop one"),
        (getattr(args, "peft", None), "with --peft: the adapters add to the QKV GEMM's output; drop one"),
    )
    _refuse_first("--litespark-rope-fp8-grad", refusals)


def _dtype_flag(value) -> str:
    """A dtype flag's value as given (fp32, bf16, fp16, fp8), also after megatron.training mapped it to torch's."""
    return {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16",
            "torch.uint8": "fp8"}.get(str(value), value)


def _check_litespark_adam(args, plat) -> None:
    """Where megatron-core steps Transformer Engine's FusedAdam on tensors the kernel takes: fp32 or bf16 moments
    and gradients, fp32 master weights (whole or as bf16 remainders) or none, no FP8 parameters, not captured."""
    exp_avg, exp_avg_sq, main_params = (_dtype_flag(getattr(args, name)) for name in
                                        ("exp_avg_dtype", "exp_avg_sq_dtype", "main_params_dtype"))
    refusals = (
        (not plat.te or plat.device_type != "cuda",
         "steps Transformer Engine's FusedAdam, megatron-core's Adam on a GPU with TE; here megatron-core runs "
         "torch's Adam: drop the flag"),
        (args.optimizer != "adam", f"is an Adam step, and the optimizer is --optimizer {args.optimizer}; drop one"),
        (args.optimizer_cpu_offload, "with --optimizer-cpu-offload: the step runs on the host's copy; drop one"),
        (args.optimizer_cuda_graph, "with --optimizer-cuda-graph: TE's capturable step reads its learning rate and "
                                    "step count on the GPU; drop one"),
        (getattr(args, "use_megatron_fsdp", False), "with --use-megatron-fsdp: its sharded parameters are DTensors; "
                                                    "drop one"),
        (args.use_precision_aware_optimizer and (exp_avg in ("fp16", "fp8") or exp_avg_sq in ("fp16", "fp8")),
         f"takes fp32 or bf16 moments, not --exp-avg-dtype {exp_avg} --exp-avg-sq-dtype {exp_avg_sq} (scaled by "
         f"TE's FusedAdam); use bf16 or fp32"),
        (args.use_precision_aware_optimizer and main_params == "fp16",
         "takes fp32 master weights, not --main-params-dtype fp16 (scaled by TE's FusedAdam); drop one"),
        (args.fp8 and args.fp8_param_gather, "with --fp8-param-gather: FP8 parameters take TE's FP8 Adam kernel; "
                                             "drop one"),
    )
    _refuse_first("--litespark-adam", refusals)
    _check_triton("--litespark-adam", plat)


def _check_litespark_swiglu(args, plat) -> None:
    """Where the Litespark MLP's GEMMs run in FP8 under delayed scaling (the scaling the kernels write), and
    nothing else owns the activation or its scaling state."""
    recomputed = args.recompute_granularity == "full" or (
        args.recompute_granularity == "selective" and "mlp" in (getattr(args, "recompute_modules", None) or ()))
    refusals = (
        (not SpecChoice.of(args).is_litespark, "builds the Litespark MLP's activation; it needs --spec litespark"),
        (args.transformer_impl != "transformer_engine" or not args.fp8,
         "writes Transformer Engine's FP8 tensors: it needs --fp8-format on the te backend (--transformer-impl "
         "transformer_engine); in BF16 TE's SwiGLU already runs"),
        (args.fp8 and args.fp8_recipe != "delayed", f"writes delayed-scaling FP8 (--fp8-recipe delayed), and the "
                                                    f"recipe is {args.fp8_recipe}; drop one"),
        (args.use_transformer_engine_op_fuser, "with --use-transformer-engine-op-fuser: the fused MLP runs "
                                               "Transformer Engine's SwiGLU op; drop one"),
        (recomputed, "with the MLP recomputed (--recompute-granularity full, or selective with mlp): Transformer "
                     "Engine keeps its own copy of the FP8 scaling state for the recompute; drop one"),
        (args.tp_comm_overlap, "with --tp-comm-overlap: not tested together yet; drop one"),
    )
    _refuse_first("--litespark-swiglu", refusals)
    _check_triton("--litespark-swiglu", plat)


def _check_litespark_fp8_output_layer(args, plat, tp: int, cp: int) -> None:
    """Where nothing else computes the logits or the loss, and (on a GPU) the FP8 GEMMs take the shapes."""
    refusals = (
        (args.cross_entropy_loss_fusion, "with --cross-entropy-loss-fusion: it computes the loss itself; drop one"),
        (args.chunked_output_loss is not None, "with --chunked-output-loss: it keeps one micro-batch's bf16 logits "
                                               "and frees them in the backward; drop one"),
        (args.mtp_num_layers, "with --mtp-num-layers: multi-token prediction computes its own logits; drop one"),
        (getattr(args, "use_mup", False), "with --use-mup: MuP scales the logits before the loss; drop one"),
        (args.defer_embedding_wgrad_compute, "with --defer-embedding-wgrad-compute: it computes the weight's "
                                             "gradient in its own backward; drop one"),
    )
    _refuse_first("--litespark-fp8-output-layer", refusals)
    _check_triton("--litespark-fp8-output-layer", plat)
    if plat.device_type == "cuda" and not plat.fp8_capable:
        raise ConfigError(f"--litespark-fp8-output-layer runs FP8 GEMMs, which need compute capability 8.9 or more "
                          f"(Ada, Hopper, Blackwell); this GPU ({plat.device_name}) has none: drop the flag")
    if plat.device_type == "cuda":
        tokens = args.seq_length // cp * args.micro_batch_size
        # Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP unless given its size
        vocab = (("vocabulary per TP rank (--padded-vocab-size / TP)", args.padded_vocab_size // tp)
                 if args.padded_vocab_size is not None else
                 ("--make-vocab-size-divisible-by (the vocabulary per TP rank is a multiple of it)",
                  args.make_vocab_size_divisible_by))
        short = [f"{what} {n}" for what, n in (("tokens per micro-batch (--seq-length / CP x --micro-batch-size)",
                                                tokens), ("--hidden-size", args.hidden_size), vocab) if n % 16]
        if short:
            raise ConfigError(f"--litespark-fp8-output-layer runs FP8 GEMMs, which take multiples of 16: "
                              f"{', '.join(short)}; drop the flag or change the shape")


def _refuse_first(flag: str, refusals) -> None:
    """The first (refused, reason) pair that holds, as the flag's one line."""
    for refused, reason in refusals:
        if refused:
            raise ConfigError(f"{flag} {reason}")


def _check_triton(flag: str, plat) -> None:
    """A CPU runs a kernel's plain-torch reference (as it runs every layer's); a GPU asked for a Litespark kernel
    must run it."""
    from .kernels import triton_on

    if plat.device_type == "cuda" and not triton_on(plat):
        raise ConfigError(f"{flag} on a GPU runs Triton kernels, and Triton does not import here: install torch's "
                          "CUDA build with its triton, or drop the flag")


def _auto_litespark_rmsnorm(args, plat) -> None:
    """The norm's default: measured in BF16 only (its FP8 path, writing the next GEMM's FP8 input, is asked for)."""
    _check_litespark_rmsnorm(args, plat)
    if args.fp8:
        raise ConfigError("--litespark-rmsnorm under FP8 is not a default yet")


# A kernel flag left out (None) is decided here. On where the kernels were measured: trained inside the noise floor of
# megatron-core's own path (the loss-equivalence runs) and faster in the step (docs/benchmarks/, 2026-11-27). Off
# everywhere else, so a CPU, FP16 and FP32, the stock specs, the local backend, CP and fine-tuning run what they ran
# before the kernels existed; a flag given either way is the user's choice (--litespark-X is refused where
# the kernel cannot run, --no-litespark-X turns it off).
KERNELS_AUTO = (  # (the flag's dest, the check that refuses it where the kernel cannot run)
    ("litespark_cross_entropy", _check_litespark_cross_entropy),
    ("litespark_rmsnorm", _auto_litespark_rmsnorm),
    ("litespark_rope", _check_litespark_rope),
    ("litespark_swiglu", _check_litespark_swiglu),  # FP8 with delayed scaling only: refused elsewhere, so off
)


def kernels_measured_setting(args, plat) -> bool:
    """Whether the run is of the kind the kernels were measured in (before each kernel's own refusals)."""
    from .kernels import triton_on

    return (plat.device_type == "cuda" and triton_on(plat) and SpecChoice.of(args).is_litespark
            and args.transformer_impl == "transformer_engine" and bool(args.bf16) and not args.fp16
            and args.context_parallel_size == 1 and not _fine_tuning(args))


def _fine_tuning(args) -> bool:
    """PEFT, or SFT rows (--sft-data, which --embedded-sft sets; Megatron-LM's packed --sft): not where the kernels
    were measured."""
    return bool(getattr(args, "peft", None) or getattr(args, "sft_data", None) or getattr(args, "sft", False))


def resolve_kernels_auto(args, plat) -> None:
    """Each Litespark kernel flag left out becomes True where the run is the measured kind and the kernel's explicit
    flag would be accepted, False otherwise."""
    measured = kernels_measured_setting(args, plat)
    for name, refusal in KERNELS_AUTO:
        if getattr(args, name, None) is not None:
            continue
        on = measured
        if on:
            try:
                refusal(args, plat)
            except ConfigError:
                on = False
        setattr(args, name, on)


def _check_fp8_parameters_optimizer(args) -> None:
    """FP8 parameters (--fp8-param-gather) under delayed scaling are updated by Transformer Engine's FP8 Adam kernel,
    which asserts fp32 master weights and moments; the precision-aware optimizer gives it master weights stored as
    16-bit remainders (megatron-core's store_param_remainders, which no Megatron-LM flag turns off), and bf16 moments
    if asked. Both failed at the first optimizer step (docs/benchmarks/2026-11-25-best-stock-graphs-h100-memory.md)."""
    if args.fp8_recipe == "delayed":
        raise ConfigError("--fp8-param-gather with --use-precision-aware-optimizer under delayed scaling: Transformer "
                          "Engine's Adam for FP8 parameters needs fp32 master weights and moments, and megatron-core "
                          "keeps the master weights as 16-bit remainders, so the first step would fail; use one of "
                          "the two flags")


def default_tokenizer(args) -> None:
    """Mock data without a --tokenizer-type: token ids only, NullTokenizer (Megatron-LM's example does the same)."""
    if args.tokenizer_type is None and args.mock_data:
        args.tokenizer_type = "NullTokenizer"


def launch_environment(tp: int, cp: int, before_blackwell: bool, environ) -> dict:
    """What the launchers add to a run's environment `environ` (scripts/pretrain.sh, tools/layout_sweep.py;
    litespark-plan prints it before its commands): under TP or CP on a GPU before Blackwell, one hardware work queue,
    CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM's overlap of their communication with compute needs the order it gives,
    and Megatron-LM asserts it), unless the user set a value."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" in environ or tp * cp == 1 or not before_blackwell:
        return {}
    return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}


@contextlib.contextmanager
def _launched(args):
    """This process's environment as the launchers will give the run, for the length of a check."""
    from megatron.training import arguments as megatron_arguments

    added = launch_environment(args.tensor_model_parallel_size, args.context_parallel_size,
                               megatron_arguments.get_device_arch_version() < 10, os.environ)
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def check_run(args, plat, world: int) -> None:
    """Every check a run of `world` processes would make before training (check(), Megatron-LM's validation, the
    model's config), for a run not started yet (launchers, the suites) with the environment the launchers give it;
    Megatron-LM's printout is not shown."""
    import io
    import warnings

    from .platform import apply_cpu_shims, te_importable

    apply_cpu_shims()  # validation reads the GPU's architecture; on a CPU-only torch the shims answer for it
    check(args, plat, world=world)
    args.world_size = world
    with warnings.catch_warnings():
        # No process of the run exists yet, so none has a rank: megatron-core's warning about that says nothing here.
        warnings.filterwarnings("ignore", message=r"Could not determine rank")
        with contextlib.redirect_stdout(io.StringIO()), _launched(args):
            megatron_validate(args)
            model = args
            if plat.te and not te_importable():
                # A GPU node assumed from here (launch_check --assume-gpu): TransformerConfig asks TE whether its
                # fused RoPE exists, which only the node can answer; the rest of the model's checks hold here too.
                model = argparse.Namespace(**{**vars(args), "apply_rope_fusion": False})
            model_config_check(model)
        learning_rate_schedule(args)
        check_checkpoints(args)


def resolve(argv: Sequence[str], plat) -> argparse.Namespace:
    """argv -> Megatron-LM's parsed arguments (presets, --config and platform flags expanded, --spec resolved),
    not yet checked: what the tools read a model's shape from."""
    from megatron.training.arguments import parse_args

    tokens = expand(argv, cpu=plat.device_type == "cpu")
    read_config_docstrings_once()  # megatron.training's parser is built at every parse (platform.library_gaps)
    saved = sys.argv
    sys.argv = [PROG, *tokens]
    try:
        args = parse_args(add_litespark_args)
        resolve_spec(args, argv)
        resolve_core_attention(args)
    finally:
        sys.argv = saved
    return args


def resolve_quietly(argv: Sequence[str], plat=None) -> argparse.Namespace:
    """resolve() for the tools: a bad flag raises ConfigError with argparse's one-line message instead of exiting.
    Without `plat`, flags resolve as on a CPU (a tool reading a model's shape needs no GPU)."""
    import io

    from .platform import Platform

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return resolve(argv, plat or Platform("cpu", "gloo", False, False, "cpu"))
    except SystemExit:
        lines = [line for line in err.getvalue().splitlines() if "error:" in line]
        raise ConfigError(lines[-1].split("error:", 1)[1].strip() if lines else "invalid litespark-train flags") \
            from None


def model_vocab_size(args) -> int:
    """The output layer's rows as megatron.training will build them: --padded-vocab-size where given (Megatron-LM
    pads no further; with --no-pad-vocab-size, an imported model's exact rows), else its tokenizer's vocabulary (a
    text tokenizer's own size, --vocab-size for NullTokenizer) padded to a multiple of
    --make-vocab-size-divisible-by x TP."""
    if args.padded_vocab_size is not None:
        return args.padded_vocab_size
    return _megatron_tokenizer(args)[1]


def _check_checkpoint(args, load_dir: Optional[str]) -> None:
    """What a run must know of the torch_dist checkpoint it loads, before any process group.

    - It must have an embedding row for every id of the run's tokenizer: megatron-core loads a smaller table into
      the larger one without a word (the rows beyond it start at zero). An imported HF checkpoint has exactly its
      vocabulary's rows, so this is where a tokenizer of another model is caught.
    - Transformer Engine modules save their FP8 state as `_extra_state`; a checkpoint of megatron-core's local modules
      (a CPU run, `litespark-convert import`) or of another spec lacks some of it, and megatron-core's default
      strictness then fails on the first one. Such a checkpoint is loaded with `--dist-ckpt-strictness
      log_unexpected` (the missing TE state starts fresh, as in a new model), unless the run chose a strictness.
    """
    from .checkpoint_dir import latest_checkpoint_dir

    directory = latest_checkpoint_dir(load_dir) if load_dir else None
    if directory is None or not os.path.isfile(os.path.join(directory, "metadata.json")):
        return  # none there, or not a torch_dist checkpoint: megatron.training's loader speaks for it
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(directory).read_metadata().state_dict_metadata
    embedding = keys.get("embedding.word_embeddings.weight")
    if embedding is not None:
        rows, vocab = embedding.size[0], _megatron_tokenizer(args)[0].vocab_size
        if vocab > rows:
            raise ConfigError(f"the tokenizer has {vocab} tokens but the checkpoint in {load_dir} has embeddings for "
                              f"{rows}: they are not one model's (an imported model's tokenizer is in its tokenizer/ "
                              "directory, and its model.yaml names it)")
    if args.transformer_impl == "transformer_engine" and args.dist_ckpt_strictness == "assume_ok_unexpected":
        objects = {key.split("/shard_")[0] for key in keys}
        missing = [key for key in _te_only_state(args) if key not in objects]
        if missing:
            args.dist_ckpt_strictness = "log_unexpected"
            print(f"{PROG}: {directory} holds no {missing[0]} (saved by other modules than this run's Transformer "
                  "Engine layer: megatron-core's local modules, or another spec): loading it with "
                  "--dist-ckpt-strictness log_unexpected, that state starts fresh", flush=True)


def _loaded_checkpoint_dir(args, load_dir: Optional[str]) -> Optional[str]:
    """The checkpoint directory megatron.training will load from `load_dir` (the tracker's, or --ckpt-step's), None
    if there is none there."""
    from .checkpoint_dir import latest_checkpoint_dir

    directory = latest_checkpoint_dir(load_dir) if load_dir else None
    if directory is not None and args.ckpt_step:
        from megatron.training.checkpointing import get_checkpoint_name

        directory = get_checkpoint_name(load_dir, args.ckpt_step, return_base_dir=True)
    return directory


def check_checkpoints(args) -> None:
    """The checkpoints the run loads against its validated arguments (megatron.training stores its arguments in a
    checkpoint's common state), before any process group: a model of another shape would fail in the loader, after
    the process groups are up and --save is created."""
    from .peft import check_checkpoint as check_peft_checkpoint

    for flag, load_dir in (("--load", args.load), ("--pretrained-checkpoint", args.pretrained_checkpoint),
                           ("--peft-base", args.peft_base)):
        directory = _loaded_checkpoint_dir(args, load_dir)
        if directory is None or not os.path.isfile(os.path.join(directory, "metadata.json")):
            continue  # none there, or not a torch_dist checkpoint: megatron.training's loader speaks for it
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(directory)
        saved = common.get("args")
        if not isinstance(saved, argparse.Namespace):
            continue  # none, or the earlier trainer's (legacy_checkpoint.py)
        _check_checkpoint_model(args, saved, f"{flag} {load_dir}")
        check_peft_checkpoint(args, saved, f"{flag} {load_dir}")
        # megatron.training resumes the schedule of --load's checkpoint, not of a release or --finetune's
        if flag == "--load" and not (os.path.basename(directory) == "release" or args.finetune or
                                     args.no_load_optim):
            _check_checkpoint_schedule(args, common.get("opt_param_scheduler"), f"{flag} {load_dir}")


# The arguments of a model a checkpoint's and the run's must agree on: the parameters' shapes, and what the same
# parameters compute (norm, position embedding). Compared where both have the argument.
MODEL_ARGUMENTS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                   "kv_channels", "untie_embeddings_and_output_weights", "swiglu", "normalization",
                   "layernorm_zero_centered_gamma", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
                   "position_embedding_type", "max_position_embeddings", "multi_latent_attention", "q_lora_rank",
                   "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "num_experts",
                   "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq", "mtp_num_layers",
                   "attention_variant", "vocab_size")


def _model_arguments(a) -> Dict[str, object]:
    """What of MODEL_ARGUMENTS applies to the model of arguments `a` (a run's, or a checkpoint's)."""
    model = {name: getattr(a, name) for name in MODEL_ARGUMENTS if hasattr(a, name)}
    if zero_centered_gamma(a) is not None:
        model["layernorm_zero_centered_gamma"] = zero_centered_gamma(a)
    model.setdefault("attention_variant", "dense")  # a checkpoint of Megatron-LM's own script: dense attention
    if not getattr(a, "group_query_attention", False):
        model["num_query_groups"] = getattr(a, "num_attention_heads", None)  # one KV head per head
    if not getattr(a, "multi_latent_attention", False):
        for name in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            model.pop(name, None)
    if not getattr(a, "num_experts", None):
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_layer_freq"):
            model.pop(name, None)
    if getattr(a, "position_embedding_type", None) != "learned_absolute":
        model.pop("max_position_embeddings", None)  # RoPE has no table of positions
    if getattr(a, "tokenizer_type", None) != "NullTokenizer":
        model.pop("vocab_size", None)  # a text tokenizer's size is its own (the embedding rows check it)
    return model


def zero_centered_gamma(a) -> Optional[bool]:
    """--apply-layernorm-1p of arguments `a`: megatron-core 0.19.2 keeps it as layernorm_zero_centered_gamma, a
    checkpoint of an earlier Megatron-LM as apply_layernorm_1p; None if neither is there."""
    value = getattr(a, "layernorm_zero_centered_gamma", None)
    return getattr(a, "apply_layernorm_1p", None) if value is None else value


def _check_checkpoint_model(args, saved, where: str) -> None:
    run, there = _model_arguments(args), _model_arguments(saved)
    if (run.get("hidden_size"), run.get("num_attention_heads")) != \
            (there.get("hidden_size"), there.get("num_attention_heads")):
        run.pop("kv_channels", None)  # derived from those two unless given: their difference says it
    differences = []
    for name, value in run.items():
        if name not in there or there[name] == value:
            continue
        if name == "add_bias_linear":
            name, value, theirs = "disable_bias_linear", not value, not there[name]
        else:
            theirs = there[name]
        flag = "--apply-layernorm-1p" if name == "layernorm_zero_centered_gamma" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            differences.append(f"{flag} {'set' if theirs else 'not set'} there, {'set' if value else 'not set'} here")
        else:
            differences.append(f"{flag} {theirs} there, {value} here")
    if differences:
        hint = "" if args.use_checkpoint_args else ", or --use-checkpoint-args to take them from the checkpoint"
        raise ConfigError(f"{where}: the checkpoint holds another model than these flags build "
                          f"({'; '.join(differences)}); give the model flags of the run that saved it{hint}")


def _te_only_state(args) -> List[str]:
    """The `_extra_state` (FP8 metadata) a Transformer Engine run's model saves and a checkpoint of megatron-core's
    local modules lacks: TE's final norm, and TE's core attention where this run has it (megatron-core's own layer;
    the Litespark layer with --core-attention te, the default under context parallelism), which a checkpoint of
    the Litespark layer's torch SDPA attention lacks too. The linears have one on every backend."""
    state = ["decoder.final_layernorm._extra_state"]
    if SpecChoice.of(args).uses_te_attention(args.transformer_impl, args.core_attention):
        state.append("decoder.layers.self_attention.core_attention._extra_state")
    return state


def parse(argv: Sequence[str], plat) -> argparse.Namespace:
    """argv -> megatron.training's validated args, also set as its global args (get_args())."""
    from megatron.training.global_vars import set_global_variables

    args = parse_checked(argv, plat)
    set_global_variables(args)
    return args


def follow_checkpoint_args(args, checkpoints: Sequence[argparse.Namespace] = ()) -> None:
    """After Megatron-LM's --use-checkpoint-args, given the arguments of the checkpoints it read (in its order, the
    last wins): it takes the checkpoint's --spec over the command line's (a Litespark checkpoint's module/function
    pair; a stock checkpoint saved none, which leaves the command line's), so the run's SpecChoice (its checks, the
    run record's name) follows what will be built, and an automatic core attention is decided again for it. Its loader forces
    the checkpoint's --apply-layernorm-1p under the name of earlier versions (apply_layernorm_1p), which
    megatron-core 0.19.2 neither stores nor builds from: that one is taken here."""
    for saved in checkpoints:
        if zero_centered_gamma(saved) is not None:
            args.layernorm_zero_centered_gamma = zero_centered_gamma(saved)
    if args.spec:
        args.litespark_spec = SpecChoice.of_megatron_spec(args.spec).value
    resolve_core_attention(args)


def parse_checked(argv: Sequence[str], plat) -> argparse.Namespace:
    """argv -> megatron.training's validated args, not yet its global args (which open TensorBoard and W&B)."""
    args = resolve(argv, plat)
    if args.use_checkpoint_args:
        from megatron.training.checkpointing import load_args_from_checkpoint

        if args.load is None and args.pretrained_checkpoint is None:
            raise ConfigError("--use-checkpoint-args needs --load or --pretrained-checkpoint")
        checkpoints = []
        for load_arg in ("pretrained_checkpoint", "load"):
            loaded = load_args_from_checkpoint(args, load_arg=load_arg)
            if isinstance(loaded, tuple):  # (args, the checkpoint's arguments) where it read a checkpoint
                checkpoints.append(loaded[1])
        follow_checkpoint_args(args, checkpoints)
    check(args, plat)
    megatron_validate(args)
    model_config_check(args)
    learning_rate_schedule(args)
    check_checkpoints(args)
    return args


def learning_rate_schedule(args) -> Optional[dict]:
    """The state megatron.training's learning-rate scheduler starts this run with (its own builder, on a copy of the
    arguments, for an optimizer without parameters); None without training. Its bare asserts as one line."""
    if args.skip_train or not (args.train_iters or args.train_samples):
        return None
    import logging
    from types import SimpleNamespace

    from megatron.core import optimizer_param_scheduler
    from megatron.training import global_vars
    from megatron.training.training import get_optimizer_param_scheduler

    previous = global_vars._GLOBAL_ARGS
    global_vars.set_args(argparse.Namespace(**vars(args)))  # the builder reads get_args() and sets some of them
    log = logging.getLogger(optimizer_param_scheduler.__name__)
    level = log.level
    log.setLevel(logging.WARNING)  # its "decay style" line: the run's own scheduler logs it
    try:
        return get_optimizer_param_scheduler(SimpleNamespace(param_groups=[])).state_dict()
    except AssertionError as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        raise ConfigError(f"Megatron-LM refuses this learning-rate schedule: {str(e).strip() or frame.line} "
                          f"({os.path.basename(frame.filename)})") from None
    finally:
        global_vars.set_args(previous)
        log.setLevel(level)


# megatron-core's OptimizerParamScheduler state a resumed run must agree on: what it is, and its unit. The steps are
# samples: iterations x --global-batch-size, or --train-samples.
SCHEDULE = {"max_lr": ("--lr", ""), "min_lr": ("--min-lr", ""), "lr_warmup_steps": ("LR warmup over", " samples"),
            "lr_decay_steps": ("LR decay over", " samples"), "lr_decay_style": ("--lr-decay-style", ""),
            "start_wd": ("--start-weight-decay", ""), "end_wd": ("--end-weight-decay", ""),
            "wd_incr_steps": ("weight-decay increment over", " samples"),
            "wd_incr_style": ("--weight-decay-incr-style", "")}


def _check_checkpoint_schedule(args, saved: Optional[dict], where: str) -> None:
    """A resumed run's learning-rate schedule against the checkpoint's: megatron-core asserts they are equal unless
    told which one to follow (after the process groups are up)."""
    if saved is None or args.override_opt_param_scheduler or args.use_checkpoint_opt_param_scheduler:
        return
    run = learning_rate_schedule(args)
    if run is None:
        return
    differences = []
    for key, (what, unit) in SCHEDULE.items():
        if key in saved and key in run and saved[key] != run[key]:
            theirs, ours = (f"{v:g}" if isinstance(v, float) else str(v) for v in (saved[key], run[key]))
            differences.append(f"{what} {theirs}{unit} there, {ours} here")
    if differences:
        raise ConfigError(f"{where}: its learning-rate schedule is not this run's ({'; '.join(differences)}), and "
                          "megatron-core refuses to resume it so: add --override-opt_param-scheduler to follow this "
                          "run's schedule from the checkpoint's step on, or --use-checkpoint-opt_param-scheduler to "
                          "keep the checkpoint's")
