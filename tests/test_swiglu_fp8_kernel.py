"""Litespark's FP8 SwiGLU (kernels/swiglu_fp8.py): the Triton kernels compute the plain-torch reference's values
and write them in both FP8 layouts with the tensor's amax (Triton's interpreter on the CPU, compiled on a GPU), over
odd sizes and both FP8 formats, forward and backward; the reference's backward is the forward's gradient;
--litespark-swiglu trains as the default SwiGLU does, says so in the run's record, resumes bit-exactly, and is
refused where it has nothing to act on."""

import pytest
import torch
import torch.nn.functional as F

from conftest import child_env, free_port, losses, ok, records, run_interpreted, train
from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError
from litespark_megatron.kernels import swiglu_fp8 as sf, te_fp8

# Largest counts over every case: bytes that differ from the reference's (and by how many FP8 steps), layouts that
# are not each other's transpose, amax's relative error; the scales cover saturation and subnormal numbers.
INTERPRETED = """
import json, torch
from litespark_megatron.kernels import swiglu_fp8 as sf

result = {"mismatched": 0, "elements": 0, "max_step": 0, "layouts_agree": True, "amax_err": 0.0,
          "scale_inv_exact": True, "saturated": True}
torch.manual_seed(0)
for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
    for rows, f in ((3, 5), (70, 37), (129, 64), (1, 130)):  # odd sizes; f as a TP rank's share of an FFN
        for xdtype in (torch.float32, torch.bfloat16):
            for spread, scale in ((3.0, 7.5), (0.01, 1.0), (3.0, 1e30), (1e-3, 50.0)):  # saturated, subnormal
                x = (torch.randn(rows, 2 * f) * spread).to(xdtype)
                dy = torch.randn(rows, f).to(xdtype)
                s = torch.tensor([scale])
                for fast, ref, args, start in ((sf.swiglu_fp8_triton, sf.swiglu_fp8_reference, (x,), 0.5),
                                               (sf.dswiglu_fp8_triton, sf.dswiglu_fp8_reference, (dy, x), 0.0)):
                    a1, a2 = torch.tensor([start]), torch.tensor([start])
                    got, want = fast(*args, s, a1, dtype), ref(*args, s, a2, dtype)
                    g, w = got[0].view(torch.uint8), want[0].view(torch.uint8)
                    result["mismatched"] += (g != w).sum().item()
                    result["elements"] += g.numel()
                    result["max_step"] = max(result["max_step"], (g.int() - w.int()).abs().max().item())
                    result["layouts_agree"] &= torch.equal(got[1].view(torch.uint8), g.t())
                    result["amax_err"] = max(result["amax_err"], abs(a1.item() - a2.item()) / a2.item())
                    result["scale_inv_exact"] &= torch.equal(got[2], want[2])
                    if scale == 1e30:  # every value saturates to the largest finite one (or is zero), none is NaN
                        top = torch.finfo(dtype).max
                        result["saturated"] &= set(got[0].float().abs().unique().tolist()) <= {0.0, top}
    # a NaN in the input stays NaN in both layouts (the reference's, torch's conversion) and nowhere else
    x = torch.randn(5, 2 * 7)
    x[2, 3] = float("nan")
    row, col, _ = sf.swiglu_fp8_triton(x, torch.tensor([1.0]), torch.zeros(1), dtype)
    result["nan_kept"] = result.get("nan_kept", True) and row.float().isnan().nonzero().tolist() == [[2, 3]] and \
        col.float().isnan().nonzero().tolist() == [[3, 2]]
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "swiglu-fp8-interpreted", INTERPRETED)


def test_triton_kernels_write_the_references_bytes_in_both_layouts(interpreted):
    """Every FP8 byte as the reference's (the kernels convert by integer arithmetic, exact under the interpreter; the
    fp32 exponentials of the two may differ in their last bit, which moves a value across an FP8 rounding boundary
    about once in a million, one step); the column-major tensor is the row-major one transposed; amax the largest
    |value| (and the one already there); 1 / scale beside them; a scale past the format's range saturates instead of
    making NaN; a NaN stays NaN."""
    assert interpreted["mismatched"] <= interpreted["elements"] * 1e-4 and interpreted["max_step"] <= 1, interpreted
    assert interpreted["layouts_agree"] and interpreted["scale_inv_exact"] and interpreted["saturated"], interpreted
    assert interpreted["nan_kept"], interpreted
    assert interpreted["amax_err"] <= 1e-6, interpreted


def test_the_references_backward_is_the_gradient_of_its_forward():
    """dswiglu_reference against autograd of silu(gate) * up, in fp64."""
    torch.manual_seed(0)
    x = (torch.randn(9, 2 * 13, dtype=torch.float64) * 4).requires_grad_()
    dy = torch.randn(9, 13, dtype=torch.float64)
    gate, up = x.chunk(2, dim=-1)
    (want,) = torch.autograd.grad(F.silu(gate) * up, x, dy)
    assert torch.allclose(sf.dswiglu_reference(dy, x.detach()), want, rtol=1e-12, atol=1e-12)


def test_the_reference_quantizes_as_delayed_scaling_does():
    """Scaled, saturated, rounded to nearest even; amax the max of the one there and the tensor's; the layouts each
    other's transpose; the reciprocal scale beside them."""
    gate_up = torch.tensor([[1.0, -2.0, 2.0, 4.0], [0.0, 30.0, 1.0, 1.0]])
    amax = torch.tensor([100.0])
    row, col, scale_inv = sf.swiglu_fp8_reference(gate_up, torch.tensor([32.0]), amax, torch.float8_e4m3fn)
    values = F.silu(gate_up[:, :2]) * gate_up[:, 2:]
    assert torch.equal(row.float(), (values * 32).clamp(-448, 448).to(torch.float8_e4m3fn).float())
    # 1.462 * 32 = 46.8 -> 48 (e4m3 steps by 4 there), -0.954 * 32 = -30.5 -> -30 (steps of 2), 30 * 32 -> 448
    assert row.float().tolist() == [[48.0, -30.0], [0.0, 448.0]]
    assert torch.equal(col, row.t()) and amax.item() == 100.0 and scale_inv.item() == 1 / 32
    sf.swiglu_fp8_reference(gate_up, torch.tensor([1.0]), amax, torch.float8_e4m3fn)
    assert amax.item() == 100.0  # nothing larger came
    sf.swiglu_fp8_reference(gate_up * 10, torch.tensor([1.0]), amax, torch.float8_e4m3fn)
    assert amax.item() == pytest.approx((F.silu(gate_up[:, :2] * 10) * gate_up[:, 2:] * 10).abs().max().item())


