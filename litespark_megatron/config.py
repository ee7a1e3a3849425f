"""Model presets, the command line (Megatron-LM flag names) and its validation.

A preset is data: a `ModelPreset`. Every field of it can be overridden by the Megatron-LM flag of the same name,
and every flag can also come from a YAML file given with `--config` (same keys; flags on the command line win).
`resolve()` turns argv into one `argparse.Namespace`; `validate()` checks it against the world it will run in and
raises `ConfigError` with one clear message, before any process group, model or file exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Optional, Sequence


class UserError(Exception):
    """Bad input the user can fix: printed as one line, exit code 2, no traceback."""


class ConfigError(UserError, ValueError):
    """A configuration that cannot run. The message says what is wrong and what to do."""


@dataclass(frozen=True)
class ModelPreset:
    """Shape of a Llama-style decoder (RMSNorm, GQA attention with RoPE, SwiGLU MLP, no biases)."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int
    rotary_base: int = 500000
    norm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = True
    description: str = ""


PRESETS = {
    # Small enough for CPU tests and the quickstart; 4 layers so that PP2 x 2 virtual stages is possible.
    "tiny": ModelPreset(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4,
                        num_query_groups=2, vocab_size=4096, seq_length=128, max_position_embeddings=4096,
                        rotary_base=10000, description="test/quickstart model, ~2M parameters"),
    # Llama-3.2-1B shape (untied here: the benchmark shapes are untied).
    "llama-1b": ModelPreset(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                            num_query_groups=8, vocab_size=128256, seq_length=4096,
                            max_position_embeddings=131072, description="Llama-3.2-1B shape, untied"),
    # Llama-3.2-3B shape: the 3B size of the Litespark paper.
    "llama-3b": ModelPreset(num_layers=28, hidden_size=3072, ffn_hidden_size=8192, num_attention_heads=24,
                            num_query_groups=8, vocab_size=128256, seq_length=4096,
                            max_position_embeddings=131072, description="Llama-3.2-3B shape, untied"),
    "llama3-8b": ModelPreset(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                             num_query_groups=8, vocab_size=128256, seq_length=8192,
                             max_position_embeddings=131072, description="Llama-3-8B"),
    # LLaMA-30B shape (multi-head attention, 32k vocabulary): the 30B size of the Litespark paper.
    "llama-30b": ModelPreset(num_layers=60, hidden_size=6656, ffn_hidden_size=17920, num_attention_heads=52,
                             num_query_groups=52, vocab_size=32000, seq_length=4096,
                             max_position_embeddings=4096, rotary_base=10000,
                             description="LLaMA-30B shape (MHA, 32k vocab)"),
    # Base sizes of the efficiency suite (tools/efficiency_suite.py): Llama-style, GQA with 4 KV groups, SwiGLU with
    # a 4x FFN (as Llama-3.2), untied, 32k vocabulary (LLaMA/Llama-2 size). Head dim 64 (0.5b) and 128 (1.5b), so
    # that TP 1, 2, 4 divide both the heads and the KV groups. Parameter counts: docs/metrics.md.
    "eff-0.5b": ModelPreset(num_layers=28, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16,
                            num_query_groups=4, vocab_size=32000, seq_length=2048, max_position_embeddings=4096,
                            rotary_base=10000, description="efficiency-suite base, ~0.49B parameters (32k vocab)"),
    "eff-1.5b": ModelPreset(num_layers=22, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
                            num_query_groups=4, vocab_size=32000, seq_length=2048, max_position_embeddings=4096,
                            rotary_base=10000, description="efficiency-suite base, ~1.47B parameters (32k vocab)"),
}

MODEL_FIELDS = [f.name for f in dataclasses.fields(ModelPreset) if f.name != "description"]
SPECS = ("litespark", "stock-te", "stock-local")
BACKENDS = ("auto", "te", "local")
POSITION_EMBEDDINGS = ("rope", "none")
MOE_DISPATCHERS = ("allgather", "alltoall")
# MoE flags that mean nothing without --num-experts (given alone, they are refused rather than ignored).
MOE_FLAGS = ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "moe_aux_loss_coeff",
             "moe_token_dispatcher_type")
MLA_FLAGS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


