"""A process that has imported torch and megatron-core once, and forks a fresh run of `python -m MODULE ARGS` (or
`python SCRIPT ARGS`) for each request: most of a tiny training run's time is those imports, paid here once per test
worker instead of once per rank. Started by tests/conftest.py (`launch`), only with the environment a plain child
gets there, since whatever the environment changes at import time was decided here (conftest falls back to a real
process otherwise).

Protocol: one JSON request per line on stdin ({"target", "is_module", "argv", "env", "cwd", "stdout", "stderr",
"status"}); for each, a waiter process is forked, which forks the run and writes the run's pid to STATUS.pid, then
its exit status to STATUS (as subprocess reports it: the code, or minus the signal) once it ends. The reply line is
the waiter's pid. Waiters are reaped here; a run's parent is its waiter, which does nothing but wait.

A request with "fork_children" (a tool such as the efficiency suite) runs with subprocess.Popen replaced: a
child `python -m litespark_megatron ARGS` it starts with its output to a file and this environment (what the tools
start for one process) is forked from the tool, which already holds the imports; every other child is a real
process."""
import json
import os
import sys

# What a run reads after its imports, so that a fork of this process serves any value of it: ranks and ports (and
# torchrun's other variables), the project's run-time variables, the test-only faults litespark_megatron.pretrain
# reads when it is imported (never here: only in the run), and the knobs of the test workers (tests/workers/), which
# they read as they start. (Not LITESPARK_CPU_SHIMS: a run without a shim fails in megatron-core code whose state the
# imports already set up.)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
RUN_TIME = set(RANK_VARIABLES) | {"GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME"}
WORKER_KNOBS = ("HANG_", "KILL_IN_SAVE_AT", "DISK_FULL_AT", "SLOW_RANK", "SLOW_SECONDS", "HELPER_DIES_ON_RANK")
RUN_TIME_PREFIX = ("LITESPARK_CACHE", "LITESPARK_RESTORE_STOP_SIGNALS", "LITESPARK_HELPER",
                   "LITESPARK_TEST_NAN_AT_STEP", "LITESPARK_TEST_SPIKE_AT_STEP") + WORKER_KNOBS


def start_env(env) -> dict:
    """What of an environment the imports read: a run whose start_env is this process's can be forked from it."""
    return {k: v for k, v in env.items() if k not in RUN_TIME and not k.startswith(RUN_TIME_PREFIX)}


def _import_what_every_run_imports() -> None:
    """The heavy part of a training run's start: torch's operator registrations, megatron-core's modules (here,
    not at this module's import: conftest reads start_env from it)."""
    import torch  # noqa: F401
    import megatron.core  # noqa: F401
    import megatron.core.models.gpt  # noqa: F401
    import megatron.training.training  # noqa: F401
    import megatron.training.initialize  # noqa: F401
    import megatron.training.checkpointing  # noqa: F401
    import megatron.core.tokenizers.text  # noqa: F401  (megatron.training builds a tokenizer: it imports transformers)


