"""Helpers to run code in fresh processes: megatron-core keeps global state (process groups, CPU shims), so every
test that builds a model runs it in its own process (or torchrun group) with its own port."""
import importlib.util
import itertools
import json
import multiprocessing
import os
import pickle
import signal
import socket
import subprocess
import sys
import types
from pathlib import Path

import pytest

from zygote import RANK_VARIABLES, start_env  # (tests/zygote.py: what a forked run may differ in)

# The stop tests send the runs they start Ctrl-C's SIGINT. A test session started in the background of a
# non-interactive shell (`nohup ... &`) inherits SIGINT ignored, its children would too, and bash cannot trap a
# signal ignored at its entry: their handlers would never run. Children inherit the default instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
WORKER_DIR = TESTS / "workers"  # the scripts the tests start as processes (ranks, trainers, converters)

# Two passes (scripts/test.sh). The suite checks the CPU path (gloo, the CPU shims, what a CPU run reports) on every
# machine: its assertions say what a CPU computes and its layouts start more ranks than a machine has GPUs, so it
# runs as on a machine without a GPU: the GPUs hidden from this process and its children (CUDA reads the variable at
# its first use, which no test has made yet), and Transformer Engine not importable (cpu_machine/sitecustomize.py,
# first on every child's path). On a machine with a GPU, the tests marked `gpu` (CUDA-only ones, and ones that check
# what must hold on any device) run again, alone, on the machine as it is: LITESPARK_TEST_GPU=1.
GPU_PASS = os.environ.get("LITESPARK_TEST_GPU") == "1"
if not GPU_PASS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["LITESPARK_TEST_NO_TE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join([str(TESTS / "cpu_machine"),
                                                os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    _spec = importlib.util.spec_from_file_location("litespark_test_cpu_machine",
                                                   TESTS / "cpu_machine" / "sitecustomize.py")
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))  # this process too

# xdist workers share the machine's cores: each worker, and each process it starts from its environment (the tools'
# runs: the layout sweep's, the benchmark's workers, the launcher's), gets its share of them as torch's intra-op
# threads instead of torch's default of every core. Two workers of two OpenMP threads each on two cores spin on
# each other's cores: a run took three times its CPU time so. A value given in the environment is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))
    if "torch" in sys.modules:  # (torch reads the variable when it starts its thread pool, at its first use)
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# How two workers share the suite (scripts/test.sh: pytest-xdist's --dist loadgroup, without groups: each test is
# its own unit, handed out in this order whenever a worker has run down its queue). Most of the time is a few long
# tests: they go first (measured with --durations; a name that no longer matches only loses its place), so the run
# ends on short tests, not on one long test alone while the other worker idles.
LONGEST_FIRST = (
    "test_quickstart.py::test_quickstart_short",
    "test_hf_parallel.py::test_ddp_and_fsdp2_on_two_ranks_train_what_one_process_trains",
    "test_peft.py",
    "test_quickstart.py::test_the_efficiency_base_recipe_exports_only_a_finished_run",
    "test_efficiency.py::test_finetune_axis_runs_the_six_variants_from_one_base",
    "test_launcher.py::test_ctrl_c_saves_on_every_rank_and_the_launch_exits_0",
    "test_cross_entropy_kernel.py::test_reference_is_the_cross_entropy_of_the_whole_vocabulary",
    "test_launcher.py::test_slurm_time_limit_saves_and_requeues",
    "test_loss_equivalence.py::test_resume_goes_on_from_a_runs_checkpoint_and_draws_the_unbroken_curve",
    "test_layout_sweep.py::test_rows_say_what_ran_and_a_fallback_fails_the_sweep",
    "test_trainer.py::test_stop_signal_saves_and_exits_0_and_resume_continues_bit_exactly",
    "test_trainer.py::test_checkpoint_reshards_tp2_to_tp1_and_pp2",
    "test_loss_equivalence.py::test_same_function_same_curve_and_a_different_run_is_caught",
    "test_launcher.py::test_slurm_script_runs_the_launcher_on_every_node",
    "test_telemetry.py::test_a_restart_after_a_kill_leaves_one_record_per_step",
    "test_layout_sweep.py::test_megatron_layouts_beside_hf_ones_train_on_random_tokens",
    "test_loss_equivalence.py::test_concurrent_waves_place_each_run_on_its_own_gpus",
    "test_launcher.py::test_two_nodes_on_localhost_match_one_node",
    "test_architectures.py::test_layout_matches_single_process",
    "test_parallel_parity.py",
    "test_checkpoints.py::test_litespark_checkpoint_resumes_in_megatron_lm_and_back",
    "test_zygote.py::test_a_forked_run_trains_what_torchrun_trains",
    "test_benchmark.py::test_cpu_hf_eager_baseline_and_ratios",
    "test_trainer.py::test_nan_loss_stops_the_run",
    "test_trainer.py::test_resume_is_bit_exact_with_the_distributed_optimizer",
    "test_hf_convert.py::test_import_loads_in_tp2pp2_with_transformers_logits",
    "test_efficiency.py::test_end_to_end_writes_table_json_csv_plots_and_tensorboard",
    "test_checkpoint_dir.py::test_killed_save_is_removed_and_the_run_resumes_from_the_one_before",
    "test_checkpoint_dir.py::test_a_run_that_does_not_load_its_save_directory_leaves_the_checkpoints_there",
    "test_efficiency.py::test_interrupted_suite_stops_its_run_and_resumes",
    "test_inference_bench.py::test_end_to_end_reports_every_variant_and_resumes_only_what_did_not_finish",
    "test_cross_entropy_kernel.py::test_the_flag_trains_as_megatron_cores_loss",
    "test_hf_convert.py",
    "test_layout_sweep.py",
    "test_benchmark.py::test_cpu_end_to_end_with_a_failing_system",
    "test_launcher.py",
    "test_loss_equivalence.py",
    "test_stdlib_sft.py::test_a_run_on_the_embedded_set_learns",
    "test_sft_training.py",
    "test_trainer.py",
    "test_checkpoint_dir.py",
    "test_checkpoints.py",
)


