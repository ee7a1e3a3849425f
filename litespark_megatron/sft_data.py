"""Supervised fine-tuning data (--sft-data, --sft-valid-data): JSONL examples, one right-padded sequence each, the
loss on the response tokens alone.

A row is one JSON object per line, either

    {"prompt": "...", "response": "..."}                                   (non-empty strings)
    {"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}

(other keys are ignored). The loss falls on the response, or on every assistant turn of a conversation, and on
nothing else. The text becomes tokens in one of two formats:

- the tokenizer's chat template, when its directory has one (transformers' `apply_chat_template`): a prompt/response
  row is a user turn and an assistant turn. An assistant turn's tokens are what the template writes after the
  generation prompt of the turns before it, its end-of-turn tokens included (the model learns to stop);
- otherwise the plain format: a prompt/response row is the prompt's tokens, the response's and the end-of-document
  token (the response part: the model learns to stop); a conversation is each turn in order, "ROLE: CONTENT\\n" for
  every role but the assistant's, and for an assistant turn "assistant: " (prompt) then its content and the
  end-of-document token (response).

Prompt and response text are tokenized apart and the token lists joined: the boundary falls where it falls when a
model generates a response to a prompt tokenized alone, and no token straddles it.

One example per sequence: its tokens right-padded to --seq-length + 1 and shifted as megatron-core's GPTDataset
shifts them (tokens = ids[:-1], labels = ids[1:]); `loss_mask` is 1 exactly where the label is a response token,
0 on prompt and padding; padding is token 0, as GPTDataset pads (causal attention: padding after the last real token
changes nothing before it). An example longer than the sequence loses its end (the rest of the response, then its
end token); a row whose response has no token within the sequence (the prompt fills it) is a bad row.

Every row is read and tokenized before training (`prepare`, before any process group): a bad row is one line
naming the file, the line and what is wrong, and the run does not start.

Why not megatron.training's own --sft (megatron/training/datasets/sft_dataset.py): it packs conversations into
sequences with `cu_seqlens` (THD), which only Transformer Engine's attention runs (the Litespark SDPA attention and
a CPU cannot); it reads the file with the `datasets` library; its "default" prompt format (the tokenizer's chat
template) puts the loss on every token, prompts included. The batches here are GPTDataset's (tokens, labels,
loss_mask, attention_mask, position_ids), so the loss, every parallel layout and the CPU path run unchanged.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .data import DataError, load_tokenizer, megatron_tokenizer

ROW_FORMS = '{"prompt": str, "response": str} or {"messages": [{"role": str, "content": str}, ...]}'
ASSISTANT = "assistant"
PAD_ID = 0  # GPTDataset's padding id: any id the embedding holds, its loss masked


@dataclass(frozen=True)
class Examples:
    """Tokenized rows of one file: row i is ids[offsets[i]:offsets[i+1]], `response` marks its response tokens."""

    path: str
    ids: np.ndarray        # int64, all rows one after another
    response: np.ndarray   # bool, the same length
    offsets: np.ndarray    # int64, rows + 1
    truncated: int         # rows longer than a sequence (their end is cut)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.ids[a:b], self.response[a:b]

    def input_tokens(self, seq_length: int) -> np.ndarray:
        """Per row, the real (non-padding) tokens of its sequence's input: what a step computes on besides padding."""
        return np.minimum(np.diff(self.offsets), seq_length)


# ----------------------------------------------------------------------------------------------------------------
# Rows
# ----------------------------------------------------------------------------------------------------------------

def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


