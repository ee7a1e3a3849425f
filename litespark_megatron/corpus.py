"""Text -> megatron-core indexed datasets: document readers, the dataset writer, the preprocessing command and the
built-in quickstart corpus.

The quickstart corpus is the Python standard library's own source: real text, written by many people, present on
every machine with Python and needing no download. `prepare_stdlib_corpus` turns it into a tokenizer and an
indexed dataset once and caches them.
"""
from __future__ import annotations

import argparse
import fcntl
import gzip
import io
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from litespark_megatron.data import (DataError, Tokenizer, cache_root, default_tokenizer_dir, load_tokenizer,
                                     train_bpe_tokenizer)

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 40_000_000
"""Default size cap of the stdlib corpus. CPython 3.11's .py files total about 32 MB (13 MB without tests), so
the cap takes all of them; preparing that takes about 20 s on two cores (tokenizer training ~5 s, tokenizing
~10 s)."""

_BATCH_DOCUMENTS = 256  # documents tokenized per call: enough for the tokenizers thread pool, bounded memory
_BATCH_CHARS = 8 << 20
_TEST_DIRS = frozenset({"test", "tests", "idle_test"})
_MANIFEST = "corpus.json"
_MANIFEST_FORMAT = 1
_PREFIX = "stdlib"  # the indexed dataset's name in the cache directory (its tokenizer: stdlib_tokenizer/)


# ----------------------------------------------------------------------------------------------------------------
# Reading documents
# ----------------------------------------------------------------------------------------------------------------

def _open_text(path: str):
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="strict")
    return open(path, encoding="utf-8", errors="strict")


def _is_jsonl(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.endswith((".jsonl", ".json"))


def _read_jsonl(path: str, json_keys: Sequence[str]) -> Iterator[Dict[str, str]]:
    lineno = 0
    try:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg} at column {e.colno}); "
                                    f"each line must be one JSON object") from None
                if not isinstance(record, dict):
                    raise DataError(f"{path} line {lineno}: expected a JSON object with key "
                                    f"{json_keys[0]!r}, got a {type(record).__name__}")
                out = {}
                for key in json_keys:
                    if key not in record:
                        have = ", ".join(map(str, list(record)[:8])) or "no keys"
                        raise DataError(f"{path} line {lineno}: no key {key!r} (the line has: {have}); choose "
                                        f"the text key with --json-keys")
                    value = record[key]
                    if not isinstance(value, str):
                        raise DataError(f"{path} line {lineno}: key {key!r} holds a {type(value).__name__}, "
                                        f"expected a string")
                    out[key] = value
                yield out
    except UnicodeDecodeError as e:
        raise DataError(f"{path} line {lineno + 1}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def _read_text(path: str, key: str, split_lines: bool) -> Iterator[Dict[str, str]]:
    try:
        with _open_text(path) as f:
            if split_lines:
                for line in f:
                    line = line.rstrip("\r\n")
                    if line.strip():
                        yield {key: line}
            else:
                yield {key: f.read()}
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None


def iter_documents(paths: Sequence[str], json_keys: Sequence[str] = ("text",),
                   txt_split_lines: bool = False) -> Iterator[Dict[str, str]]:
    """Documents of the inputs, in order, as {json_key: text}.

    `.jsonl`/`.json` files (optionally `.gz`) hold one JSON object per line; any other file is plain UTF-8 text,
    one document per file, or one per non-empty line with `txt_split_lines`.
    """
    json_keys = list(json_keys)
    if not json_keys:
        raise DataError("--json-keys needs at least one key")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"input {path}: no such file")
    for path in paths:
        if _is_jsonl(path):
            yield from _read_jsonl(path, json_keys)
        elif len(json_keys) > 1:
            raise DataError(f"{path} is plain text, which has no keys; several --json-keys need JSONL input")
        else:
            yield from _read_text(path, json_keys[0], txt_split_lines)


# ----------------------------------------------------------------------------------------------------------------
# Writing indexed datasets
# ----------------------------------------------------------------------------------------------------------------