def _place(item) -> int:
    name = f"{item.path.name}::{item.originalname}"
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if prefix in (name, item.path.name)), len(LONGEST_FIRST))


# Two rooms: `unit` tests run in this process; `integration` tests start processes (trainers, torchrun ranks,
# converters, the tools' workers). `pytest -m unit` is the quick loop (about a minute); the CI gate is the whole
# suite. A test is integration when it, a fixture it uses, or a function of the tests it calls (followed through
# their code) reaches a helper below that starts a process, or the subprocess module; a test whose process starts
# deeper, inside the package (the benchmark's workers, ...), says so with @pytest.mark.integration. A test filed as
# unit that starts a process fails, with the line to add (_unit_tests_start_no_process, below).
def _starts_processes(fn, seen) -> bool:
    code = getattr(fn, "__code__", None)
    if code is None or fn in seen:
        return False
    seen.add(fn)
    names, stack = set(), [code]
    while stack:  # the function's names, and those of the lambdas and inner functions it defines
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    for name in names:
        obj = fn.__globals__.get(name)
        if obj is subprocess or obj is multiprocessing or any(obj is s for s in _SPAWNERS):
            return True
        if isinstance(obj, types.FunctionType) and str(TESTS) in (obj.__code__.co_filename or "") \
                and _starts_processes(obj, seen):
            return True
    return False


def _is_integration(item) -> bool:
    if item.get_closest_marker("integration"):
        return True
    seen = set()
    fixtures = getattr(item, "_fixtureinfo", None)
    defs = [d for ds in (fixtures.name2fixturedefs.values() if fixtures else ()) for d in ds]
    ours = [d.func for d in defs if str(TESTS) in getattr(getattr(d.func, "__code__", None), "co_filename", "")
            and d.argname not in ("_unit_tests_start_no_process", "_imports_that_start_processes")]  # the guards
    return any(_starts_processes(f, seen) for f in [getattr(item, "function", None)] + ours)


def pytest_collection_modifyitems(config, items):
    if GPU_PASS:
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gpu") is None])
        items[:] = [i for i in items if i.get_closest_marker("gpu") is not None]
    for item in items:
        item.add_marker(pytest.mark.integration if _is_integration(item) else pytest.mark.unit)
    # The first test of each listed group, then the rest of the groups, then the others (a stable sort: each keeps
    # its order within). A group's tests share what made_once builds: with its first test alone at the front, one
    # worker builds it while the others run other long tests, instead of all of them waiting for it at once.
    places = [_place(item) for item in items]
    firsts = {p: i for i, p in reversed(list(enumerate(places)))}
    order = {id(item): (0 if firsts[p] == i and p < len(LONGEST_FIRST) else 1, p)
             for i, (item, p) in enumerate(zip(items, places))}
    items.sort(key=lambda item: order[id(item)])


