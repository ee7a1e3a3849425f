"""litespark_megatron/watchdog.py: --hang-timeout-factor (a step far slower than the run's median ends the run with
one line naming the rank and the step, and the stacks that show where it is stuck; waiting is not a hang) and
--loss-spike-factor (a loss far above the recent median warns, or stops the run before that step is saved)."""
import time

from conftest import WORKER_DIR, child_env, forked, free_port, train

from litespark_megatron.watchdog import SPIKE_MIN_HISTORY, SPIKE_WINDOW, WARM_UP_STEPS, LossSpikeGuard, StepWatchdog

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
    """Step 8 never ends (tests/workers/hang_at_step.py sleeps in its forward): with the median step ~0.1 s, factor 5
    and a 3 s floor, the run stops within seconds, exit 1, and the stack shows the sleeping forward."""
    started = time.time()
    proc = forked(1, WORKER_DIR / "hang_at_step.py", *MOCK, "--hang-timeout-factor", "5", "--hang-timeout-min-seconds",
                  "3", timeout=240, env=child_env(MASTER_PORT=free_port(), HANG_AT_STEP=8))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.time() - started < 120
    line = next(line for line in proc.stderr.splitlines() if "stopping the run as hung" in line)
    assert line.startswith("litespark-train: error: rank 0 (") and " has been in step 8 for " in line, line
    assert "x the median step (" in line and "at least 3 s" in line, line
    stacks = proc.stderr.split(line, 1)[1]
    assert 'hang_at_step.py", line' in stacks and "in forward_step" in stacks, stacks[-3000:]


def test_a_loss_spike_is_the_factor_times_the_median_of_recent_losses(capsys):
    guard = LossSpikeGuard(factor=3, action="warn")
    guard.check(1, 5.0)
    guard.check(2, 500.0)  # fewer than SPIKE_MIN_HISTORY losses before it: no reference yet
    for step in (3, 4, 5):
        guard.check(step, 5.0)
    guard.check(6, None)  # a skipped step has no loss
    guard.check(7, 15.0)  # the median of 5, 500, 5, 5, 5 is 5: 15 is 3 x, not above
    assert capsys.readouterr().out == "" and SPIKE_MIN_HISTORY == 5
    guard.check(8, 15.5)
    assert capsys.readouterr().out == ("WARNING: loss spike at step 8: 15.5 is 3.1 x the median 5 of the last 6 steps "
                                       "(--loss-spike-factor 3); training on (--loss-spike-action stop ends the run "
                                       "instead)\n")
    for step in range(SPIKE_WINDOW):
        guard.check(10 + step, 100.0)  # the window forgets: 100 becomes the median, and a spike above it warns
    guard.check(200, 301.0)
    assert "loss spike at step 200: 301 is 3.0 x the median 100 of the last 100 steps" in capsys.readouterr().out


def test_a_loss_spike_stops_the_run_before_the_step_is_saved_on_every_pipeline_stage(tmp_path):
    """Step 7's loss is 100x (the test-only fault LITESPARK_TEST_SPIKE_AT_STEP) in a PP2 run with
    --loss-spike-action stop. Rank 0, the first stage, has no loss of its own: it prints the line, so the last
    stage's loss reached it. Exit 1 with one line; the checkpoint of step 6 is the latest (the save of step 7, due by
    --save-interval, never happens). The warning of the default action: the test above."""
    save = tmp_path / "run"
    proc = train(2, *MOCK, "--pipeline-model-parallel-size", "2", "--train-iters", "8", "--save", save,
                 "--save-interval", "1", "--loss-spike-factor", "5", "--loss-spike-action", "stop",
                 env=child_env(MASTER_PORT=free_port(), LITESPARK_TEST_SPIKE_AT_STEP=7))
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("litespark-train: error: ")]
    assert len(errors) == 1, errors
    assert errors[0].startswith("litespark-train: error: loss spike at step 7: "), errors
    assert "x the median" in errors[0] and "of the last 6 steps (--loss-spike-factor 5): stopping before the step " \
        "is saved; resume from the last checkpoint with --iterations-to-skip 7" in errors[0], errors
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    assert not (save / "iter_0000007").exists()
