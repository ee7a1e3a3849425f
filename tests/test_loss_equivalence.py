"""scripts/loss_equivalence.sh: trains every run of RUNS from the same seed and data and checks their loss curves
against the first (tools/compare_losses.py). CPU: stock megatron-core local spec vs Litespark local (the same
function, so the same curve) and a run with another learning rate (a different curve)."""
import sys

import pytest

from conftest import ROOT, child_env, records, run

SCRIPT = ROOT / "scripts" / "loss_equivalence.sh"
DATA = ["--mock-data", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "3e-3"]


def equivalence(tmp_path, *args, **knobs):
    env = child_env(MODEL="tiny", OUT_DIR=str(tmp_path / "eq"), **knobs)
    env.pop("VIRTUAL_ENV", None)
    return run(["bash", SCRIPT, *args], env=env, timeout=600)


def cpu_python(tmp_path, first: str = "") -> str:
    """A python for the script's runs that keeps them on the CPU, as the suite's CPU pass runs (conftest.py): with
    CONCURRENT the script gives each run its own GPUs (CUDA_VISIBLE_DEVICES), which on a GPU machine are real.
    `first`: shell lines run before."""
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/usr/bin/env bash\n{first}export CUDA_VISIBLE_DEVICES=\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


def test_same_function_same_curve_and_a_different_run_is_caught(tmp_path):
    proc = equivalence(tmp_path, *DATA, STEPS="8", START_STEP="2", SMOOTH="2", TOLERANCE="0.001",
                       RUNS="stock-local:--spec stock-local;litespark-local:--transformer-impl local;"
                            "other-lr:--transformer-impl local --lr 3e-2")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = (tmp_path / "eq" / "report.md").read_text()
    assert "reference: stock-local" in report
    assert "| litespark-local | 7 (2-8) |" in report and report.count("| yes |") == 1
    assert "| other-lr | 7 (2-8) |" in report and "| NO |" in report
    assert (tmp_path / "eq" / "losses.png").exists()
    for name in ("stock-local", "litespark-local", "other-lr"):
        assert (tmp_path / "eq" / name / "metrics.jsonl").exists()
    # The resolved command of each run is printed; the runs' own flags come after the shared ones and win.
    assert "--train-iters 8 --lr-warmup-iters 0 --log-interval 1" in proc.stdout      # WARMUP = STEPS / 10
    assert "--lr 3e-3 --spec stock-local --tensorboard-dir" in proc.stdout
    assert "--lr 3e-3 --transformer-impl local --lr 3e-2 --tensorboard-dir" in proc.stdout
    # KEEP_DONE=1: finished runs are kept (not retrained), and the comparison is the same.
    again = equivalence(tmp_path, *DATA, STEPS="8", START_STEP="2", SMOOTH="2", TOLERANCE="0.001", KEEP_DONE="1",
                        RUNS="stock-local:--spec stock-local;litespark-local:--transformer-impl local")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count(": kept (KEEP_DONE=1") == 2 and "python" not in again.stdout.split("reference:")[0]


def test_resume_goes_on_from_a_runs_checkpoint_and_draws_the_unbroken_curve(tmp_path):
    """RESUME=1, two runs of one function: `stopped` leaves at step 4 of 6 (--exit-interval 4: megatron.training
    saves and exits 0), so no verdict on part of a curve: exit 2 naming it. The next call keeps the finished run and
    takes `stopped` on from its checkpoint (SAVE_INTERVAL=2, the newest kept) to step 6: every loss equals the
    unbroken run's."""
    knobs = dict(STEPS="6", START_STEP="1", SMOOTH="1", TOLERANCE="0.001", SAVE_INTERVAL="2", RESUME="1",
                 RUNS="unbroken:--spec stock-local;stopped:--spec stock-local --exit-interval 4")
    first = equivalence(tmp_path, *DATA, **knobs)
    assert first.returncode == 2, first.stdout[-3000:] + first.stderr[-3000:]
    assert "error: run 'stopped' stopped at step 4 of 6" in first.stderr
    assert "with RESUME=1 the next call goes on from its last checkpoint" in first.stderr
    ckpt = tmp_path / "eq" / "stopped" / "ckpt"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000004"]  # --keep-last-checkpoints 1
    second = equivalence(tmp_path, *DATA, **knobs)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "unbroken: kept (RESUME=1" in second.stdout and "stopped: resumes from step 4" in second.stdout

    def curve(name):
        return [(r["step"], r["loss"]) for r in records(tmp_path / "eq" / name / "metrics.jsonl", "train")]

    assert curve("stopped") == curve("unbroken") and len(curve("unbroken")) == 6


