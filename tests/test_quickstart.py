"""The README's main job on a shortened schedule: real text (the embedded stdlib corpus), loss falls below the
data's unigram entropy, TensorBoard + metrics.jsonl + config + checkpoint are written."""
import json
import sys

from conftest import ROOT, child_env, run


def test_quickstart_short(tmp_path):
    save = tmp_path / "run"
    proc = run([sys.executable, "-m", "litespark_megatron", "--config", ROOT / "examples" / "quickstart.yaml",
                "--train-iters", "60", "--log-interval", "10", "--eval-interval", "30", "--save-interval", "30",
                "--save", save, "--tensorboard-dir", save / "tb"], timeout=900, env=child_env(OMP_NUM_THREADS=2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "step     10/60 | loss" in out and "tok/s" in out and "ETA" in out  # a progress line per interval
    summary = json.loads(out.split("summary: ", 1)[1].splitlines()[0])
    assert summary["iterations"] == 60 and summary["skipped_steps"] == 0
    # Loss falls, and the model beats what any context-free model can do on this data.
    records = [json.loads(l) for l in open(save / "metrics.jsonl")]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [10, 20, 30, 40, 50, 60]
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    assert summary["val_loss"] < summary["unigram_entropy_nats"], summary
    for key in ("lr", "grad_norm", "tokens_per_sec", "tflops_per_gpu", "mfu", "host_rss_gb", "gpu_power_w",
                "joules_per_token", "skipped_steps"):
        assert key in train[-1], key
    assert train[-1]["mfu"] is None and train[-1]["gpu_power_w"] is None  # CPU: "not measured", never invented
    assert [r["step"] for r in records if r["kind"] == "val"] == [30, 60]
    # TensorBoard scalars.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = (save / "tb").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/tflops_per_gpu",
                "train/skipped_steps", "train/host_rss_gb", "val/loss", "val/ppl"):
        assert tag in tags, (tag, sorted(tags))
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20, 30, 40, 50, 60]
    # Checkpoints and the resolved config.
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "60"
    assert (save / "iter_0000030" / "metadata.json").is_file() and (save / "iter_0000060" / "common.pt").is_file()
    assert "model: tiny" in (save / "config.yaml").read_text()
    assert "sample (prompt 'def '):" in out
