"""The launchers on CPU (gloo): scripts/pretrain.sh started as two "nodes" on localhost trains exactly as one node
with the same ranks, the SLURM script drives it the same way, every launch that cannot work stops before training
with one line, and the example H200 layouts of docs/launching.md pass the trainer's validation."""
import json
import os
import signal
import re
import socket
import stat
import subprocess
import sys
import time

import pytest

from conftest import ROOT, child_env, free_port, made_once, run

LAUNCHER = ROOT / "scripts" / "pretrain.sh"
SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"
TINY = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "1", "--train-iters", "3",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "100", "--seed", "7"]
KNOBS = ("NNODES", "NODE_RANK", "GPUS_PER_NODE", "NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT", "RDZV_ENDPOINT",
         "RDZV_ID", "RDZV_TIMEOUT", "MASTER_WAIT_SECONDS", "RUN_DIR")


def launch_env(**knobs) -> dict:
    """The test's knobs only: a job scheduler's (or a developer's) own NNODES/MASTER_ADDR must not leak in."""
    env = child_env(PYTHON=sys.executable)
    for name in KNOBS:
        env.pop(name, None)
    env.update({k: str(v) for k, v in knobs.items()})
    return env


def launch(*args, timeout=120, **knobs) -> subprocess.CompletedProcess:
    return run(["bash", LAUNCHER, *args], timeout=timeout, env=launch_env(**knobs))


