"""Litespark's FP8 output layer: the logits' GEMM and both of its backward GEMMs in FP8, with the cross-entropy's
gradient written in FP8 straight from the logits.

The output layer of a Llama model is the largest GEMM of the step (hidden x vocabulary: 128,256 columns for Llama 3)
and megatron-core runs it in BF16 whatever the recipe (TE's FP8 covers the transformer layers). Here, with the loss
fused in, a micro-batch's tokens h [T, H] and this rank's vocabulary shard W [V, H] go:

    forward   h, W -> FP8 e4m3 (current scaling: the tensor's own amax), both layouts, one pass each;
              logits [T, V] = h W^T as one FP8 GEMM, bf16 out; the loss from them (the cross-entropy kernel's row
              statistics, combined over the TP group); kept: the logits, one logsumexp per row, the column-major
              FP8 h and W.
    backward  one pass over the logits writes the loss's gradient (softmax - onehot) * dloss in FP8 e5m2,
              rounded stochastically (most of a row is softmax values of about one size, which rounding to
              nearest would move all one way), over the logits' own memory, row-major, and a transpose copies it
              into the column-major layout beside it (the backward holds no more than the logits, as the BF16
              cross-entropy does); dh = dlogits W and dW = dlogits^T h as FP8 GEMMs. Its scale needs no pass of
              its own: |softmax - onehot| <= 1, so max |dloss| bounds the gradient's amax.

dW goes into the weight's main_grad (megatron-core's gradient-accumulation fusion) where the output layer fuses it,
else it is the weight's gradient. Tensor parallelism is megatron-core's: the input is copied (or all-gathered under
sequence parallelism) into the column-parallel layer by its own mappings, whose backward reduces dh.

The reference path defines the function in plain torch (`quantize_reference`, `gradient_fp8_reference`, and the
GEMMs as dequantized fp32 matmuls); the tests hold the Triton kernels and FP8 GEMMs to it. FP8 logits change the
model's numerics where the stock layers keep BF16, so the flag is opt-in: a loss-equivalence run decides, not this
file.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import fp8_format, kernel_path
from .cross_entropy import _tp, row_statistics

FORWARD = torch.float8_e4m3fn  # the logits' inputs: h and W
BACKWARD = torch.float8_e5m2  # the logits' gradient (Transformer Engine's hybrid format)
# _scaled_mm (cuBLASLt's FP8 GEMM) takes dimensions that are multiples of 16.
ALIGNMENT = 16
DW_ROWS = 16384  # vocabulary rows per slice of the weight-gradient GEMM (a multiple of ALIGNMENT)

fp8_logits_path = kernel_path  # what the FP8 output layer runs on a device of this type


def current_scale(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps amax to the format's largest finite value (1 where amax is 0); fp32, on amax's device,
    no synchronization."""
    amax = amax.float().reshape(1)
    return torch.where(amax > 0, torch.finfo(dtype).max / amax, torch.ones_like(amax))


def amax_scale(x: torch.Tensor, dtype: torch.dtype, group=None) -> torch.Tensor:
    """Current scaling: the scale of x's own amax, the largest over `group` where x is one shard of a tensor (the
    output layer's weight under TP), so that every layout quantizes the whole tensor alike."""
    amax = torch.linalg.vector_norm(x.detach(), ord=float("inf")).float().reshape(1)  # max |x|, no |x| copy
    if _tp(group)[1] > 1:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return current_scale(amax, dtype)


