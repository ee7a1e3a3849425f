"""--hang-timeout-factor (litespark_megatron/watchdog.py): a step far slower than the run's median ends the run with
one line naming the rank and the step, and the stacks that show where it is stuck; waiting is not a hang."""
import sys
import time

from conftest import ROOT, child_env, free_port, run

from litespark_megatron.watchdog import WARM_UP_STEPS, StepWatchdog

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "1", "--log-interval", "1", "--eval-iters",
        "0", "--eval-interval", "100", "--train-iters", "20"]


def test_the_limit_is_the_factor_times_the_median_after_warm_up():
    dog = StepWatchdog(factor=10, min_seconds=0.5, poll_seconds=3600)  # the thread never checks here
    dog.durations.extend([0.2, 0.1, 0.3])
    assert dog.limit() == 2.0  # 10 x median 0.2
    dog.durations.clear()
    dog.durations.extend([0.01, 0.01, 0.01])
    assert dog.limit() == 0.5  # the floor
    fresh = StepWatchdog(factor=10, min_seconds=0.5, poll_seconds=3600)
    for i in range(WARM_UP_STEPS):
        fresh.step_done(i + 1)
    assert fresh.limit() is None and not fresh.durations  # warm-up steps are not the median's


def test_a_hung_step_stops_the_run_with_the_rank_and_its_stack(tmp_path):
    """Step 8 never ends (tests/hang_at_step.py sleeps in its forward): with the median step ~0.1 s, factor 5 and
    a 3 s floor, the run stops within seconds, exit 1, and the stack shows the sleeping forward."""
    started = time.time()
    proc = run([sys.executable, ROOT / "tests" / "hang_at_step.py", *MOCK, "--hang-timeout-factor", "5",
                "--hang-timeout-min-seconds", "3"], timeout=240,
               env=child_env(MASTER_PORT=free_port(), HANG_AT_STEP=8))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.time() - started < 120
    line = next(line for line in proc.stderr.splitlines() if "stopping the run as hung" in line)
    assert line.startswith("litespark-train: error: rank 0 (") and " has been in step 8 for " in line, line
    assert "x the median step (" in line and "at least 3 s" in line, line
    stacks = proc.stderr.split(line, 1)[1]
    assert 'hang_at_step.py", line' in stacks and "in forward_step" in stacks, stacks[-3000:]
