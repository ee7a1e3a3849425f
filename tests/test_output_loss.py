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


def _rounding_seeds(monkeypatch, dp=1, rank=0, iteration=5, seed=1234, cp_rank=0):
    """output_loss._RoundingSeeds on data-parallel rank `rank` of `dp` (context-parallel rank cp_rank) at an
    iteration of a run of --seed `seed`; the run's arguments and its rerun state machine (to move them)."""
    from types import SimpleNamespace

    import megatron.training
    from megatron.core import parallel_state, rerun_state_machine
    from litespark_megatron import output_loss

    args = SimpleNamespace(seed=seed, curr_iteration=iteration)
    machine = SimpleNamespace(state="initial run")
    monkeypatch.setattr(megatron.training, "get_args", lambda: args)
    monkeypatch.setattr(rerun_state_machine, "get_rerun_state_machine", lambda: machine)
    monkeypatch.setattr(parallel_state, "get_data_parallel_world_size", lambda: dp)
    monkeypatch.setattr(parallel_state, "get_data_parallel_rank", lambda: rank)
    monkeypatch.setattr(parallel_state, "get_context_parallel_rank", lambda: cp_rank)
    return output_loss._RoundingSeeds(), args, machine


def test_the_fp8_output_layers_rounding_seeds_follow_the_global_batch_not_the_layout(monkeypatch):
    """One seed per micro-batch: data-parallel rank r's k-th micro-batch of an iteration draws what one process's
    k x DP + r-th draws (the sampler's order); another --seed, iteration or context-parallel rank draws another;
    31 bits (the kernel's)."""
    def seeds(micro_batches, **where):
        state, _, _ = _rounding_seeds(monkeypatch, **where)
        return [state.next() for _ in range(micro_batches)]

    one = seeds(8)
    assert len(set(one)) == 8 and all(0 <= s < 2 ** 31 for s in one)
    assert seeds(4, dp=2, rank=0) == one[0::2] and seeds(4, dp=2, rank=1) == one[1::2]
    assert seeds(2, dp=4, rank=3) == one[3::4]
    assert not set(one) & set(seeds(8, iteration=6) + seeds(8, seed=1) + seeds(8, cp_rank=1))


def test_the_rounding_seeds_count_from_0_at_every_iteration_and_rerun(monkeypatch):
    """A resumed run (or one whose previous iteration ran other micro-batches: an evaluation) draws at an
    iteration what the unbroken one drew; so does megatron.training's re-run of an iteration (its rerun state
    machine's check of a NaN or a spike), as from the generators whose states it restores."""
    state, args, machine = _rounding_seeds(monkeypatch)
    first = [state.next() for _ in range(3)]
    machine.state = "rerunning in place"
    assert [state.next() for _ in range(3)] == first
    args.curr_iteration, machine.state = 6, "initial run"
    state.next()
    args.curr_iteration = 5
    assert [state.next() for _ in range(3)] == first