def test_formats_and_shapes_it_does_not_take_are_refused():
    assert te_fp8.torch_dtype("DType.kFloat8E5M2") == torch.float8_e5m2
    with pytest.raises(ValueError, match=r"^no FP8 format kBFloat16; Transformer Engine's "
                                         r"\['kFloat8E4M3', 'kFloat8E5M2'\] only$"):
        te_fp8.torch_dtype("DType.kBFloat16")
    with pytest.raises(ValueError, match=r"^FP8 SwiGLU: input of shape \(2, 3, 8\); it takes \[rows, 2f\] laid out "
                                         r"\[gate \| up\]$"):
        sf.swiglu_to_fp8(torch.zeros(2, 3, 8), None, None)


@pytest.mark.parametrize("flags, plat, message", [
    (["--spec", "stock-te"], GPU_TE, "--litespark-swiglu builds the Litespark MLP's activation; it needs --spec "
                                     "litespark"),
    (["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16"], GPU_TE,
     "--litespark-swiglu writes Transformer Engine's FP8 tensors: it needs --fp8-format on the te backend "
     "(--transformer-impl transformer_engine); in BF16 TE's SwiGLU already runs"),
    (["--spec", "litespark"], None,
     "--litespark-swiglu writes Transformer Engine's FP8 tensors: it needs --fp8-format on the te backend "
     "(--transformer-impl transformer_engine); in BF16 TE's SwiGLU already runs"),
    (["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
      "--fp8-recipe", "tensorwise"], GPU_TE,
     "--litespark-swiglu writes delayed-scaling FP8 (--fp8-recipe delayed), and the recipe is tensorwise; drop one"),
    (["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
      "--use-transformer-engine-op-fuser"], GPU_TE,
     "--litespark-swiglu with --use-transformer-engine-op-fuser: the fused MLP runs Transformer Engine's SwiGLU op; "
     "drop one"),
    (["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid",
      "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], GPU_TE,
     "--litespark-swiglu with the MLP recomputed (--recompute-granularity full, or selective with mlp): Transformer "
     "Engine keeps its own copy of the FP8 scaling state for the recompute; drop one"),
])
def test_the_flag_is_refused_where_it_has_no_fp8_swiglu_to_run(flags, plat, message):
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-swiglu"] + flags, *([plat] if plat else []))
    assert str(e.value) == message


def test_the_spec_gives_the_dense_mlp_the_kernel_and_refuses_what_cannot_take_it():
    from litespark_megatron.layers import LitesparkMLP
    from litespark_megatron.specs import get_litespark_layer_spec

    mlp = get_litespark_layer_spec("te", swiglu="litespark").submodules.mlp
    assert mlp.module is LitesparkMLP and mlp.params == {"swiglu": "litespark"}
    assert get_litespark_layer_spec("te").submodules.mlp.params == {}
    with pytest.raises(ConfigError, match="^Litespark's FP8 SwiGLU writes Transformer Engine's FP8 tensors: it needs "
                                          "the te backend$"):
        get_litespark_layer_spec("local", swiglu="litespark")
    with pytest.raises(ValueError, match="^unknown SwiGLU kernel 'fast'; choose 'default' or 'litespark'$"):
        LitesparkMLP(None, None, swiglu="fast")


# --------------------------------------------------------------------------------------------- on a GPU
def _bytes_agree(got, want):
    """All but one in 10^4 FP8 bytes equal, the rest one step apart: the compiled kernel's fp32 differs from the
    reference's in the last bit (an exponential; a product contracted into a fused multiply-add)."""
    got, want = got.view(torch.uint8), want.view(torch.uint8)
    differ = got != want
    steps = (got.to(torch.int16) - want.to(torch.int16)).abs()
    return differ.float().mean().item() <= 1e-4 and (steps[differ] <= 1).all().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_compiled_kernels_equal_the_reference_on_the_gpu():
    """llama-3b's MLP on one micro-batch row block (4,096 rows, FFN 8,192) and a TP share of odd size, bf16 in, both
    formats: the reference's bytes (torch's conversion: the GPU's, round to nearest even, saturated) in both layouts,
    its amax and 1 / scale. (The kernels convert by integer arithmetic: any CUDA GPU runs them.)"""
    g = torch.Generator(device="cuda").manual_seed(0)
    for rows, f in ((4096, 8192), (1000, 1365)):
        x = (torch.randn(rows, 2 * f, device="cuda", generator=g) * 2).to(torch.bfloat16)
        dy = (torch.randn(rows, f, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
        for dtype, scale in ((torch.float8_e4m3fn, 20.0), (torch.float8_e5m2, 3e4)):
            s = torch.tensor([scale], device="cuda")
            for fast, ref, args in ((sf.swiglu_fp8_triton, sf.swiglu_fp8_reference, (x,)),
                                    (sf.dswiglu_fp8_triton, sf.dswiglu_fp8_reference, (dy, x))):
                a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
                got, want = fast(*args, s, a1, dtype), ref(*args, s, a2, dtype)
                assert _bytes_agree(got[0], want[0]) and _bytes_agree(got[1], want[1]), (rows, f, dtype, fast)
                assert torch.equal(got[1], got[0].t().contiguous())
                assert abs(a1.item() - a2.item()) <= 1e-6 * a2.item() and torch.equal(got[2], want[2])
    # a NaN stays NaN (compiled, the saturating clamp alone turned it into the largest finite value)
    x = torch.randn(128, 2 * 96, device="cuda")
    x[2, 3] = float("nan")
    row, col, _ = sf.swiglu_fp8_triton(x, torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"),
                                       torch.float8_e4m3fn)
    assert row.float().isnan().nonzero().tolist() == [[2, 3]] and col.float().isnan().nonzero().tolist() == [[3, 2]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 runs on a GPU with FP8 tensor cores")
def test_a_te_linear_handed_both_layouts_needs_only_the_column_major_one_after_its_forward():
    """fc2 (a TE linear under delayed scaling) handed the kernel's Float8Tensor keeps the tensor object for its weight
    gradient; drop_row_major then frees the row-major bytes (rows x f) and the backward computes the same weight
    gradient, bit for bit. When this fails, TE saves its input another way: the MLP's drop must follow."""
    te = pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or more")
    import transformer_engine_torch as tex
    from transformer_engine.common.recipe import DelayedScaling, Format
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    rows, f, out_f = 4096, 1024, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    gate_up = torch.randn(rows, 2 * f, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(rows, out_f, device="cuda", generator=g).to(torch.bfloat16)
    weight = (torch.randn(out_f, f, device="cuda", generator=g) * 0.02).to(torch.bfloat16)

    def run(drop: bool):
        fc2 = te.Linear(f, out_f, bias=False, params_dtype=torch.bfloat16, device="cuda")
        with torch.no_grad():
            fc2.weight.copy_(weight)
        x = gate_up.clone()
        backward_q = Float8Quantizer(torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"),
                                     tex.DType.kFloat8E5M2)
        with te.autocast(enabled=True, recipe=DelayedScaling(fp8_format=Format.HYBRID)):
            fc2.init_fp8_metadata()
            act = sf.swiglu_to_fp8(x, fc2.quantizers["scaling_fwd"][int(tex.FP8FwdTensors.GEMM1_INPUT)], backward_q)
            out = fc2(act)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            if drop:
                te_fp8.drop_row_major(act)
            freed = before - torch.cuda.memory_allocated()
            del act
        out.backward(dy)
        return fc2.weight.grad, freed

    kept, dropped = run(False), run(True)
    assert kept[1] == 0 and dropped[1] == rows * f, (kept[1], dropped[1])
    assert torch.equal(kept[0], dropped[0])


FP8_RUN = ["--model", "tiny", "--mock-data", "--seq-length", "128", "--global-batch-size", "8", "--micro-batch-size",
           "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "6", "--log-interval", "1", "--eval-iters",
           "0", "--eval-interval", "100", "--seed", "7", "--save-interval", "100", "--bf16", "--fp8-format", "hybrid",
           "--fp8-recipe", "delayed", "--spec", "litespark", "--transformer-impl", "transformer_engine"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 runs on a GPU with FP8 tensor cores")
def test_an_fp8_run_with_the_kernel_trains_as_tes_swiglu_says_so_and_resumes_bit_exactly(tmp_path):
    """Six FP8 steps with the kernel (an FP8 run's default on a GPU with Triton; the flag given too) against TE's
    SwiGLU (--no-litespark-swiglu): the same losses to FP8's rounding (the kernel casts fp32 to FP8 where TE's path
    casts its bf16 result), the record names the kernel, and a run stopped at step 3 and resumed equals the
    uninterrupted one bit for bit (the scaling state is fc1's and fc2's, in their checkpoints)."""
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or more")

    def env():
        return child_env(MASTER_PORT=free_port())
    default, straight, halves = tmp_path / "default", tmp_path / "straight", tmp_path / "halves"
    ok(train(1, *FP8_RUN, "--no-litespark-swiglu", "--save", default, env=env()))
    ok(train(1, *FP8_RUN, "--save", straight, env=env()))
    ok(train(1, *FP8_RUN, "--litespark-swiglu", "--save", halves, "--load", halves, "--exit-interval", "3", env=env()))
    ok(train(1, *FP8_RUN, "--litespark-swiglu", "--save", halves, "--load", halves, env=env()))
    base, fast, resumed = (losses(d / "metrics.jsonl") for d in (default, straight, halves))
    assert sorted(fast) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert [fast[s] for s in range(1, 7)] == [resumed[s] for s in range(1, 7)], (fast, resumed)
    assert all(abs(fast[s] - base[s]) <= 1e-2 * abs(base[s]) for s in range(1, 7)), (fast, base)
    health = [r for r in records(straight / "metrics.jsonl") if r["kind"] == "health"][0]
    assert health["fusions"]["swiglu"] == "litespark-fp8" and not health["degraded"], health
    assert "swiglu" not in [r for r in records(default / "metrics.jsonl") if r["kind"] == "health"][0]["fusions"]


@pytest.mark.gpu
def test_float8_tensors_reshape_keeps_the_transposed_data_of_a_shape_tuple():
    """TE's backward reshapes each output gradient with one tuple (`g.reshape((-1, n))`); TE 2.20.2 then labels the
    transposed data [rows, n] (platform/float8_reshape.py). The patched reshape keeps it [n, rows]. When the
    unpatched assertion fails, TE has fixed its reshape: drop the patch."""
    pytest.importorskip("transformer_engine.pytorch")
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    from litespark_megatron.platform import reshape_takes_a_shape_tuple

    reshape_takes_a_shape_tuple()
    reshape_takes_a_shape_tuple()  # idempotent: one wrapper
    assert not getattr(Float8Tensor.reshape.unfixed, "litespark_fixed", False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    row = torch.arange(24, dtype=torch.uint8, device=device).reshape(6, 4)
    t = Float8Tensor(shape=row.shape, dtype=torch.bfloat16, data=row, fp8_scale_inv=torch.ones(1, device=device),
                     fp8_dtype=tex.DType.kFloat8E4M3, data_transpose=row.t().contiguous(), quantizer=None,
                     requires_grad=False, device=row.device)
    for shape in (((-1, 4),), ([6, 4],), (torch.Size([6, 4]),), (-1, 4)):
        fixed = t.reshape(*shape)
        assert fixed._transpose.shape == (4, 6) and torch.equal(fixed._transpose, row.t()), shape
    assert Float8Tensor.reshape.unfixed(t, (-1, 4))._transpose.shape == (6, 4)  # TE's own, unfixed
