"""litespark-train end to end on the CPU (gloo): megatron.training's loop with the Litespark layer. Resume is
bit-exact, checkpoints reshard across layouts, a stop signal saves and exits 0, a NaN loss stops the run, TensorBoard
holds Megatron-LM's tags and the project's, and bad input fails before any work with one line."""
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, WORKER_DIR, child_env, free_port, losses, made_once, ok, records, run, torchrun, train

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "6",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100", "--seed", "7", "--save-interval", "100"]


def test_resume_is_bit_exact_with_the_distributed_optimizer(tmp_path):
    """DP2 with megatron-core's distributed optimizer (its sharded state; the `distopt` fixes of platform.py):
    a run stopped by --exit-interval and resumed equals the run without the stop, bit for bit. One process with
    torch's Adam: test_stop_signal_saves_and_exits_0_and_resume_continues_bit_exactly."""
    layout = ["--use-distributed-optimizer"]
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    ok(train(2, *MOCK, *layout, "--save", straight))
    ok(train(2, *MOCK, *layout, "--save", halves, "--load", halves, "--exit-interval", "3"))
    assert (halves / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    resumed = ok(train(2, *MOCK, *layout, "--save", halves, "--load", halves))
    assert "successfully loaded checkpoint" in resumed.stdout
    a, b = losses(straight / "metrics.jsonl"), losses(halves / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)], (a, b)  # bit-exact, not approximate


def test_checkpoint_reshards_tp2_to_tp1_and_pp2(tmp_path):
    """A TP2 checkpoint (model, optimizer, scheduler) of step 2 resumes under TP1 and PP2 with the step-3 loss the
    TP2 run itself had (layouts differ only in summation order: 1e-5). The TP2 run trains 4 steps and saves at 2
    and 4; the resuming runs load step 2 with Megatron-LM's --ckpt-step."""
    tp2 = tmp_path / "tp2"
    flags = MOCK + ["--train-iters", "4"]
    ok(train(2, *flags, "--tensor-model-parallel-size", "2", "--save", tp2, "--save-interval", "2"))
    expected = losses(tp2 / "metrics.jsonl")[3]
    for nproc, layout, name in [(1, [], "tp1"), (2, ["--pipeline-model-parallel-size", "2"], "pp2")]:
        ok(train(nproc, *flags, *layout, "--load", tp2, "--ckpt-step", "2", "--save", tmp_path / name,
                 "--metrics-file", tmp_path / f"{name}.jsonl"))
        got = losses(tmp_path / f"{name}.jsonl")
        assert sorted(got) == [3, 4], got
        assert abs(got[3] - expected) < 1e-5, f"{name}: step-3 loss {got[3]} after resharding != {expected}"


def test_load_of_a_directory_without_a_checkpoint_is_refused(tmp_path):
    """Unlike --load of the --save directory itself (a first launch: the stop-signal test), a --load elsewhere
    without a checkpoint stays an error: a typo must not train from scratch."""
    proc = train(1, *MOCK, "--save", tmp_path / "other", "--load", tmp_path / "typo")
    assert proc.returncode == 2 and f"--load {tmp_path / 'typo'}: no checkpoint there" in proc.stderr
    assert not (tmp_path / "other").exists()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """MOCK's run of 6 steps, saved at its end; its TensorBoard events (with the tags that need flags) are in
    tb/ beside the checkpoint directory."""
    def build(directory):
        save = directory / "run"
        ok(train(1, *MOCK, "--save", save, "--tensorboard-dir", directory / "tb", "--log-throughput",
                 "--log-timers-to-tensorboard", "--peak-tflops", "1"))
        return save
    return made_once(tmp_path_factory, "trainer-saved-run", build)


