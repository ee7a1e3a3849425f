#!/usr/bin/env python3
"""Collective bandwidth between the ranks of a job: all-gather, reduce-scatter and all-reduce at several sizes.

    torchrun --nproc-per-node 2 tools/comm_bandwidth.py                       # 24, 256, 1024 MB per rank, bf16
    torchrun --nnodes 2 --nproc-per-node 8 ... tools/comm_bandwidth.py --sizes-mb 64,512 --out runs/bw.json

To tell a slow tensor-, context- or data-parallel layout from a slow link: the same collectives the layouts run
(torch.distributed on NCCL, on gloo without GPUs), timed with a device synchronize over `--iters` calls after
`--warmup` ones. Bandwidth as NCCL's own tests report it: the algorithm bandwidth (bytes of the collective's full
buffer / time) and the bus bandwidth (what each link carried: x (n-1)/n for all-gather and reduce-scatter, x 2(n-1)/n
for all-reduce), comparable with the link's rated speed whatever the rank count. Sizes are each rank's input (a TP
all-gather of a sequence-parallel activation moves seq x micro-batch x hidden x 2 bytes / TP per rank). Every
collective's result is checked once against the value it must have, so a link that corrupts data does not report
a speed. Prints a table on rank 0 with the environment variables that change NCCL's behaviour; `--out` writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a source checkout: the package next to tools/
    sys.path.insert(0, str(ROOT))

OPS = ("all_gather", "reduce_scatter", "all_reduce")
ENV_SHOWN = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_NVLS_ENABLE", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE",
             "NCCL_IB_DISABLE", "NCCL_ALGO", "NCCL_PROTO", "NCCL_MIN_NCHANNELS", "NCCL_SOCKET_IFNAME")


def _sizes(text: str):
    try:
        sizes = [float(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"comma list of megabytes expected, got {text!r}") from None
    if not sizes or any(not s > 0 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive megabytes, got {text!r}")
    return sizes


def build_parser():
    from litespark_megatron.apps.cli import OneLineParser, positive_int

    p = OneLineParser(prog="comm_bandwidth", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=_sizes, default=[24.0, 256.0, 1024.0], help="each rank's input, MiB")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--warmup", type=positive_int, default=3)
    p.add_argument("--iters", type=positive_int, default=10)
    p.add_argument("--out", default=None, help="JSON file for the rows (rank 0)")
    return p


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def measure(op: str, numel: int, dtype, device, warmup: int, iters: int) -> dict:
    """One collective at one size: checked once, then timed. Returns seconds per call and the full buffer's bytes."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = torch.full((numel,), float(rank + 1), dtype=dtype, device=device)
    gathered = torch.empty(numel * world, dtype=dtype, device=device)
    if op == "all_gather":
        def call():
            dist.all_gather_into_tensor(gathered, mine)
        expected = torch.arange(1, world + 1, dtype=dtype, device=device).repeat_interleave(numel)
        result, full_bytes = gathered, gathered.numel() * gathered.element_size()
    elif op == "reduce_scatter":
        source = torch.full((numel * world,), float(rank + 1), dtype=dtype, device=device)

        def call():
            dist.reduce_scatter_tensor(mine, source)
        expected = torch.full((numel,), float(world * (world + 1) // 2), dtype=dtype, device=device)
        result, full_bytes = mine, source.numel() * source.element_size()
    else:
        def call():
            dist.all_reduce(mine)
        expected = torch.full((numel,), float(world * (world + 1) // 2), dtype=dtype, device=device)
        result, full_bytes = mine, mine.numel() * mine.element_size()
    call()
    if not torch.equal(result, expected):
        raise RuntimeError(f"{op} of {numel} elements returned wrong values on rank {rank}: the link or the "
                           "collective library corrupts data; no bandwidth reported")
    for _ in range(warmup - 1):
        call()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.barrier()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    sync()
    seconds = time.perf_counter() - t0
    # The slowest rank's time is the collective's.
    slowest = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return dict(seconds_per_call=slowest.item() / iters, full_bytes=full_bytes)


def render(report: dict) -> str:
    lines = [f"{report['world_size']} ranks, {report['backend']}, {report['device']}, {report['dtype']}; "
             + (", ".join(f"{k}={v}" for k, v in report["environment"].items()) or "no NCCL variables set"), "",
             "| collective | MiB per rank | time ms | algorithm GB/s | bus GB/s |", "|---|---|---|---|---|"]
    for r in report["rows"]:
        lines.append(f"| {r['op']} | {r['mib_per_rank']:g} | {r['seconds_per_call'] * 1e3:.3f} | "
                     f"{r['algorithm_gbps']:.1f} | {r['bus_gbps']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world < 2:
        print("comm_bandwidth: error: it measures collectives between ranks and this is one process: start it "
              "with torchrun --nproc-per-node N (N >= 2)", file=sys.stderr)
        return 2
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    dtype = torch.bfloat16 if opts.dtype == "bf16" else torch.float32
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    try:
        for mib in opts.sizes_mb:
            numel = max(1, int(mib * 2**20) // element)
            for op in OPS:
                r = measure(op, numel, dtype, device, opts.warmup, opts.iters)
                algorithm = r["full_bytes"] / r["seconds_per_call"] / 1e9
                rows.append(dict(op=op, mib_per_rank=mib, seconds_per_call=r["seconds_per_call"],
                                 algorithm_gbps=algorithm, bus_gbps=algorithm * bus_factor(op, world)))
    except RuntimeError as e:
        print(f"comm_bandwidth: error: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        report = dict(world_size=world, backend="nccl" if cuda else "gloo",
                      device=torch.cuda.get_device_name(device) if cuda else "cpu", dtype=opts.dtype,
                      environment={k: os.environ[k] for k in ENV_SHOWN if k in os.environ}, rows=rows)
        print(render(report), flush=True)
        if opts.out:
            Path(opts.out).parent.mkdir(parents=True, exist_ok=True)
            Path(opts.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
