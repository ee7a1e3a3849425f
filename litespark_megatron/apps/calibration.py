"""The planner's models against every measured row of docs/benchmarks (docs/benchmarks/measured-peaks.json).

    python -m litespark_megatron.apps.calibration          # the error tables of docs/planner.md, in Markdown

Each row's flags are parsed as litespark-train parses them (on a GPU node with Transformer Engine, as the rows ran;
every row ran megatron-core's NullTokenizer, on mock data or random tokens) and given to the memory model and, for a
multi-GPU row whose machine also measured one GPU, to the scaling estimate. What a row measured decides what it is
compared with: tools/benchmark.py's peak is the largest over every step, warm-up included, so a CUDA-graph row's is
its eager steps' (the model's `allocated`); tools/layout_sweep.py's is the steady state after the first log
interval, after capture: the allocator then no longer counts the graphed layers' activations, which live in the
graphs' pools (compared with `allocated` minus those activations). An out-of-memory row is a fit check: the model must
say the layout does not fit. A row is parsed, not checked: the Litespark kernels' default is not applied, so its kernels
are those its flags name (every row measured before that default names the ones it ran).
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import List

from . import memory_model
from .gpus import accelerator

TABLE = Path(__file__).resolve().parents[2] / "docs" / "benchmarks" / "measured-peaks.json"


def rows(table: Path = TABLE) -> List[dict]:
    out = []
    for group in json.loads(table.read_text())["groups"]:
        for i, row in enumerate(group["rows"]):
            out.append(dict(doc=group["doc"], device=group["device"], measured_by=group["measured_by"],
                            code=row.get("code", group["code"]), shared=group["shared"], index=i,
                            group=group, **{k: v for k, v in row.items() if k != "code"}))
    return out


def _args(row: dict):
    from ..platform import Platform
    from .layouts import resolve

    gpu = accelerator(row["device"])
    plat = Platform("cuda", "nccl", True, gpu.fp8, gpu.name)
    flags = [*row["shared"].split(), *row["flags"].split()]
    if "--tokenizer-type" not in flags:
        flags.append("--mock-data")
    return resolve(flags, plat, row["gpus"])


def memory_check(row: dict) -> dict:
    """The model's prediction of what the row measured; for an out-of-memory row, whether it fits."""
    args = _args(row)
    estimate = memory_model.estimate(memory_model.setup_from_args(args, row["gpus"]))
    peak = estimate.peak
    graphs = args.cuda_graph_impl not in (None, "none")
    predicted = peak.allocated - (peak.activations if graphs and row["measured_by"] == "sweep" else 0)
    out = dict(predicted_gib=predicted / memory_model.GIB, required_gib=estimate.required_gib,
               shape=f"{args.model} {args.seq_length // 1024}k, mb {args.micro_batch_size}")
    if row.get("oom"):
        usable = accelerator(row["device"]).memory_gib * memory_model.USABLE_SHARE
        out.update(usable_gib=usable, agrees=estimate.required_gib > usable)
    else:
        out["error"] = out["predicted_gib"] / row["peak_gib"] - 1
        if row["code"] == "current":
            usable = accelerator(row["device"]).memory_gib * memory_model.USABLE_SHARE
            out.update(usable_gib=usable, agrees=estimate.required_gib <= usable)
    return out


def speed_check(row: dict) -> dict:
    """The planner's estimate of a multi-GPU row (plan.speed: the scaling estimate with the host floor) from its
    machine's one-GPU row, with the datasheet's links."""
    from ..metrics.peaks import detect_peak
    from .scaling_estimate import Interconnect, Measurement
    from .plan import speed

    base = row["group"]["rows"][row["baseline"]]
    base_args = _args(dict(row, **base))
    args = _args(row)
    gpu = accelerator(row["device"])
    measured = Measurement(base["tokens_per_sec_per_gpu"], base_args.seq_length, base_args.micro_batch_size,
                           base_args.global_batch_size)
    est = speed(args, memory_model.setup_from_args(args, row["gpus"]), 1, measured,
                detect_peak(gpu.peak_name, "bf16"), Interconnect(gpus_per_node=row["gpus"]), gpu)
    predicted = est.tokens_per_sec_per_gpu
    return dict(predicted=predicted, error=predicted / row["tokens_per_sec_per_gpu"] - 1,
                shape=f"{args.model} {args.seq_length // 1024}k, mb {args.micro_batch_size}")


def _cell(row: dict, check: dict) -> str:
    flags = row["flags"] or "(shared flags only)"
    return (f"[{row['doc'][:10]}](benchmarks/{row['doc']}) | {row['device']} | {row['gpus']} | {check['shape']} | "
            f"`{flags}`")


def report() -> str:
    """docs/planner.md's error tables: every row, then the summary by code state."""
    lines = ["| doc | device | GPUs | model, sequence, micro-batch | flags (after the shared ones) | code | "
             "measured by | measured GiB | predicted GiB | error |", "|---|---|---|---|---|---|---|---|---|---|"]
    errors, fit_checks, speed_lines, speed_errors = {}, [], [], []
    for row in rows():
        check = memory_check(row)
        if row.get("oom"):
            verdict = "agrees" if check["agrees"] else "**disagrees**"
            if row["code"] == "current":
                fit_checks.append(check["agrees"])
            lines.append(f"| {_cell(row, check)} | {row['code']} | {row['measured_by']} | out of memory | "
                         f"{check['required_gib']:.1f} needed, {check['usable_gib']:.1f} fit | {verdict} |")
            continue
        if "agrees" in check:
            fit_checks.append(check["agrees"])
        errors.setdefault(row["code"], []).append(check["error"])
        lines.append(f"| {_cell(row, check)} | {row['code']} | {row['measured_by']} | {row['peak_gib']:.1f} | "
                     f"{check['predicted_gib']:.1f} | {check['error']:+.1%} |")
        if row.get("baseline") is not None:
            speed = speed_check(row)
            speed_errors.append(speed["error"])
            speed_lines.append(f"| {_cell(row, speed)} | {row['tokens_per_sec_per_gpu']:,.0f} | "
                               f"{speed['predicted']:,.0f} | {speed['error']:+.1%} |")
    summary = ["| code | rows | mean abs. error | largest abs. error | within 10% |", "|---|---|---|---|---|"]
    for code, errs in errors.items():
        absolute = [abs(e) for e in errs]
        summary.append(f"| {code} | {len(errs)} | {statistics.mean(absolute):.1%} | {max(absolute):.1%} | "
                       f"{sum(a <= 0.10 for a in absolute)} |")
    summary.append(f"\nFit checks of the current code (its out-of-memory rows must not fit, its rows that ran must): "
                   f"{sum(fit_checks)} of {len(fit_checks)} agree.")
    absolute = [abs(e) for e in speed_errors]
    speed_table = ["| doc | device | GPUs | model, sequence, micro-batch | flags (after the shared ones) | "
                   "measured tokens/s/GPU | predicted | error |", "|---|---|---|---|---|---|---|---|", *speed_lines, "",
                   f"{len(absolute)} rows: mean abs. error {statistics.mean(absolute):.1%}, largest "
                   f"{max(absolute):.1%}, {sum(a <= 0.10 for a in absolute)} within 10%."]
    return "\n".join(["## Memory: every row", "", *lines, "", "## Memory: summary", "", *summary, "",
                      "## Throughput: every multi-GPU row with a one-GPU row of its machine", "", *speed_table, ""])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    print(report())
