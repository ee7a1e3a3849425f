"""Litespark's cross-entropy (litespark_megatron/kernels/cross_entropy.py) on gloo ranks, its Triton kernels through
Triton's interpreter (TRITON_INTERPRET=1 in the environment, before anything imports Triton). Run by torchrun with 3
ranks: TP groups of 1, 2 and 3 ranks split one vocabulary as megatron-core does. Rank 0 prints the largest
differences as one JSON line:

    triton_fp32 / triton_bf16   the Triton path against the reference on the same logits in fp64 (loss, gradient)
    megatron_fp32 / megatron_bf16   the reference against megatron-core's vocab_parallel_cross_entropy
    exact_fp64                  the reference with its TP shards against torch's cross_entropy of the whole row
    and single-rank checks of what the Triton path keeps and writes (see the keys).
"""
import json

import torch
import torch.distributed as dist
import torch.nn.functional as F

from litespark_megatron.kernels.cross_entropy import (vocab_parallel_cross_entropy_reference as reference,
                                                      vocab_parallel_cross_entropy_triton as triton_path)

SHARDS = (37, 129)        # columns per rank: odd, one block and several
SHAPES = ((1, 1), (7, 1), (3, 2))  # [s, b]: rows 1, 7, 6


def case(seed: int, shape, shard: int, tp: int, padded: int = 0):
    """Logits of the whole vocabulary (every rank draws the same) and targets: the first rows at the edges of every
    shard, the rest random; `padded` last columns are -inf (megatron's padded vocabulary), never a target."""
    g = torch.Generator().manual_seed(seed)
    vocab = shard * tp
    logits = torch.randn(*shape, vocab, generator=g, dtype=torch.float64) * 3
    if padded:
        logits[..., vocab - padded:] = float("-inf")
    real = vocab - padded
    edges = sorted({i for r in range(tp) for i in (r * shard, r * shard + shard - 1)} & set(range(real)))
    target = torch.randint(0, real, shape, generator=g).view(-1)
    target[:len(edges)] = torch.tensor(edges[:target.numel()])
    return logits, target.view(shape)


def shard_of(x, rank: int, shard: int):
    return x[..., rank * shard:(rank + 1) * shard]


def loss_and_grad(fn, logits, target, grad_loss, *args, **kwargs):
    logits = logits.detach().clone().requires_grad_()
    loss = fn(logits, target, *args, **kwargs)
    (grad,) = torch.autograd.grad(loss, logits, grad_loss.to(loss.dtype))
    return loss.detach().double(), grad.double()


def diff(a, b) -> float:
    return (a - b).abs().max().item()


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    groups = {tp: dist.new_group(list(range(tp))) for tp in (1, 2, 3)}
    worst = {}

    def note(key, value):
        worst[key] = max(worst.get(key, 0.0), value)

    seed = 0
    for tp, group in groups.items():
        for shard in SHARDS:
            for shape in SHAPES:
                for padded in (0, shard // 2 + (shard if tp > 1 else 0)):  # under TP a whole shard of -inf too
                    seed += 1
                    if rank >= tp:
                        continue
                    full, target = case(seed, shape, shard, tp, padded)
                    mine = shard_of(full, rank, shard)
                    g = torch.Generator().manual_seed(seed)
                    grad_loss = torch.randn(shape, generator=g, dtype=torch.float64)
                    ref_loss, ref_grad = loss_and_grad(reference, mine, target, grad_loss, group)
                    if padded == 0:
                        exact = F.cross_entropy(full.view(-1, full.size(-1)), target.view(-1), reduction="none")
                        note("exact_fp64", diff(ref_loss.view(-1), exact))
                    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                        x = mine.to(dtype)
                        # the reference on the same (rounded) logits, in fp64
                        ref_loss, ref_grad = loss_and_grad(reference, x.double(), target, grad_loss, group)
                        for block in (None, 16):
                            loss, grad = loss_and_grad(triton_path, x, target, grad_loss, group, block=block)
                            note(f"triton_{name}_loss", diff(loss, ref_loss))
                            # relative to the loss's gradient, the scale of the logits' (|softmax - onehot| <= 1):
                            # a bf16 gradient is rounded to 8 bits
                            note(f"triton_{name}_grad", diff(grad, ref_grad) / grad_loss.abs().max().item())
                        # megatron-core's own (it subtracts the max in place from fp32 logits: a copy each)
                        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

                        mc_loss, mc_grad = loss_and_grad(vocab_parallel_cross_entropy, x, target, grad_loss,
                                                         tp_group=group)
                        loss, grad = loss_and_grad(reference, x, target, grad_loss, group)
                        note(f"megatron_{name}_loss", diff(loss, mc_loss))
                        note(f"megatron_{name}_grad", diff(grad, mc_grad))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, worst)
    if rank == 0:
        report = {k: max(w[k] for w in gathered if k in w) for k in gathered[0]}
        report.update(single_rank_checks())
        print(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def single_rank_checks() -> dict:
    """What the Triton path keeps, writes and refuses, on one rank (no TP group)."""
    full, target = case(99, (5, 2), 37, 1)
    x = full.float()
    out = {}
    # The backward writes the gradient over the logits themselves: the gradient is the logits' memory.
    logits = x.clone().requires_grad_()
    loss = triton_path(logits, target)
    (grad,) = torch.autograd.grad(loss.sum(), logits, retain_graph=True)
    out["grad_is_the_logits_memory"] = grad.data_ptr() == logits.data_ptr()
    # A second backward would read the gradient as logits: autograd's version check refuses it.
    try:
        torch.autograd.grad(loss.sum(), logits)
        out["second_backward"] = "ran"
    except RuntimeError as e:
        out["second_backward"] = "refused" if "modified by an inplace operation" in str(e) else str(e)
    # Evaluation (no gradient) leaves the logits as they were.
    with torch.no_grad():
        logits = x.clone()
        triton_path(logits, target)
        out["no_grad_logits_unchanged"] = torch.equal(logits, x)
    # A non-contiguous view ([b, s, V] transposed) computes the same, and is left alone: its copy takes the gradient.
    view = x.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    before = view.detach().clone()
    ref_loss, ref_grad = loss_and_grad(reference, x.double(), target, torch.ones(5, 2, dtype=torch.float64))
    loss = triton_path(view, target)
    (grad,) = torch.autograd.grad(loss.sum(), view)
    out["non_contiguous_loss"] = diff(loss.double(), ref_loss)
    out["non_contiguous_grad"] = diff(grad.double(), ref_grad)
    out["non_contiguous_input_unchanged"] = torch.equal(view.detach(), before)
    # Under activation checkpointing (--chunked-output-loss) the forward runs again in the backward.
    from torch.utils.checkpoint import checkpoint

    logits = x.clone().requires_grad_()
    loss = checkpoint(lambda t: triton_path(t * 1.0, target), logits, use_reentrant=False)
    (grad,) = torch.autograd.grad(loss.sum(), logits)
    out["checkpoint_loss"] = diff(loss.double(), ref_loss)
    out["checkpoint_grad"] = diff(grad.double(), ref_grad)
    return out


if __name__ == "__main__":
    main()
