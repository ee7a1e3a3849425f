"""The --save directory stays usable whatever happens to a run: one run writes it at a time, a run never
overwrites or deletes a complete checkpoint it did not load, a save killed half-way is removed at the next start, old
checkpoints go only once a newer one is complete, and a complete checkpoint is never rewritten in place.

megatron.training writes a checkpoint into `iter_N/`; megatron-core writes `iter_N/metadata.json` last, once every
rank's shards and the shard index are written (for an async save: when the save is finalized), and only then does
megatron.training name it in `latest_checkpointed_iteration.txt` (the tracker). So an `iter_N` is complete when its
metadata.json is there, whatever the tracker says: a run that started from scratch in a directory of checkpoints
moved the tracker back below complete ones. (Megatron-LM's legacy `--ckpt-format torch` writes no such file: there
the tracker is the only line, everything up to it complete.) Everything this module deletes or refuses is decided
from those files, never from timestamps.

    lock(args)         global rank 0, before anything is written: refuse a --save another live run holds
    clean(args)        global rank 0, at start: refuse a run whose saves would overwrite complete checkpoints it
                       did not load (it does not --load that directory, or starts at an iteration before them);
                       remove unfinished saves; apply --keep-last-checkpoints
    attach(args)       a listener of megatron.training's saves (platform.callbacks): no in-place re-save, a failed
                       save as one line and exit 1 (the tracker still names the last complete checkpoint), then
                       pruning
    finish()           end of the run (any exit): the last pruning, once the final save is complete
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
from typing import Iterator, List, Optional

from .errors import PROG, ConfigError
from .platform import callbacks

LOCK_NAME = ".litespark.lock"
_ITER_DIR = re.compile(r"^iter_(\d{7})$")

_lock_fd: Optional[int] = None
_pruner: Optional[threading.Thread] = None
_args = None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _say(message: str) -> None:
    print(f"{PROG}: {message}", flush=True)


# --------------------------------------------------------------------------------------------- the lock
def lock(args) -> None:
    """Hold an exclusive lock on `--save` for the life of this process (global rank 0 only): a second run on the
    same directory would interleave its iterations and its tracker with this one's. The lock is the kernel's
    (flock), so it ends with the process however it ends; the file names the holder for the refusal message."""
    global _lock_fd
    if not args.save or _rank() != 0 or _lock_fd is not None:
        return
    try:
        os.makedirs(args.save, exist_ok=True)
        fd = os.open(os.path.join(args.save, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        blocking = _file_in_the_way(args.save)
        why = f"{blocking} is a file, not a directory" if blocking else f"cannot create it ({e.strerror})"
        raise ConfigError(f"--save {args.save}: {why}; give --save a directory this run can write") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"--save {args.save} is in use by another run ({holder}): two runs must not write "
                              "one checkpoint directory; wait for that run to end, or give this one another --save")
        # A filesystem without flock (some Lustre and NFS mounts): run unlocked rather than not at all.
        os.close(fd)
        _say(f"WARNING: --save {args.save} cannot be locked on this filesystem ({e.strerror}); make sure no other "
             "run writes it")
        return
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"host {socket.gethostname()}, pid {os.getpid()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    _lock_fd = fd


def _file_in_the_way(path: str) -> Optional[str]:
    """The part of `path` that exists and is not a directory, if one is."""
    path = os.path.normpath(path)
    while path and path != os.path.dirname(path):
        if os.path.lexists(path):
            return None if os.path.isdir(path) else path
        path = os.path.dirname(path)
    return None


# --------------------------------------------------------------------------------------------- the tracker
def tracked_iteration(save_dir: str) -> Optional[int]:
    """The iteration the tracker names (None: no tracker; a release checkpoint counts as iteration 0)."""
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return 0 if text == "release" else int(text) if text.isdigit() else None


def iteration_dirs(save_dir: str) -> List[int]:
    """The iterations with an `iter_N` directory, ascending."""
    try:
        names = os.listdir(save_dir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(_ITER_DIR.match, names) if m and
                  os.path.isdir(os.path.join(save_dir, m.group(0))))


def _dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:07d}")


def complete(save_dir: str, iteration: int, ckpt_format: str = "torch_dist") -> bool:
    """Whether `iter_N` holds a finished save: its metadata.json, megatron-core's last file, is there and whole
    (megatron-core's own reader of it). The legacy format has no such file: up to the tracker's iteration."""
    if ckpt_format == "torch":
        latest = tracked_iteration(save_dir)
        return latest is not None and iteration <= latest
    from megatron.core.dist_checkpointing.core import maybe_load_config

    try:
        return maybe_load_config(_dir(save_dir, iteration)) is not None
    except (OSError, ValueError, TypeError):  # cut short while written
        return False


def unfinished(save_dir: str, ckpt_format: str = "torch_dist") -> List[int]:
    """Saves that never completed: every `iter_N` that is not complete."""
    return [i for i in iteration_dirs(save_dir) if not complete(save_dir, i, ckpt_format)]


def superseded(save_dir: str, keep: int, ckpt_format: str = "torch_dist") -> List[int]:
    """Complete checkpoints beyond the `keep` newest up to the tracker's: never the tracker's, never one newer than
    it."""
    latest = tracked_iteration(save_dir)
    if latest is None:
        return []
    done = [i for i in iteration_dirs(save_dir) if i <= latest and complete(save_dir, i, ckpt_format)]
    return done[:-keep] if len(done) > keep else []


# --------------------------------------------------------------------------------------------- start and saves
def clean(args) -> None:
    """At start, on global rank 0 (which holds the lock, so no save of this directory is running): refuse a run
    that would overwrite complete checkpoints it did not load (one line, before anything is removed), remove the
    saves a killed run left unfinished, and the checkpoints --keep-last-checkpoints no longer keeps."""
    if not args.save or _rank() != 0:
        return
    refusal = _would_overwrite(args)
    if refusal:
        raise ConfigError(refusal)
    latest = tracked_iteration(args.save)
    for iteration in unfinished(args.save, _format(args)):
        _say(f"removing {_dir(args.save, iteration)}: a save that did not finish (the tracker names "
             f"{'no checkpoint' if latest is None else f'iteration {latest}'})")
        shutil.rmtree(_dir(args.save, iteration), ignore_errors=True)
    _prune(args, background=False)


def _format(args) -> str:
    return getattr(args, "ckpt_format", None) or "torch_dist"


def loads_save(args) -> bool:
    """Whether the run loads the checkpoints of its --save directory (--load names the same directory)."""
    return bool(args.load and args.save) and os.path.realpath(args.load) == os.path.realpath(args.save)


def _would_overwrite(args) -> Optional[str]:
    """Why the run must not start on its --save directory, or None. A run saves iter_N, in place, for iterations
    after the one it starts at, and moves the tracker to each: complete checkpoints there that it did not load
    (it loads another directory or none), or newer than where it starts (--ckpt-step, --finetune, a tracker moved
    back), would be overwritten, and the tracker would no longer name the newest."""
    save = args.save
    held = [i for i in iteration_dirs(save) if complete(save, i, _format(args))]
    latest = tracked_iteration(save)
    release = latest == 0 and os.path.isdir(os.path.join(save, "release"))
    if not held and not release:
        return None
    if not loads_save(args):
        what = f"the newest: iteration {held[-1]}" if held else "a release checkpoint"
        if args.load:
            return (f"--save {save} holds checkpoints ({what}) and this run loads --load {args.load}: its saves "
                    f"would replace them; --load {save} continues from them, or give this run another --save")
        return (f"--save {save} holds checkpoints ({what}) that this run does not load: its saves would replace "
                f"them; add --load {save} to continue from them, or give this run another --save")
    if getattr(args, "finetune", False):
        start, why = 0, "--finetune"  # megatron.training starts a fine-tuning at iteration 0
    elif getattr(args, "ckpt_step", None):
        start, why = args.ckpt_step, f"--ckpt-step {args.ckpt_step}"
    elif latest is None:
        start, why = 0, "no tracker: from scratch"
    else:
        start, why = latest, "the tracker's" if latest else "the release checkpoint's"
    newer = [i for i in held if i > start]
    if not newer:
        return None
    go_on = "give this run another --save" if why.startswith("--") else \
        f"--ckpt-step {newer[-1]} continues from the newest, or give this run another --save"
    return (f"--save {save} holds complete checkpoints newer than iteration {start}, where this run starts ({why}): "
            f"{_iterations(newer)}; its saves would overwrite them: {go_on}")


def _iterations(iterations: List[int]) -> str:
    if len(iterations) == 1:
        return f"iteration {iterations[0]}"
    shown = iterations if len(iterations) <= 4 else [*iterations[:2], "...", iterations[-1]]
    return f"iterations {', '.join(map(str, shown))}"


def _prune(args, background: bool) -> None:
    global _pruner
    keep = getattr(args, "keep_last_checkpoints", None)
    if not keep or not args.save or _rank() != 0:
        return
    old = superseded(args.save, keep, _format(args))
    if not old:
        return
    if _pruner is not None:
        _pruner.join()  # one deletion at a time, in order

    def delete():
        for iteration in old:
            shutil.rmtree(_dir(args.save, iteration), ignore_errors=True)
        _say(f"--keep-last-checkpoints {keep}: removed iteration(s) {', '.join(map(str, old))} from {args.save}")

    if background:  # deleting tens of GB must not hold rank 0 (and with it every rank) in the training loop
        _pruner = threading.Thread(target=delete, name="litespark-prune", daemon=True)
        _pruner.start()
    else:
        delete()


def already_saved(args, iteration: int) -> bool:
    """True when saving `iteration` would rewrite, in place, the complete checkpoint the tracker names with the same
    state: a run resumed from it that trained no step (it was resumed at --train-iters, or stopped at once).
    megatron.training would then overwrite the only complete checkpoint file by file, and a kill in that window
    leaves the tracker naming a damaged one."""
    return (loads_save(args) and iteration == getattr(args, "iteration", None)
            and tracked_iteration(args.save) == iteration and os.path.isdir(_dir(args.save, iteration)))


class _Listener(callbacks.Listener):
    """megatron.training's saves, as platform.callbacks tells them: none without --save, no in-place re-save, a
    failed save as one line and exit 1, then pruning in the background."""

    def skip_save(self, iteration):
        from megatron.training import get_args

        current = get_args()
        if not current.save:
            # megatron.training saves on its own where a run names no directory: its rerun state machine after a
            # NaN/Inf it saw again (megatron-core 0.19.2 then joins None into a path). Nothing to save to: the run
            # stops with its one line (pretrain._explain_failed_validation: "no checkpoint holds it").
            return True
        if not already_saved(current, iteration):
            return False
        if _rank() == 0:
            _say(f"iteration {iteration} is already saved in {_dir(current.save, iteration)} (this run loaded it and "
                 "trained no step since): not saving it again")
        return True

    def on_save_start(self, iteration):
        _writer_errors.last = None

    def on_save_end(self, iteration, seconds, error):
        from megatron.training import get_args

        if error is not None:
            _failed(error, get_args(), f"saving iteration {iteration}")
        _prune(get_args(), background=True)

    def on_async_save_error(self, error):
        """--async-save's writes end in maybe_finalize_async_save, after the save call returned: a storage error
        surfaces there."""
        from megatron.training import get_args

        _failed(error, get_args(), "an asynchronous checkpoint save")


def attach(args) -> None:
    """Guard this run's saves: a listener of megatron.training's loop (platform.callbacks)."""
    global _args
    _args = args
    _watch_writer()
    callbacks.listen("checkpoint_dir", _Listener())


def _failed(error: BaseException, args, what: str) -> None:
    """A save that failed (disk full, permissions, a storage error): one line on rank 0 instead of a traceback from
    every rank, and exit 1. The tracker still names the last complete checkpoint; the line says how this command
    goes on from it. A failure every rank learns of (torch's CheckpointException gathers every rank's) is rank 0's
    line alone; any other is this rank's own, which rank 0 may never see (it waits in the save's next collective
    until the launcher stops it): the rank says it."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error  # (torch's CheckpointException is a BaseException: callers catch BaseException)
    rank = _rank()
    if rank == 0 or not _seen_by_every_rank(error):
        save_dir, cause = args.save, _storage_error(error)
        fix = "free space there" if cause is not None and cause.errno in (errno.ENOSPC, errno.EDQUOT) else \
            "fix the storage"
        latest = tracked_iteration(save_dir)
        if cause is None and _refused_contents(error):  # the same command would fail the same way
            kept = "no checkpoint is complete yet" if latest is None else \
                f"the checkpoint of iteration {latest} stays the latest"
            then = f"{kept}; megatron-core refused what this run saves, not the storage: report this line"
        elif latest is None:
            then = f"no checkpoint is complete yet: {fix} and start again"
        else:  # a run without --load of this directory starts from scratch, or is refused once it holds one
            resume = "start the same command again to resume from it" if loads_save(args) else \
                f"resume from it with --load {save_dir}"
            then = f"the checkpoint of iteration {latest} stays the latest: {fix}, then {resume}"
        where = "" if rank == 0 else f"rank {rank}: "
        print(f"{PROG}: error: {where}{what} to {save_dir} failed ({_cause(error, cause)}; "
              f"{_free_space(save_dir)}); {then}", file=sys.stderr, flush=True)
    sys.exit(1)


