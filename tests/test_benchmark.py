"""tools/benchmark.py: CPU end-to-end runs (fresh worker processes, fp32), the report's fields, the ratio and rate
arithmetic, failing systems reported while the others complete, micro-batch selection, and bad input (exit 2)."""
import importlib.util
import json
import math
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import load_tool

from litespark_megatron.apps import benchmark, hf_model
from litespark_megatron import arguments, platform
from litespark_megatron.metrics.flops import ModelShape, training_flops_per_step

ROOT = Path(__file__).resolve().parent.parent
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
TINY = ["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2", "--steps", "2", "--warmup", "1"]


def resolve(argv):
    return arguments.resolve(argv, platform.detect())


def tiny_flops(seq: int, gbs: int, causal: str) -> int:
    # The tiny preset written out, independently of the resolver the tool uses.
    shape = ModelShape(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
                       vocab_size=4096, seq_length=seq)
    return training_flops_per_step(shape, gbs, causal=causal).model_flops


def check_ok_row(row, seq: int, gbs: int):
    assert row["status"] == "ok", row
    assert row["precision"] == "fp32 (CPU run)"
    assert row["tokens_per_step"] == gbs * seq and row["steps"] == 2 and len(row["step_times_s"]) == 2
    assert row["seconds"] == pytest.approx(sum(row["step_times_s"]), rel=0.05)
    assert row["tokens_per_sec"] == pytest.approx(gbs * seq * 2 / row["seconds"])
    assert row["model_flops_per_step"] == tiny_flops(seq, gbs, "full")
    assert row["model_flops_per_step_causal"] == tiny_flops(seq, gbs, "half")
    assert row["tflops_per_gpu"] == pytest.approx(tiny_flops(seq, gbs, "full") * 2 / row["seconds"] / 1e12)
    # GPU-only measurements are absent on the CPU, never filled in.
    for key in ("mfu", "mfu_causal", "peak_mem_gib", "gpu_power_w", "joules_per_token"):
        assert row[key] is None, key
    assert row["params"] == 1_787_008  # tiny preset, docs/metrics.md
    # Random tokens over a 4096 vocabulary: a fresh model's loss is close to ln(4096) = 8.318.
    assert abs(row["loss_first"] - math.log(4096)) < 0.3 and math.isfinite(row["loss_last"])


@pytest.mark.integration  # its processes start inside the package
def test_megatron_steps_timed_by_log_intervals(tmp_path):
    """--log-interval 2: the megatron worker reads the timed steps from interval records (two intervals of two
    steps), each step counted at its interval's mean, and the table says how the steps were timed."""
    out = tmp_path / "bench"
    rc = load_tool("benchmark").main(["--model", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
                                      "--warmup", "2", "--steps", "4", "--log-interval", "2",
                                      "--systems", "litespark-local-bf16", "--out", str(out)])
    assert rc == 0
    row = json.loads((out / "benchmark.json").read_text())["systems"][0]
    assert row["status"] == "ok" and row["steps"] == 4 and len(row["step_times_s"]) == 4, row
    times = row["step_times_s"]
    assert times[0] == times[1] and times[2] == times[3]
    assert row["seconds"] == pytest.approx(sum(times)) and row["tokens_per_step"] == 2 * 64
    assert "megatron systems timed by log intervals of 2 steps" in (out / "benchmark.md").read_text()


@pytest.mark.integration  # its processes start inside the package
def test_cpu_end_to_end_with_a_failing_system(tmp_path, capsys):
    out = tmp_path / "bench"
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    rc = load_tool("benchmark").main(TINY + ["--systems", "litespark-local-bf16,stock-te-bf16", "--out", str(out),
                                             "--profile-steps", "1", "--megatron-flags=--no-gradient-accumulation-fusion",
                                             "--variant", f"local-recompute=litespark-local-bf16:{recompute}"])
    printed = capsys.readouterr().out
    assert rc == 1  # one system failed; the run itself completed
    report = json.loads((out / "benchmark.json").read_text())
    rows = {r["system"]: r for r in report["systems"]}
    check_ok_row(rows["litespark-local-bf16"], 64, 2)
    failed = rows["stock-te-bf16"]
    assert failed["status"] == "failed" and "needs Transformer Engine" in failed["reason"]
    assert "\n" not in failed["reason"]
    # The variant ran after --systems as its own system, with its flags; full recompute changes no number.
    assert [r["system"] for r in report["systems"]] == ["litespark-local-bf16", "stock-te-bf16", "local-recompute"]
    variant = rows["local-recompute"]
    check_ok_row(variant, 64, 2)
    assert variant["flags"][-6:] == ["--recompute-granularity", "full", "--recompute-method", "uniform",
                                     "--recompute-num-layers", "1"]
    assert variant["description"].endswith("plus `--recompute-granularity full --recompute-method uniform "
                                           "--recompute-num-layers 1`")
    assert (variant["loss_first"], variant["loss_last"]) == (rows["litespark-local-bf16"]["loss_first"],
                                                             rows["litespark-local-bf16"]["loss_last"])
    assert "--recompute-granularity" in (out / "logs" / "local-recompute-mb2.log").read_text().splitlines()[0]
    # No baseline in this run: the ratios say n/a rather than inventing one.
    assert rows["litespark-local-bf16"]["vs_hf_eager"] == {"tokens_per_sec": None, "joules_per_token": None}
    assert report["device"]["type"] == "cpu" and report["peak"] is None and "CPU" in report["peak_note"]
    assert report["software"]["megatron_core"] == platform.MEGATRON_CORE_VERSION
    assert report["settings"]["tokens_per_step"] == 128 and report["settings"]["global_batch_size"] == 2
    assert report["command"].startswith("python tools/benchmark.py --model tiny")
    md = (out / "benchmark.md").read_text()
    assert printed.endswith(md)  # the table is printed last
    # What ran, per row: on the CPU the SDPA dispatcher picks its CPU flash kernel; no fused path exists there.
    assert "| litespark-local-bf16 | fp32 (CPU run) | torch SDPA FlashAttention (CPU) | off / unfused / off | 2 x 1 |" \
        in md
    assert rows["litespark-local-bf16"]["health"] == dict(
        attention=["torch SDPA FlashAttention (CPU)"], attention_kind="flash", degraded=[], device_type="cpu",
        fusions=dict(cross_entropy="off", rope="unfused", wgrad_accumulation="off"))
    assert "| stock-te-bf16 | failed: --transformer-impl transformer_engine (Megatron-LM's default) needs " \
        "Transformer Engine, which is not importable on a CPU" in md
    assert "--systems litespark-local-bf16,stock-te-bf16" in md and f"megatron-core {platform.MEGATRON_CORE_VERSION}" in md
    results_table = md.split("Where the time goes")[0]
    for line in results_table.splitlines():
        if line.startswith("| "):
            assert line.count("|") == 16, line  # 15 columns in every row, failed ones too
    # One log per worker (its first line the worker's command, with the --megatron-flags), a profile per system that
    # ran; the workers' result files are merged into benchmark.json and removed.
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["litespark-local-bf16-mb2.log",
                                                                 "litespark-local-bf16-mb2.profile.md",
                                                                 "local-recompute-mb2.log",
                                                                 "local-recompute-mb2.profile.md",
                                                                 "stock-te-bf16-mb2.log"]
    assert "needs Transformer Engine" in (out / "logs" / "stock-te-bf16-mb2.log").read_text()
    # The workers read random tokens written for this run (not the mock dataset), removed with it.
    worker_command = shlex.split((out / "logs" / "litespark-local-bf16-mb2.log").read_text().splitlines()[0])
    worker_flags = json.loads(worker_command[worker_command.index("--worker") + 1])["flags"]
    assert "--mock-data" not in worker_flags
    assert not Path(worker_flags[worker_flags.index("--data-path") + 1] + ".bin").exists()
    for log in ("litespark-local-bf16-mb2.log", "stock-te-bf16-mb2.log"):
        assert "--no-gradient-accumulation-fusion" in (out / "logs" / log).read_text().splitlines()[0]
    # --profile-steps: CPU operators (no kernels here), one step more than the timed ones, not in the timing.
    profile = rows["litespark-local-bf16"]["profile"]
    assert profile["device"] == "cpu" and profile["steps"] == 1 and profile["busy_fraction"] is not None
    assert {"gemm", "attention"} <= {c["category"] for c in profile["categories"]}
    assert any(k["name"] == "aten::mm" for k in profile["top_kernels"])
    assert "Where the time goes (CPU operator (self) ms per step" in md and "| gemm | " in md
    assert "aten::mm" in (out / "logs" / "litespark-local-bf16-mb2.profile.md").read_text()
    assert report["settings"]["steps"] == 2 and rows["stock-te-bf16"].get("profile") is None


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="hf-eager needs HuggingFace transformers (pip install "
                                                  "transformers), which is not a dependency of the package")
