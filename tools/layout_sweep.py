#!/usr/bin/env python3
"""Train the same model under several parallel layouts, one after another, and tabulate their throughput.

    python tools/layout_sweep.py --out runs/sweep --layout 1:"" --layout 2:"--tensor-model-parallel-size 2" \
        -- --model llama-1b --mock-data --bf16 --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 \
           --train-iters 20 --log-interval 5

Each layout is `NPROC:FLAGS`; the flags after `--` are shared. Each run is a fresh `torchrun -m litespark_megatron`
writing its own metrics.jsonl; the table takes the mean over the log records after the first (warm-up) of
tokens/s per GPU, TFLOP/s per GPU, MFU, peak memory, GPU power and J/token, and the ratio of each layout's
tokens/s per GPU to the first layout's. Writes OUT/sweep.md and OUT/sweep.json.
"""
from __future__ import annotations

import argparse
import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

FIELDS = ("tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "mem_max_allocated_gb", "gpu_power_w",
          "joules_per_token")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def steady_state(metrics: Path) -> dict:
    from litespark_megatron.health import from_metrics

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"][1:]  # the first interval holds warm-up/compilation
    health = from_metrics(records)
    out = {"health": health.to_dict() if health else None}
    for field in FIELDS:
        values = [r[field] for r in train if r.get(field) is not None]
        out[field] = sum(values) / len(values) if values else None
    out["intervals"] = len(train)
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="layout_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for runs, sweep.md and sweep.json")
    p.add_argument("--layout", action="append", required=True, metavar="NPROC:FLAGS")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--allow-degraded", action="store_true",
                   help="exit 0 even if a layout fell back (unfused attention, a fused path asked for but off); "
                        "it stays flagged DEGRADED in the table")
    args = p.parse_args(own)
    layouts = []
    for spec in args.layout:
        nproc, _, flags = spec.partition(":")
        if not nproc.isdigit() or int(nproc) < 1:
            print(f"layout_sweep: error: --layout {spec!r}: expected NPROC:FLAGS, e.g. 2:'--use-distributed-optimizer'",
                  file=sys.stderr)
            return 2
        layouts.append((int(nproc), shlex.split(flags)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (nproc, flags) in enumerate(layouts):
        name = f"{i}_np{nproc}_" + ("_".join(f.lstrip("-") for f in flags) or "base")
        run_dir = out / name[:120]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
               "127.0.0.1", "--master-port", str(_free_port()), "-m", "litespark_megatron", *shared, *flags,
               "--metrics-file", str(run_dir / "metrics.jsonl")]
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "log.txt", "w") as log:
            log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            log.flush()
            try:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row = {"nproc": nproc, "flags": " ".join(flags) or "(none)", "rc": rc}
        metrics = run_dir / "metrics.jsonl"
        if rc == 0 and metrics.exists():
            row.update(steady_state(metrics))
        else:
            lines = (run_dir / "log.txt").read_text().strip().splitlines()
            # The trainer's own one-line refusal says what was wrong; torchrun's report after it does not.
            refusals = [line for line in lines if line.startswith("litespark-train: error: ")]
            row["error"] = refusals[-1] if refusals else " | ".join(lines[-3:])[-300:]
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0].get("tokens_per_sec_per_gpu")
    for row in rows:
        value = row.get("tokens_per_sec_per_gpu")
        row["ratio_per_gpu_vs_first"] = value / base if value and base else None
    (out / "sweep.json").write_text(json.dumps({"shared_flags": shared, "rows": rows}, indent=1))

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    lines = ["| GPUs | layout | tokens/s/GPU | ratio vs first | TFLOP/s/GPU | MFU | peak mem GB | W/GPU | J/token "
             "| what ran (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    degraded = []
    for r in rows:
        if r["rc"] != 0:
            lines.append(f"| {r['nproc']} | {r['flags']} | failed ({r['rc']}): {r.get('error', '')[:120]} ||||||||")
            continue
        health = r.get("health")
        if health is None:
            ran = "not recorded"
        else:
            ran = ("**DEGRADED**: " + "; ".join(health["degraded"]) + "; " if health["degraded"] else "") + \
                " + ".join(health["attention"]) + "; fused: " + \
                ", ".join(f"{k} {v}" for k, v in health["fusions"].items())
            if health["degraded"]:
                degraded.append(f"{r['nproc']}:{r['flags']}: " + "; ".join(health["degraded"]))
        lines.append(f"| {r['nproc']} | {r['flags']} | {fmt(r['tokens_per_sec_per_gpu'], ',.0f')} | "
                     f"{fmt(r['ratio_per_gpu_vs_first'], '.3f')} | {fmt(r['tflops_per_gpu'], '.1f')} | "
                     f"{fmt(r['mfu'], '.1%')} | {fmt(r['mem_max_allocated_gb'], '.1f')} | "
                     f"{fmt(r['gpu_power_w'], '.0f')} | {fmt(r['joules_per_token'], '.4f')} | {ran} |")
    table = "\n".join(lines)
    (out / "sweep.md").write_text("shared flags: `" + " ".join(shared) + "`\n\n" + table + "\n")
    print(table)
    for what in degraded:
        print(f"layout_sweep: DEGRADED layout {what}" +
              ("" if args.allow_degraded else " (fix the environment, or pass --allow-degraded to accept it)"),
              file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in rows) and (args.allow_degraded or not degraded) else 1


if __name__ == "__main__":
    sys.exit(main())
