"""Multi-node scaling estimate: step time, tokens/s and MFU of a TP/PP/CP/DP layout, from one measured GPU.

The input is a single-GPU training measurement (tokens/s per GPU, or MFU) of the same model. Its step time is
split into the optimizer step (a per-step cost, modelled from memory traffic, or measured) and the forward +
backward time of one micro-batch. The estimate then runs that micro-batch on the target layout:

* compute: the single-GPU micro-batch time, scaled by the executed FLOPs of the target micro-batch, the share
  of the model on the busiest pipeline stage, and divided by TP x CP (every GEMM and the attention core split
  evenly; the efficiency loss of smaller GEMMs is not modelled, so TP/CP estimates are optimistic);
* TP: per layer 2 all-reduces forward and 2 backward of the activations (b x s/cp x h x 2 bytes); sequence
  parallelism turns each into a reduce-scatter + all-gather of the same total volume (same ring time); full
  recomputation runs the 2 forward ones again; the embedding (forward) and the output layer (backward) add one
  each, the vocabulary-parallel loss 3 small all-reduces. Exposed: Megatron runs them on the compute stream;
* PP: 1F1B with m micro-batches per step: bubble = (pp-1)/v micro-batch times (fraction (pp-1)/(v m + pp-1));
  each micro-batch sends its activations forward and its gradients back at every stage boundary;
* CP, ``cp_comm_type="all_gather"``: Litespark's all-gather attention: per layer an all-gather of every rank's K
  and V over the CP group forward (again with full recomputation) and a reduce-scatter of their gradients backward,
  exposed (the attention waits for them); ``"p2p"``: Transformer Engine's ring attention (what the te backend runs
  under CP): CP - 1 ring steps per layer, each passing one rank's K and V (backward: K, V and their gradients) to
  the next rank while the attention of the block at hand runs, so only what a step's transfer takes beyond that
  block's attention is exposed; either way a CP rank's micro-batch costs CP_ATTENTION_OVERHEAD more than 1/CP of the
  one GPU's (the attention split into smaller kernels, its partial results merged: measured, not derived);
* DP (gradients are reduced over the data-parallel x context-parallel group): all-reduce of the gradient
  buffer, or reduce-scatter of gradients + all-gather of parameters with the distributed optimizer; exposed
  unless --overlap-grad-reduce / --overlap-param-gather;
* the optimizer step, which DP does not shrink without the distributed optimizer;
* the host (``host_s_per_layer``, 0 unless given): a stage's micro-batch takes at least the host's time to launch its
  layers' kernels, where the GPU's work per launch is small (micro-batch 1, TP and CP without CUDA graphs).

Collectives use the ring model: time = (n-1)/n (reduce-scatter, all-gather) or 2(n-1)/n (all-reduce) x bytes /
bus bandwidth + the per-step latency of each ring step (NCCL's own tuning model counts the same steps). The bus
bandwidth of a group is that of where it lands under Megatron's rank order tp-cp-ep-dp-pp (tensor-parallel ranks
adjacent) with ``gpus_per_node`` GPUs per node: NVLink if the group stays in one node; if it spans nodes, the
NICs of its GPUs in one node, capped by NVLink (each ring crosses the node boundary on one NIC; NCCL runs one ring
per NIC). docs/metrics.md ("Scaling estimate") gives every formula and the check against a measured DP2 run.

Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from litespark_megatron.metrics.flops import (
    CAUSAL_CONVENTIONS,
    ModelShape,
    layer_forward_per_sequence,
    param_count,
    training_flops_per_step,
)
from litespark_megatron.metrics.peaks import Peak, match_device


class ScalingError(ValueError):
    """An input the estimate cannot use (a layout that does not fit the world or the model, a non-positive
    number, a missing bandwidth); the message says which and what to change."""


# ---- interconnect defaults (DGX/HGX H100 and H200) ----------------------------------------------------------
# NVLink 4 (H100/H200 SXM; NVIDIA H100 and H200 datasheets): 900 GB/s bidirectional per GPU over 18 links through
# NVSwitch, i.e. 450 GB/s per direction between any two GPUs of the node.
NVLINK4_GBPS_PER_DIRECTION = 450.0
# DGX H100 / DGX H200 compute fabric: 8 ConnectX-7 NICs at 400 Gb/s InfiniBand (or EFA/RoCE at that rate), one per
# GPU: 400 Gb/s = 50 GB/s per GPU per direction.
CX7_400G_GBPS_PER_GPU = 50.0
# What NCCL's Simple protocol moves per unit of line rate: the NCCL maintainers give ~20% protocol overhead on
# NVLink ("450GB/s is the line rate ... NCCL can get an effective NVLink bandwidth of 370GB/s", NVIDIA/nccl-tests
# issue 212): 370 / 450 = 0.82. Applied to both NVLink and the network.
NCCL_BUS_EFFICIENCY = 0.8
# Per-ring-step latency of NCCL's Ring/Simple algorithm in its own tuning model (src/graph/tuning.cc, hwLat):
# 3.4 us over NVLink, 9.6 us over the network.
NVLINK_STEP_LATENCY_US = 3.4
NETWORK_STEP_LATENCY_US = 9.6

# Peak HBM bandwidth per GPU, TB/s, from the datasheets, keyed like peaks.PEAK_TFLOPS. Only where the key names
# one memory configuration: A100 (40 GB HBM2 1.555 TB/s vs 80 GB HBM2e 2.0 TB/s) and GH200 (HBM3 vs HBM3e) do
# not, and B200 is left out; for those pass --hbm-tbps.
HBM_TBPS = {
    "H100-SXM": 3.35,   # H100 datasheet, SXM5 80 GB HBM3
    "H100-PCIE": 2.0,   # H100 datasheet, PCIe 80 GB HBM2e
    "H100-NVL": 3.9,    # H100 datasheet, NVL 94 GB HBM3
    "H200": 4.8,        # H200 datasheet, SXM 141 GB HBM3e
    "H200-NVL": 4.8,    # H200 datasheet, NVL 141 GB HBM3e
    "L40S": 0.864,      # L40S datasheet, 48 GB GDDR6
}

# Context parallelism's attention costs more than its K/V exchange: TE splits a layer's attention into 2 x CP - 1
# smaller kernels per pass (ring) or all-to-alls around it (a2a), merges the partial outputs in fp32 and waits for
# each step.
# Measured, a CP rank's micro-batch takes this much longer than 1/CP of one GPU's: the median over the CP rows of
# docs/benchmarks (docs/planner.md, "The estimate"; 8-43% on two to four H200s, 4k-16k tokens).
CP_ATTENTION_OVERHEAD = 0.17

# Megatron-Core's default gradient bucket (distributed_data_parallel.py: max(40M, 1M x data-parallel size)
# parameters) when --overlap-grad-reduce is on; without it the whole buffer is one bucket.
BUCKET_MIN_PARAMS = 40_000_000
BUCKET_PARAMS_PER_DP_RANK = 1_000_000

# Bytes moved per parameter by one optimizer step of Megatron's mixed-precision Adam (bf16/fp16 model parameters,
# fp32 main parameters and moments), with gradient buffers of ``g`` bytes (4: grad_reduce_in_fp32, what
# litespark-train uses; 2: bf16):
#   zero the gradient buffer (write g), gradient norm for clipping (read 4), Adam (read param, grad, m, v;
#   write param, m, v: 7 x 4), copy main parameters to the 16-bit model parameters (read 4, write 2);
#   with 16-bit gradients also the copy to fp32 main gradients (read 2, write 4).
# With DP > 1 Megatron DDP scales the gradients by 1/DP before the reduction (read g, write g).
ADAM_BYTES_PER_PARAM = 28
MAIN_PARAM_COPY_BYTES = 6
GRAD_NORM_BYTES = 4


@dataclass(frozen=True)
class Interconnect:
    """Links between GPUs. Bandwidths in GB/s (gigabytes, not gigabits) per GPU per direction; latencies in us
    per ring step; ``bus_efficiency`` is the fraction of the line rate NCCL reaches (its protocol overhead)."""

    nvlink_gbps: float = NVLINK4_GBPS_PER_DIRECTION
    nvlink_latency_us: float = NVLINK_STEP_LATENCY_US
    ib_gbps_per_gpu: float = CX7_400G_GBPS_PER_GPU
    ib_latency_us: float = NETWORK_STEP_LATENCY_US
    bus_efficiency: float = NCCL_BUS_EFFICIENCY
    gpus_per_node: int = 8

    def __post_init__(self):
        for name in ("nvlink_gbps", "ib_gbps_per_gpu"):
            _positive(name, getattr(self, name))
        for name in ("nvlink_latency_us", "ib_latency_us"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v >= 0:
                raise ScalingError(f"{name} must be a number >= 0, got {v!r}")
        if not 0 < self.bus_efficiency <= 1:
            raise ScalingError(f"bus_efficiency must be in (0, 1], got {self.bus_efficiency!r}")
        _positive_int("gpus_per_node", self.gpus_per_node)

    @property
    def intra_bytes_per_s(self) -> float:
        return self.nvlink_gbps * 1e9 * self.bus_efficiency

    @property
    def nic_bytes_per_s(self) -> float:
        return self.ib_gbps_per_gpu * 1e9 * self.bus_efficiency


@dataclass(frozen=True)
class Layout:
    """The parallel layout and the Megatron options that change communication (litespark-train flag names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    recompute_granularity: Optional[str] = None  # None, "full" or "selective"
    cp_comm_type: str = "all_gather"  # "all_gather" (Litespark's own CP attention) or "p2p" (TE's ring attention)
    grad_reduce_in_fp32: bool = True  # litespark-train always reduces gradients in fp32

    def __post_init__(self):
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            _positive_int(name, getattr(self, name))
        if self.num_layers_per_virtual_pipeline_stage is not None:
            _positive_int("num_layers_per_virtual_pipeline_stage", self.num_layers_per_virtual_pipeline_stage)
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ScalingError(f"recompute_granularity must be None, 'full' or 'selective', "
                               f"got {self.recompute_granularity!r}")
        if self.cp_comm_type not in ("all_gather", "p2p"):
            raise ScalingError(f"cp_comm_type must be 'all_gather' or 'p2p', got {self.cp_comm_type!r}")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class Measurement:
    """A single-GPU training measurement: throughput at a given micro-batch, global batch and sequence length.

    ``optimizer_step_s``: the measured time of its optimizer step (e.g. from a profile); None models it from the
    optimizer's memory traffic at the GPU's peak HBM bandwidth.
    """

    tokens_per_sec_per_gpu: float
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    optimizer_step_s: Optional[float] = None

    def __post_init__(self):
        _positive("tokens_per_sec_per_gpu", self.tokens_per_sec_per_gpu)
        for name in ("seq_length", "micro_batch_size", "global_batch_size"):
            _positive_int(f"measured {name}", getattr(self, name))
        if self.global_batch_size % self.micro_batch_size:
            raise ScalingError(f"measured global batch {self.global_batch_size} is not a multiple of its "
                               f"micro-batch {self.micro_batch_size}")
        if self.optimizer_step_s is not None:
            _positive("optimizer_step_s", self.optimizer_step_s)


@dataclass(frozen=True)
class GroupPlacement:
    """Where one kind of process group lands. ``gpus_per_node_in_group``: fewest members any node of a group
    holds (its NICs carry the inter-node traffic); ``bytes_per_s``: the bus bandwidth used for it."""

    name: str
    size: int
    stride: int
    nodes_spanned: int
    gpus_per_node_in_group: int
    bytes_per_s: float

    @property
    def where(self) -> str:
        if self.size == 1:
            return "none (size 1)"
        return "intra-node" if self.nodes_spanned == 1 else f"inter-node ({self.nodes_spanned} nodes)"

    def as_dict(self) -> dict:
        return dict(name=self.name, size=self.size, stride=self.stride, nodes_spanned=self.nodes_spanned,
                    gpus_per_node_in_group=self.gpus_per_node_in_group, bus_gbps=self.bytes_per_s / 1e9,
                    where=self.where)


@dataclass(frozen=True)
class ScalingEstimate:
    """The prediction. Times are seconds per optimizer step; ``breakdown`` sums to ``step_time_s``."""

    nodes: int
    world_size: int
    data_parallel_size: int
    num_microbatches: int
    virtual_pipeline_size: int
    breakdown: Dict[str, float]
    step_time_s: float
    tokens_per_step: int
    tokens_per_sec: float
    tokens_per_sec_per_gpu: float
    model_tflops_per_gpu: float
    mfu: float
    scaling_efficiency: float
    convention: str
    groups: Dict[str, GroupPlacement]
    single_gpu: Dict[str, float]
    details: Dict[str, float]
    assumptions: List[str]

    def as_dict(self) -> dict:
        return dict(nodes=self.nodes, world_size=self.world_size, data_parallel_size=self.data_parallel_size,
                    num_microbatches=self.num_microbatches, virtual_pipeline_size=self.virtual_pipeline_size,
                    breakdown=dict(self.breakdown), step_time_s=self.step_time_s,
                    tokens_per_step=self.tokens_per_step, tokens_per_sec=self.tokens_per_sec,
                    tokens_per_sec_per_gpu=self.tokens_per_sec_per_gpu,
                    model_tflops_per_gpu=self.model_tflops_per_gpu, mfu=self.mfu,
                    scaling_efficiency=self.scaling_efficiency, convention=self.convention,
                    groups={k: g.as_dict() for k, g in self.groups.items()}, single_gpu=dict(self.single_gpu),
                    details=dict(self.details), assumptions=list(self.assumptions))


BREAKDOWN_KEYS = ("compute", "tp_comm", "cp_exposed", "cp_attention", "host_wait", "pp_bubble", "pp_p2p",
                  "dp_grad_exposed", "dp_param_gather_exposed", "embedding_grad_sync", "optimizer")


def _positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ScalingError(f"{name} must be a positive number, got {value!r}")


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScalingError(f"{name} must be a positive integer, got {value!r}")


# ---- collectives -------------------------------------------------------------------------------------------
def group_placement(name: str, size: int, stride: int, world_size: int, ic: Interconnect) -> GroupPlacement:
    """Placement of the groups of ``size`` ranks ``stride`` apart (Megatron's rank order puts the fastest-varying
    dimension, TP, at stride 1). Reports the worst group: the most nodes spanned, the fewest GPUs on one node."""
    if size == 1:
        return GroupPlacement(name, 1, stride, 1, 1, ic.intra_bytes_per_s)
    gpn = ic.gpus_per_node
    most_nodes, fewest = 1, size
    # Groups are the ranks base + i*stride, for every base whose index along this dimension is 0.
    for base in range(world_size):
        if (base // stride) % size or base + (size - 1) * stride >= world_size:
            continue
        per_node: Dict[int, int] = {}
        for i in range(size):
            node = (base + i * stride) // gpn
            per_node[node] = per_node.get(node, 0) + 1
        most_nodes = max(most_nodes, len(per_node))
        if len(per_node) > 1:
            fewest = min(fewest, min(per_node.values()))
    if most_nodes == 1:
        return GroupPlacement(name, size, stride, 1, size, ic.intra_bytes_per_s)
    # Each NCCL ring crosses a node boundary on one NIC, and NCCL runs one ring per NIC, so a group with k GPUs on a
    # node has k NICs' worth of network bandwidth, and never more than NVLink inside the node.
    bw = min(ic.intra_bytes_per_s, fewest * ic.nic_bytes_per_s)
    return GroupPlacement(name, size, stride, most_nodes, fewest, bw)


def _latency_s(steps: int, inter_steps: int, ic: Interconnect) -> float:
    return ((steps - inter_steps) * ic.nvlink_latency_us + inter_steps * ic.ib_latency_us) * 1e-6


def all_reduce_s(nbytes: float, group: GroupPlacement, ic: Interconnect) -> float:
    """Ring all-reduce: 2(n-1)/n x bytes / bus bandwidth + 2(n-1) step latencies (2(N-1) of them between nodes)."""
    n = group.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / group.bytes_per_s + _latency_s(2 * (n - 1), 2 * (group.nodes_spanned - 1), ic)


def reduce_scatter_s(nbytes: float, group: GroupPlacement, ic: Interconnect) -> float:
    """Ring reduce-scatter (or all-gather) of a ``nbytes`` buffer: (n-1)/n x bytes / bus bandwidth + n-1 steps."""
    n = group.size
    if n == 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / group.bytes_per_s + _latency_s(n - 1, group.nodes_spanned - 1, ic)


all_gather_s = reduce_scatter_s


def p2p_s(nbytes: float, inter_node: bool, ic: Interconnect) -> float:
    """One send/receive between two GPUs: over NVLink, or over the sending GPU's NIC."""
    if inter_node:
        return nbytes / ic.nic_bytes_per_s + ic.ib_latency_us * 1e-6
    return nbytes / ic.intra_bytes_per_s + ic.nvlink_latency_us * 1e-6


def pipeline_bubble_fraction(pp: int, num_microbatches: int, virtual: int = 1) -> float:
    """Idle share of a 1F1B step: (pp-1)/v of a micro-batch's time out of m + (pp-1)/v of them."""
    return (pp - 1) / (virtual * num_microbatches + pp - 1)


# ---- the estimate ------------------------------------------------------------------------------------------
def hbm_tbps_for(device: Optional[str]) -> Optional[float]:
    """Datasheet peak HBM bandwidth of a device name, or None when the table has no single value for it."""
    key = match_device(device) if device else None
    return HBM_TBPS.get(key) if key else None


def optimizer_bytes(params: float, dp: int, distributed: bool, grad_bytes: int) -> float:
    """HBM bytes moved by one optimizer step on a rank holding ``params`` parameters (see ADAM_BYTES_PER_PARAM)."""
    per_shard = GRAD_NORM_BYTES + ADAM_BYTES_PER_PARAM + MAIN_PARAM_COPY_BYTES + (6 if grad_bytes == 2 else 0)
    full = grad_bytes  # zeroing the gradient buffer touches all of it, also with the distributed optimizer
    if dp > 1:
        full += 2 * grad_bytes  # the 1/DP pre-scaling of megatron DDP
    return params * (full + per_shard / (dp if distributed else 1))


def _kv_width(shape: ModelShape) -> int:
    """K and V values per token per layer that context parallelism exchanges (all heads)."""
    if shape.mla is None:
        return 2 * shape.num_query_groups * shape.kv_channels
    m = shape.mla
    return shape.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim)


def _layer_norm_params(shape: ModelShape) -> int:
    """Norm weights of one layer: replicated on every TP rank (everything else in a layer is split by TP)."""
    extra = 0
    if shape.mla is not None:
        extra = shape.mla.kv_lora_rank + (shape.mla.q_lora_rank or 0)
    return 2 * shape.hidden_size + extra


def stage_layers(num_layers: int, pp: int, virtual: int = 1) -> List[List[int]]:
    """The layers each pipeline stage holds: model chunks of num_layers / (pp x virtual) layers, dealt round-robin
    to the stages (megatron-core's interleaved order; one chunk per stage without virtual stages)."""
    chunk = num_layers // (pp * virtual)
    return [[i for i in range(num_layers) if (i // chunk) % pp == r] for r in range(pp)]


def stage_parameters(shape: ModelShape, tp: int, pp: int, virtual: int = 1) -> List[Tuple[float, float]]:
    """(parameters, of which the layers' linear weights) one TP rank of each pipeline stage holds. Everything in a
    layer but its norms is split by TP; the first stage holds the embedding, the last the final norm and the output
    layer (a copy of the embedding when tied, under PP)."""
    layer_params = param_count(shape).transformer_layers // shape.num_layers
    norm_params = _layer_norm_params(shape)
    emb_params = shape.vocab_size * shape.hidden_size
    tied = not shape.untie_embeddings_and_output_weights
    out = []
    for r, layers in enumerate(stage_layers(shape.num_layers, pp, virtual)):
        linear = len(layers) * (layer_params - norm_params) / tp
        params = linear + len(layers) * norm_params
        if r == 0:
            params += emb_params / tp
        if r == pp - 1:
            params += shape.hidden_size  # final norm
            if not tied or pp > 1:
                params += emb_params / tp  # the output layer (a copy of the embedding when tied)
        out.append((params, linear))
    return out


def check_layout(shape: ModelShape, layout: Layout, world_size: int, global_batch_size: int,
                 micro_batch_size: int) -> Tuple[int, int, int]:
    """(data-parallel size, micro-batches per step, virtual stages) or ScalingError with what does not fit."""
    tp, pp, cp = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.context_parallel_size)
    if shape.moe is not None:
        raise ScalingError("mixture-of-experts models are not modelled (their expert-parallel all-to-all is not); "
                           "use a dense model")
    if world_size % layout.model_parallel_size:
        raise ScalingError(f"{world_size} GPUs are not divisible by TP x PP x CP = {tp} x {pp} x {cp} = "
                           f"{layout.model_parallel_size}")
    if shape.num_attention_heads % tp:
        raise ScalingError(f"{shape.num_attention_heads} attention heads are not divisible by TP {tp}")
    if shape.mla is None and shape.num_query_groups % tp:
        raise ScalingError(f"{shape.num_query_groups} query groups (KV heads) are not divisible by TP {tp}")
    if shape.ffn_hidden_size % tp:
        raise ScalingError(f"FFN hidden size {shape.ffn_hidden_size} is not divisible by TP {tp}")
    if shape.vocab_size % tp:
        raise ScalingError(f"padded vocabulary {shape.vocab_size} is not divisible by TP {tp}")
    if layout.sequence_parallel and tp == 1:
        raise ScalingError("sequence parallelism needs TP > 1")
    vp_layers = layout.num_layers_per_virtual_pipeline_stage
    if vp_layers is not None:
        if pp < 2:
            raise ScalingError("virtual pipeline stages need PP >= 2")
        if shape.num_layers % (pp * vp_layers):
            raise ScalingError(f"{shape.num_layers} layers are not divisible by PP x layers per virtual stage = "
                               f"{pp} x {vp_layers}")
        virtual = shape.num_layers // (pp * vp_layers)
    else:
        if shape.num_layers % pp:
            raise ScalingError(f"{shape.num_layers} layers are not divisible by PP {pp}")
        virtual = 1
    if cp > 1 and shape.seq_length % (2 * cp):
        raise ScalingError(f"sequence length {shape.seq_length} is not divisible by 2 x CP = {2 * cp}")
    dp = world_size // layout.model_parallel_size
    if global_batch_size % (micro_batch_size * dp):
        raise ScalingError(f"global batch {global_batch_size} is not divisible by micro-batch x DP = "
                           f"{micro_batch_size} x {dp} = {micro_batch_size * dp}")
    m = global_batch_size // (micro_batch_size * dp)
    if virtual > 1 and m % pp:
        # Megatron-Core's interleaved schedule refuses this (micro-batch groups of PP).
        raise ScalingError(f"the interleaved pipeline needs the micro-batches per step ({m}) to be a multiple of "
                           f"PP {pp}")
    return dp, m, virtual


def estimate(shape: ModelShape, layout: Layout, *, nodes: int, global_batch_size: int, micro_batch_size: int,
             measured: Measurement, peak: Peak, interconnect: Interconnect = Interconnect(),
             hbm_tbps: Optional[float] = None, convention: str = "full",
             host_s_per_layer: float = 0.0) -> ScalingEstimate:
    """Predict one optimizer step of ``shape`` (at ``shape.seq_length``) on ``nodes`` x gpus_per_node GPUs.

    ``measured``: the single-GPU measurement. ``peak``: the MFU denominator (peaks.detect_peak). ``hbm_tbps``:
    peak HBM bandwidth for the optimizer-step model (default: the table entry of ``peak.device``); not needed when
    ``measured.optimizer_step_s`` is given. ``convention``: attention convention of the MFU ("full" or "half").
    ``host_s_per_layer``: the host's time to launch one layer's forward and backward kernels for a micro-batch; a
    stage's micro-batch takes at least that times its layers (0: the host is never the bottleneck).
    """
    ic = interconnect
    _positive_int("nodes", nodes)
    _positive_int("global_batch_size", global_batch_size)
    _positive_int("micro_batch_size", micro_batch_size)
    if convention not in CAUSAL_CONVENTIONS:
        raise ScalingError(f"convention must be 'half' or 'full', got {convention!r}")
    if not host_s_per_layer >= 0:
        raise ScalingError(f"host_s_per_layer must be >= 0, got {host_s_per_layer!r}")
    world = nodes * ic.gpus_per_node
    dp, m, v = check_layout(shape, layout, world, global_batch_size, micro_batch_size)
    tp, pp, cp = (layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
                  layout.context_parallel_size)
    L, h, s, b = shape.num_layers, shape.hidden_size, shape.seq_length, micro_batch_size
    act_bytes = 2  # bf16/fp16 activations and activation gradients at every communication boundary
    grad_bytes = 4 if layout.grad_reduce_in_fp32 else 2
    param_bytes = 2  # 16-bit model parameters (what the distributed optimizer all-gathers)
    assumptions: List[str] = []

    # -- the single-GPU measurement: optimizer step + m1 micro-batches ----------------------------------------
    total_params = param_count(shape).total
    m1 = measured.global_batch_size // measured.micro_batch_size
    t1 = measured.global_batch_size * measured.seq_length / measured.tokens_per_sec_per_gpu
    bytes_opt1 = optimizer_bytes(total_params, 1, layout.use_distributed_optimizer, grad_bytes)
    if measured.optimizer_step_s is not None:
        t_opt1 = measured.optimizer_step_s
        hbm_bytes_per_s = bytes_opt1 / t_opt1
        assumptions.append(f"optimizer step: measured {t_opt1 * 1e3:.3g} ms on the single GPU = "
                           f"{hbm_bytes_per_s / 1e12:.3g} TB/s effective over {bytes_opt1 / 1e9:.4g} GB of "
                           f"modelled traffic; the target's traffic is moved at that rate")
    else:
        if hbm_tbps is None:
            hbm_tbps = HBM_TBPS.get(peak.device)
        if hbm_tbps is None:
            raise ScalingError(f"no HBM bandwidth known for {peak.device!r}: give hbm_tbps (--hbm-tbps) or the "
                               f"measured optimizer step time (--optimizer-step-ms)")
        _positive("hbm_tbps", hbm_tbps)
        hbm_bytes_per_s = hbm_tbps * 1e12
        t_opt1 = bytes_opt1 / hbm_bytes_per_s
        assumptions.append(f"optimizer step: memory traffic at the datasheet peak HBM bandwidth {hbm_tbps:g} TB/s "
                           f"(a lower bound on its time); single GPU {bytes_opt1 / 1e9:.4g} GB = "
                           f"{t_opt1 * 1e3:.3g} ms")
    if not t1 > t_opt1:
        raise ScalingError(f"the measured step ({t1:.4g} s) is not longer than the modelled optimizer step "
                           f"({t_opt1:.4g} s): check the measured throughput and --hbm-tbps/--optimizer-step-ms")
    t_mb1 = (t1 - t_opt1) / m1

    # Executed FLOPs ("half": what causal flash attention computes) carry the time from the measured micro-batch
    # to the target one: the same achieved FLOP rate is assumed at both shapes.
    shape1 = dataclasses.replace(shape, seq_length=measured.seq_length)
    exec1 = training_flops_per_step(shape1, measured.micro_batch_size, causal="half").model_flops
    exec_mb = training_flops_per_step(shape, b, causal="half").model_flops
    t_mb_one_gpu = t_mb1 * exec_mb / exec1  # the target micro-batch, whole model, one GPU
    if (measured.seq_length, measured.micro_batch_size) != (s, b):
        assumptions.append(f"the measured micro-batch (b={measured.micro_batch_size}, s={measured.seq_length}) "
                           f"is carried to the target one (b={b}, s={s}) at the same achieved FLOP rate "
                           f"(executed FLOPs, causal-half)")

    # -- per pipeline stage: executed FLOPs, parameters, TP collectives -----------------------------------------
    layer_fwd = [layer_forward_per_sequence(shape, i, "half") for i in range(L)]
    logits_fwd = 2 * s * h * shape.vocab_size
    total_fwd = sum(f.total for f in layer_fwd) + logits_fwd
    layers_of = stage_layers(L, pp, v)
    params_of = [params for params, _ in stage_parameters(shape, tp, pp, v)]
    emb_params = shape.vocab_size * h
    tied = not shape.untie_embeddings_and_output_weights

    groups = {
        "tp": group_placement("tp", tp, 1, world, ic),
        "cp": group_placement("cp", cp, tp, world, ic),
        # Gradients are reduced over data-parallel x context-parallel ranks (adjacent in the rank order).
        "dp": group_placement("dp", dp * cp, tp, world, ic),
        "pp": group_placement("pp", pp, tp * cp * dp, world, ic),
    }
    tp_msg = b * (s // cp) * h * act_bytes
    t_tp_ar = all_reduce_s(tp_msg, groups["tp"], ic)
    # Vocabulary-parallel cross entropy: all-reduces of the max, the sum of exponentials and the target logit, one
    # fp32 value per token each.
    t_loss_ar = 3 * all_reduce_s(b * (s // cp) * 4, groups["tp"], ic)
    ar_per_layer = 4 + (2 if layout.recompute_granularity == "full" else 0)

    # CP: the gathered K and V of the whole sequence (this TP rank's heads); all-gather forward (twice with full
    # recomputation), reduce-scatter of their gradients backward.
    kv_bytes = b * s * _kv_width(shape) // tp * act_bytes
    gathers = 2 if layout.recompute_granularity == "full" else 1
    if layout.cp_comm_type == "p2p":
        # The ring: a rank's K and V block (1/CP of kv_bytes) per step, hidden behind the attention of one block,
        # the forward's 1/3 of the attention core's share of the layer (causal-half FLOPs), per CP block.
        attn_block_fwd = t_mb_one_gpu / (tp * cp) * sum(f.attention_core for f in layer_fwd) / L / total_fwd / 3 / cp
        ring = groups["cp"].nodes_spanned > 1
        fwd_step = max(0.0, p2p_s(kv_bytes / cp, ring, ic) - attn_block_fwd) if cp > 1 else 0.0
        bwd_step = max(0.0, p2p_s(2 * kv_bytes / cp, ring, ic) - 2 * attn_block_fwd) if cp > 1 else 0.0
        t_cp_layer = (cp - 1) * (gathers * fwd_step + bwd_step)
    else:
        t_cp_layer = gathers * all_gather_s(kv_bytes, groups["cp"], ic) + reduce_scatter_s(kv_bytes, groups["cp"], ic)

    stages = []
    for r in range(pp):
        fwd = sum(layer_fwd[i].total for i in layers_of[r]) + (logits_fwd if r == pp - 1 else 0)
        compute = t_mb_one_gpu * fwd / total_fwd / (tp * cp)
        n_ar = ar_per_layer * len(layers_of[r]) + (1 if r == 0 else 0) + (1 if r == pp - 1 else 0)
        tp_comm = n_ar * t_tp_ar + (t_loss_ar if r == pp - 1 else 0.0)
        cp_exposed = len(layers_of[r]) * t_cp_layer
        cp_attention = CP_ATTENTION_OVERHEAD * compute if cp > 1 else 0.0
        params = params_of[r]
        busy = compute + tp_comm + cp_exposed + cp_attention
        # A GPU faster than its host waits for the launches: the micro-batch takes the host's time then.
        host_wait = max(0.0, host_s_per_layer * len(layers_of[r]) - busy)
        stages.append(dict(compute=compute, tp_comm=tp_comm, cp_exposed=cp_exposed, cp_attention=cp_attention,
                           host_wait=host_wait, params=params, per_microbatch=busy + host_wait))
    crit = max(range(pp), key=lambda r: stages[r]["per_microbatch"])
    st = stages[crit]
    t_fb = st["per_microbatch"]

    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    breakdown["compute"] = m * st["compute"]
    breakdown["tp_comm"] = m * st["tp_comm"]
    breakdown["cp_exposed"] = m * st["cp_exposed"]
    breakdown["cp_attention"] = m * st["cp_attention"]
    breakdown["host_wait"] = m * st["host_wait"]
    if pp > 1:
        breakdown["pp_bubble"] = (pp - 1) / v * t_fb
        p2p_bytes = b * (s // cp) * h * act_bytes // (tp if layout.sequence_parallel else 1)
        t_p2p = p2p_s(p2p_bytes, groups["pp"].nodes_spanned > 1, ic)
        # A send forward and one backward per micro-batch and model chunk, plus the fill and drain traversals.
        breakdown["pp_p2p"] = (m * v + pp - 1) * 2 * t_p2p

    # -- data parallel, optimizer: the stage with the most parameters sets the tail ----------------------------
    tail_best = None
    dpg = groups["dp"]
    d = dpg.size
    for r in range(pp):
        params = stages[r]["params"]
        bucket = min(params, max(BUCKET_MIN_PARAMS, BUCKET_PARAMS_PER_DP_RANK * d))
        if layout.use_distributed_optimizer:
            t_grad = reduce_scatter_s(params * grad_bytes, dpg, ic)
            t_grad_bucket = reduce_scatter_s(bucket * grad_bytes, dpg, ic)
            t_param = all_gather_s(params * param_bytes, dpg, ic)
            t_param_bucket = all_gather_s(bucket * param_bytes, dpg, ic)
        else:
            t_grad = all_reduce_s(params * grad_bytes, dpg, ic)
            t_grad_bucket = all_reduce_s(bucket * grad_bytes, dpg, ic)
            t_param = t_param_bucket = 0.0
        # The reduction overlaps the backward of the last micro-batch (2/3 of its time), except the last bucket;
        # the parameter all-gather overlaps the forward of the next step's first micro-batch (1/3).
        window = stages[r]["per_microbatch"]
        grad_exposed = max(t_grad - 2 * window / 3, t_grad_bucket) if layout.overlap_grad_reduce else t_grad
        param_exposed = (max(t_param - window / 3, t_param_bucket) if layout.overlap_param_gather else t_param)
        emb_sync = 0.0
        if tied and pp > 1 and r in (0, pp - 1):
            # The word-embedding gradient is all-reduced between the first and last stage (2 ranks).
            first_last = group_placement("embedding", 2, (pp - 1) * tp * cp * dp, world, ic)
            emb_sync = all_reduce_s(emb_params / tp * grad_bytes, first_last, ic)
        opt = optimizer_bytes(params, d, layout.use_distributed_optimizer, grad_bytes) / hbm_bytes_per_s
        tail = dict(dp_grad_exposed=grad_exposed, dp_param_gather_exposed=param_exposed,
                    embedding_grad_sync=emb_sync, optimizer=opt)
        if tail_best is None or sum(tail.values()) > sum(tail_best.values()):
            tail_best = tail
    breakdown.update(tail_best)

    step = sum(breakdown.values())
    tokens = global_batch_size * s
    flops = training_flops_per_step(shape, global_batch_size, causal=convention).model_flops
    rate_per_gpu = flops / step / world
    flops1 = training_flops_per_step(shape1, measured.global_batch_size, causal=convention).model_flops
    rate1 = flops1 / t1
    single = dict(step_time_s=t1, optimizer_s=t_opt1, microbatch_s=t_mb1, num_microbatches=m1,
                  tokens_per_sec_per_gpu=measured.tokens_per_sec_per_gpu, model_tflops=rate1 / 1e12,
                  mfu=rate1 / (peak.tflops * 1e12))
    details = dict(microbatch_compute_one_gpu_s=t_mb_one_gpu, tp_all_reduce_s=t_tp_ar,
                   tp_message_bytes=float(tp_msg if tp > 1 else 0), critical_stage=float(crit),
                   critical_stage_params=stages[crit]["params"],
                   stage_compute_imbalance=(max(x["compute"] for x in stages)
                                            / (sum(x["compute"] for x in stages) / pp)),
                   pp_bubble_fraction=pipeline_bubble_fraction(pp, m, v), cp_kv_exchange_per_layer_s=t_cp_layer,
                   hbm_bytes_per_s=hbm_bytes_per_s, total_params=float(total_params))

    assumptions += [
        f"collective bus bandwidth: NVLink {ic.nvlink_gbps:g} GB/s per direction x {ic.bus_efficiency:g}; "
        f"network {ic.ib_gbps_per_gpu:g} GB/s per GPU x {ic.bus_efficiency:g}; ring algorithm (NVLink SHARP, "
        f"trees and in-network reduction not modelled); latency {ic.nvlink_latency_us:g} us per NVLink ring step, "
        f"{ic.ib_latency_us:g} us per network step",
        f"rank order tp-cp-dp-pp with {ic.gpus_per_node} GPUs per node; a group spanning nodes gets the NICs of "
        f"its GPUs on one node (capped by NVLink)",
        "compute divides evenly by TP x CP and by layers over pipeline stages (the output layer on the last); "
        "smaller GEMMs running less efficiently, and work TP replicates without sequence parallelism (norms, "
        "residual adds), are not modelled",
        "TP collectives are exposed (no TP communication overlap); activations are communicated in 16 bits",
        "CP: " + ("TE's ring attention: each ring step's K/V transfer hidden behind one block's attention, the rest "
                  "exposed" if layout.cp_comm_type == "p2p" else "Litespark's all-gather attention: the K/V "
                  "all-gather and its reduce-scatter exposed")
        + (f"; a CP rank's micro-batch {CP_ATTENTION_OVERHEAD:.0%} longer than 1/CP of one GPU's (split attention, "
           f"measured)" if cp > 1 else ""),
        f"DP gradients reduced in {'fp32' if grad_bytes == 4 else '16 bits'} over DP x CP ranks; "
        + ("distributed optimizer: reduce-scatter + 16-bit parameter all-gather" if layout.use_distributed_optimizer
           else "all-reduce (no distributed optimizer)")
        + ("; overlapped with the last micro-batch's backward except the last bucket" if layout.overlap_grad_reduce
           else "; exposed (no --overlap-grad-reduce)"),
        "the DP/optimizer tail of the stage with the most parameters follows the pipeline flush (not overlapped "
        "with other stages' drain)",
        "everything else in the measured step (data loading, logging) scales with the micro-batches",
    ]
    return ScalingEstimate(
        nodes=nodes, world_size=world, data_parallel_size=dp, num_microbatches=m, virtual_pipeline_size=v,
        breakdown=breakdown, step_time_s=step, tokens_per_step=tokens, tokens_per_sec=tokens / step,
        tokens_per_sec_per_gpu=tokens / step / world, model_tflops_per_gpu=rate_per_gpu / 1e12,
        mfu=rate_per_gpu / (peak.tflops * 1e12), scaling_efficiency=rate_per_gpu / rate1, convention=convention,
        groups=groups, single_gpu=single, details=details, assumptions=assumptions)