class IndexedDatasetWriter:
    """Writes PREFIX.bin/PREFIX.idx with megatron-core's IndexedDatasetBuilder, one sequence per document.

    Token dtype as Megatron-LM's preprocess_data.py picks it (uint16 below 65500 ids, else int32). Both files are
    written under temporary names and renamed by `commit()`; an error or interrupt leaves no half-written
    dataset. Use as a context manager (aborts on exception) or call commit()/abort().
    """

    def __init__(self, prefix: str, vocab_size: int) -> None:
        from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

        self.prefix = prefix
        self.dtype = DType.optimal_dtype(int(vocab_size))
        self.num_documents = 0
        self.num_tokens = 0
        self.num_skipped = 0
        suffix = f".tmp-{os.getpid()}"
        self._tmp_bin = prefix + ".bin" + suffix
        self._tmp_idx = prefix + ".idx" + suffix
        self._builder = None
        try:
            parent = os.path.dirname(os.path.abspath(prefix))
            os.makedirs(parent, exist_ok=True)
            self._builder = IndexedDatasetBuilder(self._tmp_bin, dtype=self.dtype)
        except OSError as e:
            raise DataError(f"cannot write {prefix}.bin: {e.strerror or e}; choose a writable output "
                            f"prefix") from None

    def add_document(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            # An empty document is no sample material; megatron-core would keep a zero-length sequence.
            self.num_skipped += 1
            return
        array = np.asarray(ids, dtype=self.dtype)
        self._builder.add_document(array, [array.size])
        self.num_documents += 1
        self.num_tokens += int(array.size)

    def commit(self) -> None:
        if self.num_documents == 0:
            self.abort()
            raise DataError(f"no documents for {self.prefix}: the input holds no non-empty text")
        try:
            self._builder.finalize(self._tmp_idx)
            os.replace(self._tmp_bin, self.prefix + ".bin")
            os.replace(self._tmp_idx, self.prefix + ".idx")
        except OSError as e:
            self.abort()
            raise DataError(f"cannot write {self.prefix}: {e.strerror or e}") from None

    def abort(self) -> None:
        if self._builder is not None and not self._builder.data_file.closed:
            self._builder.data_file.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)

    def __enter__(self) -> "IndexedDatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()


def _batches(records: Iterable[Dict[str, str]]) -> Iterator[List[Dict[str, str]]]:
    batch, chars = [], 0
    for record in records:
        batch.append(record)
        chars += sum(len(v) for v in record.values())
        if len(batch) >= _BATCH_DOCUMENTS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def tokenize_to_indexed_datasets(records: Iterable[Dict[str, str]], tokenizer: Tokenizer,
                                 output_prefixes: Dict[str, str], append_eod: bool = True,
                                 log_every_seconds: float = 30.0) -> Dict[str, IndexedDatasetWriter]:
    """Tokenize {key: text} records into one indexed dataset per key (output_prefixes[key]).

    EOD is appended to every document (Megatron-LM's --append-eod), so that samples packed across document
    boundaries carry the boundary. Returns the committed writers (their counts are the statistics).
    """
    writers: Dict[str, IndexedDatasetWriter] = {}
    try:
        for key, prefix in output_prefixes.items():
            writers[key] = IndexedDatasetWriter(prefix, tokenizer.vocab_size)
        t0 = last_log = time.time()
        for batch in _batches(records):
            for key, writer in writers.items():
                for ids in tokenizer.tokenize_batch([r[key] for r in batch]):
                    if ids and append_eod:
                        ids.append(tokenizer.eod)
                    writer.add_document(ids)
            if time.time() - last_log >= log_every_seconds:
                last_log = time.time()
                w = next(iter(writers.values()))
                logger.info("tokenized %d documents, %d tokens (%.0f s)", w.num_documents, w.num_tokens,
                            last_log - t0)
        for writer in writers.values():
            writer.commit()
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    return writers


def unigram_entropy_nats(counts: np.ndarray) -> float:
    """Entropy of the token frequency distribution, in nats: the loss of a model that ignores context."""
    counts = counts[counts > 0].astype(np.float64)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


