"""Litespark's vocab-parallel cross-entropy: megatron-core's per-token loss without an fp32 copy of the logits.

megatron-core's cross-entropy, fused or not, upcasts this rank's [s, b, V / TP] logits to fp32 and keeps the fp32
softmax for the backward: twice the bytes of bf16 logits, for the whole micro-batch, from the loss's forward to its
backward. Here the logits stay in their own dtype and are the only thing the loss keeps:

    forward   a Triton program per row reads the row once (online softmax, fp32 in registers): this shard's max,
              sum of exp(logit - max), and the target's logit where the target is in this shard; torch combines
              the shards over the TP group (MAX of the maxima, then SUM of the rescaled sums and of the target's
              logit); loss = logsumexp - target logit. Saved: the logits and one fp32 logsumexp per row.
    backward  one more read of the row writes (softmax - onehot) * the loss's gradient over the logits, in place:
              the logits' memory becomes their gradient.

The gradient is written in the backward, not in the forward as Liger-Kernel's cross-entropy does: megatron's loss
gradient differs per token (the loss mask, the token count), so a gradient written in the forward needs another
pass over the logits to scale it, and the forward would destroy logits the caller may still read (evaluation, a
hook). Writing over the logits is safe because nothing else keeps them: megatron-core's output layer needs its
input and weight for its backward, not its output. The version counter of the logits is bumped after the write, so
that any autograd use of them afterwards (another node that saved them, a second backward) fails loudly instead of
reading the gradient. Non-contiguous logits are copied first (the copy then is what the loss keeps).

`vocab_parallel_cross_entropy_reference` defines the function: megatron-core's vocab_parallel_cross_entropy in plain
torch (fp32 statistics, autograd's gradient); the Triton path is held to it in tests/test_cross_entropy_kernel.py.
`cross_entropy` runs the Triton path on CUDA and the reference elsewhere; `cross_entropy_path` says which (the run's
"what ran" record).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from . import kernel_path


def _refuse_label_smoothing(label_smoothing: float) -> None:
    if label_smoothing:
        raise ValueError(f"label smoothing {label_smoothing:g}: Litespark's cross-entropy computes the plain loss; "
                         "use megatron-core's vocab_parallel_cross_entropy for a smoothed one")


def _check_shapes(logits: torch.Tensor, target: torch.Tensor) -> None:
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"cross-entropy: target of shape {tuple(target.shape)} for logits of shape "
                         f"{tuple(logits.shape)}; the target has the logits' shape without the vocabulary")


def _tp(tp_group) -> tuple:
    """(rank, size) in the TP group; None is a vocabulary held whole by this process."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


