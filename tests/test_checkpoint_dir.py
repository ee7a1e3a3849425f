"""The --save directory survives what happens to runs (litespark_megatron/checkpoint_dir.py): a save killed half-way
is removed at the next start and the run resumes from the checkpoint before it, --keep-last-checkpoints keeps the
newest complete ones, a complete checkpoint is not rewritten in place, and a second run on a directory in use is
refused before it writes anything."""
import fcntl
import os
import re
import signal
import sys
import time

from conftest import ROOT, child_env, free_port, ok, records, run, running, torchrun, train

from litespark_megatron import checkpoint_dir

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters",
        "0", "--eval-interval", "100", "--seed", "7"]


def test_megatron_training_still_saves_through_the_wrapped_functions():
    """attach() replaces two module globals of megatron.training.training that train() calls by name, and the
    tracker is megatron's file: a rename there must fail here, not leave the directory unguarded."""
    import inspect

    from megatron.training import checkpointing, training

    train_source = inspect.getsource(training.train)
    for name in ("save_checkpoint_and_time(", "maybe_finalize_async_save(", "checkpoint_and_decide_exit("):
        assert name in train_source, name
    assert "save_checkpoint_and_time(" in inspect.getsource(training.checkpoint_and_decide_exit)
    assert checkpointing.get_checkpoint_tracker_filename("d") == "d/latest_checkpointed_iteration.txt"
    assert checkpointing.get_checkpoint_name("d", 7, return_base_dir=True) == "d/iter_0000007"


def _fake_save_dir(root, iterations, tracker):
    root.mkdir()
    for i in iterations:
        (root / f"iter_{i:07d}").mkdir()
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return str(root)


def test_complete_and_unfinished_are_decided_by_the_tracker(tmp_path):
    d = _fake_save_dir(tmp_path / "a", [2, 4, 6, 8], tracker=6)
    assert checkpoint_dir.unfinished(d) == [8]  # newer than the tracker: its save never completed
    assert checkpoint_dir.superseded(d, keep=2) == [2]  # never the tracker's (6), never one newer than it (8)
    assert checkpoint_dir.superseded(d, keep=5) == []
    d = _fake_save_dir(tmp_path / "b", [2], tracker=None)
    assert checkpoint_dir.unfinished(d) == [2] and checkpoint_dir.superseded(d, keep=1) == []
    d = _fake_save_dir(tmp_path / "c", [], tracker="release")
    assert checkpoint_dir.tracked_iteration(d) == 0 and checkpoint_dir.unfinished(d) == []


def test_killed_save_is_removed_and_the_run_resumes_from_the_one_before(tmp_path):
    """SIGKILL in the middle of saving iteration 4 (tests/kill_in_save.py) leaves iter_0000004 half-written and the
    tracker at 2. The same command again removes it with one line, resumes from 2, trains to 7 and keeps only the
    newest checkpoint; once more, at the end already, it does not rewrite iter_0000007 in place (7 is not a multiple
    of --save-interval, so megatron.training would save it again at the end)."""
    save = tmp_path / "run"
    flags = [*MOCK, "--train-iters", "7", "--save-interval", "2", "--save", save, "--load", save,
             "--keep-last-checkpoints", "1"]
    killed = run([sys.executable, ROOT / "tests" / "kill_in_save.py", *flags],
                 env=child_env(MASTER_PORT=free_port(), KILL_IN_SAVE_AT=4))
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (save / "iter_0000004" / "__0_0.distcp").exists()
    # Its helper processes (the checkpoint writer's queue manager, data-loader workers) ended with it.
    children = [int(pid) for pid in (save / "iter_0000004" / "children").read_text().split()]
    assert len(children) >= 2, children
    deadline = time.time() + 10
    while any(map(running, children)) and time.time() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in children if running(pid)], "helpers outlived the killed trainer"

    resumed = ok(train(1, *flags))
    assert f"litespark-train: removing {save / 'iter_0000004'}: a save that did not finish (the tracker names " \
           "iteration 2)" in resumed.stdout
    assert "successfully loaded checkpoint" in resumed.stdout
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000007"]  # keep 1: 2, 4 and 6 are gone
    # Steps 3 and 4 ran before the kill and again from the step-2 checkpoint: metrics.jsonl has each step once.
    steps = [r["step"] for r in records(save / "metrics.jsonl", "train")]
    assert steps == [1, 2, 3, 4, 5, 6, 7], steps
    assert [r["step"] for r in records(save / "metrics.jsonl", "load")] == [2]  # its load time, at step 2

    metadata = save / "iter_0000007" / ".metadata"
    before = metadata.stat().st_mtime_ns
    again = ok(train(1, *flags))
    assert f"iteration 7 is already saved in {save / 'iter_0000007'} (this run loaded it and trained no step " \
           "since): not saving it again" in again.stdout
    assert metadata.stat().st_mtime_ns == before


