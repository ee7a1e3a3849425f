"""Peak GPU memory of a training layout, per GPU, before it runs.

What one rank of each pipeline stage holds when its memory peaks (the loss of a micro-batch, with every micro-batch
the stage has in flight still holding its activations), in bytes, by part:

* weights: the stage's parameters (stage_parameters: everything in a layer but its norms split by TP) in the
  parameter dtype; with --fp8-param-gather the linear weights in FP8 (1 byte);
* fp8_copies: under FP8, Transformer Engine's cached FP8 copy of every linear weight and its transpose (2 bytes per
  linear parameter; 1, the transpose, when the weights are FP8 already);
* gradients: megatron-core's gradient buffer, whole on every rank, also with the distributed optimizer (fp32 for
  bf16 and fp32 parameters unless the main gradients are bf16; fp16 for fp16 parameters unless
  --accumulate-allreduce-grads-in-fp32);
* optimizer: main parameters (fp32; 16-bit remainders under the precision-aware optimizer; none for fp32
  parameters) and Adam's two moments, divided over the DP x CP ranks with the distributed optimizer;
* activations: what the layers save for the backward, per token and layer (h hidden, f FFN, qd = heads x head dim,
  kvd = KV groups x head dim, e = 2 bytes (4 for fp32), x = 1 byte under FP8 (TE saves a GEMM's FP8 input) else e):
  the two norms' inputs and outputs 2 (h e + h x), split by TP only under sequence parallelism; q, k, v and the
  attention output (2 qd + 2 kvd) e (1 byte with --fp8-attention); under FP8 the output projection's FP8 input qd;
  the SwiGLU input 2f e and the down projection's input f x; these split by TP. Litespark's all-gather attention under
  CP adds the gathered keys and values of the other ranks and a second copy of its output. Tokens per micro-batch on a
  rank are b x s / CP. A pipeline stage holds the micro-batches (model chunks) in flight of the 1F1B schedule:
  PP - stage of them (interleaved: 2 (PP - stage - 1) + (v - 1) PP + 1 chunks). Full recomputation keeps only each
  recomputed group's input (h e per token) plus one group's activations while it is recomputed; selective
  recomputation of the core attention changes nothing (flash attention keeps no scores);
* loss: on the last stage, the logits of one micro-batch (or of one --chunked-output-loss chunk) and what the loss
  keeps of them, LOSS_BYTES_PER_LOGIT per element by implementation, plus the final norm's input and output;
* graph_pools: under --cuda-graph-impl, the private memory pools of the captured layers (GRAPH_POOL_SHARE of the
  activations they hold, FP8's share larger), which the allocator's peak statistic does not count but the GPU must
  hold;
* overhead: workspaces and buffers not itemized (OVERHEAD_GIB).

`allocated` is what torch.cuda.max_memory_allocated reports for a step (without CUDA graphs, or in the eager steps
before capture); `required` adds the graph pools, and a layout fits a GPU when it is at most USABLE_SHARE of the GPU's
memory. The constants marked "fitted" come from the measured rows of docs/benchmarks (docs/planner.md lists every row
and the model's error on it).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import List, Optional

from ..errors import UserError
from ..metrics.flops import ModelShape
from ..spec_choice import SpecChoice
from .scaling_estimate import stage_layers, stage_parameters

GIB = 2 ** 30
# Bytes per logit element that the loss holds at its peak, for 16-bit logits. unfused: the bf16 logits and their
# fp32 copy, in which megatron-core computes the softmax and then the gradient in place; native (megatron-core's
# fused loss, torch-compiled): its fp32 softmax, the fp32 gradient computed from it and that gradient in bf16; te
# (Transformer Engine's, which megatron-core 0.19.2 refuses): fitted to its rows; litespark (--litespark-cross-entropy):
# the bf16 logits only, its gradient written over them; litespark-fp8 (--litespark-fp8-output-layer): the bf16 logits,
# their FP8 gradient written over them in both layouts (1 byte each). All agree with the measured differences between
# rows.
LOSS_BYTES_PER_LOGIT = {"unfused": 6, "native": 10, "te": 4, "litespark": 2, "litespark-fp8": 2}
FP8_COPY_BYTES = 2  # TE's FP8 weight cache: the weight and its transpose, one byte each
OVERHEAD_GIB = 1.0  # fitted: the median residual of the one-GPU rows (workspaces, RoPE tables, small buffers)
# fitted, BF16 and FP8 apart: shares that separate the CUDA-graph layouts that ran from those that ran out of memory
# (stock BF16 at micro-batch 4 ran with graphs where stock FP8, with the same eager peak, did not; Litespark BF16 at
# micro-batch 8 ran with 119.8 GiB eager, so BF16's is at most 0.086). FP8's is not one share of the activations:
# Litespark FP8 at micro-batch 8 on an H200 ran with graphs (at most 0.16) where Litespark FP8 at micro-batch 2 on an
# H100 did not (at least 0.30); the larger one keeps the plan on the side of not running out (docs/planner.md).
GRAPH_POOL_SHARE = {"bf16": 0.08, "fp8": 0.55}
# fitted: between the largest peak that ran on an 80 GB H100 (68.4 GiB) and the smallest predicted for a run that
# did not (73.3 GiB), with the margin on the side of not running out (allocator fragmentation, the CUDA context)
USABLE_SHARE = 0.90
DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp8": 1, "uint8": 1}


@dataclass(frozen=True)
class MemorySetup:
    """What decides a layout's memory. Sizes per rank follow from the layout; dtypes are bytes per value."""

    shape: ModelShape
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    virtual: int = 1  # model chunks per pipeline stage (interleaved schedule)
    sequence_parallel: bool = False
    micro_batch_size: int = 1
    num_microbatches: int = 1
    param_bytes: int = 2
    fp8: bool = False
    fp8_param_gather: bool = False
    fp8_attention: bool = False
    grad_bytes: int = 4
    main_param_bytes: int = 4  # 0: fp32 parameters are their own main copy; 2: the precision-aware remainders
    exp_avg_bytes: int = 4
    exp_avg_sq_bytes: int = 4
    distributed_optimizer: bool = False
    recompute: Optional[str] = None  # None, "full" or "selective"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    cross_entropy: str = "unfused"
    chunked_output_loss: int = 1
    all_gather_cp: bool = False  # Litespark's own context-parallel attention (--core-attention sdpa)
    cuda_graphs: bool = False

    def __post_init__(self):
        if self.cross_entropy not in LOSS_BYTES_PER_LOGIT:
            raise UserError(f"unknown cross-entropy implementation {self.cross_entropy!r} for the memory model")
        if self.recompute not in (None, "full", "selective"):
            raise UserError(f"recompute must be None, 'full' or 'selective', got {self.recompute!r}")


