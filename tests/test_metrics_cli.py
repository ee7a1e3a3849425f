"""tools/mfu.py and tools/energy_to_train.py: outputs against hand-computed values, and their error paths.

Hand-computed training FLOPs per token (see tests/test_flops.py for the derivation):
  llama-3b   half 21,389,377,536   full 23,503,306,752   params 3,606,752,256
  llama-30b  half 203,705,548,800  full 213,520,220,160  params 32,528,943,616
"""
import json

import pytest

from conftest import load_tool, run_error, run_json

from litespark_megatron.metrics.peaks import UnknownGPUError, detect_peak, match_device, mfu

LLAMA_3B = {"half": 21_389_377_536, "full": 23_503_306_752, "params": 3_606_752_256}
LLAMA_30B = {"half": 203_705_548_800, "full": 213_520_220_160, "params": 32_528_943_616}
H100_BF16_DENSE = 989.4e12


@pytest.fixture(scope="module")
def mfu_tool():
    return load_tool("mfu")


@pytest.fixture(scope="module")
def energy_tool():
    return load_tool("energy_to_train")


# ---------------------------------------------------------------------------------------------------------
# peaks
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, key", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIE"), ("NVIDIA H100 NVL", "H100-NVL"),
    ("NVIDIA H200", "H200"), ("NVIDIA H200 NVL", "H200-NVL"), ("NVIDIA GH200 480GB", "GH200"),
    ("NVIDIA A100-SXM4-80GB", "A100-SXM"), ("NVIDIA A100 80GB PCIe", "A100-PCIE"), ("NVIDIA L40S", "L40S"),
    ("NVIDIA B200", "B200"), ("h200", "H200"), ("H100-SXM", "H100-SXM"),
    ("NVIDIA L40", None), ("NVIDIA GB200", None), ("Tesla V100-SXM2-32GB", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
])
def test_device_names(name, key):
    assert match_device(name) == key


def test_dense_peaks_and_fp8_basis():
    bf16 = detect_peak("NVIDIA H100 80GB HBM3", "bf16")
    assert bf16.tflops == 989.4 and bf16.mfu_basis == "bf16-dense"  # not the 1,979 sparse figure
    fp8 = detect_peak("NVIDIA H200", "fp8")
    assert (fp8.tflops, fp8.mfu_basis, fp8.precision_peak_tflops) == (989.4, "bf16-dense", 1978.9)
    assert detect_peak("NVIDIA A100-SXM4-80GB", "bf16").tflops == 312.0
    assert detect_peak("NVIDIA A100-PCIE-40GB", "bf16").tflops == 312.0
    assert detect_peak("NVIDIA H200", "torch.bfloat16").mfu_basis == "bf16-dense"
    assert detect_peak("NVIDIA H200", "hybrid").precision == "fp8"  # --fp8-format names
    override = detect_peak("anything at all", "bf16", override=500)
    assert (override.tflops, override.mfu_basis) == (500.0, "override")
    assert mfu(494.7e12, bf16) == pytest.approx(0.5)


def test_unknown_gpu_and_missing_precision():
    with pytest.raises(UnknownGPUError, match="--peak-tflops"):
        detect_peak("Tesla V100-SXM2-32GB", "bf16")
    with pytest.raises(UnknownGPUError, match="MIG"):
        detect_peak("NVIDIA H100 80GB HBM3 MIG 3g.40gb", "bf16")
    with pytest.raises(ValueError, match="no FP8"):
        detect_peak("NVIDIA A100-SXM4-80GB", "fp8")


# ---------------------------------------------------------------------------------------------------------
# tools/mfu.py
# ---------------------------------------------------------------------------------------------------------
def test_mfu_llama_3b_measured(mfu_tool, capsys):
    out = run_json(mfu_tool, ["--model", "llama-3b", "--gpu", "H200", "--tokens-per-sec-per-gpu", "8000",
                              "--global-batch-size", "512"], capsys)
    assert out["flops_per_token"]["half"]["model"] == LLAMA_3B["half"]
    assert out["flops_per_token"]["full"]["model"] == LLAMA_3B["full"]
    assert out["params"]["total"] == LLAMA_3B["params"]
    assert out["flops_per_step"]["half"]["model"] == 512 * 4096 * LLAMA_3B["half"]
    assert out["flops_per_step"]["full"]["model"] == 512 * 4096 * LLAMA_3B["full"]
    # 8,000 tokens/s x 21.389 GFLOP = 171.1 TFLOP/s; / 989.4 = 17.29 %
    assert out["measured"]["half"]["model_tflops_per_gpu"] == pytest.approx(8000 * LLAMA_3B["half"] / 1e12)
    assert out["measured"]["half"]["mfu"] == pytest.approx(8000 * LLAMA_3B["half"] / H100_BF16_DENSE)
    assert out["measured"]["full"]["mfu"] == pytest.approx(8000 * LLAMA_3B["full"] / H100_BF16_DENSE)
    assert out["peak"]["mfu_basis"] == "bf16-dense"


