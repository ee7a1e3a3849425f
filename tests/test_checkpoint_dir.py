"""The --save directory survives what happens to runs (litespark_megatron/checkpoint_dir.py): a save killed half-way
is removed at the next start and the run resumes from the checkpoint before it, --keep-last-checkpoints keeps the
newest complete ones, a complete checkpoint is not rewritten in place, a failed save says why and how to go on, and
a second run on a directory in use, a run that would overwrite checkpoints it did not load and a --save that cannot
be a directory are refused before they write anything."""
import fcntl
import os
import re
import signal
import time

from conftest import WORKER_DIR, child_env, forked, free_port, ok, records, running, train

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
    # A checkpoint is complete when its metadata.json is there: megatron-core writes it after every rank's shards
    # (for an async save, in the finalization), and megatron.training moves the tracker after that.
    from megatron.core.dist_checkpointing import core, serialization

    assert core.CONFIG_FNAME == "metadata.json"
    save = inspect.getsource(serialization.save)
    assert save.index("sharded_strategy.save(") < save.index("metadata_finalize_fn()", save.index(
        "sharded_strategy.save(")) and "async_request.finalize_fns.append(metadata_finalize_fn)" in save


def _fake_save_dir(root, iterations, tracker, unfinished=()):
    """A --save directory as megatron.training leaves it: `iterations` complete (their metadata.json, the file
    megatron-core writes once a torch_dist save has finished), `unfinished` with a shard and nothing else."""
    root.mkdir()
    for i in iterations:
        (root / f"iter_{i:07d}").mkdir()
        (root / f"iter_{i:07d}" / "__0_0.distcp").write_bytes(b"shard")
        (root / f"iter_{i:07d}" / "metadata.json").write_text('{"sharded_backend": "torch_dist", '
                                                              '"sharded_backend_version": 1}')
    for i in unfinished:
        (root / f"iter_{i:07d}").mkdir()
        (root / f"iter_{i:07d}" / "__0_0.distcp").write_bytes(b"the first bytes")
    if tracker is not None:
        (root / "latest_checkpointed_iteration.txt").write_text(str(tracker))
    return str(root)


def _listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_complete_and_unfinished_are_decided_by_what_a_finished_save_writes(tmp_path):
    d = _fake_save_dir(tmp_path / "a", [2, 4, 6], tracker=6, unfinished=[8])
    assert checkpoint_dir.unfinished(d) == [8]  # no metadata.json: its save never completed
    assert checkpoint_dir.superseded(d, keep=2) == [2]  # never the tracker's (6), never one newer than it (8)
    assert checkpoint_dir.superseded(d, keep=5) == []
    d = _fake_save_dir(tmp_path / "b", [], tracker=None, unfinished=[2])
    assert checkpoint_dir.unfinished(d) == [2] and checkpoint_dir.superseded(d, keep=1) == []
    d = _fake_save_dir(tmp_path / "c", [], tracker="release")
    assert checkpoint_dir.tracked_iteration(d) == 0 and checkpoint_dir.unfinished(d) == []
    # A tracker moved back (a run that trained from scratch into a directory of a longer run, before such a start
    # was refused): iteration 10 is newer than the tracker, and complete. It is no unfinished save.
    d = _fake_save_dir(tmp_path / "d", [5, 10], tracker=5)
    assert checkpoint_dir.unfinished(d) == [] and checkpoint_dir.superseded(d, keep=1) == []
    # A metadata.json cut short (killed while megatron-core wrote it) is no finished save.
    (tmp_path / "d" / "iter_0000010" / "metadata.json").write_text('{"sharded_ba')
    assert checkpoint_dir.unfinished(d) == [10]
    # Megatron-LM's legacy format writes no such file: the tracker is the only line there.
    e = tmp_path / "e"
    for i in (2, 4):
        (e / f"iter_{i:07d}" / "mp_rank_00").mkdir(parents=True)
        (e / f"iter_{i:07d}" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"state")
    (e / "latest_checkpointed_iteration.txt").write_text("2")
    assert checkpoint_dir.unfinished(str(e), ckpt_format="torch") == [4]


def _args(save, **flags):
    """The arguments checkpoint_dir reads, as megatron.training's parser leaves them unless given."""
    from types import SimpleNamespace

    defaults = dict(load=None, finetune=False, no_load_optim=False, ckpt_step=None, ckpt_format="torch_dist",
                    keep_last_checkpoints=None)
    return SimpleNamespace(save=str(save), **{**defaults, **flags})


