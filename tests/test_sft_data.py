"""SFT data (--sft-data): rows -> one right-padded sequence each, the loss on the response tokens alone, checked by
hand on a word-level tokenizer whose ids are known; the plain and the chat-template formats; the truncation rule;
every bad row one line naming the file, the line and what is wrong."""
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from litespark_megatron import sft_data
from litespark_megatron.data import DataError
from litespark_megatron.errors import UserError

WORDS = ["<|endoftext|>", "a", "b", "c", "d", "e", "f", "g", "user:", "assistant:", "system:"]
ID = {w: i for i, w in enumerate(WORDS)}
EOD = ID["<|endoftext|>"]
SPECIAL = {"<|user|>": 11, "<|assistant|>": 12, "<|end|>": 13}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def word_tokenizer(directory, chat_template=None):
    """A word-level tokenizer (whitespace-separated words -> the ids of WORDS; the chat markers special tokens after
    them), in a HuggingFace tokenizer directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(ID, unk_token="a"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    if chat_template:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def run_args(tokenizer_dir, **kw):
    values = dict(tokenizer_model=str(tokenizer_dir), tokenizer_type="HuggingFaceTokenizer", vocab_size=None,
                  seq_length=8)
    values.update(kw)
    return SimpleNamespace(**values)


def write_rows(path, *rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def examples_of(tmp_path, rows, chat_template=None, seq_length=8):
    args = run_args(word_tokenizer(tmp_path / "tok", chat_template), seq_length=seq_length)
    return sft_data.read_examples(write_rows(tmp_path / "rows.jsonl", *rows), sft_data.text_format(args),
                                  seq_length)


def items(examples, seq_length=8):
    return [sft_data.sequence(*examples.row(i), seq_length) for i in range(len(examples))]


def ids(*words):
    return [ID[w] if w in ID else SPECIAL[w] for w in words]


def test_plain_prompt_response_masks_exactly_the_response_and_its_end(tmp_path):
    """prompt "a b", response "c d": ids a b | c d EOD; inputs a b c d EOD pad pad pad, labels shifted by one, the
    loss on the labels c, d and EOD alone."""
    (item,) = items(examples_of(tmp_path, [{"prompt": "a b", "response": "c d", "id": 7}]))
    assert item["tokens"].tolist() == ids("a", "b", "c", "d") + [EOD, 0, 0, 0]
    assert item["labels"].tolist() == ids("b", "c", "d") + [EOD, 0, 0, 0, 0]
    assert item["loss_mask"].tolist() == [0, 1, 1, 1, 0, 0, 0, 0]
    assert item["position_ids"].tolist() == list(range(8))
    assert item["loss_mask"].dtype == torch.float32 and item["tokens"].dtype == torch.int64


def test_plain_conversation_learns_every_assistant_turn(tmp_path):
    """system "a", user "b", assistant "c", user "d", assistant "e f": each turn "ROLE: CONTENT", the assistant's
    header part of the prompt, its content and EOD the response."""
    row = {"messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"},
                        {"role": "assistant", "content": "c"}, {"role": "user", "content": "d"},
                        {"role": "assistant", "content": "e f"}]}
    (item,) = items(examples_of(tmp_path, [row], seq_length=16), seq_length=16)
    expected = ids("system:", "a", "user:", "b", "assistant:", "c") + [EOD] + \
        ids("user:", "d", "assistant:", "e", "f") + [EOD]
    assert item["tokens"].tolist()[:len(expected)] == expected
    response = [0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1]  # per id above
    assert item["loss_mask"].tolist() == response[1:] + [0] * (16 - len(response) + 1)


def test_chat_template_masks_the_assistant_turns_with_their_end_of_turn(tmp_path):
    """The template writes "<|user|> b <|end|> <|assistant|> c <|end|> ": the generation prompt "<|assistant|>"
    belongs to the prompt, "c <|end|>" to the response (the model learns to end its turn); a prompt/response row is
    a user turn and an assistant turn."""
    conversation = {"messages": [{"role": "user", "content": "b"}, {"role": "assistant", "content": "c"},
                                 {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}]}
    first, second = items(examples_of(tmp_path, [{"prompt": "a", "response": "c d"}, conversation],
                                      chat_template=TEMPLATE, seq_length=12), seq_length=12)
    assert first["tokens"].tolist()[:7] == ids("<|user|>", "a", "<|end|>", "<|assistant|>", "c", "d", "<|end|>")
    assert first["loss_mask"].tolist() == [0, 0, 0, 1, 1, 1] + [0] * 6
    assert second["tokens"].tolist()[:10] == ids("<|user|>", "b", "<|end|>", "<|assistant|>", "c", "<|end|>",
                                                 "<|user|>", "d", "<|end|>", "<|assistant|>")
    assert second["labels"].tolist()[:11] == ids("b", "<|end|>", "<|assistant|>", "c", "<|end|>", "<|user|>", "d",
                                                 "<|end|>", "<|assistant|>", "e", "<|end|>")
    assert second["loss_mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0]


def test_a_template_that_rewrites_earlier_turns_is_one_line(tmp_path):
    """A template whose generation prompt is not how it writes the assistant's turn: the response cannot be told
    apart, so the row is refused rather than guessed."""
    rewriting = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> <|end|> {% endif %}")
    with pytest.raises(DataError) as e:
        examples_of(tmp_path, [{"prompt": "a", "response": "b"}], chat_template=rewriting)
    assert str(e.value).startswith(f"{tmp_path}/rows.jsonl line 1: the tokenizer's chat template writes the turns "
                                   "before message 2 differently once it follows")


def test_truncation_cuts_the_end_and_a_prompt_that_fills_the_sequence_is_refused(tmp_path):
    """seq-length 4: 5 ids fit (4 inputs + the last label). Prompt "a b", response "c d e f": a b c d e kept, the
    rest of the response and its EOD cut. A 4-token prompt still leaves its response's first token as the last label;
    a 5-token prompt leaves none: refused."""
    examples = examples_of(tmp_path, [{"prompt": "a b", "response": "c d e f"},
                                      {"prompt": "a b c d", "response": "e"}], seq_length=4)
    assert examples.truncated == 2
    cut, full_prompt = items(examples, seq_length=4)
    assert cut["tokens"].tolist() == ids("a", "b", "c", "d") and cut["labels"].tolist() == ids("b", "c", "d", "e")
    assert cut["loss_mask"].tolist() == [0, 1, 1, 1]
    assert full_prompt["labels"].tolist() == ids("b", "c", "d", "e") and full_prompt["loss_mask"].tolist() == [0, 0, 0,
                                                                                                               1]
    with pytest.raises(DataError) as e:
        examples_of(tmp_path, [{"prompt": "a b", "response": "c"}, {"prompt": "a b c d e", "response": "f"}],
                    seq_length=4)
    assert str(e.value) == (f"{tmp_path}/rows.jsonl line 2: the prompt alone takes 5 tokens, and a sequence holds 4 "
                            "inputs (--seq-length): no response token is left to learn; shorten the prompt or raise "
                            "--seq-length")


def test_an_item_is_what_gpt_dataset_gives(tmp_path):
    """The keys and dtypes of megatron-core's GPTDataset items (its causal attention mask where asked for)."""
    examples = examples_of(tmp_path, [{"prompt": "a", "response": "b"}])
    ours = sft_data.sequence(*examples.row(0), 8, attention_mask=True)
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    mask, _, positions = _get_ltor_masks_and_position_ids(ours["tokens"], EOD, False, False, False, True)
    assert sorted(ours) == ["attention_mask", "labels", "loss_mask", "position_ids", "tokens"]
    assert torch.equal(ours["attention_mask"], mask) and torch.equal(ours["position_ids"], positions)