def _seen_by_every_rank(error: BaseException) -> bool:
    """Whether the failure is torch's CheckpointException (or wraps one): raised on every rank with every rank's
    failures, so rank 0's line names it."""
    from torch.distributed.checkpoint.api import CheckpointException

    return any(isinstance(e, CheckpointException) for e in _chain(error))


def _chain(error: BaseException) -> Iterator[BaseException]:
    """The error and those behind it: causes, contexts, and the rank failures torch's CheckpointException holds."""
    seen, queue = set(), [error]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        queue += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, tb)
            queue.append(failure[0] if isinstance(failure, tuple) else failure)


class _WriterErrors(logging.Handler):
    """megatron-core's checkpoint writer raises, for a write that failed, an error naming only the failure's class
    ("<class 'OSError'>"), and logs the failure itself: the last one logged here. (A synchronous save writes in
    this process; an async save in its worker process, whose log line is in the run's log.)"""
    LOGGER = "megatron.core.dist_checkpointing.strategies.filesystem_async"
    LINE = re.compile(r"Local worker \d+ encountered an error: (.*)", re.S)
    last: Optional[str] = None

    def emit(self, record: logging.LogRecord) -> None:
        found = self.LINE.match(record.getMessage())
        if found:
            self.last = found.group(1)


_writer_errors = _WriterErrors(logging.ERROR)


