"""Data pipeline: preprocessing, tokenizers, dataset building, the resumable iterator, the stdlib corpus and the
error messages of bad input."""
import argparse
import gzip
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from litespark_megatron import corpus, data
from litespark_megatron.data import DataError

ROOT = Path(__file__).resolve().parents[1]

DOCS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "import os\nprint(os.getcwd())  # <|endoftext|> is text here\n",
    "",  # empty: skipped, not written
    "naïve café — UTF-8 survives byte-level BPE ✓",
]


def write_jsonl(path, texts, key="text"):
    with open(path, "w", encoding="utf-8") as f:
        for t in texts:
            f.write(json.dumps({key: t, "meta": 1}) + "\n")
    return str(path)


def write_prefix(prefix, documents, vocab_size=100):
    """An indexed dataset of the given token-id documents, written by the project's writer."""
    with corpus.IndexedDatasetWriter(str(prefix), vocab_size) as writer:
        for doc in documents:
            writer.add_document(list(doc))
        writer.commit()
    return str(prefix)


def random_documents(rng, n, low, high, eod, min_len=5, max_len=40):
    return [list(rng.integers(low, high, size=rng.integers(min_len, max_len))) + [eod] for _ in range(n)]


def make_args(**kw):
    """litespark-train's arguments (the tokenizer's vocabulary: 100 ids, as write_prefix's) with these fields."""
    from litespark_megatron.arguments import resolve_quietly

    args = vars(resolve_quietly(["--model", "tiny", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]))
    args.update(data_path=None, split="969,30,1", mock_data=False, seq_length=16, seed=1234, data_cache_path=None,
                train_iters=10, train_samples=None, skip_train=False)
    args.update(kw)
    return argparse.Namespace(**args)


def read_back(prefix):
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))], ds.index.dtype


# ---------------------------------------------------------------------------------------------------------------
# preprocessing
# ---------------------------------------------------------------------------------------------------------------

def test_preprocess_roundtrip_trained_tokenizer(tmp_path, capsys):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    prefix = str(tmp_path / "out" / "docs")
    rc = corpus.preprocess_main(["--input", src, "--output-prefix", prefix, "--train-tokenizer-vocab-size", "300"])
    assert rc == 0, capsys.readouterr().err
    tok = data.load_tokenizer("ByteLevelBPE", data.default_tokenizer_dir(prefix))
    assert tok.eod == tok.vocab[data.EOD_TOKEN] and tok.pad == data.NO_PAD

    stored, dtype = read_back(prefix)
    expected_texts = [t for t in DOCS if t]
    assert dtype == np.uint16  # Megatron-LM's choice below 65500 ids
    assert len(stored) == len(expected_texts)
    for text, ids in zip(expected_texts, stored):
        assert ids == tok.tokenize(text) + [tok.eod]
        assert tok.detokenize(ids[:-1]) == text
    # A literal end-of-text string inside a document is text: the only EODs are the appended ones.
    assert all(ids.count(tok.eod) == 1 for ids in stored)
    info = data.inspect_prefix(prefix)
    assert info.num_documents == len(expected_texts) and info.num_tokens == sum(map(len, stored))


