"""The Triton kernels of Litespark's FP8 output layer (fp8_logits.py). Each program takes a tile of a [rows, n]
matrix and computes in fp32: the cast stores the tile's FP8 bytes twice, row-major ([rows, n]) and column-major
([n, rows]), as the FP8 SwiGLU's kernels do (fp8_bytes_triton.py: the byte conversion and the two-layout store); the
loss's gradient stores the row-major bytes, which a transpose copies into the column-major layout.
Imported only where Triton runs (a CUDA device, or Triton's interpreter in the tests)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _fp8_codes, _fp8_codes_stochastic, _random_bits, _store_both

# (rows, columns, warps) of a program's tile: the FP8 SwiGLU backward's (swiglu_fp8_triton.py), the same loads and
# two-layout stores.
TILE = (32, 128, 8)
TILE_ARGUMENTS = dict(BLOCK_ROWS=TILE[0], BLOCK_COLUMNS=TILE[1], num_warps=TILE[2])  # a launch's keywords


def grid(rows: int, columns: int):
    return (triton.cdiv(rows, TILE[0]), triton.cdiv(columns, TILE[1]))


@triton.jit
def fp8_cast_both_layouts(x_ptr, row_ptr, col_ptr, scale_ptr, rows, columns: tl.constexpr, FP8_MAX: tl.constexpr,
                          MANTISSA: tl.constexpr, BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                          BLOCK_COLUMNS: tl.constexpr):
    """x [rows, columns] times the scale, in FP8, row-major and column-major (the output layer's input and
    weight)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    mask = (r < rows)[:, None] & (c < columns)[None, :]
    x = tl.load(x_ptr + r[:, None] * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
    _store_both(x, tl.load(scale_ptr), FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, columns, columns, 0)


# (the seed and the first row: no compiled variant for each value that Triton would otherwise specialize, 1 or
# multiples of 16)
@triton.jit(do_not_specialize=["seed", "first_row"])
def cross_entropy_gradient_fp8(logits_ptr, target_ptr, lse_ptr, grad_ptr, row_ptr, scale_ptr, seed, first_row,
                               vocab_start, rows, columns: tl.constexpr, FP8_MAX: tl.constexpr,
                               MANTISSA: tl.constexpr, BIAS: tl.constexpr, STOCHASTIC: tl.constexpr,
                               BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """The loss's gradient over this shard's logits, (softmax - onehot(target)) * the token's loss gradient, in
    FP8, row-major: exp(logit - logsumexp) from the forward's logsumexp, so each tile is independent. STOCHASTIC:
    rounded stochastically, the random bits of element (first_row + row, vocab_start + column) under the seed."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    in_rows = r < rows
    mask = in_rows[:, None] & (c < columns)[None, :]
    x = tl.load(logits_ptr + r[:, None] * columns + c[None, :], mask=mask, other=0.0).to(tl.float32)
    lse = tl.load(lse_ptr + r, mask=in_rows, other=0.0)
    g = tl.load(grad_ptr + r, mask=in_rows, other=0.0)
    target = tl.load(target_ptr + r, mask=in_rows, other=-1) - vocab_start
    onehot = (c[None, :] == target[:, None]).to(tl.float32)
    d = (tl.exp(x - lse[:, None]) - onehot) * g[:, None]
    if STOCHASTIC:
        random = _random_bits(first_row + r[:, None], vocab_start + c[None, :], seed.to(tl.uint32))
        code = _fp8_codes_stochastic(d, tl.load(scale_ptr), random, FP8_MAX, MANTISSA, BIAS)
    else:
        code = _fp8_codes(d, tl.load(scale_ptr), FP8_MAX, MANTISSA, BIAS)
    tl.store(row_ptr + r[:, None] * columns + c[None, :], code.to(tl.uint8), mask=mask)


@triton.jit
def fp8_transpose(src_ptr, dst_ptr, rows, columns: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                  BLOCK_COLUMNS: tl.constexpr):
    """Bytes [rows, columns] -> [columns, rows] (an FP8 tensor's column-major layout), a tile through on-chip memory
    (transposed as 32-bit integers, as _store_both does)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1).to(tl.int64) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)
    x = tl.load(src_ptr + r[:, None] * columns + c[None, :], mask=(r < rows)[:, None] & (c < columns)[None, :],
                other=0).to(tl.int32)
    tl.store(dst_ptr + c[:, None] * rows + r[None, :], tl.trans(x).to(tl.uint8),
             mask=(c < columns)[:, None] & (r < rows)[None, :])
