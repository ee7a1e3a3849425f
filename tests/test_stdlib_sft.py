"""--embedded-sft stdlib: the standard library's functions as prompt (signature and docstring) and response (body);
the set is deterministic, its validation files are held out whole, the parser builds nothing, and a run on it
learns."""
import json
import os
import sys
import textwrap

import pytest

from conftest import child_env, ok, records, run, train
from litespark_megatron import corpus, stdlib_sft
from litespark_megatron.data import load_tokenizer

SOURCE = textwrap.dedent('''\
    """Module docstring."""


    def plain(a, b=1):
        """Add."""
        return a + b


    async def multi_line(
            x,
            y):
        """Two lines
        of docstring."""
        # a comment belongs to the body
        await x
        return y


    def no_docstring():
        return 1


    def docstring_only():
        """Nothing after it."""


    def same_line():
        """Code on its line."""; return 2


    class Outer:
        def method(self):
            """Method."""
            def inner():
                """Inside the body, not a row of its own."""
                return 3
            return inner()

        class Inner:
            @property
            def deep(self):
                """Deep."""
                return 4
    ''')


def test_a_row_is_a_functions_signature_and_docstring_then_its_body():
    rows = stdlib_sft.function_rows("pkg/mod.py", SOURCE)
    assert [(r["function"], r["line"]) for r in rows] == [("plain", 4), ("multi_line", 9), ("Outer.method", 32),
                                                          ("Outer.Inner.deep", 41)]
    plain, multi, method, deep = rows
    assert (plain["prompt"], plain["response"]) == ('def plain(a, b=1):\n    """Add."""\n', "    return a + b\n")
    assert multi["prompt"] == 'async def multi_line(\n        x,\n        y):\n    """Two lines\n    of docstring."""\n'
    assert multi["response"] == "    # a comment belongs to the body\n    await x\n    return y\n"
    assert method["prompt"] == 'def method(self):\n    """Method."""\n'  # dedented to its def
    assert method["response"] == ('    def inner():\n        """Inside the body, not a row of its own."""\n'
                                  "        return 3\n    return inner()\n")
    assert deep["prompt"] == 'def deep(self):\n    """Deep."""\n'  # the decorator is not the signature
    assert all(r["path"] == "pkg/mod.py" for r in rows)
    assert stdlib_sft.function_rows("bad.py", "def broken(:\n") == []


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory):
    """A small BPE of a part of the standard library (the embedded corpus's builder, at a tenth of its cost)."""
    built = corpus.prepare_stdlib_corpus(str(tmp_path_factory.mktemp("corpus")), vocab_size=512, max_bytes=300_000)
    return built.tokenizer_dir


def read(directory, name):
    return [json.loads(line) for line in open(os.path.join(directory, name), encoding="utf-8")]


def test_the_set_is_deterministic_and_holds_out_whole_files(small_tokenizer, tmp_path):
    first = stdlib_sft.prepare_stdlib_sft(str(tmp_path / "a"), small_tokenizer)
    assert sorted(os.listdir(tmp_path / "a")) == [".lock", "sft.json", "train.jsonl", "valid.jsonl"]
    train_rows, valid_rows = read(tmp_path / "a", "train.jsonl"), read(tmp_path / "a", "valid.jsonl")
    assert first["rows"] == {"train": len(train_rows), "valid": len(valid_rows)}
    assert len(train_rows) > 1000 and len(valid_rows) > 20, first["rows"]
    train_files, valid_files = {r["path"] for r in train_rows}, {r["path"] for r in valid_rows}
    assert first["source_files"] == {"train": len(train_files), "valid": len(valid_files)}
    assert not train_files & valid_files
    assert all(stdlib_sft.is_validation_file(p) for p in valid_files)
    assert not any(stdlib_sft.is_validation_file(p) for p in train_files)
    assert not any("test" in p.split("/")[:-1] or "tests" in p.split("/")[:-1] for p in train_files | valid_files)
    tokenizer = load_tokenizer("ByteLevelBPE", small_tokenizer)
    for row in train_rows[::50]:  # within the limits: every prompt fits a --seq-length of 64
        prompt, response = tokenizer.tokenize(row["prompt"]), tokenizer.tokenize(row["response"])
        assert len(prompt) <= 64 and len(prompt) + len(response) + 1 <= 512, row

    mtimes = {p: os.stat(tmp_path / "a" / p).st_mtime_ns for p in os.listdir(tmp_path / "a")}
    assert stdlib_sft.prepare_stdlib_sft(str(tmp_path / "a"), small_tokenizer) == first  # cached: nothing rewritten
    assert {p: os.stat(tmp_path / "a" / p).st_mtime_ns for p in os.listdir(tmp_path / "a")} == mtimes
    stdlib_sft.prepare_stdlib_sft(str(tmp_path / "b"), small_tokenizer)  # built again elsewhere: the same bytes
    for name in ("train.jsonl", "valid.jsonl", "sft.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_parsing_the_embedded_sft_set_builds_nothing(tmp_path):
    """--embedded-sft names its files and the embedded corpus's tokenizer; the run builds them, not the parser."""
    code = ("from litespark_megatron import arguments\n"
            "a = arguments.resolve_quietly(['--model', 'tiny', '--embedded-sft', 'stdlib'])\n"
            "print(a.sft_data, a.sft_valid_data, a.tokenizer_type, a.tokenizer_model, a.vocab_size)")
    proc = run([sys.executable, "-c", code], env=child_env(LITESPARK_CACHE=tmp_path / "cache"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    sft, corpus_dir = tmp_path / "cache" / "stdlib-sft", tmp_path / "cache" / "stdlib-corpus"
    assert proc.stdout.split() == [f"{sft}/train.jsonl", f"{sft}/valid.jsonl", "NullTokenizer",
                                   f"{corpus_dir}/stdlib_tokenizer", "4096"], proc.stdout
    assert not (tmp_path / "cache").exists()


def test_a_run_on_the_embedded_set_learns(tmp_path):
    """The set built by the run (the embedded corpus's cache, shared with the quickstart), the tiny preset."""
    metrics = tmp_path / "m.jsonl"
    proc = ok(train(1, "--model", "tiny", "--embedded-sft", "stdlib", "--micro-batch-size", "4",
                    "--global-batch-size", "8", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "20",
                    "--log-interval", "5", "--eval-interval", "20", "--eval-iters", "2", "--metrics-file", metrics,
                    timeout=600))
    assert "(plain format)" in proc.stdout, proc.stdout[-3000:]
    losses = [r["loss"] for r in records(metrics, "train")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 1.0, losses
    run_record = records(metrics, "run")[0]
    assert run_record["data"].startswith("stdlib SFT set of "), run_record["data"]
