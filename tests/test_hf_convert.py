"""Hugging Face interop (litespark-convert): a tiny transformers LlamaForCausalLM (GQA, Llama-3 RoPE scaling, tied
and untied, a vocabulary TP must pad) imported, loaded by megatron.training in TP2, PP2 and TP2+PP2 with the
logits of transformers, exported back bit for bit; --finetune from it starts at transformers' loss, and a model
trained here is exported with the validation loss the trainer reported, one with zero-centered norms with its
logits; bad input is one line and writes nothing."""
import json
import os

import pytest
import torch

from conftest import WORKER_DIR, forked, free_port, made_once, ok, records, train

VOCAB = 301  # TP pads it (to 384 at TP1, 512 at TP2): the padded rows must not change logits or loss
SEQ = 32


def make_hf_llama(path, tied: bool, seed: int = 0, vocab: int = VOCAB):
    """A random Llama-3-style model saved with save_pretrained, fp32. Weights larger than the default init, so
    that logits are O(1) and a wrong layout or a missing RoPE scaling shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16384,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, initializer_range=0.15,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1.0, 0.2)  # not all ones: a swapped norm shows
    model.save_pretrained(path)
    return path


def save_word_tokenizer(path):
    """A HF tokenizer with exactly VOCAB tokens (t0 ... and <s>, </s>), saved as transformers does."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB - 2)}
    vocab.update({"<s>": VOCAB - 2, "</s>": VOCAB - 1})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>").save_pretrained(path)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def hf_logits(path, tokens):
    with torch.no_grad():
        return hf_model(path)(tokens).logits


def hf_tensors(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def convert(*argv):
    return forked(1, "litespark_megatron.hf_convert", *argv, "--quiet", module=True)


def megatron_logits(tmp_path, ckpt, tokens, nproc, *layout, model=None):
    """The logits megatron.training's model gives after `--load ckpt` in this layout
    (tests/workers/hf_logits_worker.py); the model's flags are `model`, by default the import's model.yaml."""
    tokens_file, out = tmp_path / "tokens.json", tmp_path / f"logits_{free_port()}.pt"
    tokens_file.write_text(json.dumps({"tokens": tokens.tolist()}))
    model = model or ["--config", ckpt / "model.yaml"]
    ok(forked(nproc, WORKER_DIR / "hf_logits_worker.py", tokens_file, out, "--", *model, "--load", ckpt,
              "--mock-data", "--skip-train", *layout))
    return torch.load(out)


def tokens_for(seed, rows=2):
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def assert_same_logits(ours, reference):
    assert ours.shape[:2] == reference.shape[:2]
    assert torch.isinf(ours[..., VOCAB:]).all() and (ours[..., VOCAB:] < 0).all()  # padded rows: no tokens
    diff = (ours[..., :VOCAB] - reference).abs().max().item()
    assert diff < 1e-4, diff
    assert reference.abs().max() > 1.0  # the comparison has something to compare


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    """A HF model and its import, shared by the tests that only read them."""
    def build(tmp):
        hf = make_hf_llama(tmp / "hf", tied=False)
        save_word_tokenizer(hf)
        ok(convert("import", hf, tmp / "ckpt"))
        return hf, tmp / "ckpt"
    return made_once(tmp_path_factory, "hf-untied", build)


def test_import_loads_in_tp2pp2_with_transformers_logits(untied, tmp_path):
    """TP2 x PP2: every tensor split by TP (the QKV groups, [gate; up], the vocabulary padded to 512) and the layers
    by PP (PP2 alone: the tied test)."""
    hf, ckpt = untied
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert (ckpt / "tokenizer" / "tokenizer.json").is_file()  # model.yaml names it: the run's tokenizer
    tokens = tokens_for(1)
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]
    assert_same_logits(megatron_logits(tmp_path, ckpt, tokens, 4, *layout), hf_logits(hf, tokens))


