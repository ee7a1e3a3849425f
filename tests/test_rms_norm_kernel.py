"""Litespark's RMSNorm (kernels/rms_norm.py): the Triton kernels equal the plain-torch reference (through Triton's
interpreter on the CPU, compiled on a GPU), forward and both gradients, over odd sizes, several backward programs
and a last one with fewer rows; --litespark-rmsnorm trains what the default norm trains, says so, keeps the
checkpoint keys, and is refused where it has nothing to act on."""

import pytest
import torch

from conftest import ok, records, run_interpreted, train
from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError
import litespark_megatron.kernels
from litespark_megatron.kernels import rms_norm as rn, triton_available

# Largest differences of the Triton path from the reference in fp64, relative to the reference's largest value.
INTERPRETED = """
import json, torch
from litespark_megatron.kernels import rms_norm as rn

worst = {}
torch.manual_seed(0)
for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    for shape, rows_per_program in (((3, 37), 1), ((7, 2, 48), 3), ((5, 130), 0), ((1, 1, 64), 2)):
        for zero_centered in (False, True):
            x = (torch.randn(*shape) * 3).to(dtype).requires_grad_()
            w = (torch.rand(shape[-1]) * (0.2 if zero_centered else 1) + (0 if zero_centered else 0.5)).to(dtype)
            w.requires_grad_()
            dy = torch.randn(*shape).to(dtype)
            scale = (w + 1) if zero_centered else w  # --apply-layernorm-1p: the module passes 1 + weight
            y = rn.rms_norm_triton(x, scale, 1e-5, rows_per_program)
            gx, gw = torch.autograd.grad(y, (x, w), dy)
            x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
            y64 = rn.rms_norm_reference(x64, (w64 + 1) if zero_centered else w64, 1e-5)
            rx, rw = torch.autograd.grad(y64, (x64, w64), dy.double())
            for key, got, want in (("y", y, y64), ("dx", gx, rx), ("dw", gw, rw)):
                assert got.dtype == dtype and got.shape == want.shape, (key, got.dtype, got.shape)
                err = ((got.double() - want).abs().max() / want.abs().max()).item()
                worst[f"{name}_{key}"] = max(worst.get(f"{name}_{key}", 0.0), err)
print(json.dumps(worst))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "rms-norm-interpreted", INTERPRETED)


def test_triton_kernels_equal_the_reference(interpreted):
    """fp32 to fp32 rounding; bf16 within two roundings of the output (2^-8 each: the normed row, then its product
    with the weight; the reference rounds the same two, in an order of sums of its own)."""
    for key in ("y", "dx", "dw"):
        assert interpreted[f"fp32_{key}"] <= 1e-6, interpreted
        assert interpreted[f"bf16_{key}"] <= 2 ** -6, interpreted


def test_the_cpu_runs_the_reference():
    x, w = torch.randn(3, 2, 40), torch.rand(40)
    assert rn.rms_norm_path("cpu") == "litespark (reference)"
    assert torch.equal(rn.rms_norm(x, w, 1e-5), rn.rms_norm_reference(x, w, 1e-5))
    assert rn.rms_norm_path("cuda") == ("litespark" if triton_available() else "litespark (reference)")


def test_a_weight_of_another_size_is_refused():
    if not triton_available():
        pytest.skip("the Triton path needs Triton")
    with pytest.raises(ValueError, match=r"^RMSNorm: weight of shape \(39,\) for rows of 40$"):
        rn.rms_norm_triton(torch.randn(2, 40), torch.rand(39), 1e-5)


MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234", "--log-interval", "1", "--spec", "litespark", "--transformer-impl", "local"]


def test_the_flag_trains_as_the_default_norm_and_says_so(tmp_path):
    """On the CPU both norms are the reference: the same losses bit for bit, the same checkpoint keys (a run with
    the flag resumes one without it); the run's record and its first-step line name the norm that ran."""
    off = tmp_path / "off.jsonl"
    ok(train(1, *MOCK, "--metrics-file", off, "--save", tmp_path / "ckpt", "--save-interval", "2",
             "--exit-interval", "2"))
    on = tmp_path / "on.jsonl"
    proc = ok(train(1, *MOCK, "--metrics-file", on, "--litespark-rmsnorm", "--load", tmp_path / "ckpt"))
    fresh = tmp_path / "fresh.jsonl"
    ok(train(1, *MOCK, "--metrics-file", fresh))
    losses = {name: {r["step"]: r["loss"] for r in records(path) if r["kind"] == "train"}
              for name, path in (("off", off), ("on", on), ("fresh", fresh))}
    assert sorted(losses["on"]) == [3]  # resumed after step 2
    assert losses["off"][2] == losses["fresh"][2] and losses["on"][3] == losses["fresh"][3], losses
    health = [r for r in records(on) if r["kind"] == "health"]
    assert health[0]["fusions"]["rms_norm"] == "litespark (reference)", health
    assert "RMSNorm litespark (reference)" in proc.stdout


@pytest.mark.parametrize("flags, plat, message", [
    (["--spec", "stock-local"], None, "--litespark-rmsnorm builds the Litespark layer's norms; it needs --spec "
                                      "litespark"),
    (["--spec", "litespark", "--multi-latent-attention"], None,
     "--litespark-rmsnorm with --multi-latent-attention: MLA's latent norms stay inside Transformer Engine's up "
     "projections; drop one"),
])
def test_the_flag_is_refused_where_it_has_no_norm_to_run(flags, plat, message):
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-rmsnorm"] + flags, *([plat] if plat else []))
    assert str(e.value) == message


