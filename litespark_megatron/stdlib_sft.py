"""--embedded-sft stdlib: a fine-tuning set every machine has offline, made from the Python standard library's source
(the files the embedded corpus is made of, its test packages left out): the prompt is a function's signature and
docstring, the response its body.

One row per function or method with a docstring and code after it (functions inside functions are part of their
outer function's body), dedented to its `def`, in file and line order:

    {"prompt": "def f(x):\\n    \\"\\"\\"Doc.\\"\\"\\"\\n", "response": "    return x\\n", "path": "os.py", "function": "f"}

Rows whose prompt takes more than MAX_PROMPT_TOKENS tokens of the embedded corpus's tokenizer, or whose prompt and
response take more than MAX_ROW_TOKENS, are left out: every prompt then fits a --seq-length of 64 or more. Whole files
are held out for validation (those whose path hashes to 0 modulo VALID_EVERY): no function of a validation file is
trained on. The set is deterministic for an interpreter (another Python version has another standard library), built
by the run that asks for it (not by the command line's parser) and cached beside the embedded corpus.
"""
from __future__ import annotations

import ast
import hashlib
import json
import logging
import os
import platform
import tempfile
from typing import Dict, Iterator, List, Optional, Tuple

from .corpus import locked, prepare_stdlib_corpus, stdlib_corpus_dir, stdlib_corpus_layout, stdlib_source_files
from .data import DataError, cache_root, load_tokenizer

logger = logging.getLogger(__name__)

EMBEDDED_SFT_SETS = ("stdlib",)
MAX_PROMPT_TOKENS = 64
MAX_ROW_TOKENS = 512
VALID_EVERY = 20
_FORMAT = 1
_MANIFEST = "sft.json"
_FILES = {"train": "train.jsonl", "valid": "valid.jsonl"}


def stdlib_sft_dir() -> str:
    return os.path.join(cache_root(), "stdlib-sft")


def stdlib_sft_layout() -> Dict[str, object]:
    """What `--embedded-sft stdlib` names, built or not (nothing is written): its two files, and the embedded
    corpus's tokenizer and vocabulary it is tokenized with."""
    _, tokenizer_dir, vocab_size = stdlib_corpus_layout(stdlib_corpus_dir())
    directory = stdlib_sft_dir()
    return {"train": os.path.join(directory, _FILES["train"]), "valid": os.path.join(directory, _FILES["valid"]),
            "tokenizer_dir": tokenizer_dir, "vocab_size": vocab_size}


def is_validation_file(rel_path: str) -> bool:
    """Held out by the file's path alone: the same files on every machine with the same standard library."""
    return int(hashlib.sha256(rel_path.encode("utf-8")).hexdigest(), 16) % VALID_EVERY == 0


# ----------------------------------------------------------------------------------------------------------------
# Functions of a source file
# ----------------------------------------------------------------------------------------------------------------

def _dedent(lines: List[str], indent: int) -> str:
    """Each line without the `def`'s indentation (a line indented less, inside a string, loses what it has)."""
    out = []
    for line in lines:
        strip = min(indent, len(line) - len(line.lstrip(" \t")))
        out.append(line[strip:])
    return "".join(out)


def _definitions(body, prefix: str = "") -> Iterator[Tuple[str, ast.AST]]:
    """(qualified name, node) of the functions of a module or class body, methods of nested classes included."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
        elif isinstance(node, ast.ClassDef):
            yield from _definitions(node.body, f"{prefix}{node.name}.")


def function_rows(rel_path: str, text: str) -> List[Dict[str, object]]:
    """The rows of one source file: (signature and docstring, body) of each function with a docstring and code after
    it on later lines. A file Python cannot parse gives none."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    rows = []
    for name, node in _definitions(tree.body):
        if ast.get_docstring(node, clean=False) is None or len(node.body) < 2:
            continue
        docstring, code = node.body[0], node.body[1]
        if code.lineno <= docstring.end_lineno:  # code on the docstring's own line: no line between them to cut at
            continue
        prompt = _dedent(lines[node.lineno - 1:docstring.end_lineno], node.col_offset)
        response = _dedent(lines[docstring.end_lineno:node.end_lineno], node.col_offset)
        if response.strip():
            rows.append({"prompt": prompt, "response": response, "path": rel_path, "function": name,
                         "line": node.lineno})
    return rows


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8")
    except (OSError, UnicodeDecodeError):  # a few files are not UTF-8 on purpose
        return None


# ----------------------------------------------------------------------------------------------------------------
# The set, built once
# ----------------------------------------------------------------------------------------------------------------

