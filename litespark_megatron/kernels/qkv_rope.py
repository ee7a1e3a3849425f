"""Litespark's QKV split + RoPE: the QKV projection's output in, the attention's query, key and value out, in one read
and one write each way.

megatron-core splits the projection's [s, b, groups, (heads_per_group + 2) * d] output into views of the query
heads, key and value of each group, rotates the query and key with Transformer Engine's fused RoPE (a kernel each,
forward and backward), copies the value (the attention wants it contiguous), and in the backward concatenates the
three gradients back into the projection's layout (a copy of all of them). These kernels do the whole of it:

    forward   a program per (token, group): the group's query heads and key rotated (angles in fp32, cos and sin
              in fp32, the result rounded once to the input's dtype, as TE's fused RoPE computes), written to
              contiguous [s, b, heads, d] query and [s, b, groups, d] key; the value copied to [s, b, groups, d].
    backward  the same programs: the inverse rotation of the query's and key's gradients and the value's gradient,
              written straight into the projection's layout.

Nothing but the angles' cos and sin tables is kept for the backward (the rotation is linear), and those once per run,
not per layer (`_tables`). Under FP8, `qkv_rope_fp8_grad` (--litespark-rope-fp8-grad) has the backward write the QKV
GEMM's FP8 output gradient in both layouts instead (below).

`qkv_rope_reference` defines the function in plain torch; tests/test_qkv_rope_kernel.py holds the Triton path to it.
`qkv_rope` runs the Triton path on CUDA and the reference elsewhere; `qkv_rope_path` says which (the run's "what
ran" record). Covered: Llama's RoPE (halves rotated, not interleaved) over the whole head (rotary percent 1), a
power-of-two head size, the same angles for every head of a token, one sequence per sample (no packed sequences);
arguments.py refuses --litespark-rope elsewhere.
"""
from __future__ import annotations

from typing import Tuple

import torch

from . import kernel_path
from .te_fp8 import float8_tensor, quantized_reference, torch_dtype


