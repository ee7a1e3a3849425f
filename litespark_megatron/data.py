"""Text tokenizers, indexed-dataset prefixes and the checks megatron-core leaves to assertions or endless loops.

The data on disk is megatron-core's indexed dataset (`PREFIX.bin` + `PREFIX.idx`, the format Megatron-LM's
`tools/preprocess_data.py` writes), so corpora prepared for Megatron-LM train here and the other way round.
megatron.training builds the datasets and batches from them (pretrain.datasets_provider); this module checks the
prefixes and the split first, and holds the text tokenizers the preprocessing tool and --sample-prompt use.

megatron-core is imported inside the functions that need it: importing it costs seconds, and the tokenizer and
argument helpers here are also used by command-line front ends that should start instantly.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .errors import UserError

logger = logging.getLogger(__name__)

EOD_TOKEN = "<|endoftext|>"
"""End-of-document token of the byte-level BPE tokenizers trained here (GPT-2's spelling)."""

TOKENIZER_TYPES = ("HuggingFaceTokenizer", "ByteLevelBPE", "NullTokenizer")

NO_PAD = -1
"""Pad id of tokenizers without a pad token distinct from EOD. It is megatron-core's own "no pad" id: never a
real token, so GPTDataset masks only the padding it adds itself, never a genuine EOD."""

# End-of-text spellings of common tokenizers, tried in order when a tokenizer directory does not name its EOS token.
_EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>", "<|eot_id|>")

_SPLIT_NAMES = ("train", "valid", "test")


class DataError(UserError, ValueError):
    """Data or tokenizer input that cannot be used. The message says what is wrong and what to do."""


# ----------------------------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------------------------

class TextTokenizer:
    """A HuggingFace `tokenizers.Tokenizer` with the interface megatron-core's datasets and this project use.

    GPTDataset reads `vocab_size` (to pick the token dtype), `eod` (loss/position masks), `pad` (the id of the
    padding it adds) and `unique_identifiers` (a JSON-able description hashed into its index-cache file names).
    """

    def __init__(self, backend, *, kind: str, eod_token: str, pad_token: Optional[str] = None) -> None:
        self.backend = backend
        # Documents are data: a literal "<|endoftext|>" inside a text is text, not a document boundary. The only
        # EODs in a token stream must be the ones the preprocessor appends.
        self.backend.encode_special_tokens = True
        self._vocab = backend.get_vocab(with_added_tokens=True)
        if eod_token not in self._vocab:
            raise DataError(f"the tokenizer has no token {eod_token!r} to end documents with")
        self.kind = kind
        self.eod_token = eod_token
        self._eod = self._vocab[eod_token]
        # The largest id + 1, not len(vocab): some tokenizers leave holes in the id space and the embedding table
        # must cover the largest id.
        self._vocab_size = max(self._vocab.values()) + 1
        pad = self._vocab.get(pad_token) if pad_token else None
        self._pad = pad if pad is not None and pad != self._eod else NO_PAD
        self._inv_vocab: Optional[Dict[int, str]] = None
        # Content hash, not path: moving a tokenizer keeps megatron-core's index caches valid, retraining one in
        # place invalidates them.
        digest = hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()[:16]
        self.unique_identifiers = OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("sha256", digest),
             ("vocab_size", self._vocab_size), ("eod", self._eod)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._eod

    @property
    def eos(self) -> int:
        return self._eod

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def vocab(self) -> Dict[str, int]:
        return self._vocab

    @property
    def inv_vocab(self) -> Dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {i: t for t, i in self._vocab.items()}
        return self._inv_vocab

    def tokenize(self, text: str) -> List[int]:
        # add_special_tokens=False: a pretraining stream holds documents and EODs only, no BOS/template tokens
        # (Megatron-LM's HuggingFaceTokenizer does the same for data).
        return self.backend.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        """Many texts at once, in parallel in the tokenizers library (its thread pool, RAYON_NUM_THREADS)."""
        return [e.ids for e in self.backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kind}, vocab_size={self._vocab_size}, eod={self._eod})"


