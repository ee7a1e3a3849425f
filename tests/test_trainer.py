"""The trainer end to end (CPU, gloo): resume is bit-exact, checkpoints reshard, bad input fails cleanly."""
import json
import os
import sys

import pytest

from conftest import child_env, free_port, run

MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "6",
        "--log-interval", "1", "--eval-iters", "0", "--seed", "7"]


def train(nproc, *flags, timeout=300, **env):
    if nproc == 1:
        cmd = [sys.executable, "-m", "litespark_megatron", *flags]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", nproc, "--master-addr",
               "127.0.0.1", "--master-port", free_port(), "-m", "litespark_megatron", *flags]
    return run(cmd, timeout=timeout, env=child_env(MASTER_PORT=free_port(), **env))


def losses(metrics_file):
    records = [json.loads(line) for line in open(metrics_file)]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.parametrize("nproc, layout", [(1, []), (2, ["--use-distributed-optimizer"])],
                         ids=["adam", "dp2-distributed-optimizer"])
def test_resume_is_bit_exact(tmp_path, nproc, layout):
    straight, halves = tmp_path / "straight", tmp_path / "halves"
    first = ok(train(nproc, *MOCK, *layout, "--save", straight))
    # What ran, observed on the first step: logged in one line and as a "health" record for the tools.
    assert "what ran: attention torch SDPA FlashAttention (CPU); fused: cross-entropy off, RoPE unfused, " \
           "wgrad-accumulation off" in first.stdout
    records = [json.loads(line) for line in open(straight / "metrics.jsonl")]
    assert [r["degraded"] for r in records if r["kind"] == "health"] == [[]]
    ok(train(nproc, *MOCK, *layout, "--save", halves, "--exit-interval", "3"))
    assert (halves / "latest_checkpointed_iteration.txt").read_text() == "3"
    if "--use-distributed-optimizer" in layout:
        # Without the 'optckpt' CPU shim megatron-core's distributed-optimizer load fails on torch's AdamW state.
        broken = train(nproc, *MOCK, *layout, "--load", halves, "--save", halves,
                       LITESPARK_CPU_SHIMS="dev,rng,misc,mode,spnorm,moe")
        assert broken.returncode != 0 and "KeyError: 'step'" in broken.stderr, broken.stderr[-3000:]
    resumed = ok(train(nproc, *MOCK, *layout, "--load", halves, "--save", halves))
    assert "resumed from" in resumed.stdout and "at iteration 3" in resumed.stdout
    a, b = losses(straight / "metrics.jsonl"), losses(halves / "metrics.jsonl")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)], (a, b)  # bit-exact, not approximate


def test_checkpoint_reshards_tp2_to_tp1_and_pp2(tmp_path):
    tp2 = tmp_path / "tp2"
    flags = MOCK + ["--train-iters", "4"]
    ok(train(2, *flags, "--tensor-model-parallel-size", "2", "--save", tp2, "--exit-interval", "2"))
    ok(train(2, *flags, "--tensor-model-parallel-size", "2", "--load", tp2, "--save", tmp_path / "tp2b",
             "--exit-interval", "3"))
    expected = losses(tmp_path / "tp2b" / "metrics.jsonl")[3]
    for nproc, layout, name in [(1, [], "tp1"), (2, ["--pipeline-model-parallel-size", "2"], "pp2")]:
        ok(train(nproc, *flags, *layout, "--load", tp2, "--save", tmp_path / name, "--exit-interval", "3"))
        got = losses(tmp_path / name / "metrics.jsonl")[3]
        assert abs(got - expected) < 1e-5, f"{name}: step-3 loss {got} after resharding != {expected}"


def test_incomplete_checkpoint_is_refused(tmp_path):
    ckpt = tmp_path / "ckpt"
    (ckpt / "iter_0000004").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("4")
    proc = train(1, *MOCK, "--load", ckpt, "--save", tmp_path / "out")
    assert proc.returncode == 2
    assert "is incomplete (metadata.json or common.pt missing)" in proc.stderr
    assert not (tmp_path / "out").exists(), "a refused run must not create its --save directory"


def test_missing_checkpoint_and_unwritable_save(tmp_path):
    proc = train(1, *MOCK, "--load", tmp_path / "nothing")
    assert proc.returncode == 2 and f"--load {tmp_path / 'nothing'}: no such directory" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = train(1, *MOCK, "--load", empty)
    assert proc.returncode == 2 and "latest_checkpointed_iteration.txt is missing" in proc.stderr
    blocker = tmp_path / "file"
    blocker.write_text("x")
    proc = train(1, *MOCK, "--save", blocker / "run")
    assert proc.returncode == 2 and "is not writable" in proc.stderr