def read_token_counts(prefix: str, vocab_size: int) -> np.ndarray:
    """Occurrences of each token id in PREFIX.bin."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(prefix, multimodal=False, mmap=False)
    dtype = dataset.index.dtype
    del dataset
    tokens = np.fromfile(prefix + ".bin", dtype=dtype)
    return np.bincount(tokens.astype(np.int64), minlength=int(vocab_size))


# ----------------------------------------------------------------------------------------------------------------
# The Python standard library corpus
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StdlibCorpus:
    """A prepared stdlib corpus: `prefix` for --data-path, `tokenizer_dir` for --tokenizer-model."""

    prefix: str
    tokenizer_dir: str
    manifest_path: str
    num_files: int
    num_bytes: int
    num_tokens: int
    vocab_size: int
    unigram_entropy_nats: float
    cached: bool


def stdlib_source_files(include_tests: bool = True) -> List[Tuple[str, str]]:
    """(path relative to the stdlib, absolute path) of the standard library's .py files, sorted.

    Third-party packages (site-packages, dist-packages) are not the standard library and are skipped.
    """
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        parts = [] if rel_dir == "." else rel_dir.split(os.sep)
        if parts and parts[0] in ("site-packages", "dist-packages"):
            dirnames[:] = []
            continue
        if "__pycache__" in parts or (not include_tests and _TEST_DIRS.intersection(parts)):
            dirnames[:] = []
            continue
        for name in filenames:
            if name.endswith(".py"):
                rel = "/".join(parts + [name])
                files.append((rel, os.path.join(dirpath, name)))
    files.sort()
    return files


def _read_stdlib_documents(max_bytes: int, include_tests: bool) -> List[Tuple[str, str]]:
    """(relative path, text) of the sorted stdlib files that fit in max_bytes together.

    Files that are not UTF-8 (a few tests on purpose) or hold only whitespace are skipped; a file larger than what
    is left of the cap is skipped and later smaller ones still fill it, deterministically.
    """
    docs, total = [], 0
    for rel, path in stdlib_source_files(include_tests):
        if total >= max_bytes:
            break
        try:
            size = os.path.getsize(path)
            if total + size > max_bytes:
                continue
            with open(path, "rb") as f:
                text = f.read().decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        docs.append((rel, text))
        total += size
    return docs


@contextmanager
def locked(directory: str):
    """Exclusive lock on a directory: concurrent preparers (several ranks, several runs) build it once."""
    # Append mode: opening must not touch the file, so that a cache hit leaves the directory exactly as it was.
    with open(os.path.join(directory, ".lock"), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _corpus_config(vocab_size: int, max_bytes: int, include_tests: bool) -> dict:
    # The Python version is part of the key: another interpreter has another standard library.
    return {"format": _MANIFEST_FORMAT, "source": "python-stdlib", "python": platform.python_version(),
            "implementation": platform.python_implementation(), "vocab_size": int(vocab_size),
            "max_bytes": int(max_bytes), "include_tests": bool(include_tests)}


def _load_cached(cache_dir: str, config: dict) -> Optional[StdlibCorpus]:
    path = os.path.join(cache_dir, _MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("config") != config:
        return None
    prefix = os.path.join(cache_dir, manifest.get("prefix", ""))
    tokenizer_dir = os.path.join(cache_dir, manifest.get("tokenizer_dir", ""))
    if not all(os.path.isfile(p) for p in (prefix + ".bin", prefix + ".idx",
                                            os.path.join(tokenizer_dir, "tokenizer.json"))):
        return None
    return StdlibCorpus(prefix=prefix, tokenizer_dir=tokenizer_dir, manifest_path=path,
                        num_files=manifest["files"], num_bytes=manifest["bytes"], num_tokens=manifest["tokens"],
                        vocab_size=manifest["vocab_size"], unigram_entropy_nats=manifest["unigram_entropy_nats"],
                        cached=True)


def describe_stdlib_corpus(prefix: str) -> Optional[str]:
    """One line naming a prepared stdlib corpus (its --data-path prefix) by what decides its content: the
    interpreter, and the files and tokens its standard library gave (distributions differ: one without the test
    packages gives a third of the text). None when its manifest cannot be read."""
    try:
        with open(os.path.join(os.path.dirname(prefix), _MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        config = manifest["config"]
        return (f"stdlib corpus of {config['implementation']} {config['python']}: {manifest['files']} files, "
                f"{manifest['tokens']:,} tokens")
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prepare_stdlib_corpus(cache_dir: str, vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES,
                          include_tests: bool = True) -> StdlibCorpus:
    """Tokenizer + indexed dataset of the Python standard library's source, built once in cache_dir.

    Writes cache_dir/corpus.jsonl (the documents), stdlib_tokenizer/ (byte-level BPE of `vocab_size` tokens
    trained on them), stdlib.bin/.idx (one document per file, EOD appended) and corpus.json, the manifest, last.
    A later call with the same arguments finds the manifest and returns at once. Safe to call from several
    processes at the same time (one builds, the others wait and reuse it).
    """
    if int(max_bytes) < 1:
        raise DataError(f"max_bytes must be positive, got {max_bytes}")
    config = _corpus_config(vocab_size, max_bytes, include_tests)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the corpus cache directory {cache_dir}: {e.strerror or e}") from None
    with locked(cache_dir):
        cached = _load_cached(cache_dir, config)
        if cached is not None:
            return cached
        return _build_stdlib_corpus(cache_dir, config)


def stdlib_corpus_dir() -> str:
    """Where `--embedded-corpus stdlib` keeps the corpus."""
    return os.path.join(cache_root(), "stdlib-corpus")


def stdlib_corpus_layout(cache_dir: str, vocab_size: int = 4096, max_bytes: int = DEFAULT_MAX_BYTES,
                         include_tests: bool = True) -> Tuple[str, str, int]:
    """(--data-path prefix, tokenizer directory, vocabulary) of the corpus `prepare_stdlib_corpus` keeps in cache_dir,
    built or not: what a run's flags name before the run builds it. Nothing is written. The vocabulary is the built
    tokenizer's where the corpus is built (a byte-level BPE reports its real size), else the size it is trained to,
    which a standard library's source reaches."""
    built = _load_cached(cache_dir, _corpus_config(vocab_size, max_bytes, include_tests))
    prefix = os.path.join(cache_dir, _PREFIX)
    return prefix, default_tokenizer_dir(prefix), built.vocab_size if built is not None else int(vocab_size)