def test_mfu_llama_3b_text_names_the_conventions(mfu_tool, capsys):
    assert mfu_tool.main(["--model", "llama-3b", "--gpu", "NVIDIA H200", "--tokens-per-sec-per-gpu", "8000"]) == 0
    text = capsys.readouterr().out
    assert "21,389,377,536" in text and "23,503,306,752" in text and "3,606,752,256" in text
    assert "MFU 17.29%" in text and "MFU 19.00%" in text
    assert "Megatron-LM" in text and "NeMo" in text and "bf16-dense" in text


def test_mfu_llama_30b_assumed_fp8(mfu_tool, capsys):
    out = run_json(mfu_tool, ["--model", "llama-30b", "--gpu", "NVIDIA H100 80GB HBM3", "--precision", "fp8",
                              "--mfu", "0.45"], capsys)
    assert out["params"]["total"] == LLAMA_30B["params"]
    assert out["peak"]["tflops"] == 989.4 and out["peak"]["precision_peak_tflops"] == 1978.9
    # 0.45 x 989.4 TFLOP/s / 203.7 GFLOP per token = 2,185.7 tokens/s per GPU (half); 2,085.2 (full)
    assert out["assumed"]["half"]["tokens_per_sec_per_gpu"] == pytest.approx(0.45 * H100_BF16_DENSE / LLAMA_30B["half"])
    assert out["assumed"]["full"]["tokens_per_sec_per_gpu"] == pytest.approx(0.45 * H100_BF16_DENSE / LLAMA_30B["full"])
    assert out["assumed"]["half"]["tokens_per_sec_per_gpu"] == pytest.approx(2185.7, abs=0.05)


def test_mfu_overrides_and_recompute(mfu_tool, capsys):
    # --seq-length 8192 on llama-3b: only the attention core changes; per layer full core = 4*8192*3072.
    out = run_json(mfu_tool, ["--model", "llama-3b", "--seq-length", "8192", "--recompute-granularity", "full"],
                   capsys)
    core_full = 3 * 28 * 4 * 8192 * 3072
    non_attn = LLAMA_3B["full"] - 3 * 28 * 4 * 4096 * 3072
    assert out["flops_per_token"]["full"]["model"] == non_attn + core_full
    logits = 3 * 2 * 3072 * 128256
    assert out["flops_per_token"]["full"]["hardware"] == pytest.approx(
        out["flops_per_token"]["full"]["model"] * 4 / 3 - logits / 3)
    assert out["recompute"] == "full"


@pytest.mark.parametrize("argv, needle", [
    (["--model", "llama-3b", "--gpu", "Tesla V100", "--mfu", "0.4"], "--peak-tflops"),
    (["--model", "llama-3b", "--mfu", "0.4"], "--gpu"),
    (["--model", "llama-3b", "--gpu", "H100", "--tokens-per-sec-per-gpu", "0"], "positive"),
    (["--model", "llama-3b", "--gpu", "H100", "--tokens-per-sec-per-gpu", "-5"], "positive"),
    (["--model", "llama-3b", "--peak-tflops", "-1", "--mfu", "0.4"], "positive"),
    (["--model", "llama-3b", "--gpu", "H100", "--mfu", "1.5"], "(0, 1]"),
    (["--model", "llama-3b", "--global-batch-size", "0"], "positive"),
    (["--model", "llama-3b", "--hidden-size", "3001"], "kv_channels"),
    (["--model", "llama-7"], "unknown --model"),
    (["--model", "llama-3b", "--gpu", "A100", "--precision", "fp8", "--mfu", "0.4"], "no FP8"),
    (["--model", "llama-3b", "--gpu", "H100", "--mfu", "0.4", "--tokens-per-sec-per-gpu", "10"], "not allowed"),
])
def test_mfu_errors(mfu_tool, capsys, argv, needle):
    assert needle in run_error(mfu_tool, argv, capsys)


