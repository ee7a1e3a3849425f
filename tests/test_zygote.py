"""The suite's runs are forked from a process that imported torch and megatron-core (tests/zygote.py): a forked run
must be what a real `python -m litespark_megatron` (torchrun for more ranks) runs: the same losses, exit statuses
and messages."""
import json

import pytest

from conftest import WORKER_DIR, child_env, free_port, losses, ok, tool, train, zygote

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


def test_a_tools_trainers_are_forked_from_it_and_end_as_processes_end():
    """tool(): the tool forked from the zygote starts its one-process `python -m litespark_megatron` runs forked from
    itself (the efficiency suite's variants), with their exit statuses, messages and sessions as real processes have
    them and none of the tool's buffered output; a child with another environment or program is a real process."""
    report = json.loads(ok(tool(WORKER_DIR / "starts_trainers.py", timeout=600)).stdout.strip().splitlines()[-1])
    forked = ("trains", "refused", "new session")
    assert {name: r["kind"] for name, r in report.items()} == {
        **{name: "_Forked" for name in forked}, "another environment": "Popen", "another program": "Popen"}
    assert report["trains"]["code"] == 0 and report["trains"]["trained"], report
    assert report["refused"]["code"] == 2, report
    assert report["refused"]["error"] == "litespark-train: error: unrecognized arguments: --no-such-flag", report
    assert [name for name, r in report.items() if r["own_session"]] == ["new session"]
    assert not any(r["tool_line_in_output"] for r in report.values()), report
    assert report["another environment"]["code"] == 0 and report["another program"]["code"] == 0