def test_samples_cycle_through_shuffled_epochs_deterministically():
    order = sft_data.sample_order(5, 12, seed=3, stream=0)
    assert len(order) == 12 and sorted(order[:5]) == sorted(order[5:10]) == list(range(5))
    assert set(order[10:]) <= set(range(5)) and not np.array_equal(order[:5], order[5:10])
    assert np.array_equal(order, sft_data.sample_order(5, 12, seed=3, stream=0))
    assert not np.array_equal(order, sft_data.sample_order(5, 12, seed=4, stream=0))
    assert len(sft_data.sample_order(5, None, seed=3, stream=1)) == 5  # full validation: one epoch


BAD_ROWS = [
    ('{"prompt": "a", "response": ', "not valid JSON (Expecting value at column 29); each line must be one JSON "
                                     "object"),
    ('["a", "b"]', "expected a JSON object, {\"prompt\": str, \"response\": str} or {\"messages\": [{\"role\": str, "
                   "\"content\": str}, ...]}; got a list"),
    ({"text": "a b"}, "no 'prompt' and 'response', and no 'messages' (the row has: text); an SFT row is"),
    ({"prompt": "a"}, "'prompt' without 'response'"),
    ({"prompt": "a", "response": 3}, "'response' holds a number, expected a string"),
    ({"prompt": ["a"], "response": "b"}, "'prompt' holds a list, expected a string"),
    ({"prompt": "a", "response": " \n"}, "'response' is empty: a row needs a prompt to answer and a response to "
                                         "learn; fill it or drop the row"),
    ({"prompt": "a", "response": "b", "messages": []}, "the row has both 'messages' and 'prompt': give one form"),
    ({"messages": "a b"}, "'messages' holds a string, expected a list"),
    ({"messages": [{"role": "user", "content": "a"}]}, "no assistant turn (roles: user); the loss falls on the "
                                                       "'assistant' turns"),
    ({"messages": [{"role": "user"}]}, "message 1 has no 'content'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": None}]},
     "message 2: 'content' holds null, expected a string"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
     "message 2: an empty assistant turn, nothing to learn"),
]