def prepare_embedded_corpus(args) -> None:
    """--embedded-corpus: build the corpus the run's data flags name (once, cached; several ranks at once are safe).
    The command line only named it (`stdlib_corpus_layout`): a run builds its data, a parser does not."""
    if getattr(args, "embedded_corpus", None) == "stdlib":
        prepare_stdlib_corpus(stdlib_corpus_dir())


def _build_stdlib_corpus(cache_dir: str, config: dict) -> StdlibCorpus:
    t0 = time.time()
    docs = _read_stdlib_documents(config["max_bytes"], config["include_tests"])
    if not docs:
        raise DataError(f"no standard library file fits in max_bytes={config['max_bytes']}; raise it")
    num_bytes = sum(len(text.encode("utf-8")) for _, text in docs)
    logger.info("stdlib corpus: %d files, %.1f MB", len(docs), num_bytes / 1e6)

    names = {"jsonl": "corpus.jsonl", "prefix": _PREFIX}
    names["tokenizer"] = os.path.basename(default_tokenizer_dir(names["prefix"]))
    build_dir = tempfile.mkdtemp(prefix=".build-", dir=cache_dir)
    try:
        with open(os.path.join(build_dir, names["jsonl"]), "w", encoding="utf-8") as f:
            for rel, text in docs:
                f.write(json.dumps({"text": text, "path": rel}, ensure_ascii=False) + "\n")

        t1 = time.time()
        tokenizer = train_bpe_tokenizer((text for _, text in docs), config["vocab_size"],
                                        os.path.join(build_dir, names["tokenizer"]), length=len(docs))
        t2 = time.time()
        logger.info("stdlib corpus: trained a %d-token BPE in %.1f s", tokenizer.vocab_size, t2 - t1)
        writers = tokenize_to_indexed_datasets(({"text": text} for _, text in docs), tokenizer,
                                               {"text": os.path.join(build_dir, names["prefix"])})
        writer = writers["text"]
        t3 = time.time()
        logger.info("stdlib corpus: %d tokens in %.1f s", writer.num_tokens, t3 - t2)
        counts = read_token_counts(os.path.join(build_dir, names["prefix"]), tokenizer.vocab_size)
        entropy = unigram_entropy_nats(counts)

        # Publish: the old manifest goes first and the new one comes last, so an interruption in between leaves
        # a directory that the next call rebuilds rather than trusts.
        manifest_path = os.path.join(cache_dir, _MANIFEST)
        if os.path.exists(manifest_path):
            os.remove(manifest_path)
        for name in (names["jsonl"], names["prefix"] + ".bin", names["prefix"] + ".idx", names["tokenizer"]):
            target = os.path.join(cache_dir, name)
            if os.path.isdir(target):
                shutil.rmtree(target)
            elif os.path.exists(target):
                os.remove(target)
            os.replace(os.path.join(build_dir, name), target)
        manifest = {
            "config": config,
            "prefix": names["prefix"],
            "tokenizer_dir": names["tokenizer"],
            "documents_file": names["jsonl"],
            "files": len(docs),
            "bytes": num_bytes,
            "documents": writer.num_documents,
            "tokens": writer.num_tokens,
            "vocab_size": tokenizer.vocab_size,
            "dtype": np.dtype(writer.dtype).name,
            "bytes_per_token": round(num_bytes / max(writer.num_tokens, 1), 4),
            "unigram_entropy_nats": round(entropy, 6),
            "build_seconds": round(time.time() - t0, 2),
        }
        tmp = os.path.join(build_dir, _MANIFEST)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2)
            f.write("\n")
        os.replace(tmp, manifest_path)
    except OSError as e:
        raise DataError(f"cannot write the corpus in {cache_dir}: {e.strerror or e}") from None
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    logger.info("stdlib corpus ready in %.1f s: %s", time.time() - t0, cache_dir)
    return StdlibCorpus(prefix=os.path.join(cache_dir, names["prefix"]),
                        tokenizer_dir=os.path.join(cache_dir, names["tokenizer"]), manifest_path=manifest_path,
                        num_files=len(docs), num_bytes=num_bytes, num_tokens=writer.num_tokens,
                        vocab_size=tokenizer.vocab_size, unigram_entropy_nats=round(entropy, 6), cached=False)