@pytest.mark.parametrize("knobs, message", [
    (dict(RUNS="only:--spec stock-local"), "RUNS needs at least two runs (a reference first), got 1"),
    (dict(RUNS="a:--spec stock-local;a:--spec litespark"), "RUNS names 'a' twice"),
    (dict(RUNS="a --spec stock-local;b:"), "RUNS entry 'a --spec stock-local' is not name:flags"),
    (dict(STEPS="ten"), "STEPS='ten' must be an integer >= 1"),
    (dict(WARMUP="-3"), "WARMUP='-3' must be an integer >= 0"),
    (dict(STEPS="10", START_STEP="10"), "START_STEP=10 must be below STEPS=10"),
    (dict(SHARE_GPUS="yes"), "SHARE_GPUS='yes' must be 0 or 1"),
    (dict(STEPS="10", START_STEP="2", WARMUP="10"), "WARMUP=10 must be below STEPS=10"),
    (dict(CONCURRENT="0"), "CONCURRENT='0' must be an integer >= 1"),
    (dict(RESUME="yes"), "RESUME='yes' must be 0 or 1"),
    (dict(SAVE_INTERVAL="0"), "SAVE_INTERVAL='0' must be an integer >= 1"),
])
def test_bad_knobs_fail_before_training(tmp_path, knobs, message):
    proc = equivalence(tmp_path, *DATA, **knobs)
    assert proc.returncode == 2 and proc.stderr.strip() == f"loss_equivalence.sh: error: {message}", proc.stderr
    assert not (tmp_path / "eq").exists() or not any((tmp_path / "eq").iterdir())


@pytest.mark.parametrize("concurrent", ["1", "2"])
def test_a_failing_run_stops_the_script(tmp_path, concurrent):
    proc = equivalence(tmp_path, *DATA, STEPS="4", START_STEP="1", CONCURRENT=concurrent,
                       PYTHON=cpu_python(tmp_path),
                       RUNS="a:--transformer-impl local;b:--transformer-impl local --tensor-model-parallel-size 2")
    assert proc.returncode == 2
    assert "loss_equivalence.sh: error: run 'b' failed (log: " in proc.stderr
    assert "world size 1 is not divisible by TP" in proc.stderr
    assert 'summary: {"iterations": 4,' in (tmp_path / "eq" / "a.log").read_text()  # its wave-mate ran to the end


def test_concurrent_waves_place_each_run_on_its_own_gpus(tmp_path):
    """CONCURRENT=2, NPROC=1, three runs: two waves; in each wave run k sees GPU k only (CUDA_VISIBLE_DEVICES).
    A python wrapper records, as each run starts, its devices and how many train records the first run had logged
    by then, and keeps the run on the CPU, where the curves are the sequential ones: the first run's wave-mate waits
    for one (megatron-core's index cache), the next wave need not."""
    ref_metrics = tmp_path / "eq" / "ref" / "metrics.jsonl"
    wrapper = cpu_python(tmp_path, f"""if [ "$1 $2" = "-m litespark_megatron" ]; then
  echo "$CUDA_VISIBLE_DEVICES $(grep -cs '"kind": "train"' {ref_metrics})" >> {tmp_path / "starts.txt"}
fi
""")
    proc = equivalence(tmp_path, *DATA, STEPS="6", START_STEP="2", SMOOTH="2", TOLERANCE="0.001", CONCURRENT="2",
                       PYTHON=wrapper,
                       RUNS="ref:--spec stock-local;same:--transformer-impl local;third:--transformer-impl local")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert [line.split(" /")[0] for line in lines] == [
        "[1/3] ref: CUDA_VISIBLE_DEVICES=0", "[2/3] same: CUDA_VISIBLE_DEVICES=1", "[3/3] third: CUDA_VISIBLE_DEVICES=0"]
    starts = [line.split() for line in (tmp_path / "starts.txt").read_text().splitlines()]
    assert starts[0] == ["0"] and starts[1][0] == "1" and int(starts[1][1]) >= 1, starts    # ["0"]: no file yet
    assert starts[2] == ["0", "6"], starts         # the second wave starts after the first finished
    report = (tmp_path / "eq" / "report.md").read_text()
    assert "| same | 5 (2-6) |" in report and "| third | 5 (2-6) |" in report and report.count("| yes |") == 2


def test_shared_gpus_leave_the_devices_to_every_run(tmp_path):
    """SHARE_GPUS=1: the concurrent runs all see the devices the script was given (no CUDA_VISIBLE_DEVICES of their
    own), and the second still waits for the first's first step (the index cache)."""
    ref_metrics = tmp_path / "eq" / "ref" / "metrics.jsonl"
    wrapper = cpu_python(tmp_path, f"""if [ "$1 $2" = "-m litespark_megatron" ]; then
  echo "${{CUDA_VISIBLE_DEVICES-unset}} $(grep -cs '"kind": "train"' {ref_metrics})" >> {tmp_path / "starts.txt"}
fi
""")
    proc = equivalence(tmp_path, *DATA, STEPS="3", START_STEP="1", SMOOTH="1", CONCURRENT="2", SHARE_GPUS="1",
                       PYTHON=wrapper, CUDA_VISIBLE_DEVICES="7",
                       RUNS="ref:--spec stock-local;same:--transformer-impl local")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    assert [line.split(" /")[0] for line in lines] == ["[1/2] ref:", "[2/2] same:"]
    starts = [line.split() for line in (tmp_path / "starts.txt").read_text().splitlines()]
    assert starts[0] == ["7"] and starts[1][0] == "7" and int(starts[1][1]) >= 1, starts  # ["7"]: no file yet