def _refused(args) -> str:
    import pytest

    with pytest.raises(checkpoint_dir.ConfigError) as refused:
        checkpoint_dir.clean(args)
    return str(refused.value)


def test_a_start_that_would_overwrite_checkpoints_it_did_not_load_is_refused(tmp_path):
    """A run writes iter_N of every iteration it saves, in place, and moves the tracker to it: one that did not load
    the checkpoints of its --save directory would overwrite them (and before, the next start removed the newer
    ones as unfinished). Refused with one line; the directory is as it was."""
    x = tmp_path / "x"
    _fake_save_dir(x, [2, 4], tracker=4, unfinished=[6])
    before = _listing(x)
    assert _refused(_args(x)) == (
        f"--save {x} holds checkpoints (the newest: iteration 4) that this run does not load: its saves would "
        f"replace them; add --load {x} to continue from them, or give this run another --save")
    y = _fake_save_dir(tmp_path / "y", [8], tracker=8)
    assert _refused(_args(x, load=y)) == (
        f"--save {x} holds checkpoints (the newest: iteration 4) and this run loads --load {y}: its saves would "
        f"replace them; --load {x} continues from them, or give this run another --save")
    # Loaded, but from an iteration before some of them: those would be overwritten.
    assert _refused(_args(x, load=str(x), ckpt_step=2)) == (
        f"--save {x} holds complete checkpoints newer than iteration 2, where this run starts (--ckpt-step 2): "
        "iteration 4; its saves would overwrite them: give this run another --save")
    assert _refused(_args(x, load=str(x), finetune=True)) == (
        f"--save {x} holds complete checkpoints newer than iteration 0, where this run starts (--finetune): "
        "iterations 2, 4; its saves would overwrite them: give this run another --save")
    assert _listing(x) == before
    # A directory whose tracker a from-scratch run moved back: the newer complete checkpoint stays, and the
    # plain resume, which would start from the tracker's, is refused with the way to the newest.
    z = tmp_path / "z"
    _fake_save_dir(z, [5, 10], tracker=5)
    assert _refused(_args(z, load=str(z))) == (
        f"--save {z} holds complete checkpoints newer than iteration 5, where this run starts (the tracker's): "
        "iteration 10; its saves would overwrite them: --ckpt-step 10 continues from the newest, or give this run "
        "another --save")
    assert (z / "iter_0000010" / "metadata.json").exists()


def test_a_start_that_loads_its_save_directory_or_finds_no_checkpoint_there_goes_on(tmp_path):
    x = tmp_path / "x"
    _fake_save_dir(x, [2, 4], tracker=4, unfinished=[6])
    checkpoint_dir.clean(_args(x, load=str(x) + "/", no_load_optim=True))  # the same directory, spelled otherwise
    assert sorted(p.name for p in x.glob("iter_*")) == ["iter_0000002", "iter_0000004"]  # 6: unfinished, removed
    checkpoint_dir.clean(_args(x, load=str(x), ckpt_step=4))
    checkpoint_dir.clean(_args(x, load=str(x)))
    # Nothing complete there: a start without --load (unfinished saves go).
    y = tmp_path / "y"
    _fake_save_dir(y, [], tracker=None, unfinished=[2])
    checkpoint_dir.clean(_args(y))
    assert not list(y.glob("iter_*"))
    # An imported (release) checkpoint: --finetune from it starts at iteration 0 and overwrites nothing.
    r = tmp_path / "r"
    _fake_save_dir(r, [], tracker="release")
    (r / "release").mkdir()
    checkpoint_dir.clean(_args(r, load=str(r), finetune=True))
    assert _refused(_args(r)) == (
        f"--save {r} holds checkpoints (a release checkpoint) that this run does not load: its saves would "
        f"replace them; add --load {r} to continue from them, or give this run another --save")