def _bool_pair(group, name: str, default: Optional[bool], help: str):
    """--name / --no-name, default None where the preset decides."""
    group.add_argument(f"--{name}", dest=name.replace("-", "_"), action=argparse.BooleanOptionalAction,
                       default=default, help=help)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="litespark-train",
        description="Pretrain a Llama-style model with Litespark layers on Megatron-Core. Flags use Megatron-LM "
                    "names; every flag may also be a key of the --config YAML file (flags win).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", help="YAML file whose keys are these flags (dashes or underscores)")

    g = p.add_argument_group("model")
    g.add_argument("--model", default="tiny", help=f"preset: {', '.join(PRESETS)}")
    g.add_argument("--spec", default="litespark", help=f"layer spec: {', '.join(SPECS)}")
    g.add_argument("--transformer-impl", dest="backend", default="auto",
                   help="litespark backend: te (or transformer_engine: Transformer Engine), local (megatron-core "
                        "local modules, runs on CPU) or auto (te when importable and on GPU)")
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
                 "vocab-size", "seq-length", "max-position-embeddings", "rotary-base"):
        g.add_argument(f"--{name}", type=int, default=None, help="override the preset")
    g.add_argument("--norm-epsilon", type=float, default=None, help="override the preset")
    _bool_pair(g, "untie-embeddings-and-output-weights", None, "separate output layer (preset decides)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this (independent of TP, so that every layout "
                        "computes the same softmax)")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDINGS, default="rope",
                   help="rope (Llama) or none (NoPE: no positional encoding; causal masking alone orders tokens)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)

    g = p.add_argument_group(
        "multi-latent attention (MLA, DeepSeek-V2; megatron-core MLASelfAttention)",
        "Defaults follow DeepSeek-V2's proportions from the preset's head dim d = hidden / heads: qk-head-dim = "
        "v-head-dim = d, qk-pos-emb-head-dim = d/2, kv-lora-rank = 4d, no query compression (as DeepSeek-V2-Lite). "
        "RoPE is plain RoPE (base --rotary-base) on the decoupled qk-pos-emb part.")
    g.add_argument("--multi-latent-attention", action="store_true", help="use MLA instead of GQA/MHA attention")
    g.add_argument("--q-lora-rank", type=int, default=None, help="query compression rank (default: none)")
    g.add_argument("--kv-lora-rank", type=int, default=None, help="key/value latent rank (default: 4d)")
    g.add_argument("--qk-head-dim", type=int, default=None, help="per-head q/k dim without RoPE (default: d)")
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=None, help="per-head RoPE q/k dim (default: d/2)")
    g.add_argument("--v-head-dim", type=int, default=None, help="per-head value dim (default: d)")

    g = p.add_argument_group("mixture of experts (MoE; megatron-core MoELayer in every layer)")
    g.add_argument("--num-experts", type=int, default=None, help="routed experts per layer (default: dense MLP)")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token (default 2)")
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (needed for top-1)")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="FFN size of each expert "
                   "(default: --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="total FFN size of the shared experts every token runs through (default: none)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=None,
                   help="load-balancing auxiliary loss coefficient (default 0.0; its gradient is added, the logged "
                        "loss is the language-model loss alone)")
    g.add_argument("--moe-token-dispatcher-type", choices=MOE_DISPATCHERS, default=None,
                   help="how tokens reach their experts (default allgather)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="run the local experts as one grouped GEMM (Transformer Engine's TEGroupedMLP)")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="spread the experts of each MoE layer over this many ranks (taken from the data-parallel "
                        "ranks; expert tensor parallelism equals --tensor-model-parallel-size)")
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--distributed-backend", choices=["auto", "nccl", "gloo"], default="auto")
    g.add_argument("--distributed-timeout-minutes", type=int, default=10)

    g = p.add_argument_group("precision")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None, help="enable FP8 (TE on Hopper+)")
    g.add_argument("--fp8-recipe", choices=["delayed", "tensorwise", "mxfp8", "blockwise"], default="delayed")
    g.add_argument("--loss-scale", type=float, default=None, help="static fp16 loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)

    g = p.add_argument_group("kernel fusions (Megatron-LM names; each applies where its modules are in use)")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="TE linears accumulate weight gradients into the fp32 main_grad buffers inside their wgrad "
                        "GEMM (on by default on GPU with TE; megatron's own linears need Apex for it)")
    g.add_argument("--no-rope-fusion", dest="rope_fusion", action="store_false",
                   help="RoPE in megatron-core's plain torch ops instead of TE's fused kernel (on by default where "
                        "TE is installed; on GPUs without TE the Litespark layer runs a torch.compile'd RoPE)")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="fused vocab-parallel cross-entropy (one kernel instead of several passes over the logits)")
    g.add_argument("--cross-entropy-fusion-impl", choices=["native", "te"], default="native",
                   help="with --cross-entropy-loss-fusion: megatron-core's fused kernel (bf16 runs only: it rounds the "
                        "logits gradient to bf16) or TE's Triton kernel")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default: micro-batch x data parallel")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--lr", type=float, default=3e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="indexed dataset prefixes, optionally with weights: [W1] PREFIX1 [W2] PREFIX2 ...")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions of each prefix")
    g.add_argument("--mock-data", action="store_true", help="random tokens, no files (smoke tests, benchmarks)")
    g.add_argument("--tokenizer-type", default=None,
                   help="HuggingFaceTokenizer (a tokenizer directory) or ByteLevelBPE (a tokenizer.json); "
                        "default: the one saved next to the data")
    g.add_argument("--tokenizer-model", default=None, help="path of the tokenizer directory or file")
    g.add_argument("--data-cache-path", default=None, help="where megatron-core caches dataset indices")
    g.add_argument("--num-workers", type=int, default=0)

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (saving a checkpoint if --save is set) once the iteration is a multiple of this")

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=int, default=None)
    g.add_argument("--eval-iters", type=int, default=10)
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--metrics-file", default=None, help="default: metrics.jsonl in --save (or the TB dir)")
    g.add_argument("--peak-tflops", type=float, default=None, help="override the detected dense peak (MFU)")

    g = p.add_argument_group("profiling (Megatron-LM names; torch.profiler)")
    g.add_argument("--profile", action="store_true",
                   help="run the steps from --profile-step-start to --profile-step-end under torch.profiler on "
                        "--profile-ranks; writes <run dir>/profile/rank<R>.md (GPU time by category, top kernels), "
                        ".json and .trace.json.gz (Chrome/Perfetto trace)")
    g.add_argument("--profile-step-start", type=int, default=10, help="first profiled step (steps done before it)")
    g.add_argument("--profile-step-end", type=int, default=12, help="profiling stops once this many steps are done")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="global ranks that profile")
    return p


