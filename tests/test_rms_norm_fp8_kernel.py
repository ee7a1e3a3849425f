"""Litespark's FP8 RMSNorm (kernels/rms_norm_fp8.py): the Triton kernel writes the plain-torch reference's bytes in
both FP8 layouts with its amax and row statistics (Triton's interpreter on the CPU, compiled on a GPU), over odd sizes
and both formats; the backward's reference is the norm's gradient; under FP8 --litespark-rmsnorm feeds TE's QKV and
fc1 GEMMs their FP8 input, trains as TE's fused norm does, says so, and is refused where it cannot."""

import pytest
import torch

from conftest import ok, records, run_interpreted, train
from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError
from litespark_megatron.kernels import rms_norm as rn, rms_norm_fp8 as rf

INTERPRETED = """
import json, torch
from litespark_megatron.kernels import rms_norm_fp8 as rf

result = {"mismatched_fp32": 0, "mismatched_bf16": 0, "elements": 0, "max_step": 0, "layouts_agree": True,
          "amax_err_fp32": 0.0, "amax_err_bf16": 0.0, "rstd_err": 0.0, "scale_inv_exact": True}
torch.manual_seed(0)
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    # rows below, at and past one program's 32; columns below, at and past one tile's 256 and not a power of two
    for rows, columns in ((3, 37), (32, 256), (70, 300), (1, 520)):
        for xdtype in (torch.float32, torch.bfloat16):
            for scale in (7.5, 1e30, 1e-3):  # saturated, subnormal
                x = (torch.randn(rows, columns) * 3).to(xdtype)
                w = (torch.rand(columns) + 0.5).to(xdtype)
                s = torch.tensor([scale])
                a1, a2 = torch.tensor([0.25]), torch.tensor([0.25])
                got, want = rf.rms_norm_fp8_triton(x, w, 1e-5, s, a1, dtype), \\
                    rf.rms_norm_fp8_reference(x, w, 1e-5, s, a2, dtype)
                g, r = got[0].view(torch.uint8), want[0].view(torch.uint8)
                name = "fp32" if xdtype == torch.float32 else "bf16"
                result["mismatched_" + name] += (g != r).sum().item()
                result["elements"] += g.numel()
                result["max_step"] = max(result["max_step"], (g.int() - r.int()).abs().max().item())
                result["layouts_agree"] &= torch.equal(got[1].view(torch.uint8), g.t())
                result["amax_err_" + name] = max(result["amax_err_" + name], abs(a1.item() - a2.item()) / a2.item())
                result["rstd_err"] = max(result["rstd_err"], ((got[3] - want[3]).abs() / want[3]).max().item())
                result["scale_inv_exact"] &= torch.equal(got[2], want[2])
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "rms-norm-fp8-interpreted", INTERPRETED)


def test_triton_kernel_writes_the_references_bytes(interpreted):
    """The kernel's row sums of squares are not torch's (another order of fp32 additions), so a value on a rounding
    boundary may land one step apart: from fp32 rows a byte in a thousand at most (measured: none), from bf16 rows,
    where the normed value is rounded to bf16 first and one bf16 step moves an FP8 byte, under 2% (measured: 1.1%);
    never more than one FP8 step. The column-major layout is the row-major's transpose; the amax is the reference's
    to one bf16 step (2^-7 at most), the row statistics to fp32 rounding."""
    elements = interpreted["elements"] / 2  # per input dtype
    assert elements > 0 and interpreted["max_step"] <= 1, interpreted
    assert interpreted["mismatched_fp32"] <= 1e-3 * elements, interpreted
    assert interpreted["mismatched_bf16"] <= 2e-2 * elements, interpreted
    assert interpreted["layouts_agree"] and interpreted["scale_inv_exact"], interpreted
    assert interpreted["amax_err_fp32"] <= 1e-6 and interpreted["amax_err_bf16"] <= 2 ** -7, interpreted
    assert interpreted["rstd_err"] <= 1e-6, interpreted


def test_the_reference_is_the_bf16_norms_function_quantized():
    """Dequantized, the FP8 reference is the BF16 norm's output before its last rounding, within the format's half
    step; its amax is that output's largest |value|; the rows' statistics are the norm's."""
    torch.manual_seed(1)
    x, w = torch.randn(9, 40, dtype=torch.float64) * 2, torch.rand(40, dtype=torch.float64) + 0.5
    amax = torch.zeros(1)
    row, col, scale_inv, rstd = rf.rms_norm_fp8_reference(x, w, 1e-5, torch.tensor([30.0]), amax, torch.float8_e4m3fn)
    want = rn.rms_norm_reference(x, w, 1e-5)
    assert torch.equal(col, row.t())
    assert torch.allclose(row.double() * scale_inv.double(), want, rtol=2 ** -4, atol=0)
    assert amax.item() == pytest.approx(want.abs().max().item(), rel=1e-6)
    assert torch.allclose(rstd.double(), x.pow(2).mean(-1).add(1e-5).rsqrt(), rtol=1e-6)


