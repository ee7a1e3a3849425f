"""Each Litespark kernel equals its plain-torch reference on random inputs (fused versions on CUDA)."""
import pytest
import torch
import torch.nn.functional as F

from litespark_megatron.layers import kernels


def test_swiglu_reference_is_silu_gate_times_up():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    gate, up = x[..., :8], x[..., 8:]
    torch.testing.assert_close(kernels.swiglu_reference(x), gate * torch.sigmoid(gate) * up)


def test_rms_norm_reference_matches_torch():
    x, w = torch.randn(4, 7, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(kernels.rms_norm_reference(x, w, 1e-5), F.rms_norm(x, (32,), w, 1e-5))


def test_core_attention_equals_explicit_softmax():
    """LitesparkCoreAttention (SDPA, causal, grouped KV) against an explicit masked softmax in float64."""
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from litespark_megatron.layers.attention import LitesparkCoreAttention

    s, b, heads, groups, d = 12, 2, 4, 2, 8
    config = SimpleNamespace(attention_dropout=0.0, kv_channels=d, context_parallel_size=1)
    attn = LitesparkCoreAttention.__new__(LitesparkCoreAttention)
    torch.nn.Module.__init__(attn)
    attn.config, attn.dropout, attn.softmax_scale = config, 0.0, d ** -0.5
    q = torch.randn(s, b, heads, d, dtype=torch.float64)
    k, v = torch.randn(s, b, groups, d, dtype=torch.float64), torch.randn(s, b, groups, d, dtype=torch.float64)
    out = attn(q, k, v, None, attn_mask_type=AttnMaskType.causal)
    kr, vr = (t.repeat_interleave(heads // groups, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q, kr) * d ** -0.5
    scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), 1), float("-inf"))
    ref = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vr).reshape(s, b, heads * d)
    torch.testing.assert_close(out, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels run on CUDA only")
def test_swiglu_uses_te_where_te_is_installed():
    from litespark_megatron.platform import te_importable

    assert kernels.swiglu_impl("cuda") == ("te" if te_importable() else "compiled")
    assert kernels.swiglu_impl("cpu") == "reference"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels run on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_reference_on_cuda(dtype):
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else {}
    x = torch.randn(64, 3, 256, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 3, 128, device="cuda", dtype=dtype)
    y = kernels.swiglu(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    y_ref = kernels.swiglu_reference(x)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    x = x.detach()
    w = torch.randn(256, device="cuda", dtype=dtype)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), kernels.rms_norm_reference(x, w, 1e-5), **tol)
