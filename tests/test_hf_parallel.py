"""The HF data-parallel baseline (litespark_megatron.apps.hf_parallel) on the CPU: DDP and FSDP2 on two ranks train what
one process trains, its rows in tools/layout_sweep.py say what trained, and what HF cannot run is refused in one line
before anything is written."""
import json

import pytest

from conftest import load_tool

TINY = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size", "1",
        "--global-batch-size", "4", "--lr", "1e-2", "--train-iters", "5", "--log-interval", "1"]


def _steps(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in records if r["kind"] == "run" and "spec" in r)
    return run, [(r["loss"], r["grad_norm"]) for r in records if r["kind"] == "train"]


def _largest_deviation(steps, reference):
    assert len(steps) == len(reference) == 5
    return (max(abs(a[0] - b[0]) / b[0] for a, b in zip(steps, reference)),
            max(abs(a[1] - b[1]) / b[1] for a, b in zip(steps, reference)))


@pytest.mark.integration  # its processes start inside the package
def test_ddp_and_fsdp2_on_two_ranks_train_what_one_process_trains(tmp_path, capsys):
    """Per-step loss and gradient norm (lr 1e-2, so every step's update shows) of DDP and FSDP2 on 2 ranks, each rank
    accumulating 2 micro-batches, against one process. The tolerance is this test's own noise floor: one process
    with micro-batches of 2 instead of 1, the same arithmetic summed in another order (measured: loss 5.8e-7,
    gradient norm 3.2e-5 relative; the two-rank layouts 1.0e-7 and 4.6e-6). A rank that trained the wrong rows or a
    gradient reduction that was skipped moves the loss by 1e-3 or more from the second step on."""
    sweep = load_tool("layout_sweep")
    rc = sweep.main(["--out", str(tmp_path), "--timeout", "300", "--layout", "1:hf-ddp", "--layout", "2:hf-ddp",
                     "--layout", "2:hf-fsdp2",
                     "--layout", "1:hf-ddp --micro-batch-size 2", "--"] + TINY)
    out = capsys.readouterr().out
    assert rc == 0, out
    one, ddp, fsdp2, noise = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    (run_one, reference), (run_ddp, steps_ddp), (run_fsdp2, steps_fsdp2), (_, steps_noise) = \
        map(_steps, (one, ddp, fsdp2, noise))
    assert (run_one["world_size"], run_ddp["world_size"], run_fsdp2["world_size"]) == (1, 2, 2)
    assert (run_ddp["spec"], run_fsdp2["spec"], run_ddp["precision"]) == ("hf-ddp", "hf-fsdp2", "fp32")
    assert run_one["params"] == 771_200 and run_one["data"] == "random tokens (uniform over the vocabulary)"
    floor_loss, floor_norm = _largest_deviation(steps_noise, reference)
    assert floor_loss > 0 and floor_norm > 0  # the floor is a real difference, not a copy of the reference
    for steps in (steps_ddp, steps_fsdp2):
        loss, norm = _largest_deviation(steps, reference)
        assert loss <= floor_loss and norm <= floor_norm, (loss, norm, floor_loss, floor_norm)
    rows = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["spec"] for r in rows] == ["hf-ddp", "hf-ddp", "hf-fsdp2", "hf-ddp"]
    assert rows[2]["health"] == {"attention": ["torch SDPA FlashAttention (CPU)"], "attention_kind": "flash",
                                 "fusions": {}, "degraded": [], "device_type": "cpu"}
    table = (tmp_path / "sweep.md").read_text()
    assert "| 2 | hf-fsdp2 | hf-fsdp2 fp32 | " in table
    assert table.count("| torch SDPA FlashAttention (CPU); fused: none |") == 4