def _rotate(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """RoPE of [s, b, n, d] by [s, 1, 1, d] angles, halves rotated; arithmetic in (at least) fp32, result in t's
    dtype."""
    compute = torch.promote_types(t.dtype, torch.float32)
    x = t.to(compute)
    x1, x2 = torch.chunk(x, 2, dim=-1)
    angles = freqs.to(compute)
    return (x * torch.cos(angles) + torch.cat([-x2, x1], dim=-1) * torch.sin(angles)).to(t.dtype)


def qkv_rope_reference(mixed: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                       heads_per_group: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[s, b, groups, (heads_per_group + 2) * d] -> query [s, b, groups * heads_per_group, d] rotated by q_freqs,
    key [s, b, groups, d] rotated by k_freqs, value [s, b, groups, d]; angles [s, 1, 1, d]."""
    s, b, groups, width = mixed.shape
    d = width // (heads_per_group + 2)
    query, key, value = torch.split(mixed, [heads_per_group * d, d, d], dim=3)
    query = query.reshape(s, b, groups * heads_per_group, d)
    return _rotate(query, q_freqs), _rotate(key, k_freqs), value.contiguous()


def _cos_sin(q_freqs, k_freqs, s: int, d: int):
    """cos and sin of the query's and key's angles as [s, d] fp32 (torch's, as the reference's); once where both
    are the same tensor (Llama)."""
    q_cos, q_sin = _tables(q_freqs, s, d)
    if k_freqs is q_freqs:
        return q_cos, q_sin, q_cos, q_sin
    return (q_cos, q_sin) + _tables(k_freqs, s, d)


def _tables(freqs: torch.Tensor, s: int, d: int):
    """(cos, sin) of one angles tensor, kept on that tensor: megatron-core's rotary embedding hands the same tensor
    to every layer and step (its forward is cached), so the tables are computed once per run instead of twice per
    layer and micro-batch (two kernels and their launches each time). Computed again if the tensor changed in place
    since (its version counter) or is read at another shape."""
    kept = getattr(freqs, "_litespark_cos_sin", None)
    if kept is not None and kept[:2] == (freqs._version, (s, d)):
        return kept[2:]
    angles = freqs.reshape(s, d).float()
    tables = (torch.cos(angles).contiguous(), torch.sin(angles).contiguous())
    freqs._litespark_cos_sin = (freqs._version, (s, d)) + tables
    return tables


def _forward_triton(mixed, cos_sin, heads_per_group: int):
    """The forward kernel on [s, b, groups, (heads_per_group + 2) * d]: (query, key, value)."""
    from . import qkv_rope_triton as kernels

    s, b, groups, width = mixed.shape
    d = width // (heads_per_group + 2)
    mixed = mixed.contiguous()
    query = mixed.new_empty(s, b, groups * heads_per_group, d)
    key, value = mixed.new_empty(s, b, groups, d), mixed.new_empty(s, b, groups, d)
    rows_per_program, warps = kernels.TILE
    kernels.qkv_rope_forward[kernels.grid(s * b, kernels.TILE)](
        mixed, *cos_sin, query, key, value, s * b, b, groups, heads_per_group, d, BLOCK_ROWS=rows_per_program,
        num_warps=warps)
    return query, key, value


class _TritonQKVRoPE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mixed, q_freqs, k_freqs, heads_per_group):
        s, b, groups, width = mixed.shape
        cos_sin = _cos_sin(q_freqs, k_freqs, s, width // (heads_per_group + 2))
        # The tables shared by every layer (_tables): no memory of this layer's. An attribute, not a saved tensor:
        # they are never changed in place.
        ctx.cos_sin = cos_sin
        ctx.heads_per_group, ctx.shape = heads_per_group, mixed.shape
        return _forward_triton(mixed, cos_sin, heads_per_group)

    @staticmethod
    def backward(ctx, d_query, d_key, d_value):
        from . import qkv_rope_triton as kernels

        s, b, groups, width = ctx.shape
        p = ctx.heads_per_group
        d = width // (p + 2)
        d_mixed = d_query.new_empty(ctx.shape)
        rows_per_program, warps = kernels.TILE
        kernels.qkv_rope_backward[kernels.grid(s * b, kernels.TILE)](
            d_query.contiguous(), d_key.contiguous(), d_value.contiguous(), *ctx.cos_sin, d_mixed, s * b, b, groups,
            p, d, BLOCK_ROWS=rows_per_program, num_warps=warps)
        return d_mixed, None, None, None


def qkv_rope_triton(mixed, q_freqs, k_freqs, heads_per_group: int):
    """The reference's function through the Triton kernels."""
    return _TritonQKVRoPE.apply(mixed, q_freqs, k_freqs, heads_per_group)


qkv_rope_path = kernel_path  # what `qkv_rope` runs on a device of this type


# ------------------------------------------------------------------------------ the gradient written in FP8
# Under FP8 the QKV projection is a Transformer Engine linear whose backward casts its bf16 output gradient to FP8
# row-major (its input's gradient GEMM) and column-major (its weight's): a read and two writes after the backward
# kernel's own write. With `qkv_rope_fp8_grad` the backward kernel writes both FP8 layouts itself, from fp32 registers,
# with the linear's own output-gradient quantizer (delayed scaling: its scale read, its amax maxed into), as the FP8
# SwiGLU does for fc1 (swiglu_fp8.py). The projection then runs on [tokens, n] rows: Transformer Engine keeps a
# gradient's column-major layout only where its shape stays the same.


def qkv_rope_grad_reference(d_query: torch.Tensor, d_key: torch.Tensor, d_value: torch.Tensor, q_freqs, k_freqs,
                            heads_per_group: int) -> torch.Tensor:
    """The gradient of qkv_rope_reference with respect to its input as [s * b, groups * width] fp32 rows: autograd
    of the reference in fp32 (the rotation is linear: the point it is taken at does not matter)."""
    s, b, groups, d = d_key.shape
    mixed = torch.zeros(s, b, groups, (heads_per_group + 2) * d, dtype=torch.float32, device=d_key.device,
                        requires_grad=True)
    with torch.enable_grad():
        outputs = qkv_rope_reference(mixed, q_freqs, k_freqs, heads_per_group)
        (grad,) = torch.autograd.grad(outputs, mixed, [t.float() for t in (d_query, d_key, d_value)])
    return grad.reshape(s * b, -1)


def qkv_rope_grad_fp8_reference(d_query, d_key, d_value, q_freqs, k_freqs, heads_per_group: int, scale, amax, dtype):
    """qkv_rope_grad_reference in FP8 under delayed scaling: ([rows, n], [n, rows], 1 / scale); amax updated."""
    grad = qkv_rope_grad_reference(d_query, d_key, d_value, q_freqs, k_freqs, heads_per_group)
    return quantized_reference(grad, scale, amax, dtype)


def qkv_rope_grad_fp8_triton(d_query, d_key, d_value, q_freqs, k_freqs, heads_per_group: int, scale, amax, dtype):
    """qkv_rope_grad_fp8_reference's function through the Triton kernel."""
    from . import qkv_rope_triton as kernels
    from .fp8_bytes_triton import format_arguments

    s, b, groups, d = d_key.shape
    tokens, n = s * b, groups * (heads_per_group + 2) * d
    row = torch.empty(tokens, n, device=d_key.device, dtype=torch.uint8)
    col = torch.empty(n, tokens, device=d_key.device, dtype=torch.uint8)
    scale_inv = torch.empty(1, device=d_key.device, dtype=torch.float32)
    rows_per_program, warps = kernels.FP8_BACKWARD_TILE
    kernels.qkv_rope_backward_fp8[kernels.grid(tokens, kernels.FP8_BACKWARD_TILE)](
        d_query.contiguous(), d_key.contiguous(), d_value.contiguous(), *_cos_sin(q_freqs, k_freqs, s, d), row, col,
        scale, amax, scale_inv, tokens, b, groups, heads_per_group, d, *format_arguments(dtype),
        BLOCK_ROWS=rows_per_program, num_warps=warps)
    return row.view(dtype), col.view(dtype), scale_inv


class _QKVRoPEFP8Grad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, q_freqs, k_freqs, heads_per_group, batch, groups, quantizer):
        mixed = rows.view(rows.size(0) // batch, batch, groups, rows.size(1) // groups)
        ctx.fast = qkv_rope_path(rows.device.type) == "litespark"
        if ctx.fast:
            query, key, value = _forward_triton(mixed, _cos_sin(q_freqs, k_freqs, mixed.size(0), mixed.size(3) //
                                                                (heads_per_group + 2)), heads_per_group)
        else:
            query, key, value = qkv_rope_reference(mixed, q_freqs, k_freqs, heads_per_group)
        ctx.freqs, ctx.heads_per_group, ctx.quantizer, ctx.dtype = (q_freqs, k_freqs), heads_per_group, quantizer, \
            rows.dtype
        return query, key, value

    @staticmethod
    def backward(ctx, d_query, d_key, d_value):
        q = ctx.quantizer
        fn = qkv_rope_grad_fp8_triton if ctx.fast else qkv_rope_grad_fp8_reference
        row, col, scale_inv = fn(d_query, d_key, d_value, *ctx.freqs, ctx.heads_per_group, q.scale, q.amax,
                                 torch_dtype(q.dtype))
        return float8_tensor(row, col, scale_inv, q, ctx.dtype), None, None, None, None, None, None


def qkv_rope_fp8_grad(rows: torch.Tensor, batch: int, groups: int, q_freqs, k_freqs, heads_per_group: int,
                      quantizer):
    """qkv_rope of the QKV projection's output as [s * batch, groups * width] rows (the projection run on rows),
    whose gradient with respect to `rows` is a Float8Tensor of both layouts quantized by `quantizer` (the
    projection's output-gradient quantizer, Transformer Engine's delayed-scaling Float8Quantizer)."""
    if rows.dim() != 2 or rows.size(0) % batch or rows.size(1) % groups:
        raise ValueError(f"QKV + RoPE with an FP8 gradient: rows of shape {tuple(rows.shape)} for batch {batch} and "
                         f"{groups} query groups; it takes [s * batch, groups * width]")
    return _QKVRoPEFP8Grad.apply(rows, q_freqs, k_freqs, heads_per_group, batch, groups, quantizer)


def qkv_rope(mixed, q_freqs, k_freqs, heads_per_group: int):
    if qkv_rope_path(mixed.device.type) == "litespark":
        return qkv_rope_triton(mixed, q_freqs, k_freqs, heads_per_group)
    return qkv_rope_reference(mixed, q_freqs, k_freqs, heads_per_group)