# ---------------------------------------------------------------------------------------------------------
# tools/energy_to_train.py
# ---------------------------------------------------------------------------------------------------------
def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def steady_run(tmp_path):
    # 3 warm-up records (slow), then 8 GPUs at 8,000 tokens/s each and 600 W each:
    # J/token = 8 x 600 / (8 x 8,000) = 0.075. An evaluation record without throughput in between.
    warm = [dict(step=10 * i, tokens_per_sec=8 * 2000.0, tokens_per_sec_per_gpu=2000.0, num_gpus=8,
                 joules_per_token=0.3, gpu_power_w=600.0) for i in (1, 2, 3)]
    steady = [dict(step=10 * i, tokens_per_sec=64000.0, tokens_per_sec_per_gpu=8000.0, num_gpus=8,
                   joules_per_token=0.075, gpu_power_w=600.0) for i in range(4, 10)]
    return write_metrics(tmp_path / "metrics.jsonl", warm + [dict(step=40, eval_loss=2.5)] + steady)


def test_energy_from_metrics_llama_cluster(energy_tool, tmp_path, capsys):
    path = steady_run(tmp_path)
    out = run_json(energy_tool, ["--metrics", path, "--target-tokens", "627B", "--nodes", "16",
                                 "--grid-gco2-per-kwh", "400", "--price-per-gpu-hour", "2.5",
                                 "--price-per-kwh", "0.1"], capsys)
    # 128 GPUs x 8,000 = 1,024,000 tokens/s; 627e9 / 1,024,000 = 612,304.6875 s = 7.0869 days
    assert out["inputs"]["tokens_per_sec_per_gpu"] == pytest.approx(8000.0)
    assert out["inputs"]["gpu_power_w"] == pytest.approx(600.0)
    assert out["wall_clock_seconds"] == pytest.approx(612_304.6875)
    assert out["wall_clock_days"] == pytest.approx(612_304.6875 / 86400)
    assert out["gpu_hours"] == pytest.approx(128 * 612_304.6875 / 3600)          # 21,770.8
    assert out["gpu_energy_kwh"] == pytest.approx(13_062.5)                        # 600 W x 128 x s / 3.6e6
    assert out["node_energy_kwh"] == pytest.approx(13_062.5 * 1.2)
    assert out["facility_energy_kwh"] == pytest.approx(13_062.5 * 1.44)            # 18,810 kWh
    assert out["co2_tonnes"] == pytest.approx(18_810 * 400 / 1e6)                  # 7.524 t
    assert out["cost_gpu_hours"] == pytest.approx(21_770.833333 * 2.5)
    assert out["cost_energy"] == pytest.approx(1_881.0)
    assert out["joules_per_token_gpu"] == pytest.approx(0.075)


def test_energy_text_prints_every_assumption(energy_tool, tmp_path, capsys):
    path = steady_run(tmp_path)
    assert energy_tool.main(["--metrics", path, "--target-tokens", "627e9", "--nodes", "16",
                             "--scaling-efficiency", "0.9"]) == 0
    text = capsys.readouterr().out
    for needle in ("--scaling-efficiency", "--node-overhead", "--pue", "first 3 skipped", "14,514 kWh",
                   "not computed (give --grid-gco2-per-kwh)", "128 GPUs"):
        assert needle in text
    # 0.9 scaling: 612,304.6875 / 0.9 s
    assert f"{612_304.6875 / 0.9 / 86400:,.2f} days" in text


def test_energy_steady_state_averages(energy_tool, tmp_path, capsys):
    # Equal-token intervals: mean throughput = harmonic mean; power time-weighted (no joules_per_token here).
    records = [dict(step=1, tokens_per_sec_per_gpu=100.0, gpu_power_w=100.0),
               dict(step=2, tokens_per_sec_per_gpu=8000.0, gpu_power_w=600.0),
               dict(step=3, tokens_per_sec_per_gpu=10000.0, gpu_power_w=700.0, joules_per_token="not measured")]
    path = write_metrics(tmp_path / "m.jsonl", records)
    out = run_json(energy_tool, ["--metrics", path, "--skip-records", "1", "--target-tokens", "1T"], capsys)
    assert out["inputs"]["tokens_per_sec_per_gpu"] == pytest.approx(2 / (1 / 8000 + 1 / 10000))  # 8,888.9
    assert out["inputs"]["gpu_power_w"] == pytest.approx((600 / 8000 + 700 / 10000) / (1 / 8000 + 1 / 10000))
    assert out["inputs"]["target_tokens"] == 10 ** 12