def _watch_writer() -> None:
    logger = logging.getLogger(_WriterErrors.LOGGER)
    if _writer_errors not in logger.handlers:
        logger.addHandler(_writer_errors)


def _storage_error(error: BaseException) -> Optional[OSError]:
    """The OSError behind a failed save: in the chain of errors (torch's CheckpointException wraps each rank's
    failure and megatron-core's writer wraps those again), else the one megatron-core's writer logged."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.strerror:
            return e
    logged = re.fullmatch(r"\[Errno (\d+)\] (.*?)(?:: '(.*)')?", (_writer_errors.last or "").strip(), re.S)
    return OSError(int(logged.group(1)), logged.group(2), logged.group(3)) if logged else None


def _refused_contents(error: BaseException) -> bool:
    """megatron-core's dist_checkpointing refused the state dict itself (its sharding validation), before any
    storage was involved."""
    from megatron.core.dist_checkpointing.core import CheckpointingException

    return any(isinstance(e, CheckpointingException) for e in _chain(error))


def _cause(error: BaseException, storage: Optional[OSError]) -> str:
    """What went wrong, in a few words: the storage error, else the innermost message."""
    if storage is not None:
        return f"{storage.strerror}: {storage.filename}" if storage.filename else storage.strerror
    innermost = list(_chain(error))[-1]
    text = str(innermost).strip().splitlines()
    return f"{type(innermost).__name__}: {text[0]}" if text else type(innermost).__name__


def _free_space(path: str) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 1e9:.1f} GB free there"
    except OSError:
        return "free space unknown"


def finish() -> None:
    """The run is over (trained, stopped by a signal or a limit): megatron.training has finalized its last save,
    so the last pruning can run; wait for deletions still under way."""
    if _args is not None:
        _prune(_args, background=False)
    if _pruner is not None:
        _pruner.join()


def latest_checkpoint_dir(load_dir: str) -> Optional[str]:
    """The checkpoint directory (iter_N or release) the tracker of a --load/--save directory names, None if there
    is none (megatron.training's own tracker and names)."""
    import contextlib
    import io

    from megatron.training.checkpointing import (checkpoint_exists, get_checkpoint_name,
                                                 get_checkpoint_tracker_filename, read_metadata)

    if not checkpoint_exists(load_dir):
        return None
    with contextlib.redirect_stdout(io.StringIO()):  # read_metadata prints on every rank
        iteration, release = read_metadata(get_checkpoint_tracker_filename(load_dir))
    return get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