@pytest.fixture(scope="session", autouse=True)
def _imports_that_start_processes():
    """Libraries that start a process when first imported (megatron-core runs `git rev-parse` for its package info;
    torch._dynamo and peft run `ldconfig -p` through Triton's driver lookup; megatron.training, where cuda-python is
    installed (GPU machines), runs `ldconfig -p` through cuda.core's library finder): imported here, before any test,
    so that the check below sees the tests' own processes only, whichever test imports them first."""
    import megatron.core  # noqa: F401
    import megatron.training  # noqa: F401
    import torch._dynamo  # noqa: F401
    try:
        import peft  # noqa: F401
    except ImportError:  # an optional dependency (the dev extra has it)
        pass


@pytest.fixture(autouse=True)
def _unit_tests_start_no_process(request, monkeypatch):
    """A test filed as unit may not start a process: its classification would be wrong, and the quick loop slow.
    Checked in the CPU pass: on a GPU, Triton starts ptxas to compile a kernel (a process of the toolchain, not of
    the test)."""
    if GPU_PASS or request.node.get_closest_marker("unit") is None:
        return

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process but was filed as a unit test: mark it "
                             "@pytest.mark.integration (tests/conftest.py)")
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    monkeypatch.setattr(os, "fork", refuse)


def made_once(tmp_path_factory, name: str, build):
    """`build(directory)`'s result, built once per test run whichever workers ask for it. A module fixture is set up
    again on every worker that runs one of the module's tests, and again on one worker whenever another module's
    test ran in between (the suite's longest-first order interleaves modules): the expensive ones (training runs,
    conversions) share their result through this instead. The first asker builds it under a lock in a directory
    all workers of the run share (the parent of xdist's per-worker temporary directories); the others wait and read
    its pickle. The result is read, never changed, by the tests (they may run at the same time on other workers)."""
    import filelock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # the run's own directory, above popen-gw0, popen-gw1, ...
    root = shared / "made-once"
    root.mkdir(exist_ok=True)
    done = root / f"{name}.pickle"
    with filelock.FileLock(str(root / f"{name}.lock")):
        if not done.exists():
            directory = root / name
            if directory.exists():  # an earlier asker's build failed there: start again
                import shutil
                shutil.rmtree(directory)
            directory.mkdir()
            result = build(directory)
            part = root / f"{name}.pickle.part"
            part.write_bytes(pickle.dumps(result))
            part.rename(done)
    return pickle.loads(done.read_bytes())


def run_interpreted(tmp_path_factory, name: str, code: str):
    """The JSON on the last line `code` prints, run once per test run (made_once) in a fresh process under Triton's
    interpreter: Triton reads TRITON_INTERPRET when it is first imported, so the test process cannot switch to it."""
    def build(_):
        proc = run([sys.executable, "-c", code], env=child_env(TRITON_INTERPRET=1))
        assert proc.returncode == 0, proc.stderr[-4000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])
    return made_once(tmp_path_factory, name, build)


# Ports for the children's rendezvous come from a block of this xdist worker's own, below the kernel's ephemeral
# range: a port-0 choice, closed and handed to a child, was once taken in between by another worker's gloo (which
# binds ephemeral ports all the time); nothing else hands out these, and no two workers share a block.
# The 12,768 ports from 20000 to the ephemeral range split among the workers: a block each, never shared (with 12
# blocks, workers 2 and 14 of 16 once bound the same port; with 30 fixed blocks, workers 30 and 31 of 32 shared
# workers 0's and 1's).
def port_block(worker: str, workers: int) -> range:
    """The ports of xdist worker `worker` ("gw3") of `workers`."""
    size = 12768 // max(30, workers)
    start = 20000 + size * (int(worker[2:]) if worker[2:].isdigit() else 0)
    return range(start, start + size)