def test_a_failed_save_is_one_line_and_the_previous_checkpoint_stays(tmp_path):
    """The filesystem fills up while iteration 4 is written (tests/disk_full_in_save.py fails megatron-core's writer
    with ENOSPC mid-file): one line on stderr instead of every rank's traceback, exit 1, the tracker at 2."""
    save = tmp_path / "run"
    proc = run([sys.executable, ROOT / "tests" / "disk_full_in_save.py", *MOCK, "--train-iters", "6",
                "--save-interval", "2", "--save", save], env=child_env(MASTER_PORT=free_port(), DISK_FULL_AT=4))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"litespark-train: error: saving iteration 4 to {save} failed (") and last.endswith(
        " GB free there); the checkpoint of iteration 2 stays the latest: fix the storage and start the same "
        "command again to resume from it"), last
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_a_save_that_fails_on_one_rank_alone_is_said_by_that_rank(tmp_path):
    """Rank 1's save fails before the save's first collective (tests/helper_dies_on_one_rank.py: the writer's
    results-queue helper dies at birth there, as a scheduler's signal once made it): rank 1 says why in one line
    naming itself; rank 0, whose save then loses its peer, says its own. Before, only rank 0 spoke, of the lost
    connection: the cause was in no log."""
    save = tmp_path / "run"
    proc = torchrun(2, ROOT / "tests" / "helper_dies_on_one_rank.py", *MOCK, "--train-iters", "4",
                    "--save-interval", "2", "--save", save, env=child_env(HELPER_DIES_ON_RANK=1))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    said = [line for line in proc.stderr.splitlines() if line.startswith("litespark-train: error: ")]
    rank1 = [line for line in said if line.startswith("litespark-train: error: rank 1: ")]
    assert len(rank1) == 1, said
    assert re.fullmatch(rf"litespark-train: error: rank 1: saving iteration 2 to {re.escape(str(save))} failed "
                        r"\(EOFError: the manager's helper process exited before it answered; [\d.]+ GB free there\); "
                        r"no checkpoint is complete yet: fix the storage and start again", rank1[0]), said
    assert all(line.startswith(f"litespark-train: error: saving iteration 2 to {save} failed (")
               for line in said if line not in rank1) and len(said) <= 2, said  # rank 0's own line, if it had time
    assert not (save / "latest_checkpointed_iteration.txt").exists()


def test_a_second_run_on_a_locked_save_directory_is_refused(tmp_path):
    """Another process holds --save's lock (as a running training does): the run is refused with one line naming
    the holder, exit 2, and the directory is as it was."""
    save = tmp_path / "busy"
    save.mkdir()
    fd = os.open(save / checkpoint_dir.LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, b"host node7, pid 4242, since 2026-11-24 01:00:00\n")
    try:
        proc = train(1, *MOCK, "--train-iters", "3", "--save", save, "--save-interval", "3")
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"litespark-train: error: --save {save} is in use by another run (host node7, pid 4242, since 2026-11-24 "
        "01:00:00): two runs must not write one checkpoint directory; wait for that run to end, or give this one "
        "another --save")
    assert sorted(p.name for p in save.iterdir()) == [checkpoint_dir.LOCK_NAME]
    # Released (the holder ended): the same command trains.
    ok(train(1, *MOCK, "--train-iters", "3", "--save", save, "--save-interval", "3"))
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
