"""The --save directory stays usable whatever happens to a run: one run writes it at a time, a save killed half-way
is removed at the next start, old checkpoints go only once a newer one is complete, and a complete checkpoint is
never rewritten in place.

megatron.training writes a checkpoint into `iter_N/` and names it in `latest_checkpointed_iteration.txt` (the
tracker) only once every rank has finished (for an async save: when the save is finalized). So the tracker is the
line between complete and not: an `iter_N` newer than the tracker's iteration is a save that never finished, and
everything this module deletes is decided from the tracker, never from timestamps.

    lock(args)         global rank 0, before anything is written: refuse a --save another live run holds
    clean(args)        global rank 0, at start: remove unfinished saves; apply --keep-last-checkpoints
    attach(args)       around megatron.training's save_checkpoint_and_time: no in-place re-save, a failed save as
                       one line and exit 1 (the tracker still names the last complete checkpoint), then pruning
    finish()           end of the run (any exit): the last pruning, once the final save is complete
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import sys
import threading
import time
from typing import List, Optional

from .arguments import PROG, ConfigError

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
    os.makedirs(args.save, exist_ok=True)
    path = os.path.join(args.save, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
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


# --------------------------------------------------------------------------------------------- the tracker
def tracked_iteration(save_dir: str) -> Optional[int]:
    """The iteration the tracker names (None: no tracker; a release checkpoint counts as iteration 0)."""
    path = os.path.join(save_dir, "latest_checkpointed_iteration.txt")
    try:
        text = open(path).read().strip()
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


def unfinished(save_dir: str) -> List[int]:
    """Saves that never completed: every `iter_N` newer than the tracker (all of them when there is none)."""
    latest = tracked_iteration(save_dir)
    return [i for i in iteration_dirs(save_dir) if latest is None or i > latest]


def superseded(save_dir: str, keep: int) -> List[int]:
    """Complete checkpoints beyond the `keep` newest: never the tracker's, never one newer than it."""
    latest = tracked_iteration(save_dir)
    if latest is None:
        return []
    complete = [i for i in iteration_dirs(save_dir) if i <= latest]
    return complete[:-keep] if len(complete) > keep else []


# --------------------------------------------------------------------------------------------- start and saves
def clean(args) -> None:
    """At start, on global rank 0 (which holds the lock, so no save of this directory is running): remove the
    saves a killed run left unfinished, and the checkpoints --keep-last-checkpoints no longer keeps."""
    if not args.save or _rank() != 0:
        return
    latest = tracked_iteration(args.save)
    for iteration in unfinished(args.save):
        _say(f"removing {_dir(args.save, iteration)}: a save that did not finish (the tracker names "
             f"{'no checkpoint' if latest is None else f'iteration {latest}'})")
        shutil.rmtree(_dir(args.save, iteration), ignore_errors=True)
    _prune(args, background=False)


def _prune(args, background: bool) -> None:
    global _pruner
    keep = getattr(args, "keep_last_checkpoints", None)
    if not keep or not args.save or _rank() != 0:
        return
    old = superseded(args.save, keep)
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
    return (bool(args.load) and os.path.abspath(args.load) == os.path.abspath(args.save)
            and iteration == getattr(args, "iteration", None) and tracked_iteration(args.save) == iteration
            and os.path.isdir(_dir(args.save, iteration)))


def attach(args) -> None:
    """Wrap megatron.training's save_checkpoint_and_time and maybe_finalize_async_save (train() calls both through
    its module globals): skip the in-place re-save above, a failed save as one line, then prune in the
    background."""
    global _args
    from megatron.training import training

    _args = args
    original = training.save_checkpoint_and_time
    if getattr(original, "__litespark_checkpoint_dir__", False):
        return

    def save_checkpoint_and_time(iteration, *a, **k):
        from megatron.training import get_args

        current = get_args()
        if current.save and already_saved(current, iteration):
            if _rank() == 0:
                _say(f"iteration {iteration} is already saved in {_dir(current.save, iteration)} (this run loaded it "
                     "and trained no step since): not saving it again")
            return None
        try:
            result = original(iteration, *a, **k)
        except BaseException as e:
            _failed(e, current.save, f"saving iteration {iteration}")
        _prune(current, background=True)
        return result

    original_finalize = training.maybe_finalize_async_save

    def maybe_finalize_async_save(*a, **k):
        """--async-save's writes end here, after the save call returned: a storage error surfaces here."""
        try:
            return original_finalize(*a, **k)
        except BaseException as e:
            from megatron.training import get_args

            _failed(e, get_args().save, "an asynchronous checkpoint save")

    save_checkpoint_and_time.__litespark_checkpoint_dir__ = True
    save_checkpoint_and_time.__wrapped__ = original
    maybe_finalize_async_save.__wrapped__ = original_finalize
    training.save_checkpoint_and_time = save_checkpoint_and_time
    training.maybe_finalize_async_save = maybe_finalize_async_save


def _failed(error: BaseException, save_dir: str, what: str) -> None:
    """A save that failed (disk full, permissions, a storage error): one line on rank 0 instead of a traceback from
    every rank, and exit 1. The tracker still names the last complete checkpoint. A failure every rank learns of
    (torch's CheckpointException gathers every rank's) is rank 0's line alone; any other is this rank's own, which
    rank 0 may never see (it waits in the save's next collective until the launcher stops it): the rank says it."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        raise error  # (torch's CheckpointException is a BaseException: callers catch BaseException)
    rank = _rank()
    if rank == 0 or not _seen_by_every_rank(error):
        latest = tracked_iteration(save_dir)
        then = "no checkpoint is complete yet: fix the storage and start again" if latest is None else \
            f"the checkpoint of iteration {latest} stays the latest: fix the storage and start the same command " \
            "again to resume from it"
        where = "" if rank == 0 else f"rank {rank}: "
        print(f"{PROG}: error: {where}{what} to {save_dir} failed ({_cause(error)}; {_free_space(save_dir)}); {then}",
              file=sys.stderr, flush=True)
    sys.exit(1)


def _seen_by_every_rank(error: BaseException) -> bool:
    """Whether the failure is torch's CheckpointException (or wraps one): raised on every rank with every rank's
    failures, so rank 0's line names it."""
    from torch.distributed.checkpoint.api import CheckpointException

    seen, queue = set(), [error]
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        if isinstance(e, CheckpointException):
            return True
        seen.add(id(e))
        queue += [e.__cause__, e.__context__]
    return False


def _cause(error: BaseException) -> str:
    """The storage error behind a failed save. torch's CheckpointException wraps each rank's failure and
    megatron-core's writer wraps those again (keeping only the class of the error from its writer threads): the
    first OSError found, else the innermost message."""
    seen, queue, innermost = set(), [error], error
    while queue:
        e = queue.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.strerror:
            return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        innermost = e
        queue += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # CheckpointException: rank -> (exc, tb)
            queue.append(failure[0] if isinstance(failure, tuple) else failure)
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
