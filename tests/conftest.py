"""Helpers to run code in fresh processes: megatron-core keeps global state (process groups, CPU shims), so every
test that builds a model runs it in its own process (or torchrun group) with its own port."""
import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run(cmd, timeout=300, env=None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=env or child_env(), cwd=cwd or ROOT)


def torchrun(nproc: int, script, *script_args, timeout=300, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc,
           "--master-addr", "127.0.0.1", "--master-port", free_port(), script, *script_args]
    return run(cmd, timeout=timeout, env=env)


def parity_losses(tmp_path, nproc: int, flags, steps: int = 3, env=None) -> dict:
    out = tmp_path / f"losses_{free_port()}.json"
    proc = torchrun(nproc, TESTS / "parity_worker.py", out, steps, "--", *flags, env=env)
    assert proc.returncode == 0, f"worker failed ({flags}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text())


@pytest.fixture
def py():
    """Run `python -c CODE` (or a script with args) in a fresh process with the project on the path."""
    def _run(*argv, timeout=300, **env):
        return run([sys.executable, *argv], timeout=timeout, env=child_env(**env))
    return _run


def load_tool(name: str):
    """Import tools/<name>.py (the CLIs are scripts, not package modules) to call its main(argv)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TESTS.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_json(tool, argv, capsys):
    """A tool's --json output, after checking it exited 0."""
    assert tool.main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def run_error(tool, argv, capsys) -> str:
    """The one line a tool prints for bad input, after checking exit code 2 and nothing on stdout."""
    assert tool.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err  # one line: no usage block, no traceback
    return lines[0]
