"""Litespark's QKV split + RoPE (kernels/qkv_rope.py): the reference is megatron-core's split and RoPE; the Triton
kernels equal the reference (through Triton's interpreter on the CPU, compiled on a GPU), the outputs and the
projection's gradient, over group sizes (MHA, GQA, MQA-like TP shards), head sizes, distinct query and key angles;
--litespark-rope trains what megatron-core's path trains, says so, and is refused where the kernel does not cover
the model."""

import pytest
import torch

from conftest import ok, records, run_interpreted, train
from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError
import litespark_megatron.kernels
from litespark_megatron.kernels import qkv_rope as qr, triton_available

# (s, b, groups, heads per group, head size, the key's own angles): a TP shard holds whole groups, so these cover
# TP splits too (llama-3b's 24 heads / 8 groups over TP 2: 4 groups of 3 heads).
SHAPES = ((3, 2, 2, 3, 16, False), (5, 1, 1, 1, 8, True), (2, 3, 4, 2, 32, False), (1, 2, 3, 4, 64, False))

# Largest differences of the Triton path from the fp64 reference, relative to the reference's largest value.
INTERPRETED = """
import json, torch
from litespark_megatron.kernels import qkv_rope as qr

SHAPES = %r
worst = {}
torch.manual_seed(0)
for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
    for s, b, groups, p, d, own_key_angles in SHAPES:
        mixed = torch.randn(s, b, groups, (p + 2) * d).to(dtype).requires_grad_()
        half = torch.rand(s, 1, 1, d // 2) * 60  # positions far apart: large angles
        q_freqs = torch.cat([half, half], dim=-1)
        k_freqs = torch.rand(s, 1, 1, d) * 60 if own_key_angles else q_freqs
        outs = qr.qkv_rope_triton(mixed, q_freqs, k_freqs, p)
        grads = [torch.randn_like(o) for o in outs]
        (got_grad,) = torch.autograd.grad(outs, (mixed,), grads)
        m64 = mixed.detach().double().requires_grad_()
        ref = qr.qkv_rope_reference(m64, q_freqs.double(), k_freqs.double(), p)
        (ref_grad,) = torch.autograd.grad(ref, (m64,), [g.double() for g in grads])
        for key, got, want in (("q", outs[0], ref[0]), ("k", outs[1], ref[1]), ("v", outs[2], ref[2]),
                               ("grad", got_grad, ref_grad)):
            assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous(), (key, got.shape)
            err = ((got.double() - want).abs().max() / want.abs().max()).item()
            worst[f"{name}_{key}"] = max(worst.get(f"{name}_{key}", 0.0), err)
print(json.dumps(worst))
""" % (SHAPES,)


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "qkv-rope-interpreted", INTERPRETED)