def test_energy_from_assumptions_llama_30b(energy_tool, capsys):
    out = run_json(energy_tool, ["--model", "llama-30b", "--gpu", "H100", "--mfu", "0.45", "--gpu-power-w", "650",
                                 "--tokens-per-param", "20", "--nodes", "64"], capsys)
    tokens = 20 * LLAMA_30B["params"]                                   # 650,578,872,320 (Chinchilla 20/param)
    tps_gpu = 0.45 * H100_BF16_DENSE / LLAMA_30B["half"]                # 2,185.7
    seconds = tokens / (tps_gpu * 512)
    assert out["inputs"]["target_tokens"] == tokens
    assert out["wall_clock_seconds"] == pytest.approx(seconds)
    assert out["gpu_energy_kwh"] == pytest.approx(650 * 512 * seconds / 3.6e6)


def test_energy_llama_3b_tokens_per_param(energy_tool, capsys):
    out = run_json(energy_tool, ["--model", "llama-3b", "--tokens-per-sec-per-gpu", "8000", "--gpu-power-w", "600",
                                 "--tokens-per-param", "20", "--gpus-per-node", "4"], capsys)
    assert out["inputs"]["target_tokens"] == 20 * LLAMA_3B["params"]
    assert out["wall_clock_seconds"] == pytest.approx(20 * LLAMA_3B["params"] / 32_000)


def test_energy_errors(energy_tool, tmp_path, capsys):
    good = steady_run(tmp_path)
    assert "no such file" in run_error(energy_tool, ["--metrics", str(tmp_path / "nope.jsonl"),
                                                     "--target-tokens", "1B"], capsys)
    bad = write_metrics(tmp_path / "bad.jsonl", [dict(step=1, tokens_per_sec_per_gpu=1.0)])
    with open(bad, "a") as f:
        f.write("{not json\n")
    assert ":2: not valid JSON" in run_error(energy_tool, ["--metrics", bad, "--target-tokens", "1B"], capsys)
    text = write_metrics(tmp_path / "text.jsonl", [dict(step=1, tokens_per_sec_per_gpu="fast")])
    assert "text.jsonl:1: 'tokens_per_sec_per_gpu'" in run_error(
        energy_tool, ["--metrics", text, "--target-tokens", "1B"], capsys)
    short = write_metrics(tmp_path / "short.jsonl", [dict(step=1, tokens_per_sec_per_gpu=1.0, gpu_power_w=5.0)])
    assert "--skip-records" in run_error(energy_tool, ["--metrics", short, "--target-tokens", "1B"], capsys)
    empty = write_metrics(tmp_path / "empty.jsonl", [])
    assert "no record" in run_error(energy_tool, ["--metrics", empty, "--target-tokens", "1B"], capsys)
    for tokens in ("0", "-5", "627X"):
        assert "token count" in run_error(energy_tool, ["--metrics", good, "--target-tokens", tokens], capsys)
    assert "no target" in run_error(energy_tool, ["--metrics", good], capsys)
    assert "needs --model" in run_error(energy_tool, ["--metrics", good, "--tokens-per-param", "20"], capsys)
    assert "positive" in run_error(energy_tool, ["--metrics", good, "--tokens-per-param", "0"], capsys)
    assert "--gpu-power-w" in run_error(energy_tool, ["--tokens-per-sec-per-gpu", "10", "--target-tokens", "1B"],
                                        capsys)
    assert "(0, 1]" in run_error(energy_tool, ["--metrics", good, "--target-tokens", "1B",
                                               "--scaling-efficiency", "1.5"], capsys)
    assert ">= 1" in run_error(energy_tool, ["--metrics", good, "--target-tokens", "1B", "--pue", "0.8"], capsys)
    assert "--peak-tflops" in run_error(energy_tool, ["--model", "llama-3b", "--gpu", "V100", "--mfu", "0.4",
                                                      "--gpu-power-w", "300", "--target-tokens", "1B"], capsys)