def _write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def _run(request: dict) -> int:
    """In the forked run: become `python -m target argv` in the request's environment and directory."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    if request.get("fork_children"):
        _fork_children()
    return _become(request)


def _become(request: dict) -> int:
    """Run the request's target as `python [-m] target argv` would, in this process (its output already in place);
    its exit status."""
    import atexit
    import random
    import runpy

    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    random.seed()  # as a fresh interpreter: not the state every fork shares
    sys.path[0] = request["cwd"] if request["is_module"] else os.path.dirname(os.path.abspath(request["target"]))
    sys.argv = [request["target"], *request["argv"]]
    code, interrupted = 0, False
    try:
        if request["is_module"]:
            runpy.run_module(request["target"], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(request["target"], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        import traceback
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 1
    import threading
    try:  # what an interpreter's normal shutdown runs: wait for non-daemon threads, then the exit functions
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    if interrupted:  # an interpreter ended by an uncaught Ctrl-C ends by SIGINT itself
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


# ---- a tool's children forked from the tool ------------------------------------------------------------------
FORKED_MODULES = ("litespark_megatron",)  # what the tools start as `python -m` for one process


class _Forked:
    """The part of subprocess.Popen the tools use, for a forked child."""

    def __init__(self, pid: int, args):
        self.pid, self.args, self.returncode = pid, args, None
        self.stdin = self.stdout = self.stderr = None

    def poll(self):
        if self.returncode is None:
            pid, raw = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(raw)
        return self.returncode

    def wait(self, timeout=None):
        import subprocess
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.02)
        return self.returncode

    def communicate(self, input=None, timeout=None):
        self.wait(timeout)
        return None, None

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        import signal
        self.send_signal(signal.SIGTERM)

    def kill(self):
        import signal
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()


def _forkable(cmd, kwargs) -> bool:
    import subprocess

    if not isinstance(cmd, (list, tuple)) or len(cmd) < 3 or cmd[0] != sys.executable or cmd[1] != "-m" \
            or cmd[2] not in FORKED_MODULES:
        return False
    if set(kwargs) - {"stdout", "stderr", "env", "cwd", "start_new_session"}:
        return False
    out, err = kwargs.get("stdout"), kwargs.get("stderr")
    if not hasattr(out, "fileno") or not (err is subprocess.STDOUT or hasattr(err, "fileno")):
        return False
    return start_env(kwargs.get("env") or os.environ) == start_env(os.environ)


def _as_a_fresh_process() -> None:
    """Drop what the tool set up for itself: its exit functions and its signal handlers (a fresh interpreter has
    Python's own SIGINT handler and the system's default for the rest)."""
    import atexit
    import signal

    atexit._clear()
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and handler is not signal.default_int_handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)


def _fork_children() -> None:
    import subprocess

    real = subprocess.Popen

    def popen(cmd, *args, **kwargs):
        if args or not _forkable(cmd, kwargs):
            return real(cmd, *args, **kwargs)
        out = kwargs["stdout"]
        err = out if kwargs.get("stderr") is subprocess.STDOUT else kwargs["stderr"]
        for stream in (out, err, sys.stdout, sys.stderr):  # nothing buffered here is written again by the child
            stream.flush()
        started, ready = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.close(started)
                if kwargs.get("start_new_session"):
                    os.setsid()
                os.write(ready, b"1")  # as Popen returns: the child in its session (a signal to its group reaches it)
                os.close(ready)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                _as_a_fresh_process()
                subprocess.Popen = real  # the child's own children: as it would start them
                env = dict(kwargs.get("env") or os.environ)
                os.environ.clear()
                os.environ.update(env)
                cwd = kwargs.get("cwd") or os.getcwd()
                os.chdir(cwd)
                code = _become(dict(target=cmd[2], is_module=True, argv=[str(a) for a in cmd[3:]], cwd=str(cwd)))
            finally:
                os._exit(code)
        os.close(ready)
        os.read(started, 1)
        os.close(started)
        return _Forked(pid, cmd)

    subprocess.Popen = popen


def _wait_for(run: int, status: str) -> None:
    _write_atomically(status + ".pid", str(run))
    _, raw = os.waitpid(run, 0)
    _write_atomically(status, str(os.waitstatus_to_exitcode(raw)))


def main() -> None:
    _import_what_every_run_imports()
    for line in sys.stdin:
        request = json.loads(line)
        waiter = os.fork()
        if waiter == 0:
            code = 1
            try:
                run = os.fork()
                if run == 0:
                    code = _run(request)
                else:
                    _wait_for(run, request["status"])
                    code = 0
            finally:  # never back into this loop
                os._exit(code)
        print(waiter, flush=True)
        while True:  # reap the waiters that are done
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break


if __name__ == "__main__":
    main()