class NullTokenizer:
    """Tokenizer of mock data: ids are written as text ("5 17 3"); the last id of the vocabulary is EOD.

    Unlike Megatron-LM's NullTokenizer (vocab_size + 1 ids, EOD outside the given size), `vocab_size` here is the
    whole vocabulary, so a mock run uses exactly the model's embedding table.
    """

    def __init__(self, vocab_size: Optional[int]) -> None:
        if vocab_size is None or int(vocab_size) < 2:
            raise DataError(f"NullTokenizer needs --vocab-size >= 2 (got {vocab_size}): the mock data draws ids "
                            f"below it and uses the last one as end of document")
        self._vocab_size = int(vocab_size)
        self.unique_identifiers = OrderedDict(
            [("class", f"{type(self).__module__}.{type(self).__qualname__}"), ("vocab_size", self._vocab_size)])

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def eod(self) -> int:
        return self._vocab_size - 1

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def pad(self) -> int:
        return NO_PAD

    def tokenize(self, text: str) -> List[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise DataError("NullTokenizer reads whitespace-separated token ids, e.g. '5 17 3'") from None
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise DataError(f"NullTokenizer: id {bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        return ids

    def tokenize_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.tokenize(t) for t in texts]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer(vocab_size={self._vocab_size})"


Tokenizer = Union[TextTokenizer, NullTokenizer]


def _tokenizer_file(path: str, tokenizer_type: str) -> str:
    if os.path.isdir(path):
        path_json = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path_json):
            raise DataError(
                f"--tokenizer-model {path}: the directory has no tokenizer.json; {tokenizer_type} loads the "
                f"'tokenizers' format (a HuggingFace fast tokenizer writes it with save_pretrained())")
        return path_json
    if os.path.isfile(path):
        return path
    raise DataError(f"--tokenizer-model {path}: no such file or directory (--tokenizer-type {tokenizer_type} "
                    f"loads a local tokenizer.json or a directory holding one; nothing is downloaded)")


def special_token_name(value) -> Optional[str]:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _hf_special_tokens(directory: str) -> Tuple[Optional[str], Optional[str]]:
    """(eos, pad) named by a HuggingFace tokenizer directory, if it names them."""
    eos = pad = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        except (OSError, ValueError) as e:
            raise DataError(f"{path}: not readable JSON ({e})") from None
        if not isinstance(cfg, dict):
            continue
        eos = eos or special_token_name(cfg.get("eos_token"))
        pad = pad or special_token_name(cfg.get("pad_token"))
    return eos, pad


def load_tokenizer(tokenizer_type: Optional[str], tokenizer_model: Optional[str],
                   vocab_size: Optional[int] = None) -> Tokenizer:
    """Load a tokenizer offline.

    HuggingFaceTokenizer: a local directory with tokenizer.json (EOS/pad from tokenizer_config.json or
    special_tokens_map.json when present). ByteLevelBPE: a tokenizer.json trained by `train_bpe_tokenizer`, or
    its directory; its EOD is <|endoftext|>. NullTokenizer: mock data, `vocab_size` ids. With no type, a
    directory with tokenizer_config.json is read as HuggingFaceTokenizer, anything else as ByteLevelBPE.
    """
    if tokenizer_type is None:
        if tokenizer_model is None:
            raise DataError("no tokenizer: pass --tokenizer-model PATH (a tokenizer.json or a directory holding "
                            "one), or --tokenizer-type NullTokenizer for mock data")
        tokenizer_type = ("HuggingFaceTokenizer"
                          if os.path.isfile(os.path.join(tokenizer_model, "tokenizer_config.json"))
                          else "ByteLevelBPE")
    if tokenizer_type not in TOKENIZER_TYPES:
        raise DataError(f"unknown --tokenizer-type {tokenizer_type!r}; choose one of: {', '.join(TOKENIZER_TYPES)}")
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if not tokenizer_model:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs --tokenizer-model PATH (a tokenizer.json or a "
                        f"directory holding one)")

    from tokenizers import Tokenizer as _HFTokenizer

    path = _tokenizer_file(tokenizer_model, tokenizer_type)
    try:
        backend = _HFTokenizer.from_file(path)
    except Exception as e:  # the Rust side raises a bare Exception for any parse problem
        raise DataError(f"{path}: not a tokenizer.json of the 'tokenizers' library ({e})") from None
    vocab = backend.get_vocab(with_added_tokens=True)

    if tokenizer_type == "ByteLevelBPE":
        if EOD_TOKEN not in vocab:
            raise DataError(f"{path} has no {EOD_TOKEN} token, so it was not trained by litespark's "
                            f"train_bpe_tokenizer; use --tokenizer-type HuggingFaceTokenizer for other tokenizers")
        return TextTokenizer(backend, kind=tokenizer_type, eod_token=EOD_TOKEN)

    eos, pad = _hf_special_tokens(os.path.dirname(path))
    if eos is None or eos not in vocab:
        eos = next((t for t in _EOD_CANDIDATES if t in vocab), None)
    if eos is None:
        raise DataError(f"{path}: cannot tell which token ends a document; put a tokenizer_config.json with "
                        f"\"eos_token\" next to it")
    return TextTokenizer(backend, kind=tokenizer_type, eod_token=eos, pad_token=pad)


