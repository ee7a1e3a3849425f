"""One optimizer step (and one eval pass) through megatron-core's pipeline schedules.

The loss is summed over tokens and divided by the number of loss tokens in the whole global batch (megatron-core's
`calculate_per_token_loss`), so every TP/PP/DP/CP layout computes the same number from the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from ..platform import current_device


@dataclass
class StepResult:
    loss: float               # mean loss per token over the global batch
    tokens: int               # loss tokens in the global batch
    grad_norm: Optional[float]
    skipped: bool             # inf/nan in the grads (fp16 overflow): no update was applied


def loss_func(loss_mask: torch.Tensor, per_token_loss: torch.Tensor):
    mask = loss_mask.reshape(-1).float()
    loss_sum = (per_token_loss.float().reshape(-1) * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}


def forward_step(data_iterator: Iterator, model):
    """megatron's forward_step_func: one micro-batch -> per-token losses and how to reduce them."""
    batch = next(data_iterator)
    device = current_device()
    tokens = batch["tokens"].to(device, non_blocking=True)
    labels = batch["labels"].to(device, non_blocking=True)
    position_ids = batch["position_ids"].to(device, non_blocking=True)
    loss_mask = batch["loss_mask"].to(device, non_blocking=True)
    tokens, labels, loss_mask, position_ids = _slice_for_context_parallel(tokens, labels, loss_mask, position_ids)
    # attention_mask=None: every spec runs causal attention (the Litespark and TE modules natively, the stock local
    # spec through megatron-core's default causal mask).
    per_token_loss = model(tokens, position_ids, None, labels=labels)
    return per_token_loss, partial(loss_func, loss_mask)


def _slice_for_context_parallel(*tensors):
    """Under CP each rank keeps 2 of the 2*CP sequence chunks (i and 2*CP-1-i) so causal work is balanced."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return tensors
    rank = parallel_state.get_context_parallel_rank()
    out = []
    for t in tensors:
        # Slices, not an index tensor: building one on the GPU copies from the host and synchronizes the stream.
        chunks = t.view(t.size(0), 2 * cp, t.size(1) // (2 * cp), *t.shape[2:])
        out.append(torch.cat([chunks[:, rank], chunks[:, 2 * cp - rank - 1]], dim=1))
    return out


def _reduce_losses(loss_dicts: List[dict]) -> tuple:
    """Sum of loss and tokens over micro-batches and data-parallel (+CP) ranks, known on every rank."""
    device = current_device()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        for d in loss_dicts:
            total += d["lm loss"].to(total)
        torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        last = parallel_state.get_pipeline_model_parallel_last_rank()
        torch.distributed.broadcast(total, src=last, group=parallel_state.get_pipeline_model_parallel_group())
    loss_sum, tokens = total.tolist()
    return loss_sum / max(tokens, 1.0), int(tokens)


def _run_schedule(model: list, data_iterators, num_microbatches: int, args, forward_only: bool) -> List[dict]:
    """One global batch through megatron's schedule for this layout (no pipelining, 1F1B or interleaved)."""
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(model) > 1 else data_iterators[0],
        model=model,
        num_microbatches=num_microbatches,
        seq_length=args.seq_length // args.context_parallel_size,
        micro_batch_size=args.micro_batch_size,
        forward_only=forward_only,
    )


def train_step(model: list, optimizer, scheduler, data_iterators, num_microbatches: int, args) -> StepResult:
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    loss_dicts = _run_schedule(model, data_iterators, num_microbatches, args, forward_only=False)
    updated, grad_norm, _ = optimizer.step()
    if updated:
        scheduler.step(increment=1)
    loss, tokens = _reduce_losses(loss_dicts)
    return StepResult(loss=loss, tokens=tokens, grad_norm=None if grad_norm is None else float(grad_norm),
                      skipped=not updated)


@torch.no_grad()
def eval_step(model: list, data_iterators, num_microbatches: int, args) -> tuple:
    """Forward only over one global batch: (mean loss per token, tokens)."""
    return _reduce_losses(_run_schedule(model, data_iterators, num_microbatches, args, forward_only=True))
