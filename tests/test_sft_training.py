"""litespark-train --sft-data on the tiny preset: the loss of a fine-tuning run falls and its validation is recorded;
TP2+SP and PP2 take the single-process steps on the same rows (the padding and the masked prompts included); a bad
row stops the run before any work, in one line, with nothing written."""
import json
import random

import pytest

from conftest import made_once, ok, parity_run, records, train
from test_parallel_parity import assert_same
from test_sft_data import TEMPLATE, word_tokenizer

WORDS = ["a", "b", "c", "d", "e", "f", "g"]


def reversal_rows(path, n, seed):
    """Prompt: 2-6 words; response: the same words reversed. Lengths vary, so sequences carry different paddings."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            words = rng.choices(WORDS, k=rng.randint(2, 6))
            f.write(json.dumps({"prompt": " ".join(words), "response": " ".join(reversed(words))}) + "\n")
    return path


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    def build(directory):
        return (reversal_rows(directory / "train.jsonl", 64, 1), reversal_rows(directory / "valid.jsonl", 8, 2),
                word_tokenizer(directory / "tok"), word_tokenizer(directory / "chat", TEMPLATE))
    return made_once(tmp_path_factory, "sft-rows", build)


def flags(rows, tokenizer, *extra):
    train_rows, valid_rows = rows[:2]
    # NullTokenizer with 256 ids: the model's vocabulary is the same under TP1 and TP2 (Megatron-LM pads it per TP)
    return ["--model", "tiny", "--seq-length", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
            "--tokenizer-model", tokenizer, "--sft-data", train_rows, "--sft-valid-data", valid_rows,
            "--micro-batch-size", "2", "--global-batch-size", "8", "--seed", "1234", *map(str, extra)]


def test_an_sft_run_learns_its_responses_and_is_validated(rows, tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = ok(train(1, *flags(rows, rows[2], "--lr", "3e-3", "--train-iters", "30", "--eval-interval", "15",
                               "--eval-iters", "1", "--log-interval", "5", "--metrics-file", metrics)))
    assert "sft data: --sft-data " in proc.stdout and "64 rows (plain format)" in proc.stdout, proc.stdout[-3000:]
    losses = [r["loss"] for r in records(metrics, "train")]
    assert len(losses) == 6 and losses[-1] < 0.6 * losses[0], losses
    val = records(metrics, "val")
    assert [r["step"] for r in val][:2] == [15, 30] and val[1]["loss"] < val[0]["loss"], val
    # tokens/s counts the samples' example tokens, not their padding: the sum over the sample order
    from litespark_megatron import sft_data
    from litespark_megatron.arguments import resolve_quietly

    args = resolve_quietly([str(f) for f in flags(rows, rows[2], "--lr", "3e-3", "--train-iters", "30")])
    sft_data.prepare(args)
    summed = sft_data.train_input_tokens(args)
    train_records = records(metrics, "train")
    assert [r["tokens_seen"] for r in train_records] == [int(summed[r["consumed_samples"]]) for r in train_records]
    assert train_records[-1]["tokens_seen"] < 240 * 32 / 2  # the sequences are mostly padding
    for before, record in zip(train_records, train_records[1:]):
        interval = record["tokens_per_sec"] * record["step_time_s"] * record["steps"]
        assert interval == pytest.approx(record["tokens_seen"] - before["tokens_seen"], rel=1e-6)


@pytest.fixture(scope="module")
def reference(rows, tmp_path_factory):
    return made_once(tmp_path_factory, "sft-parity-reference", lambda directory: parity_run(
        directory, 1, flags(rows, rows[3], *PARITY)))


PARITY = ["--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "100"]


@pytest.mark.parametrize("layout, nproc, extra", [
    ("tp2-sp", 2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    ("pp2", 2, ["--pipeline-model-parallel-size", "2"]),
])
def test_layouts_take_the_single_process_steps_on_sft_rows(rows, reference, tmp_path, layout, nproc, extra):
    """The chat-template format (the tokenizer's template through transformers) under TP2+SP and PP2."""
    assert reference["losses"][-1] < reference["losses"][0]
    assert_same(parity_run(tmp_path, nproc, flags(rows, rows[3], *PARITY, *extra)), reference, layout)


def test_a_bad_row_stops_the_run_before_any_work(rows, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(open(rows[0]).read() + '{"prompt": "a b", "response": ""}\n')
    save = tmp_path / "save"
    args = flags(rows, rows[2], "--lr", "1e-3", "--train-iters", "2", "--eval-interval", "10", "--save", save,
                 "--save-interval", "5")
    args[args.index("--sft-data") + 1] = str(bad)
    proc = train(1, *args)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [
        f"litespark-train: error: {bad} line 65: 'response' is empty: a row needs a prompt to answer and a response "
        "to learn; fill it or drop the row"], proc.stderr[-3000:]
    assert not save.exists(), "a refused run must not create its --save directory"