def test_export_gives_the_imported_tensors_bit_for_bit_and_a_config_that_imports_the_same(untied, tmp_path):
    hf, ckpt = untied
    first = tmp_path / "first"
    ok(convert("export", ckpt, first))
    original, back = hf_tensors(hf), hf_tensors(first)
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    tokens = tokens_for(1)
    assert torch.equal(hf_logits(first, tokens), hf_logits(hf, tokens))
    config = json.loads((first / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "llama3" and config["rope_parameters"]["factor"] == 8.0
    assert config["vocab_size"] == VOCAB and not config["tie_word_embeddings"]
    # The import's own arguments name no tokenizer (NullTokenizer): its tokenizer/ ships, and names BOS and EOS.
    assert (first / "tokenizer.json").is_file()
    assert (config["bos_token_id"], config["eos_token_id"]) == (VOCAB - 2, VOCAB - 1)
    # The exported config.json reads back as the original's model; with the tensors equal bit for bit, importing
    # the export is importing the original (export -> import -> export without two more processes).
    from litespark_megatron import hf_convert as convert_module

    assert convert_module.model_flags(convert_module.read_config(first)) == \
        convert_module.model_flags(convert_module.read_config(hf))


def test_tied_import_loads_in_pp2_and_exports_bit_for_bit(tmp_path):
    """Llama-3.2 ties the embedding and the output layer; under PP2 the last stage holds a copy of the embedding."""
    hf = make_hf_llama(tmp_path / "hf", tied=True)
    ckpt, exported = tmp_path / "ckpt", tmp_path / "exported"
    ok(convert("import", hf, ckpt))
    tokens = tokens_for(2)
    assert_same_logits(megatron_logits(tmp_path, ckpt, tokens, 2, "--pipeline-model-parallel-size", "2"),
                       hf_logits(hf, tokens))
    ok(convert("export", ckpt, exported))
    original, back = hf_tensors(hf), hf_tensors(exported)
    assert "lm_head.weight" not in back and sorted(back) == sorted(original)
    assert all(torch.equal(back[n], original[n]) for n in original)
    assert json.loads((exported / "config.json").read_text())["tie_word_embeddings"] is True


def write_repeated_document(prefix, document):
    """An indexed dataset whose every document is `document` (SEQ tokens): every sample megatron-core's
    GPTDataset draws from it is then document + document[0], whatever its shuffling."""
    from litespark_megatron.corpus import IndexedDatasetWriter

    with IndexedDatasetWriter(str(prefix), VOCAB) as writer:
        for _ in range(64):
            writer.add_document(document)
        writer.commit()


def test_finetune_starts_from_transformers_loss_and_the_trained_model_exports_with_its_validation_loss(untied,
                                                                                                     tmp_path):
    hf, ckpt = untied
    document = tokens_for(3, rows=1)[0]
    write_repeated_document(tmp_path / "data", document.tolist())
    sample = torch.cat([document, document[:1]]).unsqueeze(0)
    with torch.no_grad():
        expected = hf_model(hf)(sample, labels=sample).loss.item()  # transformers shifts the labels itself

    metrics, save = tmp_path / "metrics.jsonl", tmp_path / "trained"
    ok(train(1, "--config", ckpt / "model.yaml", "--load", ckpt, "--finetune", "--data-path", tmp_path / "data",
             "--split", "90,10,0", "--seq-length", SEQ, "--micro-batch-size", 2, "--lr", "1e-3", "--train-iters", 20,
             "--log-interval", 1, "--eval-interval", 20, "--eval-iters", 1, "--save", save, "--save-interval", 20,
             "--metrics-file", metrics, "--seed", 5))
    train_rows = records(metrics, "train")
    assert train_rows[0]["step"] == 1 and len(train_rows) == 20  # iteration 0: the checkpoint is weights only
    assert abs(train_rows[0]["loss"] - expected) < 1e-5, (train_rows[0]["loss"], expected)
    assert train_rows[-1]["loss"] < expected - 0.5  # it trained

    val = [r for r in records(metrics, "val") if r["step"] == 20][-1]["loss"]
    exported = tmp_path / "exported"
    ok(convert("export", save, exported))
    # The run's HF tokenizer (the import's tokenizer/) ships with the model, and names BOS and EOS in its config.
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(exported).convert_tokens_to_ids("</s>") == VOCAB - 1
    config = json.loads((exported / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (VOCAB - 2, VOCAB - 1)
    with torch.no_grad():
        after = hf_model(exported)(sample, labels=sample).loss.item()
    assert abs(after - val) < 1e-3, (after, val)


def test_a_model_with_more_rows_than_its_tokenizer_has_tokens_trains_and_exports_them_all(tmp_path):
    """Published models often have more embedding rows than their tokenizer has tokens (here 384 and 301): those rows
    are the model's, in transformers' softmax, so they stay unmasked, and export keeps them. (Megatron-LM pads the
    tokenizer's 301 to 384 rows at TP1 and 512 at TP2: only rows beyond the model's own are padding.)"""
    rows = 384
    hf = make_hf_llama(tmp_path / "hf", tied=False, vocab=rows)
    save_word_tokenizer(hf)
    ckpt, save, exported = tmp_path / "ckpt", tmp_path / "trained", tmp_path / "exported"
    ok(convert("import", hf, ckpt))
    document = tokens_for(6, rows=1)[0]
    write_repeated_document(tmp_path / "data", document.tolist())
    sample = torch.cat([document, document[:1]]).unsqueeze(0)
    with torch.no_grad():
        expected = hf_model(hf)(sample, labels=sample).loss.item()

    metrics = tmp_path / "metrics.jsonl"
    ok(train(2, "--config", ckpt / "model.yaml", "--load", ckpt, "--finetune", "--tensor-model-parallel-size", 2,
             "--data-path", tmp_path / "data", "--split", "90,10,0", "--seq-length", SEQ, "--micro-batch-size", 2,
             "--lr", "1e-3", "--train-iters", 1, "--log-interval", 1, "--eval-interval", 10, "--eval-iters", 0,
             "--save", save, "--save-interval", 1, "--metrics-file", metrics))
    loss = records(metrics, "train")[0]["loss"]
    assert abs(loss - expected) < 1e-5, (loss, expected)

    ok(convert("export", save, exported))
    assert json.loads((exported / "config.json").read_text())["vocab_size"] == rows
    back = hf_tensors(exported)
    assert back["model.embed_tokens.weight"].shape[0] == back["lm_head.weight"].shape[0] == rows


def test_a_run_with_zero_centered_norms_exports_the_norm_weights_transformers_computes(tmp_path):
    """--apply-layernorm-1p (Megatron-LM's Llama-3 example uses it; megatron-core's layernorm_zero_centered_gamma)
    stores each norm's weight minus 1: HF's RMSNorm weights are the stored ones plus 1."""
    model = ["--model", "tiny", "--vocab-size", 256, "--apply-layernorm-1p"]
    save, exported = tmp_path / "trained", tmp_path / "exported"
    ok(train(1, *model, "--mock-data", "--seq-length", SEQ, "--micro-batch-size", 2, "--lr", "1e-2", "--train-iters",
             3, "--eval-iters", 0, "--eval-interval", 100, "--save", save, "--save-interval", 3, "--seed", 3))
    ok(convert("export", save, exported))
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(4))
    ours, reference = megatron_logits(tmp_path, save, tokens, 1, model=model), hf_logits(exported, tokens)
    assert ours.shape == reference.shape
    diff = (ours - reference).abs().max().item()
    assert diff < 1e-4, diff
    assert reference.abs().max() > 0.1  # the comparison has something to compare


# --------------------------------------------------------------------------------------------- bad input
def refused(capsys, *argv):
    from litespark_megatron import hf_convert

    assert hf_convert.main([*map(str, argv), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("litespark-convert: error: "), err
    return err


def edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.fixture
def tiny_hf(untied):
    return untied[0]


def copy_of(tiny_hf, tmp_path):
    import shutil

    return shutil.copytree(tiny_hf, tmp_path / "copy")


@pytest.mark.parametrize("change,message", [
    ({"model_type": "mistral"}, "model_type is 'mistral'; only Llama-architecture models"),
    ({"attention_bias": True}, "attention_bias = True (attention with biases)"),
    ({"sliding_window": 4096}, "sliding_window = 4096 (sliding-window attention)"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 2.0}},
     "rope_scaling.low_freq_factor = 2.0"),
    ({"intermediate_size": 128}, "model.layers.0.mlp.gate_proj.weight has shape [160, 64] but config.json implies "
                                 "[128, 64]"),
])
def test_import_refuses_what_is_not_this_llama(tiny_hf, tmp_path, capsys, change, message):
    hf = copy_of(tiny_hf, tmp_path)
    edit_config(hf, **change)
    assert message in refused(capsys, "import", hf, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "out.partial")


def test_import_refuses_a_directory_that_is_not_a_hf_model_and_missing_shards(tiny_hf, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert "is not a Hugging Face model directory: it has no config.json" in \
        refused(capsys, "import", tmp_path / "empty", tmp_path / "out")
    hf = copy_of(tiny_hf, tmp_path)
    os.rename(hf / "model.safetensors", hf / "model-00001-of-00002.safetensors")
    index = {"weight_map": {name: f"model-0000{1 + i % 2}-of-00002.safetensors"
                            for i, name in enumerate(hf_tensors(tiny_hf))}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "shard model-00002-of-00002.safetensors is listed in model.safetensors.index.json but missing" in \
        refused(capsys, "import", hf, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")


def test_conversion_refuses_an_output_that_exists_and_is_not_empty(tiny_hf, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    message = "exists and is not an empty directory: give a new output directory"
    assert message in refused(capsys, "import", tiny_hf, tmp_path / "out")
    assert message in refused(capsys, "export", tiny_hf, tmp_path / "out")
    assert os.listdir(tmp_path / "out") == ["keep.txt"]


def test_export_ships_the_tokenizer_the_run_trained_with(tmp_path):
    """A HuggingFaceTokenizer run's, the embedded corpus's (named beside the NullTokenizer that run reads token ids
    with), an untouched import's tokenizer/; nothing for a run without one (mock data's NullTokenizer)."""
    from types import SimpleNamespace

    from litespark_megatron.hf_convert import run_tokenizer_dir

    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.json").write_text("{}")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()

    def run(kind, model=str(tokenizer), corpus=None):
        return run_tokenizer_dir(SimpleNamespace(tokenizer_type=kind, tokenizer_model=model, embedded_corpus=corpus),
                                 str(ckpt))
    assert run("HuggingFaceTokenizer") == str(tokenizer)
    assert run("NullTokenizer", corpus="stdlib") == str(tokenizer)
    assert run("NullTokenizer") is None and run("NullTokenizer", model=None, corpus="stdlib") is None
    assert run("HuggingFaceTokenizer", model=str(tmp_path)) is None  # no tokenizer.json there
    (tmp_path / "tokenizer").mkdir()
    (tmp_path / "tokenizer" / "tokenizer.json").write_text("{}")
    assert run("NullTokenizer", model=None) == str(tmp_path / "tokenizer")  # an import's, beside its checkpoint


def test_a_run_whose_tokenizer_outgrows_the_checkpoints_embedding_is_refused(untied):
    """megatron-core would load the 301-row embedding into a 400-token model without a word."""
    from litespark_megatron import arguments
    from litespark_megatron.platform import Platform

    _, ckpt = untied
    cpu = Platform("cpu", "gloo", False, False, "cpu")
    run_flags = ["--config", str(ckpt / "model.yaml"), "--load", str(ckpt), "--mock-data", "--micro-batch-size", "1",
                 "--seq-length", "32", "--lr", "1e-3", "--train-iters", "1", "--eval-interval", "10"]
    arguments.check(arguments.resolve(run_flags, cpu), cpu)  # its own vocabulary: fine
    with pytest.raises(arguments.ConfigError, match=f"the tokenizer has 400 tokens but the checkpoint in {ckpt} has "
                                                    "embeddings for 301: they are not one model's"):
        arguments.check(arguments.resolve(run_flags + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "400"],
                                          cpu), cpu)


def test_a_transformer_engine_run_loads_an_import_without_the_te_state_it_lacks(untied, capsys):
    """The import is written by megatron-core's local modules: no `_extra_state` of TE's final norm (nor of TE's
    core attention, on the stock spec). A TE run loads it with log_unexpected strictness, and says so."""
    from litespark_megatron import arguments
    from litespark_megatron.platform import Platform

    _, ckpt = untied
    gpu = Platform("cuda", "nccl", True, True, "NVIDIA H200")
    flags = ["--config", str(ckpt / "model.yaml"), "--load", str(ckpt), "--mock-data", "--micro-batch-size", "1",
             "--seq-length", "32", "--lr", "1e-3", "--train-iters", "1", "--eval-interval", "10"]
    args = arguments.resolve(flags + ["--transformer-impl", "transformer_engine"], gpu)
    arguments.check(args, gpu)
    assert args.dist_ckpt_strictness == "log_unexpected"
    assert "holds no decoder.final_layernorm._extra_state" in capsys.readouterr().out
    for chosen in (["--transformer-impl", "local"], ["--transformer-impl", "transformer_engine",
                                                     "--dist-ckpt-strictness", "raise_all"]):
        args = arguments.resolve(flags + chosen, gpu)
        arguments.check(args, gpu)
        assert args.dist_ckpt_strictness == ("assume_ok_unexpected" if "local" in chosen else "raise_all")