def test_the_backward_reference_is_the_norms_gradient():
    """In fp64 the plain-torch backward (the FP8 norm's on a CPU, the Triton kernel's definition) is autograd's
    gradient of the norm, with respect to the rows and the weight."""
    torch.manual_seed(2)
    x = (torch.randn(11, 24, dtype=torch.float64) * 3).requires_grad_()
    w = (torch.rand(24, dtype=torch.float64) + 0.5).requires_grad_()
    dy = torch.randn(11, 24, dtype=torch.float64)
    gx, gw = torch.autograd.grad(rn.rms_norm_reference(x, w, 1e-5), (x, w), dy)
    rstd = x.detach().pow(2).mean(-1).add(1e-5).rsqrt()
    dx, dw = rn.rms_norm_backward_reference(dy, x.detach(), w.detach(), rstd)
    assert torch.allclose(dx, gx, rtol=1e-12, atol=1e-12) and torch.allclose(dw, gw, rtol=1e-12, atol=1e-12)


def test_a_weight_of_another_size_is_refused():
    with pytest.raises(ValueError, match=r"^RMSNorm: weight of shape \(39,\) for rows of 40$"):
        rf.rms_norm_to_fp8(torch.randn(2, 40), torch.rand(39), 1e-5, None)


def _bare(cls, **children):
    """A module of class cls without its constructor (megatron-core's need a model's config), holding children."""
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, child in children.items():
        setattr(module, name, child)
    return module


def test_each_pre_norm_feeds_the_one_gemm_after_it_outside_the_module_tree():
    """link_fp8_norms: the dense attention's input norm feeds its QKV GEMM and the MLP's pre-norm its fc1; a norm
    followed by another attention (NSA: two GEMMs read it) is not linked. The linear stays out of the norm's
    parameters and keys, and without FP8 (here: a CPU, a linear that is not TE's) the norm writes what it wrote."""
    from types import SimpleNamespace

    from litespark_megatron.layers import LitesparkMLP, LitesparkRMSNorm, LitesparkSelfAttention
    from litespark_megatron.model import link_fp8_norms

    config = SimpleNamespace(layernorm_zero_centered_gamma=False, params_dtype=torch.float32, sequence_parallel=False)
    norms = [LitesparkRMSNorm(config, 8) for _ in range(4)]
    qkv, fc1, other = torch.nn.Linear(8, 24), torch.nn.Linear(8, 32), torch.nn.Linear(8, 24)
    dense = SimpleNamespace(input_layernorm=norms[0], self_attention=_bare(LitesparkSelfAttention, linear_qkv=qkv),
                            pre_mlp_layernorm=norms[1], mlp=_bare(LitesparkMLP, linear_fc1=fc1))
    nsa = SimpleNamespace(input_layernorm=norms[2], self_attention=_bare(torch.nn.Module, linear_qkv=other),
                          pre_mlp_layernorm=norms[3], mlp=_bare(torch.nn.Module, linear_fc1=other))
    link_fp8_norms([SimpleNamespace(decoder=SimpleNamespace(layers=[dense, nsa]))])
    assert norms[0].__dict__["_feeds"] is qkv and norms[1].__dict__["_feeds"] is fc1
    assert "_feeds" not in norms[2].__dict__ and "_feeds" not in norms[3].__dict__
    assert list(norms[0].state_dict()) == ["weight"] and list(norms[0].children()) == []
    x = torch.randn(3, 2, 8)
    assert torch.equal(norms[0](x), rn.rms_norm_reference(x, norms[0].weight, norms[0].eps))
    assert norms[0].fp8_ran is False


