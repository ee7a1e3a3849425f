"""The Triton kernels of Litespark's FP8 output layer (fp8_logits.py). Each program takes a tile of a [rows, n]
matrix, computes in fp32 and stores the tile's FP8 bytes twice, row-major ([rows, n]) and column-major ([n, rows]),
as the FP8 SwiGLU's kernels do (fp8_bytes_triton.py: the byte conversion and the two-layout store).
Imported only where Triton runs (a CUDA device, or Triton's interpreter in the tests)."""
import triton
import triton.language as tl

from .fp8_bytes_triton import _store_both

# (rows, columns, warps) of a program's tile: the FP8 SwiGLU backward's (swiglu_fp8_triton.py), the same loads and
# two-layout stores.
TILE = (32, 128, 8)


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


@triton.jit
def cross_entropy_gradient_fp8(logits_ptr, target_ptr, lse_ptr, grad_ptr, row_ptr, col_ptr, scale_ptr, vocab_start,
                               rows, columns: tl.constexpr, FP8_MAX: tl.constexpr, MANTISSA: tl.constexpr,
                               BIAS: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_COLUMNS: tl.constexpr):
    """The loss's gradient over this shard's logits, (softmax - onehot(target)) * the token's loss gradient, in
    FP8, both layouts: exp(logit - logsumexp) from the forward's logsumexp, so each tile is independent."""
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
    _store_both(d, tl.load(scale_ptr), FP8_MAX, MANTISSA, BIAS, row_ptr, col_ptr, r, c, rows, columns, columns, 0)
