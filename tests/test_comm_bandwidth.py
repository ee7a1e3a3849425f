"""tools/comm_bandwidth.py on the CPU (gloo): every collective at every size, bus bandwidth by NCCL's convention, a
collective that returns wrong values reports no speed, and bad input is one line."""
import json
import sys

import pytest

from conftest import ROOT, child_env, forked, load_tool, run


def test_two_ranks_measure_every_collective_at_every_size(tmp_path):
    out = tmp_path / "bw.json"
    proc = forked(2, ROOT / "tools" / "comm_bandwidth.py", "--sizes-mb", "0.25,1", "--iters", "2", "--out", out)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert (report["world_size"], report["backend"], report["dtype"]) == (2, "gloo", "bf16")
    assert [(r["op"], r["mib_per_rank"]) for r in report["rows"]] == [
        (op, size) for size in (0.25, 1.0) for op in ("all_gather", "reduce_scatter", "all_reduce")]
    for r in report["rows"]:
        assert r["seconds_per_call"] > 0
        # all-gather / reduce-scatter: the full buffer is 2 ranks' inputs, each link carries half of it; all-reduce:
        # the buffer is one rank's input, each link carries it 2 (n-1) / n = 1 times.
        full = r["mib_per_rank"] * 2**20 * (1 if r["op"] == "all_reduce" else 2)
        assert r["algorithm_gbps"] == pytest.approx(full / r["seconds_per_call"] / 1e9)
        assert r["bus_gbps"] == pytest.approx(r["algorithm_gbps"] * (1.0 if r["op"] == "all_reduce" else 0.5))
    assert "| all_gather | 0.25 | " in proc.stdout and "2 ranks, gloo, cpu, bf16" in proc.stdout


CORRUPT = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tools!r})
import comm_bandwidth
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
real = dist.all_gather_into_tensor
def corrupting(out, inp, *a, **k):
    real(out, inp, *a, **k)
    out[-1] = 0
dist.all_gather_into_tensor = corrupting
try:
    comm_bandwidth.measure("all_gather", 8, torch.float32, torch.device("cpu"), 1, 1)
except RuntimeError as e:
    print(e)
"""


def test_a_collective_that_returns_wrong_values_reports_no_speed():
    from conftest import free_port

    proc = run([sys.executable, "-c", CORRUPT.format(tools=str(ROOT / "tools")), free_port()], env=child_env())
    assert proc.stdout.strip() == ("all_gather of 8 elements returned wrong values on rank 0: the link or the "
                                   "collective library corrupts data; no bandwidth reported"), proc.stderr[-2000:]


@pytest.mark.parametrize("argv, message", [
    ([], "it measures collectives between ranks and this is one process: start it with torchrun --nproc-per-node "
         "N (N >= 2)"),
    (["--sizes-mb", "24,x"], "argument --sizes-mb: comma list of megabytes expected, got '24,x' (see --help)"),
    (["--sizes-mb", "0"], "argument --sizes-mb: sizes must be positive megabytes, got '0' (see --help)"),
    (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8' (choose from 'bf16', 'fp32') (see --help)"),
])
def test_bad_input_is_one_line(monkeypatch, capsys, argv, message):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tool = load_tool("comm_bandwidth")
    try:
        code = tool.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2 and capsys.readouterr().err.strip().splitlines() == [f"comm_bandwidth: error: {message}"]