@pytest.mark.parametrize("row, message", BAD_ROWS, ids=[
    "json", "not-object", "no-keys", "no-response", "response-type", "prompt-type", "empty-response", "both-forms",
    "messages-type", "no-assistant", "message-keys", "content-type", "empty-assistant"])
def test_a_bad_row_is_one_line_naming_the_file_and_line(tmp_path, row, message):
    good = {"prompt": "a", "response": "b"}
    with pytest.raises(DataError) as e:
        examples_of(tmp_path, [good, "", row, good])  # the blank line 2 counts as a line
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{tmp_path}/rows.jsonl line 3: "), text
    assert message in text, text


def test_a_missing_or_empty_file_is_one_line(tmp_path):
    args = run_args(word_tokenizer(tmp_path / "tok"))
    fmt = sft_data.text_format(args)
    with pytest.raises(DataError) as e:
        sft_data.read_examples(str(tmp_path / "nope.jsonl"), fmt, 8, "--sft-valid-data")
    assert str(e.value).startswith(f"--sft-valid-data {tmp_path}/nope.jsonl: no such file (a JSONL file, one row a "
                                   "line: ")
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    with pytest.raises(DataError) as e:
        sft_data.read_examples(str(tmp_path / "empty.jsonl"), fmt, 8)
    assert str(e.value).startswith(f"--sft-data {tmp_path}/empty.jsonl: the file holds no rows; one JSON object a "
                                   "line")


def test_no_text_tokenizer_is_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        sft_data.text_format(run_args(None, tokenizer_model=None, tokenizer_type="NullTokenizer"))
    assert str(e.value).startswith("--sft-data is text and needs the text tokenizer: give --tokenizer-model")
    with pytest.raises(DataError) as e:
        sft_data.text_format(run_args(tmp_path / "nowhere", tokenizer_type="NullTokenizer"))
    assert str(e.value) == (f"--tokenizer-model {tmp_path}/nowhere: no such file or directory (the text tokenizer of "
                            "--sft-data: a tokenizer directory or tokenizer.json; nothing is downloaded)")


# --------------------------------------------------------------------------------------------- the flags
SFT_RUN = ["--model", "tiny", "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "2", "--eval-interval",
           "10", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--tokenizer-model", "tok/",
           "--sft-data", "train.jsonl"]


def checked(argv):
    from litespark_megatron import arguments
    from litespark_megatron.platform import Platform

    plat = Platform("cpu", "gloo", False, False, "cpu")
    args = arguments.resolve(argv, plat)
    arguments.check(args, plat)
    return args


