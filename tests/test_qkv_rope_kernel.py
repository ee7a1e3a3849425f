"""Litespark's QKV split + RoPE (kernels/qkv_rope.py): the reference is megatron-core's split and RoPE; the Triton
kernels equal the reference (through Triton's interpreter on the CPU, compiled on a GPU), the outputs and the
projection's gradient, over group sizes (MHA, GQA, MQA-like TP shards), head sizes, distinct query and key angles;
--litespark-rope trains what megatron-core's path trains, says so, and is refused where the kernel does not cover
the model. The backward that writes the QKV GEMM's FP8 output gradient (--litespark-rope-fp8-grad): the reference's
bytes in both layouts, its amax and 1 / scale (interpreted and compiled), the reference being the gradient's hand
formula quantized; the layer's row bookkeeping; the flag's refusals; an FP8 run with it trains as without."""

import pytest
import torch

from conftest import child_env, free_port, losses, ok, records, run_interpreted, train
from test_arguments import GPU_TE, TINY, check
from test_swiglu_fp8_kernel import FP8_RUN, _bytes_agree
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


# The FP8 backward against its reference over the shapes (one with many tokens per program's 32 and a ragged last
# block), both formats, fp32 and bf16 gradients, scales that keep, flush to subnormal and saturate: bytes that differ
# (and by how many FP8 steps), layouts that are not each other's transpose, amax's relative error.
FP8_INTERPRETED = """
import json, torch
from litespark_megatron.kernels import qkv_rope as qr

SHAPES = %r + ((11, 3, 1, 4, 64, False),)
result = {"mismatched": 0, "elements": 0, "max_step": 0, "layouts_agree": True, "amax_err": 0.0,
          "scale_inv_exact": True, "saturated": True}
torch.manual_seed(0)
for dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
    for i, (s, b, groups, p, d, own_key_angles) in enumerate(SHAPES):
        # every shape from bf16 gradients at scales that keep and that flush to subnormal; the first from fp32 too,
        # and saturating (the interpreter is slow: the cases that add nothing per shape run once)
        for gdtype in (torch.float32, torch.bfloat16) if i == 0 else (torch.bfloat16,):
            for spread, scale in ((1.0, 3e3), (1e-3, 1.0)) + (((1.0, 1e30),) if i == 0 else ()):
                half = torch.rand(s, 1, 1, d // 2) * 60
                q_freqs = torch.cat([half, half], dim=-1)
                k_freqs = torch.rand(s, 1, 1, d) * 60 if own_key_angles else q_freqs
                grads = [(torch.randn(s, b, n, d) * spread).to(gdtype) for n in (groups * p, groups, groups)]
                a1, a2 = torch.tensor([0.25]), torch.tensor([0.25])
                got = qr.qkv_rope_grad_fp8_triton(*grads, q_freqs, k_freqs, p, torch.tensor([scale]), a1, dtype)
                want = qr.qkv_rope_grad_fp8_reference(*grads, q_freqs, k_freqs, p, torch.tensor([scale]), a2, dtype)
                g, w = got[0].view(torch.uint8), want[0].view(torch.uint8)
                assert g.shape == (s * b, groups * (p + 2) * d), g.shape
                result["mismatched"] += (g != w).sum().item()
                result["elements"] += g.numel()
                result["max_step"] = max(result["max_step"], (g.int() - w.int()).abs().max().item())
                result["layouts_agree"] &= torch.equal(got[1].view(torch.uint8), g.t())
                result["amax_err"] = max(result["amax_err"], abs(a1.item() - a2.item()) / a2.item())
                result["scale_inv_exact"] &= torch.equal(got[2], want[2])
                if scale == 1e30:
                    top = torch.finfo(dtype).max
                    result["saturated"] &= set(got[0].float().abs().unique().tolist()) <= {0.0, top}
print(json.dumps(result))
""" % (SHAPES,)


@pytest.fixture(scope="module")
def fp8_interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "qkv-rope-fp8-interpreted", FP8_INTERPRETED)


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


def test_the_fp8_backward_writes_the_references_bytes_in_both_layouts(fp8_interpreted):
    """Every byte the reference's (integer conversion, the same fp32 products and sums), the two layouts each other's
    transpose, amax and 1 / scale the reference's, saturation at the format's largest finite value."""
    r = fp8_interpreted
    assert r["elements"] > 0 and r["mismatched"] == 0 and r["max_step"] == 0, r
    assert r["layouts_agree"] and r["scale_inv_exact"] and r["saturated"] and r["amax_err"] <= 1e-6, r


