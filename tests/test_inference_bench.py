"""The inference benchmark (litespark_megatron/apps/inference_*.py) on a tiny random HF Llama: int4 weights against
the error bound of their own scales, the byte and MCR arithmetic, perplexity against a hand computation, exact token
counts, the refusals, and the benchmark end to end with its resume."""
import json
import math
import types

import pytest

from conftest import load_tool, run_error

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

HIDDEN, FFN, VOCAB, LAYERS = 128, 256, 384, 2  # widths that are multiples of the int4 group (128)
TEXT = "\n".join(f"def f{i}(x, y):\n    return x * {i} + y  # line {i}\n" for i in range(400))


def tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bar would be a second line of a refusal's stderr
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny random Llama saved with save_pretrained, with a byte-level BPE trained on TEXT beside it."""
    from litespark_megatron.data import train_bpe_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama")
    train_bpe_tokenizer([TEXT], 300, str(path))
    tiny_llama().save_pretrained(path)
    (path.parent / "eval.txt").write_text(TEXT)
    return path


def int4_model(dtype=torch.bfloat16):
    from litespark_megatron.apps.inference_variants import quantize

    model = tiny_llama().to(dtype)
    original = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    done = quantize(model, "int4", cuda=False)
    return model, original, done


# Round-to-nearest onto a grid of step `scale` that spans each group's range: at most half a step off, exactly so in
# fp32. In bf16 (what the benchmark runs) torchao forms the grid index (w - min) / scale in bf16, whose spacing
# between 8 and 16 is 1/16: up to another 1/16 step; and the dequantized value comes out of the kernel rounded to
# bf16, as are the weight and the zero point it is computed from (2^-8 of values of the weight's size).
@pytest.mark.parametrize("dtype, slack", [(torch.float32, lambda scale, w, dq: 1e-6 * scale),
                                          (torch.bfloat16, lambda scale, w, dq: scale / 16 +
                                           (dq.abs() + w.abs()) * 2 ** -8)])
def test_int4_weights_dequantize_within_half_a_step_of_their_own_group_scale(dtype, slack):
    from litespark_megatron.apps.inference_variants import dequantized_weight, int4_group_scales, is_quantized

    model, original, done = int4_model(dtype)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and is_quantized(m.weight)}
    # Every linear of the blocks (4 attention + 3 MLP per layer); the output layer, tied to the embedding, is not.
    assert done["quantized_layers"] == len(linears) == 7 * LAYERS and done["layers_left_16bit"] == 1
    for name, linear in linears.items():
        w = original[name].float()
        dq = dequantized_weight(linear).float()
        scale = int4_group_scales(linear.weight).float().repeat_interleave(128, dim=1)
        assert dq.shape == w.shape == scale.shape
        excess = ((w - dq).abs() - scale / 2 - slack(scale, w, dq)).max()
        assert float(excess) <= 0, (name, float(excess))
        assert float((w - dq).abs().max()) > 0  # it was quantized, not copied


def test_int4_logits_are_those_of_its_own_dequantized_weights():
    from litespark_megatron.apps.inference_variants import dequantized_weight, is_quantized

    model, _, _ = int4_model()
    reference = tiny_llama().to(torch.bfloat16)
    with torch.no_grad():
        for (name, q), (_, plain) in zip(model.named_modules(), reference.named_modules()):
            if isinstance(q, torch.nn.Linear) and is_quantized(q.weight):
                plain.weight.copy_(dequantized_weight(q))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got, want = model(ids).logits.float(), reference(ids).logits.float()
    assert torch.allclose(got, want, atol=0.05, rtol=0.02), float((got - want).abs().max())


def test_awq_calibrates_on_a_number_of_windows_that_is_no_multiple_of_a_batch(tmp_path):
    """torchao's AWQ observer concatenates what it saw along the sequence: forwards of unequal batch sizes (8 windows
    then 6, as the first GPU run had) failed at convert. The calibration runs one window per forward."""
    from litespark_megatron.apps.inference_run import calibrator
    from litespark_megatron.apps.inference_variants import quantize

    torch.manual_seed(0)
    torch.save(torch.randint(0, VOCAB, (3, 32)), tmp_path / "calibration.pt")
    model = tiny_llama().to(torch.bfloat16)
    done = quantize(model, "int4-awq", cuda=False, calibrate=calibrator(tmp_path / "calibration.pt", "cpu"))
    assert done["quantized_layers"] == 2 * 7 and done["method"].startswith("torchao AWQConfig(")
    logits = model(input_ids=torch.randint(0, VOCAB, (2, 16))).logits
    assert logits.shape == (2, 16, VOCAB) and torch.isfinite(logits).all()


def test_weight_bytes_count_packed_int4_scales_and_zeros_and_the_16_bit_rest():
    from litespark_megatron.apps.inference_variants import weight_bytes

    model, original, _ = int4_model()
    blocks = sum(w.numel() for n, w in original.items() if n != "lm_head")
    others = sum(p.numel() for n, p in tiny_llama().named_parameters() if not n.endswith("proj.weight"))
    # int4: half a byte per weight; per group of 128 inputs of a row a bf16 scale and a bf16 zero (4 bytes).
    assert weight_bytes(model) == blocks // 2 + blocks // 128 * 4 + others * 2
    assert weight_bytes(tiny_llama().to(torch.bfloat16)) == (blocks + others) * 2  # tied output layer counted once


def test_compression_rate_is_size_ratio_times_score_ratio():
    from litespark_megatron.apps.inference_quality import compression_rate

    assert compression_rate(4.0, 0.2341, 0.2420) == pytest.approx(3.869, abs=1e-3)  # EfficientLLM's 1.5B: 3.87
    assert compression_rate(2.5, 0.3, 0.4) == pytest.approx(1.875)
    assert compression_rate(None, 0.3, 0.4) is None and compression_rate(2.0, 0.3, None) is None


def test_perplexity_and_top1_by_hand_on_a_two_token_vocabulary():
    from litespark_megatron.apps.inference_quality import evaluate, perplexity

    class Fixed(torch.nn.Module):
        """p(token 0) = 3/4, p(token 1) = 1/4 at every position."""
        def forward(self, input_ids, use_cache=False):
            logits = torch.tensor([math.log(3.0), 0.0]).expand(*input_ids.shape, 2)
            return types.SimpleNamespace(logits=logits)

    scores = evaluate(Fixed(), [torch.tensor([[0, 0, 1, 0]])], "cpu")
    nll = -2 * math.log(3 / 4) - math.log(1 / 4)  # targets 0, 1, 0
    assert scores["tokens"] == 3 and scores["nll_sum"] == pytest.approx(nll)
    assert perplexity(scores["nll_sum"], scores["tokens"]) == pytest.approx(math.exp(nll / 3))
    assert scores["top1_hits"] == 2 and scores["predictions"].tolist() == [0, 0, 0]


def test_held_out_documents_are_megatrons_default_validation_and_test_ranges():
    from litespark_megatron.apps.inference_quality import split_documents

    docs = list(range(2000))
    assert split_documents(docs, "validation") == list(range(1938, 1998))  # [0.969 n, 0.999 n)
    assert split_documents(docs, "test") == [1998, 1999]
    assert split_documents(docs, "train") == list(range(1938))


def test_generation_makes_exactly_n_tokens_even_when_the_model_predicts_end_of_sequence():
    from litespark_megatron.apps.inference_engine import generate_exactly

    model = tiny_llama()
    prompts = torch.randint(0, VOCAB, (3, 8), generator=torch.Generator().manual_seed(2))
    first = generate_exactly(model, prompts, 1)[:, -1]
    model.generation_config.eos_token_id = int(first[0])  # the token it predicts next is its end-of-sequence
    out = generate_exactly(model, prompts, 6)
    assert out.shape == (3, 8 + 6) and torch.equal(out[:, :8], prompts) and torch.equal(out[:, 8], first)


def test_timing_splits_first_token_and_decode_steps(monkeypatch):
    from litespark_megatron.apps import inference_engine as engine

    calls = []
    monkeypatch.setattr(engine, "generate_exactly", lambda m, p, n, c=False: calls.append(n))
    ticks = iter([0.0, 0.5, 0.0, 0.7, 10.0, 12.5, 20.0, 22.5])  # two TTFT calls, two 5-token calls

    def on_timed(event):
        calls.append(event)

    timing = engine.time_generation(None, torch.zeros(4, 16, dtype=torch.long), 5, warmup=1, calls=2,
                                    sync=lambda: None, clock=lambda: next(ticks), on_timed=on_timed)
    assert calls == [1, 5, 1, 1, "start", 5, 5, "stop"]
    assert timing.ttft_s == pytest.approx(0.6) and timing.total_s == pytest.approx(2.5)
    assert timing.decode_s_per_token == pytest.approx((2.5 - 0.6) / 4)
    assert timing.generated_tokens == 20 and timing.it_tokens_per_s == pytest.approx(20 / 2.5)


@pytest.mark.parametrize("argv, expected", [
    (["--hf", "{missing}"], "no such directory"),
    (["--hf", "{gpt2}"], "a gpt2 model, not a Llama"),
    (["--hf", "{llama}", "--variants", "bf16,int3"], "unknown variant 'int3'; choose from: bf16, fp16, int4"),
    (["--hf", "{llama}", "--batch-sizes", "1,0"], "batch sizes must be between 1 and"),
    (["--hf", "{llama}", "--batch-sizes", "1,eight"], "positive integers separated by commas expected"),
    (["--hf", "{llama}", "--batch-sizes", "8,8"], "a batch size is named twice"),
    (["--hf", "{llama}", "--prompt-tokens", "1000", "--new-tokens", "100"], "exceed the model's 1024 positions"),
    (["--hf", "{llama}", "--compile"], "--compile: transformers compiles the decode step on a GPU only"),
    (["--hf", "{bare}"], "has no tokenizer.json: pass --tokenizer"),
])
def test_bad_input_is_one_line_and_nothing_is_written(llama_dir, tmp_path, capsys, argv, expected):
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    bare = tmp_path / "bare"
    tiny_llama().save_pretrained(bare)
    paths = dict(missing=tmp_path / "nope", gpt2=gpt2, llama=llama_dir, bare=bare)
    out = tmp_path / "out"
    argv = [a.format(**paths) for a in argv] + ["--out", str(out), "--cpu", "--eval-text",
                                                 str(llama_dir.parent / "eval.txt")]
    line = run_error(load_tool("inference_bench"), argv, capsys)
    assert line.startswith("inference_bench: error: ") and expected in line, line
    assert not (out / "bench_state.json").exists() and not (out / "runs").exists()


def test_inference_findings_compare_the_precisions_at_the_smallest_batch_by_their_intervals():
    from litespark_megatron.apps import findings
    from litespark_megatron.apps.inference_report import finding_spreads

    def row(name, ppl, at1, at8, done=3):
        def cell(b, values):
            return dict(batch_size=b, spread={k: findings.interval(v) for k, v in values.items()})
        return dict(variant=name, repeats_done=done, spread=dict(perplexity=findings.interval(ppl)),
                    batches=[cell(1, at1), cell(8, at8)])
    # At batch 8 every ordering is the other way round: the findings must read batch 1.
    flipped = dict(power_w=[300, 301, 302], it_tokens_per_s=[1, 2, 3], peak_memory_gb=[9, 9.1, 9.2])
    rows = [row("bf16", [69.1, 69.2, 69.15], dict(power_w=[140, 141, 142], it_tokens_per_s=[60, 61, 62],
                                                  peak_memory_gb=[2.0, 2.04, 2.05]), flipped),
            row("fp16", [69.2, 69.3, 69.2], dict(power_w=[158, 159, 160], it_tokens_per_s=[70, 71, 72],
                                                 peak_memory_gb=[2.0, 2.04, 2.05]), flipped),
            row("int4", [70.9, 71.0, 70.95], dict(power_w=[137, 150, 143], it_tokens_per_s=[50, 50.5, 51],
                                                  peak_memory_gb=[0.6, 0.61, 0.62]), flipped),
            row("fp8", [], {}, {}, done=0)]
    spreads = finding_spreads(rows, 1)
    assert set(spreads) == {"bf16", "fp16", "int4"}  # fp8 did not run: no numbers of it
    verdicts = {r["claim"]: r["verdict"] for r in findings.evaluate(spreads, "inference")}
    assert verdicts == {
        "bf16 draws less power than fp16 at inference": "agree",
        "bf16 generates more tokens per second than fp16": "disagree",
        "int4 needs less memory than bf16": "agree",
        "int4 draws less power than bf16": "inconclusive",  # int4's interval overlaps bf16's
        "int4 generates more tokens per second than bf16": "disagree",
        "int4 costs quality (bf16's perplexity is the lower)": "agree"}
    ratios = {r["claim"]: r["ratio"] for r in findings.evaluate(spreads, "inference")}
    assert ratios["int4 needs less memory than bf16"].startswith(f"x{0.61 / (6.09 / 3):.3f}")
    assert "served by vLLM" in findings.markdown(findings.evaluate(spreads, "inference"), "# h")


@pytest.mark.parametrize("axis", [["--axis", "inference"], ["--axis=inference"]])
def test_the_efficiency_suites_inference_axis_is_this_benchmark(llama_dir, tmp_path, monkeypatch, axis):
    """`efficiency_suite --axis inference` takes the benchmark's options and runs it (its run_bench, stubbed here)."""
    from litespark_megatron.apps import inference_bench

    ran = []
    monkeypatch.setattr(inference_bench, "run_bench", lambda settings: ran.append(settings) or 0)
    argv = ["--hf", str(llama_dir), "--out", str(tmp_path / "out"), "--variants", "bf16,int4", "--batch-sizes", "1,8",
            "--repeats", "3", "--cpu"]
    assert load_tool("efficiency_suite").main(axis + argv) == 0
    assert ran == [inference_bench.parse_settings(argv)]


