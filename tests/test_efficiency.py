"""The efficiency suite (tools/efficiency_suite.py): end to end on CPU, resume, bad input, OOM, the metric formulas."""
import json
import math
import shutil
import sys

import pytest

from conftest import ROOT, child_env, made_once, ok, preset, tool, train

SUITE = [sys.executable, str(ROOT / "tools" / "efficiency_suite.py")]
OWN = ["--model", "tiny", "--variants", "gqa,mqa", "--mock-data", "--train-iters", "4", "--log-interval", "2",
       "--eval-iters", "1"]
SHARED = ["--", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "4", "--micro-batch-size", "2"]
PLOTS = ("ppl_vs_joules_per_token.png", "memory_vs_latency.png", "pcu_per_variant.png", "latency_per_variant.png",
         "tt_per_variant.png", "ppl_per_variant.png")
GPU_ONLY = ("amu_gb", "pcu", "aec_w", "j_per_token", "peak_mem_gb")


def suite(out, *argv, timeout=300):
    return tool(SUITE[1], "--out", out, *argv, timeout=timeout)


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    def build(directory):
        proc = suite(directory / "out", *OWN, *SHARED)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return directory / "out", proc
    return made_once(tmp_path_factory, "efficiency-suite", build)


def test_end_to_end_writes_table_json_csv_plots_and_tensorboard(finished):
    out, proc = finished
    table = (out / "efficiency.md").read_text()
    for name in ("gqa", "mqa"):
        row = next(l for l in table.splitlines() if l.startswith(f"| {name} |"))
        assert row.count("not measured") == 5, row  # AMU, PCU, AEC, J/token, peak alloc: GPU-only on CPU
        assert row.rstrip().endswith("| torch SDPA FlashAttention (CPU) | done |")  # what ran, not degraded
    doc = json.loads((out / "efficiency.json").read_text())
    rows = {r["variant"]: r for r in doc["variants"]}
    assert list(rows) == ["gqa", "mqa"]
    for r in rows.values():
        assert all(r[k] is None for k in GPU_ONLY), r
        assert r["al_s"] > 0 and r["tokens_per_sec"] > 0 and 1 < r["val_ppl"] < 1000
        assert r["tt"] == pytest.approx(r["tokens_per_sec"] / r["params"], rel=1e-12)
        assert r["params_active"] == r["params"]  # dense: the shape's count agrees with the built model's
        assert r["intervals_used"] == 1 and r["intervals_total"] == 2  # the warm-up interval is left out
        assert r["attention"] == "torch SDPA FlashAttention (CPU)" and r["degraded"] == ""
    # MQA has one KV head where GQA has two: fewer K/V projection weights, 4 layers x 2 x (128 x 32) of them.
    assert rows["gqa"]["params"] - rows["mqa"]["params"] == 4 * 2 * 128 * 32
    csv_lines = (out / "efficiency.csv").read_text().splitlines()
    assert csv_lines[0].startswith("variant,status,") and len(csv_lines) == 3
    for name in PLOTS:
        assert (out / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    for name in ("gqa", "mqa", "summary"):
        assert list((out / "tb" / name).glob("events.out.tfevents.*")), name
    state = json.loads((out / "suite_state.json").read_text())
    assert {n: v["status"] for n, v in state["variants"].items()} == {"gqa": "done", "mqa": "done"}


def test_al_and_ppl_are_the_trainers_numbers(finished):
    """AL is the trainer's step time over the measured interval; PPL its final validation perplexity."""
    out, _ = finished
    records = [json.loads(l) for l in (out / "runs" / "gqa" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    row = next(r for r in json.loads((out / "efficiency.json").read_text())["variants"] if r["variant"] == "gqa")
    assert row["al_s"] == pytest.approx(train[1]["step_time_s"], rel=1e-12)
    assert row["val_ppl"] == next(r for r in records if r["kind"] == "run" and "iterations" in r)["val_ppl"]


def test_resume_runs_only_what_is_missing(finished, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(finished[0], out)
    # mqa was interrupted half-way: its state says running, its metrics stop after the first interval.
    state_file = out / "suite_state.json"
    state = json.loads(state_file.read_text())
    state["variants"]["mqa"] = dict(state["variants"]["mqa"], status="running")
    state_file.write_text(json.dumps(state))
    metrics = out / "runs" / "mqa" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]) + '{"step": 4, "kind": "tr')
    gqa_metrics = out / "runs" / "gqa" / "metrics.jsonl"
    before = gqa_metrics.stat().st_mtime_ns
    proc = suite(out, *OWN, *SHARED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gqa: already done, skipped" in proc.stdout
    assert "mqa: training" in proc.stdout and "gqa: training" not in proc.stdout
    assert gqa_metrics.stat().st_mtime_ns == before
    assert sum('"kind": "run"' in l and '"iterations"' in l for l in metrics.read_text().splitlines()) == 1
    assert json.loads(state_file.read_text())["variants"]["mqa"]["status"] == "done"


def test_other_settings_in_the_same_out_are_refused(finished):
    out, _ = finished
    proc = suite(out, *OWN[:-1], "2", *SHARED)  # --eval-iters 2 instead of 1
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"efficiency_suite: error: {out} holds a suite with other settings (different: "
                                   f"eval_iters); use another --out, or the same settings to continue it")


def test_unknown_variant_is_refused_before_any_work(tmp_path):
    proc = suite(tmp_path / "out", "--variants", "gqa,flash", "--model", "tiny")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("efficiency_suite: error: unknown variant 'flash'; choose from: dense, mha, gqa, "
                                   "mqa, mla, nsa, moe, moe-active, nope, bf16, fp16, fp8 (or 'all')")
    assert not (tmp_path / "out").exists()


def test_zero_repeats_is_refused_before_any_work(tmp_path):
    proc = suite(tmp_path / "out", "--variants", "gqa", "--repeats", "0")
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("efficiency_suite: error: argument --repeats: a positive integer expected, got "
                                   "'0' (see --help)")
    assert not (tmp_path / "out").exists()


def test_a_suite_of_variants_none_of_which_can_run_is_refused_before_any_work(tmp_path):
    proc = suite(tmp_path / "out", "--variants", "fp8", "--model", "tiny", "--mock-data", "--",
                 "--micro-batch-size", "2")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "efficiency_suite: error: variant 'fp8' cannot run here: --fp8-format needs a GPU with FP8 tensor cores "
        "(compute capability >= 8.9, e.g. H100/H200) and Transformer Engine; use --bf16")
    assert not (tmp_path / "out").exists()


