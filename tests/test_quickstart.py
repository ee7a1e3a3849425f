"""The README's main job on a shortened schedule: real text (the embedded stdlib corpus) through megatron.training,
loss falls below the data's unigram entropy, Megatron-LM's log and TensorBoard tags plus Litespark's metrics.jsonl,
`litespark/...` tags, summary and sample, and a Megatron-LM checkpoint."""
import json
import os
import re
import sys

from conftest import ROOT, child_env, run, train as litespark_train


def test_quickstart_short(tmp_path):
    save = tmp_path / "run"
    # 40 steps (the config's 30 of warm-up and 10 at the peak learning rate) are enough for what is asserted below:
    # the loss falls by more than 1 and the validation loss ends below the data's unigram entropy (measured: 8.00 ->
    # 5.92, and 6.24 against 6.47; after 30 steps the validation loss, 6.49, is not below it yet). `python -m
    # litespark_megatron`, forked from the test worker's zygote (conftest.train) with the suite's thread count.
    proc = litespark_train(1, "--config", ROOT / "examples" / "quickstart.yaml", "--train-iters", "40",
                           "--log-interval", "10", "--eval-interval", "20", "--save-interval", "20", "--save", save,
                           "--tensorboard-dir", save / "tb", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    # Megatron-LM's own progress line: after the first step, then once per log interval.
    assert [int(m) for m in re.findall(r"iteration +(\d+)/ +40 \|", out)] == [1, 10, 20, 30, 40]
    assert re.search(r"\| lm loss: [0-9.E+-]+ \|", out) and "throughput per GPU (TFLOP/s/GPU)" in out
    assert re.search(r"^what ran: attention .*\| spec litespark", out, re.M), out[:3000]
    summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
    assert summary["iterations"] == 40 and summary["energy_kwh"] is None  # CPU: not measured, never invented
    # Loss falls, and the model beats what any context-free model can do on this data.
    from litespark_megatron.data import cache_root
    from litespark_megatron.corpus import prepare_stdlib_corpus

    entropy = prepare_stdlib_corpus(os.path.join(cache_root(), "stdlib-corpus")).unigram_entropy_nats  # cached
    records = [json.loads(line) for line in open(save / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert summary["val_loss"] < entropy, (summary, entropy)
    for key in ("lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "tflops_per_gpu_causal", "mfu",
                "host_rss_gb", "gpu_power_w", "joules_per_token", "skipped_in_interval", "consumed_samples"):
        assert key in train[-1], key
    assert train[-1]["mfu"] is None and train[-1]["gpu_power_w"] is None
    assert train[-1]["consumed_samples"] == 40 * 32
    # Evaluation at 20 and 40 in the loop, and Megatron-LM's final one after training.
    assert [r["step"] for r in records if r["kind"] == "val"] == [20, 40, 40]
    assert [r["step"] for r in records if r["kind"] == "save"] == [20, 40]
    (health,) = [r for r in records if r["kind"] == "health"]
    assert health["degraded"] == [], health
    # TensorBoard: Megatron-LM's tags and Litespark's beside them.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (save / "tb").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("lm loss", "learning-rate", "grad-norm", "throughput", "lm loss validation", "lm loss validation ppl",
                "litespark/tokens-per-sec", "litespark/tflops-per-gpu", "litespark/tflops-per-gpu-causal"):
        assert tag in tags, (tag, sorted(tags))
    assert "litespark/mfu" not in tags and "litespark/gpu-power-w" not in tags  # not measured: no point at all
    assert [e.step for e in acc.Scalars("litespark/tokens-per-sec")] == [10, 20, 30, 40]
    # Megatron-LM checkpoints, and the sample.
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "40"
    for step in ("0000020", "0000040"):  # torch_dist: Megatron-LM's metadata and one shard per rank
        files = {p.name for p in (save / f"iter_{step}").iterdir()}
        assert {"metadata.json", "__0_0.distcp"} <= files, files
    assert re.search(r"^sample \(\d+ tokens after 'def '\):", out, re.M), out[-2000:]


def test_the_efficiency_base_recipe_exports_only_a_finished_run(tmp_path):
    """scripts/efficiency_base.sh on the tiny preset: a run stopped before its end exports nothing (exit 3, and says
    so); the same command again finishes the training and exports the model with the embedded corpus's tokenizer."""
    script = ROOT / "scripts" / "efficiency_base.sh"
    out = tmp_path / "base"
    flags = ["--model", "tiny", "--seq-length", "64", "--train-iters", "4", "--lr-warmup-iters", "1",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-interval", "4", "--eval-iters", "1",
             "--log-interval", "1"]
    env = child_env(PYTHON=sys.executable)
    stopped = run(["bash", script, out, *flags, "--exit-interval", "2"], timeout=600, env=env)
    assert stopped.returncode == 3, stopped.stdout[-2000:] + stopped.stderr[-2000:]
    assert "efficiency_base.sh: the training stopped 2 steps before its end; run the same command again" in \
        stopped.stderr and not (out / "hf").exists()
    finished = run(["bash", script, out, *flags], timeout=600, env=env)
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-2000:]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (out / "hf").iterdir()}
    trained = [json.loads(line)["step"] for line in open(out / "metrics.jsonl") if '"kind": "train"' in line]
    assert trained == [1, 2, 3, 4]  # the second command continued where the first stopped
    again = run(["bash", script, out, *flags], timeout=60, env=env)
    assert again.returncode == 2 and "hf exists: this base was exported already" in again.stderr