def default_tokenizer_dir(prefix: str) -> str:
    """Where tools/preprocess_data.py --train-tokenizer-vocab-size saves the tokenizer of PREFIX."""
    return f"{prefix}_tokenizer"


def tokenizer_from_args(args) -> Tokenizer:
    """The tokenizer a run asks for: --tokenizer-type/--tokenizer-model; without them NullTokenizer for
    --mock-data, else the tokenizer saved next to the first --data-path prefix (PREFIX_tokenizer/)."""
    ttype = getattr(args, "tokenizer_type", None)
    model = getattr(args, "tokenizer_model", None)
    vocab_size = getattr(args, "vocab_size", None)
    if ttype is None and model is None:
        if getattr(args, "mock_data", False):
            return NullTokenizer(vocab_size)
        if getattr(args, "data_path", None):
            prefixes, _ = _split_blend_tokens(args.data_path)
            candidate = default_tokenizer_dir(prefixes[0])
            if os.path.isfile(os.path.join(candidate, "tokenizer.json")):
                return load_tokenizer(None, candidate, vocab_size)
            raise DataError(f"no tokenizer: pass --tokenizer-model (and --tokenizer-type), or keep the data's "
                            f"tokenizer in {candidate}/ (tools/preprocess_data.py --train-tokenizer-vocab-size "
                            f"puts it there)")
    return load_tokenizer(ttype, model, vocab_size)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def train_bpe_tokenizer(text_iterator: Iterable[str], vocab_size: int, save_dir: str, *,
                        length: Optional[int] = None) -> TextTokenizer:
    """Train a byte-level BPE (GPT-2 style, <|endoftext|> as EOD) and save save_dir/tokenizer.json.

    Byte-level: every byte is in the base alphabet, so any text round-trips and nothing maps to an unknown token.
    No normalizer: source code and whitespace survive exactly. The directory also gets a tokenizer_config.json so
    `transformers.AutoTokenizer` loads it too. tokenizer.json is written last and atomically: a directory holding
    it holds a complete tokenizer.
    """
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if int(vocab_size) < len(alphabet) + 1:
        raise DataError(f"tokenizer vocab size {vocab_size} is too small: a byte-level BPE needs the "
                        f"{len(alphabet)} byte tokens plus {EOD_TOKEN}, so at least {len(alphabet) + 1}")
    backend = _HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # min_frequency=2: a merge seen once is noise; a small corpus then yields fewer than vocab_size tokens, and
    # the tokenizer reports its real size.
    trainer = trainers.BpeTrainer(vocab_size=int(vocab_size), min_frequency=2, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=alphabet, show_progress=False)
    backend.train_from_iterator(text_iterator, trainer, length=length)

    try:
        os.makedirs(save_dir, exist_ok=True)
        # GPT-2's convention: one <|endoftext|> serves as BOS and EOS; byte-level BPE has no unknown token.
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
                  "add_prefix_space": False, "model_max_length": 1 << 30}
        _atomic_write_text(os.path.join(save_dir, "tokenizer_config.json"), json.dumps(config, indent=2) + "\n")
        _atomic_write_text(os.path.join(save_dir, "tokenizer.json"), backend.to_str())
    except OSError as e:
        raise DataError(f"cannot save the tokenizer in {save_dir}: {e.strerror or e}") from None
    return TextTokenizer(backend, kind="ByteLevelBPE", eod_token=EOD_TOKEN)


def check_vocab(tokenizer: Tokenizer, model_vocab_size: Optional[int]) -> None:
    """Refuse a model whose embedding table cannot hold every token id the tokenizer produces."""
    if model_vocab_size is None:
        return
    if tokenizer.vocab_size > int(model_vocab_size):
        raise DataError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is {model_vocab_size} "
            f"(--vocab-size); drop --vocab-size so it is taken from the tokenizer, or set it to at least "
            f"{tokenizer.vocab_size}")


# ----------------------------------------------------------------------------------------------------------------
# Data paths and splits
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrefixInfo:
    """What the .idx of an indexed dataset says (documents = sequences: one sequence per document)."""

    prefix: str
    num_documents: int
    num_tokens: int
    dtype: str
    sequence_lengths: np.ndarray


