"""The Triton kernels of Litespark's FP8 SwiGLU (swiglu_fp8.py): each program takes a tile of [rows, f] channels,
computes in fp32, and stores the tile's FP8 bytes twice (fp8_bytes_triton.py): row-major ([rows, f], the GEMM's
input) and column-major ([f, rows], the weight-gradient GEMM's input), the tile transposed in on-chip memory, not by
another kernel. Each program maxes its tile's |value| into the tensor's amax (what delayed scaling records);
the first writes the reciprocal scale. Imported only where Triton runs (a CUDA device, or Triton's interpreter in
the tests)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _store_both

# (rows, channels, warps) of a program's tile, the fastest of a sweep on an H200 (llama-3b's and llama3-8b's MLP at
# 16,384 rows; docs/benchmarks/2026-11-27-swiglu-default-fp8-output-layer-h200.md): the column-major store is
# then 32 bytes per channel, one whole sector, and the row-major one 128 or 256 bytes per row.
FORWARD_TILE = (32, 256, 8)
BACKWARD_TILE = (32, 128, 8)


def grid(rows: int, channels: int, tile):
    return (triton.cdiv(rows, tile[0]), triton.cdiv(channels, tile[1]))


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
