"""The suite's own helpers (tests/conftest.py): made_once builds a fixture's result once per test run, whichever
workers ask, and a failed build leaves nothing a later asker would take for a result; the rooms: a test is filed
as integration when its code, its fixtures or the test functions they call start a process, else as unit."""
import pickle
import subprocess
import sys

import pytest

import conftest
from conftest import ROOT, made_once, run, train

ASK = """
import sys, time
sys.path.insert(0, {tests!r})
from pathlib import Path
from conftest import made_once

class Factory:  # what made_once reads of pytest's tmp_path_factory
    def getbasetemp(self):
        return Path({base!r})

def build(directory):
    with open({log!r}, "a") as log:
        log.write("built\\n")
    time.sleep(1)  # the other asker arrives while this one builds
    (directory / "file").write_text("content")
    return {{"answer": 42, "file": directory / "file"}}

result = made_once(Factory(), "shared", build)
assert result["answer"] == 42 and result["file"].read_text() == "content", result
"""


def test_two_workers_asking_at_once_build_once(tmp_path):
    """Two xdist workers of one run (their temporary directories side by side) ask at the same time."""
    log = tmp_path / "log"
    procs = []
    for worker in ("gw0", "gw1"):
        (tmp_path / f"popen-{worker}").mkdir()
        code = ASK.format(tests=str(ROOT / "tests"), base=str(tmp_path / f"popen-{worker}"), log=str(log))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env={"PYTEST_XDIST_WORKER": worker,
                                                                         "PATH": "/usr/bin:/bin"}))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert log.read_text() == "built\n"
    assert pickle.loads((tmp_path / "made-once" / "shared.pickle").read_bytes())["answer"] == 42


def test_a_failed_build_is_built_again_by_the_next_asker(factory):
    calls = []

    def failing(directory):
        calls.append("failing")
        (directory / "half-written").write_text("")
        raise RuntimeError("the build failed")

    def working(directory):
        calls.append("working")
        assert not (directory / "half-written").exists()  # a clean directory
        return "result"

    with pytest.raises(RuntimeError, match="the build failed"):
        made_once(factory, "thing", failing)
    assert made_once(factory, "thing", working) == "result"
    assert made_once(factory, "thing", failing) == "result"  # built: not asked again
    assert calls == ["failing", "working"]


@pytest.fixture
def factory(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)

    class Factory:
        def getbasetemp(self):
            return tmp_path
    return Factory()


def _pure(x):
    return x + 1


def _calls_train_two_levels_down():
    return _helper()


def _helper():
    return train(1, "--model", "tiny")


def test_the_rooms_follow_a_test_into_its_helpers_lambdas_and_the_subprocess_module():
    starts = conftest._starts_processes
    assert not starts(_pure, set())
    assert starts(_calls_train_two_levels_down, set())  # a helper of a helper
    assert starts(lambda: run(["true"]), set())
    assert starts(lambda: [subprocess.run(["true"]) for _ in range(1)], set())  # inside a comprehension's code
    assert not starts(lambda: pickle.dumps(1), set())


def test_the_suite_files_its_tests_in_both_rooms(request):
    """This test runs in-process: unit (its helpers above are only referenced by other tests)."""
    assert request.node.get_closest_marker("unit") is not None
    assert request.node.get_closest_marker("integration") is None


@pytest.mark.parametrize("workers", [1, 2, 4, 16, 30, 32, 48, 64])
def test_each_worker_has_its_own_ports_below_the_ephemeral_range(workers):
    """No two xdist workers share a rendezvous port (64 workers on a 64-core machine), and none is in the kernel's
    ephemeral range, where gloo binds."""
    from conftest import port_block

    blocks = [port_block(f"gw{i}", workers) for i in range(workers)]
    ports = [port for block in blocks for port in block]
    assert len(set(ports)) == len(ports)
    assert min(ports) >= 20000 and max(ports) < 32768
    assert min(len(block) for block in blocks) >= 100
