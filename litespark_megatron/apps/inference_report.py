"""The inference benchmark's report, from its recorded runs: OUT/inference.md (two tables: size and quality per
variant, speed, memory and energy per variant and batch size) and OUT/inference.json (every number, with its spread
over repeats). Numbers nobody measured stay None ("not measured"); nothing is filled in.

Cross-variant numbers are computed here, from what each variant's process recorded: the size ratio to bf16 (bytes
as stored), top-1 agreement with bf16 (the two runs' saved predictions on the same windows) and the model
compression rate, measured (bytes) and nominal (16 / bits, EfficientLLM's form: 3.69 for its Qwen2.5-32B int4).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

from .findings import interval
from .inference_quality import agreement, compression_rate
from .inference_variants import VARIANTS

REFERENCE = "bf16"
VARIANT_KEYS = ("weight_bytes", "perplexity", "top1_accuracy", "load_and_quantize_s")
BATCH_KEYS = ("ttft_s", "decode_s_per_token", "it_tokens_per_s", "peak_memory_gb", "power_w", "joules_per_token",
              "decode_bandwidth_gbs", "mbu")


def _results(settings, state: dict, name: str) -> List[dict]:
    out = []
    for run_id in settings.run_ids(name):
        path = settings.out / "runs" / run_id / "result.json"
        if state["runs"].get(run_id, {}).get("status") == "done" and path.exists():
            out.append(json.loads(path.read_text()))
    return out


def _predictions(settings, name: str):
    import torch

    path = settings.out / "runs" / name / "predictions.pt"
    return torch.load(path) if path.exists() else None


def collect_rows(settings, state: dict) -> List[dict]:
    rows = []
    for name in settings.variants:
        results = _results(settings, state, name)
        entries = [state["runs"].get(r, {}) for r in settings.run_ids(name)]
        row = dict(variant=name, what=VARIANTS[name].what, weight_bits_nominal=VARIANTS[name].weight_bits,
                   repeats_done=len(results), spread={}, batches=[], error=None)
        if entries[0].get("status") == "cannot run here":
            row.update(status="cannot run here", error=entries[0].get("error"))
        elif len(results) == settings.repeats:
            row["status"] = "done"
        elif results:
            row["status"] = f"{len(results)} of {settings.repeats} repeats done"
        else:
            row["status"] = next((e["status"] for e in entries if e.get("status")), "not run")
        errors = [e["error"] for e in entries if e.get("error")]
        row["error"] = row["error"] or (errors[-1] if errors else None)
        if results:
            first = results[0]
            row.update(method=first["method"], quantized_layers=first["quantized_layers"],
                       layers_left_16bit=first["layers_left_16bit"], device=first["device"],
                       eval_tokens=first["eval_tokens"], compiled=first["compiled"])
            for key in VARIANT_KEYS:
                row["spread"][key] = interval([r.get(key) for r in results])
                row[key] = row["spread"][key].mean if row["spread"][key] else None
            for i, batch in enumerate(first["batches"]):
                cell = dict(batch_size=batch["batch_size"], peak_memory_kind=batch["peak_memory_kind"],
                            energy_not_measured=batch.get("energy_not_measured"), spread={})
                for key in BATCH_KEYS:
                    spread = interval([r["batches"][i].get(key) for r in results])
                    cell["spread"][key] = spread
                    cell[key] = spread.mean if spread else None
                row["batches"].append(cell)
        rows.append(row)
    _compare_with_reference(settings, rows)
    return rows


def _compare_with_reference(settings, rows: List[dict]) -> None:
    """Size ratios, agreement and MCR against the bf16 row (None for all when bf16 has no result)."""
    ref = next((r for r in rows if r["variant"] == REFERENCE and r["repeats_done"]), None)
    ref_predictions = _predictions(settings, REFERENCE) if ref else None
    for row in rows:
        row.update(size_ratio_measured=None, size_ratio_nominal=None, top1_agreement_with_bf16=None,
                   mcr_measured=None, mcr_nominal=None)
        if not row["repeats_done"] or ref is None:
            continue
        row["size_ratio_measured"] = ref["weight_bytes"] / row["weight_bytes"]
        row["size_ratio_nominal"] = 16 / row["weight_bits_nominal"]
        predictions = _predictions(settings, row["variant"])
        if predictions is not None and ref_predictions is not None:
            row["top1_agreement_with_bf16"] = agreement(predictions, ref_predictions)
        row["mcr_measured"] = compression_rate(row["size_ratio_measured"], row["top1_accuracy"], ref["top1_accuracy"])
        row["mcr_nominal"] = compression_rate(row["size_ratio_nominal"], row["top1_accuracy"], ref["top1_accuracy"])


def _fmt(value, spec: str, spread=None) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    text = spec.format(value)
    if spread is not None and spread.half_width is not None and spread.mean:
        text += f" ±{spread.half_width / abs(spread.mean):.1%}"
    return text


def markdown(settings, rows: List[dict], device: str) -> str:
    head = ["variant", "weights (MB)", "size vs bf16, measured", "size vs bf16, nominal", "PPL", "top-1 acc",
            "top-1 agreement with bf16", "MCR measured", "MCR nominal", "linear layers quantized", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["repeats_done"]:
            cells = ["-"] * (len(head) - 2) + [f"{r['status']}: {r.get('error') or ''}".rstrip(": ")]
        else:
            s = r["spread"]
            cells = [_fmt(r["weight_bytes"] / 1e6, "{:,.2f}"), _fmt(r["size_ratio_measured"], "{:.2f}x"),
                     _fmt(r["size_ratio_nominal"], "{:.0f}x"), _fmt(r["perplexity"], "{:.3f}", s.get("perplexity")),
                     _fmt(r["top1_accuracy"], "{:.2%}"), _fmt(r["top1_agreement_with_bf16"], "{:.2%}"),
                     _fmt(r["mcr_measured"], "{:.2f}"), _fmt(r["mcr_nominal"], "{:.2f}"),
                     f"{r['quantized_layers']} of {r['quantized_layers'] + r['layers_left_16bit']}", r["status"]]
        lines.append("| " + " | ".join([r["variant"]] + [c.replace("|", "/") for c in cells]) + " |")
    speed = ["variant", "batch", "TTFT (ms)", "decode (ms/token step)", "IT (tokens/s)", "peak memory (GB)",
             "power (W)", "J/token", "decode bandwidth (GB/s)", "MBU"]
    lines += ["", "| " + " | ".join(speed) + " |", "|" + "---|" * len(speed)]
    for r in rows:
        for b in r["batches"]:
            s = b["spread"]
            ms = lambda v: None if v is None else v * 1e3  # noqa: E731
            cells = [str(b["batch_size"]), _fmt(ms(b["ttft_s"]), "{:.2f}", s.get("ttft_s")),
                     _fmt(ms(b["decode_s_per_token"]), "{:.3f}", s.get("decode_s_per_token")),
                     _fmt(b["it_tokens_per_s"], "{:,.1f}", s.get("it_tokens_per_s")),
                     _fmt(b["peak_memory_gb"], "{:.3f}"), _fmt(b["power_w"], "{:.0f}", s.get("power_w")),
                     _fmt(b["joules_per_token"], "{:.4g}", s.get("joules_per_token")),
                     _fmt(b["decode_bandwidth_gbs"], "{:,.3g}"), _fmt(b["mbu"], "{:.1%}")]
            lines.append("| " + " | ".join([r["variant"]] + cells) + " |")
    kinds = sorted({b["peak_memory_kind"] for r in rows for b in r["batches"]})
    energy = sorted({b["energy_not_measured"] for r in rows for b in r["batches"] if b.get("energy_not_measured")})
    methods = [f"{r['variant']}: {r['method']}" for r in rows if r.get("method")]
    notes = [
        f"{settings.hf.name} on {device}; prompts of {settings.prompt_tokens} tokens, {settings.new_tokens} new "
        f"tokens each (greedy, static KV cache, end-of-sequence ignored), {settings.warmup} warm-up and "
        f"{settings.timed_calls} timed calls per number, decode step {'compiled' if settings.compile else 'eager'}; "
        f"{settings.repeats} fresh process(es) per variant" +
        (" (± the half-width of the 95% interval of the mean, relative)" if settings.repeats > 1 else "") + ".",
        "Methods: " + "; ".join(methods) + "." if methods else "",
        "Weights: bytes of the parameters as stored (packed int4 data, scales and zeros included; the 16-bit "
        "embedding included). Size vs bf16: measured = bf16's bytes / this variant's; nominal = 16 / the quantized "
        "weights' bits (EfficientLLM's MCR uses the nominal form). MCR = size ratio x (top-1 accuracy / bf16's "
        f"top-1 accuracy). PPL and top-1 on {rows[0].get('eval_tokens') or 'the'} predicted tokens of held-out text "
        f"({'the file ' + settings.eval_text.name if settings.eval_text else 'the validation documents of the embedded corpus'}).",
        "TTFT: a 1-token call (prefill and the first token); decode: (N-token call - TTFT) / (N - 1), one step for the "
        "whole batch; IT: generated tokens (all sequences) / seconds of the N-token call. Decode bandwidth: bytes "
        "one decode step reads (the weights but the embedding, and the KV cache at the mean context) / the decode "
        "step's time; MBU: its fraction of the GPU's peak memory bandwidth.",
        "Peak memory: " + "; ".join(kinds) + "." if kinds else "",
        "Energy not measured: " + "; ".join(energy) + "." if energy else "",
    ]
    return "\n".join(lines) + "\n\n" + "\n\n".join(n for n in notes if n) + "\n"


def _jsonable(rows: List[dict]) -> List[dict]:
    def spreads(d):
        return {k: v.as_dict() for k, v in d.items() if v is not None}
    out = []
    for r in rows:
        r = dict(r, spread=spreads(r["spread"]), batches=[dict(b, spread=spreads(b["spread"])) for b in r["batches"]])
        out.append(r)
    return out


FINDING_BATCH_KEYS = ("power_w", "it_tokens_per_s", "peak_memory_gb")


def finding_spreads(rows: List[dict], batch_size: int) -> dict:
    """{variant: {metric: Spread}} of the variants that ran: perplexity, and at `batch_size` power, IT and peak
    memory (findings.py's inference findings compare these)."""
    spreads = {}
    for r in rows:
        if not r["repeats_done"]:
            continue
        spreads[r["variant"]] = dict(perplexity=r["spread"].get("perplexity"))
        cell = next((b for b in r["batches"] if b["batch_size"] == batch_size), None)
        if cell is not None:
            spreads[r["variant"]].update({k: cell["spread"].get(k) for k in FINDING_BATCH_KEYS})
    return spreads


def write_report(settings, state: dict) -> List[dict]:
    from . import findings

    rows = collect_rows(settings, state)
    device = state.get("device") or "an unrecorded device"
    (settings.out / "inference.md").write_text(f"# Inference benchmark: {settings.hf.name}\n\n" +
                                               markdown(settings, rows, device))
    batch = min(settings.batch_sizes)
    header = (f"# EfficientLLM's inference findings against this benchmark: {settings.hf.name}, batch {batch}, "
              f"{settings.repeats} repeat(s), decode {'compiled' if settings.compile else 'eager'}, on {device}")
    (settings.out / "findings.md").write_text(
        findings.markdown(findings.evaluate(finding_spreads(rows, batch), "inference"), header))
    doc = dict(settings=settings.identity() | dict(variants=settings.variants, repeats=settings.repeats),
               device=device, reference=REFERENCE, variants=_jsonable(rows))
    tmp = settings.out / "inference.json.tmp"
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(settings.out / "inference.json")
    return rows