@pytest.mark.integration  # its processes start inside the package
def test_an_hf_run_writes_tensorboard_under_megatron_trainings_tags(tmp_path):
    """With --tensorboard-dir an HF layout writes the loss, gradient norm and learning rate under megatron.training's
    tags and Telemetry's throughput scalars, one value per log interval, like a litespark-train run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sweep = load_tool("layout_sweep")
    tb = tmp_path / "tb"
    assert sweep.main(["--out", str(tmp_path / "sweep"), "--timeout", "300", "--layout", "1:hf-ddp", "--"] + TINY +
                      ["--log-interval", "2", "--tensorboard-dir", str(tb)]) == 0
    acc = EventAccumulator(str(tb))
    acc.Reload()
    scalars = acc.Tags()["scalars"]
    for tag in ("lm loss", "grad-norm", "learning-rate", "litespark/tokens-per-sec-per-gpu"):
        assert [e.step for e in acc.Scalars(tag)] == [2, 4, 5], (tag, scalars)
    (run_dir,) = [p for p in (tmp_path / "sweep").iterdir() if p.is_dir()]
    losses = [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if r["kind"] == "train"]
    assert [e.value for e in acc.Scalars("lm loss")] == pytest.approx(losses)


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2: HF transformers runs data-parallel only "
                                            "here (--parallel ddp|fsdp2); drop the flag"),
    (["--pipeline-model-parallel-size", "2"], "--pipeline-model-parallel-size 2: HF transformers runs data-parallel "
                                              "only here (--parallel ddp|fsdp2); drop the flag"),
    (["--context-parallel-size", "2"], "--context-parallel-size 2: HF transformers runs data-parallel only here "
                                       "(--parallel ddp|fsdp2); drop the flag"),
    (["--expert-model-parallel-size", "2", "--num-experts", "4"],
     "--expert-model-parallel-size 2: HF transformers runs data-parallel only here (--parallel ddp|fsdp2); drop the "
     "flag"),
    (["--num-experts", "4"], "--num-experts: the HF baseline is the dense Llama model (RoPE, RMSNorm, SwiGLU, no "
                             "biases); drop the flag"),
    (["--multi-latent-attention"], "--multi-latent-attention: the HF baseline is the dense Llama model (RoPE, "
                                   "RMSNorm, SwiGLU, no biases); drop the flag"),
    (["--position-embedding-type", "none"], "--position-embedding-type none: the HF baseline is the dense Llama "
                                            "model (RoPE, RMSNorm, SwiGLU, no biases); drop the flag"),
    (["--attention-variant", "nsa"], "--attention-variant nsa: the HF baseline is the dense Llama model (RoPE, "
                                     "RMSNorm, SwiGLU, no biases); drop the flag"),
    (["--qk-layernorm"], "--qk-layernorm: the HF baseline is the dense Llama model (RoPE, RMSNorm, SwiGLU, no "
                         "biases); drop the flag"),
    (["--fp8-format", "hybrid"], "--fp8-format: the HF baseline trains in bf16 (fp32 on a CPU); drop the flag"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"],
     "--recompute-granularity full: the HF baseline keeps its activations (no recompute); drop the flag"),
    (["--fp16"], "--fp16: the HF baseline trains in bf16 (fp32 on a CPU); drop the flag"),
    (["--micro-batch-size", "2", "--global-batch-size", "3"],
     "--global-batch-size 3 is not a multiple of --micro-batch-size 2 x 1 ranks; use a multiple of 2"),
    (["--parallel", "zero3"], "argument --parallel: invalid choice: 'zero3' (choose from 'ddp', 'fsdp2') (see --help)"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_what_hf_cannot_run_is_refused_in_one_line(tmp_path, capsys, flags, message):
    from litespark_megatron.apps import hf_parallel

    metrics = tmp_path / "run" / "metrics.jsonl"
    try:
        code = hf_parallel.main(TINY + ["--metrics-file", str(metrics)] + flags)
    except SystemExit as e:  # argparse's own errors (--parallel) exit from inside main
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [f"hf_parallel: error: {message}"], err
    assert not (tmp_path / "run").exists()


def test_a_layout_sweep_names_why_a_run_failed():
    """torchrun's report at the end of a failed run names exit codes; the row says the cause."""
    sweep = load_tool("layout_sweep")
    torchrun_report = ["  error_file: <N/A>", "  traceback : To enable traceback see: https://pytorch.org/docs/stable/"
                       "elastic/errors.html", "============================================================"]
    oom = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total "
           "capacity of 79.18 GiB of which 2.33 GiB is free. Including non-PyTorch memory, this process has 76.84 GiB "
           "memory in use.")
    assert sweep.failure_reason([oom, "[rank0]: Traceback (most recent call last):"] + torchrun_report) == \
        "out of GPU memory (Tried to allocate 3.91 GiB)"
    raised = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "x.py", line 1, in <module>',
              "[rank1]: TypeError: 'NoneType' object is not subscriptable",
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: "]
    assert sweep.failure_reason(raised + torchrun_report) == "TypeError: 'NoneType' object is not subscriptable"
    refused = ["litespark-train: error: world size 1 is not divisible by TP x PP x CP = 3 x 1 x 1 = 3"]
    assert sweep.failure_reason(refused + [oom] + torchrun_report) == refused[0]
    assert sweep.failure_reason(["a", "b", "c", "d"]) == "b | c | d"