def _normalize_key(key: str) -> str:
    return key.strip().lstrip("-").replace("-", "_")


def _load_yaml(path: str, parser: argparse.ArgumentParser) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values")
    known = {a.dest for a in parser._actions}
    out = {}
    for k, v in data.items():
        key = _normalize_key(str(k))
        if key == "transformer_impl":
            key = "backend"
        if key not in known or key == "config":
            raise ConfigError(f"--config {path}: unknown key '{k}' (keys are the flags of litespark-train --help)")
        out[key] = v
    return out


def resolve(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """argv -> Namespace with the preset applied. Raises ConfigError (never SystemExit) on a bad preset/file."""
    parser = build_parser()
    known, _ = parser.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**_load_yaml(known.config, parser))
    args = parser.parse_args(argv)
    if args.model not in PRESETS:
        raise ConfigError(f"unknown model preset '{args.model}'; choose one of: {', '.join(PRESETS)}")
    preset = PRESETS[args.model]
    args.preset_fields = []  # fields taken from the preset (not given): e.g. the vocabulary may follow the data
    for name in MODEL_FIELDS:
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(preset, name))
            args.preset_fields.append(name)
    if args.spec not in SPECS:
        raise ConfigError(f"unknown --spec '{args.spec}'; choose one of: {', '.join(SPECS)}")
    if args.backend == "transformer_engine":  # Megatron-LM's spelling
        args.backend = "te"
    if args.backend not in BACKENDS:
        raise ConfigError(f"unknown --transformer-impl '{args.backend}'; choose one of: {', '.join(BACKENDS)}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    _resolve_architecture(args)
    return args


def _resolve_architecture(args: argparse.Namespace) -> None:
    """Fill the MoE and MLA defaults, so that the namespace holds the numbers the model is built with (the FLOP
    counter and the saved config.yaml read them from here)."""
    if args.num_experts is None:
        given = [f for f in MOE_FLAGS if getattr(args, f) is not None]
        given += [f for f in ("moe_grouped_gemm", "moe_router_pre_softmax") if getattr(args, f)]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --num-experts (the model is dense without it)")
    else:
        for name, default in (("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.0),
                              ("moe_token_dispatcher_type", "allgather"), ("moe_ffn_hidden_size", args.ffn_hidden_size)):
            if getattr(args, name) is None:
                setattr(args, name, default)
    if not args.multi_latent_attention:
        given = [f for f in MLA_FLAGS if getattr(args, f) is not None]
        if given:
            raise ConfigError(f"--{given[0].replace('_', '-')} needs --multi-latent-attention")
        return
    if "num_query_groups" not in args.preset_fields and args.num_query_groups != args.num_attention_heads:
        raise ConfigError(f"--num-query-groups {args.num_query_groups} has no meaning with --multi-latent-attention: "
                          f"MLA gives every head its own keys and values (up-projected from one shared latent); "
                          f"drop --num-query-groups or --multi-latent-attention")
    args.num_query_groups = args.num_attention_heads
    head_dim = args.hidden_size // max(args.num_attention_heads, 1)
    for name, default in (("qk_head_dim", head_dim), ("v_head_dim", head_dim), ("qk_pos_emb_head_dim", head_dim // 2),
                          ("kv_lora_rank", 4 * head_dim)):
        if getattr(args, name) is None:
            setattr(args, name, default)


def data_parallel_size(args, world_size: int) -> int:
    return world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
                          * args.context_parallel_size)


def virtual_pipeline_size(args) -> Optional[int]:
    if args.num_layers_per_virtual_pipeline_stage is None:
        return None
    return args.num_layers // (args.pipeline_model_parallel_size * args.num_layers_per_virtual_pipeline_stage)


def validate(args: argparse.Namespace, world_size: int, *, cuda: bool, te: bool, fp8_capable: bool = False) -> None:
    """Check everything that can be checked before any work. One ConfigError, the first problem found."""
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    for name, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--context-parallel-size", cp), ("--micro-batch-size", args.micro_batch_size),
                    ("--num-layers", args.num_layers), ("--seq-length", args.seq_length)):
        if v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    if world_size % (tp * pp * cp):
        raise ConfigError(
            f"world size {world_size} is not divisible by TP x PP x CP = {tp} x {pp} x {cp} = {tp * pp * cp}; "
            f"start a multiple of {tp * pp * cp} processes or change the layout")
    if args.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if args.num_query_groups % tp:
        kind = "MQA has one KV head" if args.num_query_groups == 1 else "GQA"
        raise ConfigError(f"--num-query-groups (KV heads) {args.num_query_groups} is not divisible by "
                          f"--tensor-model-parallel-size {tp}: megatron-core's attention gives every TP rank whole "
                          f"KV heads ({kind}); use a TP that divides {args.num_query_groups} (and data parallelism "
                          f"for the other GPUs), or more --num-query-groups")
    if args.num_attention_heads % args.num_query_groups:
        raise ConfigError(f"--num-attention-heads {args.num_attention_heads} is not a multiple of "
                          f"--num-query-groups {args.num_query_groups}")
    if args.hidden_size % args.num_attention_heads:
        raise ConfigError(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                          f"{args.num_attention_heads}")
    if args.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by TP {tp}")
    vp = args.num_layers_per_virtual_pipeline_stage
    if vp is not None:
        if pp < 2:
            raise ConfigError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size >= 2")
        if args.num_layers % (pp * vp):
            raise ConfigError(f"--num-layers {args.num_layers} is not divisible by PP x layers per virtual stage "
                              f"= {pp} x {vp}")
    elif args.num_layers % pp:
        raise ConfigError(f"--num-layers {args.num_layers} is not divisible by --pipeline-model-parallel-size {pp}")
    if args.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits activations "
                          "across the TP group)")
    if args.bf16 and args.fp16:
        raise ConfigError("--bf16 and --fp16 are exclusive; pick one")
    backend = resolved_backend(args, cuda=cuda, te=te)
    if cp > 1:
        if args.spec == "stock-local":
            raise ConfigError("--context-parallel-size > 1: the stock-local spec's attention (megatron-core's "
                              "DotProductAttention) has no context parallelism; use --spec litespark (either "
                              "backend) or stock-te")
        if args.seq_length % (2 * cp):
            raise ConfigError(f"--seq-length {args.seq_length} must be divisible by 2 x CP = {2 * cp}")
    if args.fp8_format is not None:
        if not te:
            raise ConfigError("FP8 (--fp8-format) needs Transformer Engine, which is not importable here: "
                              "pip install 'litespark-megatron[te]' on a GPU machine, or drop --fp8-format")
        if not cuda:
            raise ConfigError("FP8 (--fp8-format) needs a CUDA GPU (Hopper or newer); none is visible")
        if not fp8_capable:
            raise ConfigError("FP8 (--fp8-format) needs a GPU with FP8 tensor cores (compute capability >= 8.9, "
                              "e.g. H100/H200/L40S); this GPU has none: use --bf16")
        if backend != "te" and args.spec != "stock-te":
            raise ConfigError("FP8 needs Transformer Engine modules: use --transformer-impl te (or auto)")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "native" and not args.bf16:
        raise ConfigError("--cross-entropy-loss-fusion with --cross-entropy-fusion-impl native needs --bf16: "
                          "megatron-core's fused kernel rounds the logits gradient to bf16 (2e-3 off in an fp32 "
                          "run); use --cross-entropy-fusion-impl te, or drop the flag")
    if args.cross_entropy_loss_fusion and args.cross_entropy_fusion_impl == "te" and not te:
        raise ConfigError("--cross-entropy-fusion-impl te needs Transformer Engine, which is not importable here; "
                          "use --cross-entropy-fusion-impl native")
    if args.spec == "stock-te" and not te:
        raise ConfigError("--spec stock-te needs Transformer Engine, which is not importable here; "
                          "use --spec stock-local or --spec litespark")
    if args.spec == "stock-te" and not cuda:
        raise ConfigError("--spec stock-te needs a CUDA GPU; on CPU use --spec stock-local or litespark")
    if args.make_vocab_size_divisible_by % tp:
        raise ConfigError(f"--make-vocab-size-divisible-by {args.make_vocab_size_divisible_by} must be a "
                          f"multiple of TP {tp}")
    dp = data_parallel_size(args, world_size)
    gbs = args.global_batch_size or args.micro_batch_size * dp
    if gbs % (args.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {gbs} is not divisible by micro-batch x data-parallel = "
                          f"{args.micro_batch_size} x {dp} = {args.micro_batch_size * dp}")
    if args.train_iters < 0:
        raise ConfigError(f"--train-iters must be >= 0, got {args.train_iters}")
    if args.profile:
        _validate_profile(args, world_size)
    _validate_architecture(args, world_size, backend, cuda)


