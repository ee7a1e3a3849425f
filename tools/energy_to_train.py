#!/usr/bin/env python3
"""Time, GPU-hours, energy, CO2 and cost to train on a number of tokens, on a cluster.

Throughput and GPU power come from a run's metrics.jsonl (steady state: the first records are skipped), or
from assumptions (--mfu with a model and GPU, --tokens-per-sec-per-gpu, --gpu-power-w). Flags given
explicitly win over the file. Every input is printed with where it came from.

    python tools/energy_to_train.py --metrics runs/x/metrics.jsonl --target-tokens 627B --nodes 16
    python tools/energy_to_train.py --model llama-30b --gpu H100 --mfu 0.45 --gpu-power-w 650 \\
        --tokens-per-param 20 --nodes 64 --grid-gco2-per-kwh 400 --price-per-gpu-hour 2.5
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import List, Optional, Sequence

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps import cli  # noqa: E402
from litespark_megatron.metrics.energy import JOULES_PER_KWH  # noqa: E402
from litespark_megatron.metrics.flops import CAUSAL_CONVENTIONS, param_count, training_flops_per_step  # noqa: E402

SECONDS_PER_DAY = 86400.0
# Values a record may hold where the trainer could not measure something.
_MISSING = (None, "not measured")


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="energy_to_train", description=__doc__.split("\n\n")[0])
    g = p.add_argument_group("measured run")
    g.add_argument("--metrics", default=None, help="metrics.jsonl of a training run")
    g.add_argument("--skip-records", type=cli.non_negative_int, default=3,
                   help="records with a throughput to skip at the start (warm-up: compilation, allocator, "
                        "first data reads)")
    g = p.add_argument_group("assumed throughput and power (instead of, or over, the metrics file)")
    g.add_argument("--tokens-per-sec-per-gpu", type=cli.positive_float, default=None)
    g.add_argument("--mfu", type=cli.fraction, default=None,
                   help="assumed MFU (fraction); needs --model and --gpu/--peak-tflops")
    g.add_argument("--attention-convention", choices=["half", "full"], default="half",
                   help="FLOP convention the assumed --mfu is in (half: Megatron-LM causal; full: NeMo tables)")
    g.add_argument("--gpu-power-w", type=cli.positive_float, default=None,
                   help="mean power per GPU while training, W")
    cli.add_model_args(p, required=False)
    cli.add_peak_args(p)
    g = p.add_argument_group("target and cluster")
    g.add_argument("--target-tokens", type=cli.token_count, default=None, help="627e9, 627B, 1.5T, ...")
    g.add_argument("--tokens-per-param", type=cli.positive_float, default=None,
                   help="target = this x total parameters of --model (20: Chinchilla)")
    g.add_argument("--nodes", type=cli.positive_int, default=1)
    g.add_argument("--gpus-per-node", type=cli.positive_int, default=8)
    g.add_argument("--scaling-efficiency", type=cli.fraction, default=1.0,
                   help="per-GPU throughput on the target cluster / per-GPU throughput measured or assumed "
                        "(assumption; 1.0 = perfect scaling)")
    g = p.add_argument_group("energy accounting and prices (all assumptions, printed)")
    g.add_argument("--node-overhead", type=positive_at_least_one, default=1.2,
                   help="node energy / GPU energy: CPUs, memory, NICs, fans, local storage")
    g.add_argument("--pue", type=positive_at_least_one, default=1.2,
                   help="facility energy / IT energy (power usage effectiveness of the data center)")
    g.add_argument("--grid-gco2-per-kwh", type=cli.positive_float, default=None,
                   help="carbon intensity of the electricity, g CO2e per kWh")
    g.add_argument("--price-per-gpu-hour", type=cli.positive_float, default=None)
    g.add_argument("--price-per-kwh", type=cli.positive_float, default=None,
                   help="electricity price, applied to facility energy")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def positive_at_least_one(text: str) -> float:
    value = cli.positive_float(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a factor >= 1 expected, got {text!r}")
    return value


def _field(record: dict, key: str, path: str, lineno: int) -> Optional[float]:
    value = record.get(key)
    if value in _MISSING:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise cli.UsageError(f"{path}:{lineno}: '{key}' is {value!r}, not a number")
    if value < 0:
        raise cli.UsageError(f"{path}:{lineno}: '{key}' is negative ({value})")
    return float(value)


def read_metrics(path: str, skip: int) -> dict:
    """Steady-state averages of a metrics.jsonl.

    Each record covers one log interval of the same number of steps, so the same tokens: the mean throughput
    is then the harmonic mean of the records' throughputs (total tokens / total time), the mean J/token the
    plain mean, and the mean power the time-weighted mean (weights 1 / throughput).
    """
    p = Path(path)
    if not p.is_file():
        raise cli.UsageError(f"--metrics {path}: no such file")
    rows: List[dict] = []
    with open(p) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise cli.UsageError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise cli.UsageError(f"{path}:{lineno}: expected a JSON object per line")
            tps_gpu = _field(record, "tokens_per_sec_per_gpu", path, lineno)
            tps = _field(record, "tokens_per_sec", path, lineno)
            num_gpus = _field(record, "num_gpus", path, lineno)
            if tps_gpu is None and tps is not None:
                if not num_gpus:
                    raise cli.UsageError(f"{path}:{lineno}: has tokens_per_sec but neither tokens_per_sec_per_gpu "
                                          f"nor num_gpus")
                tps_gpu = tps / num_gpus
            if not tps_gpu:
                continue  # evaluation, checkpoint or start-up records carry no throughput
            rows.append(dict(line=lineno, tps_gpu=tps_gpu, num_gpus=num_gpus,
                             jpt=_field(record, "joules_per_token", path, lineno),
                             power=_field(record, "gpu_power_w", path, lineno)))
    if not rows:
        raise cli.UsageError(f"--metrics {path}: no record has tokens_per_sec_per_gpu (or tokens_per_sec with "
                              f"num_gpus)")
    if len(rows) <= skip:
        raise cli.UsageError(f"--metrics {path}: only {len(rows)} records with a throughput, all skipped as "
                              f"warm-up by --skip-records {skip}; lower --skip-records or train longer")
    steady = rows[skip:]
    tps_gpu = len(steady) / sum(1 / r["tps_gpu"] for r in steady)
    out = dict(tokens_per_sec_per_gpu=tps_gpu, records_used=len(steady), records_skipped=skip,
               first_line=steady[0]["line"], last_line=steady[-1]["line"],
               num_gpus=sorted({int(r["num_gpus"]) for r in steady if r["num_gpus"]}) or None,
               gpu_power_w=None, power_source=None)
    with_jpt = [r for r in steady if r["jpt"] is not None]
    with_power = [r for r in steady if r["power"] is not None]
    if with_jpt:
        # W per GPU = J/token (all GPUs) x tokens/s (all GPUs) / GPUs = J/token x tokens/s per GPU.
        jpt = sum(r["jpt"] for r in with_jpt) / len(with_jpt)
        tps_j = len(with_jpt) / sum(1 / r["tps_gpu"] for r in with_jpt)
        out.update(gpu_power_w=jpt * tps_j, joules_per_token=jpt,
                   power_source=f"joules_per_token x tokens_per_sec_per_gpu, {len(with_jpt)} records")
    elif with_power:
        weights = [1 / r["tps_gpu"] for r in with_power]
        out.update(gpu_power_w=sum(w * r["power"] for w, r in zip(weights, with_power)) / sum(weights),
                   power_source=f"gpu_power_w, time-weighted over {len(with_power)} records")
    return out


def compute(args) -> dict:
    inputs = {}
    shape = None
    if args.model is not None:
        shape = cli.shape_from_cli(args)
    metrics = read_metrics(args.metrics, args.skip_records) if args.metrics else None

    # Throughput per GPU.
    if args.tokens_per_sec_per_gpu is not None and args.mfu is not None:
        raise cli.UsageError("give --tokens-per-sec-per-gpu or --mfu, not both")
    if args.tokens_per_sec_per_gpu is not None:
        tps_gpu, tps_source = args.tokens_per_sec_per_gpu, "assumed (--tokens-per-sec-per-gpu)"
    elif args.mfu is not None:
        if shape is None:
            raise cli.UsageError("--mfu needs --model (to count FLOPs per token)")
        peak = cli.resolve_peak(args, "--mfu")
        per_token = training_flops_per_step(shape, 1, causal=args.attention_convention).model_flops_per_token
        tps_gpu = args.mfu * peak.tflops * 1e12 / per_token
        tps_source = (f"assumed MFU {args.mfu:g} x peak {peak.tflops:g} TFLOP/s ({peak.mfu_basis}) / "
                      f"{per_token:,.0f} FLOPs per token ({args.attention_convention} attention: "
                      f"{CAUSAL_CONVENTIONS[args.attention_convention]})")
        inputs["peak"] = peak.as_dict()
    elif metrics is not None:
        tps_gpu = metrics["tokens_per_sec_per_gpu"]
        tps_source = (f"{args.metrics}: harmonic mean of {metrics['records_used']} records (lines "
                      f"{metrics['first_line']}-{metrics['last_line']}), first {metrics['records_skipped']} skipped"
                      + (f"; measured on {', '.join(map(str, metrics['num_gpus']))} GPUs" if metrics["num_gpus"]
                         else ""))
    else:
        raise cli.UsageError("no throughput: give --metrics, --tokens-per-sec-per-gpu, or --mfu with --model and "
                              "--gpu")

    # Power per GPU.
    if args.gpu_power_w is not None:
        power, power_source = args.gpu_power_w, "assumed (--gpu-power-w)"
    elif metrics is not None and metrics["gpu_power_w"] is not None:
        power, power_source = metrics["gpu_power_w"], f"{args.metrics}: {metrics['power_source']}"
    else:
        where = f"{args.metrics} has no joules_per_token or gpu_power_w" if metrics else "no metrics file"
        raise cli.UsageError(f"no GPU power: {where}; give --gpu-power-w")

    # Target tokens.
    if args.target_tokens is not None and args.tokens_per_param is not None:
        raise cli.UsageError("give --target-tokens or --tokens-per-param, not both")
    if args.target_tokens is not None:
        tokens, tokens_source = args.target_tokens, "--target-tokens"
    elif args.tokens_per_param is not None:
        if shape is None:
            raise cli.UsageError("--tokens-per-param needs --model (to count parameters)")
        params = param_count(shape).total
        tokens = int(round(args.tokens_per_param * params))
        tokens_source = f"--tokens-per-param {args.tokens_per_param:g} x {params:,} total parameters of {args.model}"
    else:
        raise cli.UsageError("no target: give --target-tokens (e.g. 627B) or --tokens-per-param")

    gpus = args.nodes * args.gpus_per_node
    cluster_tps = tps_gpu * gpus * args.scaling_efficiency
    seconds = tokens / cluster_tps
    gpu_hours = gpus * seconds / 3600
    gpu_kwh = power * gpus * seconds / JOULES_PER_KWH
    node_kwh = gpu_kwh * args.node_overhead
    facility_kwh = node_kwh * args.pue
    out = {
        "inputs": dict(inputs, tokens_per_sec_per_gpu=tps_gpu, throughput_source=tps_source,
                       gpu_power_w=power, power_source=power_source, target_tokens=tokens,
                       target_source=tokens_source, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                       gpus=gpus, scaling_efficiency=args.scaling_efficiency, node_overhead=args.node_overhead,
                       pue=args.pue, grid_gco2_per_kwh=args.grid_gco2_per_kwh,
                       price_per_gpu_hour=args.price_per_gpu_hour, price_per_kwh=args.price_per_kwh),
        "cluster_tokens_per_sec": cluster_tps,
        "wall_clock_seconds": seconds,
        "wall_clock_days": seconds / SECONDS_PER_DAY,
        "gpu_hours": gpu_hours,
        "gpu_energy_kwh": gpu_kwh,
        "node_energy_kwh": node_kwh,
        "facility_energy_kwh": facility_kwh,
        "joules_per_token_gpu": power * gpus / cluster_tps,
        "co2_tonnes": (facility_kwh * args.grid_gco2_per_kwh / 1e6 if args.grid_gco2_per_kwh is not None else None),
        "cost_gpu_hours": (gpu_hours * args.price_per_gpu_hour if args.price_per_gpu_hour is not None else None),
        "cost_energy": (facility_kwh * args.price_per_kwh if args.price_per_kwh is not None else None),
    }
    return out


def render(out: dict) -> str:
    i = out["inputs"]
    lines = [
        "inputs and assumptions:",
        f"  throughput     {i['tokens_per_sec_per_gpu']:,.1f} tokens/s per GPU  [{i['throughput_source']}]",
        f"  GPU power      {i['gpu_power_w']:,.1f} W per GPU while training  [{i['power_source']}]",
        f"  target         {i['target_tokens']:,} tokens  [{i['target_source']}]",
        f"  cluster        {i['nodes']} nodes x {i['gpus_per_node']} GPUs = {i['gpus']} GPUs",
        f"  scaling        efficiency {i['scaling_efficiency']:.2f}: each GPU of this cluster runs at "
        f"{i['scaling_efficiency']:.2f} x the throughput above [assumed: --scaling-efficiency]",
        f"  node overhead  x{i['node_overhead']:g} on GPU energy for CPUs, memory, NICs, fans, storage "
        f"[assumed: --node-overhead]",
        f"  PUE            x{i['pue']:g} on node energy for cooling and power distribution [assumed: --pue]",
        "  GPU power is taken as constant for the whole run, idle gaps (evaluation, checkpoints, restarts) are "
        "not included",
        "results:",
        f"  cluster throughput  {out['cluster_tokens_per_sec']:,.0f} tokens/s",
        f"  wall clock          {out['wall_clock_days']:,.2f} days ({out['wall_clock_seconds']:,.0f} s)",
        f"  GPU-hours           {out['gpu_hours']:,.0f}",
        f"  GPU energy          {out['gpu_energy_kwh']:,.0f} kWh ({out['joules_per_token_gpu']:.4g} J per token)",
        f"  node energy         {out['node_energy_kwh']:,.0f} kWh (GPU x {i['node_overhead']:g})",
        f"  facility energy     {out['facility_energy_kwh']:,.0f} kWh (node x PUE {i['pue']:g})",
    ]
    if out["co2_tonnes"] is None:
        lines.append("  CO2                 not computed (give --grid-gco2-per-kwh)")
    else:
        lines.append(f"  CO2                 {out['co2_tonnes']:,.1f} t CO2e (facility energy x "
                     f"{i['grid_gco2_per_kwh']:g} g/kWh)")
    if out["cost_gpu_hours"] is None and out["cost_energy"] is None:
        lines.append("  cost                not computed (give --price-per-gpu-hour and/or --price-per-kwh)")
    if out["cost_gpu_hours"] is not None:
        lines.append(f"  cost of GPU-hours   {out['cost_gpu_hours']:,.2f} (GPU-hours x {i['price_per_gpu_hour']:g})")
    if out["cost_energy"] is not None:
        lines.append(f"  cost of energy      {out['cost_energy']:,.2f} (facility kWh x {i['price_per_kwh']:g})")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.report_main(argv, build_parser(), compute, render)


if __name__ == "__main__":
    sys.exit(main())