def test_a_gpu_without_triton_is_refused(monkeypatch):
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-rmsnorm", "--spec", "litespark", "--transformer-impl", "transformer_engine",
                      "--bf16"], GPU_TE)
    assert str(e.value) == ("--litespark-rmsnorm on a GPU runs Triton kernels, and Triton does not import here: "
                            "install torch's CUDA build with its triton, or drop the flag")
    check(TINY + ["--litespark-rmsnorm", "--spec", "litespark"])  # the CPU: the reference, Triton or not


@pytest.mark.parametrize("moe", [False, True])
def test_every_norm_of_the_local_spec_runs_the_kernel(moe):
    """Every norm of the layer (and the block's final norm) is a LitesparkRMSNorm with Litespark's kernel; the default
    spec keeps the compiled one. (A spec whose norm variable was reused for the module class once left all but the
    final norm on the default.)"""
    from types import SimpleNamespace
    from unittest import mock

    from litespark_megatron.layers import LitesparkRMSNorm
    from litespark_megatron.specs import get_litespark_layer_spec, litespark_layer_spec

    spec = get_litespark_layer_spec("local", num_experts=4 if moe else None, norm="litespark").submodules
    for norm in (spec.input_layernorm, spec.pre_mlp_layernorm):
        assert norm.module is LitesparkRMSNorm and norm.params == {"kernel": "litespark"}, norm
    assert get_litespark_layer_spec("local").submodules.input_layernorm is LitesparkRMSNorm
    config = SimpleNamespace(transformer_impl="local", multi_latent_attention=False, moe_grouped_gemm=False,
                             qk_layernorm=False, num_moe_experts=None, moe_layer_freq=1, num_layers=2,
                             pipeline_model_parallel_layout=None)
    with mock.patch("megatron.core.transformer.transformer_block.get_num_layers_to_build", return_value=2), \
            mock.patch("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", return_value=0), \
            mock.patch("megatron.core.models.gpt.experimental_attention_variant_module_specs.get_moe_layer_pattern",
                       return_value=[0, 0]):
        block = litespark_layer_spec(config, norm="litespark")
    assert block.layer_norm.module is LitesparkRMSNorm and block.layer_norm.params == {"kernel": "litespark"}
    assert all(layer.submodules.input_layernorm.params == {"kernel": "litespark"} for layer in block.layer_specs)


@pytest.mark.gpu
def test_the_te_spec_puts_the_norms_before_plain_linears_under_the_fused_keys():
    """--litespark-rmsnorm on the te backend: LitesparkRMSNorm modules run Litespark's kernel, the QKV and fc1 GEMMs
    are TE's plain column-parallel linears, and the norms' keys map to the fused modules' (layer_norm_weight)."""
    pytest.importorskip("transformer_engine.pytorch")
    from litespark_megatron.layers import LitesparkRMSNorm
    from litespark_megatron.specs import LOCAL_TO_TE_KEYS, get_litespark_layer_spec
    from megatron.core.extensions.transformer_engine import TEColumnParallelLinear

    spec = get_litespark_layer_spec("te", norm="litespark").submodules
    for norm in (spec.input_layernorm, spec.pre_mlp_layernorm):
        assert norm.module is LitesparkRMSNorm and norm.params == {"kernel": "litespark"}
    assert spec.self_attention.submodules.linear_qkv is TEColumnParallelLinear
    assert spec.mlp.submodules.linear_fc1 is TEColumnParallelLinear
    assert spec.sharded_state_dict_keys_map == LOCAL_TO_TE_KEYS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_triton_on_cuda_equals_the_reference():
    """8192 rows of 3072 (llama-3b's hidden size, which TE's tuned kernels do not cover) in bf16: the compiled
    kernels give the reference's output and gradients within bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(4096, 2, 3072, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_()
    w = (torch.rand(3072, device="cuda", generator=g) + 0.5).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(4096, 2, 3072, device="cuda", generator=g).to(torch.bfloat16)
    assert rn.rms_norm_path("cuda") == "litespark"
    y = rn.rms_norm(x, w, 1e-5)
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    x64, w64 = (t.detach().double().requires_grad_() for t in (x, w))
    y64 = rn.rms_norm_reference(x64, w64, 1e-5)
    rx, rw = torch.autograd.grad(y64, (x64, w64), dy.double())
    for got, want in ((y, y64), (gx, rx), (gw, rw)):
        assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 2 ** -6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the te backend's BF16 run needs a GPU")
def test_on_the_te_backend_a_run_resumes_the_fused_norms_checkpoint(tmp_path):
    """A te-backend BF16 checkpoint (norms inside TE's norm+GEMM modules) resumes under --litespark-rmsnorm (norms of
    their own, keys mapped) and trains step 3 as the run without the flag does, to the two norm kernels' rounding;
    the record names Litespark's kernel."""
    te = [a if a != "local" else "transformer_engine" for a in MOCK] + ["--bf16"]
    ok(train(1, *te, "--save", tmp_path / "ckpt", "--save-interval", "2", "--exit-interval", "2",
             "--metrics-file", tmp_path / "off.jsonl"))
    ok(train(1, *te, "--litespark-rmsnorm", "--load", tmp_path / "ckpt", "--metrics-file", tmp_path / "on.jsonl"))
    ok(train(1, *te, "--metrics-file", tmp_path / "fresh.jsonl"))
    on, fresh = (records(tmp_path / f"{name}.jsonl") for name in ("on", "fresh"))
    got = [r["loss"] for r in on if r["kind"] == "train"]
    want = [r["loss"] for r in fresh if r["kind"] == "train" and r["step"] == 3]
    assert len(got) == 1 and abs(got[0] - want[0]) <= 1e-2 * abs(want[0]), (got, want)
    assert [r for r in on if r["kind"] == "health"][0]["fusions"]["rms_norm"] == "litespark"