def _as_float(token: str) -> Optional[float]:
    try:
        return float(token)
    except ValueError:
        return None


def _is_prefix_on_disk(token: str) -> bool:
    return os.path.exists(token + ".idx") or os.path.exists(token + ".bin")


def _split_blend_tokens(data_path) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron-LM's `[W1] P1 [W2] P2 ...` -> (prefixes, weights or None), without touching the files."""
    tokens = data_path.split() if isinstance(data_path, str) else [str(t) for t in (data_path or [])]
    if not tokens:
        raise DataError("--data-path is empty; give indexed dataset prefixes (tools/preprocess_data.py makes "
                        "them) or --mock-data")
    # A leading number is a weight unless a dataset of that name exists (Megatron-LM's ambiguity, resolved).
    weighted = _as_float(tokens[0]) is not None and not _is_prefix_on_disk(tokens[0])
    if not weighted:
        for t in tokens:
            if _as_float(t) is not None and not _is_prefix_on_disk(t):
                raise DataError(f"--data-path mixes weights and prefixes ({t!r} is a number); give a weight "
                                f"before every prefix (W1 P1 W2 P2 ...) or before none")
        return tokens, None
    if len(tokens) % 2:
        raise DataError(f"--data-path starts with a weight, so it must be weight/prefix pairs (W1 P1 W2 P2 ...); "
                        f"got {len(tokens)} items")
    prefixes, weights = [], []
    for w_tok, p_tok in zip(tokens[0::2], tokens[1::2]):
        w = _as_float(w_tok)
        if w is None:
            raise DataError(f"--data-path: expected a weight before prefix {p_tok!r}, got {w_tok!r}")
        if not math.isfinite(w) or w <= 0:
            raise DataError(f"--data-path: weight {w_tok} of {p_tok} must be a positive number (leave a prefix "
                            f"out rather than giving it weight 0)")
        if _as_float(p_tok) is not None and not _is_prefix_on_disk(p_tok):
            raise DataError(f"--data-path: expected a prefix after weight {w_tok}, got the number {p_tok!r}")
        prefixes.append(p_tok)
        weights.append(w)
    return prefixes, weights


_IDX_HEADER_BYTES = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)


def _check_index_layout(idx_path: str) -> None:
    """Check the .idx header and that the file is as long as its header says.

    megatron-core's IndexedDataset fails on a damaged index with assertions or numpy errors, and its destructor
    then prints a second, unrelated traceback; checking the layout first gives one clear message instead.
    """
    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

    advice = "regenerate it with tools/preprocess_data.py"
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_IDX_HEADER_BYTES)
    if len(head) < len(_INDEX_HEADER) or head[:len(_INDEX_HEADER)] != _INDEX_HEADER:
        raise DataError(f"{idx_path} is not a readable Megatron index (no MMIDIDX header): {advice}")
    if len(head) < _IDX_HEADER_BYTES:
        raise DataError(f"{idx_path} is not a readable Megatron index (truncated header, {size} bytes): {advice}")
    version, code, num_sequences, num_documents = struct.unpack("<QBQQ", head[len(_INDEX_HEADER):])
    if version != 1:
        raise DataError(f"{idx_path} is not a readable Megatron index (version {version}, expected 1): {advice}")
    try:
        DType(code)
    except ValueError:
        raise DataError(f"{idx_path} is not a readable Megatron index (unknown token dtype code {code}): "
                        f"{advice}") from None
    needed = _IDX_HEADER_BYTES + num_sequences * (4 + 8) + num_documents * 8
    if size < needed:
        raise DataError(f"{idx_path} is not a readable Megatron index (truncated: {size} bytes, its header "
                        f"promises {needed}): {advice}")