def test_reference_is_megatron_cores_split_and_rope():
    """megatron-core's split of the QKV output (the group's query heads, then key, then value) and its unfused RoPE,
    in fp64, give the reference's query, key and value."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    torch.manual_seed(0)
    for s, b, groups, p, d, own_key_angles in SHAPES:
        mixed = torch.randn(s, b, groups, (p + 2) * d, dtype=torch.float64)
        q_freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60
        k_freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60 if own_key_angles else q_freqs
        query, key, value = torch.split(mixed, [p * d, d, d], dim=3)
        want = (_apply_rotary_pos_emb_bshd(query.reshape(s, b, groups * p, d), q_freqs),
                _apply_rotary_pos_emb_bshd(key, k_freqs), value)
        for got, expected in zip(qr.qkv_rope_reference(mixed, q_freqs, k_freqs, p), want):
            assert got.shape == expected.shape and (got - expected).abs().max().item() <= 1e-12


def test_triton_kernels_equal_the_reference(interpreted):
    """fp32: a few fp32 roundings; bf16: one rounding of each output (Triton's interpreter truncates to bf16 where
    a GPU rounds to nearest: 2^-7 relative). The value and its gradient are copies: exact."""
    for key in ("q", "k", "grad"):
        assert interpreted[f"fp32_{key}"] <= 1e-6, interpreted
        assert interpreted[f"bf16_{key}"] <= 2 ** -7, interpreted
    assert interpreted["fp32_v"] == interpreted["bf16_v"] == 0.0, interpreted


def test_the_angle_tables_are_computed_once_per_angles_tensor_and_again_when_it_changes(monkeypatch):
    """The kernels' cos and sin tables: torch's of the angles, kept on the angles tensor (the rotary embedding hands
    the same one to every layer and step); computed again after an in-place change or at another shape; a key with
    its own angles gets its own tables."""
    calls = []
    cos = torch.cos
    monkeypatch.setattr(qr.torch, "cos", lambda t: calls.append(t.shape) or cos(t))
    s, d = 6, 8
    freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60
    first = qr._cos_sin(freqs, freqs, s, d)
    assert len(calls) == 1 and first[0] is first[2] and first[1] is first[3]
    assert torch.equal(first[0], cos(freqs.reshape(s, d).float()))
    assert torch.equal(first[1], torch.sin(freqs.reshape(s, d).float())) and first[0].dtype == torch.float32
    again = qr._cos_sin(freqs, freqs, s, d)
    assert len(calls) == 1 and all(a is b for a, b in zip(first, again))
    freqs.mul_(0.5)  # in place: the tables follow
    changed = qr._cos_sin(freqs, freqs, s, d)
    assert len(calls) == 2 and torch.equal(changed[0], cos(freqs.reshape(s, d).float()))
    qr._cos_sin(freqs, freqs, s * d, 1)  # another shape (the tensor keeps the last shape's tables)
    assert len(calls) == 3
    qr._cos_sin(freqs, freqs, s, d)
    assert len(calls) == 4
    key = torch.rand(s, 1, 1, d, dtype=torch.float64)
    own = qr._cos_sin(freqs, key, s, d)
    assert len(calls) == 5 and torch.equal(own[2], cos(key.reshape(s, d).float())) and own[0] is not own[2]


def test_the_cpu_runs_the_reference():
    mixed, freqs = torch.randn(2, 1, 2, 5 * 8), torch.rand(2, 1, 1, 8)
    assert qr.qkv_rope_path("cpu") == "litespark (reference)"
    for got, want in zip(qr.qkv_rope(mixed, freqs, freqs, 3), qr.qkv_rope_reference(mixed, freqs, freqs, 3)):
        assert torch.equal(got, want)
    assert qr.qkv_rope_path("cuda") == ("litespark" if triton_available() else "litespark (reference)")


MOCK = ["--model", "tiny", "--mock-data", "--seq-length", "32", "--vocab-size", "256", "--global-batch-size", "4",
        "--micro-batch-size", "2", "--lr", "1e-2", "--train-iters", "3", "--eval-iters", "0", "--eval-interval",
        "100", "--seed", "1234", "--log-interval", "1", "--spec", "litespark", "--transformer-impl", "local"]


@pytest.mark.parametrize("layout", [[], ["--tensor-model-parallel-size", "2", "--sequence-parallel"]])
def test_the_flag_trains_as_megatron_cores_rope_and_says_so(tmp_path, layout):
    """On the CPU the flag runs the reference: megatron-core's losses to fp32 rounding, in one process and under
    TP 2 + SP (each rank's groups); the same checkpoint keys (a run with the flag resumes one without it); the run's
    record and its first-step line name the RoPE that ran."""
    nproc = 2 if layout else 1
    off = tmp_path / "off.jsonl"
    ok(train(nproc, *MOCK, *layout, "--metrics-file", off, "--save", tmp_path / "ckpt", "--save-interval", "2",
             "--exit-interval", "2"))
    on = tmp_path / "on.jsonl"
    proc = ok(train(nproc, *MOCK, *layout, "--metrics-file", on, "--litespark-rope", "--load", tmp_path / "ckpt"))
    fresh = tmp_path / "fresh.jsonl"
    ok(train(nproc, *MOCK, *layout, "--metrics-file", fresh, "--litespark-rope"))
    default = tmp_path / "default.jsonl"
    ok(train(nproc, *MOCK, *layout, "--metrics-file", default))
    losses = {name: {r["step"]: r["loss"] for r in records(path) if r["kind"] == "train"}
              for name, path in (("off", off), ("on", on), ("fresh", fresh), ("default", default))}
    assert sorted(losses["on"]) == [3]  # resumed after step 2
    for step in (1, 2, 3):
        assert losses["fresh"][step] == pytest.approx(losses["default"][step], rel=1e-6), losses
    assert losses["on"][3] == pytest.approx(losses["default"][3], rel=1e-6), losses
    health = [r for r in records(on) if r["kind"] == "health"]
    assert health[0]["fusions"]["rope"] == "litespark (reference)", health
    assert "RoPE litespark (reference)" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--spec", "stock-local"], "--litespark-rope builds the Litespark attention's query, key and value; it needs "
                                "--spec litespark"),
    (["--position-embedding-type", "learned_absolute"], "--litespark-rope applies RoPE, and "
                                                        "--position-embedding-type is learned_absolute; drop the flag"),
    (["--multi-latent-attention"], "--litespark-rope with --multi-latent-attention: MLA splits and rotates its own "
                                   "latents; drop one"),
    (["--qk-layernorm"], "--litespark-rope with --qk-layernorm: the norms sit between the split and RoPE; drop one"),
    (["--rotary-interleaved"], "--litespark-rope with --rotary-interleaved: the kernel rotates halves (Llama's "
                               "layout); drop one"),
    (["--rotary-percent", "0.5"], "--litespark-rope with --rotary-percent 0.5: the kernel rotates the whole head; "
                                  "drop one"),
    (["--kv-channels", "24"], "--litespark-rope with a head size of 24: the kernel takes a power of two; drop the "
                              "flag"),
    (["--context-parallel-size", "2"], "--litespark-rope with --context-parallel-size > 1: not tested together yet; "
                                       "drop one"),
])
def test_the_flag_is_refused_where_the_kernel_does_not_cover_the_model(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # room for CP 2 (a world of one refuses it before the flag)
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--spec", "litespark", "--litespark-rope"] + flags)
    assert str(e.value) == message


def test_a_gpu_without_triton_is_refused(monkeypatch):
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-rope", "--spec", "litespark", "--transformer-impl", "transformer_engine",
                      "--bf16"], GPU_TE)
    assert str(e.value) == ("--litespark-rope on a GPU runs Triton kernels, and Triton does not import here: "
                            "install torch's CUDA build with its triton, or drop the flag")
    check(TINY + ["--litespark-rope", "--spec", "litespark"])  # the CPU: the reference, Triton or not


def test_the_spec_hands_the_kernel_to_the_dense_attention_only():
    from litespark_megatron.layers import LitesparkSelfAttention
    from litespark_megatron.specs import get_litespark_layer_spec

    attention = get_litespark_layer_spec("local", rope="litespark").submodules.self_attention
    assert attention.module is LitesparkSelfAttention and attention.params["rope_kernel"] == "litespark"
    assert get_litespark_layer_spec("local").submodules.self_attention.params["rope_kernel"] == "default"
    with pytest.raises(ConfigError, match="^Litespark's QKV split \\+ RoPE builds the dense GQA attention's"):
        get_litespark_layer_spec("local", multi_latent_attention=True, rope="litespark")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_triton_on_cuda_equals_the_reference():
    """llama-3b's attention at micro-batch 2 (4096 x 2 tokens, 8 groups of 3 query heads of 128) in bf16 with
    Llama 3's angles: the compiled kernels give the reference's outputs and gradient within one bf16 rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    s, b, groups, p, d = 4096, 2, 8, 3, 128
    mixed = torch.randn(s, b, groups, (p + 2) * d, device="cuda", generator=g).to(torch.bfloat16).requires_grad_()
    inv = 500000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    half = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
    freqs = torch.cat([half, half], dim=-1).view(s, 1, 1, d)
    assert qr.qkv_rope_path("cuda") == "litespark"
    outs = qr.qkv_rope(mixed, freqs, freqs, p)
    grads = [torch.randn(o.shape, device="cuda", generator=g).to(torch.bfloat16) for o in outs]
    (got,) = torch.autograd.grad(outs, (mixed,), grads)
    m64 = mixed.detach().double().requires_grad_()
    ref = qr.qkv_rope_reference(m64, freqs.double(), freqs.double(), p)
    (want,) = torch.autograd.grad(ref, (m64,), [x.double() for x in grads])
    for out, expected in ((outs[0], ref[0]), (outs[1], ref[1]), (outs[2], ref[2]), (got, want)):
        assert ((out.double() - expected).abs().max() / expected.abs().max()).item() <= 2 ** -7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the te backend's BF16 run needs a GPU")
def test_on_the_te_backend_the_kernel_trains_as_tes_rope(tmp_path):
    """te backend, BF16: three steps with the kernel follow three steps with TE's fused RoPE to the two kernels'
    rounding; the record names Litespark's kernel."""
    te = [a if a != "local" else "transformer_engine" for a in MOCK] + ["--bf16"]
    ok(train(1, *te, "--litespark-rope", "--metrics-file", tmp_path / "on.jsonl"))
    ok(train(1, *te, "--metrics-file", tmp_path / "off.jsonl"))
    on, off = (records(tmp_path / f"{name}.jsonl") for name in ("on", "off"))
    got, want = ([r["loss"] for r in rows if r["kind"] == "train"] for rows in (on, off))
    assert len(got) == 3 and all(abs(a - b) <= 1e-2 * abs(b) for a, b in zip(got, want)), (got, want)
    assert [r for r in on if r["kind"] == "health"][0]["fusions"]["rope"] == "litespark"