def test_killed_save_is_removed_and_the_run_resumes_from_the_one_before(tmp_path):
    """SIGKILL in the middle of saving iteration 4 (tests/workers/kill_in_save.py) leaves iter_0000004 half-written
    and the tracker at 2. The same command again removes it with one line, resumes from 2, trains to 7 and keeps only
    the newest checkpoint; once more, at the end already, it does not rewrite iter_0000007 in place (7 is not a multiple
    of --save-interval, so megatron.training would save it again at the end)."""
    save = tmp_path / "run"
    flags = [*MOCK, "--train-iters", "7", "--save-interval", "2", "--save", save, "--load", save,
             "--keep-last-checkpoints", "1"]
    killed = forked(1, WORKER_DIR / "kill_in_save.py", *flags,
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


def test_a_run_that_does_not_load_its_save_directory_leaves_the_checkpoints_there(tmp_path):
    """`--save X --load X` trains 4 of 6 steps (checkpoints 2 and 4). `--save X` alone trained from scratch, rewrote
    iter_0000002 in place and moved the tracker back to 2; the next `--save X --load X` then removed iteration 4 as
    a save that did not finish. Now that start is refused with one line before it writes anything, and the third
    resumes from 4."""
    save = tmp_path / "ow"
    flags = [*MOCK, "--train-iters", "6", "--save-interval", "2", "--save", save]
    ok(train(1, *flags, "--load", save, "--exit-interval", "4"))
    saved = {p: p.stat().st_mtime_ns for p in save.glob("iter_*/*")}
    proc = train(1, *flags)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"litespark-train: error: --save {save} holds checkpoints (the newest: iteration 4) that this run does not "
        f"load: its saves would replace them; add --load {save} to continue from them, or give this run another "
        "--save")
    assert {p: p.stat().st_mtime_ns for p in save.glob("iter_*/*")} == saved
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    resumed = ok(train(1, *flags, "--load", save))
    assert "successfully loaded checkpoint" in resumed.stdout and "removing" not in resumed.stdout
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000004", "iter_0000006"]
    assert [r["step"] for r in records(save / "metrics.jsonl", "train")] == [1, 2, 3, 4, 5, 6]


def test_a_failed_save_is_one_line_and_the_previous_checkpoint_stays(tmp_path):
    """The filesystem fills up while iteration 4 is written (tests/workers/disk_full_in_save.py fails megatron-core's
    writer with ENOSPC mid-file): one line on stderr naming the cause instead of every rank's traceback, exit 1, the
    tracker at 2. The run had no --load: the same command would not resume, the line says how to."""
    save = tmp_path / "run"
    proc = forked(1, WORKER_DIR / "disk_full_in_save.py", *MOCK, "--train-iters", "6", "--save-interval", "2",
                  "--save", save, env=child_env(MASTER_PORT=free_port(), DISK_FULL_AT=4))
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"litespark-train: error: saving iteration 4 to {re.escape(str(save))} failed \(No space "
                        rf"left on device: {re.escape(str(save / 'iter_0000004' / '__0_0.distcp'))}; [\d.]+ GB free "
                        rf"there\); the checkpoint of iteration 2 stays the latest: free space there, then resume "
                        rf"from it with --load {re.escape(str(save))}", last), last
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_a_failed_saves_line_says_how_to_go_on_for_the_command_that_ran(tmp_path, capsys):
    import errno

    import pytest

    x = _fake_save_dir(tmp_path / "x", [2], tracker=2)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{x}/iter_0000004/__0_0.distcp")
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), f"{x}/iter_0000004")
    empty = _fake_save_dir(tmp_path / "empty", [], tracker=None)
    for error, args, then in [
            (full, _args(x, load=x), "the checkpoint of iteration 2 stays the latest: free space there, then start "
                                     "the same command again to resume from it"),
            (full, _args(x), f"the checkpoint of iteration 2 stays the latest: free space there, then resume from "
                             f"it with --load {x}"),
            (denied, _args(x, load=x), "the checkpoint of iteration 2 stays the latest: fix the storage, then start "
                                       "the same command again to resume from it"),
            (full, _args(empty), "no checkpoint is complete yet: free space there and start again")]:
        with pytest.raises(SystemExit) as exited:
            checkpoint_dir._failed(error, args, "saving iteration 4")
        assert exited.value.code == 1
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"litespark-train: error: saving iteration 4 to {args.save} failed "
                               f"({error.strerror}: {error.filename}; "), line
        assert line.endswith(f" GB free there); {then}"), line