@dataclass(frozen=True)
class StageMemory:
    """Bytes one rank of pipeline stage `stage` holds at its peak, by part (see the module docstring)."""

    stage: int
    in_flight: int
    weights: float
    fp8_copies: float
    gradients: float
    optimizer: float
    activations: float
    loss: float
    overhead: float
    graph_pools: float
    parts: tuple = field(default=("weights", "fp8_copies", "gradients", "optimizer", "activations", "loss",
                                  "overhead"), repr=False)

    @property
    def allocated(self) -> float:
        return sum(getattr(self, p) for p in self.parts)

    @property
    def required(self) -> float:
        return self.allocated + self.graph_pools

    def as_gib(self) -> dict:
        out = {p: getattr(self, p) / GIB for p in (*self.parts, "graph_pools")}
        return dict(stage=self.stage, in_flight=self.in_flight, **out, allocated=self.allocated / GIB,
                    required=self.required / GIB)


@dataclass(frozen=True)
class MemoryEstimate:
    stages: List[StageMemory]

    @property
    def peak(self) -> StageMemory:
        """The stage that needs the most memory (the layout's peak per GPU)."""
        return max(self.stages, key=lambda s: s.required)

    @property
    def allocated_gib(self) -> float:
        return max(s.allocated for s in self.stages) / GIB

    @property
    def required_gib(self) -> float:
        return self.peak.required / GIB


def in_flight(stage: int, pp: int, virtual: int, num_microbatches: int) -> int:
    """Micro-batches (model chunks, with virtual stages) whose activations a stage holds at once under megatron-core's
    1F1B schedule: its warm-up forwards plus the one whose backward comes next."""
    if virtual == 1:
        return min(num_microbatches, pp - stage)
    return min(num_microbatches * virtual, 2 * (pp - stage - 1) + (virtual - 1) * pp + 1)