def _refused_before_any_work(proc, save, line: str) -> None:
    """Exit 2 with `line` as the last line, no traceback, and the run's --save never created."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == line
    assert "Traceback" not in proc.stderr and not save.exists()


def test_load_of_another_model_is_refused_in_one_line_before_any_work(saved_run, tmp_path):
    """A checkpoint of another shape used to fail in megatron.training's loader: 67 lines of
    CheckpointingException after the process group was up and --save created. It is one line now, before both."""
    other = tmp_path / "other"
    _refused_before_any_work(
        train(1, *MOCK, "--hidden-size", "64", "--load", saved_run, "--save", other), other,
        f"litespark-train: error: --load {saved_run}: the checkpoint holds another model than these flags build "
        "(--hidden-size 128 there, 64 here); give the model flags of the run that saved it, or --use-checkpoint-args "
        "to take them from the checkpoint")


def test_a_longer_resume_names_the_schedule_flags_and_trains_with_one(saved_run, tmp_path):
    """Resumed with a larger --train-iters, megatron-core's OptimizerParamScheduler asserted in the loader ("class
    input value 64 and checkpointvalue 48 for total number of iterations do not match", a traceback); now one line
    before any work names Megatron-LM's two flags, and with one of them the run trains on to the new end."""
    longer = tmp_path / "longer"
    _refused_before_any_work(
        train(1, *MOCK, "--train-iters", "8", "--load", saved_run, "--save", longer), longer,
        f"litespark-train: error: --load {saved_run}: its learning-rate schedule is not this run's (LR decay over 48 "
        "samples there, 64 here; weight-decay increment over 48 samples there, 64 here), and megatron-core refuses to "
        "resume it so: add --override-opt_param-scheduler to follow this run's schedule from the checkpoint's step "
        "on, or --use-checkpoint-opt_param-scheduler to keep the checkpoint's")
    ok(train(1, *MOCK, "--train-iters", "8", "--load", saved_run, "--save", longer, "--override-opt_param-scheduler"))
    assert sorted(losses(longer / "metrics.jsonl")) == [7, 8]


def _wait_for_step(metrics, step, proc, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"run ended early: {proc.returncode}")
        if metrics.exists() and any(r["step"] >= step for r in records(metrics, "train")):
            return
        time.sleep(0.2)
    raise AssertionError(f"no step {step} within {timeout} s")


