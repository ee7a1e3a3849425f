"""--chunked-output-loss: the output layer and the loss in chunks of the sequence under activation checkpointing
(output_loss.py). Its losses equal one process without it under CP2+TP2+SP and PP2 with virtual stages:
test_parallel_parity.py; here what the forward keeps, generation's logits, and the refusals."""
import pytest

from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError


@pytest.mark.gpu
def test_the_forward_keeps_no_logits_and_generation_gets_megatrons_logits(saved_tensors):
    """Without chunks the loss keeps the micro-batch's logits (fp32 copies in megatron-core's loss) for the
    backward; in chunks it keeps none (each chunk's are recomputed in the backward). Without labels (generation)
    the chunked path returns megatron-core's own logits."""
    assert saved_tensors["rope-gqa"]["logits_saved"] > 0
    r = saved_tensors["chunked-loss"]
    assert r["logits_saved"] == 0, r
    assert r["logits_max_diff"] == 0.0, r


@pytest.mark.parametrize("flags, message", [
    (["--chunked-output-loss", "0"], "--chunked-output-loss 0: give the number of chunks, 1 or more"),
    (["--seq-length", "32", "--chunked-output-loss", "5"],
     "--chunked-output-loss 5 does not divide the 32 sequence positions each rank holds (--seq-length / CP); use a "
     "divisor of 32"),
    (["--seq-length", "32", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--chunked-output-loss",
      "32"], "--chunked-output-loss 32 does not divide the 16 sequence positions each rank holds (--seq-length / CP "
             "/ TP under --sequence-parallel); use a divisor of 16"),
    (["--mtp-num-layers", "1", "--chunked-output-loss", "2"],
     "--chunked-output-loss with --mtp-num-layers: multi-token prediction computes its own logits; the two are not "
     "tested together, drop one"),
])
def test_chunks_that_cannot_split_the_sequence_are_refused(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        check(TINY + flags, GPU_TE)
    assert str(e.value) == message