_BLOCK = port_block(os.environ.get("PYTEST_XDIST_WORKER", "gw0"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
_PORTS = itertools.cycle(_BLOCK)


def free_port() -> int:
    for port in itertools.islice(_PORTS, len(_BLOCK)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering) from an earlier run: the next one
                continue
            return port
    raise RuntimeError(f"no free port in {_BLOCK.start}-{_BLOCK.stop - 1}")


# What torchrun gives its ranks (zygote.RANK_VARIABLES): a child of the test process is not one unless a test says so
# (an in-process call that set one of these must not turn every later child into "rank 0 of 8").
def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
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


def train(nproc: int, *flags, timeout=300, env=None, launcher="fork") -> subprocess.CompletedProcess:
    """litespark-train in fresh processes: as `python -m litespark_megatron` for one, as torchrun's ranks for more.
    launcher="fork": forked from the worker's zygote (below) where the environment allows, which is what a real
    process would run without its imports; "process": a real `python -m` (and torchrun), for tests of what happens
    at a process's start or of torchrun itself."""
    env = env or child_env(MASTER_PORT=free_port())
    if launcher == "fork" and zygote.can_run(env):
        return zygote.launch(nproc, "litespark_megatron", [str(f) for f in flags], env, timeout)
    if nproc == 1:
        cmd = [sys.executable, "-m", "litespark_megatron", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, "--master-addr",
               "127.0.0.1", "--master-port", free_port(), "-m", "litespark_megatron", *flags]
    return run(cmd, timeout=timeout, env=env)


def forked(nproc: int, target, *args, module: bool = False, timeout=300, env=None) -> subprocess.CompletedProcess:
    """`python TARGET ARGS` (a script; module=True: `python -m TARGET`), as torchrun's ranks for nproc > 1, forked
    from the worker's zygote where the environment allows, as `train` does; else real processes."""
    env = env or child_env(MASTER_PORT=free_port())
    if zygote.can_run(env):
        return zygote.launch(nproc, str(target), [str(a) for a in args], env, timeout, is_module=module)
    target = ["-m", target] if module else [target]
    if nproc == 1:
        return run([sys.executable, *target, *args], timeout=timeout, env=env)
    return torchrun(nproc, *target, *args, timeout=timeout, env=env)


def tool(script, *args, timeout=300, env=None) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGS` for a tool that starts one-process training runs (the efficiency suite):
    forked from the worker's zygote where the environment allows, and the runs it starts forked from it in turn
    (tests/zygote.py); else a real process, as `run`."""
    env = env or child_env()
    if zygote.can_run(env):
        return zygote.launch(1, str(script), [str(a) for a in args], env, timeout, is_module=False,
                             fork_children=True)
    return run([sys.executable, script, *args], timeout=timeout, env=env)


class Zygote:
    """tests/zygote.py, started once per test worker on first use: a process that imported torch and megatron-core
    and forks a run per request (a tiny training run's time is mostly those imports). It serves only runs whose
    environment equals its own except for what is read after the imports (ranks, ports, the project's run-time
    variables: zygote.RUN_TIME); any other gets a real process. LITESPARK_TEST_FORK=0: never."""

    def __init__(self):
        self.proc = None
        # Not in the GPU pass: a fork must not inherit CUDA state its parent's imports might have made.
        self.enabled = os.environ.get("LITESPARK_TEST_FORK", "1") != "0" and not GPU_PASS

    def can_run(self, env: dict) -> bool:
        return self.enabled and start_env(env) == start_env(child_env())

    def _server(self):
        if self.proc is None or self.proc.poll() is not None:
            import tempfile
            self.log = Path(tempfile.gettempdir()) / f"litespark-zygote-{os.getpid()}.log"
            with open(self.log, "w") as log:
                self.proc = subprocess.Popen([sys.executable, str(TESTS / "zygote.py")], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=log, text=True, env=child_env(),
                                             cwd=ROOT)
        return self.proc

    def _fork(self, env: dict, argv: list, folder: Path, name: str, target: str, is_module: bool,
              fork_children: bool = False) -> Path:
        request = {"target": target, "is_module": is_module, "argv": argv, "env": env, "cwd": str(ROOT),
                   "stdout": str(folder / f"{name}.out"), "stderr": str(folder / f"{name}.err"),
                   "status": str(folder / f"{name}.status"), "fork_children": fork_children}
        server = self._server()
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        if not server.stdout.readline():
            raise RuntimeError(f"the test zygote ended (its log: {self.log})")
        return folder / name

    @staticmethod
    def _status(run: Path):
        path = run.with_name(run.name + ".status")
        return int(path.read_text()) if path.exists() else None

    @staticmethod
    def _signal(run: Path, sig) -> None:
        path = run.with_name(run.name + ".status.pid")
        try:
            os.kill(int(path.read_text()), sig)
        except (OSError, ValueError):  # not started yet, or already ended
            pass

    def launch(self, nproc: int, target: str, argv: list, env: dict, timeout: float,
               is_module: bool = True, fork_children: bool = False) -> subprocess.CompletedProcess:
        """Run `python -m target argv` (nproc ranks, as torchrun starts them); what subprocess.run would return
        (ranks' outputs one after the other; torchrun's exit status: 1 if any rank failed). fork_children: the
        one-process training runs the target starts are forked from it (tests/zygote.py)."""
        import shutil
        import tempfile
        import time
        folder = Path(tempfile.mkdtemp(prefix="litespark-run-"))
        try:
            ranks = []
            for rank in range(nproc):
                rank_env = dict(env)
                if nproc > 1:
                    rank_env.update(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, LOCAL_WORLD_SIZE=nproc,
                                    GROUP_RANK=0, ROLE_RANK=rank, ROLE_WORLD_SIZE=nproc, MASTER_ADDR="127.0.0.1",
                                    MASTER_PORT=env.get("MASTER_PORT") or free_port())
                ranks.append(self._fork({k: str(v) for k, v in rank_env.items()}, argv, folder, f"rank{rank}",
                                        target, is_module, fork_children))
            deadline, failed_at, sent = time.monotonic() + timeout, None, set()
            stops = ((2, signal.SIGTERM), (12, signal.SIGKILL))
            while True:
                statuses = [self._status(r) for r in ranks]
                if all(s is not None for s in statuses):
                    break
                now = time.monotonic()
                if failed_at is None and any(s not in (None, 0) for s in statuses):
                    failed_at = now  # as torchrun: the other ranks are stopped when one fails
                for after, sig in stops:  # once each: torchrun's SIGTERM to the others, then SIGKILL
                    if failed_at is not None and now >= failed_at + after and sig not in sent:
                        sent.add(sig)
                        for r, s in zip(ranks, statuses):
                            if s is None:
                                self._signal(r, sig)
                if now > deadline:
                    for r in ranks:
                        self._signal(r, signal.SIGKILL)
                    while any(self._status(r) is None for r in ranks):
                        time.sleep(0.05)
                    out, err = self._outputs(ranks)
                    raise subprocess.TimeoutExpired([target, *argv], timeout, out, err)
                time.sleep(0.05)
            out, err = self._outputs(ranks)
            code = statuses[0] if nproc == 1 else (0 if all(s == 0 for s in statuses) else 1)
            return subprocess.CompletedProcess([sys.executable, "-m", target, *argv], code, out, err)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    @staticmethod
    def _outputs(ranks):
        read = lambda path: path.read_text(errors="replace") if path.exists() else ""  # noqa: E731
        return ("".join(read(r.with_name(r.name + ".out")) for r in ranks),
                "".join(read(r.with_name(r.name + ".err")) for r in ranks))


zygote = Zygote()


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def records(metrics_file, kind=None) -> list:
    rows = [json.loads(line) for line in Path(metrics_file).read_text().splitlines() if line.strip()]
    return [r for r in rows if kind is None or r["kind"] == kind]


def losses(metrics_file) -> dict:
    """step -> training loss of each log interval (log interval 1: every step)."""
    return {r["step"]: r["loss"] for r in records(metrics_file, "train")}


def parity_run(tmp_path, nproc: int, flags, env=None) -> dict:
    """Train in a layout; its per-step losses and grad norms (metrics.jsonl, log interval 1) and its run record."""
    metrics = tmp_path / f"metrics_{free_port()}.jsonl"
    ok(train(nproc, *flags, "--log-interval", "1", "--metrics-file", metrics, env=env))
    rows = records(metrics, "train")
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows],
            "run": records(metrics, "run")[0]}


# conftest's helpers that start processes (the rooms, above)
_SPAWNERS = (run, torchrun, train, forked, tool, parity_run)


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


def preset(name: str):
    """A --model preset's Megatron-LM arguments as attributes (num_layers, ...; num_query_groups for MHA too)."""
    from types import SimpleNamespace

    from litespark_megatron.presets import preset_values

    values = preset_values(name)
    values.setdefault("num_query_groups", values["num_attention_heads"])
    values.setdefault("untie_embeddings_and_output_weights", False)
    return SimpleNamespace(**values)


def running(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return "\nState:\tZ" not in status


SAVED_TENSOR_MODELS = {  # name -> litespark-train flags of the tiny model (tests/workers/saved_tensors_worker.py)
    "rope-gqa": "--spec litespark --transformer-impl local",
    "nope-gqa": "--spec litespark --transformer-impl local --position-embedding-type none",
    "nope-mha": "--spec litespark --transformer-impl local --position-embedding-type none --num-query-groups 4",
    "chunked-loss": "--spec litespark --transformer-impl local --chunked-output-loss 4",
}


@pytest.fixture(scope="session")
def saved_tensors():
    """What each of SAVED_TENSOR_MODELS keeps for the backward of a training forward, from one worker process."""
    proc = forked(1, WORKER_DIR / "saved_tensors_worker.py", *SAVED_TENSOR_MODELS.values())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(SAVED_TENSOR_MODELS, json.loads(proc.stdout.strip().splitlines()[-1])))