def test_stop_signal_saves_and_exits_0_and_resume_continues_bit_exactly(tmp_path):
    """--exit-signal-handler (megatron.training's): a stop signal during training saves a checkpoint at the next
    step and exits 0; the same command again continues exactly where a run without the interruption would be. It is
    one requeue-able command, as in Megatron-LM: --save X --load X trains from scratch while X holds no checkpoint,
    and resumes once it does. The signal here is Ctrl-C's: SIGINT to the run's process group (its data-loader
    workers included, which must live on until the save), handled as megatron.training's SIGTERM (test_launcher
    sends SIGTERM to the workers of a two-rank run)."""
    flags = MOCK + ["--train-iters", "40"]
    straight = tmp_path / "straight"
    first = ok(train(1, *flags, "--save", straight))
    # What ran, observed on the first step: one line on the console and a "health" record for the tools.
    assert "what ran: attention torch SDPA FlashAttention (CPU); fused: cross-entropy off, RoPE unfused, " \
           "wgrad-accumulation off" in first.stdout
    assert [r["degraded"] for r in records(straight / "metrics.jsonl", "health")] == [[]]
    interrupted = tmp_path / "interrupted"
    requeueable = [*map(str, flags), "--save", str(interrupted), "--load", str(interrupted), "--exit-signal-handler"]
    cmd = [sys.executable, "-m", "litespark_megatron", *requeueable]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=child_env(MASTER_PORT=free_port()), start_new_session=True)
    _wait_for_step(interrupted / "metrics.jsonl", 2, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    saved = int((interrupted / "latest_checkpointed_iteration.txt").read_text())
    assert 2 <= saved < 40 and "exiting program after receiving SIGTERM" in out and "KeyboardInterrupt" not in err
    assert out.count(CTRL_C_LINE) == 1, out[-3000:]  # the trainer's, not its data-loader workers' too
    resumed = ok(train(1, *requeueable))
    assert "successfully loaded checkpoint" in resumed.stdout
    a, b = losses(straight / "metrics.jsonl"), losses(interrupted / "metrics.jsonl")
    # Both launches append to one metrics.jsonl: each step once, then bit-exact equality, not approximate.
    assert [r["step"] for r in records(interrupted / "metrics.jsonl", "train")] == list(range(1, 41))
    assert [b[s] for s in range(1, 41)] == [a[s] for s in range(1, 41)], (a, b)


def test_the_forward_step_takes_no_schedule_plan_request():
    """megatron-core asks the forward step for the model's schedule plan (return_schedule_plan=True) only under
    --overlap-moe-expert-parallel-comm, which is refused (test_arguments); the step took and ignored it, and
    returned the output where a plan was expected."""
    from litespark_megatron import pretrain

    with pytest.raises(TypeError, match="return_schedule_plan"):
        pretrain.forward_step(iter([]), None, return_schedule_plan=True)


CTRL_C_LINE = ("litespark-train: Ctrl-C (SIGINT): stopping as on SIGTERM (--exit-signal-handler): a checkpoint at "
               "the next step, then exit")


def test_ctrl_c_says_what_it_is_before_megatron_training_logs_its_exit_signal(py):
    """megatron.training's exit line names SIGTERM whatever stopped the run; Ctrl-C, re-sent as the exit signal, says
    first what it was, once: in the trainer, not in its forked data-loader workers (which inherit the handler). With
    a --save and without: both in one process (the handler is installed again for each)."""
    proc = py("-c", """if True:
        import os, signal, time
        from litespark_megatron import pretrain
        for saves in (True, False):
            got = []
            signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
            pretrain._ctrl_c_like(signal.SIGUSR1, saves=saves)
            worker = os.fork()
            if worker == 0:
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.5)
                os._exit(0 if got == [signal.SIGUSR1] else 3)
            worker_stopped = os.waitpid(worker, 0)[1] == 0
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
            print(worker_stopped, got == [signal.SIGUSR1], flush=True)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = "litespark-train: Ctrl-C (SIGINT): stopping as on SIGUSR1 (--exit-signal-handler)"
    assert proc.stdout.splitlines() == [f"{line}: a checkpoint at the next step, then exit", "True True",
                                        f"{line} at the next step, then exit", "True True"]


def test_a_schedulers_sigterm_to_every_process_saves_and_exits_0(tmp_path):
    """SLURM (at a time limit, on scancel) signals every process of a job step, not only the trainers: the
    checkpoint writer's helper processes too (megatron-core's results-queue Manager, started by the first save).
    Killed by that SIGTERM, they would fail the save the signal asks for ("Broken pipe"); they ignore it and end
    with the trainer instead. The run saves at the next step after the signal and exits 0."""
    save = tmp_path / "run"
    cmd = [sys.executable, "-m", "litespark_megatron", *map(str, MOCK), "--train-iters", "200", "--save-interval",
           "2", "--save", str(save), "--exit-signal-handler"]
    with open(tmp_path / "out", "w") as stdout, open(tmp_path / "err", "w") as stderr:  # a save a step: too much
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, cwd=ROOT,  # for an unread pipe
                                env=child_env(MASTER_PORT=free_port()), start_new_session=True)
        try:
            _wait_for_step(save / "metrics.jsonl", 3, proc)  # step 2 saved: the helpers are running
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    out, err = (tmp_path / "out").read_text(), (tmp_path / "err").read_text()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "exiting program after receiving SIGTERM" in out and "litespark-train: error" not in err
    assert 3 <= int((save / "latest_checkpointed_iteration.txt").read_text()) < 200


@pytest.mark.parametrize("stop", [[], ["--exit-interval", "2"]], ids=["trained", "stopped"])
def test_a_run_that_ended_well_leaves_its_process_groups(tmp_path, stop):
    """Every rank of a run that trained to the end, or that megatron.training stopped (sys.exit(0) at
    --exit-interval), destroys its process groups together before exit: left to the interpreter's teardown, gloo's
    threads raced the peers that had exited and a finished rank could abort (SIGABRT; seen in about 1 of 30
    four-rank runs)."""
    proc = torchrun(2, WORKER_DIR / "groups_after_exit.py", *MOCK, "--train-iters", "3", *stop,
                    env=child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("GROUPS OPEN AFTER EXIT: False") == 2, proc.stdout[-3000:]


def test_exit_duration_saves_on_every_rank_at_one_step_and_exits_0(tmp_path):
    """--exit-duration-in-mins 1 (megatron.training's): rank 1 started a minute early (tests/workers/started_earlier.py
    moves its start back). megatron.training takes the earliest start of all ranks and reduces the decision over
    them, so both ranks stop after the same step (the first), save it, and the run exits 0; the same command without
    the limit resumes from it."""
    save = tmp_path / "run"
    flags = [*MOCK, "--train-iters", "40", "--save", save, "--load", save, "--exit-duration-in-mins", "1"]
    proc = torchrun(2, WORKER_DIR / "started_earlier.py", *flags,
                    env=child_env(EARLIER_RANK=1, EARLIER_SECONDS=61))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "exiting program after" in proc.stdout
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    resumed = ok(train(2, *flags[:-2], "--exit-interval", "3"))
    assert "successfully loaded checkpoint" in resumed.stdout
    assert [r["step"] for r in records(save / "metrics.jsonl", "train")] == [1, 2, 3]


def test_nan_loss_stops_the_run(tmp_path):
    """A NaN loss at step 3 (the test-only fault LITESPARK_TEST_NAN_AT_STEP) is caught by megatron.training's
    check (the rerun state machine re-runs the step, sees the same NaN, calls it reproducible): the run stops before
    step 3 is applied, saves the state of step 2 for the re-run on another node and exits 16, with one line naming
    the step, the rank and the value. That checkpoint holds no NaN: resumed (--rerun-mode disabled: this machine
    is the same node), steps 3-6 train to finite losses."""
    save = tmp_path / "run"
    proc = train(1, *MOCK, "--save", save, "--load", save,
                 env=child_env(MASTER_PORT=free_port(), LITESPARK_TEST_NAN_AT_STEP=3))
    assert proc.returncode == 16, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("litespark-train: error: ")]
    assert errors == [f"litespark-train: error: step 3: found NaN in local forward loss calculation (rank 0, value "
                      f"nan); the step was not applied, the checkpoint of step 2 in {save} holds the state before "
                      "it: resumed on another node, megatron.training re-runs the step there to tell a faulty GPU "
                      "from the data; --rerun-mode disabled resumes it anywhere; exit 16"], errors
    assert sorted(losses(save / "metrics.jsonl")) == [1, 2]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    ok(train(1, *MOCK, "--save", save, "--load", save, "--rerun-mode", "disabled"))
    resumed = losses(save / "metrics.jsonl")
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] and all(math.isfinite(v) for v in resumed.values()), resumed


def test_nan_loss_without_save_stops_the_run_in_one_line(tmp_path):
    """The same NaN in a run without --save: megatron.training's rerun state machine still asks for a checkpoint
    (megatron-core 0.19.2 then fails joining None into a path, a traceback); the run saves nothing, and stops with
    exit 16 and the one line, which says no checkpoint holds the state."""
    proc = train(1, *MOCK, env=child_env(MASTER_PORT=free_port(), LITESPARK_TEST_NAN_AT_STEP=3))
    assert proc.returncode == 16, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("litespark-train: error: ")]
    assert errors == ["litespark-train: error: step 3: found NaN in local forward loss calculation (rank 0, value "
                      "nan); the step was not applied, no checkpoint holds it; exit 16"], errors


def test_tensorboard_holds_megatron_lm_tags_and_litespark_tags(saved_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = saved_run.parent / "tb"
    events = EventAccumulator(str(tb), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "grad-norm", "throughput"} <= scalars, scalars
    assert {"litespark/mfu", "litespark/mfu-causal", "litespark/tokens-per-sec", "litespark/tflops-per-gpu",
            "litespark/forward-s-max", "litespark/forward-s-min", "litespark/slowest-rank"} <= scalars, scalars
    assert "litespark/health/text_summary" in events.Tags()["tensors"]


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Three short documents, tokenized with a 300-token BPE trained on them (tools/preprocess_data.py)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20}) + "\n"
                            for i in range(3)))
    proc = run([sys.executable, "tools/preprocess_data.py", "--input", docs, "--output-prefix", root / "d",
                "--train-tokenizer-vocab-size", "300"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "d"


DATA = ["--model", "tiny", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "1", "--eval-interval", "2",
        "--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--split", "1,1,1"]  # one document each


@pytest.mark.parametrize("flags, message", [
    (lambda c: ["--data-path", str(c) + "_missing"], "missing data prefix"),
    (lambda c: ["--data-path", str(c), "--split", "98,1,1"], "--split 98,1,1 gives the"),
    (lambda c: [], "no data: give --data-path"),
    (lambda c: ["--data-path", str(c), "--batch-size", "4"],
     "Megatron-LM refuses these arguments: --batch-size argument is no longer valid"),
    (lambda c: ["--data-path", str(c), "--vocab-size", "200"], "but the tokenizer has 200 ids (0 to 199): the data "
     "was tokenized with another tokenizer; give the data's tokenizer (for NullTokenizer, a --vocab-size above the "
     "largest id)"),
], ids=["missing-prefix", "empty-split-part", "no-data", "megatron-assert", "token-id-out-of-range"])
def test_bad_input_is_refused_before_work(small_corpus, tmp_path, flags, message):
    save = tmp_path / "save"
    proc = train(1, *DATA, *flags(small_corpus), "--save", save, "--save-interval", "5")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("litespark-train: error: ") and message in last, last
    assert "Traceback" not in proc.stderr
    assert not save.exists(), "a refused run must not create its --save directory"


def test_trains_on_preprocessed_data_and_records_validation(small_corpus, tmp_path):
    metrics = tmp_path / "m.jsonl"
    ok(train(1, *DATA, "--data-path", small_corpus, "--log-interval", "1", "--metrics-file", metrics))
    assert sorted(losses(metrics)) == [1, 2]
    assert 1 < records(metrics, "val")[0]["ppl"] < 1000


def test_corrupt_index_is_refused(small_corpus, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copy(str(small_corpus) + ".bin", str(bad) + ".bin")
    idx = open(str(small_corpus) + ".idx", "rb").read()
    open(str(bad) + ".idx", "wb").write(idx[: len(idx) // 2])
    proc = train(1, *DATA, "--data-path", bad)
    assert proc.returncode == 2 and f"{bad}.idx" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_fp16_loss_scaling_skips_and_counts_overflow_steps(tmp_path):
    """fp16 starts at Megatron-LM's loss scale 2^32: the first steps overflow, are skipped (no update), counted and
    logged, and the dynamic scaler backs off until steps go through."""
    metrics = tmp_path / "m.jsonl"
    ok(train(1, *MOCK, "--fp16", "--train-iters", "40", "--log-interval", "4", "--metrics-file", metrics))
    rows = records(metrics, "train")
    skipped = [r["skipped_in_interval"] for r in rows]
    scales = [r["loss_scale"] for r in rows]
    assert skipped[0] > 0 and skipped[-1] == 0, skipped
    assert scales == sorted(scales, reverse=True) and scales[-1] < 2.0 ** 32, scales
    assert rows[-1]["loss"] is not None and rows[-1]["loss"] < 10


def test_fp16_steps_skipped_in_a_row_stop_the_run_at_the_limit(tmp_path):
    """--max-skipped-steps 3: the first steps of fp16 at a loss scale of 2^32 overflow one after another (the test
    above), so the run stops at step 3 with one line, exit 1, and no checkpoint."""
    save = tmp_path / "run"
    proc = train(1, *MOCK, "--fp16", "--train-iters", "40", "--max-skipped-steps", "3", "--save", save)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "litespark-train: error: 3 steps in a row (up to step 3) were skipped for inf/NaN gradients "
        "(--max-skipped-steps 3): the loss scale cannot recover; lower --lr or --initial-loss-scale, or train in "
        "bf16")
    assert not (save / "latest_checkpointed_iteration.txt").exists()


def test_data_seed_keeps_the_data_order_of_another_model_seed(small_corpus, tmp_path):
    """--data-seed (the efficiency suite's repeats): runs with other --seed values and the same --data-seed build
    the same shuffled dataset. megatron-core caches a dataset's shuffle indices under a hash of its configuration,
    the seed included: the second run finds every index file of the first and writes none of its own (were
    --data-seed ignored, its --seed 2 would write another set)."""
    cache = tmp_path / "cache"
    ok(train(1, *DATA, "--data-path", small_corpus, "--data-cache-path", cache, "--seed", "1", "--data-seed", "7"))
    first = sorted(p.name for p in cache.rglob("*") if p.is_file())
    ok(train(1, *DATA, "--data-path", small_corpus, "--data-cache-path", cache, "--seed", "2", "--data-seed", "7"))
    assert first and sorted(p.name for p in cache.rglob("*") if p.is_file()) == first
