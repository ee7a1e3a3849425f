"""The Triton kernels of Litespark's QKV split + RoPE (qkv_rope.py): a program per (token, query group), the group's
query heads, key and value in one block each; the backward that writes FP8 a program per (32 tokens, query group),
whose column-major store is then a sector per channel. cos and sin of the angles come in as [s, d] fp32 tensors
(torch's, as the reference's). Imported only where Triton runs (a CUDA device, or Triton's interpreter in the
tests)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _store_both


def heads_block(heads_per_group: int) -> int:
    return triton.next_power_of_2(heads_per_group)


def warps(heads_per_group: int, head_size: int) -> int:
    """A group's (heads_per_group + 2) * head_size values (640 for Llama-3.2-3B's 3 query heads of 128) fit 4 warps
    at a few per thread; larger groups take 8."""
    return 4 if (heads_per_group + 2) * head_size <= 1024 else 8


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, angle, cols, half: tl.constexpr):
    """A token's cos and sin, first half (c1, s1) and second half (c2, s2). Read from torch's tensors rather than
    taken with tl.cos/tl.sin here: every program of a token would compute them again, and fp32 sin/cos of angles up
    to the sequence length cost more than the kernel's whole memory traffic (the RoPE time doubled)."""
    c1 = tl.load(cos_ptr + angle + cols)
    s1 = tl.load(sin_ptr + angle + cols)
    c2 = tl.load(cos_ptr + angle + half + cols)
    s2 = tl.load(sin_ptr + angle + half + cols)
    return c1, s1, c2, s2


