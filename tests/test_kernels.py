"""Each Litespark kernel equals its plain-torch reference on random inputs (fused versions on CUDA)."""
import pytest
import torch
import torch.nn.functional as F

from litespark_megatron.layers import elementwise


def test_swiglu_reference_is_silu_gate_times_up():
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    gate, up = x[..., :8], x[..., 8:]
    torch.testing.assert_close(elementwise.swiglu_reference(x), gate * torch.sigmoid(gate) * up)


def test_rms_norm_reference_matches_torch():
    x, w = torch.randn(4, 7, 32, dtype=torch.float64), torch.randn(32, dtype=torch.float64)
    torch.testing.assert_close(elementwise.rms_norm_reference(x, w, 1e-5), F.rms_norm(x, (32,), w, 1e-5))


def _rope_config(fusion=False):
    from types import SimpleNamespace

    return SimpleNamespace(apply_rope_fusion=fusion, rotary_interleaved=False, multi_latent_attention=False,
                           mrope_section=None)


@pytest.mark.parametrize("rotated", [16, 8])  # all channels, and a partial rotary
def test_rope_reference_is_megatron_cores_rope(rotated):
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    s, b, h, d = 10, 2, 3, 16
    t = torch.randn(s, b, h, d, dtype=torch.float64)
    inv = 1.0 / 10000 ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron-core's [s, 1, 1, r] layout
    expected = apply_rotary_pos_emb(t, freqs, config=_rope_config(), cp_group=object())
    torch.testing.assert_close(elementwise.rope_reference(t, freqs), expected)
    # RoPE at position 0 is the identity; at any position it keeps each rotated pair's norm.
    torch.testing.assert_close(expected[0], t[0])
    torch.testing.assert_close(expected[..., :rotated].norm(dim=-1), t[..., :rotated].norm(dim=-1))
    assert elementwise.rope_impl(t, _rope_config()) == "unfused"  # the CPU: megatron-core's own ops
    assert elementwise.rope_impl(t, _rope_config(fusion=True)) == "te"


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


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA attention paths need a GPU")


@pytest.mark.parametrize("device, impl", [("cpu", "sdpa-mask"), pytest.param("cuda", "cudnn-split", marks=CUDA),
                                          pytest.param("cuda", "sdpa-lower-right", marks=CUDA)])
def test_queries_at_the_end_of_longer_keys(device, impl, monkeypatch):
    """Context parallelism attends a chunk of queries to every key before it: the causal diagonal sits at the end
    of the keys (bottom-right), with grouped KV heads. Output and gradients against an explicit float64 softmax:
    CPU in float64 (explicit mask); CUDA in bf16 through each implementation (cuDNN split + merged backward, and
    FlashAttention's lower-right mode)."""
    from litespark_megatron.layers import prefix_attention

    dtype = torch.float64 if device == "cpu" else torch.bfloat16
    sq, sk, b, heads, groups, d = 128, 384, 2, 8, 2, 64
    q = torch.randn(sq, b, heads, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(sk, b, groups, d, dtype=dtype, device=device, requires_grad=True) for _ in range(2))
    assert prefix_attention.prefix_causal_impl(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                               0.0) == ("sdpa-mask" if device == "cpu" else "cudnn-split")
    monkeypatch.setattr(prefix_attention, "prefix_causal_impl", lambda *a: impl)
    out = _core_attention(d)._attend(q, k, v)  # [b, h, sq, d]
    got = out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)
    dout = torch.randn_like(got)
    grads = torch.autograd.grad(got, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _explicit_attention(q64, k64, v64)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tol = {} if device == "cpu" else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), ref, **tol)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, **tol, msg=lambda m: f"d{name}: {m}")
    # The first query sees sk - sq + 1 keys, not 1: a top-left causal mask would give another answer.
    top_left = _core_attention(d)._attend(q, k[:sq], v[:sq]).permute(2, 0, 1, 3).reshape(sq, b, heads * d)
    assert (top_left.double() - got.double()).abs().max() > 0.1


