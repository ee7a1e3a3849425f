"""The end-of-run text sample: right-padding the context (for FP8's token-count rule) must not change the text."""
import pytest
import torch
from megatron.core import parallel_state

from litespark_megatron.sample import sample


class CausalToy(torch.nn.Module):
    """A causal model: position t's logits depend on tokens 0..t only (a running mean of embeddings)."""

    def __init__(self, vocab: int = 50, multiple: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 16)
        self.head = torch.nn.Linear(16, vocab)
        self.multiple = multiple
        self.lengths = []

    def forward(self, tokens, positions, mask):
        assert mask is None and positions.shape == tokens.shape
        self.lengths.append(tokens.shape[1])
        if tokens.shape[1] % self.multiple:     # what Transformer Engine's FP8 GEMMs do with 2 tokens
            raise ValueError(f"FP8 execution requires ... got {tokens.shape[1]} tokens")
        x = self.embed(tokens).cumsum(1) / torch.arange(1, tokens.shape[1] + 1).view(1, -1, 1)
        return self.head(x)


class Letters:
    vocab_size = 50
    eod = 0

    def tokenize(self, text):
        return [ord(c) % 49 + 1 for c in text]

    def detokenize(self, ids):
        return "".join(chr(96 + i % 26) for i in ids)


@pytest.fixture(autouse=True)
def one_tensor_rank(monkeypatch):
    monkeypatch.setattr(parallel_state, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE", 1)


def test_padded_context_samples_the_same_text():
    plain = sample(CausalToy(), Letters(), "def ", seq_length=64, max_new_tokens=20, pad_multiple=1)
    strict = CausalToy(multiple=16)
    padded = sample(strict, Letters(), "def ", seq_length=64, max_new_tokens=20, pad_multiple=16)
    assert padded == plain and len(plain) > 0
    assert set(strict.lengths) == {16, 32}      # 4..23 tokens, each run padded up to the next multiple of 16


def test_unpadded_short_prompt_is_what_fp8_refuses():
    """The toy stands in for TE: without padding a 4-token prompt fails the way the FP8 run did."""
    with pytest.raises(ValueError, match="FP8 execution requires"):
        sample(CausalToy(multiple=16), Letters(), "def ", seq_length=64, max_new_tokens=2, pad_multiple=1)


def test_full_window_of_an_odd_sequence_length_runs_unpadded():
    toy = CausalToy()
    sample(toy, Letters(), "abcdefghij", seq_length=10, max_new_tokens=3, pad_multiple=16)
    assert toy.lengths == [10, 10, 10]      # padding to 16 would exceed the 10-token window


def test_the_continuation_is_greedy():
    """The documented sample (README, --help) is the greedy continuation: each token the argmax of the logits
    after the tokens before it, the same for every seed and TP rank."""
    toy, letters = CausalToy(), Letters()
    ids, expected = letters.tokenize("def "), []
    for _ in range(20):
        logits = toy(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0), None)[0, -1]
        token = int(logits.argmax())
        if token == letters.eod:
            break
        ids.append(token)
        expected.append(token)
    assert sample(CausalToy(), letters, "def ", seq_length=64, max_new_tokens=20, pad_multiple=1) == \
        letters.detokenize(expected)