def train_losses(metrics) -> dict:
    records = [json.loads(line) for line in open(metrics)]
    assert [r["world_size"] for r in records if r["kind"] == "run" and "world_size" in r] == [2]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def last_line(proc) -> str:
    return proc.stderr.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory):
    """The reference: one node, two processes (the same two ranks as the two one-process nodes)."""
    def build(run_dir):
        proc = launch(*TINY, "--metrics-file", run_dir / "metrics.jsonl", GPUS_PER_NODE=2, RUN_DIR=run_dir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        command = (run_dir / "command.txt").read_text()
        assert "--standalone" in command and "--nproc-per-node 2 " in command and "--max-restarts 0" in command
        assert re.search(r"iteration +3/ +3 \|", (run_dir / "launch.log").read_text())  # the training's own output
        losses = train_losses(run_dir / "metrics.jsonl")
        assert sorted(losses) == [1, 2, 3]
        return losses
    return made_once(tmp_path_factory, "launcher-one-node", build)


@pytest.mark.parametrize("rendezvous", ["static", "c10d"])
def test_two_nodes_on_localhost_match_one_node(tmp_path, one_node_losses, rendezvous):
    port = free_port()
    if rendezvous == "static":
        knobs = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    else:
        knobs = dict(RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID="job-42")
    knobs.update(NNODES=2, RUN_DIR=tmp_path, RDZV_TIMEOUT=60)
    args = ["bash", str(LAUNCHER), *TINY, "--metrics-file", str(tmp_path / "metrics.jsonl")]
    # Node 1 first: it must wait for node 0 to listen rather than fail.
    nodes = [subprocess.Popen(args, env=launch_env(NODE_RANK=rank, **knobs), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
             for rank in (1, 0)]
    try:
        outputs = [node.communicate(timeout=120) for node in nodes]
    finally:  # a hung rendezvous must not leave torchrun and its workers behind
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out[-3000:] + err[-3000:]
    assert train_losses(tmp_path / "metrics.jsonl") == one_node_losses  # bit-identical: same ranks, same math
    if rendezvous == "c10d":  # torchrun assigns the node ranks; the files are named after the host
        host = socket.gethostname().split(".")[0]
        command = (tmp_path / f"command.{host}.txt").read_text()
        assert f"--nnodes 2 --nproc-per-node 1 --max-restarts 0 --rdzv-backend c10d --rdzv-endpoint " \
               f"127.0.0.1:{port} --rdzv-id job-42 --rdzv-conf join_timeout=60 -m litespark_megatron" in command
        return
    node1_out, node0_out = outputs[0][0], outputs[1][0]
    assert f"pretrain.sh: node 1 of 2, master 127.0.0.1:{port}, 1 process(es) on cpu, world size 2" in node1_out
    assert f"pretrain.sh: master 127.0.0.1:{port} reachable after" in node1_out
    assert "using world size: 2" in node0_out  # Megatron-LM prints it on global rank 0, which lives on node 0
    assert "using world size" not in node1_out
    for rank in (0, 1):
        command = (tmp_path / f"command.node{rank}.txt").read_text()
        assert f"--nnodes 2 --nproc-per-node 1 --max-restarts 0 --node-rank {rank} --master-addr 127.0.0.1 " \
               f"--master-port {port} --rdzv-conf timeout=60 -m litespark_megatron --model tiny" in command
        assert (tmp_path / f"launch.node{rank}.log").is_file()


def fake_slurm(bin_dir):
    """`srun`, `scontrol` and `scancel` stand-ins: srun records its options and runs the task once per node, in
    parallel, with that node's SLURM_NODEID (what SLURM does with --ntasks-per-node=1), and lists the tasks' pids;
    `scancel --signal=S` sends S to every process of those tasks (slurmstepd signals every process of a step);
    `scontrol requeue` is recorded."""
    bin_dir.mkdir()
    scripts = {
        "scontrol": '#!/usr/bin/env bash\n'
                    'if [ "$1" = requeue ]; then echo "requeue $2" >> "$SCONTROL_LOG"; exit 0; fi\n'
                    '[ "$1 $2" = "show hostnames" ] || exit 1\nprintf "%s\\n" ${3//,/ }\n',
        "srun": '#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS_FILE"\n'
                'while [[ $1 == -* ]]; do shift; done\npids=()\n'
                'for ((n = 0; n < SLURM_NNODES; n++)); do SLURM_NODEID=$n "$@" & pids+=($!); done\n'
                'echo "${pids[@]}" > "$SRUN_ARGS_FILE.tasks"\n'
                'rc=0\nfor p in "${pids[@]}"; do wait "$p" || rc=$?; done\nexit $rc\n',
        "scancel": '#!/usr/bin/env bash\nsig=${1#--signal=}\n'
                   'tree() { echo "$1"; for c in $(pgrep -P "$1"); do tree "$c"; done; }\n'
                   'for t in $(cat "$SRUN_ARGS_FILE.tasks"); do kill -s "$sig" $(tree "$t") 2>/dev/null; done\n'
                   'exit 0\n',
    }
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_slurm_script_runs_the_launcher_on_every_node(tmp_path, one_node_losses):
    fake_slurm(tmp_path / "bin")
    port = free_port()
    env = launch_env(MASTER_PORT=port, RUN_DIR=tmp_path / "run", RDZV_TIMEOUT=60)
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}", SRUN_ARGS_FILE=str(tmp_path / "srun_args"),
               SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_NNODES="2", SLURM_CPUS_ON_NODE="2",
               SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1", SLURM_SUBMIT_DIR=str(ROOT))
    proc = run(["bash", SBATCH, *TINY, "--metrics-file", tmp_path / "metrics.jsonl"], timeout=120, env=env,
               cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"pretrain.sbatch: job 4242, 2 node(s) (127.0.0.1,127.0.0.1), master 127.0.0.1:{port}" in proc.stdout
    srun_args = (tmp_path / "srun_args").read_text().splitlines()
    assert srun_args[:3] == ["--ntasks-per-node=1", "--cpus-per-task=2", "--kill-on-bad-exit=1"]
    for rank in (0, 1):
        command = (tmp_path / "run" / f"command.node{rank}.txt").read_text()
        assert f"--nnodes 2 --nproc-per-node 1 --max-restarts 0 --node-rank {rank} --master-addr 127.0.0.1 " \
               f"--master-port {port} " in command
    assert train_losses(tmp_path / "metrics.jsonl") == one_node_losses


def test_ctrl_c_saves_on_every_rank_and_the_launch_exits_0(tmp_path):
    """Ctrl-C on a terminal signals the launcher's process group (the script and torchrun; the workers have their
    own sessions). The script asks the workers to stop, they save one checkpoint at the same step and exit 0, and
    so do torchrun (which ignores the signal instead of failing the job) and the script. The same command resumes."""
    save = tmp_path / "ck"
    flags = [*TINY, "--train-iters", "300", "--save", save, "--load", save, "--save-interval", "1000"]
    env = launch_env(GPUS_PER_NODE=2, RUN_DIR=tmp_path / "run")
    proc = subprocess.Popen(["bash", str(LAUNCHER), *map(str, flags)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True)
    deadline = time.time() + 240
    while not (save / "metrics.jsonl").exists() or '"step": 3,' not in (save / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, "no step 3"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "pretrain.sh: SIGINT: asking the training processes to save a checkpoint at the next step and exit" in out
    assert "exiting program after receiving SIGTERM" in out and "SignalException" not in err
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 300
    resumed = launch(*flags, "--exit-interval", str(saved + 2), GPUS_PER_NODE=2, RUN_DIR=tmp_path / "run2",
                     timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    steps = [json.loads(line)["step"] for line in (save / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]
    assert steps == list(range(1, saved + 3)), steps


def test_slurm_time_limit_saves_and_requeues(tmp_path):
    """Near the time limit SLURM sends USR1 to the batch script (#SBATCH --signal=B:USR1@300): it has the job's
    steps signalled (SIGTERM to every process), both nodes save at one step and exit 0, and the job is requeued
    (#SBATCH --requeue). (That the same command resumes: test_ctrl_c_saves_on_every_rank_and_the_launch_exits_0.)"""
    fake_slurm(tmp_path / "bin")
    save = tmp_path / "ck"
    env = launch_env(MASTER_PORT=free_port(), RUN_DIR=tmp_path / "run", RDZV_TIMEOUT=60)
    env.update(PATH=f"{tmp_path / 'bin'}{os.pathsep}{env['PATH']}", SRUN_ARGS_FILE=str(tmp_path / "srun_args"),
               SCONTROL_LOG=str(tmp_path / "scontrol.log"), SLURM_JOB_ID="4243", SLURM_JOB_NUM_NODES="2",
               SLURM_NNODES="2", SLURM_CPUS_ON_NODE="2", SLURM_JOB_NODELIST="127.0.0.1,127.0.0.1",
               SLURM_SUBMIT_DIR=str(ROOT))
    flags = [*TINY, "--train-iters", "300", "--save", save, "--load", save, "--save-interval", "1000"]
    proc = subprocess.Popen(["bash", str(SBATCH), *map(str, flags)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path, env=env, start_new_session=True)
    deadline = time.time() + 240
    while not (save / "metrics.jsonl").exists() or '"step": 3,' not in (save / "metrics.jsonl").read_text():
        assert proc.poll() is None and time.time() < deadline, "no step 3"
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert "pretrain.sbatch: the time limit is near" in out and "pretrain.sbatch: requeueing job 4243" in out
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4243\n"
    saved = int((save / "latest_checkpointed_iteration.txt").read_text())
    assert 3 <= saved < 300


# --------------------------------------------------------------------------------------------- bad launches
@pytest.mark.parametrize("knobs, message", [
    (dict(NNODES=2, NODE_RANK=2, MASTER_ADDR="127.0.0.1"),
     "pretrain.sh: error: NODE_RANK=2 is out of range for NNODES=2: give each node a different NODE_RANK from 0 to "
     "1, node 0 being the one at MASTER_ADDR"),
    (dict(NNODES=2, NODE_RANK=1),
     "pretrain.sh: error: NNODES=2 needs MASTER_ADDR (an address of the NODE_RANK=0 node that every node can "
     "reach), or RDZV_ENDPOINT and RDZV_ID for torchrun's c10d rendezvous"),
    (dict(NNODES=2, RDZV_ENDPOINT="127.0.0.1:29400"),
     "pretrain.sh: error: RDZV_ENDPOINT=127.0.0.1:29400 needs RDZV_ID: give every node of the job the same RDZV_ID "
     "(the scheduler's job id, for example)"),
    (dict(NNODES="2:4", MASTER_ADDR="127.0.0.1"), "pretrain.sh: error: NNODES='2:4' must be an integer >= 1"),
    (dict(GPUS_PER_NODE=2, NPROC_PER_NODE=4),
     "pretrain.sh: error: GPUS_PER_NODE=2 and NPROC_PER_NODE=4 disagree: set only one of them"),
], ids=["node-rank-out-of-range", "no-master-addr", "c10d-without-id", "elastic-range", "nproc-disagree"])
def test_bad_knobs_fail_before_anything(tmp_path, knobs, message):
    proc = launch(*TINY, RUN_DIR=tmp_path / "run", **knobs)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message
    assert not (tmp_path / "run").exists(), "a refused launch writes nothing"


@pytest.mark.parametrize("script, first, last, after", [
    ("pretrain.sh", "Launch litespark-train with torchrun on this node", "NNODES=8 NODE_RANK=$i MASTER_ADDR=node0",
     "usage: litespark-train"),  # then the trainer's own flags
    ("loss_equivalence.sh", "Train the same model with stock Megatron-Core and with Litespark",
     "Exit status: 0 all within tolerance", None),
])
def test_help_is_the_scripts_header(script, first, last, after):
    """--help prints the script's own header comment (scripts/_lib.sh reads the file that sources it), exit 0."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / script), "--help"], capture_output=True, text=True,
                          timeout=120, env=launch_env())
    assert proc.returncode == 0, proc.stderr
    header, found, _ = proc.stdout.partition(f"\n\n{after}") if after else (proc.stdout, True, "")
    assert found, proc.stdout[-500:]
    lines = header.splitlines()
    assert lines[0].startswith(first) and lines[-1].strip().startswith(last), (lines[0], lines[-1])
    assert not any(line.startswith("#") or "set -euo" in line for line in lines)


def test_layout_that_does_not_fit_the_processes_is_refused_before_training(tmp_path):
    proc = launch(*TINY, "--tensor-model-parallel-size", "2", GPUS_PER_NODE=3, RUN_DIR=tmp_path)
    assert proc.returncode == 2
    assert last_line(proc) == (
        "pretrain.sh: error: NNODES x GPUS_PER_NODE = 1 x 3 = 3 processes is not divisible by TP x PP x CP = "
        "2 x 1 x 1 = 2 (from the training arguments): choose GPUS_PER_NODE and NNODES whose product is a multiple "
        "of 2, or change the parallel layout")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "torch.distributed.run" in proc.stdout and "litespark-train:" not in proc.stdout  # nothing started
    command = (tmp_path / "command.txt").read_text()
    assert "-m torch.distributed.run --nnodes 1 --nproc-per-node 3 --max-restarts 0 --standalone " \
           "-m litespark_megatron --model tiny" in command and "--tensor-model-parallel-size 2" in command
    assert (tmp_path / "launch.log").read_text().strip().splitlines()[-1] == last_line(proc)


def test_unreachable_master_is_a_bounded_wait(tmp_path):
    port = free_port()  # nobody listens there
    start = time.monotonic()
    proc = launch(*TINY, NNODES=2, NODE_RANK=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, MASTER_WAIT_SECONDS=3,
                  RUN_DIR=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2
    assert last_line(proc) == (
        f"pretrain.sh: error: cannot reach the master at MASTER_ADDR=127.0.0.1 MASTER_PORT={port} within "
        "MASTER_WAIT_SECONDS=3 (Connection refused): start the NODE_RANK=0 node (it listens there), check both "
        "variables and the firewall, or raise MASTER_WAIT_SECONDS")
    assert 3 <= elapsed < 45, elapsed
    assert "litespark-train:" not in proc.stdout
    assert "--node-rank 1 --master-addr 127.0.0.1" in (tmp_path / "command.node1.txt").read_text()


def test_busy_master_port_on_node_zero(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = launch(*TINY, NNODES=2, NODE_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RUN_DIR=tmp_path)
    assert proc.returncode == 2
    assert last_line(proc) == (
        f"pretrain.sh: error: MASTER_PORT={port} is already in use on this node (another job, or a previous run "
        "still exiting): choose another MASTER_PORT for every node")


def test_missing_node_fails_within_the_rendezvous_timeout(tmp_path):
    """Node 0 alone: torchrun's static rendezvous gives up after RDZV_TIMEOUT instead of waiting forever."""
    start = time.monotonic()
    proc = launch(*TINY, NNODES=2, NODE_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RDZV_TIMEOUT=3,
                  RUN_DIR=tmp_path)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "waiting for clients. 1/2 clients joined" in proc.stderr, proc.stderr[-3000:]
    assert elapsed < 60, elapsed
    assert "litespark-train:" not in proc.stdout


# --------------------------------------------------------------------------------------------- example layouts
# docs/launching.md's table: (config, nodes, overrides) for 8 x H200 nodes, global batch 256 x 4096.
TABLE = [
    ("llama3b-h200.yaml", 1, [], (1, 1, 1, 8)),
    ("llama3b-h200.yaml", 8, [], (1, 1, 1, 64)),
    ("llama3b-h200.yaml", 64, ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--micro-batch-size", "1"],
     (2, 1, 1, 256)),
    ("llama30b-h200.yaml", 1, ["--pipeline-model-parallel-size", "2"], (4, 2, 1, 1)),
    ("llama30b-h200.yaml", 8, [], (4, 1, 1, 16)),
    ("llama30b-h200.yaml", 64, [], (4, 1, 1, 128)),
]


# The example configs leave the data to the command line (as docs/launching.md shows): mock data stands in for it.
DATA = ["--mock-data", "--tokenizer-type", "NullTokenizer"]


def check_layout(capsys, nnodes, *train_args):
    from litespark_megatron.apps import launch_check

    rc = launch_check.main(["--prog", "check", "layout", "--nnodes", str(nnodes), "--nproc-per-node", "8",
                            "--assume-gpu", "--", *map(str, train_args), *DATA])
    out, err = capsys.readouterr()
    return rc, out.strip(), err.strip()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("config, nodes, overrides, layout", TABLE,
                         ids=[f"{c.split('-')[0]}-{n}node" for c, n, _, _ in TABLE])
def test_example_layouts_validate(capsys, config, nodes, overrides, layout, fp8):
    flags = ["--config", ROOT / "examples" / config, *overrides] + (["--fp8-format", "hybrid"] if fp8 else [])
    rc, out, err = check_layout(capsys, nodes, *flags)
    assert rc == 0, err
    tp, pp, cp, dp = layout
    assert out == f"8 cuda 9 {tp} {pp} {cp}"
    assert nodes * 8 == tp * pp * cp * dp


def test_why_the_table_changes_layout_at_64_nodes(capsys):
    """256 sequences cannot be spread over 512 data-parallel ranks: the 3B config needs TP2 there, and the 30B
    config's default TP4 PP1 is what fits there (checked above); its 1-node PP2 is about memory, not validity."""
    rc, _, err = check_layout(capsys, 64, "--config", ROOT / "examples" / "llama3b-h200.yaml")
    assert rc == 2
    assert err.startswith("check: error: --global-batch-size 256 is not divisible by micro-batch x data-parallel = "
                          "4 x 512 = 2048: ")


def test_layout_check_reads_the_config_file(tmp_path, capsys):
    config = tmp_path / "tp2.yaml"
    config.write_text("model: tiny\ntensor-model-parallel-size: 2\nlr: 1.0e-3\ntrain-iters: 10\neval-interval: 10\n")
    rc, out, err = check_layout(capsys, 1, "--config", config, "--micro-batch-size", "1")
    assert rc == 0 and out == "8 cuda 9 2 1 1", err
    from litespark_megatron.apps import launch_check

    rc = launch_check.main(["--prog", "check", "layout", "--nnodes", "1", "--nproc-per-node", "3", "--assume-gpu",
                            "--", "--config", str(config)])
    out, err = capsys.readouterr()
    assert rc == 2 and out.strip() == "3 cuda 9 - - -"
    assert err.strip().startswith("check: error: NNODES x GPUS_PER_NODE = 1 x 3 = 3 processes is not divisible")
