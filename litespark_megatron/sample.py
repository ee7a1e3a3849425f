"""--sample-prompt: the trained model's greedy continuation of a prompt, printed after training (a quick look at what
it learned: the most likely token each time, a full forward per token; not for serving)."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from .platform import current_device

_model = []


def why_not(args) -> Optional[str]:
    """None if this run can sample after training, else why not (checked before training starts)."""
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1 or args.sequence_parallel:
        return "--sample-prompt runs without pipeline, context or sequence parallelism"
    if not args.tokenizer_model:
        return ("--sample-prompt needs a text tokenizer (--tokenizer-model, or --embedded-corpus): the "
                f"{args.tokenizer_type} cannot encode text")
    return None


def keep_model(chunks):
    """A post-wrap hook of the model config: keeps the trained model for the sample after pretrain returns."""
    _model[:] = chunks
    return chunks


def print_sample(args) -> None:
    from megatron.training.utils import print_rank_0

    from .data import load_tokenizer

    tokenizer_type = None if args.tokenizer_type == "NullTokenizer" else args.tokenizer_type
    tokenizer = load_tokenizer(tokenizer_type, args.tokenizer_model, args.vocab_size)
    text = sample(_model[0], tokenizer, args.sample_prompt, args.seq_length, max_new_tokens=args.sample_tokens)
    print_rank_0(f"sample ({args.sample_tokens} tokens after {args.sample_prompt!r}):\n{args.sample_prompt}{text}")


@torch.no_grad()
def sample(model, tokenizer, prompt: str, seq_length: int, max_new_tokens: int = 64, pad_multiple: int = 16) -> str:
    """Continue `prompt` greedily: each new token is the argmax of the whole vocabulary's logits (gathered over TP,
    so every TP rank takes the same one); stops at the end-of-document token.

    The context is right-padded to a multiple of `pad_multiple` tokens: Transformer Engine's FP8 GEMMs refuse a
    token count that is not a multiple of 8/16, and a prompt is a few tokens. The model is causal, so padding after
    the last real token leaves that token's logits unchanged."""
    device = current_device()
    ids = list(tokenizer.tokenize(prompt)) or [tokenizer.eod]
    start = len(ids)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids[-seq_length:]
            logits = _last_logits(model, context, tokenizer.eod, device, pad_multiple, seq_length)
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                logits = gather_from_tensor_model_parallel_region(logits.unsqueeze(0))[0]
            token = int(torch.argmax(logits[: tokenizer.vocab_size]))  # the vocabulary padding dropped
            if token == tokenizer.eod:
                break
            ids.append(token)
    finally:
        model.train(was_training)
    return tokenizer.detokenize(ids[start:])


def _last_logits(model, context, pad_id: int, device, pad_multiple: int, seq_length: int) -> torch.Tensor:
    """Logits (this rank's vocabulary shard) after the last token of `context`, run right-padded."""
    padded = -(-len(context) // pad_multiple) * pad_multiple
    if padded > seq_length:     # a full window of a sequence length that is no multiple: run it as it is
        padded = len(context)
    tokens = torch.tensor([context + [pad_id] * (padded - len(context))], device=device)
    positions = torch.arange(padded, device=device).unsqueeze(0)
    return model(tokens, positions, None)[0, len(context) - 1].float()
