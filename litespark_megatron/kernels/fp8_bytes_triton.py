"""FP8 bytes written from fp32 registers, shared by Litespark's FP8 kernels (swiglu_fp8_triton.py,
fp8_logits_triton.py): the byte of a scaled value by integer arithmetic, and a tile stored in both layouts at once,
row-major (a GEMM's input) and column-major (the weight-gradient GEMM's), transposed in on-chip memory. Device
functions (inlined into the kernels that call them) and the format arguments their launches pass; imported only where
Triton runs."""
import torch
import triton
import triton.language as tl

from . import fp8_format


def format_arguments(dtype) -> tuple:
    """(FP8_MAX, MANTISSA, BIAS), the kernels' compile-time description of a torch FP8 dtype."""
    return (torch.finfo(dtype).max, *fp8_format(dtype))


@triton.jit
def _fp8_codes(y, scale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 byte of y * scale, saturated to the format's largest finite value, rounded to nearest even (what
    Transformer Engine's cast writes), as integer arithmetic on the fp32 bits; uint32 codes 0-255.

    Not Triton's `.to(tl.float8e4nv)`: compiled by Triton 3.6 for an H200 it wrote wrong bytes into a part of the
    tile (a quarter to a half of them, which part depending on the shapes), and its interpreter rounds without
    carrying into the exponent. Integer arithmetic is exact on both."""
    return _fp8_codes_rounded(y, scale, 0, FP8_MAX, MANTISSA, BIAS, False)


@triton.jit
def _fp8_codes_stochastic(y, scale, random, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """_fp8_codes rounded stochastically: up to the next FP8 value with probability the fraction of a step that
    rounding down drops (at fp32's resolution), decided by the uint32 `random` (_random_bits) of each element. The
    mean of the rounded values is the value itself, where rounding to nearest moves every value between two FP8
    numbers the same way: the loss's gradient is mostly softmax values of about one size, and rounded to nearest
    their sum drifts by up to half a step (an eighth of the value in e5m2) in one direction."""
    return _fp8_codes_rounded(y, scale, random, FP8_MAX, MANTISSA, BIAS, True)


@triton.jit
def _fp8_codes_rounded(y, scale, random, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                       STOCHASTIC: tl.constexpr):
    scaled = y * scale
    v = tl.clamp(scaled, -FP8_MAX, FP8_MAX)
    bits = v.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANTISSA
    steps = tl.abs(v) * (2.0 ** (BIAS - 1 + MANTISSA))
    if STOCHASTIC:
        # Below one FP8 step of random bits added to the fp32 mantissa, then truncated: a carry (into the exponent
        # too) with probability the dropped fraction. The largest finite value has no dropped bits: no carry past
        # it. Below the smallest normal number, 2^(1 - BIAS): the count of the smallest subnormal, floor(count + u).
        normal = ((magnitude + (random >> (32 - shift))) >> shift) - ((127 - BIAS) << MANTISSA)
        u = (random >> 8).to(tl.float32) * (2.0 ** -24)
        subnormal = tl.floor(steps + u).to(tl.uint32)
    else:
        # A normal FP8 number: the fp32 mantissa rounded to MANTISSA bits (half an FP8 step minus one, plus the
        # kept last bit: ties to even; a carry moves into the exponent), then the exponent rebiased.
        normal = ((magnitude + ((1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)) >> shift) - \
            ((127 - BIAS) << MANTISSA)
        # Below the smallest normal one: a count of the smallest subnormal, 2^(1 - BIAS - MANTISSA), rounded to
        # nearest even by the fp32 addition of 1.5 * 2^23.
        subnormal = ((steps + 12582912.0) - 12582912.0).to(tl.uint32)
    code = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    code = tl.where(scaled != scaled, 0x7F, code)  # NaN stays NaN (compiled, the clamp would saturate it)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _random_bits(row, column, seed):
    """32 random bits of element (row, column) under a seed: murmur3's finalizer of the three mixed. A function of
    the element's place in the whole tensor, not of a program or a shard: every layout and split of the tensor
    draws the same bits for an element (fp8_logits.random_bits_reference computes them in torch)."""
    h = (column.to(tl.uint32) * 0x9E3779B1) ^ (row.to(tl.uint32) * 0x85EBCA77 + seed)
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _store_both(y, scale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, row_ptr, col_ptr, r, c,
                rows, channels, row_width, col_offset):
    """y [BLOCK_ROWS, BLOCK_CHANNELS] fp32 at rows r, channels c (+ col_offset) of the [rows, row_width] row-major FP8
    tensor and of its [row_width, rows] transpose (uint8 pointers), the codes transposed as 32-bit integers."""
    code = _fp8_codes(y, scale, FP8_MAX, MANTISSA, BIAS)
    in_tile = (r < rows)[:, None] & (c < channels)[None, :]
    tl.store(row_ptr + r[:, None] * row_width + (col_offset + c)[None, :], code.to(tl.uint8), mask=in_tile)
    in_tile_t = (c < channels)[:, None] & (r < rows)[None, :]
    # in 64 bits: a column-major offset passes 2^31 at 16,384 rows x 131,072 columns (a micro-batch's logits)
    column = (col_offset + c).to(tl.int64)
    tl.store(col_ptr + column[:, None] * rows + r[None, :], tl.trans(code).to(tl.uint8), mask=in_tile_t)
