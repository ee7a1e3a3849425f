"""Sample text from a trained model (top-k sampling, full forward per token: for a quick look, not for serving)."""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from .platform import current_device


def can_sample(args) -> Optional[str]:
    """None if this layout can sample, else why not."""
    if args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1 or args.sequence_parallel:
        return "sampling runs without pipeline, context or sequence parallelism"
    return None


@torch.no_grad()
def sample(model, tokenizer, prompt: str, seq_length: int, max_new_tokens: int = 64, top_k: int = 20,
           temperature: float = 0.8, seed: int = 0) -> str:
    """Continue `prompt`; every TP rank draws the same token (same generator seed, gathered logits)."""
    device = current_device()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    ids = list(tokenizer.tokenize(prompt)) or [tokenizer.eod]
    start = len(ids)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            context = ids[-seq_length:]
            tokens = torch.tensor([context], device=device)
            positions = torch.arange(len(context), device=device).unsqueeze(0)
            logits = model(tokens, positions, None)[0, -1].float()        # vocab-parallel under TP
            if parallel_state.get_tensor_model_parallel_world_size() > 1:
                logits = gather_from_tensor_model_parallel_region(logits.unsqueeze(0))[0]
            logits = logits[: tokenizer.vocab_size].cpu() / temperature   # drop the vocabulary padding
            values, indices = torch.topk(logits, min(top_k, logits.numel()))
            choice = torch.multinomial(torch.softmax(values, -1), 1, generator=generator)
            token = int(indices[choice])
            if token == tokenizer.eod:
                break
            ids.append(token)
    finally:
        model.train(was_training)
    return tokenizer.detokenize(ids[start:])