# --------------------------------------------------------------------------------------------- the reference
def quantize_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, random: torch.Tensor = None):
    """x [rows, n] times scale in FP8, saturated: (row-major [rows, n], column-major). Rounded to nearest even, or
    with `random` (uint32 values in int64, x's shape: random_bits_reference) stochastically: up with probability the
    fraction of an FP8 step that rounding down drops (fp8_bytes_triton._fp8_codes_stochastic, the same arithmetic)."""
    v = (x.float() * scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
    q = v.to(dtype) if random is None else _stochastic(v, random, dtype)
    return q, q.t().contiguous()


def _stochastic(v: torch.Tensor, random: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The FP8 bytes of saturated fp32 values v rounded stochastically by `random`, as integer arithmetic on their
    bits (the kernel's, line for line)."""
    mantissa, bias = fp8_format(dtype)
    shift = 23 - mantissa
    bits = v.view(torch.int32).long() & 0xFFFFFFFF
    magnitude = bits & 0x7FFFFFFF
    normal = ((magnitude + (random >> (32 - shift))) >> shift) - ((127 - bias) << mantissa)
    u = (random >> 8).float() * 2.0 ** -24
    subnormal = torch.floor(v.abs() * 2.0 ** (bias - 1 + mantissa) + u).long()
    code = torch.where(magnitude < ((128 - bias) << 23), subnormal, normal)
    code = torch.where(v != v, 0x7F, code) | ((bits >> 24) & 0x80)
    return code.to(torch.uint8).view(dtype)


def random_bits_reference(rows: torch.Tensor, columns: torch.Tensor, seed: int) -> torch.Tensor:
    """fp8_bytes_triton._random_bits of every (row, column) pair ([rows] x [columns] -> [rows, columns]) under a
    seed (0 to 2^31 - 1), as uint32 values in int64."""
    m = 0xFFFFFFFF
    h = ((columns.long()[None, :] * 0x9E3779B1) & m) ^ ((rows.long()[:, None] * 0x85EBCA77 + seed) & m)
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & m
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & m
    return h ^ (h >> 16)


def gradient_fp8_reference(logits, target, lse, grad, scale, vocab_start: int, dtype: torch.dtype = BACKWARD,
                           seed: int = None):
    """(softmax(logits) - onehot(target)) * grad in FP8 at `scale`, both layouts; softmax = exp(logits - lse).
    Rounded to nearest even, or stochastically with a seed: element (row, column) takes the random bits of row and
    vocab_start + column (its place in the whole vocabulary, so that every TP split rounds alike)."""
    x = logits.float()
    local = target - vocab_start
    onehot = torch.zeros_like(x)
    here = (local >= 0) & (local < x.size(-1))
    onehot[here.nonzero().squeeze(-1), local[here]] = 1.0
    random = None if seed is None else random_bits_reference(
        torch.arange(x.size(0), device=x.device), vocab_start + torch.arange(x.size(1), device=x.device), seed)
    return quantize_reference((torch.exp(x - lse[:, None]) - onehot) * grad[:, None], scale, dtype, random)


def _mm_reference(a, b, scale_a, scale_b, out_dtype):
    """What torch._scaled_mm computes: (a / scale_a^-1) @ (b / scale_b^-1), fp32 accumulation."""
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def _row_statistics_reference(logits, target, vocab_start: int, tp_group):
    """(logsumexp, the target's logit) per row over the whole vocabulary (every TP shard), in fp32."""
    x = logits.float()
    row_max = x.amax(dim=-1)
    if _tp(tp_group)[1] > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shift = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    local = target - vocab_start
    here = (local >= 0) & (local < x.size(-1))
    target_logit = x.gather(-1, torch.where(here, local, 0)[:, None]).squeeze(-1) * here
    sums = torch.stack([torch.exp(x - shift[:, None]).sum(dim=-1), target_logit])
    if _tp(tp_group)[1] > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    return torch.log(sums[0]) + shift, sums[1]


# --------------------------------------------------------------------------------------------- the Triton path
def quantize_triton(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """quantize_reference's function through the Triton kernel."""
    from . import fp8_logits_triton as kernels
    from .fp8_bytes_triton import format_arguments

    x = x.detach().contiguous()
    rows, columns = x.shape
    row = torch.empty(rows, columns, device=x.device, dtype=torch.uint8)
    col = torch.empty(columns, rows, device=x.device, dtype=torch.uint8)
    kernels.fp8_cast_both_layouts[kernels.grid(rows, columns)](x, row, col, scale, rows, columns,
                                                               *format_arguments(dtype), **kernels.TILE_ARGUMENTS)
    return row.view(dtype), col.view(dtype)


# The gradient goes over the logits it is computed from: its row-major bytes fill the first rows x n bytes of the
# logits' memory, the column-major copy the next. Row i's bytes land on the logits of rows i / 2 to (i + 1) / 2 (2
# bytes a logit, or more), so a launch over rows [start, end) with end <= 2 start overwrites only rows that earlier
# launches have read: launches over doubling row ranges, the first FIRST_ROWS rows through a scratch buffer.
FIRST_ROWS = 64


def gradient_fp8_over_logits(logits, target, lse, grad, scale, vocab_start: int, dtype: torch.dtype = BACKWARD,
                             seed: int = None):
    """gradient_fp8_reference's bytes (both layouts) through the Triton kernels, written over the logits' memory:
    the logits' values are gone after it, and the two layouts keep that memory alive."""
    if not logits.is_contiguous() or logits.element_size() < 2:
        raise ValueError(f"FP8 output layer: the logits' gradient goes over contiguous logits of 2 bytes or more, "
                         f"got {logits.dtype} of strides {logits.stride()}")
    from . import fp8_logits_triton as kernels
    from .fp8_bytes_triton import format_arguments

    rows, columns = logits.shape
    memory = logits.view(-1).view(torch.uint8)
    row = memory[:rows * columns].view(rows, columns)
    col = memory[rows * columns:2 * rows * columns].view(columns, rows)

    stochastic = seed is not None

    def launch(start: int, end: int, out: torch.Tensor):
        kernels.cross_entropy_gradient_fp8[kernels.grid(end - start, columns)](
            logits[start:end], target[start:end], lse[start:end], grad[start:end], out, scale, seed or 0, start,
            vocab_start, end - start, columns, *format_arguments(dtype), stochastic, **kernels.TILE_ARGUMENTS)

    first = min(rows, FIRST_ROWS)
    scratch = torch.empty(first, columns, device=logits.device, dtype=torch.uint8)
    launch(0, first, scratch)
    start = first
    while start < rows:
        end = min(rows, 2 * start)
        launch(start, end, row[start:end])
        start = end
    row[:first].copy_(scratch)
    kernels.fp8_transpose[kernels.grid(rows, columns)](row, col, rows, columns, **kernels.TILE_ARGUMENTS)
    return row.view(dtype), col.view(dtype)


def _mm_fp8(a, b, scale_a, scale_b, out_dtype):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------- the function
class _Ops:
    """The four steps of the function, by path: the Triton kernels and FP8 GEMMs, or the plain-torch reference."""

    def __init__(self, triton: bool, cuda: bool):
        self.quantize = quantize_triton if triton else quantize_reference
        self.gradient = gradient_fp8_over_logits if triton else gradient_fp8_reference
        self.statistics = row_statistics if triton else _row_statistics_reference
        # (the Triton kernels under Triton's interpreter run on a CPU, where no FP8 GEMM does)
        self.mm = _mm_fp8 if cuda else _mm_reference


class _FP8LogitsLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, target, tp_group, padded_from, main_grad_fusion, triton, seed=None):
        ops = _Ops(triton, h.is_cuda)
        vocab_start = _tp(tp_group)[0] * weight.size(0)
        h_scale, w_scale = amax_scale(h, FORWARD), amax_scale(weight, FORWARD, tp_group)
        (h_row, h_col), (w_row, w_col) = ops.quantize(h, h_scale, FORWARD), ops.quantize(weight, w_scale, FORWARD)
        h_inv, w_inv = 1.0 / h_scale, 1.0 / w_scale
        logits = ops.mm(h_row, w_row.t(), h_inv, w_inv, h.dtype)
        if padded_from is not None and padded_from < logits.size(1):  # padded vocabulary: no token (model.py)
            logits[:, padded_from:] = float("-inf")
        lse, target_logit = ops.statistics(logits, target, vocab_start, tp_group)
        # Kept as attributes, not saved tensors: the backward frees the logits as soon as their gradient is written.
        ctx.logits, ctx.target, ctx.lse, ctx.h_col, ctx.h_inv, ctx.w_col, ctx.w_inv = \
            logits, target, lse, h_col, h_inv, w_col, w_inv
        ctx.weight, ctx.vocab_start, ctx.main_grad_fusion, ctx.ops, ctx.h_dtype, ctx.seed = \
            weight, vocab_start, main_grad_fusion, ops, h.dtype, seed
        return lse - target_logit

    @staticmethod
    def backward(ctx, grad_loss):
        ops, weight = ctx.ops, ctx.weight
        grad = grad_loss.float().contiguous()
        # max |dloss| bounds the gradient's amax (see the module docstring)
        scale = current_scale(torch.linalg.vector_norm(grad, ord=float("inf")), BACKWARD)
        d_row, d_col = ops.gradient(ctx.logits, ctx.target, ctx.lse, grad, scale, ctx.vocab_start, seed=ctx.seed)
        ctx.logits = None  # the reference path frees its logits here; the kernels' logits memory holds the gradient
        d_inv = 1.0 / scale
        grad_h = ops.mm(d_row, ctx.w_col.t(), d_inv, ctx.w_inv, ctx.h_dtype)
        grad_weight = None
        if weight.requires_grad:
            # in slices of the vocabulary: the fp32 product of the whole shard would take 4 bytes per weight element
            # at the backward's peak (1.5 GiB for Llama 3's vocabulary at hidden 3,072), a slice's a fraction of it
            grad_weight = None if ctx.main_grad_fusion else torch.empty_like(weight)
            for v in range(0, weight.size(0), DW_ROWS):
                part = ops.mm(d_col[v:v + DW_ROWS], ctx.h_col.t(), d_inv, ctx.h_inv, torch.float32)
                if ctx.main_grad_fusion:
                    weight.main_grad[v:v + DW_ROWS].add_(part)
                else:
                    grad_weight[v:v + DW_ROWS] = part
            if ctx.main_grad_fusion:
                grad_weight = _main_grad_added(weight)
        ctx.h_col = ctx.w_col = None
        return grad_h, grad_weight, None, None, None, None, None, None


def _main_grad_added(weight):
    """What megatron-core's linear returns as the weight's gradient once it added it to main_grad itself
    (tensor_parallel/layers.py): where the parameter is marked, a dummy of its shape, Transformer Engine's reused
    buffer where TE is installed (megatron-core's DDP hooks then skip the addition); else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    zero = getattr(weight, "zero_out_wgrad", False)
    try:
        from transformer_engine.pytorch.module.base import get_dummy_wgrad
    except ImportError:
        return (torch.zeros if zero else torch.empty)(weight.main_grad.shape, dtype=weight.dtype,
                                                      device=weight.device)
    return get_dummy_wgrad(list(weight.main_grad.shape), weight.dtype, zero=zero)


def fp8_logits_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tp_group=None,
                    padded_from=None, main_grad_fusion: bool = False, seed: int = None) -> torch.Tensor:
    """Per-token loss [T] of tokens h [T, H] against this rank's vocabulary shard weight [V, H] and global target
    ids [T], the GEMMs in FP8. padded_from: the first local column of padding (its logits are -inf), or None.
    main_grad_fusion: add dW into weight.main_grad (megatron-core's gradient-accumulation fusion). seed (0 to
    2^31 - 1): the loss's gradient rounded stochastically under it (the same on every TP rank of the group, another
    for each micro-batch); None: rounded to nearest even."""
    if h.dim() != 2 or weight.dim() != 2 or h.size(1) != weight.size(1) or target.shape != h.shape[:1]:
        raise ValueError(f"FP8 output layer: tokens {tuple(h.shape)}, weight {tuple(weight.shape)}, target "
                         f"{tuple(target.shape)}; it takes [T, H], [V, H] and [T]")
    triton = fp8_logits_path(h.device.type) == "litespark"
    if triton:
        short = [n for n, size in (("tokens", h.size(0)), ("hidden size", h.size(1)),
                                   ("vocabulary shard", weight.size(0))) if size % ALIGNMENT]
        if short:
            raise ValueError(f"FP8 output layer: the {', '.join(short)} must be multiples of {ALIGNMENT} (FP8 GEMMs); "
                             f"got tokens {h.size(0)}, hidden {h.size(1)}, vocabulary shard {weight.size(0)}")
    return _FP8LogitsLoss.apply(h.contiguous(), weight, target.to(torch.int64).contiguous(), tp_group, padded_from,
                                main_grad_fusion, triton, seed)