@CUDA
@pytest.mark.gpu
def test_prefix_attention_falls_back_where_cudnn_cannot_run():
    from litespark_megatron.layers.prefix_attention import prefix_causal_impl

    q = torch.randn(2, 8, 128, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(2, 2, 384, 64, device="cuda", dtype=torch.bfloat16)
    assert prefix_causal_impl(q, k, k, 0.0) == "cudnn-split"
    assert prefix_causal_impl(q, k, k, 0.1) == "sdpa-lower-right"  # attention dropout: cuDNN split has none
    assert prefix_causal_impl(q.float(), k.float(), k.float(), 0.0) == "sdpa-lower-right"  # fp32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels run on CUDA only")
def test_swiglu_uses_te_where_te_is_installed():
    from litespark_megatron.platform import te_importable

    assert elementwise.swiglu_impl("cuda") == ("te" if te_importable() else "compiled")
    assert elementwise.swiglu_impl("cpu") == "reference"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels run on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_match_reference_on_cuda(dtype):
    tol = dict(atol=1e-2, rtol=1e-2) if dtype == torch.bfloat16 else {}
    x = torch.randn(64, 3, 256, device="cuda", dtype=dtype, requires_grad=True)
    dy = torch.randn(64, 3, 128, device="cuda", dtype=dtype)
    y = elementwise.swiglu(x)
    (dx,) = torch.autograd.grad(y, x, dy)
    y_ref = elementwise.swiglu_reference(x)
    (dx_ref,) = torch.autograd.grad(y_ref, x, dy)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(dx, dx_ref, **tol)
    x = x.detach()
    w = torch.randn(256, device="cuda", dtype=dtype)
    torch.testing.assert_close(elementwise.rms_norm(x, w, 1e-5), elementwise.rms_norm_reference(x, w, 1e-5), **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fused kernels run on CUDA only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_matches_reference_on_a_gpu_without_te(dtype, monkeypatch):
    from megatron.core.models.common.embeddings import rope_utils

    s, b, h, d = 256, 2, 4, 64
    t = torch.randn(s, b, h, d, device="cuda", dtype=dtype, requires_grad=True)
    freqs = torch.rand(s, 1, 1, d, device="cuda") * 100
    dy = torch.randn(s, b, h, d, device="cuda", dtype=dtype)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)  # as on a GPU without TE
    assert elementwise.rope_impl(t, _rope_config()) == "compiled"
    y = elementwise.rope(t, freqs, _rope_config())
    (dt,) = torch.autograd.grad(y, t, dy)
    # The truth in float64 from the same inputs: the compiled kernel rounds once at its end, the eager reference
    # after every op, so in bf16 each is compared with the truth (a few bf16 steps), not with the other.
    t64 = t.detach().double().requires_grad_()
    y64 = elementwise.rope_reference(t64, freqs.double())
    (dt64,) = torch.autograd.grad(y64, t64, dy.double())
    tol = dict(atol=3e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for out, grad in ((y, dt), (elementwise.rope_reference(t, freqs), None)):
        torch.testing.assert_close(out.double(), y64, **tol)
        if grad is not None:
            torch.testing.assert_close(grad.double(), dt64, **tol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="TE's fused RoPE runs on CUDA only")
def test_rope_fusion_follows_te_and_the_flag_on_both_backends():
    """Megatron-LM's own RoPE-fusion setting (on unless --no-rope-fusion; validation turns it off where TE has no
    fused RoPE) reaches the model config on both backends, which the Litespark layer follows."""
    pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    from megatron.training.arguments import core_transformer_config_from_args

    from litespark_megatron import arguments, platform

    plat = platform.detect()
    run = ["--model", "tiny", "--bf16", "--mock-data", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
           "1", "--eval-interval", "1"]
    for impl in ("transformer_engine", "local"):
        for extra, fused in (([], True), (["--no-rope-fusion"], False)):
            args = arguments.resolve(run + ["--transformer-impl", impl, *extra], plat)
            arguments.megatron_validate(args)
            assert core_transformer_config_from_args(args).apply_rope_fusion is fused, (impl, extra)
