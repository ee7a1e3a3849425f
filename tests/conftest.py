"""Helpers to run code in fresh processes: megatron-core keeps global state (process groups, CPU shims), so every
test that builds a model runs it in its own process (or torchrun group) with its own port."""
import importlib.util
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# The stop tests send the runs they start Ctrl-C's SIGINT. A test session started in the background of a
# non-interactive shell (`nohup ... &`) inherits SIGINT ignored, its children would too, and bash cannot trap a
# signal ignored at its entry: their handlers would never run. Children inherit the default instead.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

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


# How two workers share the suite (scripts/test.sh: pytest-xdist's --dist loadgroup, without groups: each test is
# its own unit, handed out in this order whenever a worker has run down its queue). Most of the time is a few long
# tests: they go first (measured with --durations; a name that no longer matches only loses its place), so the run
# ends on short tests, not on one long test alone while the other worker idles.
LONGEST_FIRST = (
    "test_architectures.py::test_layout_matches_single_process",
    "test_peft.py",
    "test_quickstart.py",
    "test_parallel_parity.py",
    "test_trainer.py::test_resume_is_bit_exact_with_the_distributed_optimizer",
    "test_trainer.py::test_checkpoint_reshards_tp2_to_tp1_and_pp2",
    "test_hf_parallel.py::test_ddp_and_fsdp2_on_two_ranks_train_what_one_process_trains",
    "test_hf.py::test_import_loads_in_tp2pp2_with_transformers_logits",
    "test_efficiency.py::test_end_to_end_writes_table_json_csv_plots_and_tensorboard",
    "test_cross_entropy_kernel.py::test_reference_is_the_cross_entropy_of_the_whole_vocabulary",
    "test_launcher.py::test_two_nodes_on_localhost_match_one_node",
    "test_launcher.py::test_ctrl_c_saves_on_every_rank_and_the_launch_exits_0",
    "test_checkpoint_dir.py::test_killed_save_is_removed_and_the_run_resumes_from_the_one_before",
    "test_checkpoints.py::test_litespark_checkpoint_resumes_in_megatron_lm_and_back",
    "test_checkpoint_dir.py::test_a_run_that_does_not_load_its_save_directory_leaves_the_checkpoints_there",
    "test_efficiency.py::test_interrupted_suite_stops_its_run_and_resumes",
    "test_cross_entropy_kernel.py::test_the_flag_trains_as_megatron_cores_loss",
    "test_hf.py",
    "test_layout_sweep.py",
    "test_trainer.py::test_stop_signal_saves_and_exits_0_and_resume_continues_bit_exactly",
    "test_benchmark.py::test_cpu_end_to_end_with_a_failing_system",
    "test_telemetry.py::test_a_restart_after_a_kill_leaves_one_record_per_step",
    "test_launcher.py",
    "test_loss_equivalence.py",
    "test_trainer.py",
    "test_checkpoint_dir.py",
    "test_checkpoints.py",
)


def _place(item) -> int:
    name = f"{item.path.name}::{item.originalname}"
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if prefix in (name, item.path.name)), len(LONGEST_FIRST))


def pytest_collection_modifyitems(config, items):
    if GPU_PASS:
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("gpu") is None])
        items[:] = [i for i in items if i.get_closest_marker("gpu") is not None]
    items.sort(key=_place)  # stable: the rest keep their order


# Ports for the children's rendezvous come from a block of this xdist worker's own, below the kernel's ephemeral
# range: a port-0 choice, closed and handed to a child, was once taken in between by another worker's gloo (which
# binds ephemeral ports all the time); nothing else hands out these, and no two workers share a block.
# 30 blocks below 32768: a 16-core machine runs 16 workers, whose blocks must not overlap (with 12 blocks, workers
# 2 and 14 once bound the same port).
PORT_BLOCK = 400
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
_PORT_START = 20000 + PORT_BLOCK * ((int(_WORKER[2:]) if _WORKER[2:].isdigit() else 0) % 30)
_PORTS = itertools.cycle(range(_PORT_START, _PORT_START + PORT_BLOCK))


def free_port() -> int:
    for port in itertools.islice(_PORTS, PORT_BLOCK):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # in use (or lingering) from an earlier run: the next one
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_START}-{_PORT_START + PORT_BLOCK - 1}")


# What torchrun gives its ranks: a child of the test process is not one unless a test says so (an in-process call
# that set one of these must not turn every later child into "rank 0 of 8").
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


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


def train(nproc: int, *flags, timeout=300, env=None) -> subprocess.CompletedProcess:
    """litespark-train in fresh processes: `python -m litespark_megatron` for one, torchrun for more."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "litespark_megatron", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, "--master-addr",
               "127.0.0.1", "--master-port", free_port(), "-m", "litespark_megatron", *flags]
    return run(cmd, timeout=timeout, env=env or child_env(MASTER_PORT=free_port()))


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
    """Train in a layout; its per-step losses and grad norms (metrics.jsonl, log interval 1)."""
    metrics = tmp_path / f"metrics_{free_port()}.jsonl"
    ok(train(nproc, *flags, "--log-interval", "1", "--metrics-file", metrics, env=env))
    rows = records(metrics, "train")
    return {"losses": [r["loss"] for r in rows], "grad_norms": [r["grad_norm"] for r in rows]}


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


SAVED_TENSOR_MODELS = {  # name -> litespark-train flags of the tiny model (tests/saved_tensors_worker.py)
    "rope-gqa": "--spec litespark --transformer-impl local",
    "nope-gqa": "--spec litespark --transformer-impl local --position-embedding-type none",
    "nope-mha": "--spec litespark --transformer-impl local --position-embedding-type none --num-query-groups 4",
    "chunked-loss": "--spec litespark --transformer-impl local --chunked-output-loss 4",
}


@pytest.fixture(scope="session")
def saved_tensors():
    """What each of SAVED_TENSOR_MODELS keeps for the backward of a training forward, from one worker process."""
    proc = run([sys.executable, TESTS / "saved_tensors_worker.py", *SAVED_TENSOR_MODELS.values()],
               env=child_env(MASTER_PORT=free_port()))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(zip(SAVED_TENSOR_MODELS, json.loads(proc.stdout.strip().splitlines()[-1])))