def test_bad_batch_and_layout_are_refused_before_work(tmp_path):
    proc = train(1, *MOCK, "--global-batch-size", "6", "--micro-batch-size", "4", "--save", tmp_path / "s")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("litespark-train: error: --global-batch-size 6 is not divisible "
                                                    "by micro-batch x data-parallel = 4 x 1 = 4")
    assert not (tmp_path / "s").exists()


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory):
    """Three short documents, tokenized with a 300-token BPE trained on them (tools/preprocess_data.py)."""
    root = tmp_path_factory.mktemp("corpus")
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20}) + "\n"
                            for i in range(3)))
    proc = run([sys.executable, "tools/preprocess_data.py", "--input", docs, "--output-prefix", root / "d",
                "--train-tokenizer-vocab-size", "300"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "d"


DATA = ["--model", "tiny", "--seq-length", "32", "--global-batch-size", "4", "--micro-batch-size", "2",
        "--train-iters", "2", "--eval-iters", "1"]


@pytest.mark.parametrize("flags, message", [
    (lambda c: ["--data-path", str(c) + "_missing"], "missing data prefix"),
    (lambda c: ["--data-path", str(c), "--vocab-size", "128"], "the tokenizer has 277 tokens but the model's vocabulary is 128"),
    (lambda c: ["--data-path", str(c), "--split", "98,1,1"], "--split 98,1,1 gives the"),
], ids=["missing-prefix", "vocab-larger-than-model", "empty-split-part"])
def test_bad_data_is_refused_before_work(small_corpus, tmp_path, flags, message):
    save = tmp_path / "save"
    proc = train(1, *DATA, *flags(small_corpus), "--save", save)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("litespark-train: error: ") and message in last, last
    assert "Traceback" not in proc.stderr
    assert not save.exists(), "a refused run must not create its --save directory"


def test_corrupt_index_is_refused(small_corpus, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copy(str(small_corpus) + ".bin", str(bad) + ".bin")
    shutil.copytree(str(small_corpus) + "_tokenizer", str(bad) + "_tokenizer")
    idx = open(str(small_corpus) + ".idx", "rb").read()
    open(str(bad) + ".idx", "wb").write(idx[: len(idx) // 2])
    proc = train(1, *DATA, "--data-path", bad)
    assert proc.returncode == 2 and f"{bad}.idx" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_fp16_loss_scaling_skips_and_counts_overflow_steps(tmp_path):
    """fp16 starts at loss scale 2^16: the first steps overflow, are skipped (no update), counted and logged, and
    the dynamic scaler backs off until steps go through."""
    metrics = tmp_path / "m.jsonl"
    ok(train(1, *MOCK, "--fp16", "--train-iters", "24", "--log-interval", "4", "--metrics-file", metrics))
    train_records = [json.loads(l) for l in open(metrics) if '"kind": "train"' in l]
    scales = [r["loss_scale"] for r in train_records]
    skipped = [r["skipped_steps"] for r in train_records]
    assert skipped[0] > 0 and skipped == sorted(skipped), skipped
    assert train_records[-1]["skipped_in_interval"] == 0, "steps should go through once the scale fits"
    assert scales[0] < 2.0 ** 16 and scales == sorted(scales, reverse=True), scales
    assert train_records[-1]["loss"] is not None and train_records[-1]["loss"] < 10


def test_profile_writes_each_ranks_summary_and_trace(tmp_path):
    """--profile (Megatron-LM flags): steps 3-4 of a TP2 run under torch.profiler on both ranks; each rank writes
    its summary (Markdown, JSON) and a gzipped Chrome trace into <run dir>/profile/, and training goes on."""
    import gzip

    tb = tmp_path / "run"
    proc = ok(train(2, *MOCK, "--tensor-model-parallel-size", "2", "--tensorboard-dir", tb, "--profile",
                    "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "1"))
    assert "step      6/6" in proc.stdout
    for rank in (0, 1):
        stem = tb / "profile" / f"rank{rank}"
        summary = json.loads(stem.with_suffix(".json").read_text())
        assert (summary["rank"], summary["first_step"], summary["last_step"], summary["steps"]) == (rank, 3, 4, 2)
        assert summary["device"] == "cpu" and "gemm" in {c["category"] for c in summary["categories"]}
        assert f"### rank {rank}, steps 3-4" in (tb / "profile" / f"rank{rank}.md").read_text()
        trace = json.loads(gzip.decompress((tb / "profile" / f"rank{rank}.trace.json.gz").read_bytes()))
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
        assert f"profile of rank {rank}, steps 3-4" in proc.stdout