# ----------------------------------------------------------------------------------------------------------------
# The preprocessing command (tools/preprocess_data.py, console script litespark-preprocess)
# ----------------------------------------------------------------------------------------------------------------

def build_preprocess_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="Tokenize text into a megatron-core indexed dataset (PREFIX.bin + PREFIX.idx), the format of "
                    "Megatron-LM's tools/preprocess_data.py. Train with --data-path PREFIX.")
    p.add_argument("--input", nargs="+", required=True, metavar="FILE",
                   help="JSONL files (.jsonl/.json, optionally .gz; one JSON object per line) or plain UTF-8 "
                        "text files (one document per file)")
    p.add_argument("--output-prefix", required=True, metavar="PREFIX",
                   help="writes PREFIX.bin and PREFIX.idx (PREFIX_KEY.* for several --json-keys)")
    p.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                   help="JSONL keys holding the text, one dataset per key (default: text)")
    p.add_argument("--txt-split-lines", action="store_true",
                   help="plain text: one document per non-empty line instead of per file")
    p.add_argument("--tokenizer-type", default=None,
                   help="HuggingFaceTokenizer or ByteLevelBPE (default: guessed from --tokenizer-model)")
    p.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="tokenizer.json or a directory holding one")
    p.add_argument("--train-tokenizer-vocab-size", type=int, default=None, metavar="N",
                   help="instead of --tokenizer-model, train an N-token byte-level BPE on the input and save it "
                        "in PREFIX_tokenizer/")
    p.add_argument("--train-tokenizer-max-bytes", type=int, default=1 << 30, metavar="B",
                   help="train the tokenizer on at most the first B bytes of text (default: 1 GiB)")
    p.add_argument("--append-eod", action=argparse.BooleanOptionalAction, default=True,
                   help="end every document with the tokenizer's end-of-document token (default: on)")
    p.add_argument("--workers", type=int, default=None,
                   help="tokenizer threads (default: all cores)")
    return p