def test_preprocess_text_files_and_existing_tokenizer(tmp_path, capsys):
    tok_dir = tmp_path / "tok"
    data.train_bpe_tokenizer(DOCS * 5, 300, str(tok_dir))
    a = tmp_path / "a.txt"
    a.write_text("first line\n\nsecond line\n", encoding="utf-8")
    b = tmp_path / "b.txt"
    b.write_text("whole file document", encoding="utf-8")

    per_file = str(tmp_path / "files")
    assert corpus.preprocess_main(["--input", str(a), str(b), "--output-prefix", per_file,
                                   "--tokenizer-model", str(tok_dir), "--no-append-eod"]) == 0
    per_line = str(tmp_path / "lines")
    assert corpus.preprocess_main(["--input", str(a), "--output-prefix", per_line, "--txt-split-lines",
                                   "--tokenizer-type", "ByteLevelBPE", "--tokenizer-model",
                                   str(tok_dir / "tokenizer.json")]) == 0
    tok = data.load_tokenizer("ByteLevelBPE", str(tok_dir))
    assert read_back(per_file)[0] == [tok.tokenize(a.read_text()), tok.tokenize("whole file document")]
    assert read_back(per_line)[0] == [tok.tokenize("first line") + [tok.eod],
                                      tok.tokenize("second line") + [tok.eod]]

    # gzipped JSONL with several keys: one dataset per key, as Megatron-LM's tool does
    records = [{"title": f"t{i}", "text": f"body {i} " * 3} for i in range(4)]
    with gzip.open(tmp_path / "r.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    multi = str(tmp_path / "multi")
    assert corpus.preprocess_main(["--input", str(tmp_path / "r.jsonl.gz"), "--output-prefix", multi,
                                   "--json-keys", "title", "text", "--tokenizer-model", str(tok_dir)]) == 0
    for key in ("title", "text"):
        assert read_back(f"{multi}_{key}")[0] == [tok.tokenize(r[key]) + [tok.eod] for r in records]


def test_preprocess_errors_exit_2_and_leave_nothing(tmp_path, capsys):
    good = json.dumps({"text": "fine"})
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text(f"{good}\n{{\"text\": oops}}\n{good}\n", encoding="utf-8")
    no_key = tmp_path / "nokey.jsonl"
    no_key.write_text(f"{good}\n{good}\n{json.dumps({'body': 'x'})}\n", encoding="utf-8")
    tok_dir = tmp_path / "tok"
    data.train_bpe_tokenizer(DOCS * 5, 300, str(tok_dir))
    out = tmp_path / "out"
    out.mkdir()
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")

    cases = [
        (["--input", str(bad_json), "--tokenizer-model", str(tok_dir)], [f"{bad_json} line 2", "not valid JSON"]),
        (["--input", str(no_key), "--tokenizer-model", str(tok_dir)], [f"{no_key} line 3", "no key 'text'",
                                                                      "--json-keys"]),
        (["--input", str(tmp_path / "absent.jsonl"), "--tokenizer-model", str(tok_dir)], ["absent.jsonl",
                                                                                         "no such file"]),
        (["--input", str(bad_json), "--train-tokenizer-vocab-size", "300"], [f"{bad_json} line 2"]),
        (["--input", str(bad_json)], ["no tokenizer"]),
    ]
    for argv, needles in cases:
        rc = corpus.preprocess_main(argv + ["--output-prefix", str(out / "p")])
        err = capsys.readouterr().err
        assert rc == 2, (argv, err)
        assert err.count("\n") == 1 and "error:" in err, err
        for needle in needles:
            assert needle in err, (needle, err)
        # nothing half-written: no dataset, no temporary files, no tokenizer from a failed run
        assert sorted(os.listdir(out)) == [], os.listdir(out)

    rc = corpus.preprocess_main(["--input", write_jsonl(tmp_path / "ok.jsonl", ["x y"]), "--output-prefix",
                                 str(blocker / "sub" / "p"), "--tokenizer-model", str(tok_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot write" in err and "writable" in err, err


def test_preprocess_tool_runs_as_a_script(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n', encoding="utf-8")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("PYTHONPATH", None)  # the tool must find the package from a source checkout by itself
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "preprocess_data.py"), "--input", str(bad),
                           "--output-prefix", str(tmp_path / "p"), "--train-tokenizer-vocab-size", "300"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"preprocess_data.py: error: {bad} line 2: not valid JSON (Expecting value at column 1); "
        f"each line must be one JSON object"]


# ---------------------------------------------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------------------------------------------

def test_tokenizer_errors_and_vocab_check(tmp_path):
    with pytest.raises(DataError, match=r"unknown --tokenizer-type 'GPT2BPE'.*HuggingFaceTokenizer, ByteLevelBPE, "
                                        r"NullTokenizer"):
        data.load_tokenizer("GPT2BPE", str(tmp_path))
    with pytest.raises(DataError, match=r"no such file or directory"):
        data.load_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nope"))
    with pytest.raises(DataError, match=r"needs --tokenizer-model"):
        data.load_tokenizer("ByteLevelBPE", None)
    with pytest.raises(DataError, match=r"has no tokenizer.json"):
        data.load_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    with pytest.raises(DataError, match=r"at least 257"):
        data.train_bpe_tokenizer(["abc"], 100, str(tmp_path / "small"))

    tok = data.train_bpe_tokenizer(DOCS * 20, 300, str(tmp_path / "tok"))
    assert 257 <= tok.vocab_size <= 300
    data.check_vocab(tok, tok.vocab_size)
    data.check_vocab(tok, None)
    with pytest.raises(DataError) as e:
        data.check_vocab(tok, 128)
    msg = str(e.value)
    assert f"{tok.vocab_size} tokens" in msg and "128" in msg and "drop --vocab-size" in msg


def test_huggingface_directory_eos_from_config(tmp_path):
    tok = data.train_bpe_tokenizer(DOCS * 20, 300, str(tmp_path / "hf"))
    # A HuggingFace directory names its EOS in tokenizer_config.json; use a different one than <|endoftext|>.
    cfg_path = tmp_path / "hf" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["eos_token"] = {"content": "a", "special": False}
    cfg["pad_token"] = "b"
    cfg_path.write_text(json.dumps(cfg))
    hf = data.load_tokenizer("HuggingFaceTokenizer", str(tmp_path / "hf"))
    assert hf.eod == tok.vocab["a"] and hf.pad == tok.vocab["b"]
    null = data.load_tokenizer("NullTokenizer", None, vocab_size=64)
    assert (null.vocab_size, null.eod, null.tokenize("1 2 63")) == (64, 63, [1, 2, 63])
    with pytest.raises(DataError, match="--vocab-size"):
        data.load_tokenizer("NullTokenizer", None)


# ---------------------------------------------------------------------------------------------------------------
# data paths, splits, datasets
# ---------------------------------------------------------------------------------------------------------------

def test_data_path_forms_and_prefix_errors(tmp_path):
    rng = np.random.default_rng(0)
    a = write_prefix(tmp_path / "a", random_documents(rng, 10, 0, 50, 99))
    b = write_prefix(tmp_path / "b", random_documents(rng, 10, 0, 50, 99))
    assert data.parse_data_path([a, b]) == ([a, b], None)
    assert data.parse_data_path(["0.3", a, "0.7", b]) == ([a, b], [0.3, 0.7])
    assert data.parse_data_path(f"1 {a}") == ([a], [1.0])
    with pytest.raises(DataError, match="mixes weights and prefixes"):
        data.parse_data_path([a, "0.5", b])
    with pytest.raises(DataError, match="weight/prefix pairs"):
        data.parse_data_path(["0.5", a, b])
    with pytest.raises(DataError, match="positive"):
        data.parse_data_path(["0", a, "1", b])

    missing = str(tmp_path / "missing")
    with pytest.raises(DataError) as e:
        data.parse_data_path([a, missing])
    assert str(e.value) == (f"missing data prefix {missing} (expected {missing}.bin and {missing}.idx; make them "
                            f"with tools/preprocess_data.py)")
    with pytest.raises(DataError, match=f"without the extension: {a}$"):
        data.parse_data_path([a + ".bin"])

    for cut in (4, 30, os.path.getsize(a + ".idx") - 3):
        bad = tmp_path / f"cut{cut}"
        bad.with_suffix(".bin").write_bytes(Path(a + ".bin").read_bytes())
        bad.with_suffix(".idx").write_bytes(Path(a + ".idx").read_bytes()[:cut])
        with pytest.raises(DataError, match=rf"{bad}\.idx is not a readable Megatron index"):
            data.parse_data_path([str(bad)])
    short = tmp_path / "short"
    short.with_suffix(".idx").write_bytes(Path(a + ".idx").read_bytes())
    short.with_suffix(".bin").write_bytes(Path(a + ".bin").read_bytes()[:-8])
    with pytest.raises(DataError, match=rf"{short}\.bin is truncated"):
        data.parse_data_path([str(short)])


def test_split_validation(tmp_path):
    """data.check refuses, before any process group, what megatron-core's dataset builder would loop on forever
    (a split part without tokens) or fail on with a traceback."""
    rng = np.random.default_rng(1)
    tiny = write_prefix(tmp_path / "tiny", random_documents(rng, 3, 0, 50, 99))
    big = write_prefix(tmp_path / "big", random_documents(rng, 200, 0, 50, 99))

    def check(**kw):
        data.check(make_args(**kw))

    # 3 documents, 98/1/1: valid and test get none.
    with pytest.raises(DataError) as e:
        check(data_path=[big, tiny], split="98,1,1")
    msg = str(e.value)
    assert f"--split 98,1,1 gives the valid part of {tiny} 0 of the 3 documents" in msg
    assert "--split 98,0,0" in msg
    with pytest.raises(DataError, match=f"valid part of {tiny} 0 of the 3 documents"):
        check(data_path=[tiny], split="98,1,1")
    for bad in ("98,x,1", "1,2,3,4", "-1,1,1", "0,0,0"):
        with pytest.raises(DataError, match="--split"):
            check(data_path=[big], split=bad)
    with pytest.raises(DataError, match="train part has weight 0"):
        check(data_path=[big], split="0,1,1")
    check(data_path=[big], split="0,1,1", skip_train=True)  # an evaluation-only run trains on nothing
    check(data_path=[big], split="98,2,0")
    check(mock_data=True, split="98,1,1")  # mock data has no documents to check

    not_a_dir = tmp_path / "not_a_dir"
    not_a_dir.write_text("")
    for cache in (not_a_dir, not_a_dir / "sub"):
        with pytest.raises(DataError, match=rf"cannot write megatron-core's dataset index cache in {cache} .*"
                                            r"--data-cache-path"):
            check(data_path=[big], split="1", data_cache_path=str(cache))
    check(data_path=[big], split="1", data_cache_path=str(tmp_path / "new" / "cache"))
    assert not (tmp_path / "new").exists()  # checked, not created: megatron-core creates it


def test_empty_split_part_is_what_megatron_core_loops_on(tmp_path):
    """Why the check above exists: megatron-core's GPTDataset given a split part without tokens never returns
    (its epoch count grows forever; a 3-document build otherwise takes seconds). If this stops hanging, the check
    can be relaxed."""
    rng = np.random.default_rng(1)
    tiny = write_prefix(tmp_path / "tiny", random_documents(rng, 3, 0, 50, 99))
    code = f"""
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from litespark_megatron import data
config = GPTDatasetConfig(random_seed=1, sequence_length=16, blend=([{tiny!r}], None), split="98,1,1",
                          tokenizer=data.NullTokenizer(100), reset_position_ids=False, reset_attention_mask=False,
                          eod_mask_loss=False, path_to_cache={str(tmp_path / "cache")!r})
BlendedMegatronDatasetBuilder(GPTDataset, [10, 10, 10], lambda: True, config).build()
print("BUILT")
"""
    # The suite's path (megatron-core may be installed on PYTHONPATH) with the checkout first; a process that ends,
    # whatever the reason, says how.
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=15, env=env)
    except subprocess.TimeoutExpired:
        return
    pytest.fail(f"the build returned (exit {proc.returncode}): {proc.stdout[-300:]}{proc.stderr[-2000:]}")


# ---------------------------------------------------------------------------------------------------------------
# stdlib corpus
# ---------------------------------------------------------------------------------------------------------------

def test_prepare_stdlib_corpus(tmp_path):
    cache = tmp_path / "corpus"
    c = corpus.prepare_stdlib_corpus(str(cache), vocab_size=512, max_bytes=300_000)
    assert not c.cached
    manifest = json.loads(Path(c.manifest_path).read_text())
    assert manifest["files"] == c.num_files > 3 and 0 < manifest["bytes"] <= 300_000
    assert manifest["tokens"] == c.num_tokens > manifest["files"]
    assert manifest["vocab_size"] == c.vocab_size <= 512 and manifest["dtype"] == "uint16"
    assert 0 < c.unigram_entropy_nats < math.log(c.vocab_size)
    assert manifest["config"]["max_bytes"] == 300_000
    info = data.inspect_prefix(c.prefix)
    assert info.num_documents == c.num_files and info.num_tokens == c.num_tokens
    tok = data.load_tokenizer("ByteLevelBPE", c.tokenizer_dir)
    lines = (cache / "corpus.jsonl").read_text(encoding="utf-8").splitlines()
    assert len(lines) == c.num_files
    first = json.loads(lines[0])
    assert not os.path.isabs(first["path"]) and first["path"].endswith(".py")
    assert read_back(c.prefix)[0][0] == tok.tokenize(first["text"]) + [tok.eod]
    # the run record names the corpus by what decides its content (another Python, another corpus)
    assert corpus.describe_stdlib_corpus(c.prefix) == (
        f"stdlib corpus of {platform.python_implementation()} {platform.python_version()}: {c.num_files} files, "
        f"{c.num_tokens:,} tokens")
    assert corpus.describe_stdlib_corpus(str(tmp_path / "nowhere" / "stdlib")) is None
    # nothing but the published files is left behind
    assert sorted(os.listdir(cache)) == [".lock", "corpus.json", "corpus.jsonl", "stdlib.bin", "stdlib.idx",
                                         "stdlib_tokenizer"]

    mtimes = {p: os.stat(cache / p).st_mtime_ns for p in os.listdir(cache)}
    again = corpus.prepare_stdlib_corpus(str(cache), vocab_size=512, max_bytes=300_000)
    assert again.cached and again.prefix == c.prefix and again.num_tokens == c.num_tokens
    assert {p: os.stat(cache / p).st_mtime_ns for p in os.listdir(cache)} == mtimes

    # other arguments: rebuilt in place
    other = corpus.prepare_stdlib_corpus(str(cache), vocab_size=400, max_bytes=200_000)
    assert not other.cached and other.num_bytes <= 200_000 and other.vocab_size <= 400
    assert json.loads(Path(other.manifest_path).read_text())["config"]["vocab_size"] == 400


def test_token_ids_are_checked_against_the_vocabulary(tmp_path, monkeypatch):
    """The largest id is read from the .bin (then cached by path, size and modification time): an id the
    embedding does not have is one line before training, not an IndexError (a device assert on a GPU) in step 1."""
    monkeypatch.setenv("LITESPARK_CACHE", str(tmp_path / "cache"))
    prefix = write_prefix(tmp_path / "p", [[1, 2, 3], [4, 257, 6]], vocab_size=300)
    info = data.inspect_prefix(prefix)
    data.check_token_ids(info, 258)  # ids 0..257: all there
    with pytest.raises(DataError) as e:
        data.check_token_ids(info, 257)
    assert str(e.value).startswith(f"{prefix}.bin holds token id 257, but the tokenizer has 257 ids (0 to 256)")
    assert len(list((tmp_path / "cache" / "token-range").iterdir())) == 1  # scanned once, then read from the cache
    data.check_token_ids(info, 70_000)  # a dtype whose ids all fit (uint16 < 70,000): no scan needed
    small = write_prefix(tmp_path / "small", [[1, 2, 3]], vocab_size=300)
    data.check_token_ids(data.inspect_prefix(small), 70_000)
    assert len(list((tmp_path / "cache" / "token-range").iterdir())) == 1
