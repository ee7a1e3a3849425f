"""The output layer and the loss in chunks of sequence positions (--chunked-output-loss N), so that a micro-batch's
logits are never whole in memory.

megatron-core computes the logits of the whole micro-batch, [s, b, V / TP], and its fused cross-entropy keeps an
fp32 copy of them for the backward: for llama-3b (V = 128,256) 2 GiB per sequence of 4,096 tokens, the allocation
most of the megatron rows that ran out of memory asked for
(docs/benchmarks/2026-11-25-best-stock-graphs-h100-memory.md). Here each chunk of positions goes through the output
layer and megatron-core's own loss (fused or not, as configured) under activation checkpointing: the forward keeps
only the chunk's loss, and the backward recomputes one chunk's logits at a time. The cost is the output layer's GEMM
and the loss's forward once more, and under sequence parallelism the all-gather: a share of the step traded for peak
memory (docs/benchmarks/2026-11-25-qkv-fix-chunked-loss-mb2-h200.md). A way to fit a micro-batch, not to gain speed.

It is megatron-core's `output_processor` hook of GPTModel.forward (called on the last pipeline stage): the output
layer, its weight (tied or not), gradient-accumulation fusion, TP and SP are megatron-core's, unchanged. The same
hook runs the loss through Litespark's cross-entropy kernel (--litespark-cross-entropy, kernels/cross_entropy.py),
in chunks or not.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint


def litespark_loss(tp_group):
    """megatron-core's compute_language_model_loss (labels [b, s], this rank's logits [s, b, V / TP] -> per-token
    loss [b, s]) with Litespark's cross-entropy."""
    from .kernels.cross_entropy import cross_entropy

    def loss(labels, logits):
        return cross_entropy(logits, labels.transpose(0, 1).contiguous(), tp_group).transpose(0, 1).contiguous()

    return loss


def chunked_output_loss(chunks: Optional[int], litespark_cross_entropy: bool = False):
    """megatron-core's output_processor computing the per-token loss [b, s] in `chunks` chunks of the sequence (None:
    at once), with megatron-core's loss or Litespark's cross-entropy."""

    def processor(*, hidden_states, output_layer, output_weight, labels, runtime_gather_output,
                  compute_language_model_loss, scale_logits, **unused):
        def logits_of(h):
            logits, _ = output_layer(h, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return scale_logits(logits)

        if labels is None:  # generation: the logits, as megatron-core returns them ([b, s, V])
            return logits_of(hidden_states).transpose(0, 1).contiguous()
        if litespark_cross_entropy:
            compute_language_model_loss = litespark_loss(output_layer.tp_group)
        if chunks is None:
            return compute_language_model_loss(labels, logits_of(hidden_states))

        def chunk_loss(h, chunk_labels):
            return compute_language_model_loss(chunk_labels, logits_of(h))

        # Under sequence parallelism hidden_states holds this rank's s / TP positions and the output layer
        # all-gathers a chunk from every rank: chunk j covers positions [j c, (j + 1) c) of each rank's part.
        local = hidden_states.size(0)
        ranks = output_layer.tp_group.size() if output_layer.sequence_parallel else 1
        c = local // chunks
        losses, positions = [], []
        for j in range(chunks):
            pos = torch.cat([torch.arange(r * local + j * c, r * local + (j + 1) * c, device=labels.device)
                             for r in range(ranks)])
            # no randomness in the output layer or the loss: no RNG state to stash and restore per chunk
            losses.append(checkpoint(chunk_loss, hidden_states[j * c:(j + 1) * c], labels[:, pos],
                                     use_reentrant=False, preserve_rng_state=False))
            positions.append(pos)
        # [b, s] in chunk order -> sequence order
        return torch.cat(losses, dim=1)[:, torch.argsort(torch.cat(positions))]

    return processor
