"""The suite's runs are forked from a process that imported torch and megatron-core (tests/zygote.py): a forked run
must be what a real `python -m litespark_megatron` (torchrun for more ranks) runs: the same losses, exit statuses
and messages."""
import pytest

from conftest import child_env, free_port, losses, ok, train, zygote

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "4",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100", "--seed", "7"]

pytestmark = pytest.mark.skipif(not zygote.enabled, reason="LITESPARK_TEST_FORK=0: every run is a real process")


def test_a_forked_run_trains_what_torchrun_trains(tmp_path):
    assert zygote.can_run(child_env(MASTER_PORT=free_port()))
    forked, real = tmp_path / "forked.jsonl", tmp_path / "real.jsonl"
    ok(train(2, *MOCK, "--metrics-file", forked))
    ok(train(2, *MOCK, "--metrics-file", real, launcher="process"))
    assert losses(forked) == losses(real) and len(losses(real)) == 4


@pytest.mark.parametrize("nproc, status", [(1, 2), (2, 1)])  # torchrun ends 1 when a rank fails
def test_a_forked_run_fails_as_a_process_fails(nproc, status):
    for launcher in ("fork", "process"):
        proc = train(nproc, *MOCK, "--no-such-flag", launcher=launcher)
        assert proc.returncode == status, (launcher, proc.stderr[-2000:])
        assert "litespark-train: error: unrecognized arguments: --no-such-flag" in proc.stderr, (launcher, proc.stderr)


def test_an_environment_read_at_import_gets_a_real_process():
    assert not zygote.can_run(child_env(MASTER_PORT=free_port(), TRITON_INTERPRET=1))
    assert not zygote.can_run(child_env(PYTHONPATH="elsewhere"))
    assert not zygote.can_run(child_env(LITESPARK_CPU_SHIMS="none"))
    assert zygote.can_run(child_env(MASTER_PORT=free_port(), RANK=1, LITESPARK_CACHE="elsewhere"))