def test_a_save_megatron_core_refuses_is_not_called_a_storage_fault(tmp_path, capsys):
    """megatron-core's sharding validation refuses a state dict (as it did a --peft freeze optimizer's, whose state
    covers some layers of a stacked tensor): no storage is at fault and the same command fails the same way, so the
    line says that instead of "fix the storage and start again"."""
    import pytest
    from megatron.core.dist_checkpointing.core import CheckpointingException

    x = _fake_save_dir(tmp_path / "x", [2], tracker=2)
    empty = _fake_save_dir(tmp_path / "empty", [], tracker=None)
    refused = CheckpointingException("Invalid sharding pattern validation. Errors: Invalid access pattern")
    for args, kept in [(_args(x, load=x), "the checkpoint of iteration 2 stays the latest"),
                       (_args(empty), "no checkpoint is complete yet")]:
        with pytest.raises(SystemExit) as exited:
            checkpoint_dir._failed(refused, args, "saving iteration 4")
        assert exited.value.code == 1
        line = capsys.readouterr().err.strip()
        assert line.startswith(f"litespark-train: error: saving iteration 4 to {args.save} failed "
                               "(CheckpointingException: Invalid sharding pattern validation."), line
        assert line.endswith(f"); {kept}; megatron-core refused what this run saves, not the storage: report this "
                             "line"), line
        assert "fix the storage" not in line and "\n" not in line


def test_the_cause_of_a_failed_write_is_the_one_megatron_core_logs(tmp_path, capsys):
    """megatron-core's writer keeps only the class of a failed write in the error it raises ("<class 'OSError'>")
    and logs the error itself: the line names the logged one."""
    import logging

    import pytest

    checkpoint_dir._watch_writer()
    raised = RuntimeError("Worker failure: An error is caught while starting worker 0, error: <class 'OSError'>")
    logging.getLogger("megatron.core.dist_checkpointing.strategies.filesystem_async").error(
        "Local worker 0 encountered an error: [Errno 28] No space left on device: '/d/iter_0000004/__0_0.distcp'")
    x = _fake_save_dir(tmp_path / "x", [2], tracker=2)
    with pytest.raises(SystemExit):
        checkpoint_dir._failed(raised, _args(x, load=x), "saving iteration 4")
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"litespark-train: error: saving iteration 4 to {x} failed (No space left on device: "
                           "/d/iter_0000004/__0_0.distcp; ") and "GB free there); " in line, line
    assert line.endswith(": free space there, then start the same command again to resume from it"), line


def test_a_save_that_fails_on_one_rank_alone_is_said_by_that_rank(tmp_path):
    """Rank 1's save fails before the save's first collective (tests/workers/helper_dies_on_one_rank.py: the writer's
    results-queue helper dies at birth there, as a scheduler's signal once made it): rank 1 says why in one line
    naming itself; rank 0, whose save then loses its peer, says its own. Before, only rank 0 spoke, of the lost
    connection: the cause was in no log."""
    save = tmp_path / "run"
    proc = forked(2, WORKER_DIR / "helper_dies_on_one_rank.py", *MOCK, "--train-iters", "4", "--save-interval", "2",
                  "--save", save, env=child_env(MASTER_PORT=free_port(), HELPER_DIES_ON_RANK=1))
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


def test_a_save_directory_under_a_file_is_one_line(tmp_path):
    """`--save somefile/ckpt` where somefile is a file: one line naming it and exit 2 before any work (the lock made
    it a traceback), nothing written."""
    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory")
    proc = train(1, *MOCK, "--train-iters", "3", "--save-interval", "3", "--save", somefile / "ckpt")
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"litespark-train: error: --save {somefile / 'ckpt'}: {somefile} is a file, not a directory; give --save a "
        "directory this run can write")
    assert "Traceback" not in proc.stderr and somefile.read_text() == "not a directory"


def test_a_save_directory_that_cannot_be_made_or_written_is_one_line(tmp_path):
    import pytest

    somefile = tmp_path / "somefile"
    somefile.write_text("not a directory")
    with pytest.raises(checkpoint_dir.ConfigError) as refused:
        checkpoint_dir.lock(_args(somefile))
    assert str(refused.value) == (f"--save {somefile}: {somefile} is a file, not a directory; give --save a "
                                  "directory this run can write")
    too_long = tmp_path / ("x" * 300) / "ckpt"  # (a read-only directory would not stop root)
    with pytest.raises(checkpoint_dir.ConfigError) as refused:
        checkpoint_dir.lock(_args(too_long))
    assert str(refused.value) == (f"--save {too_long}: cannot create it (File name too long); give --save a "
                                  "directory this run can write")
