"""Pieces shared by the command-line apps (tools/mfu.py, tools/energy_to_train.py, tools/scaling_estimate.py, the
benchmark, the efficiency suite, ...): a parser that fails in one line, typed numbers, the model and peak flags.

Model flags keep the Megatron-LM names of litespark-train, so a command line can be pasted between them.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Optional

from litespark_megatron.errors import ConfigError
from litespark_megatron.presets import PRESETS, preset_values
from litespark_megatron.metrics.flops import ModelShape
from litespark_megatron.metrics.peaks import PEAK_TFLOPS, Peak, PeakError, detect_peak


class UsageError(Exception):
    """Bad input to a tool: printed as one line on stderr, exit status 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit status 2, like every other input error here."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def number(text: str, kind, what: str, allow_zero: bool = False):
    """`text` as a finite `kind` (int or float) > 0 (>= 0 with allow_zero), for an argparse `type`; `what` names the
    expected value in the one-line error."""
    try:
        value = kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise argparse.ArgumentTypeError(f"{what} expected, got {text!r}")
    return value


def positive_int(text: str) -> int:
    return number(text, int, "a positive integer")


def positive_float(text: str) -> float:
    return number(text, float, "a positive number")


def non_negative_int(text: str) -> int:
    return number(text, int, "an integer >= 0", allow_zero=True)


def fraction(text: str) -> float:
    value = number(text, float, "a number in (0, 1]")
    if value > 1:
        raise argparse.ArgumentTypeError(f"a number in (0, 1] expected, got {text!r}")
    return value


_SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}


def token_count(text: str) -> int:
    """'627e9', '627B', '1.5T', '500M', '627_000_000_000' -> tokens (positive)."""
    raw = str(text).strip().replace("_", "").replace(",", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)", raw)
    if not m:
        raise argparse.ArgumentTypeError(f"a token count like 627e9, 627B or 1.5T expected, got {text!r}")
    value = float(m.group(1)) * _SUFFIXES.get(m.group(2).upper(), 1)
    if not value >= 1:
        raise argparse.ArgumentTypeError(f"the token count must be at least 1, got {text!r}")
    return int(round(value))


def add_model_args(p: argparse.ArgumentParser, required: bool) -> None:
    g = p.add_argument_group("model (litespark-train flag names; a preset plus overrides)")
    g.add_argument("--model", required=required, default=None, help=f"preset: {', '.join(PRESETS)}")
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
                 "vocab-size", "seq-length", "kv-channels"):
        g.add_argument(f"--{name}", type=positive_int, default=None, help="override the preset")
    g.add_argument("--untie-embeddings-and-output-weights", action=argparse.BooleanOptionalAction, default=None,
                   help="separate output layer (preset decides); changes parameters, not FLOPs")
    g.add_argument("--make-vocab-size-divisible-by", type=positive_int, default=128,
                   help="vocabulary padding, as litespark-train pads it (the logit GEMM uses the padded size)")
    g.add_argument("--swiglu", action=argparse.BooleanOptionalAction, default=True,
                   help="SwiGLU MLP (3 matrices); --no-swiglu: 2-matrix GELU MLP")
    g = p.add_argument_group("mixture of experts (megatron-core names)")
    g.add_argument("--num-experts", type=positive_int, default=None)
    g.add_argument("--moe-router-topk", type=positive_int, default=None, help="default 2 (megatron-core)")
    g.add_argument("--moe-ffn-hidden-size", type=positive_int, default=None, help="default --ffn-hidden-size")
    g.add_argument("--moe-shared-expert-intermediate-size", type=positive_int, default=None)
    g.add_argument("--moe-layer-freq", type=positive_int, default=None, help="every N-th layer is MoE (default 1)")
    g = p.add_argument_group("multi-latent attention (megatron-core names)")
    g.add_argument("--multi-latent-attention", action="store_true")
    g.add_argument("--q-lora-rank", type=positive_int, default=None, help="default: no query compression")
    for name in ("kv-lora-rank", "qk-head-dim", "qk-pos-emb-head-dim", "v-head-dim"):
        g.add_argument(f"--{name}", type=positive_int, default=None, help="default: megatron-core's")


def add_recompute_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("activation recomputation (changes hardware FLOPs / HFU only)")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=positive_int, default=None)
    g.add_argument("--pipeline-model-parallel-size", type=positive_int, default=1,
                   help="only for --recompute-method block (layers per stage)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=positive_int, default=None,
                   help="only for --recompute-method block")


