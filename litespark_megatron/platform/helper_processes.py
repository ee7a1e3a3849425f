"""megatron-core's checkpoint writer starts helper processes (the results queue's multiprocessing Manager, on every
save; the persistent async-save worker) that block on queues forever once the trainer is killed (SIGKILL, the OOM
killer): ~0.7 GB each, left running; data-loader workers linger for seconds. Here every helper ends with the trainer,
however it ends, and outlives the scheduler's stop signal the trainer itself handles (the `children` gap of
prepare_libraries; tests/test_platform.py reproduces each failure without it).
"""
from __future__ import annotations

import contextlib
import functools
import os

# What a scheduler sends every process of a job to stop it or warn of its end (SLURM signals each process of a job
# step; Megatron-LM's --exit-signal is one of these).
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


HELPER_PARENT = "LITESPARK_HELPER_PARENT"


def die_with_parent() -> None:
    """In a helper process: the kernel kills it when the process that started it ends, however it ends (Linux
    PR_SET_PDEATHSIG). If that process is already gone, exit now. (The kernel ties the signal to the thread that
    started the helper; torch and megatron-core start these from the trainer's main thread.)
    Its life being the trainer's, it ignores the stop signals: a scheduler's SIGTERM to every process of the job
    would otherwise kill the checkpoint writer's helpers while the trainer, which handles it, saves with them. (A
    data-loader worker that torch gives up on at shutdown and sends SIGTERM then ends with the trainer instead.)"""
    import ctypes
    import signal

    # A spawned helper runs this only after its interpreter started and imported (a second or more): its trainer
    # may have died by then, and its parent is then whoever adopted it (PID 1, or a subreaper: a container's init,
    # a job step's). The trainer's pid, in the environment it was spawned with, says which parent is its own.
    parent = int(os.environ.pop(HELPER_PARENT, 0)) or os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):
        return  # not Linux: the helpers keep megatron-core's own lifetime
    for name in STOP_SIGNALS:
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if parent == 1 or os.getppid() != parent:
        os._exit(0)


@contextlib.contextmanager
def _helpers_born_ignoring_stop_signals():
    """Helpers spawned in this block know their trainer's pid (for die_with_parent) and are born ignoring the stop
    signals. A spawned helper is a fresh interpreter for
    a second or more before `die_with_parent` runs in it, and the save that starts it is typically the one a
    scheduler's SIGTERM asked for, while the scheduler is still signalling every process of the job (node by node):
    the signal killed the helper at birth and failed the save on that rank (seen under CPU load). A signal ignored
    at exec stays ignored (a blocked one does not: spawning clears the mask), so the stop signals are ignored
    around each fork and exec of multiprocessing's spawn, a few milliseconds, and restored at once: a stop signal
    to the trainer inside those milliseconds is lost. Main thread only (signal.signal); elsewhere the signals are
    left alone."""
    import threading
    from multiprocessing import util

    os.environ[HELPER_PARENT] = str(os.getpid())  # for die_with_parent in the helpers spawned here
    try:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        with _stop_signals_ignored_at_spawn(util):
            yield
    finally:
        os.environ.pop(HELPER_PARENT, None)


@contextlib.contextmanager
def _stop_signals_ignored_at_spawn(util):
    import signal

    original = util.spawnv_passfds

    def spawnv_passfds(*args, **kwargs):
        # (None: a handler Python did not install and could not restore: that signal is left alone)
        numbers = (getattr(signal, name) for name in STOP_SIGNALS)
        before = {n: h for n in numbers if (h := signal.getsignal(n)) is not None}
        for number in before:
            signal.signal(number, signal.SIG_IGN)
        try:
            return original(*args, **kwargs)
        finally:
            for number, handler in before.items():
                signal.signal(number, handler)

    util.spawnv_passfds = spawnv_passfds
    try:
        yield
    finally:
        util.spawnv_passfds = original


def _persistent_async_loop(*args, **kwargs):
    """megatron-core's persistent async-save worker loop, in a worker that dies with its trainer."""
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    die_with_parent()
    return PersistentAsyncCaller.async_loop(*args, **kwargs)


def helper_processes_die_with_the_trainer() -> None:
    """Helper processes end with the trainer, however it ends:
    - every child forked through multiprocessing (data-loader workers, megatron-core's temporal async-save worker)
      runs `die_with_parent` first (multiprocessing's after-fork hook);
    - `filesystem_async.get_write_results_queue()` makes its queue from a spawned `Manager()` on the first save (also
      for synchronous saves); the queue is made here, by a Manager whose server process runs `die_with_parent`
      first. Started lazily, at the first save, as megatron-core does.
    - `PersistentAsyncCaller` (--use-persistent-ckpt-worker) spawns `async_loop`; its target becomes
      `_persistent_async_loop` (module-level, so the spawned process can import it), the same loop after
      `die_with_parent`.
    Idempotent."""
    import multiprocessing.util

    from megatron.core.dist_checkpointing.strategies import async_utils, filesystem_async

    if getattr(filesystem_async.get_write_results_queue, "__litespark__", False):
        return
    multiprocessing.util.register_after_fork(die_with_parent, lambda function: function())
    original = filesystem_async.get_write_results_queue

    @functools.wraps(original)
    def get_write_results_queue(mp_mode: str = "spawn"):
        if filesystem_async._results_queue is None:
            import multiprocessing.managers

            manager = multiprocessing.managers.SyncManager(ctx=multiprocessing.get_context(mp_mode))
            with _helpers_born_ignoring_stop_signals():
                manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()
            filesystem_async._litespark_manager = manager  # the queue lives as long as its manager
        return filesystem_async._results_queue

    get_write_results_queue.__litespark__ = True
    filesystem_async.get_write_results_queue = get_write_results_queue

    caller = async_utils.PersistentAsyncCaller
    original_get_process = caller._get_process.__func__

    def _get_process(cls, *args, **kwargs):
        if cls._persistent_process is None:
            loop = cls.__dict__["async_loop"]
            cls.async_loop = staticmethod(_persistent_async_loop)
            try:
                with _helpers_born_ignoring_stop_signals():
                    return original_get_process(cls, *args, **kwargs)
            finally:
                cls.async_loop = loop
        return original_get_process(cls, *args, **kwargs)

    caller._get_process = classmethod(_get_process)