def test_tensor_and_context_parallel_layouts_run_with_one_work_queue(monkeypatch):
    """Megatron-LM refuses TP or CP > 1 on Hopper without CUDA_DEVICE_MAX_CONNECTIONS=1 (a sweep of TP layouts on two
    H100s failed so); the sweep sets it for those layouts only, and a value the user set wins."""
    sweep = load_tool("layout_sweep")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    monkeypatch.setattr(sweep, "_hopper_or_older", lambda: True)
    assert sweep.run_env(["--model", "tiny", "--tensor-model-parallel-size", "2"])["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert sweep.run_env(["--context-parallel-size=2"])["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in sweep.run_env(["--tensor-model-parallel-size", "2",
                                                               "--tensor-model-parallel-size", "1"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in sweep.run_env(["--tensor-model-parallel-size", "1"])
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in sweep.run_env(["--use-distributed-optimizer"])
    assert str(sweep.ROOT) in sweep.run_env([])["PYTHONPATH"].split(":")
    monkeypatch.setattr(sweep, "_hopper_or_older", lambda: False)  # Blackwell orders the kernels without it
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in sweep.run_env(["--tensor-model-parallel-size", "2"])
    monkeypatch.setattr(sweep, "_hopper_or_older", lambda: True)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    assert sweep.run_env(["--tensor-model-parallel-size", "2"])["CUDA_DEVICE_MAX_CONNECTIONS"] == "8"


def test_without_a_gpu_the_sweep_counts_as_hopper_or_older():
    assert load_tool("layout_sweep")._hopper_or_older() is True  # no GPU here: NVML fails or counts none


def test_an_unknown_hf_layout_is_refused_before_anything_runs(tmp_path, capsys):
    sweep = load_tool("layout_sweep")
    assert sweep.main(["--out", str(tmp_path / "s"), "--layout", "2:hf-zero3", "--"] + TINY) == 2
    assert capsys.readouterr().err.strip() == \
        "layout_sweep: error: --layout 2:hf-zero3: unknown HF layout; use one of hf-ddp, hf-fsdp2"
    assert not (tmp_path / "s").exists()


HANGS = """
import subprocess, sys, time
helper = subprocess.Popen(["sleep", "120"])  # not Python: one stack in the log
print("helper", helper.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.integration  # its processes start inside the package
def test_a_run_past_the_timeout_is_stopped_whole_and_says_where_it_was(tmp_path, monkeypatch):
    """A hung run (here a process and the helper it started, both asleep) is stopped as a whole: SIGABRT first, on
    which Python prints where it was, then SIGKILL; no process of it is left to hold a GPU for the next layout."""
    import os
    import sys
    import time

    sweep = load_tool("layout_sweep")
    monkeypatch.setattr(sweep, "ABORT_GRACE_S", 5)
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        assert sweep.run_layout([sys.executable, "-c", HANGS], log, dict(os.environ), timeout=3) == "timeout"
    text = log_path.read_text()
    assert "Fatal Python error: Aborted" in text and 'File "<string>", line 5 in <module>' in text, text
    helper = int(text.split("helper ", 1)[1].split()[0])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(helper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the run's helper {helper} outlived the timeout")