@pytest.mark.parametrize("argv, expected", [
    (["--hf", "{llama}", "--", "--bf16"], "the flags after '--' have no run to go to"),
    (["--hf", "{llama}", "--peft-base", "x"], "unrecognized arguments: --peft-base x"),
    (["--hf", "{llama}", "--variants", "lora"], "unknown variant 'lora'; choose from: bf16"),
])
def test_the_inference_axis_refuses_the_training_axes_options(llama_dir, tmp_path, capsys, argv, expected):
    argv = ["--axis", "inference", "--out", str(tmp_path / "out")] + [a.format(llama=llama_dir) for a in argv]
    line = run_error(load_tool("efficiency_suite"), argv, capsys)
    assert line.startswith("efficiency_suite --axis inference: error: ") and expected in line, line
    assert not (tmp_path / "out").exists()


def test_a_variant_that_cannot_run_here_says_why():
    from litespark_megatron.apps.inference_variants import cannot_run_reason

    assert "compute capability 8.9" in cannot_run_reason("fp8", None)
    assert "is 8.0" in cannot_run_reason("fp8", (8, 0))
    assert cannot_run_reason("fp8", (9, 0)) is None and cannot_run_reason("int4", None) is None


@pytest.mark.integration  # the benchmark starts a process per variant
def test_end_to_end_reports_every_variant_and_resumes_only_what_did_not_finish(llama_dir, tmp_path, capsys):
    tool = load_tool("inference_bench")
    out = tmp_path / "out"
    argv = ["--hf", str(llama_dir), "--out", str(out), "--cpu", "--variants", "bf16,int4,fp8",
            "--batch-sizes", "1,2", "--prompt-tokens", "8", "--new-tokens", "4", "--timed-calls", "1",
            "--eval-text", str(llama_dir.parent / "eval.txt"), "--eval-tokens", "512", "--eval-seq-length", "64"]
    assert tool.main(argv) == 0, capsys.readouterr()
    report = json.loads((out / "inference.json").read_text())
    rows = {r["variant"]: r for r in report["variants"]}
    assert rows["fp8"]["status"] == "cannot run here" and "compute capability" in rows["fp8"]["error"]
    bf16, int4 = rows["bf16"], rows["int4"]
    assert bf16["status"] == int4["status"] == "done"
    assert [b["batch_size"] for b in int4["batches"]] == [1, 2]
    result = json.loads((out / "runs" / "int4" / "result.json").read_text())
    assert [b["generated_tokens"] for b in result["batches"]] == [4, 8]
    assert "PrototypeInt4WeightOnlyConfig(group_size=128" in int4["method"]
    assert int4["size_ratio_measured"] == pytest.approx(bf16["weight_bytes"] / int4["weight_bytes"])
    assert int4["size_ratio_nominal"] == 4 and bf16["top1_agreement_with_bf16"] == 1.0
    assert 0.5 < int4["top1_agreement_with_bf16"] <= 1.0
    assert int4["mcr_nominal"] == pytest.approx(4 * int4["top1_accuracy"] / bf16["top1_accuracy"])
    assert all(b["power_w"] is None for b in int4["batches"])  # no GPU: not measured, nothing made up
    assert "Energy not measured: no GPU" in (out / "inference.md").read_text()
    written = (out / "findings.md").read_text()  # on a CPU: quality judged, power not measured
    assert "| int4 costs quality (bf16's perplexity is the lower) |" in written
    assert "| int4 draws less power than bf16 | 10-23% less (14-32B) | power_w | int4 not measured; bf16 not " \
           "measured | - | **not measured** |" in written
    capsys.readouterr()

    # An interrupted int4 run (its state left 'running'): the same command runs int4 again, and only int4.
    state = json.loads((out / "bench_state.json").read_text())
    state["runs"]["int4"] = dict(status="running")
    (out / "bench_state.json").write_text(json.dumps(state))
    bf16_result = (out / "runs" / "bf16" / "result.json").stat().st_mtime_ns
    assert tool.main(argv) == 0
    log = capsys.readouterr().out
    assert "bf16: already done, skipped" in log and "int4: measuring" in log and "bf16: measuring" not in log
    assert (out / "runs" / "bf16" / "result.json").stat().st_mtime_ns == bf16_result

    assert run_error(tool, argv[:-2] + ["--eval-seq-length", "32"], capsys).endswith(
        "use another --out, or the same settings to continue it")