def parse_row(record, where: str):
    """A JSON value of one line -> ("pair", prompt, response) or ("messages", [(role, content), ...]); DataError
    (`where`: the file and line) otherwise."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object, {ROW_FORMS}; got {_kind(record)}")
    pair = [key for key in ("prompt", "response") if key in record]
    if pair and "messages" in record:
        raise DataError(f"{where}: the row has both 'messages' and '{pair[0]}': give one form, {ROW_FORMS}")
    if "messages" in record:
        return "messages", _parse_messages(record["messages"], where)
    if not pair:
        have = ", ".join(map(str, list(record)[:8])) or "no keys"
        raise DataError(f"{where}: no 'prompt' and 'response', and no 'messages' (the row has: {have}); an SFT row "
                        f"is {ROW_FORMS}")
    if len(pair) == 1:
        missing = "response" if pair[0] == "prompt" else "prompt"
        raise DataError(f"{where}: '{pair[0]}' without '{missing}'; an SFT row is {ROW_FORMS}")
    for key in ("prompt", "response"):
        if not isinstance(record[key], str):
            raise DataError(f"{where}: '{key}' holds {_kind(record[key])}, expected a string")
        if not record[key].strip():
            raise DataError(f"{where}: '{key}' is empty: a row needs a prompt to answer and a response to learn; "
                            "fill it or drop the row")
    return "pair", (record["prompt"], record["response"])


def _parse_messages(messages, where: str) -> List[Tuple[str, str]]:
    if not isinstance(messages, list):
        raise DataError(f"{where}: 'messages' holds {_kind(messages)}, expected a list of "
                        '{"role": str, "content": str} objects')
    turns = []
    for n, message in enumerate(messages, start=1):
        at = f"{where}: message {n}"
        if not isinstance(message, dict):
            raise DataError(f"{at} is {_kind(message)}, expected an object {{\"role\": str, \"content\": str}}")
        for key in ("role", "content"):
            if key not in message:
                raise DataError(f"{at} has no '{key}' (a message is {{\"role\": str, \"content\": str}})")
            if not isinstance(message[key], str):
                raise DataError(f"{at}: '{key}' holds {_kind(message[key])}, expected a string")
        if not message["role"].strip():
            raise DataError(f"{at}: 'role' is empty (system, user, assistant, ...)")
        if message["role"] == ASSISTANT and not message["content"].strip():
            raise DataError(f"{at}: an empty assistant turn, nothing to learn; fill it or drop the row")
        turns.append((message["role"], message["content"]))
    if not any(role == ASSISTANT for role, _ in turns):
        roles = ", ".join(dict.fromkeys(role for role, _ in turns)) or "no messages"
        raise DataError(f"{where}: no assistant turn (roles: {roles}); the loss falls on the 'assistant' turns, so a "
                        "conversation needs one")
    return turns


# ----------------------------------------------------------------------------------------------------------------
# Formats
# ----------------------------------------------------------------------------------------------------------------

class PlainFormat:
    """Tokenizers without a chat template (the module docstring gives the format)."""

    name = "plain"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def segments(self, row) -> List[Tuple[str, bool]]:
        """(text, is response) pieces; None stands for the end-of-document token."""
        kind, value = row
        if kind == "pair":
            return [(value[0], False), (value[1], True), (None, True)]
        out = []
        for role, content in value:
            if role == ASSISTANT:
                out += [(f"{ASSISTANT}: ", False), (content, True), (None, True)]
            else:
                out.append((f"{role}: {content}\n", False))
        return out

    def encode(self, texts: Sequence[str]) -> List[List[int]]:
        return self.tokenizer.tokenize_batch(list(texts))

    @property
    def eod(self) -> int:
        return self.tokenizer.eod


class ChatTemplateFormat:
    """The tokenizer's chat template (transformers' apply_chat_template): an assistant turn is the text the template
    adds to the conversation before it after the generation prompt."""

    name = "chat template"

    def __init__(self, hf_tokenizer) -> None:
        self.hf = hf_tokenizer

    def _render(self, turns, where: str, generation_prompt: bool) -> str:
        messages = [{"role": role, "content": content} for role, content in turns]
        try:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except Exception as e:  # the template's own raise_exception(), or a Jinja error
            raise DataError(f"{where}: the tokenizer's chat template refuses this conversation "
                            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None

    def segments(self, row, where: str) -> List[Tuple[str, bool]]:
        kind, value = row
        turns = [("user", value[0]), (ASSISTANT, value[1])] if kind == "pair" else value
        out, done = [], ""
        for k, (role, _) in enumerate(turns):
            if role == ASSISTANT:
                head = self._render(turns[:k], where, generation_prompt=True)
                if not head.startswith(done):
                    raise self._not_prefix(where, k)
                out.append((head[len(done):], False))
                done = head
            text = self._render(turns[:k + 1], where, generation_prompt=False)
            if not text.startswith(done):
                raise self._not_prefix(where, k)
            out.append((text[len(done):], role == ASSISTANT))
            done = text
        return [(t, r) for t, r in out if t]

    @staticmethod
    def _not_prefix(where: str, k: int) -> DataError:
        return DataError(f"{where}: the tokenizer's chat template writes the turns before message {k + 1} "
                         "differently once it follows (a template that rewrites earlier turns), so the assistant's "
                         "tokens cannot be told from the prompt's; give prompt/response rows without such turns, or "
                         "a tokenizer directory whose template keeps earlier turns as they were")

    def encode(self, texts: Sequence[str]) -> List[List[int]]:
        # The template writes its own BOS and special tokens; the tokenizer adds none.
        return self.hf(list(texts), add_special_tokens=False)["input_ids"]


def chat_template_of(tokenizer_model: str) -> Optional[str]:
    """The chat template a tokenizer directory (or the directory of a tokenizer.json) holds, else None. Read without
    transformers: a tokenizer without one needs no transformers import."""
    directory = tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model)
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    config = os.path.join(directory, "tokenizer_config.json")
    if os.path.isfile(config):
        try:
            with open(config, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
        except (OSError, ValueError, AttributeError) as e:
            raise DataError(f"{config}: not readable JSON ({e})") from None
        if isinstance(template, str) and template.strip():
            return template
        if isinstance(template, list) and template:  # named templates: transformers uses "default"
            return "named"
    return None


def text_format(args):
    """The format of the run's text tokenizer (--tokenizer-model): its chat template, else the plain format."""
    if not args.tokenizer_model:
        raise DataError("--sft-data is text and needs the text tokenizer: give --tokenizer-model (a tokenizer "
                        "directory or tokenizer.json; with --tokenizer-type NullTokenizer it is the text tokenizer "
                        "of a model of --vocab-size ids)")
    if not os.path.exists(args.tokenizer_model):
        raise DataError(f"--tokenizer-model {args.tokenizer_model}: no such file or directory (the text tokenizer of "
                        "--sft-data: a tokenizer directory or tokenizer.json; nothing is downloaded)")
    if chat_template_of(args.tokenizer_model) is None:
        ttype = None if args.tokenizer_type == "NullTokenizer" else args.tokenizer_type
        return PlainFormat(load_tokenizer(ttype, args.tokenizer_model, args.vocab_size))
    from transformers import AutoTokenizer

    directory = args.tokenizer_model if os.path.isdir(args.tokenizer_model) else \
        os.path.dirname(args.tokenizer_model)
    try:
        hf = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers raises many kinds for a directory it cannot read
        raise DataError(f"--tokenizer-model {args.tokenizer_model}: transformers cannot load the tokenizer whose chat "
                        f"template formats --sft-data ({type(e).__name__}: {str(e).splitlines()[0]})") from None
    return ChatTemplateFormat(hf)