def inspect_prefix(prefix: str) -> PrefixInfo:
    """Check that PREFIX.bin/.idx exist and are a consistent megatron-core indexed dataset; summarize it."""
    missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
    if missing:
        hint = ""
        stem, ext = os.path.splitext(prefix)
        if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
            hint = f"; give the prefix without the extension: {stem}"
        raise DataError(f"missing data prefix {prefix} (expected {prefix}.bin and {prefix}.idx; make them with "
                        f"tools/preprocess_data.py){hint}")
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    idx_path = prefix + ".idx"
    _check_index_layout(idx_path)
    try:
        # mmap=False: nothing maps the .bin here (an empty .bin cannot be mapped), only the index is read.
        dataset = IndexedDataset(prefix, multimodal=False, mmap=False)
        lengths = np.array(dataset.sequence_lengths, dtype=np.int64)
        pointers = np.array(dataset.index.sequence_pointers, dtype=np.int64)
        itemsize = int(dataset.index.dtype_size)
        dtype = np.dtype(dataset.index.dtype).name
        del dataset
    except Exception as e:  # megatron-core reports a bad index with assert/struct/numpy errors of many kinds
        raise DataError(f"{idx_path} is not a readable Megatron index ({type(e).__name__}: {e}); it is truncated, "
                        f"corrupt or not an indexed dataset: regenerate it with tools/preprocess_data.py") from None
    if len(lengths) == 0:
        raise DataError(f"data prefix {prefix} holds no documents; regenerate it from non-empty input")
    if (lengths < 0).any():
        raise DataError(f"{idx_path} is corrupt (negative document length); regenerate it")
    needed = int(pointers[-1] + lengths[-1] * itemsize)
    actual = os.path.getsize(prefix + ".bin")
    if actual < needed:
        raise DataError(f"{prefix}.bin is truncated: it has {actual} bytes, its index needs {needed}; regenerate "
                        f"it with tools/preprocess_data.py")
    return PrefixInfo(prefix=prefix, num_documents=len(lengths), num_tokens=int(lengths.sum()), dtype=dtype,
                      sequence_lengths=lengths)


def parse_data_path(data_path) -> Tuple[List[str], Optional[List[float]]]:
    """`[W1] P1 [W2] P2 ...` (a list of strings, or one string) -> (prefixes, weights or None).

    Every prefix must have a readable PREFIX.bin/PREFIX.idx pair with at least one document.
    """
    prefixes, weights = _split_blend_tokens(data_path)
    for prefix in prefixes:
        inspect_prefix(prefix)
    return prefixes, weights


def parse_split(split) -> List[float]:
    """--split "969,30,1" -> normalized [train, valid, test] weights. Fewer than three parts leave the rest 0."""
    text = str(split).strip()
    parts = [p.strip() for p in text.split(",")]
    values = [_as_float(p) for p in parts]
    if not 1 <= len(parts) <= 3 or any(v is None or not math.isfinite(v) or v < 0 for v in values):
        raise DataError(f"--split {text!r}: expected up to three non-negative numbers train,valid,test "
                        f"(e.g. 969,30,1)")
    values = values + [0.0] * (3 - len(values))
    total = sum(values)
    if total <= 0:
        raise DataError(f"--split {text!r}: all parts are 0; give the train part a positive weight")
    return [v / total for v in values]


def _format_split(values: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in values)


def _part_ranges(split_vector: Sequence[float], num_documents: int) -> List[Optional[Tuple[int, int]]]:
    """Document range of each part, exactly as BlendedMegatronDatasetBuilder cuts it."""
    from megatron.core.datasets.blended_megatron_dataset_config import convert_split_vector_to_split_matrix

    ranges = []
    for bookends in convert_split_vector_to_split_matrix(list(split_vector)):
        if bookends is None:
            ranges.append(None)
        else:
            ranges.append((int(round(bookends[0] * float(num_documents))),
                           int(round(bookends[1] * float(num_documents)))))
    return ranges


def _empty_parts(infos: Sequence[PrefixInfo], split_vector: Sequence[float]) -> List[Tuple[int, PrefixInfo, int]]:
    """(part, prefix, documents in the part) for every part with weight > 0 that would hold no tokens."""
    empty = []
    for info in infos:
        for part, rng in enumerate(_part_ranges(split_vector, info.num_documents)):
            if rng is not None and int(info.sequence_lengths[rng[0]:rng[1]].sum()) == 0:
                empty.append((part, info, rng[1] - rng[0]))
    return empty