def test_the_gradients_reference_is_the_inverse_rotation():
    """qkv_rope_grad_reference (autograd of the reference) against the rotation's transpose written out in fp64:
    first half g1 cos + g2 sin, second half g2 cos - g1 sin, the value's gradient as it is, laid out as the
    projection's [s * b, groups * (heads_per_group + 2) * d] output; and its FP8 reference is it quantized."""
    torch.manual_seed(0)
    for s, b, groups, p, d, own_key_angles in SHAPES:
        q_freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60
        k_freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60 if own_key_angles else q_freqs
        dq, dk, dv = (torch.randn(s, b, n, d, dtype=torch.float64) for n in (groups * p, groups, groups))

        def back(g, freqs):
            c, sn = torch.cos(freqs), torch.sin(freqs)
            g1, g2 = g.chunk(2, dim=-1)
            c1, c2 = c.chunk(2, dim=-1)
            s1, s2 = sn.chunk(2, dim=-1)
            return torch.cat([g1 * c1 + g2 * s2, g2 * c2 - g1 * s1], dim=-1)

        want = torch.cat([back(dq, q_freqs).reshape(s, b, groups, p * d), back(dk, k_freqs), dv], dim=-1)
        got = qr.qkv_rope_grad_reference(dq, dk, dv, q_freqs, k_freqs, p)
        assert got.dtype == torch.float32 and got.shape == (s * b, groups * (p + 2) * d)
        assert (got.double() - want.reshape(s * b, -1)).abs().max().item() <= 1e-5
        amax = torch.zeros(1)
        row, col, scale_inv = qr.qkv_rope_grad_fp8_reference(dq, dk, dv, q_freqs, k_freqs, p, torch.tensor([4.0]),
                                                              amax, torch.float8_e5m2)
        assert torch.equal(row.float(), (got * 4).to(torch.float8_e5m2).float()) and torch.equal(col, row.t())
        assert amax.item() == got.abs().max().item() and scale_inv.item() == 0.25


def test_the_layer_runs_the_projection_on_rows_and_rotates_its_split():
    """The attention's FP8-gradient path (here on the CPU: no quantizer, so the bf16 kernel's function) runs the
    QKV linear on [s * b, hidden] rows and gives the query, key and value of the linear's [s, b, groups, width]
    output, the value of megatron-core's layout; it records that no FP8 gradient was written."""
    from types import SimpleNamespace

    from litespark_megatron.layers.attention import LitesparkSelfAttention

    s, b, hidden, groups, p, d = 5, 3, 16, 2, 3, 8
    linear = torch.nn.Linear(hidden, groups * (p + 2) * d, bias=False, dtype=torch.float64)
    seen = []
    fake = SimpleNamespace(num_query_groups_per_partition=groups,
                           linear_qkv=lambda x: seen.append(x.shape) or (linear(x), None))
    x = torch.randn(s, b, hidden, dtype=torch.float64)
    freqs = torch.rand(s, 1, 1, d, dtype=torch.float64) * 60
    got = LitesparkSelfAttention._rows_and_rotate(fake, x, freqs, freqs, p)
    want = qr.qkv_rope_reference(linear(x).view(s, b, groups, -1), freqs, freqs, p)
    assert seen == [(s * b, hidden)] and fake.rope_fp8_grad_ran is False
    for g, w in zip(got, want):
        assert g.shape == w.shape and torch.equal(g, w)
    with pytest.raises(ValueError, match=r"^QKV \+ RoPE with an FP8 gradient: rows of shape \(14, 80\) for batch "
                                         r"3 and 2 query groups; it takes \[s \* batch, groups \* width\]$"):
        qr.qkv_rope_fp8_grad(torch.zeros(14, 80), 3, 2, freqs, freqs, p, None)


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


FP8_TE = TINY + ["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid"]