# ----------------------------------------------------------------------------------------------------------------
# Reading a file
# ----------------------------------------------------------------------------------------------------------------

def _read_rows(path: str, flag: str):
    """(line number, parsed row) of every non-blank line."""
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file (a JSONL file, one row a line: {ROW_FORMS})")
    rows, lineno = [], 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {lineno}"
                try:
                    record = json.loads(line.rstrip("\r\n"))  # columns counted on the line as written
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); each line must be one "
                                    f"JSON object, {ROW_FORMS}") from None
                rows.append((lineno, parse_row(record, where)))
    except UnicodeDecodeError as e:
        raise DataError(f"{path} line {lineno + 1}: not UTF-8 ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if not rows:
        raise DataError(f"{flag} {path}: the file holds no rows; one JSON object a line, {ROW_FORMS}")
    return rows


def tokenize_rows(rows, fmt, path: str, seq_length: int) -> Examples:
    """The rows' token ids and response marks, each row cut to seq_length + 1 ids; a row whose response has no
    token left to learn is refused."""
    pieces = []  # per row: [(text or None, is response)]
    for lineno, row in rows:
        if isinstance(fmt, ChatTemplateFormat):
            pieces.append(fmt.segments(row, f"{path} line {lineno}"))
        else:
            pieces.append(fmt.segments(row))
    texts = [text for segments in pieces for text, _ in segments if text is not None]
    encoded = iter(fmt.encode(texts))
    capacity = seq_length + 1
    all_ids, all_response, offsets, truncated = [], [], [0], 0
    for (lineno, _), segments in zip(rows, pieces):
        ids, response = [], []
        for text, is_response in segments:
            part = [fmt.eod] if text is None else list(next(encoded))
            ids += part
            response += [is_response] * len(part)
        first = response.index(True) if True in response else len(response)
        # A response token at position p is the label of position p - 1: p must be 1 ... seq_length.
        if first > seq_length or first == 0:
            what = (f"the prompt alone takes {first} tokens" if first else "the response starts the sequence, with "
                    "no prompt token before it")
            raise DataError(f"{path} line {lineno}: {what}, and a sequence holds {seq_length} inputs (--seq-length): "
                            "no response token is left to learn; shorten the prompt or raise --seq-length")
        if len(ids) > capacity:
            truncated += 1
            ids, response = ids[:capacity], response[:capacity]
        all_ids += ids
        all_response += response
        offsets.append(len(all_ids))
    return Examples(path=path, ids=np.asarray(all_ids, dtype=np.int64), response=np.asarray(all_response, bool),
                    offsets=np.asarray(offsets, dtype=np.int64), truncated=truncated)


def read_examples(path: str, fmt, seq_length: int, flag: str = "--sft-data") -> Examples:
    return tokenize_rows(_read_rows(path, flag), fmt, path, seq_length)


# ----------------------------------------------------------------------------------------------------------------
# One example per sequence
# ----------------------------------------------------------------------------------------------------------------

def sequence(ids: np.ndarray, response: np.ndarray, seq_length: int, attention_mask: bool = False) -> Dict:
    """One example as GPTDataset's batch item: tokens, labels, loss_mask, position_ids (and its causal
    attention_mask where megatron.training asks the data for one)."""
    import torch

    capacity = seq_length + 1
    padded = np.full(capacity, PAD_ID, dtype=np.int64)
    marks = np.zeros(capacity, dtype=bool)
    n = min(len(ids), capacity)
    padded[:n], marks[:n] = ids[:n], response[:n]
    item = {"tokens": torch.from_numpy(padded[:-1].copy()), "labels": torch.from_numpy(padded[1:].copy()),
            "loss_mask": torch.from_numpy(marks[1:].astype(np.float32)),
            "position_ids": torch.arange(seq_length, dtype=torch.long)}
    if attention_mask:  # GPTDataset's: True where a position may not attend
        item["attention_mask"] = torch.tril(torch.ones(seq_length, seq_length)).unsqueeze(0) < 0.5
    return item


class SFTDataset:
    """A map-style dataset of `num_samples` sequences for megatron.training's sampler: the rows in a shuffled order,
    a new order each epoch (seeded: the same seed, the same order), as many epochs as the samples need."""

    def __init__(self, examples: Examples, num_samples: Optional[int], seed: int, seq_length: int, split,
                 attention_mask: bool) -> None:
        self.examples, self.seq_length, self.attention_mask = examples, seq_length, attention_mask
        self.index_split = split  # megatron.training's sampler reads it (the eval batch size for validation)
        self.order = sample_order(len(examples), num_samples, seed, split.value)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Dict:
        ids, response = self.examples.row(int(self.order[index]))
        return sequence(ids, response, self.seq_length, self.attention_mask)


def sample_order(rows: int, num_samples: Optional[int], seed: int, stream: int) -> np.ndarray:
    """Row of each sample: whole epochs, each its own permutation of the rows; None samples: one epoch."""
    num_samples = rows if num_samples is None else int(num_samples)
    epochs = max(1, -(-num_samples // rows))
    rng = np.random.default_rng([seed, stream])
    return np.concatenate([rng.permutation(rows) for _ in range(epochs)])[:num_samples]


# ----------------------------------------------------------------------------------------------------------------
# The run's SFT data
# ----------------------------------------------------------------------------------------------------------------

_prepared: Dict[str, Examples] = {}


def prepare(args) -> None:
    """--sft-data (and --sft-valid-data) read, checked and tokenized before any work; a bad row stops the run with
    one line. Rank 0 says what was read."""
    _prepared.clear()
    if not getattr(args, "sft_data", None):
        return
    fmt = text_format(args)
    vocab = megatron_tokenizer(args)[0].vocab_size
    for split, flag in (("train", "--sft-data"), ("valid", "--sft-valid-data")):
        path = getattr(args, flag[2:].replace("-", "_"))
        if not path:
            continue
        examples = read_examples(path, fmt, args.seq_length, flag)
        largest = int(examples.ids.max())
        if largest >= vocab:
            raise DataError(f"{flag} {path}: the tokenizer gives token id {largest}, but the model has {vocab} ids "
                            f"(0 to {vocab - 1}): give the tokenizer's vocabulary (for NullTokenizer, --vocab-size "
                            f"above {largest})")
        _prepared[split] = examples
        if int(os.environ.get("RANK", "0")) == 0:
            lengths = np.diff(examples.offsets)
            print(f"sft data: {flag} {path}: {len(examples)} rows ({fmt.name} format), {int(lengths.sum()):,} tokens, "
                  f"{int(examples.response.sum()):,} of them response; {examples.truncated} cut to --seq-length "
                  f"{args.seq_length}", flush=True)


def prepared(args, split: str) -> Optional[Examples]:
    if not _prepared and getattr(args, "sft_data", None):
        prepare(args)
    return _prepared.get(split)


def datasets(args, num_samples: Sequence[Optional[int]], built_here: bool):
    """(train, valid, test) for megatron.training: SFT datasets on the ranks that read batches, None elsewhere;
    no validation set without --sft-valid-data, no test set."""
    from megatron.core.datasets.utils import Split

    if not built_here:
        return None, None, None
    seed = _seed(args)
    built = []
    for split, samples in ((Split.train, num_samples[0]), (Split.valid, num_samples[1])):
        examples = prepared(args, split.name)
        built.append(None if examples is None or samples == 0 else
                     SFTDataset(examples, samples, seed, args.seq_length, split,
                                args.create_attention_mask_in_dataloader))
    return built[0], built[1], None


def _seed(args) -> int:
    return args.seed if args.data_seed is None else args.data_seed


def train_input_tokens(args) -> Optional[np.ndarray]:
    """With --sft-data: the non-padding input tokens of the training samples, summed from the first sample on
    ([0, t0, t0 + t1, ...]), in the order megatron.training reads them (its sampler takes the samples in order);
    telemetry's tokens/s counts these. None without --sft-data."""
    from megatron.core.datasets.utils import Split

    examples = prepared(args, "train")
    if examples is None:
        return None
    num_samples = args.train_samples or args.train_iters * args.global_batch_size
    order = sample_order(len(examples), num_samples, _seed(args), Split.train.value)
    return np.concatenate([[0], np.cumsum(examples.input_tokens(args.seq_length)[order])])