@pytest.mark.integration  # its processes start inside the package
def test_cpu_hf_eager_baseline_and_ratios(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = benchmark.main(TINY + ["--global-batch-size", "4", "--systems", "hf-eager,litespark-local-bf16",
                                "--out", str(out)])
    capsys.readouterr()
    assert rc == 0
    rows = {r["system"]: r for r in json.loads((out / "benchmark.json").read_text())["systems"]}
    for row in rows.values():
        check_ok_row(row, 64, 4)
        assert row["micro_batch_size"] == 2 and row["accumulation_steps"] == 2  # HF accumulates, megatron micro-batches
    hf, ls = rows["hf-eager"], rows["litespark-local-bf16"]
    assert hf["vs_hf_eager"]["tokens_per_sec"] == pytest.approx(1.0)
    assert ls["vs_hf_eager"]["tokens_per_sec"] == pytest.approx(ls["tokens_per_sec"] / hf["tokens_per_sec"])
    assert ls["vs_hf_eager"]["joules_per_token"] is None  # no energy counter on the CPU


def test_megatron_systems_read_random_tokens_uniform_over_the_vocabulary(tmp_path):
    """Token values change FP8 speed (counting sequences ran slower and less repeatably than random tokens on an
    H200), so every system reads random tokens: here megatron-core reads back what the benchmark wrote."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    flags = ["--model", "tiny", "--mock-data", "--seq-length", "64"]
    args = SimpleNamespace(vocab_size=300, seq_length=64)
    prefix = str(tmp_path / "random")
    new = benchmark.random_token_flags(flags, args, prefix, sequences=50, seed=7)
    assert new == ["--model", "tiny", "--seq-length", "64", "--data-path", prefix, "--split", "100,0,0",
                   "--tokenizer-type", "NullTokenizer", "--vocab-size", "300"]
    data = IndexedDataset(prefix)
    tokens = [data[i] for i in range(len(data))]
    assert len(tokens) == 50 and {len(t) for t in tokens} == {65}
    everything = [int(x) for t in tokens for x in t]
    assert min(everything) >= 0 and max(everything) < 300 and len(set(everything)) > 250
    again = benchmark.random_token_flags(flags, args, str(tmp_path / "again"), sequences=50, seed=7)
    assert [list(t) for t in IndexedDataset(again[again.index("--data-path") + 1])] == [list(t) for t in tokens]


def test_rates_and_ratios_arithmetic():
    # Made-up numbers: this is arithmetic, checked against values worked out by hand.
    raw = dict(steps=10, seconds=4.0, tokens_per_step=8192, joules=20480.0, energy_seconds=4.096)
    d = benchmark.derive(raw, {"full": 2 * 10**14, "half": 10**14}, peak_tflops=1000.0)
    assert d["tokens_per_sec"] == pytest.approx(20480.0)        # 81920 tokens / 4 s
    assert d["step_time_s"] == pytest.approx(0.4)
    assert d["tflops_per_gpu"] == pytest.approx(500.0)          # 2e15 FLOPs / 4 s
    assert d["tflops_per_gpu_causal"] == pytest.approx(250.0)
    assert d["mfu"] == pytest.approx(0.5) and d["mfu_causal"] == pytest.approx(0.25)
    assert d["joules_per_token"] == pytest.approx(0.25)         # 20480 J / 81920 tokens
    assert d["gpu_power_w"] == pytest.approx(5000.0)            # 20480 J / 4.096 s
    none = benchmark.derive(dict(raw, joules=None, energy_seconds=None), {"full": 1, "half": 1}, None)
    assert none["mfu"] is None and none["joules_per_token"] is None and none["gpu_power_w"] is None

    rows = {"hf-eager": dict(tokens_per_sec=1000.0, joules_per_token=0.05),
            "litespark-bf16": dict(tokens_per_sec=2500.0, joules_per_token=0.02),
            "cpu-like": dict(tokens_per_sec=10.0, joules_per_token=None)}
    r = benchmark.ratios_vs_baseline(rows)
    assert r["hf-eager"] == {"tokens_per_sec": 1.0, "joules_per_token": 1.0}
    assert r["litespark-bf16"]["tokens_per_sec"] == pytest.approx(2.5)
    assert r["litespark-bf16"]["joules_per_token"] == pytest.approx(0.4)
    assert r["cpu-like"] == {"tokens_per_sec": pytest.approx(0.01), "joules_per_token": None}
    assert benchmark.ratios_vs_baseline({"x": rows["litespark-bf16"]})["x"] == {"tokens_per_sec": None,
                                                                                 "joules_per_token": None}


def test_best_micro_batch_keeps_the_fastest_that_fits_and_stops_at_oom(monkeypatch, tmp_path):
    speeds = {1: 1.0, 2: 0.8}  # seconds for 2 steps of 512 tokens: micro-batch 2 is fastest; 4 runs out of memory
    calls = []

    def fake_worker(name, system, flags, mbs, gbs, opts, log_dir):
        calls.append(mbs)
        if mbs in speeds:
            return dict(system=name, micro_batch_size=mbs, status="ok", steps=2, seconds=speeds[mbs],
                        tokens_per_step=gbs * 64, step_times_s=[speeds[mbs] / 2] * 2, precision="fp32 (CPU run)",
                        joules=None, energy_seconds=None, loss_first=8.3, loss_last=8.3, wall_s=1.0,
                        device={"type": "cpu", "name": "x86_64", "threads": 2})
        return dict(system=name, micro_batch_size=mbs, status="oom", reason="out of memory: CUDA out of memory",
                    wall_s=1.0)

    monkeypatch.setattr(benchmark, "run_worker", fake_worker)
    opts = benchmark.build_parser().parse_args(["--model", "tiny", "--seq-length", "64", "--best-micro-batch"])
    gbs, candidates = benchmark.micro_batch_plan(opts)
    assert (gbs, candidates) == (8, [1, 2, 4, 8])
    flags = benchmark.base_flags(opts)
    progress = []
    report = benchmark.run_all(benchmark.parse_systems("litespark-local-bf16,hf-eager"), flags, gbs, candidates,
                               opts, benchmark.check_shape(flags), tmp_path, "cmd", on_progress=progress.append)
    assert calls == [1, 2, 4, 1, 2, 4]  # 8 is not tried once 4 ran out of memory
    row = report["systems"][0]
    assert row["status"] == "ok" and row["micro_batch_size"] == 2 and row["accumulation_steps"] == 4
    assert [t["status"] for t in row["tries"]] == ["ok", "ok", "oom"]
    assert row["tokens_per_sec"] == pytest.approx(1280.0) and report["pending"] == []
    md = benchmark.render_markdown(report)
    assert row["largest_fitting_micro_batch"] == {"micro_batch_size": 2, "out_of_memory_at": 4}
    assert ("micro-batches tried: 1: 1,024 tokens/s, 2: 1,280 tokens/s, 4: oom; the largest that fits: 2 (4 ran out "
            "of memory)") in md and "PARTIAL" not in md
    # After the first system the report so far is handed over (and written with --out), marked as partial.
    assert len(progress) == 1 and progress[0]["pending"] == ["hf-eager"]
    assert [r["system"] for r in progress[0]["systems"]] == ["litespark-local-bf16"]
    assert "- PARTIAL: still to run: hf-eager" in benchmark.render_markdown(progress[0])


@pytest.mark.integration  # its processes start inside the package
def test_worker_timeout_is_reported(tmp_path, capsys):
    rc = benchmark.main(TINY + ["--systems", "litespark-local-bf16", "--timeout", "1", "--out", str(tmp_path)])
    capsys.readouterr()
    assert rc == 1
    row = json.loads((tmp_path / "benchmark.json").read_text())["systems"][0]
    assert row["status"] == "timeout" and row["reason"] == "no result within --timeout 1 s"
    assert row["tries"][0]["wall_s"] < 30


def test_failure_classification():
    import torch

    assert benchmark.classify_failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore"))\
        == ("oom", "out of memory: CUDA out of memory. Tried to allocate 2 GiB")
    assert benchmark.classify_failure(benchmark.UserError("needs X")) == ("failed", "needs X")
    assert benchmark.classify_failure(ModuleNotFoundError("No module named 'transformer_engine'")) == \
        ("failed", "import error: No module named 'transformer_engine'")
    assert benchmark.classify_failure(ValueError("bad\nshape")) == ("failed", "ValueError: bad")


def test_hf_config_has_the_preset_shape():
    args = resolve(["--model", "llama-3b"])
    kw = hf_model.hf_config_kwargs(args)
    assert (kw["num_hidden_layers"], kw["hidden_size"], kw["intermediate_size"], kw["num_attention_heads"],
            kw["num_key_value_heads"], kw["vocab_size"], kw["head_dim"]) == (28, 3072, 8192, 24, 8, 128256, 128)
    assert kw["tie_word_embeddings"] is False and kw["use_cache"] is False and kw["rms_norm_eps"] == 1e-5
    def vocab(a, name):
        return benchmark.system_vocab(a, benchmark.SYSTEMS[name])

    assert vocab(args, "hf-eager") == vocab(args, "litespark-bf16") == 128256
    odd = resolve(["--model", "tiny", "--vocab-size", "1000"])
    assert (vocab(odd, "hf-eager"), vocab(odd, "stock-te-fp8")) == (1000, 1024)


@pytest.mark.parametrize("argv, message", [
    (["--systems", "hf-eager,nope"], "unknown system 'nope' in --systems; choose from: hf-eager, hf-compile"),
    (["--systems", "hf-eager,hf-eager"], "system 'hf-eager' is listed twice"),
    (["--systems", " , "], "--systems is empty and no --variant given; name at least one of: hf-eager"),
    (["--micro-batch-size", "4", "--global-batch-size", "6"], "--global-batch-size 6 is not a multiple of"),
    (["--best-micro-batch", "--micro-batch-size", "2"], "--micro-batch-size and --best-micro-batch are exclusive"),
    (["--log-interval", "2"], "--log-interval 2 does not divide --warmup 3: the warm-up and the timed steps are "
                              "read as whole log intervals"),
    (["--log-interval", "4", "--warmup", "4", "--steps", "6"], "--log-interval 4 does not divide --steps 6"),
    (["--micro-batch-candidates", "4,8"], "--micro-batch-candidates needs --best-micro-batch"),
    (["--best-micro-batch", "--micro-batch-candidates", "4,x"], "argument --micro-batch-candidates: expected a comma "
                                                                "list of positive integers such as 4,8, got '4,x'"),
    (["--best-micro-batch", "--micro-batch-candidates", "0,8"], "got '0,8'"),
    (["--best-micro-batch", "--micro-batch-candidates", "3,4", "--global-batch-size", "8"],
     "--micro-batch-candidates 3 does not divide the global batch 8"),
    (["--model", "llama-7b"], "unknown --model 'llama-7b'; choose one of: tiny, llama-1b"),
    (["--model", "tiny", "--hidden-size", "130"], "--hidden-size 130 is not divisible by --num-attention-heads 4"),
    (["--model", "tiny", "--hidden-size", "100"], "head dimension 25 (--hidden-size 100 / --num-attention-heads 4) "
                                                  "must be even"),
    (["--steps", "0"], "argument --steps: a positive integer expected"),
    (["--profile-steps", "-1"], "argument --profile-steps: an integer >= 0 expected"),
    (["--megatron-flags=--bogus 1"], "--megatron-flags: unrecognized arguments: --bogus 1"),
    (["--megatron-flags=--cross-entropy-fusion-impl foo"], "argument --cross-entropy-fusion-impl: invalid choice"),
    (["--megatron-flags=--lr '1"], "--megatron-flags: No closing quotation"),
    (["--megatron-flags=--spec nope"], "--megatron-flags: --spec nope: name one of litespark, stock, stock-te, stock-local"),
    (["--megatron-flags=--seq-length 128"], "--megatron-flags: changes --seq-length, which the benchmark sets for "
                                            "every system alike"),
    (["--variant", "tensorwise"], "--variant tensorwise: expected NAME=SYSTEM:FLAGS"),
    (["--variant", "v=litespark-fp8"], "--variant v=litespark-fp8: expected NAME=SYSTEM:FLAGS"),
    (["--variant", "My Run=litespark-fp8:--fp8-recipe tensorwise"], "the name 'My Run' may hold only lower-case"),
    (["--variant", "v=nope:--fp8-recipe tensorwise"], "unknown system 'nope'; choose from: hf-eager"),
    (["--variant", "v=hf-eager:--bf16"], "'hf-eager' is an HF system, which takes no litespark-train flags"),
    (["--systems", "litespark-fp8", "--variant", "litespark-fp8=litespark-fp8:--fp8-recipe tensorwise"],
     "the name 'litespark-fp8' is already taken"),
    (["--variant", "v=litespark-fp8:--fp8-recipe nope"],
     "--variant v: argument --fp8-recipe: invalid choice: 'nope'"),
    (["--variant", "v=litespark-fp8:--bogus"], "--variant v: unrecognized arguments: --bogus"),
    (["--warmup", "3", "--variant", "g=litespark-fp8:--cuda-graph-impl transformer_engine"],
     "g captures CUDA graphs (--cuda-graph-impl transformer_engine) in step 4 (--cuda-graph-warmup-steps 3), and "
     "--warmup 3 would time the capture; give --warmup 4 or more"),
    (["--warmup", "2", "--systems", "stock-te-bf16",
      "--megatron-flags=--cuda-graph-impl local --cuda-graph-warmup-steps 2"],
     "stock-te-bf16 captures CUDA graphs (--cuda-graph-impl local) in step 3 (--cuda-graph-warmup-steps 2), and "
     "--warmup 2 would time the capture; give --warmup 3 or more"),
    (["--variant", "v=litespark-bf16:--num-layers 3 --micro-batch-size 1"],
     "--variant v: changes --num-layers, --micro-batch-size, which the benchmark sets"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert benchmark.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("benchmark: error: ") and message in lines[0], captured.err


def test_parser_defaults_match_the_documented_run():
    opts = benchmark.build_parser().parse_args([])
    assert (opts.model, opts.seq_length, opts.warmup, opts.steps, opts.timeout) == ("llama-3b", 4096, 3, 10, 600)
    assert list(benchmark.parse_systems(opts.systems)) == ["hf-eager", "hf-liger", "litespark-bf16",
                                                           "litespark-fp8", "stock-te-bf16", "stock-te-fp8"]
    assert benchmark.micro_batch_plan(opts) == (2, [2])
    # Leading VAR=value words are the worker's environment, not flags; flags still checked after them.
    name, system = benchmark.parse_variant("stock-cudnn=stock-te-fp8:NVTE_NORM_FWD_USE_CUDNN=1 "
                                           "NVTE_NORM_BWD_USE_CUDNN=1 --cross-entropy-loss-fusion")
    assert system.env == (("NVTE_NORM_FWD_USE_CUDNN", "1"), ("NVTE_NORM_BWD_USE_CUDNN", "1"))
    assert system.flags[-1] == "--cross-entropy-loss-fusion" and "NVTE" not in " ".join(system.flags)
    assert benchmark.parse_variant("only-env=stock-te-fp8:NVTE_NORM_FWD_USE_CUDNN=1")[1].flags == \
        benchmark.SYSTEMS["stock-te-fp8"].flags
    with pytest.raises(benchmark.UserError, match="--variant v: unrecognized arguments: --bogus"):
        benchmark.parse_variant("v=stock-te-fp8:A=1 --bogus")
    # Variants alone: the systems they vary need not run as rows of their own.
    assert list(benchmark.parse_systems("", ["a=stock-te-fp8:--cross-entropy-loss-fusion",
                                             "b=litespark-fp8:--litespark-cross-entropy"])) == ["a", "b"]
    assert benchmark.micro_batch_plan(SimpleNamespace(best_micro_batch=True, micro_batch_size=None,
                                                      global_batch_size=12)) == (12, [1, 2, 4])
    # CUDA graphs captured inside the warm-up (step 4 by default) pass; systems without graphs need none.
    graphs = benchmark.parse_systems("stock-te-bf16", ["g=litespark-fp8:--cuda-graph-impl transformer_engine"])
    benchmark.check_graph_warmup(graphs, benchmark.base_flags(opts), SimpleNamespace(warmup=4, megatron_flags=""))
    benchmark.check_graph_warmup(benchmark.parse_systems("stock-te-bf16"), benchmark.base_flags(opts),
                                 SimpleNamespace(warmup=0, megatron_flags=""))
    # Chosen candidates: ascending, each tried at the same global batch (by default their largest).
    parse = benchmark.build_parser().parse_args
    assert benchmark.micro_batch_plan(parse(["--best-micro-batch", "--micro-batch-candidates", "8,4,4"])) == (8, [4, 8])
    assert benchmark.micro_batch_plan(parse(["--best-micro-batch", "--micro-batch-candidates", "2,6",
                                             "--global-batch-size", "12"])) == (12, [2, 6])


H200 = {"type": "cuda", "name": "NVIDIA H200", "count": 1, "capability": "9.0", "cuda": "13.0", "cudnn": "9.14.0",
        "driver": "580.159.04", "memory_gib": 139.8}


def test_gpu_report_mfu_energy_ratios_and_rendering(monkeypatch, tmp_path):
    # The GPU columns cannot run here: feed build_report what a CUDA worker returns (measure() on CUDA), with
    # made-up numbers, and check the derived columns and the table against hand arithmetic.
    fused = dict(cross_entropy="te", rope="te", wgrad_accumulation="on")
    health = {"hf-eager": dict(attention=["torch SDPA cuDNN"], attention_kind="fused", fusions={}, degraded=[],
                               device_type="cuda"),
              "litespark-bf16": dict(attention=["torch SDPA cuDNN"], attention_kind="fused", fusions=fused,
                                     degraded=[], device_type="cuda"),
              # what the stock baseline of the earlier ratios ran: TE's fallback, the score matrix materialized
              "stock-te-bf16": dict(attention=["TE UnfusedDotProductAttention (TE's cuDNN 9.14.0)"],
                                    attention_kind="unfused", fusions=fused, device_type="cuda",
                                    degraded=["unfused attention: TE UnfusedDotProductAttention (TE's cuDNN 9.14.0)"])}

    def fake_worker(name, system, flags, mbs, gbs, opts, log_dir):
        if name == "stock-te-fp8":
            return dict(system=name, micro_batch_size=mbs, status="oom", reason="out of memory: CUDA out of memory",
                        wall_s=5.0, device=H200, peak_mem_gib=139.1)
        seconds = {"hf-eager": 10.0, "litespark-bf16": 4.0, "stock-te-bf16": 5.0}[name]
        joules = {"hf-eager": 7000.0, "litespark-bf16": 2600.0, "stock-te-bf16": 3000.0}[name]
        return dict(system=name, micro_batch_size=mbs, status="ok", steps=10, seconds=seconds, tokens_per_step=8192,
                    step_times_s=[seconds / 10] * 10, joules=joules, energy_seconds=seconds, energy_note=None,
                    peak_mem_gib=90.5, peak_mem_timed_gib=90.0, loss_first=11.9, loss_last=11.5, params=3_606_752_256,
                    skipped_steps=0, notes=[], precision="bf16", wall_s=40.0, device=H200, health=health[name])

    monkeypatch.setattr(benchmark, "run_worker", fake_worker)
    opts = benchmark.build_parser().parse_args([])
    gbs, candidates = benchmark.micro_batch_plan(opts)
    flags = benchmark.base_flags(opts)
    report = benchmark.run_all(benchmark.parse_systems("hf-eager,litespark-bf16,stock-te-bf16,stock-te-fp8"), flags, gbs,
                               candidates, opts, benchmark.check_shape(flags), tmp_path, "python tools/benchmark.py")
    assert report["peak"]["tflops"] == 989.4 and report["peak"]["mfu_basis"] == "bf16-dense"
    rows = {r["system"]: r for r in report["systems"]}
    ls = rows["litespark-bf16"]
    full = 2 * 4096 * 23_503_306_752  # llama-3b training FLOPs per token, full attention (docs/metrics.md)
    assert ls["model_flops_per_step"] == full
    assert ls["tokens_per_sec"] == pytest.approx(81920 / 4.0)
    assert ls["tflops_per_gpu"] == pytest.approx(full * 10 / 4.0 / 1e12)
    assert ls["mfu"] == pytest.approx(full * 10 / 4.0 / 1e12 / 989.4)
    assert ls["gpu_power_w"] == pytest.approx(650.0) and ls["joules_per_token"] == pytest.approx(2600 / 81920)
    assert ls["vs_hf_eager"]["tokens_per_sec"] == pytest.approx(2.5)
    assert ls["vs_hf_eager"]["joules_per_token"] == pytest.approx(2600 / 7000)
    assert rows["stock-te-fp8"]["status"] == "oom"
    md = benchmark.render_markdown(report)
    assert "- device: NVIDIA H200 (1 of 1 visible; compute capability 9.0), CUDA 13.0" in md
    assert "- MFU: against 989.4 TFLOP/s (dense BF16 of H200, datasheet), FP8 systems too" in md
    tflops = full * 10 / 4.0 / 1e12
    assert (f"| litespark-bf16 | bf16 | torch SDPA cuDNN | te / te / on | 2 x 1 | 20,480 | 2.50x | n/a | "
            f"{tflops:.1f} / "
            f"{2 * 4096 * 21_389_377_536 * 10 / 4.0 / 1e12:.1f} | {tflops / 989.4:.1%} / ") in md
    assert "| 90.5 | 650 | 0.0317 | 0.37x | 11.900 -> 11.500 |" in md
    assert "| stock-te-fp8 | oom: out of memory: CUDA out of memory |" in md
    assert "megatron systems (GPU): bf16 parameters and compute with fp32 main parameters" in md
    # The fallen-back stock row is flagged in its row and in a section of its own, with the reason.
    assert "| stock-te-bf16 **DEGRADED** | bf16 | TE UnfusedDotProductAttention (TE's cuDNN 9.14.0) | te / te / on |" \
        in md
    assert "- `stock-te-bf16`: unfused attention: TE UnfusedDotProductAttention (TE's cuDNN 9.14.0)" in md
    # the only stock row in bf16 fell back: no fair stock ratio, and the report says so
    assert report["best_stock"] == {"bf16": None} and "vs_best_stock" not in ls
    assert ("- best stock row (fastest stock Megatron-Core row of each precision that did not fall back; 'vs best "
            "stock' divides by it): bf16: none (every stock row fell back: no fair ratio)") in md
    assert "| hf-eager | bf16 | torch SDPA cuDNN | n/a |" in md
    # paths only some systems have follow the three columns' cell, by name
    assert benchmark._health_cells(dict(attention=["x"], degraded=[], fusions=dict(
        cross_entropy="litespark", rope="litespark", wgrad_accumulation="on", swiglu="litespark-fp8",
        output_layer="litespark-fp8")))[1] == \
        "litespark / litespark / on; SwiGLU litespark-fp8; output layer litespark-fp8"
    json.dumps(report)  # benchmark.json must serialize


def test_litespark_is_compared_with_the_fastest_stock_row_of_its_precision(monkeypatch, tmp_path):
    """Stock in BF16 twice (the default row and a --variant with CUDA graphs, which is faster) and in FP8: each
    Litespark row is divided by the fastest stock row of its precision, whatever its name; a stock row that fell
    back cannot be the best, however fast."""
    tps = {"litespark-bf16": 3.0, "stock-te-bf16": 3.6, "stock-graphs": 3.3, "litespark-fp8": 2.4,
           "stock-te-fp8": 2.5, "stock-fp8-unfused": 2.0}  # seconds for 10 steps of 8,192 tokens
    ok = dict(attention=["TE FusedAttention"], attention_kind="fused", fusions={}, degraded=[], device_type="cuda")
    unfused = dict(ok, attention_kind="unfused", degraded=["unfused attention: TE UnfusedDotProductAttention"])

    def fake_worker(name, system, flags, mbs, gbs, opts, log_dir):
        fp8 = "--fp8-format" in system.flags
        return dict(system=name, micro_batch_size=mbs, status="ok", steps=10, seconds=tps[name],
                    tokens_per_step=8192, step_times_s=[tps[name] / 10] * 10, joules=650.0 * tps[name],
                    energy_seconds=tps[name], energy_note=None, peak_mem_gib=50.0, peak_mem_timed_gib=50.0,
                    loss_first=11.9, loss_last=11.5, params=3_606_752_256, skipped_steps=0, notes=[],
                    precision="fp8 hybrid, delayed scaling + bf16, fp32 main params" if fp8 else
                    "bf16, fp32 main params", wall_s=40.0, device=H200,
                    health=unfused if name == "stock-fp8-unfused" else ok)

    monkeypatch.setattr(benchmark, "run_worker", fake_worker)
    opts = benchmark.build_parser().parse_args([])
    gbs, candidates = benchmark.micro_batch_plan(opts)
    flags = benchmark.base_flags(opts)
    systems = benchmark.parse_systems("litespark-bf16,stock-te-bf16,litespark-fp8,stock-te-fp8",
                                      ["stock-graphs=stock-te-bf16:--cuda-graph-impl transformer_engine",
                                       "stock-fp8-unfused=stock-te-fp8:--attention-backend unfused"], flags)
    report = benchmark.run_all(systems, flags, gbs, candidates, opts, benchmark.check_shape(flags), tmp_path, "cmd")
    assert report["best_stock"] == {"bf16": "stock-graphs", "fp8": "stock-te-fp8"}
    rows = {r["system"]: r for r in report["systems"]}
    assert rows["litespark-bf16"]["vs_best_stock"] == dict(against="stock-graphs", tokens_per_sec=pytest.approx(1.1),
                                                           joules_per_token=pytest.approx(3.0 / 3.3))
    assert rows["litespark-fp8"]["vs_best_stock"]["tokens_per_sec"] == pytest.approx(2.5 / 2.4)
    assert rows["stock-te-bf16"]["vs_best_stock"]["tokens_per_sec"] == pytest.approx(3.3 / 3.6)
    md = benchmark.render_markdown(report)
    assert "| 27,307 | n/a | 1.10x (stock-graphs) |" in md and "| 24,824 | n/a | best stock |" in md
    assert "| 34,133 | n/a | 1.04x (stock-te-fp8) |" in md and "| 32,768 | n/a | best stock |" in md
    assert "| stock-fp8-unfused **DEGRADED** |" in md and "| 40,960 | n/a | 1.25x (stock-te-fp8) |" in md
    assert "bf16: stock-graphs; fp8: stock-te-fp8" in md


def test_resume_keeps_what_was_measured_and_runs_the_rest(monkeypatch, tmp_path, capsys):
    """A benchmark cut into calls (a time limit per call, a machine taken back): the same command with --resume
    keeps the systems OUT/benchmark.json measured with the same flags and settings, runs the others, and the table
    says which ran when: the rows of one invocation together, however many minutes it took. Other settings, or no
    --out, are refused before anything runs."""
    ran, outcome, clock = [], {}, ["2026-11-25 01", 0]

    def now():  # a minute passes at every look at the clock
        clock[1] += 1
        return f"{clock[0]}:{clock[1]:02d} UTC"

    def fake_worker(name, system, flags, mbs, gbs, opts, log_dir):
        ran.append(name)
        if outcome.get(name) == "timeout":
            return dict(system=name, micro_batch_size=mbs, status="timeout", reason="no result within --timeout",
                        wall_s=600.0)
        return dict(system=name, micro_batch_size=mbs, status="ok", steps=2, seconds=1.0, tokens_per_step=128,
                    step_times_s=[0.5, 0.5], joules=100.0, energy_seconds=1.0, energy_note=None, peak_mem_gib=5.0,
                    peak_mem_timed_gib=5.0, loss_first=9.0, loss_last=8.9, params=1000, skipped_steps=0, notes=[],
                    precision="bf16, fp32 main params", wall_s=30.0, device=H200,
                    health=dict(attention=["TE FusedAttention"], attention_kind="fused", fusions={}, degraded=[],
                                device_type="cuda"))

    monkeypatch.setattr(benchmark, "run_worker", fake_worker)
    monkeypatch.setattr(benchmark, "preflight", lambda args: None)
    monkeypatch.setattr(benchmark, "_now", now)
    out = tmp_path / "bench"
    # (a warm-up past the CUDA graphs' capture, which the benchmark asks of a system with graphs)
    argv = TINY + ["--warmup", "4", "--systems", "litespark-bf16,stock-te-bf16", "--out", str(out), "--resume",
                   "--variant", "stock-graphs=stock-te-bf16:--cuda-graph-impl transformer_engine"]
    outcome["stock-graphs"] = "timeout"
    assert benchmark.main(argv) == 1  # first call: nothing to resume yet; the variant timed out
    assert ran == ["litespark-bf16", "stock-te-bf16", "stock-graphs"]
    ran.clear(), outcome.clear(), capsys.readouterr()
    clock[:] = ["2026-11-25 02", 0]
    assert benchmark.main(argv) == 0
    assert ran == ["stock-graphs"]  # the two measured systems are kept, the timed-out one runs again
    assert "[1/3] litespark-bf16: kept from the report being resumed (measured 2026-11-25 01:01 UTC)" in \
        capsys.readouterr().out
    report = json.loads((out / "benchmark.json").read_text())
    assert [(r["system"], r["status"], r["measured"]) for r in report["systems"]] == [
        ("litespark-bf16", "ok", "2026-11-25 01:01 UTC"), ("stock-te-bf16", "ok", "2026-11-25 01:01 UTC"),
        ("stock-graphs", "ok", "2026-11-25 02:01 UTC")]
    assert report["device"] == H200 and report["best_stock"] == {"bf16": "stock-te-bf16"}  # equal speed: first
    assert ("- measured in several invocations (--resume), same settings: 2026-11-25 01:01 UTC: litespark-bf16, "
            "stock-te-bf16; 2026-11-25 02:01 UTC: stock-graphs") in (out / "benchmark.md").read_text()
    # a changed variant is another system: it runs, the others are kept
    ran.clear()
    changed = [a if not a.startswith("stock-graphs=") else a + " --cuda-graph-warmup-steps 2" for a in argv]
    assert benchmark.main(changed) == 0 and ran == ["stock-graphs"]
    # so is a variant whose environment changed (its flags the same)
    ran.clear()
    other_env = [a.replace("stock-graphs=stock-te-bf16:", "stock-graphs=stock-te-bf16:NVTE_NORM_FWD_USE_CUDNN=1 ")
                 for a in changed]
    assert benchmark.main(other_env) == 0 and ran == ["stock-graphs"]
    assert json.loads((out / "benchmark.json").read_text())["systems"][2]["env"] == {"NVTE_NORM_FWD_USE_CUDNN": "1"}
    ran.clear()
    assert benchmark.main(other_env) == 0 and ran == []  # the same environment again: kept
    before = (out / "benchmark.json").read_text()
    ran.clear(), capsys.readouterr()
    assert benchmark.main([a if a != "2" or i != argv.index("--steps") + 1 else "3" for i, a in enumerate(argv)]) == 2
    assert capsys.readouterr().err.strip() == (f"benchmark: error: --resume: {out / 'benchmark.json'} was measured "
                                               "with other settings (different: steps); use another --out, or the "
                                               "same settings to continue it")
    assert benchmark.main([a for a in argv if a not in ("--out", str(out))]) == 2
    assert capsys.readouterr().err.strip() == "benchmark: error: --resume needs --out: it continues OUT/benchmark.json"
    assert ran == [] and (out / "benchmark.json").read_text() == before


def _report(*rows):
    return dict(systems=[dict(system=name, status=status, health=dict(degraded=degraded) if status == "ok" else None)
                         for name, status, degraded in rows])


@pytest.mark.parametrize("rows, allow, code, said", [
    ([("a", "ok", []), ("b", "ok", [])], False, 0, []),
    ([("a", "ok", []), ("b", "ok", ["unfused attention: X"])], False, 1,
     ["benchmark: b is DEGRADED: unfused attention: X (fix the environment, or pass --allow-degraded to accept it)"]),
    ([("a", "ok", []), ("b", "ok", ["unfused attention: X"])], True, 0, ["benchmark: b is DEGRADED: unfused attention: X"]),
    ([("a", "ok", []), ("b", "failed", None)], True, 1, []),  # --allow-degraded does not excuse a failure
])
def test_exit_code_follows_failures_and_degraded_systems(rows, allow, code, said, capsys):
    assert benchmark.exit_code(_report(*rows), allow) == code
    assert capsys.readouterr().err.splitlines() == said


@pytest.mark.integration  # its processes start inside the package
def test_cpu_degraded_system_fails_the_run_unless_allowed(tmp_path, capsys):
    """A real fallback on the CPU: the stock local spec's attention (megatron-core's DotProductAttention) builds
    the score matrix. The run completes, flags it, and exits 1; with --allow-degraded it exits 0."""
    argv = TINY + ["--systems", "litespark-local-bf16", "--variant", "stock-local=litespark-local-bf16:--spec stock-local"]
    assert benchmark.main(argv + ["--out", str(tmp_path / "a")]) == 1
    captured = capsys.readouterr()
    assert ("benchmark: stock-local is DEGRADED: unfused attention: megatron-core DotProductAttention (materialized "
            "scores) (fix the environment, or pass --allow-degraded to accept it)") in captured.err
    rows = {r["system"]: r for r in json.loads((tmp_path / "a" / "benchmark.json").read_text())["systems"]}
    assert rows["stock-local"]["health"]["attention_kind"] == "unfused"
    assert rows["litespark-local-bf16"]["health"]["degraded"] == []
    assert "| stock-local **DEGRADED** | fp32 (CPU run) | megatron-core DotProductAttention" in captured.out
    # --allow-degraded: the same report exits 0, still flagged in the table (the flag reaches main's exit code:
    # test_refuses_before_measuring_when_te_fused_attention_is_unavailable).
    report = json.loads((tmp_path / "a" / "benchmark.json").read_text())
    assert benchmark.exit_code(report, True) == 0 and "stock-local **DEGRADED**" in benchmark.render_markdown(report)


def test_allow_degraded_is_documented():
    assert "--allow-degraded" in benchmark.build_parser().format_help()


def test_measure_cuda_branch_with_a_replayed_energy_counter(monkeypatch):
    import torch

    from litespark_megatron.metrics import energy

    Meter = energy.EnergyMeter
    readings = iter([5_000_000, 5_000_000 + 3_000_000])  # mJ: start, then the lap after the timed steps = 3000 J
    peaks = iter([4 * 2**30, 3 * 2**30])                   # after warm-up, after the timed steps

    class ReplayMeter(Meter):
        def __init__(self):
            super().__init__(devices=["GPU-0"], reader=lambda dev: next(readings))

    monkeypatch.setattr(energy, "EnergyMeter", ReplayMeter)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a, **k: next(peaks))
    losses = iter([3.0, 2.5, 2.0, 1.5])
    out = benchmark.measure(lambda: next(losses), tokens_per_step=100, warmup=1, steps=3, cuda=True)
    assert out["joules"] == 3000.0 and out["energy_seconds"] > 0 and out["energy_note"] is None
    assert out["peak_mem_gib"] == 4.0 and out["peak_mem_timed_gib"] == 3.0
    assert (out["steps"], out["loss_first"], out["loss_last"], len(out["step_times_s"])) == (3, 3.0, 1.5, 3)

    class NoNvml(Meter):
        def __init__(self):
            super().__init__(devices=["GPU-0"], reader=lambda dev: (_ for _ in ()).throw(OSError("NVML missing")))

    monkeypatch.setattr(energy, "EnergyMeter", NoNvml)
    peaks = iter([2**30, 2**30])
    out = benchmark.measure(lambda: 1.0, tokens_per_step=100, warmup=0, steps=1, cuda=True)
    assert out["joules"] is None and out["energy_note"].startswith("GPU energy not measured: GPU energy counter")


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs HuggingFace transformers (pip install transformers)")
def test_hf_llama_3b_is_the_megatron_shape_in_bf16():
    # Built on the meta device (no memory) the way the GPU worker builds it on CUDA: bf16 by default dtype, SDPA,
    # RoPE base 500000, and exactly the parameters the FLOP/parameter counter gives llama-3b (docs/metrics.md).
    import torch

    model = hf_model.build_hf_llama(resolve(["--model", "llama-3b"]), cuda=True, device=torch.device("meta"))
    assert sum(p.numel() for p in model.parameters()) == 3_606_752_256
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # restored after the build


@pytest.mark.integration  # its processes start inside the package
def test_refuses_before_measuring_when_te_fused_attention_is_unavailable(monkeypatch, tmp_path, capsys):
    """The pre-flight check (TE's attention run once in a fresh process) stands in for a GPU whose TE loaded another
    cuDNN than torch: nothing is measured, exit 1, the cause named; --allow-degraded measures and says so on top."""
    warning = "Transformer Engine's fused attention is unavailable here: ... TE loaded cuDNN 9.14.0, torch 9.19.0"
    monkeypatch.setattr(benchmark, "preflight", lambda args: warning)
    argv = TINY + ["--systems", "litespark-local-bf16"]
    assert benchmark.main(argv + ["--out", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"benchmark: error: {warning}. Nothing was measured") and \
        "--allow-degraded" in err[0]
    assert not (tmp_path / "a" / "benchmark.json").exists()
    assert benchmark.main(argv + ["--out", str(tmp_path / "b"), "--allow-degraded"]) == 0
    assert f"- **WARNING** (measured with --allow-degraded): {warning}" in capsys.readouterr().out


@pytest.mark.integration  # its processes start inside the package
@pytest.mark.gpu
def test_preflight_gives_the_start_up_check_answer():
    """The preflight (a fresh process) answers what the trainer's start-up check answers for the model's heads:
    nothing to refuse on a CPU; on a GPU, a warning exactly where TE's fused attention does not run."""
    import torch

    from litespark_megatron import backend_probe

    args = resolve(["--model", "tiny"])
    got = benchmark.preflight(args, timeout=120)
    if not torch.cuda.is_available():
        assert got is None
    head_dim = args.hidden_size // args.num_attention_heads
    assert got == backend_probe.te_attention_check(head_dim, args.num_attention_heads, args.num_query_groups)


def test_a_rows_precision_names_what_its_flags_lower():
    """The precision column comes from the row's resolved arguments, not from its system's name: the FP8 recipe and
    what else runs in FP8, and main gradients or Adam moments the precision-aware optimizer keeps in bf16 (they
    change the numerics and the memory a row needs). Megatron-LM's validation maps the dtype flags to torch dtypes:
    both forms read the same."""
    import copy

    from litespark_megatron.arguments import check_run
    from litespark_megatron.platform import Platform

    gpu = Platform("cuda", "nccl", True, True, "NVIDIA H200")
    base = ["--model", "tiny", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "1", "--train-iters", "2",
            "--eval-interval", "10", "--bf16", "--spec", "stock-te", "--no-rope-fusion"]
    low = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16",
           "--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16"]
    fp8 = ["--fp8-format", "hybrid"]
    cases = [
        ([], "bf16, fp32 main params"),
        (fp8, "fp8 hybrid, delayed scaling + bf16, fp32 main params"),
        (fp8 + ["--fp8-recipe", "tensorwise", "--fp8-attention"],
         "fp8 hybrid, tensorwise scaling, FP8 attention + bf16, fp32 main params"),
        (fp8 + ["--use-distributed-optimizer", "--fp8-param-gather"],
         "fp8 hybrid, delayed scaling, FP8 parameters + bf16, fp32 main params"),
        (low, "bf16, fp32 main params, bf16 main grads, bf16 Adam moments"),
        (fp8 + low[:2] + ["--exp-avg-sq-dtype", "bf16"],
         "fp8 hybrid, delayed scaling + bf16, fp32 main params, Adam moments fp32 / bf16"),
        # the dtype flags act only with the precision-aware optimizer (Megatron-LM ignores them without it)
        (["--exp-avg-dtype", "bf16"], "bf16, fp32 main params"),
    ]
    for extra, expected in cases:
        args = arguments.resolve(base + extra, gpu)
        assert benchmark.precision_of(args) == expected, extra
        validated = copy.deepcopy(args)
        check_run(validated, gpu, 1)  # Megatron-LM's validation: 'bf16' -> torch.bfloat16
        assert benchmark.precision_of(validated) == expected, extra
    assert str(validated.exp_avg_dtype) == "torch.bfloat16"  # the mapped form was read above
    assert benchmark.precision_class(benchmark.precision_of(arguments.resolve(base + fp8 + low, gpu))) == "fp8"