@pytest.mark.parametrize("flags, message", [
    (FP8_TE + ["--no-litespark-rope"], "--litespark-rope-fp8-grad is the RoPE kernel's backward: it needs "
                                       "--litespark-rope (on by default where the kernels were measured)"),
    (TINY + ["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16"],
     "--litespark-rope-fp8-grad writes Transformer Engine's FP8 tensors: it needs --fp8-format on the te backend "
     "(--transformer-impl transformer_engine)"),
    (FP8_TE + ["--fp8-recipe", "tensorwise"], "--litespark-rope-fp8-grad writes delayed-scaling FP8 (--fp8-recipe "
                                              "delayed), and the recipe is tensorwise; drop one"),
    (FP8_TE + ["--tensor-model-parallel-size", "2"], "--litespark-rope-fp8-grad with --tensor-model-parallel-size > "
                                                     "1: not tested together yet; drop one"),
    (FP8_TE + ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1",
               "--no-litespark-swiglu"],
     "--litespark-rope-fp8-grad with --recompute-granularity full: not tested together yet; drop one"),
])
def test_the_fp8_gradient_is_refused_where_it_has_no_fp8_gradient_to_write(flags, message, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: True)
    with pytest.raises(ConfigError) as e:
        check(flags + ["--litespark-rope-fp8-grad"], GPU_TE)
    assert str(e.value) == message
    args = check(FP8_TE + ["--litespark-rope-fp8-grad"], GPU_TE)  # accepted where it has one; off unless given
    assert args.litespark_rope and args.litespark_rope_fp8_grad
    assert check(FP8_TE, GPU_TE).litespark_rope_fp8_grad is None


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
    fp8 = get_litespark_layer_spec("te", rope="litespark-fp8-grad").submodules.self_attention
    assert fp8.params["rope_kernel"] == "litespark-fp8-grad"
    with pytest.raises(ConfigError, match="^unknown Litespark RoPE 'fast'; choose 'default', 'litespark' or "
                                          "'litespark-fp8-grad'$"):
        get_litespark_layer_spec("te", rope="fast")
    with pytest.raises(ValueError, match="^unknown RoPE kernel 'fast'; choose one of default, litespark, "
                                         "litespark-fp8-grad$"):
        LitesparkSelfAttention(None, None, 1, rope_kernel="fast")


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on CUDA")
def test_the_compiled_fp8_backward_writes_the_references_bytes_on_the_gpu():
    """llama-3b's attention at 4,096 tokens (8 groups of 3 query heads of 128, Llama 3's angles) and an odd shape
    (37 x 3 tokens, 2 groups of 4 heads of 64, the key's own angles), bf16 gradients, both formats: the reference's
    bytes in both layouts, its amax and 1 / scale."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for s, b, groups, p, d, own_key_angles in ((2048, 2, 8, 3, 128, False), (37, 3, 2, 4, 64, True)):
        inv = 500000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
        half = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
        q_freqs = torch.cat([half, half], dim=-1).view(s, 1, 1, d)
        k_freqs = torch.rand(s, 1, 1, d, device="cuda", generator=g) * 60 if own_key_angles else q_freqs
        grads = [(torch.randn(s, b, n, d, device="cuda", generator=g) * 1e-3).to(torch.bfloat16)
                 for n in (groups * p, groups, groups)]
        for dtype, scale in ((torch.float8_e5m2, 3e3), (torch.float8_e4m3fn, 100.0)):
            a1, a2 = torch.zeros(1, device="cuda"), torch.zeros(1, device="cuda")
            sc = torch.tensor([scale], device="cuda")
            got = qr.qkv_rope_grad_fp8_triton(*grads, q_freqs, k_freqs, p, sc, a1, dtype)
            want = qr.qkv_rope_grad_fp8_reference(*grads, q_freqs, k_freqs, p, sc, a2, dtype)
            assert _bytes_agree(got[0], want[0]) and _bytes_agree(got[1], want[1]), (s, b, dtype)
            assert torch.equal(got[1], got[0].t().contiguous())
            assert abs(a1.item() - a2.item()) <= 1e-6 * a2.item() and torch.equal(got[2], want[2])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FP8 runs on a GPU with FP8 tensor cores")
def test_an_fp8_run_with_the_fp8_gradient_trains_as_without_says_so_and_resumes_bit_exactly(tmp_path):
    """Six FP8 steps with --litespark-rope-fp8-grad against the RoPE kernel's bf16 gradient, which TE casts: the
    same losses to FP8's rounding (the kernel casts the fp32 gradient where TE casts its bf16 rounding), the record
    names it, and a run stopped at step 3 and resumed equals the uninterrupted one bit for bit (the gradient's
    scaling state is the QKV linear's, in its checkpoint)."""
    pytest.importorskip("transformer_engine.pytorch")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 needs compute capability 8.9 or more")

    def env():
        return child_env(MASTER_PORT=free_port())
    default, straight, halves = tmp_path / "default", tmp_path / "straight", tmp_path / "halves"
    fp8_grad = ("--litespark-rope", "--litespark-rope-fp8-grad")
    ok(train(1, *FP8_RUN, "--litespark-rope", "--save", default, env=env()))
    ok(train(1, *FP8_RUN, *fp8_grad, "--save", straight, env=env()))
    ok(train(1, *FP8_RUN, *fp8_grad, "--save", halves, "--load", halves, "--exit-interval", "3", env=env()))
    ok(train(1, *FP8_RUN, *fp8_grad, "--save", halves, "--load", halves, env=env()))
    base, fast, resumed = (losses(d / "metrics.jsonl") for d in (default, straight, halves))
    assert sorted(fast) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert [fast[s] for s in range(1, 7)] == [resumed[s] for s in range(1, 7)], (fast, resumed)
    assert all(abs(fast[s] - base[s]) <= 1e-2 * abs(base[s]) for s in range(1, 7)), (fast, base)
    health = [r for r in records(straight / "metrics.jsonl") if r["kind"] == "health"][0]
    assert health["fusions"]["rope"] == "litespark fp8 grad" and not health["degraded"], health
    assert [r for r in records(default / "metrics.jsonl") if r["kind"] == "health"][0]["fusions"]["rope"] == \
        "litespark"