def test_rows_of_a_plain_tensor_is_its_view_and_dropping_leaves_it():
    from litespark_megatron.kernels.te_fp8 import drop_row_major_if_quantized, rows_of

    x = torch.randn(3, 2, 8)
    rows = rows_of(x)
    assert rows.shape == (6, 8) and rows.data_ptr() == x.data_ptr()
    drop_row_major_if_quantized(x)
    assert x.shape == (3, 2, 8)


FP8 = ["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
       "--litespark-rmsnorm"]


@pytest.mark.parametrize("flags, message", [
    (["--fp8-recipe", "tensorwise"], "--litespark-rmsnorm with --fp8-format on the te backend writes delayed-scaling "
     "FP8 (--fp8-recipe delayed), and the recipe is tensorwise: Transformer Engine's norm writes that recipe's FP8 "
     "input itself; drop the flag"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], "--litespark-rmsnorm with --fp8-format and "
     "--sequence-parallel: the QKV and fc1 GEMMs all-gather their input, which Transformer Engine then casts itself; "
     "drop one"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], "--litespark-rmsnorm with --fp8-format "
     "and the norms recomputed (--recompute-granularity full, or selective with layernorm): Transformer Engine keeps "
     "its own copy of the FP8 scaling state for the recompute; drop one"),
    (["--recompute-granularity", "selective", "--recompute-modules", "layernorm"], "--litespark-rmsnorm with "
     "--fp8-format and the norms recomputed (--recompute-granularity full, or selective with layernorm): Transformer "
     "Engine keeps its own copy of the FP8 scaling state for the recompute; drop one"),
])
def test_under_fp8_the_flag_is_refused_where_the_norm_cannot_write_the_gemms_input(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as e:
        check(TINY + FP8 + flags, GPU_TE)
    assert str(e.value) == message


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_triton_on_cuda_writes_the_references_bytes():
    """8192 rows of 3072 (llama-3b's hidden size) in bf16, e4m3 at a delayed scale: the compiled kernel's bytes are
    the reference's but for values on a rounding boundary (one step, as under the interpreter), its layouts each
    other's transpose, its amax and row statistics the reference's to a bf16 step and fp32 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(8192, 3072, device="cuda", generator=g) * 2).to(torch.bfloat16)
    w = (torch.rand(3072, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    s = torch.tensor([40.0], device="cuda")
    a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
    got = rf.rms_norm_fp8_triton(x, w, 1e-5, s, a1, torch.float8_e4m3fn)
    want = rf.rms_norm_fp8_reference(x, w, 1e-5, s, a2, torch.float8_e4m3fn)
    g, r = got[0].view(torch.uint8), want[0].view(torch.uint8)
    assert (g.int() - r.int()).abs().max().item() <= 1 and (g != r).float().mean().item() <= 2e-2
    assert torch.equal(got[1].view(torch.uint8), g.t())
    assert abs(a1.item() - a2.item()) <= 2 ** -7 * a2.item() and torch.allclose(got[3], want[3], rtol=1e-6)


MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "64", "--vocab-size", "256", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "4", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234", "--log-interval", "1", "--spec", "litespark", "--transformer-impl",
        "transformer_engine", "--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the te backend's FP8 run needs a GPU")
def test_under_fp8_the_norms_feed_the_gemms_and_train_as_tes_fused_norm(tmp_path):
    """A tiny FP8 run with --litespark-rmsnorm: the record says the norms wrote FP8, and each step's loss is the fused
    TE norm's run's within FP8's rounding (both cast the same normed values; the BF16 norm rounds once more)."""
    ok(train(1, *MOCK, "--litespark-rmsnorm", "--metrics-file", tmp_path / "on.jsonl"))
    ok(train(1, *MOCK, "--no-litespark-rmsnorm", "--metrics-file", tmp_path / "off.jsonl"))
    on, off = (records(tmp_path / f"{name}.jsonl") for name in ("on", "off"))
    assert [r for r in on if r["kind"] == "health"][0]["fusions"]["rms_norm"] == "litespark fp8"
    got, want = ([r["loss"] for r in rs if r["kind"] == "train"] for rs in (on, off))
    assert len(got) == len(want) == 4
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(got, want)), (got, want)