def test_every_variant_the_layout_cannot_run_says_why_and_the_others_are_planned():
    """TP2 on the CPU: MQA and NSA (one KV head), MLA (TP without TE) and the MoEs (TP without SP) cannot run; FP8
    needs a GPU. The others are planned."""
    from litespark_megatron import platform
    from litespark_megatron.apps import efficiency_suite as efficiency

    settings = efficiency.parse_settings(["--out", "unused", "--model", "tiny", "--variants", "all", "--nproc", "2",
                                          "--", "--tensor-model-parallel-size", "2", "--micro-batch-size", "2",
                                          "--global-batch-size", "4", "--mock-data"])
    planned = efficiency.plan(settings, platform.detect())
    why = {name: entry["cannot_run"] for name, entry in planned.items() if entry.get("cannot_run")}
    assert list(why) == ["mqa", "mla", "nsa", "moe", "moe-active", "fp8"]
    assert "--num-query-groups (KV heads) 1 is not divisible by --tensor-model-parallel-size 2" in why["mqa"]
    assert "--multi-latent-attention with --tensor-model-parallel-size > 1 needs" in why["mla"]
    assert "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel" in why["moe"]
    assert [n for n in planned if n not in why] == ["dense", "mha", "gqa", "nope", "bf16", "fp16"]


@pytest.mark.parametrize("axis", [[], ["--axis", "finetune", "--peft-base", "{base}"]])
def test_every_variant_holds_the_litespark_kernels_off_unless_the_flags_name_them(axis, tmp_path):
    """Their default follows precision and attention (on in BF16 on a GPU, the norm off under FP8, RoPE off with MLA):
    left to it, the kernels would differ between variants that do not name them."""
    from litespark_megatron.apps import efficiency_suite as efficiency

    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    own = ["--out", "unused", "--model", "tiny"] + [a.format(base=tmp_path) for a in axis]
    off = ["--no-litespark-cross-entropy", "--no-litespark-rmsnorm", "--no-litespark-rope", "--no-litespark-swiglu"]
    flags = efficiency.parse_settings(own).base_flags()
    assert all(flag in flags for flag in off)
    flags = efficiency.parse_settings(own + ["--", "--litespark-rope", "--no-litespark-rmsnorm"]).base_flags()
    assert [f for f in flags if "litespark-" in f and f != "--litespark-spec"] == \
        ["--no-litespark-cross-entropy", "--no-litespark-swiglu", "--litespark-rope", "--no-litespark-rmsnorm"]


def test_a_warm_up_that_leaves_cuda_graphs_capture_in_the_timed_intervals_is_refused():
    """megatron captures CUDA graphs at the start of step --cuda-graph-warmup-steps + 1: intervals left out that end
    before it would time the capture as a step (the benchmark timed 22,622 tokens/s for 35,317 so)."""
    from test_arguments import GPU_TE
    from litespark_megatron.apps import efficiency_suite as efficiency
    from litespark_megatron.arguments import UserError

    def settings(*own):
        return efficiency.parse_settings(["--out", "unused", "--model", "tiny", "--variants", "gqa", *own, "--",
                                          "--mock-data", "--micro-batch-size", "2", "--cuda-graph-impl",
                                          "transformer_engine"])
    with pytest.raises(UserError) as e:
        efficiency.plan(settings("--log-interval", "3"), GPU_TE)
    assert str(e.value) == ("variant 'gqa' captures CUDA graphs (--cuda-graph-impl transformer_engine) in step 4, "
                            "and --warmup-intervals 1 x --log-interval 3 leaves out 3 step(s): give "
                            "--warmup-intervals 2 or more")
    assert efficiency.plan(settings("--log-interval", "3", "--warmup-intervals", "2"), GPU_TE)["gqa"]["key"]
    assert efficiency.plan(settings("--log-interval", "4"), GPU_TE)["gqa"]["key"]


@pytest.mark.parametrize("argv, message", [
    (["--variants", "gqa", "--", "--save", "x"], "--save is set by the suite"),
    (["--variants", "gqa", "--", "--bf16"], "--bf16 is set by the suite"),
    (["--variants", "gqa", "--variant-flags", "fast=--lr 1"], "expected NAME=FLAGS with NAME one of"),
    (["--variants", "gqa", "--rerun", "gpa"], "--rerun: unknown variant(s) gpa"),
    (["--variants", "gqa", "--model", "gpt-5"], "unknown --model 'gpt-5'"),
])
def test_bad_options(argv, message):
    from litespark_megatron.apps import efficiency_suite as efficiency
    from litespark_megatron.arguments import UserError

    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        efficiency.parse_settings(["--out", "unused", *argv])


