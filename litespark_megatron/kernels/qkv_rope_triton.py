"""The Triton kernels of Litespark's QKV split + RoPE (qkv_rope.py). A program takes a block of tokens (rows of the
[s * b] token order): it reads the block's cos and sin once, then walks the query groups, each query head, the key
and the value a [tokens, d / 2] tile per half. cos and sin of the angles come in as [s, d] fp32 tensors (torch's, as
the reference's). The backward that writes FP8 stores each tile twice, row-major and column-major (the block's
tokens then make each channel's column-major piece). Imported only where Triton runs (a CUDA device, or Triton's
interpreter in the tests).

Why blocks of tokens: the first version ran a program per (token, group) and read the tables again for each group
and head, as many bytes as the data itself (from L2): its kernels moved ~2.3 TB/s where a RoPE that reads its tables
once per token moves ~4 (docs/benchmarks/2026-11-28-best-micro-batch-rope-fp8-grad-h200.md)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _store_both

# (tokens, warps) of a program, the fastest of a sweep on an H200 (llama-3b at 16,384 tokens; the file above): the
# bf16 kernels at 3.5 TB/s with 8 tokens; the FP8 backward with 32, whose column-major store is then a sector per
# channel (with 8 tokens a quarter of one, 1.3x slower).
TILE = (8, 4)
FP8_BACKWARD_TILE = (32, 4)


def grid(tokens: int, tile) -> tuple:
    return (triton.cdiv(tokens, tile[0]),)


@triton.jit
def _tables(cos_ptr, sin_ptr, angle, in_rows, half: tl.constexpr):
    """The block's cos and sin, first half (c1, s1) and second half (c2, s2), [tokens, d / 2] each."""
    c1 = tl.load(cos_ptr + angle, mask=in_rows, other=0.0)
    s1 = tl.load(sin_ptr + angle, mask=in_rows, other=0.0)
    c2 = tl.load(cos_ptr + angle + half, mask=in_rows, other=0.0)
    s2 = tl.load(sin_ptr + angle + half, mask=in_rows, other=0.0)
    return c1, s1, c2, s2


@triton.jit
def _rotated(x_ptr, in_rows, c1, s1, c2, s2, half: tl.constexpr, FORWARD: tl.constexpr):
    """One head's two halves at x_ptr ([tokens, d / 2] pointers to the first) rotated in fp32: forward x1 * c1 -
    x2 * s1 and x2 * c2 + x1 * s2; backward (the transpose) g1 * c1 + g2 * s2 and g2 * c2 - g1 * s1."""
    x1 = tl.load(x_ptr, mask=in_rows, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + half, mask=in_rows, other=0.0).to(tl.float32)
    if FORWARD:
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
    return x1 * c1 + x2 * s2, x2 * c2 - x1 * s1


