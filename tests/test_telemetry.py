"""telemetry.py: where it attaches to megatron.training (a change there must fail here), and what it writes."""
import inspect
import signal

import pytest

from conftest import WORKER_DIR, child_env, forked, free_port, ok, records, train
from litespark_megatron import telemetry


def test_megatron_training_still_calls_the_hooked_functions():
    """attach() replaces module globals of megatron.training.training that train() and pretrain() call by name;
    the wrappers pass their arguments through by position. If megatron.training renames one, stops calling it
    from its loop, or reorders training_log's first arguments, telemetry would go silent: this fails instead."""
    from megatron.training import training

    train_source = inspect.getsource(training.train)
    for name in ("training_log(", "evaluate_and_print_results(", "save_checkpoint_and_time("):
        assert name in train_source, name
    assert "= load_checkpoint(" in inspect.getsource(training.setup_model_and_optimizer)
    assert "total_loss_dict, collected_non_loss_data, timelimit = evaluate(" in \
        inspect.getsource(training.evaluate_and_print_results)
    assert "return total_loss_dict, collected_non_loss_data, False" in inspect.getsource(training.evaluate)
    assert list(inspect.signature(training.training_log).parameters)[:8] == [
        "loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale", "report_memory_flag",
        "skipped_iter", "grad_norm"]
    assert list(inspect.signature(training.save_checkpoint_and_time).parameters)[0] == "iteration"
    assert list(inspect.signature(training.evaluate_and_print_results).parameters)[0] == "prefix"
    for name in telemetry.HOOKED:
        assert callable(getattr(training, name)), name


class _Writer:
    """megatron.training's TensorBoard writer (add_scalar) and W&B run (the wandb module: log(values, step))."""

    def __init__(self):
        self.scalars = {}

    def add_scalar(self, tag, value, step):
        self.scalars[tag] = (value, step)

    def log(self, values, step):
        for tag, value in values.items():
            self.scalars[tag] = (value, step)


def _telemetry_of_last_rank(monkeypatch):
    """A Telemetry of the rank that writes (built without a run) and the writers megatron.training would hold."""
    from megatron.training import global_vars

    tensorboard, wandb = _Writer(), _Writer()
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", tensorboard)
    monkeypatch.setattr(global_vars, "_GLOBAL_WANDB_WRITER", wandb)
    t = object.__new__(telemetry.Telemetry)
    t.is_writer = True
    return t, tensorboard, wandb


RECORD = dict(tokens_per_sec=1000.0, tokens_per_sec_per_gpu=500.0, tflops_per_gpu=400.0, tflops_per_gpu_causal=380.0,
              mfu=0.4, mfu_causal=0.38, gpu_power_w=650.0, joules_per_token=0.02, energy_kwh_total=None,
              mem_max_allocated_gb=float("nan"), forward_s_max=0.12, forward_s_min=0.1, slowest_rank=1)


def test_tensorboard_tags_are_written_for_measured_values_only(monkeypatch):
    """The project's tags sit beside Megatron-LM's under litespark/; a value that was not measured (None) gets no
    point, never a number (GPU energy here comes from a GPU run's record)."""
    t, tensorboard, _ = _telemetry_of_last_rank(monkeypatch)
    t._tensorboard(7, RECORD)
    t._scalar("save-seconds", 1.5, 8)
    assert tensorboard.scalars == {
        "litespark/tokens-per-sec": (1000.0, 7), "litespark/tokens-per-sec-per-gpu": (500.0, 7),
        "litespark/tflops-per-gpu": (400.0, 7), "litespark/tflops-per-gpu-causal": (380.0, 7),
        "litespark/mfu": (0.4, 7), "litespark/mfu-causal": (0.38, 7), "litespark/gpu-power-w": (650.0, 7),
        "litespark/joules-per-token": (0.02, 7), "litespark/forward-s-max": (0.12, 7),
        "litespark/forward-s-min": (0.1, 7), "litespark/slowest-rank": (1, 7), "litespark/save-seconds": (1.5, 8)}


def test_wandb_gets_what_tensorboard_gets(monkeypatch):
    """With --wandb-project, megatron.training logs its own values to W&B under its TensorBoard tags: Litespark's
    (MFU, energy, J/token, per-rank forward times, save and load times) go there too, under theirs."""
    t, tensorboard, wandb = _telemetry_of_last_rank(monkeypatch)
    t._tensorboard(7, RECORD)
    t._scalar("save-seconds", 1.5, 8)
    assert wandb.scalars == tensorboard.scalars and "litespark/mfu" in wandb.scalars
    # Only the last rank writes, where megatron.training opened its W&B run.
    t, _, wandb = _telemetry_of_last_rank(monkeypatch)
    t.is_writer = False
    t._tensorboard(7, RECORD)
    assert wandb.scalars == {}


MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "4", "--log-interval", "2", "--eval-iters",
        "1", "--eval-interval", "2", "--save-interval", "2", "--split", "8,1,1"]


