"""The Triton kernels of Litespark's FP8 SwiGLU (swiglu_fp8.py): each program takes a tile of [rows, f] channels,
computes in fp32, scales, saturates and rounds to FP8 bytes, and stores the tile twice: row-major ([rows, f], the
GEMM's input) and column-major ([f, rows], the weight-gradient GEMM's input), the tile transposed in on-chip memory,
not by another kernel. Each program maxes its tile's |value| into the tensor's amax (what delayed scaling records);
the first writes the reciprocal scale. Imported only where Triton runs (a CUDA device, or Triton's interpreter in
the tests)."""
import triton
import triton.language as tl

# Tiles of 64 rows x 64 channels: the row-major store is 64 bytes per row of the tile and the column-major one 64
# bytes per channel, whole 32-byte sectors either way.
BLOCK_ROWS = 64
BLOCK_CHANNELS = 64

# The FP8 formats as (mantissa bits, exponent bias): e4m3 (the forward's) and e5m2 (the backward's, TE's hybrid).
FORMATS = {"e4m3": (3, 7), "e5m2": (2, 15)}


def grid(rows: int, channels: int):
    return (triton.cdiv(rows, BLOCK_ROWS), triton.cdiv(channels, BLOCK_CHANNELS))


@triton.jit
def _fp8_codes(y, scale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The FP8 byte of y * scale, saturated to the format's largest finite value, rounded to nearest even (what
    Transformer Engine's cast writes), as integer arithmetic on the fp32 bits; uint32 codes 0-255.

    Not Triton's `.to(tl.float8e4nv)`: compiled by Triton 3.6 for an H200 it wrote wrong bytes into a part of the
    tile (a quarter to a half of them, which part depending on the shapes), and its interpreter rounds without
    carrying into the exponent. Integer arithmetic is exact on both."""
    scaled = y * scale
    v = tl.clamp(scaled, -FP8_MAX, FP8_MAX)
    bits = v.to(tl.uint32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    shift: tl.constexpr = 23 - MANTISSA
    # A normal FP8 number: the fp32 mantissa rounded to MANTISSA bits (half an FP8 step minus one, plus the kept
    # last bit: ties to even; a carry moves into the exponent), then the exponent rebiased.
    normal = ((magnitude + ((1 << (shift - 1)) - 1) + ((magnitude >> shift) & 1)) >> shift) - \
        ((127 - BIAS) << MANTISSA)
    # Below the smallest normal one, 2^(1 - BIAS): a count of the smallest subnormal, 2^(1 - BIAS - MANTISSA),
    # rounded to nearest even by the fp32 addition of 1.5 * 2^23.
    steps = tl.abs(v) * (2.0 ** (BIAS - 1 + MANTISSA))
    subnormal = ((steps + 12582912.0) - 12582912.0).to(tl.uint32)
    code = tl.where(magnitude < ((128 - BIAS) << 23), subnormal, normal)
    code = tl.where(scaled != scaled, 0x7F, code)  # NaN stays NaN (compiled, the clamp would saturate it)
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _store_both(y, scale, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr, row_ptr, col_ptr, r, c,
                rows, channels, row_width, col_offset):
    """y [BLOCK_ROWS, BLOCK_CHANNELS] fp32 at rows r, channels c (+ col_offset) of the [rows, row_width] row-major FP8
    tensor and of its [row_width, rows] transpose (uint8 pointers), the codes transposed as 32-bit integers."""
    code = _fp8_codes(y, scale, FP8_MAX, MANTISSA, BIAS)
    in_tile = (r < rows)[:, None] & (c < channels)[None, :]
    tl.store(row_ptr + r[:, None] * row_width + (col_offset + c)[None, :], code.to(tl.uint8), mask=in_tile)
    in_tile_t = (c < channels)[:, None] & (r < rows)[None, :]
    tl.store(col_ptr + (col_offset + c)[:, None] * rows + r[None, :], tl.trans(code).to(tl.uint8), mask=in_tile_t)


@triton.jit
def swiglu_fp8_forward(gate_up_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, scale_inv_ptr, rows,
                       channels: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                       BLOCK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr):
    """y = silu(gate) * up of the [rows, 2 * channels] input laid out [gate | up], in FP8, both layouts."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    mask = (r < rows)[:, None] & (c < channels)[None, :]
    at = gate_up_ptr + r[:, None] * (2 * channels) + c[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + channels, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    scale = tl.load(scale_ptr)
    tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(y), 1), 0))
    _store_both(y, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, channels, channels, 0)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, 1.0 / scale)


@triton.jit
def swiglu_fp8_backward(dy_ptr, gate_up_ptr, row_ptr, col_ptr, scale_ptr, amax_ptr, scale_inv_ptr, rows,
                        channels: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_CHANNELS: tl.constexpr):
    """The input's gradient [d gate | d up] = [dy * up * silu'(gate) | dy * silu(gate)] in FP8, both layouts
    ([rows, 2 * channels] and [2 * channels, rows])."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_CHANNELS + tl.arange(0, BLOCK_CHANNELS)
    mask = (r < rows)[:, None] & (c < channels)[None, :]
    at = gate_up_ptr + r[:, None] * (2 * channels) + c[None, :]
    gate = tl.load(at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(at + channels, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + r[:, None] * channels + c[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-gate))
    d_gate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    d_up = dy * gate * sig
    scale = tl.load(scale_ptr)
    tl.atomic_max(amax_ptr, tl.maximum(tl.max(tl.max(tl.abs(d_gate), 1), 0), tl.max(tl.max(tl.abs(d_up), 1), 0)))
    _store_both(d_gate, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, channels, 2 * channels, 0)
    _store_both(d_up, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, channels, 2 * channels, channels)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, 1.0 / scale)