# --------------------------------------------------------------------------------------------- OOM
TORCH_OOM = """step      1/20 | loss 10.2 | lr 1.00e-05 | grad 3.1 | 30,000 tok/s | 400.0 TFLOP/s/GPU | MFU 40.4%
[rank0]: Traceback (most recent call last):
[rank0]:   File "megatron/core/transformer/moe/experts.py", line 301, in forward
[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which 1.12 GiB is free.
E1122 08:00:00.000000 1234 torch/distributed/elastic/multiprocessing/api.py:882] failed (exitcode: 1)
"""
CUBLAS_OOM = "RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`\n"
CONFIG_ERROR = "litespark-train: error: --global-batch-size 6 is not divisible by micro-batch x data-parallel\n"


def test_oom_is_told_apart_from_other_failures():
    from litespark_megatron.apps.efficiency_suite import classify_failure, failure_summary

    assert classify_failure(1, TORCH_OOM) == "oom"
    assert failure_summary(1, TORCH_OOM).startswith("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried")
    assert classify_failure(1, CUBLAS_OOM) == "oom"
    assert classify_failure(2, CONFIG_ERROR) == "failed"
    assert failure_summary(2, CONFIG_ERROR) == CONFIG_ERROR.strip()
    assert classify_failure(-9, "step 1/20 ...\n") == "failed"
    assert failure_summary(-9, "step 1/20 ...\n") == "killed by signal SIGKILL"
    assert failure_summary("timeout", "") == "timed out"


def test_an_oom_variant_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    """run_suite with the runs replaced: mqa runs out of memory, gqa (after it) still runs; the table says OOM."""
    from litespark_megatron.apps import efficiency_suite as efficiency

    ran = []

    def fake_run(settings, name, flags, log=print):
        ran.append(name)
        run_dir = settings.out / "runs" / name
        run_dir.mkdir(parents=True, exist_ok=True)
        if name == "mqa":
            (run_dir / "log.txt").write_text(TORCH_OOM)
            return dict(flags=flags, returncode=1, seconds=1.0, status=efficiency.classify_failure(1, TORCH_OOM),
                        error=efficiency.failure_summary(1, TORCH_OOM))
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in gpu_records()) + "\n")
        return dict(flags=flags, returncode=0, seconds=1.0, status="done")

    monkeypatch.setattr(efficiency, "run_variant", fake_run)
    settings = efficiency.parse_settings(["--out", str(tmp_path / "out"), "--model", "tiny", "--variants",
                                          "mqa,gqa", "--mock-data", "--train-iters", "30", "--log-interval", "10",
                                          "--", "--micro-batch-size", "2"])
    assert efficiency.run_suite(settings, log=lambda *a: None) == 1
    assert ran == ["mqa", "gqa"]
    table = (tmp_path / "out" / "efficiency.md").read_text()
    assert "| mqa |" in table and "| OOM | OOM |" in table and "oom: [rank0]: torch.OutOfMemoryError" in table
    # A second invocation keeps the OOM outcome (it would only run out of memory again) and the finished run;
    # asked for a second repeat, it runs gqa's and not mqa's (another seed runs out of memory as well).
    ran.clear()
    assert efficiency.run_suite(settings, log=lambda *a: None) == 1
    assert ran == []
    settings.repeats = 2
    assert efficiency.run_suite(settings, log=lambda *a: None) == 1
    assert ran == ["gqa.r2"]
    table = (tmp_path / "out" / "efficiency.md").read_text()
    assert next(l for l in table.splitlines() if l.startswith("| mqa |")).split(" | ").count("OOM") == \
        len(efficiency.METRICS)


# --------------------------------------------------------------------------------------------- formulas
def gpu_records():
    """A 30-step GPU run logged every 10 steps (1 GPU, 1,000,000 parameters, 4096 tokens per step)."""
    def train(step, step_time, mfu, reserved, peak, power, jpt):
        return dict(step=step, kind="train", step_time_s=step_time, tokens_per_sec=4096 / step_time, mfu=mfu,
                    mfu_causal=mfu * 0.9, mem_reserved_gb=reserved, mem_max_allocated_gb=peak, gpu_power_w=power,
                    joules_per_token=jpt, num_gpus=1)
    return [dict(step=0, kind="run", params=1_000_000, world_size=1),
            train(10, 9.0, 0.01, 1.0, 0.5, 100.0, 1.0),  # warm-up interval: left out
            train(20, 1.0, 0.40, 10.0, 8.0, 600.0, 0.2),
            train(30, 3.0, 0.20, 12.0, 9.0, 500.0, 0.3),
            dict(step=30, kind="val", loss=2.0, ppl=7.389),
            dict(step=30, kind="run", iterations=30, val_loss=2.0, val_ppl=7.389, final_loss=2.1,
                 skipped_steps=0, energy_kwh=0.001)]


def test_metric_definitions_on_known_numbers():
    from litespark_megatron.apps.efficiency_suite import summarize_metrics

    m = summarize_metrics(gpu_records(), warmup_intervals=1)
    # Measured intervals: 10 s (10 steps x 1 s) and 30 s (10 steps x 3 s); 40,960 tokens each.
    assert m["al_s"] == pytest.approx(40 / 20)
    assert m["tokens_per_sec"] == pytest.approx(2 * 40960 / 40)
    assert m["tt"] == pytest.approx(2 * 40960 / 40 / 1e6)
    assert m["pcu"] == pytest.approx((0.40 * 10 + 0.20 * 30) / 40)
    assert m["amu_gb"] == pytest.approx((10.0 * 10 + 12.0 * 30) / 40)
    assert m["peak_mem_gb"] == 9.0
    assert m["aec_w"] == pytest.approx((600 * 10 + 500 * 30) / 40)
    assert m["j_per_token"] == pytest.approx((0.2 * 40960 + 0.3 * 40960) / (2 * 40960))
    assert m["val_ppl"] == 7.389 and m["intervals_used"] == 2
    everything = summarize_metrics(gpu_records(), warmup_intervals=0)
    assert everything["al_s"] == pytest.approx((90 + 10 + 30) / 30)