def test_metrics_file_schema(tmp_path):
    """One record per log interval, evaluation, test, save and run; every value measured or null; the intervals
    exclude evaluation and saves (their time is in their own records)."""
    ok(train(1, *MOCK, "--save", tmp_path / "run", "--peak-tflops", "1"))
    rows = records(tmp_path / "run" / "metrics.jsonl")
    assert [r["kind"] for r in rows] == ["run", "health", "train", "val", "save", "train", "val", "save", "val",
                                         "test", "run"]
    start, end = rows[0], rows[-1]
    assert start["tokens_per_step"] == 4 * 32 and start["spec"] == "litespark" and start["params"] > 0
    assert start["flops_convention"] == "standard" and start["trainable_params"] == start["params"]
    assert start["data"] == "mock data (megatron-core's MockGPTDataset)"
    train_rows = [r for r in rows if r["kind"] == "train"]
    for r in train_rows:
        assert r["steps"] == 2 and r["tokens_per_sec"] == pytest.approx(2 * 128 / (2 * r["step_time_s"]))
        assert r["mfu"] == pytest.approx(r["tflops_per_gpu"] / 1.0)  # --peak-tflops 1
        assert r["gpu_power_w"] is None and r["joules_per_token"] is None and r["num_gpus"] == 0  # CPU
        assert 0 < r["forward_s_min"] == r["forward_s_max"] < r["step_time_s"] and r["slowest_rank"] == 0
    saves = [r for r in rows if r["kind"] == "save"]
    assert all(r["seconds"] > 0 for r in saves)
    assert end["iterations"] == 4 and end["final_loss"] == train_rows[-1]["loss"]
    assert end["val_loss"] == [r for r in rows if r["kind"] == "val"][-1]["loss"]


def test_the_slowest_rank_is_named_in_every_interval(tmp_path):
    """DP2, rank 1 reads its micro-batch (one per step) 0.5 s late (tests/workers/slow_rank.py): every rank's step
    takes as long (rank 0 waits for rank 1 at the gradient reduction), but the forward times per rank name rank 1:
    its forward holds the 0.5 s, and is at least 0.25 s longer than rank 0's (whose forward of ~0.01 s was seen at
    0.19 s on a busy 2-core machine: 0.25 s of margin for that noise)."""
    metrics = tmp_path / "m.jsonl"
    ok(forked(2, WORKER_DIR / "slow_rank.py", *MOCK, "--log-interval", "1", "--eval-iters", "0",
              "--metrics-file", metrics, env=child_env(MASTER_PORT=free_port(), SLOW_RANK=1, SLOW_SECONDS=0.5)))
    rows = records(metrics, "train")[1:]  # the first step: start-up, and its first forward is not timed
    assert [r["slowest_rank"] for r in rows] == [1, 1, 1], rows
    for r in rows:
        assert r["forward_s_max"] >= 0.5 and r["forward_s_max"] - r["forward_s_min"] >= 0.25, r
        assert r["step_time_s"] >= r["forward_s_max"], r


def _killed_in_step(step, flags, metrics):
    """litespark-train SIGKILLed while its step `step` runs (tests/workers/hang_at_step.py kills itself there, the
    records of the steps before it written): a run that an OOM killer or a lost node ends mid-training."""
    proc = forked(1, WORKER_DIR / "hang_at_step.py", *flags,
                  env=child_env(MASTER_PORT=free_port(), HANG_AT_STEP=step, HANG_KILL=1))
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert step - 1 in [r["step"] for r in records(metrics, "train")], f"no record of step {step - 1}"


def test_a_restart_after_a_kill_leaves_one_record_per_step(tmp_path):
    """Killed before its first checkpoint, a run's restart trains from step 0 again: the killed run's records (its
    run record included: the restart may differ) are dropped, not left beside the new ones. Killed after one (step 3),
    the restart resumes from it: records up to 3 stay, those of later steps go."""
    save = tmp_path / "run"
    metrics = save / "metrics.jsonl"
    flags = [*MOCK, "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "3",
             "--save", save, "--load", save]
    _killed_in_step(3, flags, metrics)  # steps 1 and 2 recorded, nothing saved
    assert not (save / "latest_checkpointed_iteration.txt").exists()
    _killed_in_step(6, flags, metrics)  # from step 0 again: 1 to 5, saved at 3
    assert [r["step"] for r in records(metrics, "train")] == [1, 2, 3, 4, 5]
    assert [r["kind"] for r in records(metrics) if r["step"] == 0] == ["run"]
    ok(train(1, *flags))  # resumes from 3
    assert [r["step"] for r in records(metrics, "train")] == [1, 2, 3, 4, 5, 6]
    assert [(r["step"], r["kind"]) for r in records(metrics) if r["kind"] in ("run", "load", "save")] == [
        (0, "run"), (3, "save"), (0, "run"), (3, "load"), (6, "save"), (6, "run")]