def check_split(infos: Sequence[PrefixInfo], split, num_samples: Sequence[Optional[int]]) -> List[float]:
    """Refuse a --split that megatron-core cannot build from these prefixes; return the normalized split.

    A part with weight > 0 but no tokens for some prefix makes megatron-core's GPTDataset add epochs of nothing
    forever (its epoch count loop never reaches the requested tokens), so it is refused here first.
    """
    vector = parse_split(split)
    if vector[0] == 0 and (num_samples[0] is None or num_samples[0] > 0):
        raise DataError(f"--split {split}: the train part has weight 0, so there is nothing to train on")
    empty = _empty_parts(infos, vector)
    if not empty:
        return vector
    part, info, docs = empty[0]
    what = (f"0 of the {info.num_documents} documents" if docs == 0
            else f"{docs} document(s) of {info.num_documents}, all empty")
    zeroed = list(vector)
    for p, _, _ in empty:
        zeroed[p] = 0.0
    if zeroed[0] > 0 and not _empty_parts(infos, zeroed):
        raw = [_as_float(p) for p in str(split).split(",")]
        raw = raw + [0.0] * (3 - len(raw))
        for p, _, _ in empty:
            raw[p] = 0.0
        advice = f"add documents to it, or give that part weight 0 (e.g. --split {_format_split(raw)})"
    else:
        advice = "add documents to it (it is too small for any split)"
    raise DataError(f"--split {split} gives the {_SPLIT_NAMES[part]} part of {info.prefix} {what}; megatron-core "
                    f"cannot draw {_SPLIT_NAMES[part]} samples from it: {advice}")


# ----------------------------------------------------------------------------------------------------------------
# The run's data, checked before megatron.training starts
# ----------------------------------------------------------------------------------------------------------------

def _check_cache_dir(path: str) -> None:
    """megatron-core writes its dataset index cache there (creating it on the first rank; a traceback if it
    cannot)."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise DataError(f"cannot write megatron-core's dataset index cache in {path} ({existing} is not a writable "
                        "directory): give --data-cache-path a writable directory")


def cache_root() -> str:
    """Where prepared data is kept between runs: the embedded corpus, the token ranges of checked prefixes."""
    return os.environ.get("LITESPARK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "litespark-megatron"))


def megatron_tokenizer(args):
    """(megatron.training's tokenizer for these args, the padded vocabulary it gives), without touching args."""
    import argparse

    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    probe = argparse.Namespace(**vars(args))
    probe.padded_vocab_size, probe.rank = None, 1  # a copy, and no "padded vocab" log line
    return build_tokenizer(probe), probe.padded_vocab_size


def check(args) -> None:
    """Refuse data megatron-core would fail on with a traceback or an endless loop: missing or damaged prefixes,
    a split that leaves a part without tokens, a cache directory it cannot write. Mock data needs no check."""
    if args.mock_data or not args.data_path:
        return
    if args.data_cache_path:
        _check_cache_dir(args.data_cache_path)
    prefixes, _ = _split_blend_tokens(args.data_path)
    infos = [inspect_prefix(p) for p in prefixes]
    train_samples = 0 if args.skip_train else (args.train_iters or args.train_samples)
    check_split(infos, args.split or "969,30,1", [train_samples, None, None])
    if int(os.environ.get("RANK", "0")) == 0:  # one scan per job; a refusal on rank 0 ends every rank
        vocab = megatron_tokenizer(args)[0].vocab_size
        for info in infos:
            check_token_ids(info, vocab)


def check_token_ids(info: PrefixInfo, vocab: int) -> None:
    """Every token id of a prefix is below the tokenizer's vocabulary. Otherwise the embedding lookup fails with an
    IndexError deep in the first step (on a GPU, a device-side assert that kills the process). The largest id is
    read from the .bin once and cached by the file's path, size and modification time; a dtype that cannot hold an
    id >= vocab needs no scan."""
    if np.iinfo(np.dtype(info.dtype)).max < vocab:
        return
    largest = _largest_token_id(info.prefix + ".bin", np.dtype(info.dtype))
    if largest is not None and largest >= vocab:
        raise DataError(f"{info.prefix}.bin holds token id {largest}, but the tokenizer has {vocab} ids (0 to "
                        f"{vocab - 1}): the data was tokenized with another tokenizer; give the data's tokenizer "
                        "(for NullTokenizer, a --vocab-size above the largest id)")


def _largest_token_id(path: str, dtype: np.dtype) -> Optional[int]:
    stat = os.stat(path)
    key = hashlib.sha1(f"{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    cached = os.path.join(cache_root(), "token-range", key + ".json")
    try:
        with open(cached, encoding="utf-8") as f:
            return json.load(f)["largest_token_id"]
    except (OSError, ValueError, KeyError):
        pass
    count = stat.st_size // dtype.itemsize
    if count == 0:
        return None
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
    chunk = 1 << 26  # 64 M tokens at a time: bounded memory, numpy speed
    largest = max(int(tokens[i:i + chunk].max()) for i in range(0, count, chunk))
    del tokens
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        _atomic_write_text(cached, json.dumps({"path": os.path.realpath(path), "largest_token_id": largest}))
    except OSError:
        pass  # a read-only cache: scan again next time
    return largest
