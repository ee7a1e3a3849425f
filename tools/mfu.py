#!/usr/bin/env python3
"""FLOPs, parameters and MFU of a model preset: from a measured throughput, or the throughput an MFU implies.

    python tools/mfu.py --model llama-3b --gpu H200 --tokens-per-sec-per-gpu 9000
    python tools/mfu.py --model llama-30b --seq-length 4096 --gpu H100 --mfu 0.45 --json

Both attention conventions are printed ("half": causal attention halved, Megatron-LM; "full": no causal
skipping, NeMo tables); docs/metrics.md gives every formula.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps import cli  # noqa: E402
from litespark_megatron.metrics.flops import (  # noqa: E402
    CAUSAL_CONVENTIONS,
    param_count,
    recompute_from_args,
    training_flops_per_step,
)
from litespark_megatron.metrics.peaks import mfu as mfu_of  # noqa: E402

CONVENTION_LABEL = {"half": "causal-half (Megatron-LM)", "full": "full attention (NeMo tables)"}


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="mfu", description=__doc__.split("\n\n")[0])
    cli.add_model_args(p, required=True)
    cli.add_recompute_args(p)
    cli.add_peak_args(p)
    p.add_argument("--global-batch-size", type=cli.positive_int, default=None,
                   help="sequences per optimizer step: adds per-step FLOPs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--tokens-per-sec-per-gpu", type=cli.positive_float, default=None,
                   help="measured training throughput per GPU -> achieved TFLOP/s and MFU")
    g.add_argument("--mfu", type=cli.fraction, default=None,
                   help="assumed MFU as a fraction (0.45) -> the tokens/s per GPU it implies")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def compute(args) -> dict:
    shape = cli.shape_from_cli(args)
    try:
        recompute = recompute_from_args(args)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    params = param_count(shape)
    # Per token: one sequence's worth of FLOPs divided by its tokens (global batch 1).
    per_token = {c: training_flops_per_step(shape, 1, causal=c, **recompute) for c in ("half", "full")}
    out = {
        "model": {"preset": args.model, "description": cli.describe_shape(args.model, shape),
                  "num_layers": shape.num_layers, "hidden_size": shape.hidden_size,
                  "ffn_hidden_size": shape.ffn_hidden_size, "num_attention_heads": shape.num_attention_heads,
                  "num_query_groups": shape.num_query_groups, "kv_channels": shape.kv_channels,
                  "padded_vocab_size": shape.vocab_size, "seq_length": shape.seq_length,
                  "swiglu": shape.gated_linear_unit,
                  "untie_embeddings_and_output_weights": shape.untie_embeddings_and_output_weights},
        "params": params.as_dict(),
        "recompute": per_token["half"].recompute,
        "conventions": CAUSAL_CONVENTIONS,
        "flops_per_token": {c: {"model": f.model_flops_per_token, "hardware": f.hardware_flops_per_token,
                                "model_breakdown": f.model_breakdown.scaled(1 / f.tokens).as_dict()}
                            for c, f in per_token.items()},
        "flops_per_step": None, "peak": None, "measured": None, "assumed": None,
    }
    if args.global_batch_size is not None:
        step = {c: training_flops_per_step(shape, args.global_batch_size, causal=c, **recompute)
                for c in ("half", "full")}
        out["flops_per_step"] = {"global_batch_size": args.global_batch_size, "tokens": step["half"].tokens,
                                 **{c: {"model": f.model_flops, "hardware": f.hardware_flops}
                                    for c, f in step.items()}}
    if args.tokens_per_sec_per_gpu is None and args.mfu is None:
        if args.gpu is not None or args.peak_tflops is not None:
            out["peak"] = cli.resolve_peak(args, "the peak").as_dict()
        return out
    peak = cli.resolve_peak(args, "--tokens-per-sec-per-gpu/--mfu")
    out["peak"] = peak.as_dict()
    if args.tokens_per_sec_per_gpu is not None:
        tps = args.tokens_per_sec_per_gpu
        measured = {"tokens_per_sec_per_gpu": tps}
        for c, f in per_token.items():
            model_rate = tps * f.model_flops_per_token
            hw_rate = tps * f.hardware_flops_per_token
            measured[c] = {"model_tflops_per_gpu": model_rate / 1e12, "mfu": mfu_of(model_rate, peak),
                           "hardware_tflops_per_gpu": hw_rate / 1e12, "hfu": mfu_of(hw_rate, peak)}
        out["measured"] = measured
    else:
        rate = args.mfu * peak.tflops * 1e12
        assumed = {"mfu": args.mfu, "model_tflops_per_gpu": rate / 1e12}
        for c, f in per_token.items():
            assumed[c] = {"tokens_per_sec_per_gpu": rate / f.model_flops_per_token}
        out["assumed"] = assumed
    return out


def render(out: dict) -> str:
    lines = [f"model {out['model']['description']}"]
    p = out["params"]
    lines.append(f"parameters: {cli.fmt_int(p['total'])} total = embedding {cli.fmt_int(p['embedding'])} + "
                 f"output layer {cli.fmt_int(p['output_layer'])} + transformer layers "
                 f"{cli.fmt_int(p['transformer_layers'])} + final norm {cli.fmt_int(p['final_norm'])}")
    if p["active"] != p["total"]:
        lines.append(f"  active per token (MoE: top-k experts only): {cli.fmt_int(p['active'])}")
    lines.append("training FLOPs per token (forward + backward = 3 x forward; matrix multiplications only):")
    half, full = out["flops_per_token"]["half"], out["flops_per_token"]["full"]
    lines.append(f"  {'part':<31}{CONVENTION_LABEL['half']:>26}{CONVENTION_LABEL['full']:>31}")
    for part, value in full["model_breakdown"].items():
        if value:
            lines.append(f"  {part:<31}{cli.fmt_int(half['model_breakdown'][part]):>26}{cli.fmt_int(value):>31}")
    lines.append(f"  {'total (model FLOPs)':<31}{cli.fmt_int(half['model']):>26}{cli.fmt_int(full['model']):>31}")
    if out["recompute"]:
        lines.append(f"  {'hardware (' + out['recompute'] + ' recompute)':<31}"
                     f"{cli.fmt_int(half['hardware']):>26}{cli.fmt_int(full['hardware']):>31}")
    step = out["flops_per_step"]
    if step:
        lines.append(f"training FLOPs per step (global batch {step['global_batch_size']} = "
                     f"{cli.fmt_int(step['tokens'])} tokens):")
        for c in ("half", "full"):
            lines.append(f"  {CONVENTION_LABEL[c]:<30} {step[c]['model']:.6e}"
                         + (f"  (hardware {step[c]['hardware']:.6e})" if out["recompute"] else ""))
    peak = out["peak"]
    if peak:
        if peak["mfu_basis"] == "override":
            lines.append(f"peak: {peak['tflops']:g} TFLOP/s per GPU (--peak-tflops), {peak['precision']} run")
        else:
            basis = peak["mfu_basis"].split("-")[0]
            lines.append(f"peak: {peak['device']} {peak['tflops']:g} TFLOP/s per GPU, dense {basis} (datasheet); "
                         f"MFU basis {peak['mfu_basis']}" +
                         (f" (FP8 dense peak {peak['precision_peak_tflops']:g} not used for MFU)"
                          if peak["precision"] == "fp8" else ""))
    m = out["measured"]
    if m:
        lines.append(f"measured {m['tokens_per_sec_per_gpu']:,.1f} tokens/s per GPU:")
        for c in ("half", "full"):
            lines.append(f"  {CONVENTION_LABEL[c]:<30} {m[c]['model_tflops_per_gpu']:8.1f} TFLOP/s per GPU  "
                         f"MFU {100 * m[c]['mfu']:.2f}%" +
                         (f"  (HFU {100 * m[c]['hfu']:.2f}%)" if out["recompute"] else ""))
    a = out["assumed"]
    if a:
        lines.append(f"assumed MFU {100 * a['mfu']:.2f}% = {a['model_tflops_per_gpu']:.1f} TFLOP/s per GPU of model "
                     f"FLOPs:")
        for c in ("half", "full"):
            lines.append(f"  {CONVENTION_LABEL[c]:<30} {a[c]['tokens_per_sec_per_gpu']:10,.1f} tokens/s per GPU")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.report_main(argv, build_parser(), compute, render)


if __name__ == "__main__":
    sys.exit(main())