def layer_bytes(setup: MemorySetup) -> tuple:
    """(what one layer saves for the backward of one micro-batch, what full recomputation keeps of it: its input),
    bytes on one rank."""
    s, shape = setup, setup.shape
    h, f, d = shape.hidden_size, shape.ffn_hidden_size, shape.kv_channels
    qd, kvd = shape.num_attention_heads * d, shape.num_query_groups * d
    e, x = _activation_bytes(s), 1 if s.fp8 else _activation_bytes(s)
    a = 1 if s.fp8_attention else e
    sp_split = s.tp if s.sequence_parallel else 1
    tokens = s.micro_batch_size * shape.seq_length / s.cp  # of one micro-batch on one rank
    replicated = 2 * (h * e + h * x)
    split = (2 * qd + 2 * kvd) * a + (qd if s.fp8 else 0) + 2 * f * e + f * x
    if s.all_gather_cp and s.cp > 1:
        split += ((s.cp - 1) * 2 * kvd + qd) * e
    return tokens * (replicated / sp_split + split / s.tp), tokens * h * e / sp_split


def _activation_bytes(setup: MemorySetup) -> int:
    return 4 if setup.param_bytes == 4 else 2  # activations are in the parameters' dtype


def estimate(setup: MemorySetup) -> MemoryEstimate:
    s = setup
    shape = s.shape
    h, e = shape.hidden_size, _activation_bytes(s)
    sp_split = s.tp if s.sequence_parallel else 1
    tokens = s.micro_batch_size * shape.seq_length / s.cp
    layer, checkpoint = layer_bytes(s)
    chunk = shape.num_layers // (s.pp * s.virtual)
    vocab = shape.vocab_size / s.tp
    stages = []
    for r, ((params, linear), layers) in enumerate(zip(stage_parameters(shape, s.tp, s.pp, s.virtual),
                                                       stage_layers(shape.num_layers, s.pp, s.virtual))):
        flight = in_flight(r, s.pp, s.virtual, s.num_microbatches)
        per_chunk = chunk if s.virtual > 1 else len(layers)
        if s.recompute == "full":
            if s.recompute_method == "block":
                saved = min(s.recompute_num_layers, per_chunk)
                held = flight * (saved * checkpoint + (per_chunk - saved) * layer) + layer
            else:
                group = min(s.recompute_num_layers, per_chunk)
                held = flight * -(-per_chunk // group) * checkpoint + group * layer
        else:
            held = flight * per_chunk * layer
        loss = 0.0
        if r == s.pp - 1:
            logits = s.micro_batch_size * shape.seq_length / s.cp / s.chunked_output_loss * vocab
            loss = logits * _loss_bytes(s.cross_entropy, e) + 2 * h * e * tokens / sp_split
        linear_bytes = 1 if s.fp8_param_gather else s.param_bytes
        optimizer = params * (s.main_param_bytes + s.exp_avg_bytes + s.exp_avg_sq_bytes)
        if s.distributed_optimizer:
            optimizer /= s.dp * s.cp
        stages.append(StageMemory(
            stage=r, in_flight=flight,
            weights=(params - linear) * s.param_bytes + linear * linear_bytes,
            fp8_copies=linear * (FP8_COPY_BYTES - (1 if s.fp8_param_gather else 0)) if s.fp8 else 0.0,
            gradients=params * s.grad_bytes, optimizer=optimizer, activations=held, loss=loss,
            overhead=OVERHEAD_GIB * GIB,
            graph_pools=GRAPH_POOL_SHARE["fp8" if s.fp8 else "bf16"] * held if s.cuda_graphs else 0.0))
    return MemoryEstimate(stages)


def _loss_bytes(implementation: str, e: int) -> int:
    if e == 4:  # fp32 logits: no fp32 copy to make; the softmax and its gradient are computed in them
        return 4 if implementation in ("unfused", "litespark", "litespark-fp8") else 8
    return LOSS_BYTES_PER_LOGIT[implementation]


# ---- from litespark-train's arguments ----------------------------------------------------------------------------
def _bytes(dtype) -> int:
    name = str(dtype).replace("torch.", "")
    if name not in DTYPE_BYTES:
        raise UserError(f"the memory model knows no dtype {dtype!r}")
    return DTYPE_BYTES[name]


def setup_from_args(args, world_size: int) -> MemorySetup:
    """The MemorySetup of litespark-train's parsed arguments (arguments.resolve; validated or not) on `world_size`
    ranks. Dense Llama layers only: MoE, multi-latent and native sparse attention are refused."""
    for flag, present in (("--num-experts", getattr(args, "num_experts", None)),
                          ("--multi-latent-attention", getattr(args, "multi_latent_attention", False)),
                          ("--attention-variant nsa", getattr(args, "attention_variant", "dense") == "nsa")):
        if present:
            raise UserError(f"the memory model covers dense Llama layers; {flag} is not modelled")
    from ..arguments import default_tokenizer, model_vocab_size

    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    probe = argparse.Namespace(**vars(args))
    default_tokenizer(probe)  # mock data without a tokenizer: megatron's NullTokenizer of --vocab-size
    # the output layer's rows as megatron.training builds them; without a tokenizer, --vocab-size padded as it pads
    shape = ModelShape.from_args(args, padded_vocab=model_vocab_size(probe) if probe.tokenizer_type else None)
    dp = world_size // (tp * pp * cp)
    per_virtual = args.num_layers_per_virtual_pipeline_stage
    virtual = args.num_layers // (pp * per_virtual) if per_virtual else 1
    sixteen_bit = bool(args.bf16 or args.fp16)
    param_bytes = 2 if sixteen_bit else 4
    precision_aware = bool(args.use_precision_aware_optimizer)
    main_grads = _bytes(args.main_grads_dtype) if precision_aware else 4
    if args.fp16:  # Megatron-LM accumulates fp16 gradients in fp32 only when asked
        grad_bytes = 4 if args.accumulate_allreduce_grads_in_fp32 else 2
    else:  # bf16: in fp32 unless the main gradients are bf16 or asked otherwise; fp32 parameters: fp32
        grad_bytes = 2 if sixteen_bit and (args.grad_reduce_in_bf16 or main_grads == 2) else 4
    if not sixteen_bit:
        main = 0  # fp32 parameters are the optimizer's own
    elif precision_aware and _bytes(args.main_params_dtype) == 4 and args.bf16:
        main = 2  # megatron-core keeps fp32 main parameters as 16-bit remainders beside the bf16 ones
    else:
        main = _bytes(args.main_params_dtype) if precision_aware else 4
    moments = [_bytes(getattr(args, n)) if precision_aware else 4 for n in ("exp_avg_dtype", "exp_avg_sq_dtype")]
    if getattr(args, "litespark_fp8_output_layer", False):
        loss = "litespark-fp8"
    elif args.litespark_cross_entropy:
        loss = "litespark"
    elif args.cross_entropy_loss_fusion:
        loss = args.cross_entropy_fusion_impl
    else:
        loss = "unfused"
    mb = args.micro_batch_size or 1
    gbs = args.global_batch_size or mb * dp
    return MemorySetup(
        shape=shape, tp=tp, pp=pp, cp=cp, dp=dp, virtual=virtual, sequence_parallel=bool(args.sequence_parallel),
        micro_batch_size=mb, num_microbatches=max(1, gbs // (mb * dp)),
        param_bytes=param_bytes, fp8=bool(args.fp8), fp8_param_gather=bool(args.fp8 and args.fp8_param_gather),
        fp8_attention=bool(args.fp8_dot_product_attention), grad_bytes=grad_bytes, main_param_bytes=main,
        exp_avg_bytes=moments[0], exp_avg_sq_bytes=moments[1],
        distributed_optimizer=bool(args.use_distributed_optimizer), recompute=args.recompute_granularity,
        recompute_method=args.recompute_method or "uniform", recompute_num_layers=args.recompute_num_layers or 1,
        cross_entropy=loss, chunked_output_loss=args.chunked_output_loss or 1,
        all_gather_cp=cp > 1 and SpecChoice.of(args).is_litespark and args.core_attention == "sdpa",
        cuda_graphs=getattr(args, "cuda_graph_impl", "none") not in (None, "none"))