def test_interrupted_suite_stops_its_run_and_resumes(tmp_path):
    """SIGTERM while the second variant trains: the suite stops that run (no training process is left behind),
    and the same command then skips the finished variant and trains the interrupted one."""
    import signal
    import subprocess
    import time

    import psutil

    out = tmp_path / "out"
    cmd = [str(c) for c in [*SUITE, "--out", out, *OWN, *SHARED]]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env())
    state_file, deadline = out / "suite_state.json", time.time() + 120
    while time.time() < deadline:
        try:
            if json.loads(state_file.read_text())["variants"].get("mqa", {}).get("status") == "running":
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("the suite never started its second variant")
    children = []
    while time.time() < deadline and not children:  # the training process of mqa, once started
        children = psutil.Process(proc.pid).children(recursive=True)
        time.sleep(0.2)
    assert children, "no training process was started for mqa"
    time.sleep(1.0)  # let it get into its imports/training
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-2000:]
    assert "interrupted" in stderr
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"left running: {[p.cmdline() for p in alive]}"
    assert json.loads(state_file.read_text())["variants"]["mqa"]["status"] == "running"
    again = suite(out, *OWN, *SHARED)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "gqa: already done, skipped" in again.stdout and "mqa: training" in again.stdout
    assert json.loads(state_file.read_text())["variants"]["mqa"]["status"] == "done"


PARALLEL = ["--model", "tiny", "--variants", "gqa,mqa,fp16", "--mock-data", "--train-iters", "30", "--log-interval",
            "10", "--repeats", "2", "--parallel", "2", "--", "--micro-batch-size", "2"]


def test_parallel_runs_each_take_a_free_gpu_and_a_repeat_waits_for_its_earlier_one(tmp_path, monkeypatch):
    """--parallel 2 on a machine of three GPUs: two runs at a time, never on the same GPU, each with its
    CUDA_VISIBLE_DEVICES; a second repeat starts only after its first; one that ran out of memory has no second;
    the state says which GPU each run had and the report says the runs shared the host."""
    import threading
    import time

    from litespark_megatron.apps import efficiency_suite as efficiency

    spans, lock, first_two = {}, threading.Lock(), threading.Barrier(2, timeout=30)

    def fake_run(settings, run_id, flags, log=print, gpus=None):
        started = time.monotonic()
        if run_id in ("gqa", "mqa"):
            first_two.wait()  # the first two runs are under way at once (or the barrier breaks: not in parallel)
        time.sleep(0.2)
        with lock:
            spans[run_id] = (started, time.monotonic(), gpus)
        run_dir = settings.out / "runs" / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        if run_id == "mqa":
            return dict(flags=flags, returncode=1, seconds=0.2, status="oom", error="CUDA out of memory")
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in gpu_records()) + "\n")
        return dict(flags=flags, returncode=0, seconds=0.2, status="done")

    monkeypatch.setattr(efficiency, "run_variant", fake_run)
    monkeypatch.setattr(efficiency, "visible_gpus", lambda: ["0", "1", "2"])
    settings = efficiency.parse_settings(["--out", str(tmp_path / "out"), *PARALLEL])
    assert efficiency.run_suite(settings, log=lambda *a: None) == 1  # mqa ran out of memory
    assert sorted(spans) == ["fp16", "fp16.r2", "gqa", "gqa.r2", "mqa"]  # no second seed for mqa
    assert {g for _, _, g in spans.values()} == {"0", "1"}  # two slots of one GPU each; GPU 2 left alone
    at_once = max(sum(1 for a, b, _ in spans.values() if a <= t < b) for t, _, _ in spans.values())
    assert at_once == 2
    for (a1, b1, g1), (a2, b2, g2) in ((spans[x], spans[y]) for x in spans for y in spans if x < y):
        assert g1 != g2 or b1 <= a2 or b2 <= a1, spans  # one run per GPU at a time
    for name in ("gqa", "fp16"):
        assert spans[f"{name}.r2"][0] >= spans[name][1]
    state = json.loads((tmp_path / "out" / "suite_state.json").read_text())["variants"]
    assert {r: e["gpus"] for r, e in state.items()} == {r: g for r, (_, _, g) in spans.items()}
    table = (tmp_path / "out" / "efficiency.md").read_text()
    assert "Runs ran side by side (--parallel), each on its own GPU(s) of the machine (CUDA_VISIBLE_DEVICES 0, 1;" \
        in table