# --------------------------------------------------------------------------------------------- the reference
class _SumOverTP(torch.autograd.Function):
    """All-reduce SUM in the forward, identity in the backward: every TP rank computes the same loss, and each
    rank's gradient is that of its own shard (megatron-core's reduce_from_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, tp_group):
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=tp_group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def vocab_parallel_cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                           label_smoothing: float = 0.0) -> torch.Tensor:
    """What megatron-core's vocab_parallel_cross_entropy computes, in plain torch: the per-token loss [...] of
    logits [..., V / TP], this rank's shard of the vocabulary (rank r holds ids [r V / TP, (r + 1) V / TP)), and
    global target ids; statistics in fp32 (fp64 for fp64 logits); gradient by autograd. A target outside the
    vocabulary has loss logsumexp (a target logit of 0), as in megatron-core. tp_group None: the whole
    vocabulary is here."""
    _refuse_label_smoothing(label_smoothing)
    _check_shapes(logits, target)
    rank, size = _tp(tp_group)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    columns = x.size(-1)
    # The max only shifts the exponentials (it cancels in the loss): no gradient through it.
    row_max = x.detach().amax(dim=-1)
    if size > 1:
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = x - row_max.unsqueeze(-1)
    local = target - rank * columns
    here = (local >= 0) & (local < columns)
    target_logit = shifted.gather(-1, torch.where(here, local, 0).unsqueeze(-1)).squeeze(-1) * here
    sum_exp = shifted.exp().sum(dim=-1)
    if size > 1:
        sum_exp, target_logit = _SumOverTP.apply(sum_exp, tp_group), _SumOverTP.apply(target_logit, tp_group)
    return sum_exp.log() - target_logit


# --------------------------------------------------------------------------------------------- the Triton path
def row_statistics(x: torch.Tensor, target: torch.Tensor, vocab_start: int, tp_group=None,
                   block: Optional[int] = None):
    """(logsumexp over the whole vocabulary, the target's logit) per row of this shard's contiguous logits
    [rows, V / TP], fp32: the Triton kernel's per-shard statistics combined over the TP group."""
    from . import cross_entropy_triton as kernels

    rows, columns = x.shape
    row_max, row_sum, target_logit = (torch.empty(rows, device=x.device, dtype=torch.float32) for _ in range(3))
    kernels.cross_entropy_row_statistics[(rows,)](x, target, row_max, row_sum, target_logit, vocab_start, columns,
                                                  BLOCK=block or kernels.block_size(columns))
    if _tp(tp_group)[1] > 1:
        local_max = row_max.clone()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp_group)
        # Each shard's sum rescaled to the global max; a shard of -inf logits only has sum 0 (exp(-inf) = 0).
        sums = torch.stack([row_sum * torch.exp(local_max - row_max), target_logit])
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
        row_sum, target_logit = sums
    return torch.log(row_sum) + row_max, target_logit


class _TritonCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, tp_group, block):
        from . import cross_entropy_triton as kernels

        rank = _tp(tp_group)[0]
        # The kernels read rows of `columns` contiguous values. Not a view: the saved tensor is the logits
        # themselves (or their copy), whose version autograd checks when the backward unpacks it.
        x = logits.contiguous()
        t = target.reshape(-1).to(torch.int64).contiguous()
        columns = x.size(-1)
        block = block or kernels.block_size(columns)
        lse, target_logit = row_statistics(x.view(-1, columns), t, rank * columns, tp_group, block)
        ctx.save_for_backward(x, t, lse)
        ctx.vocab_start, ctx.block = rank * columns, block
        return (lse - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        from . import cross_entropy_triton as kernels

        x, t, lse = ctx.saved_tensors
        grad = grad_loss.reshape(-1).to(torch.float32).contiguous()
        kernels.cross_entropy_gradient_in_place[(t.numel(),)](x, t, lse, grad, ctx.vocab_start, x.size(-1),
                                                              BLOCK=ctx.block)
        # Triton wrote through a pointer, which autograd does not see: say that the logits changed.
        torch.autograd.graph.increment_version(x)
        return x, None, None, None


def vocab_parallel_cross_entropy_triton(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                                        label_smoothing: float = 0.0, block: Optional[int] = None) -> torch.Tensor:
    """The reference's loss through the Triton kernels; the backward writes the gradient over `logits` (or over
    their contiguous copy). `block`: columns per step of a row (tests force several blocks on small rows)."""
    _refuse_label_smoothing(label_smoothing)
    _check_shapes(logits, target)
    return _TritonCrossEntropy.apply(logits, target, tp_group, block)


# --------------------------------------------------------------------------------------------- dispatch
cross_entropy_path = kernel_path  # what `cross_entropy` runs on a device of this type


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                  label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token loss of this rank's vocabulary shard of logits [..., V / TP] and global target ids [...]: the
    Triton kernels on CUDA, the reference elsewhere."""
    if cross_entropy_path(logits.device.type) == "litespark":
        return vocab_parallel_cross_entropy_triton(logits, target, tp_group, label_smoothing)
    return vocab_parallel_cross_entropy_reference(logits, target, tp_group, label_smoothing)
