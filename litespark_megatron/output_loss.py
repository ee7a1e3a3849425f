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
in chunks or not, and the output layer and its loss in FP8 (--litespark-fp8-output-layer, kernels/fp8_logits.py:
megatron-core's input mapping and weight, Litespark's GEMMs).
"""
from __future__ import annotations

import hashlib
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


def fp8_output_loss(output_layer, hidden_states, weight, labels):
    """The per-token loss [b, s] of hidden states [s, b, H] through Litespark's FP8 output layer
    (kernels/fp8_logits.py): megatron-core's column-parallel input mapping (copied to the TP ranks, or all-gathered
    under sequence parallelism; its backward reduces the gradient), then the FP8 GEMMs and the loss on this rank's
    vocabulary shard, its weight gradient where megatron-core's linear would put it."""
    from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                        gather_from_sequence_parallel_region)

    from .kernels.fp8_logits import fp8_logits_loss

    weight = output_layer.weight if weight is None else weight
    group = output_layer.tp_group
    tp = group.size() if group is not None else 1
    h = hidden_states
    if output_layer.sequence_parallel:
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=group)
    elif tp > 1:
        h = copy_to_tensor_model_parallel_region(h, group=group)
    s, b, hidden = h.shape
    vocab = getattr(output_layer, "unpadded_vocab", None)  # model.mask_padded_vocab's
    first = (group.rank() if tp > 1 else 0) * weight.size(0)
    padded_from = None if vocab is None or vocab - first >= weight.size(0) else max(vocab - first, 0)
    loss = fp8_logits_loss(h.reshape(s * b, hidden), weight, labels.t().reshape(-1), group if tp > 1 else None,
                           padded_from, main_grad_fusion=bool(output_layer.gradient_accumulation_fusion),
                           seed=_rounding_seeds.next())
    return loss.view(s, b).t().contiguous()


class _RoundingSeeds:
    """The seeds of the FP8 loss gradient's stochastic rounding (kernels/fp8_logits.py), one per micro-batch: a
    function of the run's --seed, the iteration and the micro-batch's place in the global batch (the k-th micro-batch
    of data-parallel rank r is the global batch's k x DP + r-th, megatron.training's sampler's order), and the
    context-parallel rank (its ranks hold other tokens of the same sample in the same rows). So every TP, SP, PP and
    DP layout rounds a token's gradient alike, and a resumed run draws what the unbroken one drew; no state of a
    random generator is used (layouts consume those differently). The count starts again at each iteration and at
    each run of it (megatron.training's rerun state machine re-runs an iteration to tell a faulty GPU from the data:
    the re-run draws what the first run drew, as it does from the generators, whose states it restores)."""

    def __init__(self):
        self.run, self.count = None, 0

    def next(self) -> int:
        from megatron.core import parallel_state
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training import get_args

        args = get_args()
        run = (args.curr_iteration, get_rerun_state_machine().state)
        if run != self.run:
            self.run, self.count = run, 0
        dp = parallel_state.get_data_parallel_world_size()
        place = self.count * dp + parallel_state.get_data_parallel_rank()
        self.count += 1
        key = f"{args.seed}:{args.curr_iteration}:{place}:{parallel_state.get_context_parallel_rank()}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 1


_rounding_seeds = _RoundingSeeds()


def chunked_output_loss(chunks: Optional[int], litespark_cross_entropy: bool = False,
                        fp8_output_layer: bool = False):
    """megatron-core's output_processor computing the per-token loss [b, s] in `chunks` chunks of the sequence (None:
    at once), with megatron-core's loss or Litespark's cross-entropy; or, fp8_output_layer, the whole micro-batch
    through Litespark's FP8 output layer and its loss."""

    def processor(*, hidden_states, output_layer, output_weight, labels, runtime_gather_output,
                  compute_language_model_loss, scale_logits, **unused):
        def logits_of(h):
            logits, _ = output_layer(h, weight=output_weight, runtime_gather_output=runtime_gather_output)
            return scale_logits(logits)

        if labels is None:  # generation: the logits, as megatron-core returns them ([b, s, V])
            return logits_of(hidden_states).transpose(0, 1).contiguous()
        if fp8_output_layer:
            return fp8_output_loss(output_layer, hidden_states, output_weight, labels)
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