def test_parallel_needs_a_gpu_set_per_run_and_writes_nothing_without(tmp_path, monkeypatch, capsys):
    from litespark_megatron.apps import efficiency_suite as efficiency

    assert efficiency.gpu_groups(2, 2, ["3", "5", "6", "7", "0"]) == ["3,5", "6,7"]
    assert efficiency.gpu_groups(1, 8, []) == [None]  # one at a time: the run sees what the suite sees
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert efficiency.visible_gpus() == ["0", "1"]
    assert efficiency.main(["--out", str(tmp_path / "out"), *PARALLEL[:-5], "--parallel", "3", "--",
                            "--micro-batch-size", "2"]) == 2
    assert capsys.readouterr().err == (
        "efficiency_suite: error: --parallel 3 with --nproc 1 needs 3 GPUs, one set per run, and this machine shows "
        "2 (CUDA_VISIBLE_DEVICES=0,1): use --parallel 2 or fewer\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.integration  # the runs are processes (of a stand-in command)
def test_an_interrupted_parallel_suite_stops_every_run_it_started(tmp_path, monkeypatch):
    """The interruption reaches the suite while two runs train on their GPUs: both processes are stopped, neither
    is recorded as finished or failed (they run again when the suite is resumed), and no run starts after it."""
    import time

    import psutil

    from litespark_megatron.apps import efficiency_suite as efficiency

    def sleeper(settings, argv):  # a training run that would outlast the test, telling which GPU it was given
        return [sys.executable, "-c", "import os, sys, time; print(os.getpid(), os.environ['CUDA_VISIBLE_DEVICES'], "
                "flush=True); time.sleep(120)"]

    def log(line):
        if line.startswith("fp16: training"):  # interrupt once the other two train (they have said who they are)
            deadline = time.time() + 30
            while time.time() < deadline and not all(
                    (runs / run_id / "log.txt").exists() and len(log_lines(run_id)) == 2 for run_id in ("gqa", "mqa")):
                time.sleep(0.05)
            raise KeyboardInterrupt

    runs = tmp_path / "out" / "runs"

    def log_lines(run_id):
        return (runs / run_id / "log.txt").read_text().splitlines()

    monkeypatch.setattr(efficiency, "trainer_command", sleeper)
    monkeypatch.setattr(efficiency, "visible_gpus", lambda: ["0", "1", "2"])
    settings = efficiency.parse_settings(["--out", str(tmp_path / "out"), *PARALLEL[:-5], "--parallel", "3", "--",
                                          "--micro-batch-size", "2"])
    with pytest.raises(KeyboardInterrupt):
        efficiency.run_suite(settings, log=log)
    gpus = []
    for run_id in ("gqa", "mqa"):  # each log: the command, then the process's pid and its GPU
        pid, gpu = log_lines(run_id)[1].split()
        gpus.append(gpu)
        with pytest.raises(psutil.NoSuchProcess):
            psutil.Process(int(pid)).status()  # stopped and reaped
    assert sorted(gpus) == ["0", "1"] and not (runs / "fp16").exists()
    state = json.loads((tmp_path / "out" / "suite_state.json").read_text())["variants"]
    assert {r: e["status"] for r, e in state.items()} == {"gqa": "running", "mqa": "running", "fp16": "running"}
    assert not efficiency._LIVE and not efficiency._STOPPING.is_set()


def test_a_variant_not_run_yet_counts_parameters_with_the_vocabulary_of_its_data(tmp_path):
    """The vocabulary is the data tokenizer's (megatron.training ignores --vocab-size for a text tokenizer), so the
    parameter count of a variant that has not run uses it, not the preset's 4096."""
    from tokenizers import Tokenizer

    from litespark_megatron import data
    from litespark_megatron.apps import efficiency_suite as efficiency
    from litespark_megatron.metrics.flops import ModelShape, param_count
    from litespark_megatron.platform import detect

    tokenizer_dir = tmp_path / "tok"
    data.train_bpe_tokenizer(["def f(x):\n    return x * 2\n" * 50], 300, str(tokenizer_dir))
    settings = efficiency.Settings(out=tmp_path / "suite", model="tiny", variants=["gqa", "mqa"], precision="fp32",
                                   train_iters=2, log_interval=1, eval_iters=1, nproc=1, mock_data=True,
                                   warmup_intervals=1, timeout=60, time_budget=None, rerun=[], variant_flags={},
                                   shared=["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                           str(tokenizer_dir), "--micro-batch-size", "1"])
    planned = efficiency.plan(settings, detect())
    rows = {r["variant"]: r for r in efficiency.collect_rows(settings, planned, {"variants": {}})}
    shape = planned["mqa"]["args"]
    per_row = 2 * shape.hidden_size  # untied: the embedding and the output layer both hold a row per token
    preset_count = param_count(ModelShape.from_args(shape, padded_vocab=4096)).total
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    assert 128 < vocab <= 300
    assert rows["mqa"]["status"] == "not run"
    assert rows["mqa"]["params"] == preset_count - per_row * (4096 - 384)  # its vocabulary padded to 3 x 128


# --------------------------------------------------------------------------------------------- repeats, findings
def test_interval_and_verdicts_on_known_numbers():
    from litespark_megatron.apps.findings import AGREE, DISAGREE, INCONCLUSIVE, NOT_MEASURED, interval, lower, lowest

    three = interval([1.0, 2.0, 3.0])
    assert (three.n, three.mean, three.min, three.max) == (3, 2.0, 1.0, 3.0)
    assert three.half_width == pytest.approx(4.303 * 1.0 / 3 ** 0.5)  # t(0.975, 2 dof) x sd / sqrt(n)
    one = interval([5.0])
    assert one.half_width is None and one.low is None
    assert interval([None, float("nan")]) is None
    low, high, wide = interval([1.0, 1.1, 0.9]), interval([2.0, 2.1, 1.9]), interval([0.0, 3.0, 1.5])
    assert lower(low, high) == AGREE and lower(high, low) == DISAGREE and lower(low, wide) == INCONCLUSIVE
    assert lower(one, high) == INCONCLUSIVE and lower(None, high) == NOT_MEASURED
    assert lowest(low, [high, interval([3.0, 3.1, 2.9])]) == AGREE
    assert lowest(high, [low, wide]) == DISAGREE
    assert lowest(low, [high, wide]) == INCONCLUSIVE


def metrics_of(al, amu, jpt, ppl, data="mock data (megatron-core's MockGPTDataset)"):
    """A fake run's metrics.jsonl records: two 10-step intervals of `al` s/step (the first left out)."""
    def train(step):
        return dict(step=step, kind="train", step_time_s=al, tokens_per_sec=4096 / al, mfu=0.3, mfu_causal=0.27,
                    mem_reserved_gb=amu, mem_max_allocated_gb=amu - 1, gpu_power_w=jpt * 4096 / al,
                    joules_per_token=jpt, num_gpus=1)
    return [dict(step=0, kind="run", params=1_000_000, world_size=1, data=data), train(10), train(20),
            dict(step=20, kind="run", iterations=20, val_loss=math.log(ppl), val_ppl=ppl, final_loss=2.0)]


# (AL s/it, AMU GB, J/token, PPL) of each variant's three repeats
FAKE = {"gqa": [(1.00, 10.2, 0.30, 50.0), (1.01, 10.7, 0.31, 51.0), (0.99, 9.7, 0.29, 49.0)],
        "mqa": [(1.10, 10.0, 0.30, 55.0), (1.11, 10.5, 0.31, 56.0), (1.09, 9.5, 0.29, 54.0)],
        "fp16": [(1.20, 10.2, 0.20, 52.0), (1.21, 10.7, 0.21, 53.0), (1.19, 9.7, 0.19, 51.0)]}


def test_repeats_give_each_number_its_spread_and_the_findings_their_verdicts(tmp_path, monkeypatch):
    """Three repeats of gqa, mqa, bf16 and fp16 with made-up measurements (bf16 is the same run as gqa here, the
    tiny preset being GQA in bf16). Repeat K trains with --seed 1234 + K - 1 on the data of --data-seed 1234. The
    table gives means with their 95% interval, findings.md reads "agree" for BF16's lower latency (1.00 vs 1.20),
    "disagree" for its energy (0.30 vs 0.20 J/token) and "inconclusive" for MQA's memory (the intervals overlap)."""
    from litespark_megatron.apps import efficiency_suite as efficiency

    flags_of = {}

    def fake_run(settings, run_id, flags, log=print):
        flags_of[run_id] = flags
        name, _, repeat = run_id.partition(".r")
        run_dir = settings.out / "runs" / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        records = metrics_of(*FAKE[name][int(repeat or 1) - 1])
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
        return dict(flags=flags, returncode=0, seconds=1.0, status="done")

    monkeypatch.setattr(efficiency, "run_variant", fake_run)
    settings = efficiency.parse_settings(["--out", str(tmp_path / "out"), "--model", "tiny", "--variants",
                                          "gqa,mqa,bf16,fp16", "--mock-data", "--train-iters", "20",
                                          "--log-interval", "10", "--repeats", "3", "--", "--micro-batch-size", "2"])
    assert efficiency.run_suite(settings, log=lambda *a: None) == 0
    assert sorted(flags_of) == ["fp16", "fp16.r2", "fp16.r3", "gqa", "gqa.r2", "gqa.r3", "mqa", "mqa.r2", "mqa.r3"]
    assert flags_of["gqa.r3"][-4:] == ["--seed", "1236", "--data-seed", "1234"] and "--data-seed" not in flags_of["gqa"]
    state = json.loads((tmp_path / "out" / "suite_state.json").read_text())["variants"]
    assert state["bf16.r2"]["same_as"] == "gqa.r2"
    rows = {r["variant"]: r for r in json.loads((tmp_path / "out" / "efficiency.json").read_text())["variants"]}
    al = rows["fp16"]["spread"]["al_s"]
    assert al["n"] == 3 and al["mean"] == pytest.approx(1.20) and al["min"] == 1.19 and al["max"] == 1.21
    assert al["ci95_half_width"] == pytest.approx(4.303 * 0.01 / 3 ** 0.5)
    assert rows["bf16"]["al_s"] == rows["gqa"]["al_s"] == pytest.approx(1.0) and rows["bf16"]["repeats_done"] == 3
    table = (tmp_path / "out" / "efficiency.md").read_text()
    assert "| 1.2000 ±2.1% |" in table  # fp16's AL: 0.0248 / 1.20
    # each measured configuration once, widest first (bf16 is gqa's run)
    assert "Spread of tokens/s between repeats, (max - min) / mean: gqa 2.0%, mqa 1.8%, fp16 1.7%." in table
    assert "Data of every run: mock data (megatron-core's MockGPTDataset)." in table
    found = {line.split(" | ")[0].lstrip("| "): line for line in
             (tmp_path / "out" / "findings.md").read_text().splitlines() if line.startswith("| ")}
    assert found["BF16 has lower latency than FP16 on Hopper"].endswith("| ~6% lower | al_s | bf16 1.0000 s ± "
                                                                        "0.0248 s (n=3); fp16 1.2000 s ± 0.0248 s "
                                                                        "(n=3) | x0.833 (0.818-0.849) | **agree** |")
    assert found["BF16 uses less energy per token than FP16 on Hopper"].endswith("| **disagree** |")
    assert found["MQA uses the least memory of the attention variants"].endswith(
        "| **inconclusive (without mha, mla, nsa: not in this suite)** |")
    assert found["MQA has the lowest latency of the attention variants"].endswith(
        "| **disagree (without mha, mla, nsa: not in this suite)** |")
    assert not any("MoE" in claim for claim in found)  # no MoE variant in this suite


def test_one_repeat_leaves_every_verdict_inconclusive_and_a_cannot_run_row_says_why(tmp_path, monkeypatch):
    from litespark_megatron.apps import efficiency_suite as efficiency

    def fake_run(settings, run_id, flags, log=print):
        run_dir = settings.out / "runs" / run_id
        run_dir.mkdir(parents=True, exist_ok=True)
        # mqa as if it ran on a machine whose standard library has no test packages
        data = "stdlib corpus of CPython 3.12.3: 569 files, 3,069,783 tokens" if run_id == "mqa" else "mock data"
        (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in metrics_of(*FAKE[run_id][0], data)))
        return dict(flags=flags, returncode=0, seconds=1.0, status="done")

    monkeypatch.setattr(efficiency, "run_variant", fake_run)
    settings = efficiency.parse_settings(["--out", str(tmp_path / "out"), "--model", "tiny", "--variants",
                                          "gqa,mqa,fp16,fp8", "--mock-data", "--train-iters", "20", "--log-interval",
                                          "10", "--", "--micro-batch-size", "2"])
    assert efficiency.run_suite(settings, log=lambda *a: None) == 1  # fp8 has no result
    table = (tmp_path / "out" / "efficiency.md").read_text()
    assert ("**The runs did not all train on the same data**: mock data (gqa, fp16); stdlib corpus of CPython "
            "3.12.3: 569 files, 3,069,783 tokens (mqa).") in table
    fp8 = next(l for l in table.splitlines() if l.startswith("| fp8 |"))
    assert fp8.endswith("| cannot run here: --fp8-format needs a GPU with FP8 tensor cores (compute capability >= "
                        "8.9, e.g. H100/H200) and Transformer Engine; use --bf16 |"), fp8
    verdicts = [line.rsplit("| **", 1)[1] for line in (tmp_path / "out" / "findings.md").read_text().splitlines()
                if line.startswith("| ") and "| **" in line]
    # MQA's memory and latency against gqa; no bf16 variant ran, so BF16's findings are left out.
    assert verdicts == ["inconclusive (without mha, mla, nsa: not in this suite)** |"] * 2, verdicts

    # --report-only: the same command on any machine writes the report again from the recorded runs, in the order
    # of --variants, training nothing; fp8 keeps the reason it could not run where the suite ran.
    def no_training(*args, **kwargs):
        raise AssertionError("--report-only trained a variant")

    monkeypatch.setattr(efficiency, "run_variant", no_training)
    (tmp_path / "out" / "efficiency.md").unlink()
    again = efficiency.parse_settings(["--out", str(tmp_path / "out"), "--model", "tiny", "--variants",
                                       "fp8,mqa,gqa", "--mock-data", "--train-iters", "20", "--log-interval", "10",
                                       "--report-only", "--", "--micro-batch-size", "2"])
    assert efficiency.run_suite(again, log=lambda *a: None) == 0
    rows = [l for l in (tmp_path / "out" / "efficiency.md").read_text().splitlines() if l.startswith("| ")][1:]
    assert [l.split(" | ")[0] for l in rows] == ["| fp8", "| mqa", "| gqa"]
    assert rows[0] == fp8 and rows[2] == next(l for l in table.splitlines() if l.startswith("| gqa |"))
    assert "1 process(es) on cpu (cpu)" in (tmp_path / "out" / "efficiency.md").read_text()


def test_report_only_needs_a_recorded_suite(tmp_path):
    from litespark_megatron.apps import efficiency_suite as efficiency
    from litespark_megatron.arguments import UserError

    settings = efficiency.parse_settings(["--out", str(tmp_path / "none"), "--model", "tiny", "--report-only"])
    with pytest.raises(UserError) as e:
        efficiency.run_suite(settings, log=lambda *a: None)
    assert str(e.value) == (f"{tmp_path / 'none'} holds no suite (suite_state.json is missing): --report-only "
                            "rewrites the report of runs made before; run the suite without it first")
    assert not (tmp_path / "none").exists()


# --------------------------------------------------------------------------------------------- fine-tuning axis
FT_OWN = ["--axis", "finetune", "--model", "tiny", "--variants", "all", "--train-iters", "4", "--log-interval", "2",
          "--eval-iters", "1"]
FT_SHARED = ["--", "--micro-batch-size", "2", "--global-batch-size", "4", "--seq-length", "64"]
FT_VARIANTS = ["full", "lora", "rslora", "dora", "lora-plus", "freeze"]


def make_base(directory):
    """A base checkpoint of the tiny preset: a short pretraining run on the embedded corpus (the SFT set's tokenizer)."""
    ok(train(1, "--model", "tiny", "--embedded-corpus", "stdlib", "--micro-batch-size", "4", "--global-batch-size",
             "8", "--lr", "1e-3", "--train-iters", "2", "--eval-iters", "0", "--eval-interval", "100", "--save",
             directory / "base", "--save-interval", "2", timeout=600))
    return directory / "base"


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
    def build(directory):
        base = make_base(directory)
        proc = suite(directory / "out", *FT_OWN, "--peft-base", base, *FT_SHARED, timeout=1200)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return base, directory / "out", proc
    return made_once(tmp_path_factory, "efficiency-suite-finetune", build)


def test_finetune_axis_runs_the_six_variants_from_one_base(finetuned):
    from litespark_megatron.metrics.flops import ModelShape, PeftShape, trainable_params

    base, out, proc = finetuned
    rows = {r["variant"]: r for r in json.loads((out / "efficiency.json").read_text())["variants"]}
    assert list(rows) == FT_VARIANTS and all(r["status"] == "done" for r in rows.values()), rows
    tiny = preset("tiny")
    shape = ModelShape.from_args(tiny, padded_vocab=4096)  # the embedded corpus's tokenizer
    expected = {"full": None, "lora": PeftShape("lora", rank=64), "rslora": PeftShape("lora", rank=64),
                "dora": PeftShape("dora", rank=64), "lora-plus": PeftShape("lora", rank=64),
                "freeze": PeftShape("freeze", trainable_layers=2)}
    for name, peft in expected.items():
        r = rows[name]
        assert r["trainable_params"] == trainable_params(shape, peft), name
        assert r["flops_convention"] == ("standard" if peft is None else "peft"), name
        assert r["al_s"] > 0 and r["tokens_per_sec"] > 0 and r["val_loss"] > 0 and r["checkpoint_mb"] > 0, r
        assert all(r[k] is None for k in GPU_ONLY), r
        assert f"--peft-base {base}" in r["flags"] or name == "full", r["flags"]
    assert f"--pretrained-checkpoint {base}" in rows["full"]["flags"]
    assert "--lora-scaling rs" in rows["rslora"]["flags"] and "--lora-plus-ratio 16" in rows["lora-plus"]["flags"]
    assert "--trainable-layers 2" in rows["freeze"]["flags"] and "--lora-rank 64 --lora-alpha 128" in rows["dora"]["flags"]
    # the adapters alone against the whole model and its optimizer state
    assert rows["lora"]["checkpoint_mb"] < rows["dora"]["checkpoint_mb"] < rows["full"]["checkpoint_mb"]
    assert not list((out / "runs").glob("*/checkpoint"))  # measured, then removed
    table = (out / "efficiency.md").read_text()
    assert "| variant | params | val loss | AMU (GB) |" in table and "checkpoint (MB)" in table
    assert "0.598M trainable" in next(l for l in table.splitlines() if l.startswith("| lora |"))


def test_finetune_findings_state_the_papers_confounds(finetuned):
    _, out, _ = finetuned
    findings = (out / "findings.md").read_text()
    rows = [l for l in findings.splitlines() if l.startswith("| ") and not l.startswith("| EfficientLLM")]
    assert len(rows) == 4 and all("4-bit NF4 base" in r for r in rows), rows
    rslora = next(r for r in rows if r.startswith("| RSLoRA"))
    assert "**not runnable here**" in rslora and "14B parameters or more" in rslora
    for claim in ("| The LoRA family", "| Freezing has the lowest", "| DoRA is the slowest"):
        row = next(r for r in rows if r.startswith(claim))
        assert "**inconclusive**" in row, row  # one repeat: no interval, no verdict either way


def test_finetune_axis_resumes_what_is_missing(finetuned, tmp_path):
    base, done, _ = finetuned
    out = tmp_path / "out"
    shutil.copytree(done, out)
    state_file = out / "suite_state.json"
    state = json.loads(state_file.read_text())
    state["variants"]["freeze"] = dict(state["variants"]["freeze"], status="running")
    state_file.write_text(json.dumps(state))
    proc = suite(out, *FT_OWN, "--peft-base", base, *FT_SHARED)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "freeze: training" in proc.stdout and "lora: already done, skipped" in proc.stdout
    assert sum(": training" in line for line in proc.stdout.splitlines()) == 1
    assert json.loads(state_file.read_text())["variants"]["freeze"]["checkpoint_bytes"] > 0


def test_a_finetune_variant_that_cannot_run_says_why(finetuned):
    """Under the stock layer spec the adapters have nowhere to go: the LoRA family cannot run, full and freeze can."""
    from litespark_megatron import platform
    from litespark_megatron.apps import efficiency_suite as efficiency

    base = finetuned[0]
    settings = efficiency.parse_settings(["--out", "unused", *FT_OWN, "--peft-base", str(base), *FT_SHARED,
                                          "--spec", "stock-local"])
    planned = efficiency.plan(settings, platform.detect())
    why = {name: entry["cannot_run"] for name, entry in planned.items() if entry.get("cannot_run")}
    assert list(why) == ["lora", "rslora", "dora", "lora-plus"]
    assert all("the adapters live in the Litespark layer" in reason for reason in why.values()), why


@pytest.mark.parametrize("argv, message", [
    (["--axis", "finetune", "--variants", "lora"], "--axis finetune fine-tunes a base model: give --peft-base CKPT"),
    (["--variants", "gqa", "--peft-base", "x"], "--peft-base is the base of --axis finetune"),
    (["--axis", "finetune", "--peft-base", "x", "--mock-data"], "--mock-data with --axis finetune"),
    (["--axis", "finetune", "--peft-base", "x", "--variants", "gqa"], "unknown variant 'gqa'; choose from: full, "
                                                                      "lora, rslora, dora, lora-plus, freeze"),
    (["--axis", "finetune", "--peft-base", "{missing}"], "no checkpoint there"),
    (["--axis", "finetune", "--peft-base", "x", "--", "--pretrained-checkpoint", "y"],
     "--pretrained-checkpoint is set by the suite"),
])
def test_bad_finetune_options(argv, message, tmp_path):
    from litespark_megatron.apps import efficiency_suite as efficiency
    from litespark_megatron.arguments import UserError

    argv = [a.replace("{missing}", str(tmp_path)) for a in argv]
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        efficiency.parse_settings(["--out", "unused", *argv])