def _limit_bytes(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    used = 0
    for text in texts:
        if used >= max_bytes:
            return
        used += len(text.encode("utf-8"))
        yield text


def preprocess(args: argparse.Namespace) -> Dict[str, IndexedDatasetWriter]:
    """The work of the preprocessing command, on parsed arguments. Raises DataError."""
    if args.train_tokenizer_vocab_size is not None and (args.tokenizer_model or args.tokenizer_type):
        raise DataError("give either --train-tokenizer-vocab-size (train a new tokenizer) or "
                        "--tokenizer-type/--tokenizer-model (use one), not both")
    if args.train_tokenizer_vocab_size is None and not args.tokenizer_model:
        raise DataError("no tokenizer: pass --tokenizer-model PATH, or --train-tokenizer-vocab-size N to train one")
    if args.tokenizer_type == "NullTokenizer":
        raise DataError("NullTokenizer makes mock data and tokenizes no text; use HuggingFaceTokenizer or "
                        "ByteLevelBPE")
    if args.workers is not None:
        if args.workers < 1:
            raise DataError(f"--workers must be >= 1, got {args.workers}")
        # The tokenizers library sizes its thread pool from this when it first tokenizes in parallel.
        os.environ["RAYON_NUM_THREADS"] = str(args.workers)
    keys = list(dict.fromkeys(args.json_keys))
    prefixes = ({keys[0]: args.output_prefix} if len(keys) == 1
                else {k: f"{args.output_prefix}_{k}" for k in keys})
    for path in args.input:
        if not os.path.isfile(path):
            raise DataError(f"input {path}: no such file")

    if args.train_tokenizer_vocab_size is not None:
        save_dir = default_tokenizer_dir(args.output_prefix)
        texts = (r[k] for r in iter_documents(args.input, keys, args.txt_split_lines) for k in keys)
        tokenizer = train_bpe_tokenizer(_limit_bytes(texts, args.train_tokenizer_max_bytes),
                                        args.train_tokenizer_vocab_size, save_dir)
        print(f"tokenizer: {save_dir} ({tokenizer.vocab_size} tokens)")
    else:
        tokenizer = load_tokenizer(args.tokenizer_type, args.tokenizer_model)

    t0 = time.time()
    writers = tokenize_to_indexed_datasets(iter_documents(args.input, keys, args.txt_split_lines), tokenizer,
                                           prefixes, append_eod=args.append_eod)
    for writer in writers.values():
        skipped = f", {writer.num_skipped} empty skipped" if writer.num_skipped else ""
        print(f"wrote {writer.prefix}.bin and .idx: {writer.num_documents} documents, {writer.num_tokens} tokens "
              f"({np.dtype(writer.dtype).name}){skipped} in {time.time() - t0:.1f} s")
    return writers


def preprocess_main(argv: Optional[Sequence[str]] = None, prog: Optional[str] = None) -> int:
    """Command line entry: 0 on success, 2 with one line on stderr for bad input."""
    parser = build_preprocess_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits on --help (0) and usage errors (2); report, don't exit
        return int(e.code or 0)
    if not logging.getLogger().handlers:
        # Progress of this package at INFO; megatron-core's per-file index chatter stays at WARNING.
        logging.basicConfig(level=logging.WARNING, format="%(message)s")
        logging.getLogger("litespark_megatron").setLevel(logging.INFO)
    try:
        preprocess(args)
    except DataError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
