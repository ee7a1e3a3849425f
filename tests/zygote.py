"""A process that has imported torch and megatron-core once, and forks a fresh run of `python -m MODULE ARGS` (or
`python SCRIPT ARGS`) for each request: most of a tiny training run's time is those imports, paid here once per test
worker instead of once per rank. Started by tests/conftest.py (`launch`), only with the environment a plain child
gets there, since whatever the environment changes at import time was decided here (conftest falls back to a real
process otherwise).

Protocol: one JSON request per line on stdin ({"target", "is_module", "argv", "env", "cwd", "stdout", "stderr",
"status"}); for each, a waiter process is forked, which forks the run and writes the run's pid to STATUS.pid, then
its exit status to STATUS (as subprocess reports it: the code, or minus the signal) once it ends. The reply line is
the waiter's pid. Waiters are reaped here; a run's parent is its waiter, which does nothing but wait."""
import json
import os
import sys

# What every training run imports first (the heavy part: torch's operator registrations, megatron-core's modules).
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
    import atexit
    import random
    import runpy

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
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


def _wait_for(run: int, status: str) -> None:
    _write_atomically(status + ".pid", str(run))
    _, raw = os.waitpid(run, 0)
    _write_atomically(status, str(os.waitstatus_to_exitcode(raw)))


def main() -> None:
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