def _config(tokenizer) -> dict:
    return {"format": _FORMAT, "source": "python-stdlib", "python": platform.python_version(),
            "implementation": platform.python_implementation(), "tokenizer": tokenizer.unique_identifiers["sha256"],
            "max_prompt_tokens": MAX_PROMPT_TOKENS, "max_row_tokens": MAX_ROW_TOKENS, "valid_every": VALID_EVERY}


def build_rows(tokenizer) -> Dict[str, List[dict]]:
    """{"train": rows, "valid": rows} of the standard library's functions, within the token limits."""
    split: Dict[str, List[dict]] = {"train": [], "valid": []}
    for rel, path in stdlib_source_files(include_tests=False):
        text = _read(path)
        rows = function_rows(rel, text) if text else []
        if not rows:
            continue
        prompts = tokenizer.tokenize_batch([r["prompt"] for r in rows])
        responses = tokenizer.tokenize_batch([r["response"] for r in rows])
        kept = [r for r, p, q in zip(rows, prompts, responses)
                if len(p) <= MAX_PROMPT_TOKENS and len(p) + len(q) + 1 <= MAX_ROW_TOKENS]  # + 1: the end token
        split["valid" if is_validation_file(rel) else "train"] += kept
    return split


def prepare_stdlib_sft(directory: str, tokenizer_dir: str) -> Dict[str, object]:
    """The set in `directory` (train.jsonl, valid.jsonl, sft.json last), built once; a later call with the same
    interpreter and tokenizer finds the manifest and returns it. Several processes at once: one builds, the others
    wait and reuse it; an interruption leaves no manifest, so the next call builds again."""
    tokenizer = load_tokenizer("ByteLevelBPE", tokenizer_dir)
    config = _config(tokenizer)
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise DataError(f"cannot create the SFT set's cache directory {directory}: {e.strerror or e}") from None
    manifest_path = os.path.join(directory, _MANIFEST)
    with locked(directory):
        try:
            with open(manifest_path, encoding="utf-8") as f:
                manifest = json.load(f)
            if manifest.get("config") == config and all(os.path.isfile(os.path.join(directory, name))
                                                        for name in _FILES.values()):
                return manifest
        except (OSError, ValueError, AttributeError):
            pass
        split = build_rows(tokenizer)
        if not split["train"] or not split["valid"]:
            raise DataError(f"the standard library of this Python gave {len(split['train'])} training and "
                            f"{len(split['valid'])} validation functions; the SFT set needs both")
        try:
            if os.path.exists(manifest_path):
                os.remove(manifest_path)
            for name, rows in split.items():
                fd, tmp = tempfile.mkstemp(prefix=".build-", dir=directory)
                try:
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        for row in rows:
                            f.write(json.dumps(row, ensure_ascii=False) + "\n")
                    os.replace(tmp, os.path.join(directory, _FILES[name]))
                finally:
                    if os.path.exists(tmp):
                        os.remove(tmp)
            manifest = {"config": config, "files": _FILES,
                        "rows": {name: len(rows) for name, rows in split.items()},
                        "source_files": {name: len({r["path"] for r in rows}) for name, rows in split.items()}}
            tmp = manifest_path + f".tmp-{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=2)
                f.write("\n")
            os.replace(tmp, manifest_path)
        except OSError as e:
            raise DataError(f"cannot write the SFT set in {directory}: {e.strerror or e}") from None
    logger.info("stdlib SFT set: %d training rows, %d validation rows", manifest["rows"]["train"],
                manifest["rows"]["valid"])
    return manifest


def prepare_embedded_sft(args) -> None:
    """--embedded-sft stdlib: the embedded corpus's tokenizer (built once, cached) and the set made with it. The
    command line only named their paths (`stdlib_sft_layout`): a run builds its data, a parser does not."""
    if getattr(args, "embedded_sft", None) != "stdlib":
        return
    corpus = prepare_stdlib_corpus(stdlib_corpus_dir())
    prepare_stdlib_sft(stdlib_sft_dir(), corpus.tokenizer_dir)


def describe_stdlib_sft(path: str) -> Optional[str]:
    """One line naming a prepared set by what decides its content (its interpreter, rows and files); None when its
    manifest cannot be read."""
    try:
        with open(os.path.join(os.path.dirname(path), _MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
        config = manifest["config"]
        return (f"stdlib SFT set of {config['implementation']} {config['python']}: {manifest['rows']['train']} "
                f"training rows from {manifest['source_files']['train']} files, {manifest['rows']['valid']} "
                f"validation rows from {manifest['source_files']['valid']} held-out files")
    except (OSError, ValueError, KeyError, TypeError):
        return None
