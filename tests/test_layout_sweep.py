"""tools/layout_sweep.py on the CPU: each layout's row says what it ran; a layout that fell back is flagged and
fails the sweep unless --allow-degraded."""
import json

import pytest

from conftest import load_tool

SHARED = ["--", "--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "128", "--micro-batch-size",
          "2", "--global-batch-size", "4", "--lr", "1e-3", "--train-iters", "4", "--log-interval", "2", "--eval-iters", "0",
          "--eval-interval", "100"]


@pytest.mark.integration  # its processes start inside the package
def test_rows_say_what_ran_and_a_fallback_fails_the_sweep(tmp_path, capsys):
    sweep = load_tool("layout_sweep")
    rc = sweep.main(["--out", str(tmp_path / "a"), "--layout", "1:", "--layout", "1:--spec stock-local"] + SHARED)
    captured = capsys.readouterr()
    assert rc == 1, captured.out + captured.err
    rows = json.loads((tmp_path / "a" / "sweep.json").read_text())["rows"]
    assert [r["rc"] for r in rows] == [0, 0]
    assert rows[0]["health"]["attention"] == ["torch SDPA FlashAttention (CPU)"] and rows[0]["health"]["degraded"] == []
    assert rows[1]["health"]["attention_kind"] == "unfused"
    table = (tmp_path / "a" / "sweep.md").read_text()
    assert "| torch SDPA FlashAttention (CPU); fused: cross_entropy off, rope unfused, wgrad_accumulation off |" in table
    assert ("| **DEGRADED**: unfused attention: megatron-core DotProductAttention (materialized scores); "
            "megatron-core DotProductAttention") in table
    assert ("layout_sweep: DEGRADED layout 1:--spec stock-local: unfused attention: megatron-core "
            "DotProductAttention (materialized scores) (fix the environment, or pass --allow-degraded to accept it)"
            in captured.err)
    rc = sweep.main(["--out", str(tmp_path / "b"), "--allow-degraded", "--layout", "1:--spec stock-local"] + SHARED)
    assert rc == 0 and "**DEGRADED**" in (tmp_path / "b" / "sweep.md").read_text()


def test_a_layout_whose_cuda_graph_capture_would_be_averaged_in_is_refused(tmp_path, capsys):
    """The sweep averages every log interval after the first; CUDA graphs captured later (step 4 by default) would
    count the capture as training: refused before anything is written."""
    sweep = load_tool("layout_sweep")
    out = tmp_path / "refused"
    assert sweep.main(["--out", str(out), "--layout", "1:", "--layout", "1:--cuda-graph-impl transformer_engine"]
                      + SHARED) == 2
    assert capsys.readouterr().err == (
        "layout_sweep: error: --layout 1:--cuda-graph-impl transformer_engine captures CUDA graphs in step 4 "
        "(--cuda-graph-warmup-steps 3), after the first log interval, the only one the sweep leaves out "
        "(--log-interval 2): give --log-interval 4 or more\n")
    assert not out.exists()
    assert sweep.graph_capture_error([(1, ["--cuda-graph-impl", "transformer_engine", "--log-interval", "4"])],
                                     SHARED[1:]) == ""
    assert sweep.graph_capture_error([(2, ["hf-ddp"])], SHARED[1:]) == ""


@pytest.mark.integration  # its processes start inside the package
def test_a_refused_layout_reports_the_trainers_reason(tmp_path, capsys):
    """...and the ratios are taken against the first layout that trained, which sweep.md names."""
    sweep = load_tool("layout_sweep")
    rc = sweep.main(["--out", str(tmp_path), "--layout", "1:--tensor-model-parallel-size 3", "--layout", "1:"] + SHARED)
    capsys.readouterr()
    assert rc == 1
    sweep_json = json.loads((tmp_path / "sweep.json").read_text())
    row, trained = sweep_json["rows"]
    assert row["rc"] == 1 and row["error"].startswith("litespark-train: error: world size 1 is not divisible by "
                                                      "TP x PP x CP = 3 x 1 x 1 = 3"), row
    assert row["ratio_per_gpu_vs_first"] is None and trained["ratio_per_gpu_vs_first"] == 1.0
    assert sweep_json["ratio_base"] == "1:(none)"
    assert "ratios against the first layout that trained: 1:(none)" in (tmp_path / "sweep.md").read_text()


@pytest.mark.integration  # its processes start inside the package
def test_megatron_layouts_beside_hf_ones_train_on_random_tokens(tmp_path, capsys):
    sweep = load_tool("layout_sweep")
    mixed = ["--layout", "1:", "--layout", "1:hf-ddp"]
    assert sweep.main(["--out", str(tmp_path / "refused")] + mixed + SHARED) == 2
    assert capsys.readouterr().err == (
        "layout_sweep: error: HF layouts train on random tokens and the megatron layouts on the shared flags' data: "
        "pass --random-tokens so that every row trains on the same kind of tokens\n")
    assert not (tmp_path / "refused").exists()
    assert sweep.main(["--out", str(tmp_path / "refused"), "--random-tokens", "--layout", "1:--data-path x"]
                      + SHARED) == 2
    assert capsys.readouterr().err == (
        "layout_sweep: error: --random-tokens replaces the megatron layouts' data; drop --data-path (from the shared "
        "flags and the layouts)\n")
    assert not (tmp_path / "refused").exists()
    assert sweep.main(["--out", str(tmp_path / "refused"), "--random-tokens", "--layout", "1:", "--",
                       "--model", "llama-9z"]) == 2
    assert capsys.readouterr().err.startswith("layout_sweep: error: --random-tokens needs the model's shape from "
                                              "the shared flags: ")
    assert not (tmp_path / "refused").exists()

    out = tmp_path / "sweep"
    rc = sweep.main(["--out", str(out), "--random-tokens"] + mixed + SHARED)
    captured = capsys.readouterr()
    assert rc == 0, captured.out + captured.err
    megatron_run, hf_run = (json.loads((d / "metrics.jsonl").read_text().splitlines()[0])
                            for d in sorted(out.glob("[0-9]_np1_*")))
    assert megatron_run["data"] == f"data: {out / 'random-tokens'}"
    assert hf_run["data"] == "random tokens (uniform over the vocabulary)"
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = IndexedDataset(str(out / "random-tokens"))
    assert len(docs) == 4 * 4 and {len(docs[i]) for i in range(len(docs))} == {33}  # a step's sequences per step
    tokens = [int(t) for i in range(len(docs)) for t in docs[i]]
    assert 0 <= min(tokens) and max(tokens) < 128 and len(set(tokens)) > 100  # not megatron's counting sequences
    assert "data: random tokens, uniform over the vocabulary, for every layout" in (out / "sweep.md").read_text()
