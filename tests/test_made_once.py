"""conftest.made_once: a fixture's result built once per test run, whichever workers ask; a failed build leaves
nothing behind that a later asker would take for a result."""
import pickle
import subprocess
import sys

import pytest

from conftest import ROOT, made_once

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