@triton.jit
def qkv_rope_forward(mixed_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, q_ptr, k_ptr, v_ptr, tokens, batch,
                     groups, heads_per_group: tl.constexpr, d: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """mixed [tokens, groups, (heads_per_group + 2) * d] -> query [tokens, groups * heads_per_group, d] and key
    [tokens, groups, d] rotated, value [tokens, groups, d] copied. Token t is position t // batch of the [s, b]
    layout."""
    half: tl.constexpr = d // 2
    width: tl.constexpr = (heads_per_group + 2) * d
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = (r < tokens)[:, None]
    cols = tl.arange(0, half)[None, :]
    whole = tl.arange(0, d)[None, :]
    angle = (r // batch)[:, None] * d + cols
    qc1, qs1, qc2, qs2 = _tables(q_cos_ptr, q_sin_ptr, angle, in_rows, half)
    kc1, ks1, kc2, ks2 = _tables(k_cos_ptr, k_sin_ptr, angle, in_rows, half)
    for g in range(groups):
        row = r[:, None] * groups + g
        src = mixed_ptr + row * width
        for h in tl.static_range(heads_per_group):
            first, second = _rotated(src + h * d + cols, in_rows, qc1, qs1, qc2, qs2, half, True)
            dst = q_ptr + (row * heads_per_group + h) * d + cols
            tl.store(dst, first.to(q_ptr.dtype.element_ty), mask=in_rows)
            tl.store(dst + half, second.to(q_ptr.dtype.element_ty), mask=in_rows)
        first, second = _rotated(src + heads_per_group * d + cols, in_rows, kc1, ks1, kc2, ks2, half, True)
        tl.store(k_ptr + row * d + cols, first.to(k_ptr.dtype.element_ty), mask=in_rows)
        tl.store(k_ptr + row * d + half + cols, second.to(k_ptr.dtype.element_ty), mask=in_rows)
        tl.store(v_ptr + row * d + whole, tl.load(src + (heads_per_group + 1) * d + whole, mask=in_rows),
                 mask=in_rows)


@triton.jit
def qkv_rope_backward(dq_ptr, dk_ptr, dv_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, d_mixed_ptr, tokens,
                      batch, groups, heads_per_group: tl.constexpr, d: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """The forward's transpose: the query's and key's gradients rotated back and the value's gradient, written
    into the projection's [tokens, groups, (heads_per_group + 2) * d] layout."""
    half: tl.constexpr = d // 2
    width: tl.constexpr = (heads_per_group + 2) * d
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = (r < tokens)[:, None]
    cols = tl.arange(0, half)[None, :]
    whole = tl.arange(0, d)[None, :]
    angle = (r // batch)[:, None] * d + cols
    qc1, qs1, qc2, qs2 = _tables(q_cos_ptr, q_sin_ptr, angle, in_rows, half)
    kc1, ks1, kc2, ks2 = _tables(k_cos_ptr, k_sin_ptr, angle, in_rows, half)
    out_ty = d_mixed_ptr.dtype.element_ty
    for g in range(groups):
        row = r[:, None] * groups + g
        dst = d_mixed_ptr + row * width
        for h in tl.static_range(heads_per_group):
            first, second = _rotated(dq_ptr + (row * heads_per_group + h) * d + cols, in_rows, qc1, qs1, qc2, qs2,
                                     half, False)
            tl.store(dst + h * d + cols, first.to(out_ty), mask=in_rows)
            tl.store(dst + h * d + half + cols, second.to(out_ty), mask=in_rows)
        first, second = _rotated(dk_ptr + row * d + cols, in_rows, kc1, ks1, kc2, ks2, half, False)
        tl.store(dst + heads_per_group * d + cols, first.to(out_ty), mask=in_rows)
        tl.store(dst + heads_per_group * d + half + cols, second.to(out_ty), mask=in_rows)
        tl.store(dst + (heads_per_group + 1) * d + whole, tl.load(dv_ptr + row * d + whole, mask=in_rows),
                 mask=in_rows)


@triton.jit
def _amax(amax, first, second):
    return tl.maximum(amax, tl.maximum(tl.max(tl.max(tl.abs(first), 1), 0), tl.max(tl.max(tl.abs(second), 1), 0)))


@triton.jit
def qkv_rope_backward_fp8(dq_ptr, dk_ptr, dv_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, row_ptr, col_ptr,
                          scale_ptr, amax_ptr, scale_inv_ptr, tokens, batch, groups,
                          heads_per_group: tl.constexpr, d: tl.constexpr, FP8_MAX: tl.constexpr,
                          MANTISSA: tl.constexpr, BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """qkv_rope_backward's gradient in FP8, both layouts: [tokens, groups * (heads_per_group + 2) * d] row-major (the
    QKV GEMM's output gradient for its input's gradient) and its transpose (for its weight's); the block's max
    |value| maxed into amax, 1 / scale written by the first program."""
    half: tl.constexpr = d // 2
    width: tl.constexpr = (heads_per_group + 2) * d
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = (r < tokens)[:, None]
    c = tl.arange(0, half)
    cols = c[None, :]
    angle = (r // batch)[:, None] * d + cols
    qc1, qs1, qc2, qs2 = _tables(q_cos_ptr, q_sin_ptr, angle, in_rows, half)
    kc1, ks1, kc2, ks2 = _tables(k_cos_ptr, k_sin_ptr, angle, in_rows, half)
    row_width = groups * width
    scale = tl.load(scale_ptr)
    amax = tl.zeros([], dtype=tl.float32)
    for g in range(groups):
        row = r[:, None] * groups + g
        base = g * width
        for h in tl.static_range(heads_per_group):
            first, second = _rotated(dq_ptr + (row * heads_per_group + h) * d + cols, in_rows, qc1, qs1, qc2, qs2,
                                     half, False)
            _store_both(first, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                        base + h * d)
            _store_both(second, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                        base + h * d + half)
            amax = _amax(amax, first, second)
        first, second = _rotated(dk_ptr + row * d + cols, in_rows, kc1, ks1, kc2, ks2, half, False)
        _store_both(first, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                    base + heads_per_group * d)
        _store_both(second, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                    base + heads_per_group * d + half)
        amax = _amax(amax, first, second)
        value = tl.load(dv_ptr + row * d + cols, mask=in_rows, other=0.0).to(tl.float32)
        value2 = tl.load(dv_ptr + row * d + half + cols, mask=in_rows, other=0.0).to(tl.float32)
        _store_both(value, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                    base + (heads_per_group + 1) * d)
        _store_both(value2, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, tokens, half, row_width,
                    base + (heads_per_group + 1) * d + half)
        amax = _amax(amax, value, value2)
    tl.atomic_max(amax_ptr, amax)
    if tl.program_id(0) == 0:
        tl.store(scale_inv_ptr, 1.0 / scale)
