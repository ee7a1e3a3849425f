"""What a precision costs in quality, without a model hub: perplexity and next-token top-1 accuracy on held-out text,
the top-1 agreement of two precisions' predictions, and EfficientLLM's model compression rate (MCR).

Held-out text: by default the embedded corpus's documents that training never sees. megatron.training splits a
--data-path dataset's documents in order into train/validation/test by --split, whose default for the embedded
corpus is Megatron-LM's legacy "969, 30, 1": perplexity is measured on the validation documents (the ones a
training run's validation loss comes from) and AWQ calibrates on the test documents, so the calibration text is
never the evaluation text.

The text is one stream (documents tokenized without special tokens, each followed by the tokenizer's end-of-
document token, as the training data is), cut into non-overlapping windows; every token of a window but its first
is predicted from the ones before it in the window.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List, Optional, Sequence

from ..errors import UserError

# Megatron-LM's default --split for a --data-path dataset (megatron.training.arguments): train, validation, test.
MEGATRON_DEFAULT_SPLIT = (969, 30, 1)
SPLITS = ("train", "validation", "test")


def split_documents(documents: Sequence, split: str, weights: Sequence[float] = MEGATRON_DEFAULT_SPLIT) -> list:
    """The documents of one split, as megatron-core's BlendedMegatronDatasetBuilder cuts a dataset of len(documents)
    documents: split i is [round(start_i * n), round(end_i * n)) with the weights normalized to fractions."""
    total = float(sum(weights))
    index = SPLITS.index(split)
    start = sum(weights[:index]) / total
    end = start + weights[index] / total
    n = len(documents)
    return list(documents[int(round(start * n)):int(round(end * n))])


def embedded_corpus_documents(split: str) -> List[str]:
    """The texts of one split of `--embedded-corpus stdlib` (prepared once and cached, as a training run does)."""
    from ..corpus import prepare_stdlib_corpus, stdlib_corpus_dir

    corpus = prepare_stdlib_corpus(stdlib_corpus_dir())
    manifest = json.loads(open(corpus.manifest_path, encoding="utf-8").read())
    path = os.path.join(os.path.dirname(corpus.manifest_path), manifest["documents_file"])
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return split_documents(texts, split)


def text_file_documents(path: str) -> List[str]:
    """A text file as one document, or a .jsonl file's "text" fields as documents."""
    try:
        with open(path, encoding="utf-8") as f:
            if path.endswith(".jsonl"):
                docs = [json.loads(line)["text"] for line in f if line.strip()]
            else:
                docs = [f.read()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{path}: not readable as text (a UTF-8 file, or JSONL with a \"text\" field per line): "
                        f"{e}") from None
    return [d for d in docs if d.strip()]


def token_stream(tokenizer, documents: Sequence[str], max_tokens: int) -> List[int]:
    """The documents' tokens, each document followed by the end-of-document token, cut at max_tokens."""
    stream: List[int] = []
    eod = getattr(tokenizer, "eod", None)
    for doc in documents:
        stream += tokenizer.tokenize(doc)
        if eod is not None:
            stream.append(int(eod))
        if len(stream) >= max_tokens:
            break
    return stream[:max_tokens]


def windows(stream: Sequence[int], length: int):
    """Non-overlapping windows [W, length] of the stream (the tail shorter than a window is left out)."""
    import torch

    count = len(stream) // length
    if count == 0:
        raise UserError(f"the evaluation text has {len(stream)} tokens, fewer than one window of {length}; give "
                        f"more text or a shorter --eval-seq-length")
    return torch.tensor(list(stream[:count * length]), dtype=torch.long).view(count, length)


def evaluate(model, batches: Sequence, device) -> Dict[str, object]:
    """Next-token negative log-likelihood (summed, in fp32 from the model's logits), top-1 hits and the top-1
    predictions over every predicted position of the windows, batch by batch."""
    import torch

    nll, hits, count, predictions = 0.0, 0, 0, []
    with torch.inference_mode():
        for ids in batches:
            ids = ids.to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            targets = ids[:, 1:]
            nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     reduction="sum").item()
            top1 = logits.argmax(-1)
            hits += int((top1 == targets).sum())
            count += targets.numel()
            predictions.append(top1.reshape(-1).to(torch.int32).cpu())
    return dict(nll_sum=nll, tokens=count, top1_hits=hits, predictions=torch.cat(predictions))


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp of the mean next-token negative log-likelihood."""
    return math.exp(nll_sum / tokens)


def agreement(predictions, reference) -> float:
    """Fraction of positions where two precisions predict the same next token."""
    if predictions.shape != reference.shape:
        raise ValueError(f"predictions of {tuple(predictions.shape)} positions against {tuple(reference.shape)}")
    return float((predictions == reference).float().mean())


def compression_rate(size_ratio: Optional[float], score: Optional[float], reference_score: Optional[float]):
    """EfficientLLM's MCR: (size of the 16-bit model / size of this one) x (this one's score / the 16-bit one's).
    The score here is next-token top-1 accuracy on the held-out text (EfficientLLM's was its benchmark average).
    None when a part is missing."""
    if size_ratio is None or score is None or not reference_score:
        return None
    return size_ratio * score / reference_score
