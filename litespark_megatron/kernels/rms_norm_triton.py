"""The Triton kernels of Litespark's RMSNorm (rms_norm.py): one program per row in the forward (the row read once,
statistics in fp32); in the backward one program per block of rows, each writing its rows' input gradient and its
partial sum of the weight's gradient. The FP8 forward (rms_norm_fp8.py) takes a block of rows per program and writes
the next GEMM's FP8 input in both layouts. Imported only where Triton runs (a CUDA device, or Triton's interpreter in
the tests)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _store_both

# The hidden size is a compile-time constant (one kernel per model); a row is read in one block of the next power of
# two (presets: 2,048-8,192 columns).


def block_size(columns: int) -> int:
    return triton.next_power_of_2(columns)


def warps(block: int) -> int:
    """Warps per program: a row of 2,048-8,191 columns over 8 warps keeps each thread at 8-32 values in registers
    (4 warps, Triton's default, leaves 32-64 per thread and fewer rows in flight)."""
    return 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4


@triton.jit
def rms_norm_forward(x_ptr, w_ptr, y_ptr, rstd_ptr, eps, columns: tl.constexpr, BLOCK: tl.constexpr):
    """y = (x * rsqrt(mean(x^2) + eps)) rounded to x's dtype, times the weight (the product rounded again, as torch
    multiplies two bf16 tensors); the row's rsqrt kept (fp32) for the backward."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < columns
    x = tl.load(x_ptr + row * columns + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, 0) / columns + eps)
    normed = (x * rstd).to(y_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(y_ptr.dtype.element_ty).to(tl.float32)  # as the reference
    tl.store(y_ptr + row * columns + cols, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def rms_norm_backward(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, rows, columns: tl.constexpr,
              ROWS_PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    """For rows [first, first + ROWS_PER_PROGRAM): dx = rstd * (g - xhat * mean(g * xhat)) with g = dy * w and
    xhat = x * rstd (fp32), written in x's dtype; the program's sum of dy * xhat (xhat rounded as the forward
    rounded it) into its row of the [programs, columns] fp32 partials, which torch sums. (Loop bounds are
    compile-time constants and rows past the end are masked, not skipped: what Triton's interpreter runs too.)"""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    in_row = cols < columns
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(dx_ptr.dtype.element_ty).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    first = program.to(tl.int64) * ROWS_PER_PROGRAM
    for i in range(0, ROWS_PER_PROGRAM):
        row = first + i
        exists = row < rows
        mask = in_row & exists
        x = tl.load(x_ptr + row * columns + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * columns + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=exists, other=0.0)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, 0) / columns))
        tl.store(dx_ptr + row * columns + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat.to(dx_ptr.dtype.element_ty).to(tl.float32)
    tl.store(dw_partial_ptr + program * columns + cols, dw, mask=in_row)


# (rows, columns, warps) of an FP8 forward program's tile: the swiglu FP8 forward's (swiglu_fp8_triton.FORWARD_TILE),
# whose stores are the same two layouts.
FP8_TILE = (32, 256, 8)


def fp8_grid(rows: int):
    return (triton.cdiv(rows, FP8_TILE[0]),)


@triton.jit
def rms_norm_fp8_forward(x_ptr, w_ptr, row_ptr, col_ptr, rstd_ptr, scale_ptr, amax_ptr, scale_inv_ptr, eps, rows,
                         columns: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr, BIAS: tl.constexpr,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """The forward's function for rows [first, first + BLOCK_ROWS), written in FP8 both layouts (the next GEMM's input
    and its weight gradient's): a first sweep over the rows' columns sums their squares, a second normalizes each tile
    (rounded to x's dtype, as the BF16 forward rounds it), scales it by the weight in fp32 and stores its FP8 bytes
    twice (fp8_bytes_triton._store_both). The second sweep reads the rows again, mostly from L2 (a program's rows
    are 32 x 2 bytes x the hidden size). Each program maxes its |values| into the tensor's amax; the first writes the
    reciprocal scale."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_rows = r < rows
    squares = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, columns, BLOCK_COLUMNS):
        c = start + tl.arange(0, BLOCK_COLUMNS)
        mask = in_rows[:, None] & (c < columns)[None, :]
        x = tl.load(x_ptr + r[:, None] * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
    rstd = 1.0 / tl.sqrt(squares / columns + eps)
    tl.store(rstd_ptr + r, rstd, mask=in_rows)
    scale = tl.load(scale_ptr)
    amax = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    for start in range(0, columns, BLOCK_COLUMNS):
        c = start + tl.arange(0, BLOCK_COLUMNS)
        mask = in_rows[:, None] & (c < columns)[None, :]
        x = tl.load(x_ptr + r[:, None] * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c, mask=c < columns, other=0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        y = (x * rstd[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * w[None, :]
        amax = tl.maximum(amax, tl.max(tl.abs(y), 1))
        _store_both(y, scale, FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, columns, columns, 0)
    tl.atomic_max(amax_ptr, tl.max(amax, 0))
    if tl.program_id(0) == 0:
        tl.store(scale_inv_ptr, 1.0 / scale)