def add_peak_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("GPU peak (MFU denominator)")
    g.add_argument("--gpu", default=None,
                   help=f"GPU name as nvidia-smi prints it or a short name: {', '.join(PEAK_TFLOPS)}")
    g.add_argument("--peak-tflops", type=positive_float, default=None,
                   help="dense peak TFLOP/s per GPU to use instead of the table (wins over --gpu)")
    g.add_argument("--precision", choices=["bf16", "fp16", "fp8"], default="bf16",
                   help="training precision; FP8 MFU is taken against the BF16 dense peak")


# The shape fields a preset fills where no flag overrode them (its other flags, e.g. the activation, are the
# tools' own defaults already).
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length", "untie_embeddings_and_output_weights")


def apply_preset(args: argparse.Namespace) -> None:
    """Fill the model fields of ``args`` from its preset where no flag overrode them."""
    try:
        values = preset_values(args.model)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    values.setdefault("num_query_groups", values["num_attention_heads"])  # an MHA preset has no GQA flags
    values.setdefault("untie_embeddings_and_output_weights", False)
    for name in MODEL_FIELDS:
        if getattr(args, name, None) is None:
            setattr(args, name, values[name])


def shape_from_cli(args: argparse.Namespace) -> ModelShape:
    apply_preset(args)
    mla_flags = [n for n in ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
                 if getattr(args, n) is not None]
    if mla_flags and not args.multi_latent_attention:
        raise UsageError(f"--{mla_flags[0].replace('_', '-')} needs --multi-latent-attention")
    moe_flags = [n for n in ("moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                             "moe_layer_freq") if getattr(args, n) is not None]
    if moe_flags and not args.num_experts:
        raise UsageError(f"--{moe_flags[0].replace('_', '-')} needs --num-experts")
    try:
        return ModelShape.from_args(args)
    except ValueError as e:
        raise UsageError(f"invalid model shape: {e}") from None


def resolve_peak(args: argparse.Namespace, needed_for: str) -> Peak:
    if args.gpu is None and args.peak_tflops is None:
        raise UsageError(f"{needed_for} needs the GPU: pass --gpu (e.g. H100, H200) or --peak-tflops")
    try:
        return detect_peak(args.gpu, args.precision, override=args.peak_tflops)
    except PeakError as e:
        raise UsageError(str(e)) from None


def describe_shape(name: Optional[str], s: ModelShape) -> str:
    mlp = "SwiGLU" if s.gated_linear_unit else "GELU"
    if s.mla is not None:
        m = s.mla
        attn = (f"MLA {s.num_attention_heads} heads (q_lora_rank {m.q_lora_rank}, kv_lora_rank {m.kv_lora_rank}, "
                f"qk {m.qk_head_dim}+{m.qk_pos_emb_head_dim}, v {m.v_head_dim})")
    else:
        attn = f"{s.num_attention_heads} heads / {s.num_query_groups} query groups, head dim {s.kv_channels}"
    text = (f"{name or 'custom'}: {s.num_layers} layers, hidden {s.hidden_size}, FFN {s.ffn_hidden_size} {mlp}, "
            f"{attn}, "
            f"vocab {s.vocab_size} (padded), seq {s.seq_length}, "
            f"{'untied' if s.untie_embeddings_and_output_weights else 'tied'} embeddings")
    if s.moe is not None:
        m = s.moe
        text += (f", MoE {m.num_experts} experts top-{m.moe_router_topk} (expert FFN "
                 f"{m.moe_ffn_hidden_size or s.ffn_hidden_size}, shared {m.moe_shared_expert_intermediate_size or 0}, "
                 f"{s.num_moe_layers} MoE layers)")
    return text


def run_main(body, argv, parser: argparse.ArgumentParser) -> int:
    """Parse, run ``body(args)``; UsageError -> one line on stderr and 2. Returns the exit status (also for
    --help and argparse errors, which argparse reports by raising SystemExit)."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        return body(args)
    except UsageError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2


def report_main(argv, parser: argparse.ArgumentParser, compute, render) -> int:
    """The main() of a report tool: parse, ``out = compute(args)``, print ``render(out)`` (or the JSON of ``out``
    with --json); bad input as in run_main."""
    def body(args) -> int:
        out = compute(args)
        print(json.dumps(out, indent=2) if args.json else render(out))
        return 0

    return run_main(body, argv, parser)


def fmt_int(x: float) -> str:
    return f"{int(round(x)):,}"


def fmt_sig(x: float, digits: int = 4) -> str:
    """Engineering-style short form: 21.39 G, 4.486e+16 -> '44.86 P'."""
    for scale, suffix in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g} {suffix}"
    return f"{x:.{digits}g} "