def test_the_largest_micro_batch_that_fits():
    """Read from a system's tries: bounded by the first larger one that ran out of memory, open when no larger one
    did (another failure than memory bounds nothing), none when no micro-batch trained."""
    def tries(**status):
        return [dict(micro_batch_size=int(k[2:]), status=v) for k, v in status.items()]

    cases = [(tries(mb1="ok", mb2="ok", mb4="oom"), {"micro_batch_size": 2, "out_of_memory_at": 4},
              "2 (4 ran out of memory)"),
             (tries(mb1="ok", mb2="ok", mb4="ok", mb8="ok"), {"micro_batch_size": 8, "out_of_memory_at": None},
              "8 or more (no larger one ran out of memory)"),
             (tries(mb1="ok", mb2="failed"), {"micro_batch_size": 1, "out_of_memory_at": None},
              "1 or more (no larger one ran out of memory)"),
             (tries(mb1="oom"), None, "none trained")]
    for t, expected, text in cases:
        assert benchmark.largest_fitting(t) == expected
        assert benchmark._largest_fitting_text(expected) == text


def test_a_variants_environment_reaches_its_worker_alone(tmp_path, monkeypatch):
    seen = []

    class Exited:
        pid = 0

        def wait(self, timeout=None):
            return 1

    def popen(cmd, env=None, **kwargs):
        seen.append(env)
        return Exited()
    monkeypatch.setattr(benchmark.subprocess, "Popen", popen)
    monkeypatch.setattr(benchmark, "_kill_group", lambda proc: None)
    opts = benchmark.build_parser().parse_args(TINY)
    _, variant = benchmark.parse_variant("v=stock-te-fp8:LITESPARK_TEST_VARIANT_ENV=1 --cross-entropy-loss-fusion")
    for system in (variant, benchmark.SYSTEMS["stock-te-fp8"]):
        assert benchmark.run_worker("v", system, [], 1, 1, opts, tmp_path)["status"] == "failed"
    assert seen[0]["LITESPARK_TEST_VARIANT_ENV"] == "1" and "LITESPARK_TEST_VARIANT_ENV" not in seen[1]


