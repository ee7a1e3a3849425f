"""litespark-plan: the fastest layouts of a model on a set of GPUs, each with the command that runs it.

    litespark-plan --gpu H100 --nodes 1 --gpus-per-node 4 --model llama-3b --bf16 --seq-length 4096 \\
        --global-batch-size 64 [--fp8-format hybrid] [--measured-tokens-per-sec-per-gpu 23500] [--verify 2]

Every flag litespark-plan does not know is a litespark-train flag (model, precision, loss, data...), passed on as
given; a layout flag among them (--tensor-model-parallel-size 2, --micro-batch-size 4, ...) fixes that dimension.
The plan enumerates the layouts of the GPUs and keeps those litespark-train's own checks accept (layouts.py), drops
those the memory model says do not fit (memory_model.py), ranks the rest by the scaling estimate's tokens/s per GPU
(apps/scaling_estimate.py, carried from one GPU's rate: measured, or an MFU measured on these GPUs) and prints the best
with their predicted tokens/s per GPU, peak memory and flags. A plan that cannot fit says what would: more GPUs, FP8
with the precision-aware optimizer, recomputation. --verify K trains the best K for a few steps on this machine
(tools/layout_sweep.py) and prints what was measured beside what was predicted. docs/planner.md gives the formulas
and their error against every measured row.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from ..errors import ConfigError, UserError
from . import layouts, memory_model
from .gpus import Accelerator, accelerator

PROG = "litespark-plan"
# One GPU's MFU (causal-half convention) when no rate is measured, from the one-GPU rows of docs/benchmarks
# (docs/planner.md): BF16 50% (llama-3b on H100 and H200: 50-56%); FP8 65% (llama-3b on an H100 at micro-batch 2:
# 64%), and on an H200 with the Litespark defaults 75% (llama-3b at micro-batch 4: 75-78%; llama3-8b at 2: 88%).
DEFAULT_MFU = {"bf16": 0.50, "fp16": 0.50, "fp8": 0.65}
DEFAULT_MFU_OF_GPU = {"H200": {"fp8": 0.75}}
PAO_FLAGS = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
             "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
MORE_NODES = (2, 4, 8, 16, 32, 64)
# The host's time to launch one layer's forward and backward kernels for a micro-batch, without CUDA graphs, in ms:
# from measured steps that took the same time whatever their micro-batch's size (docs/planner.md). On one GPU or
# under DP 5.0 (llama-1b at micro-batch 1, eff-0.5b at 4, llama-3b FP8 at 1: 5.0-5.5); under TP or CP, which launch
# their collectives too, 7.5 (llama-1b TP2+SP and CP2 on H200s 7.4-7.6; llama-3b TP2+SP on H100s 6.6-8.3).
HOST_MS_PER_LAYER = {False: 5.0, True: 7.5}
REFUSALS_SHOWN = 3  # reasons printed (--json has them all)
SWEEP = Path(__file__).resolve().parents[2] / "tools" / "layout_sweep.py"


def build_parser() -> argparse.ArgumentParser:
    from .cli import OneLineParser, positive_float, positive_int

    p = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                      epilog="Every other flag is litespark-train's (see litespark-train --help).")
    p.add_argument("--gpu", required=True, help="the GPU type: H100, H200 (or cpu, to try a plan on this machine)")
    p.add_argument("--nodes", type=positive_int, default=1)
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--gpu-memory-gib", type=positive_float, default=None,
                   help="memory per GPU instead of the type's (needed for --gpu cpu: the host memory per rank)")
    p.add_argument("--nvlink-gbps", type=positive_float, default=None,
                   help="GB/s per direction between two GPUs of a node (default: the type's link)")
    p.add_argument("--network-gbps-per-gpu", type=positive_float, default=None,
                   help="GB/s per direction per GPU between nodes (default: one 400 Gb/s NIC per GPU)")
    p.add_argument("--comm-bandwidth", default=None, metavar="FILE.json",
                   help="the collective bandwidth measured by tools/comm_bandwidth.py --out (one node: the link's; "
                        "several: the network's) instead of the datasheet's")
    p.add_argument("--measured-tokens-per-sec-per-gpu", type=positive_float, default=None,
                   help="one GPU's training rate with these flags (default: an MFU measured on H100/H200)")
    p.add_argument("--measured-micro-batch-size", type=positive_int, default=1,
                   help="the micro-batch of that measurement")
    p.add_argument("--host-ms-per-layer", type=positive_float, default=None,
                   help="the host's time to launch a layer's forward and backward for a micro-batch, without CUDA "
                        "graphs (default: measured, 5.0 ms, or 7.5 under TP or CP)")
    p.add_argument("--top", type=positive_int, default=5, help="layouts to print")
    p.add_argument("--verify", type=positive_int, default=None, metavar="K",
                   help="train the best K layouts for a few steps here and print measured beside predicted")
    p.add_argument("--verify-steps", type=positive_int, default=6, help="steps per verified layout")
    p.add_argument("--verify-timeout", type=positive_int, default=900, help="seconds per verified layout")
    p.add_argument("--out", default="runs/plan", help="directory of the verification runs")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    return p


# ---- what the GPUs are and how fast one of them is -------------------------------------------------------------
def platform_of(gpu: Accelerator):
    from ..platform import Platform

    if gpu.cpu:
        return Platform("cpu", "gloo", False, False, "cpu")
    # a GPU node with TE and Triton (torch's CUDA wheels ship it), as launch_check --assume-gpu
    return Platform("cuda", "nccl", True, gpu.fp8, gpu.name, triton=True)


def interconnect(opts, gpu: Accelerator):
    from .scaling_estimate import NCCL_BUS_EFFICIENCY, Interconnect

    link, network = opts.nvlink_gbps or gpu.link_gbps, opts.network_gbps_per_gpu or gpu.network_gbps
    if opts.comm_bandwidth is None:
        return Interconnect(nvlink_gbps=link, ib_gbps_per_gpu=network, gpus_per_node=opts.gpus_per_node), \
            f"datasheet: {link:g} GB/s between GPUs of a node, {network:g} GB/s per GPU between nodes, x " \
            f"{NCCL_BUS_EFFICIENCY:g} (NCCL)"
    try:
        report = json.loads(Path(opts.comm_bandwidth).read_text())
        largest = max(r["mib_per_rank"] for r in report["rows"])
        bus = max(r["bus_gbps"] for r in report["rows"] if r["mib_per_rank"] == largest)
        ranks = int(report["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--comm-bandwidth {opts.comm_bandwidth}: not a report of tools/comm_bandwidth.py --out "
                        f"({type(e).__name__}: {e})") from None
    # The measured bus bandwidth already includes NCCL's efficiency: the datasheet's other link takes it too.
    if ranks <= opts.gpus_per_node:
        link, network = bus, network * NCCL_BUS_EFFICIENCY
        where = f"measured {bus:.0f} GB/s bus bandwidth inside a node ({ranks} ranks, {opts.comm_bandwidth})"
    else:
        link, network = link * NCCL_BUS_EFFICIENCY, bus / opts.gpus_per_node
        where = (f"measured {bus:.0f} GB/s bus bandwidth across nodes ({ranks} ranks, {opts.comm_bandwidth}): "
                 f"{network:.1f} GB/s per GPU")
    return Interconnect(nvlink_gbps=link, ib_gbps_per_gpu=network, bus_efficiency=1.0,
                        gpus_per_node=opts.gpus_per_node), where


def one_gpu_rate(opts, args, shape, gpu: Accelerator):
    """(the scaling estimate's Measurement, its Peak, where the rate comes from)."""
    from ..metrics.flops import training_flops_per_step
    from ..metrics.peaks import Peak, detect_peak
    from .scaling_estimate import Measurement

    precision = "fp8" if args.fp8 else "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if gpu.cpu:
        peak = Peak(device="cpu", precision=precision, tflops=1.0, mfu_basis="none", precision_peak_tflops=None,
                    source="none")
    else:
        peak = detect_peak(gpu.peak_name, "bf16" if precision in ("fp8", "fp32") else precision)
    gbs = args.global_batch_size
    mb1 = opts.measured_micro_batch_size
    if opts.measured_tokens_per_sec_per_gpu is not None:
        return (Measurement(opts.measured_tokens_per_sec_per_gpu, shape.seq_length, mb1, mb1 * max(1, gbs // mb1)),
                peak, f"measured {opts.measured_tokens_per_sec_per_gpu:,.0f} tokens/s on one GPU at micro-batch {mb1}")
    if gpu.cpu or precision not in DEFAULT_MFU:
        raise UserError(f"{'--gpu cpu' if gpu.cpu else precision.upper() + ' training'} has no measured MFU to start "
                        "from: give --measured-tokens-per-sec-per-gpu (one GPU's rate with these flags)")
    mfu = DEFAULT_MFU_OF_GPU.get(gpu.name, {}).get(precision, DEFAULT_MFU[precision])
    per_token = training_flops_per_step(shape, 1, causal="half").model_flops_per_token
    rate = mfu * peak.tflops * 1e12 / per_token
    return (Measurement(rate, shape.seq_length, 1, gbs), peak,
            f"assumed MFU {mfu:.0%} (causal-half, {precision.upper()}; measured on {gpu.name}s), {rate:,.0f} tokens/s "
            "on one GPU: give --measured-tokens-per-sec-per-gpu for a plan of your own rate")


# ---- one layout: its memory and its speed ---------------------------------------------------------------------
@dataclasses.dataclass
class Evaluated:
    candidate: layouts.Candidate
    memory: memory_model.MemoryEstimate
    fits: bool
    tokens_per_sec_per_gpu: Optional[float] = None
    mfu: Optional[float] = None
    step_time_s: Optional[float] = None

    def as_dict(self, named, argv, world, nodes, gpus_per_node, environment: dict) -> dict:
        own = self.candidate.flags(named)
        flags = list(argv) + own
        return dict(layout=self.candidate.describe(), layout_flags=own, flags=flags, environment=environment,
                    command="".join(f"{k}={shlex.quote(v)} " for k, v in environment.items())
                            + f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} -m litespark_megatron "
                            + shlex.join(flags),
                    tokens_per_sec_per_gpu=self.tokens_per_sec_per_gpu, mfu=self.mfu, step_time_s=self.step_time_s,
                    memory_gib=self.memory.peak.as_gib(), gpus=world)


def host_s_per_layer(setup, gpu: Accelerator, override_ms: Optional[float] = None) -> float:
    """The scaling estimate's host floor of a layout: none under CUDA graphs (they replay the layers without the
    host) or on a CPU (whose host is its compute), else HOST_MS_PER_LAYER or the user's."""
    if setup.cuda_graphs or gpu.cpu:
        return 0.0
    return (override_ms if override_ms is not None else HOST_MS_PER_LAYER[setup.tp > 1 or setup.cp > 1]) / 1e3


def speed(args, setup, nodes: int, measured, peak, ic, gpu: Accelerator, host_ms: Optional[float] = None):
    """The scaling estimate of a checked layout (its ScalingEstimate), with full recomputation's extra forward
    charged at the measured FLOP rate (the measurement is taken as one without recomputation)."""
    from ..metrics.flops import recompute_from_args, training_flops_per_step
    from .scaling_estimate import Layout, estimate

    layout = Layout(tensor_model_parallel_size=setup.tp, pipeline_model_parallel_size=setup.pp,
                    context_parallel_size=setup.cp,
                    num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
                    sequence_parallel=setup.sequence_parallel, use_distributed_optimizer=setup.distributed_optimizer,
                    overlap_grad_reduce=bool(args.overlap_grad_reduce),
                    overlap_param_gather=bool(args.overlap_param_gather),
                    recompute_granularity=setup.recompute, grad_reduce_in_fp32=setup.grad_bytes == 4,
                    cp_comm_type="all_gather" if setup.all_gather_cp else "p2p")
    flops = training_flops_per_step(setup.shape, 1, causal="half", **recompute_from_args(args))
    measured = dataclasses.replace(measured, tokens_per_sec_per_gpu=measured.tokens_per_sec_per_gpu
                                   * flops.model_flops / flops.hardware_flops)
    return estimate(setup.shape, layout, nodes=nodes, global_batch_size=args.global_batch_size,
                    micro_batch_size=setup.micro_batch_size, measured=measured, peak=peak, interconnect=ic,
                    hbm_tbps=gpu.hbm_tbps, convention="half", host_s_per_layer=host_s_per_layer(setup, gpu, host_ms))


def evaluate(args, world, opts, named, plat, usable_gib, rate=None) -> tuple:
    """(every checked layout of `world` GPUs, the refusals (candidate, reason)); with `rate` (measured, peak, ic,
    gpu, host_ms) the layouts that fit get their speed."""
    from .scaling_estimate import ScalingError

    evaluated, refused = [], []
    for candidate in layouts.candidates(args, world, opts.gpus_per_node, named):
        try:
            checked = layouts.check(args, candidate, plat, world)
        except ConfigError as e:
            refused.append((candidate, str(e)))
            continue
        setup = memory_model.setup_from_args(checked, world)
        memory = memory_model.estimate(setup)
        result = Evaluated(candidate, memory, memory.required_gib <= usable_gib)
        if result.fits and rate is not None:
            try:
                est = speed(checked, setup, opts.nodes, *rate)
            except ScalingError as e:
                refused.append((candidate, f"the scaling estimate cannot model it: {e}"))
                continue
            result.tokens_per_sec_per_gpu, result.step_time_s = est.tokens_per_sec_per_gpu, est.step_time_s
            result.mfu = None if rate[3].cpu else est.mfu
        evaluated.append(result)
    return evaluated, refused


def rank(e: Evaluated) -> tuple:
    """Fastest first; among layouts within 0.1% of each other, fewer model-parallel ranks, then the larger
    micro-batch (every measured table ran larger micro-batches faster, which the estimate's one FLOP rate does not
    see beyond its host floor), then less memory."""
    c = e.candidate
    return (-round(math.log(e.tokens_per_sec_per_gpu) * 1000), c.tp * c.pp * c.cp, -c.micro_batch_size,
            e.memory.required_gib)


# ---- the plan -------------------------------------------------------------------------------------------------
def plan(opts, argv: Sequence[str]) -> dict:
    from .. import arguments

    gpu = accelerator(opts.gpu)
    memory_gib = opts.gpu_memory_gib or gpu.memory_gib
    if memory_gib is None:
        raise UserError("--gpu cpu needs --gpu-memory-gib: the host memory each rank may use")
    usable = memory_gib * memory_model.USABLE_SHARE
    world = opts.nodes * opts.gpus_per_node
    plat = platform_of(gpu)
    named = layouts.named_flags(argv)
    layouts.refuse_unmodelled(named)
    if "--global-batch-size" not in named:
        raise UserError("--global-batch-size is not set: the sequences per optimizer step, which the plan keeps")
    if opts.verify and opts.nodes > 1:
        raise UserError("--verify trains the layouts on this machine: plan for --nodes 1 (several nodes: run the "
                        "printed commands with scripts/pretrain.sh)")
    args = layouts.resolve([*argv, *layouts.placeholders(named)], plat, world)
    if not gpu.cpu and not (args.bf16 or args.fp16):
        raise UserError("these flags train in FP32 (no --bf16 or --fp16; FP8 runs keep --bf16 too): on a GPU the "
                        "attention's fused kernels take 16-bit inputs only, so it would fall back to scores held in "
                        "memory, which the memory model does not cover; add --bf16")
    setup = memory_model.setup_from_args(args, world)  # refuses what the memory model does not cover
    measured, peak, rate_source = one_gpu_rate(opts, args, setup.shape, gpu)
    ic, link_source = interconnect(opts, gpu)
    rate = (measured, peak, ic, gpu, opts.host_ms_per_layer)
    evaluated, refused = evaluate(args, world, opts, named, plat, usable, rate)
    where = f"{world} {gpu.name} GPU{'s' if world > 1 else ''}"
    if not evaluated:
        reason = refused[0][1] if refused else "no layout to check"
        raise UserError(f"no layout of {where} passes litespark-train's checks with these flags: {reason}")
    fitting = sorted((e for e in evaluated if e.fits), key=rank)
    if not fitting:
        raise UserError(cannot_fit(args, argv, evaluated, world, opts, named, plat, usable, gpu, where))
    best = []
    for e in fitting[:opts.top]:
        # the printed command itself, parsed and checked as litespark-train will (not only the edited arguments)
        flags = [*argv, *e.candidate.flags(named)]
        arguments.check_run(layouts.resolve([*flags, *layouts.placeholders(named)], plat, world), plat, world)
        # what the command sets before torchrun, as scripts/pretrain.sh would on the node (H100 and H200: Hopper)
        environment = arguments.launch_environment(e.candidate.tp, e.candidate.cp, not gpu.cpu, {})
        best.append(e.as_dict(named, argv, world, opts.nodes, opts.gpus_per_node, environment))
    return dict(gpu=gpu.name, nodes=opts.nodes, gpus_per_node=opts.gpus_per_node, memory_gib=memory_gib,
                usable_gib=usable, model=_describe_model(args, setup), rate=rate_source, interconnect=link_source,
                checked=len(evaluated) + len(refused), refused=len(refused), refusals=refusal_counts(refused),
                do_not_fit=sum(not e.fits for e in evaluated), fit=len(fitting), layouts=best,
                cuda_graph_capture_step=arguments.cuda_graph_capture_step(args))


def refusal_counts(refused) -> List[dict]:
    """Each distinct reason layouts were refused for, with how many, the most frequent first."""
    counts = {}
    for _, reason in refused:
        counts[reason] = counts.get(reason, 0) + 1
    return [dict(reason=r, layouts=n) for r, n in sorted(counts.items(), key=lambda item: -item[1])]


def pipeline_splits(layers: int, worlds: Sequence[int]) -> Tuple[List[int], List[int]]:
    """(the pipeline sizes these GPU counts allow that split `layers` evenly, the deeper ones they allow that would
    split them unevenly)."""
    sizes = sorted({p for w in worlds for p in range(1, min(w, layers) + 1) if w % p == 0})
    even = [p for p in sizes if layers % p == 0]
    return even, [p for p in sizes if layers % p and p > max(even)]


def cannot_fit(args, argv, evaluated, world, opts, named, plat, usable, gpu, where) -> str:
    """One line: the smallest layout's need against the GPU's, and what would fit instead."""
    smallest = min(evaluated, key=lambda e: e.memory.required_gib)
    ways = []
    for factor in MORE_NODES:
        nodes = opts.nodes * factor
        more, _ = evaluate(args, nodes * opts.gpus_per_node, opts, named, plat, usable)
        fits = [e for e in more if e.fits]
        if fits:
            e = min(fits, key=lambda e: e.memory.required_gib)
            ways.append(f"{nodes} nodes of {opts.gpus_per_node} ({nodes * opts.gpus_per_node} GPUs), e.g. "
                        f"{e.candidate.describe()} at {e.memory.required_gib:.1f} GiB")
            break
    if gpu.fp8 and not (args.fp8 and args.use_precision_aware_optimizer):
        extra = ([] if args.fp8 else ["--fp8-format", "hybrid"]) + [f for f in PAO_FLAGS if f not in argv]
        lighter = layouts.resolve([*argv, *extra, *layouts.placeholders(named)], plat, world)
        fits = [e for e in evaluate(lighter, world, opts, layouts.named_flags([*argv, *extra]), plat, usable)[0]
                if e.fits]
        if fits:
            e = min(fits, key=lambda e: e.memory.required_gib)
            ways.append(f"FP8 with the precision-aware optimizer ({' '.join(extra)}), e.g. {e.candidate.describe()} "
                        f"at {e.memory.required_gib:.1f} GiB")
    if "--recompute-granularity" in named and args.recompute_granularity != "full":
        ways.append("full recomputation (drop --recompute-granularity: the plan then tries it)")
    what = ("what would fit: " + "; or ".join(ways)) if ways else \
        f"nothing tried fits either (up to {opts.nodes * MORE_NODES[-1]} nodes, FP8 with the precision-aware optimizer)"
    if not ways:
        worlds = [world] + [world * factor for factor in MORE_NODES]
        even, deeper = pipeline_splits(args.num_layers, worlds)
        if deeper:
            what += (f"; the plan splits the {args.num_layers} layers evenly only (pipeline sizes "
                     f"{', '.join(map(str, even))} on these GPU counts): deeper pipelines "
                     f"({', '.join(map(str, deeper))}) need an uneven split (--decoder-first-pipeline-num-layers, "
                     "--decoder-last-pipeline-num-layers, --account-for-embedding-in-pipeline-split), which it does "
                     "not model")
    return (f"no layout of {where} fits {args.model or 'the model'}: the smallest, "
            f"{smallest.candidate.describe()}, needs {smallest.memory.required_gib:.1f} GiB per GPU where "
            f"{usable:.1f} GiB fit ({memory_model.USABLE_SHARE:.0%} of {usable / memory_model.USABLE_SHARE:.1f}); "
            + what)


def _describe_model(args, setup) -> str:
    from ..metrics.flops import param_count

    precision = ("FP8 " + args.fp8 + " + " if args.fp8 else "") + \
        ("BF16" if args.bf16 else "FP16" if args.fp16 else "FP32")
    name = args.model or "model"
    return (f"{name}: {param_count(setup.shape).total / 1e9:.2f}B parameters, {precision}, seq {args.seq_length}, "
            f"global batch {args.global_batch_size}")


# ---- --verify: the best layouts trained here -------------------------------------------------------------------
def verify(result: dict, argv: Sequence[str], opts) -> List[dict]:
    """Train the best --verify layouts for --verify-steps steps with tools/layout_sweep.py; each row predicted
    beside measured (tokens/s per GPU; peak memory where the machine has a GPU)."""
    if not SWEEP.exists():
        raise UserError(f"--verify runs {SWEEP.relative_to(SWEEP.parents[1])} of a source checkout, which is not "
                        "here (pip install -e . from the repository)")
    named = layouts.named_flags(argv)
    steps = opts.verify_steps
    # a few steps, logged every third of them (the sweep averages the intervals after the first), no evaluation;
    # data and a learning rate only where the user's flags have none (later flags win): the plan's placeholders
    # for the steps and the evaluation are these. With CUDA graphs the first interval holds their capture.
    interval, capture = max(1, steps // 3), result.get("cuda_graph_capture_step")
    if capture is not None:
        interval = max(interval, capture)
        if steps < 2 * interval:
            raise UserError(f"--verify-steps {steps} with CUDA graphs (captured in step {capture}): the sweep times "
                            f"the log intervals after the first, which must hold the capture; give --verify-steps "
                            f"{2 * interval} or more")
    run = [*layouts.placeholders(named | {"--train-iters", "--eval-interval"}), "--train-iters", str(steps),
           "--log-interval", str(interval), "--eval-iters", "0", "--eval-interval", str(10 ** 6)]
    chosen = result["layouts"][:opts.verify]
    world = result["nodes"] * result["gpus_per_node"]
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SWEEP), "--out", str(out), "--timeout", str(opts.verify_timeout),
               "--allow-degraded"]
    for layout in chosen:
        command += ["--layout", f"{world}:{shlex.join(layout['layout_flags'])}"]
    command += ["--", *argv, *run]
    with open(out / "verify.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, check=False)
    sweep = out / "sweep.json"
    if not sweep.exists():
        raise UserError(f"--verify: tools/layout_sweep.py wrote no results; its log is {out / 'verify.log'}")
    rows = json.loads(sweep.read_text())["rows"]
    return [dict(layout=layout["layout"], predicted_tokens_per_sec_per_gpu=layout["tokens_per_sec_per_gpu"],
                 measured_tokens_per_sec_per_gpu=row.get("tokens_per_sec_per_gpu"),
                 predicted_peak_gib=layout["memory_gib"]["allocated"],
                 measured_peak_gib=row.get("mem_max_allocated_gb"),
                 error=row.get("error")) for layout, row in zip(chosen, rows)]


def render(result: dict) -> str:
    lines = [f"{PROG}: {result['model']}; {result['nodes']} node{'s' if result['nodes'] > 1 else ''} x "
             f"{result['gpus_per_node']} {result['gpu']} ({result['memory_gib']:.1f} GiB each; a layout fits in "
             f"{result['usable_gib']:.1f})",
             f"one GPU: {result['rate']}", f"interconnect: {result['interconnect']}",
             f"{result['checked']} layouts: {result['refused']} refused (litespark-train's checks, the estimate), "
             f"{result['do_not_fit']} do not fit, {result['fit']} fit; "]
    if result["refusals"]:  # why, the most frequent reasons first
        lines[-1] += "refused:"
        lines += [f"  {r['layouts']} x {r['reason']}" for r in result["refusals"][:REFUSALS_SHOWN]] + ["the best:"]
    else:
        lines[-1] += "the best:"
    for i, layout in enumerate(result["layouts"], 1):
        mem = layout["memory_gib"]
        mfu = f", MFU {layout['mfu']:.1%}" if layout["mfu"] is not None else ""
        pools = f" + {mem['graph_pools']:.1f} CUDA-graph pools" if mem["graph_pools"] else ""
        lines.append(f"{i}. {layout['layout']}: {layout['tokens_per_sec_per_gpu']:,.0f} tokens/s per GPU predicted"
                     f"{mfu}; peak {mem['allocated']:.1f} GiB{pools} (weights {mem['weights']:.1f}, gradients "
                     f"{mem['gradients']:.1f}, optimizer {mem['optimizer']:.1f}, activations {mem['activations']:.1f}, "
                     f"loss {mem['loss']:.1f})")
        lines.append(f"   {layout['command']}")
    for row in result.get("verified", []):
        if row["error"]:
            lines.append(f"verify {row['layout']}: failed: {row['error']}")
            continue
        measured = row["measured_tokens_per_sec_per_gpu"]
        mem = row["measured_peak_gib"]
        lines.append(f"verify {row['layout']}: {measured:,.0f} tokens/s per GPU measured, "
                     f"{row['predicted_tokens_per_sec_per_gpu']:,.0f} predicted "
                     f"({measured / row['predicted_tokens_per_sec_per_gpu']:.2f}x); peak "
                     + (f"{mem:.1f} GiB measured, " if mem is not None else "not measured (no GPU), ")
                     + f"{row['predicted_peak_gib']:.1f} predicted")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, trainer_argv = build_parser().parse_known_args(argv)
    try:
        result = plan(opts, trainer_argv)
        if opts.verify:
            result["verified"] = verify(result, trainer_argv, opts)
    except UserError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(json.dumps(result, indent=1) if opts.json else render(result), flush=True)
    return 0 if all(not r["error"] for r in result.get("verified", [])) else 1


if __name__ == "__main__":
    sys.exit(main())