@triton.jit
def qkv_rope_forward(mixed_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, q_ptr, k_ptr, v_ptr, batch, groups,
                     heads_per_group: tl.constexpr, d: tl.constexpr, HEADS: tl.constexpr):
    """mixed [tokens, groups, (heads_per_group + 2) * d] -> query [tokens, groups * heads_per_group, d] and key
    [tokens, groups, d] rotated (first half x1 * cos - x2 * sin, second half x2 * cos + x1 * sin, in fp32), value
    [tokens, groups, d] copied. Token t is position t // batch of the [s, b] layout."""
    half: tl.constexpr = d // 2
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    angle = (token // batch) * d
    cols = tl.arange(0, half)
    heads = tl.arange(0, HEADS)
    in_group = (heads < heads_per_group)[:, None]
    src = mixed_ptr + (token * groups + group) * (heads_per_group + 2) * d

    offsets = heads[:, None] * d + cols[None, :]
    c1, s1, c2, s2 = _cos_sin(q_cos_ptr, q_sin_ptr, angle, cols, half)
    c1, s1, c2, s2 = c1[None, :], s1[None, :], c2[None, :], s2[None, :]
    x1 = tl.load(src + offsets, mask=in_group, other=0.0).to(tl.float32)
    x2 = tl.load(src + offsets + half, mask=in_group, other=0.0).to(tl.float32)
    dst = q_ptr + (token * groups + group) * heads_per_group * d
    tl.store(dst + offsets, (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty), mask=in_group)
    tl.store(dst + offsets + half, (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty), mask=in_group)

    key = src + heads_per_group * d
    c1, s1, c2, s2 = _cos_sin(k_cos_ptr, k_sin_ptr, angle, cols, half)
    x1 = tl.load(key + cols).to(tl.float32)
    x2 = tl.load(key + half + cols).to(tl.float32)
    dst = k_ptr + (token * groups + group) * d
    tl.store(dst + cols, (x1 * c1 - x2 * s1).to(k_ptr.dtype.element_ty))
    tl.store(dst + half + cols, (x2 * c2 + x1 * s2).to(k_ptr.dtype.element_ty))

    whole = tl.arange(0, d)
    tl.store(v_ptr + (token * groups + group) * d + whole, tl.load(key + d + whole))


@triton.jit
def qkv_rope_backward(dq_ptr, dk_ptr, dv_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, d_mixed_ptr, batch, groups,
                      heads_per_group: tl.constexpr, d: tl.constexpr, HEADS: tl.constexpr):
    """The forward's transpose: the rotation's inverse (first half dy1 * cos + dy2 * sin, second half dy2 * cos -
    dy1 * sin, with each half's own cos and sin) of the query's and key's gradients and the value's gradient, written
    into the projection's [tokens, groups, (heads_per_group + 2) * d] layout."""
    half: tl.constexpr = d // 2
    token = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1).to(tl.int64)
    angle = (token // batch) * d
    cols = tl.arange(0, half)
    heads = tl.arange(0, HEADS)
    in_group = (heads < heads_per_group)[:, None]
    dst = d_mixed_ptr + (token * groups + group) * (heads_per_group + 2) * d

    offsets = heads[:, None] * d + cols[None, :]
    c1, s1, c2, s2 = _cos_sin(q_cos_ptr, q_sin_ptr, angle, cols, half)
    c1, s1, c2, s2 = c1[None, :], s1[None, :], c2[None, :], s2[None, :]
    src = dq_ptr + (token * groups + group) * heads_per_group * d
    g1 = tl.load(src + offsets, mask=in_group, other=0.0).to(tl.float32)
    g2 = tl.load(src + offsets + half, mask=in_group, other=0.0).to(tl.float32)
    tl.store(dst + offsets, (g1 * c1 + g2 * s2).to(d_mixed_ptr.dtype.element_ty), mask=in_group)
    tl.store(dst + offsets + half, (g2 * c2 - g1 * s1).to(d_mixed_ptr.dtype.element_ty), mask=in_group)

    key = dst + heads_per_group * d
    c1, s1, c2, s2 = _cos_sin(k_cos_ptr, k_sin_ptr, angle, cols, half)
    src = dk_ptr + (token * groups + group) * d
    g1 = tl.load(src + cols).to(tl.float32)
    g2 = tl.load(src + half + cols).to(tl.float32)
    tl.store(key + cols, (g1 * c1 + g2 * s2).to(d_mixed_ptr.dtype.element_ty))
    tl.store(key + half + cols, (g2 * c2 - g1 * s1).to(d_mixed_ptr.dtype.element_ty))

    whole = tl.arange(0, d)
    tl.store(key + d + whole, tl.load(dv_ptr + (token * groups + group) * d + whole))


# (tokens, warps) of a program of the FP8 backward: 32 tokens make the column-major store of each channel 32 bytes,
# one whole sector (as the FP8 SwiGLU's tiles).
FP8_BACKWARD_TILE = (32, 4)


def fp8_grid(tokens: int, groups: int):
    return (triton.cdiv(tokens, FP8_BACKWARD_TILE[0]), groups)


@triton.jit
def _store_rotated_back(g_ptr, cos_ptr, sin_ptr, angle, r, cols, in_rows, scale, amax, row_ptr, col_ptr, tokens,
                        row_width, col_offset, half: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                        BIAS: tl.constexpr):
    """One head's gradient [tokens, d] at g_ptr (rows of d) rotated back (first half g1 * c1 + g2 * s2, second half
    g2 * c2 - g1 * s1) and stored in both FP8 layouts at column col_offset; the running amax returned."""
    g1 = tl.load(g_ptr, mask=in_rows, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + half, mask=in_rows, other=0.0).to(tl.float32)
    c1 = tl.load(cos_ptr + angle, mask=in_rows, other=0.0)
    s1 = tl.load(sin_ptr + angle, mask=in_rows, other=0.0)
    c2 = tl.load(cos_ptr + angle + half, mask=in_rows, other=0.0)
    s2 = tl.load(sin_ptr + angle + half, mask=in_rows, other=0.0)
    first = g1 * c1 + g2 * s2
    second = g2 * c2 - g1 * s1
    _store_both(first, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, cols, tokens, half, row_width, col_offset)
    _store_both(second, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, cols, tokens, half, row_width,
                col_offset + half)
    return tl.maximum(amax, tl.maximum(tl.max(tl.max(tl.abs(first), 1), 0), tl.max(tl.max(tl.abs(second), 1), 0)))


@triton.jit
def qkv_rope_backward_fp8(dq_ptr, dk_ptr, dv_ptr, q_cos_ptr, q_sin_ptr, k_cos_ptr, k_sin_ptr, row_ptr, col_ptr,
                          scale_ptr, amax_ptr, scale_inv_ptr, tokens, batch, groups,
                          heads_per_group: tl.constexpr, d: tl.constexpr, FP8_MAX: tl.constexpr,
                          MANTISSA: tl.constexpr, BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """qkv_rope_backward's gradient in FP8, both layouts: [tokens, groups * (heads_per_group + 2) * d] row-major (the
    QKV GEMM's output gradient for its input's gradient) and its transpose (for its weight's), a program per
    (BLOCK_ROWS tokens, query group); the tile's max |value| maxed into amax, 1 / scale written by the first."""
    half: tl.constexpr = d // 2
    width: tl.constexpr = (heads_per_group + 2) * d
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    group = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, half)
    in_rows = (r < tokens)[:, None]
    angle = (r // batch)[:, None] * d + cols[None, :]
    row_width = groups * width
    base = group * width
    scale = tl.load(scale_ptr)
    amax = tl.zeros([], dtype=tl.float32)
    for h in tl.static_range(heads_per_group):
        src = dq_ptr + ((r * groups + group) * heads_per_group + h)[:, None] * d + cols[None, :]
        amax = _store_rotated_back(src, q_cos_ptr, q_sin_ptr, angle, r, cols, in_rows, scale, amax, row_ptr, col_ptr,
                                   tokens, row_width, base + h * d, half, FP8_MAX, MANTISSA, BIAS)
    src = dk_ptr + (r * groups + group)[:, None] * d + cols[None, :]
    amax = _store_rotated_back(src, k_cos_ptr, k_sin_ptr, angle, r, cols, in_rows, scale, amax, row_ptr, col_ptr,
                               tokens, row_width, base + heads_per_group * d, half, FP8_MAX, MANTISSA, BIAS)
    whole = tl.arange(0, d)
    dv = tl.load(dv_ptr + (r * groups + group)[:, None] * d + whole[None, :], mask=in_rows, other=0.0).to(tl.float32)
    _store_both(dv, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, whole, tokens, d, row_width,
                base + (heads_per_group + 1) * d)
    tl.atomic_max(amax_ptr, tl.maximum(amax, tl.max(tl.max(tl.abs(dv), 1), 0)))
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, 1.0 / scale)
