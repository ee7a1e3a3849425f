"""tools/kernel_bench.py: its refusals on this CPU machine, and its table (the GPU runs it: docs/benchmarks)."""
import pytest
import torch

from litespark_megatron.apps import kernel_bench


@pytest.mark.parametrize("argv, message", [
    ([], "kernel_bench.py: error: give --hidden N or --model NAME (see --help)"),
    (["--kernel", "qkv-rope", "--hidden", "3072"], "kernel_bench.py: error: --kernel qkv-rope takes its heads, query "
                                                   "groups and head size from --model NAME (see --help)"),
    (["--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels it compares run on a GPU"),
    (["--kernel", "swiglu-fp8"], "kernel_bench.py: error: --kernel swiglu-fp8 takes its FFN size from --model NAME "
                                 "(see --help)"),
    (["--kernel", "swiglu-fp8", "--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels "
                                                        "it compares run on a GPU"),
    (["--kernel", "qkv-rope", "--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels it "
                                                      "compares run on a GPU"),
    (["--kernel", "fp8-logits"], "kernel_bench.py: error: --kernel fp8-logits takes its hidden size and vocabulary "
                                 "from --model NAME (see --help)"),
    (["--kernel", "fp8-logits", "--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels "
                                                        "it compares run on a GPU"),
    (["--kernel", "adam"], "kernel_bench.py: error: --kernel adam takes its parameters' shapes from --model NAME "
                           "(see --help)"),
    (["--kernel", "int4-linear"], "kernel_bench.py: error: --kernel int4-linear takes its linear layers' shapes from "
                                  "--model NAME (see --help)"),
    (["--kernel", "int4-linear", "--model", "llama-1b"], "kernel_bench.py: error: no CUDA device here; the kernels "
                                                         "it compares run on a GPU"),
    (["--kernel", "adam", "--model", "llama-3b"], "kernel_bench.py: error: no CUDA device here; the kernels it "
                                                  "compares run on a GPU"),
])
def test_refusals_are_one_line_and_exit_2(argv, message, capsys):
    assert kernel_bench.main(argv) == 2
    assert capsys.readouterr().err.strip() == message


def test_bad_flags_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        kernel_bench.main(["--hidden", "0"])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip() == ("kernel_bench.py: error: argument --hidden: a positive integer "
                                               "expected, got '0' (see --help)")


def test_table_shows_kernel_time_wall_time_and_error_and_says_why_a_row_did_not_run():
    base = dict(kernel="rms-norm", shape="16384 x 3072", dtype="bfloat16")
    rows = [dict(base, candidate="litespark", forward_ms=0.053, forward_kernel_ms=0.049, forward_gb_s=4108.0,
                 forward_backward_ms=0.494, forward_backward_kernel_ms=0.163, forward_backward_gb_s=3088.5,
                 error_outputs=5.0e-3, error_gradients=3.5e-3),
            dict(base, candidate="te", unavailable="Transformer Engine does not import (ImportError)")]
    assert kernel_bench.render(rows).splitlines()[2:] == [
        "| rms-norm | litespark | 16384 x 3072 | bfloat16 | 0.049 / 4,108 / 0.053 | 0.163 / 3,088 / 0.494 | "
        "5.0e-03 / 3.5e-03 |",
        "| rms-norm | te | 16384 x 3072 | bfloat16 | not run: Transformer Engine does not import (ImportError) | | |"]


def test_the_harness_measures_a_candidate_against_the_reference_and_names_what_could_not_run(monkeypatch):
    """_measure on the CPU, its GPU timers replaced: the outputs' and gradients' errors against the fp64 reference
    (a candidate off by 1% shows 1e-2), bandwidth from the kernels' time, and a builder's reason for not running."""
    monkeypatch.setattr(kernel_bench, "_median_ms", lambda fn: (fn(), 2.0)[1])
    monkeypatch.setattr(kernel_bench, "_kernel_ms", lambda fn: (fn(), 1.0)[1])
    x = torch.randn(8, 4)

    def off_by_a_percent(x):
        return (lambda: (x * 2 * 1.01,)), (x,)
    row = kernel_bench._measure({}, off_by_a_percent, (), (x,), (torch.ones(8, 4),), lambda x64: x64 * 2, (4e6, 6e6))
    assert row["error_outputs"] == pytest.approx(1e-2, rel=1e-3)
    assert row["error_gradients"] == pytest.approx(1e-2, rel=1e-3)
    assert (row["forward_ms"], row["forward_kernel_ms"], row["forward_gb_s"], row["forward_backward_gb_s"]) == \
        (2.0, 1.0, 4.0, 10.0)

    def unavailable():
        raise kernel_bench.Unavailable("no such kernel here")
    assert kernel_bench._measure({"candidate": "c"}, lambda x: unavailable(), (), (x,), (x,), None, (1, 1)) == \
        {"candidate": "c", "unavailable": "no such kernel here"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels it compares run on CUDA")
def test_the_fp8_swiglu_table_has_every_candidate_within_fp8s_rounding():
    """tiny's FFN (352 channels, a partial tile) on 512 rows: Litespark's kernels and TE's two paths each measured,
    their FP8 values within FP8's rounding of the fp64 function (e4m3: 2^-4 of the largest; e5m2: 2^-3)."""
    rows = kernel_bench.bench_swiglu_fp8(352, 512)
    assert [r["candidate"] for r in rows] == ["litespark", "te + cast/transpose",
                                              "te fused cast, then transpose (op fuser)"]
    if "unavailable" in rows[1]:
        pytest.skip(rows[1]["unavailable"])
    for r in rows:
        assert "unavailable" not in r, r
        assert r["error_outputs"] <= 2 ** -4 and r["error_gradients"] <= 2 ** -3, r
        assert r["forward_kernel_ms"] > 0 and r["forward_backward_kernel_ms"] > r["forward_kernel_ms"], r


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernels it compares run on CUDA")
def test_the_fp8_output_layer_table_has_every_candidate_within_its_rounding():
    """A small output layer (2,048 tokens, hidden 512, vocabulary 4,096): the FP8 path (its gradient rounded
    stochastically, and to nearest) and the BF16 one each measured, the FP8 loss and gradients within FP8's rounding
    of fp64, the BF16 ones within bf16's."""
    rows = kernel_bench.bench_fp8_logits(512, 4096, 2048)
    assert [r["candidate"] for r in rows] == ["litespark fp8 (GEMMs and loss gradient in FP8)",
                                              "litespark fp8, gradient rounded to nearest",
                                              "bf16 GEMMs + litespark cross-entropy"]
    if "unavailable" in rows[0]:
        pytest.skip(rows[0]["unavailable"])
    fp8 = (2 ** -5, 2 ** -2)
    for r, (outputs, gradients) in zip(rows, (fp8, fp8, (2 ** -7, 2 ** -5))):
        assert "unavailable" not in r, r
        assert r["error_outputs"] <= outputs and r["error_gradients"] <= gradients, r
        assert r["forward_backward_kernel_ms"] > r["forward_kernel_ms"] > 0, r


def test_adam_takes_the_presets_parameters():
    """llama-3b: 3 + 28 x 6 tensors, 3,606,752,256 parameters (its output layer untied); tiny the same way."""
    from litespark_megatron.presets import PRESETS

    shapes = kernel_bench.parameter_shapes(PRESETS["llama-3b"].flags)
    assert len(shapes) == 171 and sum(torch.Size(s).numel() for s in shapes) == 3_606_752_256
    assert shapes[:3] == [(128256, 3072), (128256, 3072), (3072,)] and shapes[3:9] == [
        (5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192), (3072,), (3072,)]
    tied = dict(PRESETS["tiny"].flags, **{"untie-embeddings-and-output-weights": False})
    assert kernel_bench.parameter_shapes(tied)[:2] == [(4096, 128), (128,)]


def test_adam_counts_master_weights_that_differ_from_the_reference():
    """The share of elements whose master weight differs in any bit from the reference's first step: none for the
    reference's own step, one element of 17 + 12 when one remainder is off by one."""
    from types import SimpleNamespace

    from litespark_megatron.kernels import adam as A

    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in ((17,), (3, 4))]
    start = [(p.detach().clone(), torch.randn(p.shape).bfloat16() * 1e-3) for p in params]
    group = dict(params=params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state = {}
    for p, (_, grad) in zip(params, start):
        m, v = torch.zeros(p.shape).bfloat16(), torch.zeros(p.shape).bfloat16()
        r = torch.zeros(p.shape, dtype=torch.int16)
        A.adam_reference(p.data, grad, m, v, r, A.AdamHyper(1e-4, 0.9, 0.95, 1e-8, 0.1, step=1), "remainders")
        state[p] = dict(exp_avg=m, exp_avg_sq=v, master_param=r)
    optimizer = SimpleNamespace(param_groups=[group], state=state)
    assert kernel_bench._adam_differs(optimizer, params, start) == 0
    state[params[1]]["master_param"][0, 0] += 1
    assert kernel_bench._adam_differs(optimizer, params, start) == pytest.approx(1 / 29)


def test_adam_table_shows_the_step_and_the_master_weights_that_differ():
    base = dict(kernel="adam", shape="171 tensors, 3.61 B parameters", dtype="bf16 parameters + remainders, "
                "bf16 gradients, bfloat16 moments")
    rows = [dict(base, candidate="te", step_ms=39.8, step_kernel_ms=39.6, gb_s=1640.2, master_bits_differ=0.0021),
            dict(base, candidate="litespark", unavailable="Triton does not import here")]
    assert kernel_bench.render_adam(rows).splitlines()[2:] == [
        "| adam | te | 171 tensors, 3.61 B parameters | bf16 parameters + remainders, bf16 gradients, bfloat16 moments "
        "| 39.60 / 1,640 / 39.80 | 0.210% |",
        "| adam | litespark | 171 tensors, 3.61 B parameters | bf16 parameters + remainders, bf16 gradients, bfloat16 "
        "moments | not run: Triton does not import here | |"]


def test_int4_linear_takes_the_blocks_linears_and_shows_what_each_reads_per_second():
    from litespark_megatron.presets import PRESETS

    assert kernel_bench.linear_shapes(PRESETS["llama-3b"].flags) == [
        ("qkv", 5120, 3072), ("proj", 3072, 3072), ("fc1", 16384, 3072), ("fc2", 3072, 8192)]
    base = dict(kernel="int4-linear", shape="fc1 1 x 3072 -> 16384", dtype="bf16 activations")
    rows = [dict(base, candidate="torch bf16", step_ms=0.0712, step_kernel_ms=0.0301, gb_s=3344.6, error=0.0),
            dict(base, candidate="litespark int4", unavailable="Triton does not import here")]
    assert kernel_bench.render_products(rows).splitlines()[2:] == [
        "| int4-linear | torch bf16 | fc1 1 x 3072 -> 16384 | bf16 activations | 0.0301 / 3,345 / 0.0712 | 0.0e+00 |",
        "| int4-linear | litespark int4 | fc1 1 x 3072 -> 16384 | bf16 activations | not run: Triton does not import "
        "here | |"]
