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


def _core_attention(d):
    from types import SimpleNamespace

    from megatron.core.transformer.enums import AttnMaskType

    from litespark_megatron.layers.attention import LitesparkCoreAttention

    config = SimpleNamespace(attention_dropout=0.0, kv_channels=d, context_parallel_size=1)
    return LitesparkCoreAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal)


def _explicit_attention(q, k, v):
    """softmax over [sq, b, h, d] queries that are the last sq positions of [sk, b, hk, d] keys, in float64."""
    (sq, b, heads, d), (sk, groups) = q.shape, k.shape[::2]
    kr, vr = (t.double().repeat_interleave(heads // groups, dim=2) for t in (k, v))
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), kr) * d ** -0.5
    future = torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(sk - sq + 1)
    scores = scores.masked_fill(future, float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vr).reshape(sq, b, heads * d)


def test_core_attention_equals_explicit_softmax():
    """LitesparkCoreAttention (SDPA, causal, grouped KV) against an explicit masked softmax in float64."""
    s, b, heads, groups, d = 12, 2, 4, 2, 8
    q = torch.randn(s, b, heads, d, dtype=torch.float64)
    k, v = torch.randn(s, b, groups, d, dtype=torch.float64), torch.randn(s, b, groups, d, dtype=torch.float64)
    torch.testing.assert_close(_core_attention(d)(q, k, v, None), _explicit_attention(q, k, v))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the flash-attention path (bf16 on CUDA) needs a GPU"))])
def test_queries_at_the_end_of_longer_keys(device):
    """Context parallelism attends a chunk of queries to every key before it: the causal diagonal sits at the end
    of the keys (bottom-right), with grouped KV heads. CPU: explicit mask in float64; CUDA: bf16 through
    flash attention's lower-right causal mode."""
    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    sq, sk, b, heads, groups, d = 16, 48, 2, 8, 2, 64
    q = torch.randn(sq, b, heads, d, dtype=dtype, device=device)
    k, v = (torch.randn(sk, b, groups, d, dtype=dtype, device=device) for _ in range(2))
    out = _core_attention(d)._attend(q, k, v)  # [b, h, sq, d]
    got = out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)
    tol = {} if device == "cpu" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), _explicit_attention(q, k, v), **tol)
    # The first query sees sk - sq + 1 keys, not 1: a top-left causal mask would give another answer.
    top_left = _core_attention(d)._attend(q, k[:sq], v[:sq]).permute(2, 0, 1, 3).reshape(sq, b, heads * d)
    assert (top_left.double() - got.double()).abs().max() > 0.1


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