def _validate_profile(args, world_size: int) -> None:
    start, end = args.profile_step_start, args.profile_step_end
    if not (args.save or args.tensorboard_dir):
        raise ConfigError("--profile writes its files into the run directory: give --save or --tensorboard-dir")
    if not 0 <= start < end <= args.train_iters:
        raise ConfigError(f"--profile-step-start {start} and --profile-step-end {end} must satisfy 0 <= start < end "
                          f"<= --train-iters {args.train_iters}")
    bad = [r for r in args.profile_ranks if not 0 <= r < world_size]
    if bad:
        raise ConfigError(f"--profile-ranks {' '.join(map(str, bad))}: no such rank in a world of {world_size} "
                          f"(ranks 0..{world_size - 1})")


def _validate_architecture(args, world_size: int, backend: str, cuda: bool) -> None:
    """Position encoding, MLA and MoE against the layout and the backend."""
    tp, pp, ep = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.expert_model_parallel_size
    te_modules = backend == "te" or args.spec == "stock-te"
    if args.multi_latent_attention:
        if args.position_embedding_type != "rope":
            raise ConfigError("--position-embedding-type none cannot be combined with --multi-latent-attention: MLA "
                              "applies its own decoupled RoPE inside the attention")
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(args, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
        if args.q_lora_rank is not None and args.q_lora_rank < 1:
            raise ConfigError(f"--q-lora-rank must be >= 1 (or left out for no query compression), "
                              f"got {args.q_lora_rank}")
        if args.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"--qk-pos-emb-head-dim {args.qk_pos_emb_head_dim} must be even (RoPE rotates pairs)")
        if tp > 1 and not args.sequence_parallel:
            raise ConfigError("--multi-latent-attention with --tensor-model-parallel-size > 1 needs "
                              "--sequence-parallel: megatron-core replicates MLA's latent down-projections on every "
                              "TP rank and sums their gradients (and the shared RoPE key's) over the sequence-parallel "
                              "region; without SP each rank keeps only its own heads' share of them")
        if args.spec == "stock-local":
            raise ConfigError("--spec stock-local cannot build MLA with megatron-core 0.16.1 (its local MLA spec "
                              "passes k_channels to DotProductAttention, which does not take it): use --spec "
                              "litespark (local or te backend) or --spec stock-te")
    if ep < 1:
        raise ConfigError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    if args.num_experts is None:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs an MoE model (--num-experts)")
        return
    e, k = args.num_experts, args.moe_router_topk
    if e < 1:
        raise ConfigError(f"--num-experts must be >= 1, got {e}")
    if not 1 <= k <= e:
        raise ConfigError(f"--moe-router-topk must be between 1 and --num-experts ({e}), got {k}")
    if k == 1 and not args.moe_router_pre_softmax:
        raise ConfigError("--moe-router-topk 1 needs --moe-router-pre-softmax (a softmax over the one chosen expert "
                          "is constant 1, so the router would get no gradient)")
    if e % ep:
        raise ConfigError(f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}: every expert-"
                          f"parallel rank holds the same number of experts")
    if world_size % (tp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by TP x EP x PP = {tp} x {ep} x {pp} = "
                          f"{tp * ep * pp} (the expert layout); start a multiple of {tp * ep * pp} processes or "
                          f"lower --expert-model-parallel-size")
    if tp > 1 and not args.sequence_parallel:
        raise ConfigError("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (megatron-core's "
                          "MoE layer refuses to train without it: every TP rank would route the same tokens)")
    for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
        v = getattr(args, name)
        if v is not None and (v < 1 or v % tp):
            raise ConfigError(f"--{name.replace('_', '-')} {v} must be >= 1 and divisible by TP {tp}")
    if args.moe_token_dispatcher_type == "alltoall" and tp > 1 and (not cuda or args.distributed_backend == "gloo"):
        raise ConfigError("--moe-token-dispatcher-type alltoall with --tensor-model-parallel-size > 1 gathers uneven "
                          "token counts over the TP group, which gloo (the CPU backend) cannot do; use "
                          "--moe-token-dispatcher-type allgather here, or NCCL on GPUs")
    if args.moe_aux_loss_coeff < 0:
        raise ConfigError(f"--moe-aux-loss-coeff must be >= 0, got {args.moe_aux_loss_coeff}")
    if args.moe_grouped_gemm and not te_modules:
        raise ConfigError("--moe-grouped-gemm needs Transformer Engine (TEGroupedMLP): use --transformer-impl te "
                          "on a GPU with TE installed, or drop --moe-grouped-gemm (the experts then run one after "
                          "another as megatron-core's SequentialMLP)")


def resolved_backend(args, *, cuda: bool, te: bool) -> str:
    """Which Litespark backend runs: 'te' or 'local'."""
    if args.backend == "te":
        if not te:
            raise ConfigError("--transformer-impl te: Transformer Engine is not importable here "
                              "(pip install 'litespark-megatron[te]'), or use --transformer-impl local")
        if not cuda:
            raise ConfigError("--transformer-impl te needs a CUDA GPU; on CPU use --transformer-impl local")
        return "te"
    if args.backend == "local":
        return "local"
    return "te" if (te and cuda) else "local"


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    return -(-vocab_size // divisible_by) * divisible_by
