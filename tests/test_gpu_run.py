"""litespark-train on the machine's GPU (the GPU pass of scripts/test.sh; skipped where there is none): the tiny model
trains on the te backend in BF16 and FP8, the Litespark layer and stock's alike, through fused kernels (no
fallback named), with its GPU's energy measured."""
import pytest
import torch

from conftest import ok, records, train

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="trains on the machine's GPU")]


@pytest.mark.parametrize("precision", [["--bf16"], ["--bf16", "--fp8-format", "hybrid"]], ids=["bf16", "fp8"])
@pytest.mark.parametrize("spec", ["litespark", "stock"])
def test_the_tiny_model_trains_on_the_gpu(tmp_path, spec, precision):
    pytest.importorskip("transformer_engine.pytorch", reason="the te backend needs Transformer Engine")
    metrics = tmp_path / "metrics.jsonl"
    proc = ok(train(1, "--model", "tiny", "--mock-data", "--spec", spec, "--transformer-impl", "transformer_engine",
                    *precision, "--seq-length", "128", "--micro-batch-size", "4", "--global-batch-size", "8",
                    "--train-iters", "30", "--lr", "3e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
                    "--eval-iters", "0", "--eval-interval", "100", "--metrics-file", metrics))
    ran = [line for line in proc.stdout.splitlines() if line.startswith("what ran: ")]
    assert len(ran) == 1 and "(CPU)" not in ran[0] and not ran[0].endswith(", cpu"), proc.stdout[-3000:]
    assert "DEGRADED" not in proc.stdout, ran
    rows = records(metrics, "train")
    losses = [r["loss"] for r in rows]
    assert len(losses) == 30 and losses[-1] < losses[0], losses
    # The caching allocator: the first step takes its memory from the driver, the steady steps none (no cudaMalloc,
    # no cudaFree, no out-of-memory retry).
    counts = [(r["device_mallocs"], r["device_frees"], r["alloc_retries"]) for r in rows]
    assert counts[0][0] > 0 and counts[-10:] == [(0, 0, 0)] * 10, counts
    assert records(metrics, "run")[-1]["energy_kwh"] > 0, records(metrics, "run")