@pytest.mark.parametrize("flags, message", [
    (["--sft-valid-data", "v.jsonl", "--data-path", "corpus"],
     "--sft-data trains on its JSONL rows alone, not on --data-path: drop --data-path (pretrain first, then "
     "fine-tune the checkpoint: --peft-base, or --load with --finetune)"),
    (["--sft-valid-data", "v.jsonl", "--mock-data"], "--sft-data trains on its JSONL rows alone, not on --mock-data"),
    (["--sft-valid-data", "v.jsonl", "--embedded-corpus", "stdlib"],
     "--sft-data trains on its JSONL rows alone, not on --embedded-corpus"),
    (["--sft-valid-data", "v.jsonl", "--sft"], "--sft is megatron.training's packed SFT"),
    (["--sft-valid-data", "v.jsonl", "--eod-mask-loss"], "--eod-mask-loss is for documents packed into sequences; "
                                                         "--sft-data puts one example in a sequence"),
    (["--sft-valid-data", "v.jsonl", "--dataloader-type", "cyclic"], "--dataloader-type cyclic with --sft-data"),
    ([], "--eval-iters 100 but no --sft-valid-data: give the validation rows, or --eval-iters 0"),
], ids=["data-path", "mock-data", "embedded-corpus", "megatron-sft", "eod-mask-loss", "cyclic", "no-validation"])
def test_a_bad_flag_combination_is_one_line(flags, message):
    with pytest.raises(UserError) as e:
        checked(SFT_RUN + flags)
    assert str(e.value).startswith(message), str(e.value)


def test_the_sft_flags_pass_and_need_their_pieces():
    from litespark_megatron.arguments import ConfigError

    checked(SFT_RUN + ["--sft-valid-data", "v.jsonl"])
    checked(SFT_RUN + ["--eval-iters", "0"])
    with pytest.raises(ConfigError, match="^--sft-valid-data needs --sft-data, the training rows$"):
        checked(SFT_RUN[:-2] + ["--sft-valid-data", "v.jsonl", "--eval-iters", "0"])
    no_text_tokenizer = [f for f in SFT_RUN if f not in ("--tokenizer-model", "tok/")]
    with pytest.raises(ConfigError, match="^--sft-data is text and needs the text tokenizer: give --tokenizer-model"):
        checked(no_text_tokenizer + ["--eval-iters", "0"])


def test_a_token_id_beyond_the_models_vocabulary_is_one_line(tmp_path):
    """The text tokenizer gives ids the model's embedding must hold: the words' ids run to 7 (g); a model of 5 ids
    is refused before training, not an IndexError in the first step."""
    from litespark_megatron.arguments import resolve_quietly

    word_tokenizer(tmp_path / "tok")
    rows = write_rows(tmp_path / "rows.jsonl", {"prompt": "a b", "response": "c"}, {"prompt": "d", "response": "g"})
    base = ["--model", "tiny", "--seq-length", "8", "--tokenizer-type", "NullTokenizer", "--tokenizer-model",
            str(tmp_path / "tok"), "--sft-data", rows]
    args = resolve_quietly(base + ["--vocab-size", "5"])
    with pytest.raises(DataError) as e:
        sft_data.prepare(args)
    vocab = sft_data.megatron_tokenizer(args)[0].vocab_size
    assert str(e.value) == (f"--sft-data {rows}: the tokenizer gives token id 7, but the model has {vocab} ids (0 to "
                            f"{vocab - 1}): give the tokenizer's vocabulary (for NullTokenizer, --vocab-size above 7)")
    args = resolve_quietly(base + ["--vocab-size", "64"])
    sft_data.prepare(args)
    assert len(sft_data.prepared(args, "train")) == 2 and sft_data.prepared(args, "valid") is None
    args.train_iters, args.global_batch_size = 1, 2  # one epoch: both rows
    summed = sft_data.train_input_tokens(args)
    assert summed.tolist() in ([0, 4, 7], [0, 3, 7])  # a b c EOD and d g EOD, in the epoch's order
