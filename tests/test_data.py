"""Data pipeline: preprocessing, tokenizers, dataset building, the resumable iterator, the stdlib corpus and the
error messages of bad input."""
import argparse
import gzip
import json
import math
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

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


@contextmanager
def deadline(seconds):
    """Fail instead of hanging: megatron-core loops forever on an empty split part, in Python code that a signal
    interrupts."""
    def _expired(signum, frame):
        raise TimeoutError(f"did not finish within {seconds} s")
    previous = signal.signal(signal.SIGALRM, _expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


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
    base = dict(data_path=None, split="969,30,1", mock_data=False, seq_length=16, seed=1234, data_cache_path=None,
                vocab_size=None, tokenizer_type=None, tokenizer_model=None)
    base.update(kw)
    return argparse.Namespace(**base)


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
    rng = np.random.default_rng(1)
    tiny = write_prefix(tmp_path / "tiny", random_documents(rng, 3, 0, 50, 99))
    big = write_prefix(tmp_path / "big", random_documents(rng, 200, 0, 50, 99))
    tok = data.NullTokenizer(100)

    # 3 documents, 98/1/1: valid and test get none; megatron-core would loop forever, we refuse at once.
    with deadline(60), pytest.raises(DataError) as e:
        data.build_datasets(make_args(data_path=[big, tiny], split="98,1,1"), tok, [100, 10, 10])
    msg = str(e.value)
    assert f"--split 98,1,1 gives the valid part of {tiny} 0 of the 3 documents" in msg
    assert "--split 98,0,0" in msg
    with deadline(30), pytest.raises(DataError, match=f"valid part of {tiny} 0 of the 3 documents"):
        data.build_datasets(make_args(data_path=[tiny], split="98,1,1"), tok, [100, 10, 10])

    for bad in ("98,x,1", "1,2,3,4", "-1,1,1", "0,0,0"):
        with pytest.raises(DataError, match="--split"):
            data.build_datasets(make_args(data_path=[big], split=bad), tok, [10, 1, 1])
    with pytest.raises(DataError, match="train part has weight 0"):
        data.build_datasets(make_args(data_path=[big], split="0,1,1"), tok, [10, 1, 1])
    with pytest.raises(DataError, match="--data-path PREFIX"):
        data.build_datasets(make_args(), tok, [10, 1, 1])

    with deadline(60):
        train, valid, test = data.build_datasets(make_args(data_path=[big], split="98,2,0"), tok, [50, 5, 0])
    assert len(train) >= 50 and len(valid) >= 5 and test is None

    not_a_dir = tmp_path / "not_a_dir"
    not_a_dir.write_text("")
    with pytest.raises(DataError, match=rf"cannot write megatron-core's dataset index cache in {not_a_dir} .*"
                                        r"--data-cache-path"):
        data.build_datasets(make_args(data_path=[big], split="1", data_cache_path=str(not_a_dir)), tok,
                            [10, 0, 0])


def test_blend_weights_are_honoured(tmp_path):
    rng = np.random.default_rng(2)
    a = write_prefix(tmp_path / "a", random_documents(rng, 60, 0, 50, 99))
    b = write_prefix(tmp_path / "b", random_documents(rng, 60, 50, 99, 99))
    args = make_args(data_path=["0.2", a, "0.8", b], split="1", data_cache_path=str(tmp_path / "cache"))
    with deadline(60):
        train, valid, test = data.build_datasets(args, data.NullTokenizer(100), [1000, 0, 0])
    assert valid is None and test is None
    assert len(train) == 1000
    ids = np.array([int(train[i]["dataset_id"]) for i in range(len(train))])
    assert abs((ids == 0).mean() - 0.2) < 0.03 and abs((ids == 1).mean() - 0.8) < 0.03
    # the samples really come from the prefix the blend says
    for i in range(0, 1000, 37):
        sample = train[i]
        body = sample["tokens"][sample["tokens"] != 99]
        assert ((body < 50) if ids[i] == 0 else (body >= 50)).all()


def test_mock_data():
    tok = data.NullTokenizer(256)
    train, valid, test = data.build_datasets(make_args(mock_data=True, seq_length=32), tok, [20, 4, 4])
    batch = next(data.build_iterator(train, 0, 3, 0, 1))
    assert batch["tokens"].shape == (3, 32) and int(batch["tokens"].max()) < 256
    assert batch["loss_mask"].dtype == torch.float32 and batch["position_ids"][0].tolist() == list(range(32))


# ---------------------------------------------------------------------------------------------------------------
# iterator
# ---------------------------------------------------------------------------------------------------------------

def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


def _same(b1, b2):
    return all(torch.equal(b1[k], b2[k]) for k in ("tokens", "labels", "loss_mask", "position_ids"))


def test_iterator_resumes_and_partitions(tmp_path):
    rng = np.random.default_rng(3)
    prefix = write_prefix(tmp_path / "d", random_documents(rng, 40, 0, 99, 99))
    with deadline(60):
        train, _, _ = data.build_datasets(make_args(data_path=[prefix], split="1"), data.NullTokenizer(100),
                                          [30, 0, 0])
    n = len(train)
    assert n >= 30
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64), ("loss_mask", torch.float32),
                       ("position_ids", torch.int64)):
        assert next(data.build_iterator(train, 0, 2, 0, 1))[key].dtype == dtype

    # resume: consumed_samples=k gives what a straight run gives after k samples, also across epochs
    straight = _take(data.build_iterator(train, 0, 2, 0, 1), n)  # 2n samples: two epochs
    for k in (4, 6, 2 * (n // 2)):
        resumed = _take(data.build_iterator(train, k, 2, 0, 1), 5)
        assert all(_same(r, s) for r, s in zip(resumed, straight[k // 2:k // 2 + 5]))
    # the stream wraps around the dataset: epoch 2 repeats epoch 1 in the same order
    flat = torch.cat([b["tokens"] for b in straight])
    assert torch.equal(flat[:n], flat[n:2 * n])
    assert torch.equal(flat[0], train[0]["tokens"])

    # data parallel: the ranks' slices of each step are disjoint and together form the global batch
    mbs, dp = 2, 3
    whole = _take(data.build_iterator(train, 6, mbs * dp, 0, 1), 4)
    ranks = [_take(data.build_iterator(train, 6, mbs, r, dp), 4) for r in range(dp)]
    for step in range(4):
        assert torch.equal(torch.cat([ranks[r][step]["tokens"] for r in range(dp)]), whole[step]["tokens"])

    # worker processes give the same order; ranks without data get None
    with deadline(60):
        loaded = _take(data.build_iterator(train, 4, 2, 1, 2, num_workers=1), 3)
    assert all(_same(a, b) for a, b in zip(loaded, _take(data.build_iterator(train, 4, 2, 1, 2), 3)))
    assert data.build_iterator(None, 0, 2, 0, 1) is None
    with pytest.raises(DataError, match="bad batch layout"):
        data.build_iterator(train, 0, 2, 2, 2)


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