def test_a_row_whose_allocator_went_to_the_driver_in_the_timed_steps_says_so():
    """telemetry's allocator counts of the timed steps: none, no note; any cudaMalloc, cudaFree or out-of-memory
    retry, one note with the totals (a cudaFree synchronizes the device: time the kernel table does not show)."""
    from litespark_megatron.apps.benchmark import _allocator_note
    from litespark_megatron.telemetry import allocator_counts

    steady = dict(device_mallocs=0, device_frees=0, alloc_retries=0)
    assert _allocator_note([steady, steady]) is None
    assert _allocator_note([{}, {"device_mallocs": None}]) is None  # a CPU run's records have no counts
    note = _allocator_note([steady, dict(device_mallocs=3, device_frees=2, alloc_retries=1),
                            dict(device_mallocs=1, device_frees=0, alloc_retries=0)])
    assert note.startswith("the caching allocator in the timed steps: 4 cudaMalloc, 2 cudaFree, 1 out-of-memory "
                           "retries") and "synchronizes the device" in note
    # the peak reserved beside the peak allocated (what CUDA graphs' pools and the cache add)
    assert benchmark._reserved_note(131.25, 117.5) == (
        "the caching allocator reserved 131.2 GiB at most beside 117.5 GiB allocated at most (reserved: what the GPU "
        "held, cached blocks and CUDA graphs' pools included)")
    assert benchmark._reserved_note(2.0, None).startswith("the caching allocator reserved 2.0 GiB at most (reserved")
    # torch.cuda.memory_stats' cumulative counters, in the order of the record's names
    assert allocator_counts({"num_device_alloc": 7, "num_device_free": 2, "num_alloc_retries": 1,
                             "allocated_bytes.all.current": 5}) == [7, 2, 1]
    assert allocator_counts({}) == [0, 0, 0]
