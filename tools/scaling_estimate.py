#!/usr/bin/env python3
"""Predict step time, tokens/s and MFU of a TP/PP/CP/DP layout on N nodes from one measured GPU.

    python tools/scaling_estimate.py --model llama-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 \\
        --gpu H200 --measured-tokens-per-sec-per-gpu 28021 --nodes 1 --gpus-per-node 2
    python tools/scaling_estimate.py --model llama-30b --tensor-model-parallel-size 4 \\
        --pipeline-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --overlap-grad-reduce \\
        --micro-batch-size 1 --global-batch-size 512 --gpu H100 --measured-mfu 0.40 --sweep-nodes 1,8,64

The single-GPU measurement is taken at the target's sequence length and micro-batch unless --measured-* says
otherwise. docs/metrics.md ("Scaling estimate") gives every formula and assumption.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import List, Optional, Sequence

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps import cli  # noqa: E402
from litespark_megatron.metrics.flops import training_flops_per_step  # noqa: E402
from litespark_megatron.apps.scaling_estimate import (  # noqa: E402
    BREAKDOWN_KEYS,
    CX7_400G_GBPS_PER_GPU,
    NCCL_BUS_EFFICIENCY,
    NETWORK_STEP_LATENCY_US,
    NVLINK4_GBPS_PER_DIRECTION,
    NVLINK_STEP_LATENCY_US,
    Interconnect,
    Layout,
    Measurement,
    ScalingError,
    estimate,
    hbm_tbps_for,
)

CONVENTION_LABEL = {"half": "causal-half, Megatron-LM", "full": "full attention, NeMo tables"}
BREAKDOWN_LABEL = {
    "compute": "compute (busiest stage)", "tp_comm": "TP collectives", "cp_exposed": "CP KV exchange, exposed",
    "cp_attention": "CP split attention",
    "host_wait": "host launches, beyond the GPU's time",
    "pp_bubble": "PP bubble", "pp_p2p": "PP send/receive", "dp_grad_exposed": "DP gradient reduction, exposed",
    "dp_param_gather_exposed": "DP parameter all-gather, exposed", "embedding_grad_sync": "tied-embedding sync",
    "optimizer": "optimizer step",
}


def latency(text: str) -> float:
    return cli.number(text, float, "a latency in microseconds >= 0", allow_zero=True)


def milliseconds(text: str) -> float:
    return cli.number(text, float, "milliseconds >= 0", allow_zero=True)


def node_list(text: str) -> List[int]:
    items = [t.strip() for t in str(text).split(",")]
    if not items or any(not t.isdigit() or int(t) < 1 for t in items):
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive node counts like 1,8,64 expected, "
                                         f"got {text!r}")
    return [int(t) for t in items]


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="scaling_estimate", description=__doc__.split("\n\n")[0])
    cli.add_model_args(p, required=True)
    g = p.add_argument_group("batch")
    g.add_argument("--global-batch-size", type=cli.positive_int, required=True, help="sequences per step")
    g.add_argument("--micro-batch-size", type=cli.positive_int, default=2, help="as litespark-train (default 2)")
    g = p.add_argument_group("parallel layout (litespark-train flags)")
    g.add_argument("--tensor-model-parallel-size", type=cli.positive_int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=cli.positive_int, default=1)
    g.add_argument("--context-parallel-size", type=cli.positive_int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=cli.positive_int, default=None)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="full recomputation repeats the forward TP collectives (the measured time must come from "
                        "a run with the same setting)")
    g.add_argument("--cp-comm-type", choices=["all_gather", "p2p"], default="all_gather",
                   help="context parallelism's attention: all_gather (Litespark's own, --core-attention sdpa) or p2p "
                        "(Transformer Engine's ring, what the te backend runs under CP by default)")
    g.add_argument("--grad-reduce-in-fp32", action=argparse.BooleanOptionalAction, default=True,
                   help="fp32 gradient buffers and reduction (what litespark-train does)")
    g = p.add_argument_group("cluster")
    g.add_argument("--nodes", type=cli.positive_int, default=None, help="default 1")
    g.add_argument("--gpus-per-node", type=cli.positive_int, default=8)
    g.add_argument("--sweep-nodes", type=node_list, default=None, help="node counts, e.g. 1,8,64: prints a table")
    g = p.add_argument_group("interconnect (bandwidths in GB/s = gigabytes, per GPU per direction)")
    g.add_argument("--nvlink-gbps", type=cli.positive_float, default=NVLINK4_GBPS_PER_DIRECTION,
                   help="NVLink line rate per GPU per direction (default: NVLink 4, 900 GB/s bidirectional)")
    g.add_argument("--nvlink-latency-us", type=latency, default=NVLINK_STEP_LATENCY_US,
                   help="per ring step over NVLink (default: NCCL's tuning model)")
    g.add_argument("--ib-gbps-per-gpu", type=cli.positive_float, default=CX7_400G_GBPS_PER_GPU,
                   help="network line rate per GPU per direction (default: one 400 Gb/s NIC per GPU = 50 GB/s)")
    g.add_argument("--ib-latency-us", type=latency, default=NETWORK_STEP_LATENCY_US,
                   help="per ring step over the network (default: NCCL's tuning model)")
    g.add_argument("--bus-efficiency", type=cli.fraction, default=NCCL_BUS_EFFICIENCY,
                   help="fraction of the line rate NCCL reaches (default 0.8: its ~20%% protocol overhead)")
    g.add_argument("--host-ms-per-layer", type=milliseconds, default=0.0,
                   help="the host's time to launch one layer's forward and backward for a micro-batch, ms: a floor on "
                        "a stage's micro-batch (default 0; docs/planner.md gives measured values)")
    g.add_argument("--hbm-tbps", type=cli.positive_float, default=None,
                   help="peak HBM bandwidth for the optimizer-step model (default: the datasheet value of --gpu)")
    g = p.add_argument_group("single-GPU measurement (one of the first two)")
    m = g.add_mutually_exclusive_group(required=True)
    m.add_argument("--measured-tokens-per-sec-per-gpu", type=cli.positive_float, default=None)
    m.add_argument("--measured-mfu", type=cli.fraction, default=None,
                   help="measured MFU (fraction) in --attention-convention")
    g.add_argument("--measured-seq-length", type=cli.positive_int, default=None, help="default --seq-length")
    g.add_argument("--measured-micro-batch-size", type=cli.positive_int, default=None,
                   help="default --micro-batch-size")
    g.add_argument("--measured-global-batch-size", type=cli.positive_int, default=None,
                   help="default --global-batch-size")
    g.add_argument("--optimizer-step-ms", type=cli.positive_float, default=None,
                   help="measured optimizer-step time of the single-GPU run (default: modelled from its memory "
                        "traffic at --hbm-tbps)")
    cli.add_peak_args(p)
    p.add_argument("--attention-convention", choices=["half", "full"], default="full",
                   help="FLOP convention of the MFU printed and of --measured-mfu (default full)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _inputs(args):
    shape = cli.shape_from_cli(args)
    peak = cli.resolve_peak(args, "the estimate")
    if args.nodes is not None and args.sweep_nodes is not None:
        raise cli.UsageError("give --nodes or --sweep-nodes, not both")
    try:
        layout = Layout(
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
            sequence_parallel=args.sequence_parallel, use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather,
            recompute_granularity=args.recompute_granularity, grad_reduce_in_fp32=args.grad_reduce_in_fp32,
            cp_comm_type=args.cp_comm_type)
        ic = Interconnect(nvlink_gbps=args.nvlink_gbps, nvlink_latency_us=args.nvlink_latency_us,
                          ib_gbps_per_gpu=args.ib_gbps_per_gpu, ib_latency_us=args.ib_latency_us,
                          bus_efficiency=args.bus_efficiency, gpus_per_node=args.gpus_per_node)
    except ScalingError as e:
        raise cli.UsageError(str(e)) from None
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise cli.UsageError("--overlap-param-gather needs --use-distributed-optimizer")
    seq1 = args.measured_seq_length or shape.seq_length
    mb1 = args.measured_micro_batch_size or args.micro_batch_size
    gbs1 = args.measured_global_batch_size or args.global_batch_size
    if gbs1 % mb1:
        raise cli.UsageError(f"the measured global batch {gbs1} is not a multiple of its micro-batch {mb1}")
    if args.measured_mfu is not None:
        shape1 = dataclasses.replace(shape, seq_length=seq1)
        per_token = training_flops_per_step(shape1, 1, causal=args.attention_convention).model_flops_per_token
        tps1 = args.measured_mfu * peak.tflops * 1e12 / per_token
    else:
        tps1 = args.measured_tokens_per_sec_per_gpu
    measured = Measurement(tokens_per_sec_per_gpu=tps1, seq_length=seq1, micro_batch_size=mb1,
                           global_batch_size=gbs1,
                           optimizer_step_s=None if args.optimizer_step_ms is None else args.optimizer_step_ms / 1e3)
    hbm = args.hbm_tbps
    if hbm is None and args.optimizer_step_ms is None:
        hbm = hbm_tbps_for(args.gpu)
        if hbm is None:
            raise cli.UsageError(f"no datasheet HBM bandwidth for {args.gpu or 'this GPU'!s}: pass --hbm-tbps "
                                  f"(TB/s) or --optimizer-step-ms (the single-GPU run's measured optimizer step)")
    return shape, peak, layout, ic, measured, hbm


def compute(args) -> dict:
    shape, peak, layout, ic, measured, hbm = _inputs(args)
    node_counts = args.sweep_nodes or [args.nodes or 1]
    results = []
    for n in node_counts:
        try:
            est = estimate(shape, layout, nodes=n, global_batch_size=args.global_batch_size,
                           micro_batch_size=args.micro_batch_size, measured=measured, peak=peak, interconnect=ic,
                           hbm_tbps=hbm, convention=args.attention_convention,
                           host_s_per_layer=args.host_ms_per_layer / 1e3)
        except ScalingError as e:
            where = f" at {n} node{'s' if n > 1 else ''} ({n * ic.gpus_per_node} GPUs)" if args.sweep_nodes else ""
            raise cli.UsageError(f"{e}{where}") from None
        results.append(est.as_dict())
    return {
        "model": {"preset": args.model, "description": cli.describe_shape(args.model, shape)},
        "layout": dataclasses.asdict(layout),
        "batch": {"global_batch_size": args.global_batch_size, "micro_batch_size": args.micro_batch_size,
                  "seq_length": shape.seq_length},
        "interconnect": dataclasses.asdict(ic),
        "hbm_tbps": hbm,
        "measured": dataclasses.asdict(measured) | {"from": "mfu" if args.measured_mfu is not None
                                                     else "tokens_per_sec_per_gpu",
                                                     "mfu": args.measured_mfu},
        "peak": peak.as_dict(),
        "sweep": bool(args.sweep_nodes),
        "estimates": results,
    }


def _layout_line(out: dict, est: dict) -> str:
    lay = out["layout"]
    parts = [f"TP {lay['tensor_model_parallel_size']}", f"PP {lay['pipeline_model_parallel_size']}"
             + (f" x {est['virtual_pipeline_size']} virtual" if est["virtual_pipeline_size"] > 1 else ""),
             f"CP {lay['context_parallel_size']}", f"DP {est['data_parallel_size']}"]
    flags = [f for f in ("sequence_parallel", "use_distributed_optimizer", "overlap_grad_reduce",
                         "overlap_param_gather") if lay[f]]
    if lay["recompute_granularity"]:
        flags.append(f"{lay['recompute_granularity']} recompute")
    return ", ".join(parts) + (f"; {', '.join(f.replace('_', ' ') for f in flags)}" if flags else "")


def render(out: dict) -> str:
    ic, batch, first = out["interconnect"], out["batch"], out["estimates"][0]
    single = first["single_gpu"]
    conv = first["convention"]
    lines = [f"model {out['model']['description']}",
             f"batch: global {batch['global_batch_size']} x {batch['seq_length']} tokens, micro-batch "
             f"{batch['micro_batch_size']}"]
    meas = out["measured"]
    src = (f"MFU {100 * meas['mfu']:.2f}% ({CONVENTION_LABEL[conv]})" if meas["from"] == "mfu"
           else f"{meas['tokens_per_sec_per_gpu']:,.1f} tokens/s")
    opt_src = "measured" if meas["optimizer_step_s"] is not None else f"modelled at {out['hbm_tbps']:g} TB/s HBM"
    lines.append(f"single GPU (measured {src}, micro-batch {meas['micro_batch_size']} x {meas['seq_length']}, "
                 f"global batch {meas['global_batch_size']}): step {single['step_time_s']:.4f} s = "
                 f"{int(single['num_microbatches'])} micro-batches x {1e3 * single['microbatch_s']:.2f} ms + "
                 f"optimizer {1e3 * single['optimizer_s']:.2f} ms ({opt_src}); "
                 f"{single['tokens_per_sec_per_gpu']:,.1f} tokens/s, {single['model_tflops']:.1f} TFLOP/s, "
                 f"MFU {100 * single['mfu']:.2f}%")
    lines.append(f"interconnect: NVLink {ic['nvlink_gbps']:g} GB/s, network {ic['ib_gbps_per_gpu']:g} GB/s per GPU "
                 f"(per direction) x bus efficiency {ic['bus_efficiency']:g}; latency {ic['nvlink_latency_us']:g} / "
                 f"{ic['ib_latency_us']:g} us per ring step; {ic['gpus_per_node']} GPUs per node")
    peak = out["peak"]
    lines.append(f"peak: {peak['device']} {peak['tflops']:g} TFLOP/s ({peak['mfu_basis']}); MFU in the "
                 f"{CONVENTION_LABEL[conv]} convention")
    if out["sweep"]:
        lines.append(f"layout: {_layout_line(out, first)}")
        lines.append(render_table(out["estimates"]))
    else:
        e = first
        lines.append(f"layout: {_layout_line(out, e)}; {e['world_size']} GPUs = {e['nodes']} node"
                     f"{'s' if e['nodes'] > 1 else ''}; {e['num_microbatches']} micro-batches per step")
        names = {"tp": "TP", "cp": "CP", "dp": "gradient-reduction (DP x CP)", "pp": "PP"}
        for key, g in e["groups"].items():
            if g["size"] > 1:
                lines.append(f"  {names[key]} groups: {g['size']} ranks, stride {g['stride']}, {g['where']}, "
                             f"bus {g['bus_gbps']:.0f} GB/s")
        lines.append("step breakdown:")
        for key in BREAKDOWN_KEYS:
            v = e["breakdown"][key]
            if v:
                lines.append(f"  {BREAKDOWN_LABEL[key]:<36}{1e3 * v:12.2f} ms {100 * v / e['step_time_s']:6.2f}%")
        lines.append(f"  {'step':<36}{1e3 * e['step_time_s']:12.2f} ms")
        lines.append(f"tokens/s {e['tokens_per_sec']:,.1f} total, {e['tokens_per_sec_per_gpu']:,.1f} per GPU; "
                     f"{e['model_tflops_per_gpu']:.1f} TFLOP/s per GPU; MFU {100 * e['mfu']:.2f}%; scaling "
                     f"efficiency {e['scaling_efficiency']:.3f} of the single GPU")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in first["assumptions"]]
    return "\n".join(lines)


def render_table(estimates: List[dict]) -> str:
    head = (f"{'nodes':>6}{'GPUs':>7}{'DP':>6}{'micro':>7}{'step s':>10}{'tokens/s':>14}{'tok/s/GPU':>11}"
            f"{'MFU':>8}{'eff':>7}   share of step: compute/TP/CP/bubble/p2p/DP/optimizer")
    rows = [head]
    for e in estimates:
        b, step = e["breakdown"], e["step_time_s"]
        dp = b["dp_grad_exposed"] + b["dp_param_gather_exposed"] + b["embedding_grad_sync"]
        cp = b["cp_exposed"] + b["cp_attention"]
        shares = "/".join(f"{100 * x / step:.1f}" for x in (b["compute"], b["tp_comm"], cp, b["pp_bubble"],
                                                            b["pp_p2p"], dp, b["optimizer"]))
        rows.append(f"{e['nodes']:>6}{e['world_size']:>7}{e['data_parallel_size']:>6}{e['num_microbatches']:>7}"
                    f"{step:>10.3f}{e['tokens_per_sec']:>14,.0f}{e['tokens_per_sec_per_gpu']:>11,.1f}"
                    f"{100 * e['mfu']:>7.2f}%{e['scaling_efficiency']:>7.3f}   {shares}")
    return "\n".join(rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return cli.report_main(argv, build_parser(), compute, render)


if __name__ == "__main__":
    sys.exit(main())
