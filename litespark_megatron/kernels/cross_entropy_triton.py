"""The Triton kernels of Litespark's cross-entropy (cross_entropy.py): one program per row of logits, the row read in
blocks of columns, statistics in fp32. Imported only where Triton runs (a CUDA device, or Triton's interpreter in
the tests), so that a torch without Triton still runs the reference."""
import triton
import triton.language as tl

# Columns a program reads at once: large enough to keep the memory system busy, small enough for its registers.
MAX_BLOCK = 8192
# The row's width (a TP rank's share of the vocabulary) is a compile-time constant: one kernel per model, and its loop
# bound a Python int, which Triton's interpreter needs (Triton 3.6's turns a runtime bound into a one-element numpy
# array, and numpy 2.5 refuses that array as a range bound).


def block_size(columns: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(columns))


@triton.jit
def cross_entropy_row_statistics(logits_ptr, target_ptr, max_ptr, sum_ptr, target_logit_ptr, vocab_start,
                                 columns: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: the max of this shard's logits, the sum of exp(logit - max), and the target's logit (0 where the
    target is in another shard). One read of the row (online softmax: the sum is rescaled as the max grows)."""
    row = tl.program_id(0).to(tl.int64)  # row * columns exceeds int32 at realistic sizes
    logits_ptr += row * columns
    row_max = -float("inf")
    row_sum = 0.0
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + cols, mask=cols < columns, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(row_max, tl.max(x, 0))
        # Padded vocabulary rows are -inf logits (model.mask_padded_vocab), a whole shard of them possibly:
        # shift by 0 then, not by -inf (exp(-inf - -inf) is NaN).
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        row_sum = row_sum * tl.exp(row_max - shift) + tl.sum(tl.exp(x - shift), 0)
        row_max = new_max
    local = tl.load(target_ptr + row) - vocab_start
    here = (local >= 0) & (local < columns)
    target_logit = tl.load(logits_ptr + tl.where(here, local, 0), mask=here, other=0.0).to(tl.float32)
    tl.store(max_ptr + row, row_max)
    tl.store(sum_ptr + row, row_sum)
    tl.store(target_logit_ptr + row, target_logit)


@triton.jit
def cross_entropy_gradient_in_place(logits_ptr, target_ptr, lse_ptr, grad_loss_ptr, vocab_start,
                                    columns: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: (softmax - onehot(target)) * the loss's gradient, written over the row's logits in their dtype.
    The softmax is exp(logit - logsumexp) with the logsumexp of the whole vocabulary (all TP shards)."""
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * columns
    lse = tl.load(lse_ptr + row)
    grad = tl.load(grad_loss_ptr + row)
    local = tl.load(target_ptr + row) - vocab_start
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < columns
        x = tl.load(logits_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        d = (tl.exp(x - lse) - tl.where(cols == local, 1.0, 0.0)) * grad
        tl.store(logits_ptr + cols, d.to(logits_ptr.dtype.element_ty), mask=mask)
