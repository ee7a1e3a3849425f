"""One kernel against the stock ones it replaces, at a model's shapes: time, bandwidth and error, side by side.

    python tools/kernel_bench.py --kernel rms-norm --hidden 3072 --tokens 16384
    python tools/kernel_bench.py --kernel qkv-rope --model llama-3b --micro-batch-size 4 --json
    python tools/kernel_bench.py --kernel swiglu-fp8 --model llama-3b
    python tools/kernel_bench.py --kernel fp8-logits --model llama-3b --tokens 8192
    python tools/kernel_bench.py --kernel adam --model llama-3b --moments bf16
    python tools/kernel_bench.py --kernel int4-linear --model llama-1b --rows 1 --rows 8 --rows 32

Each candidate runs the same inputs forward, and forward+backward, two ways: under triton.testing.do_bench (the L2
flushed between repeats, the median of its repeats: the time a caller waits, the host's launch work included, which
a short kernel's backward through autograd can exceed), and under torch.profiler (the GPU time of its kernels alone:
what a training step pays, where the host runs ahead of the GPU). The row gives both, the bytes each pass must move
over the kernels' time (GB/s: a memory-bound kernel's grade), and its largest difference from the reference computed
in fp64 (relative to the reference's largest value), outputs and gradients, so a fast row that is wrong shows it. A
candidate that cannot run here (no Transformer Engine, no Triton) is a row saying why, never a number.

`--kernel adam` times one optimizer step over a model's parameters instead (the step has no forward), as
megatron-core's precision-aware optimizer holds them (bf16 parameters with their master weights' remainders, bf16
main gradients, --moments bf16 or fp32): Transformer Engine's FusedAdam against Litespark's step
(--litespark-adam), the bytes the step must move over its kernels' time, and the share of elements whose master
weight differs in any bit from the plain-torch reference's after one step.

`--kernel int4-linear` times decode's matrix products (a few rows of activations, --rows) by each linear layer of a
model's blocks: torch's bf16 GEMM against Litespark's int4 layer (kernels/int4_linear.py), the weight bytes each must
read over its kernels' time, and the int4 result's largest difference from its reference.
"""
from __future__ import annotations

import json
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

from litespark_megatron.apps import cli
from litespark_megatron.presets import PRESETS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# A builder takes the run's leaves (tensors that get gradients, already on the GPU) and returns fn() -> the
# candidate's outputs (a tuple) and the leaves whose gradients it computes, or raises Unavailable with the reason.
class Unavailable(Exception):
    pass


# ---------------------------------------------------------------------------------------------- RMSNorm
def _rms_litespark(eps, x, w):
    from litespark_megatron.kernels import rms_norm as rn
    if rn.rms_norm_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    return (lambda: (rn.rms_norm_triton(x, w, eps),)), (x, w)


def _rms_te(eps, x, w):
    te = _import_te()
    module = te.RMSNorm(w.numel(), eps=eps, params_dtype=w.dtype, device="cuda")
    with torch.no_grad():
        module.weight.copy_(w)
    return (lambda: (module(x),)), (x, module.weight)


def _rms_compiled(eps, x, w):
    from litespark_megatron.layers import elementwise
    return (lambda: (elementwise.rms_norm(x, w, eps),)), (x, w)


def _rms_eager(eps, x, w):
    from litespark_megatron.kernels.rms_norm import rms_norm_reference
    return (lambda: (rms_norm_reference(x, w, eps),)), (x, w)


RMS_NORM = (("litespark", _rms_litespark), ("te", _rms_te), ("torch.compile", _rms_compiled),
            ("torch eager", _rms_eager))


def bench_rms_norm(hidden: int, tokens: int, dtype: torch.dtype, eps: float = 1e-5) -> List[dict]:
    """Rows of the RMSNorm table, one per candidate: [tokens, hidden] rows and their weight."""
    from litespark_megatron.kernels.rms_norm import rms_norm_reference

    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    dy = torch.randn_like(x)
    # Bytes a pass must move at least: forward reads x, writes y; backward reads x and dy, writes dx.
    moved = (2 * x.numel() * x.element_size(), 3 * x.numel() * x.element_size())
    row = dict(kernel="rms-norm", shape=f"{tokens} x {hidden}", dtype=str(dtype).split(".")[-1])
    return [_measure(dict(row, candidate=name), build, (eps,), (x, w), (dy,),
                     lambda x64, w64: rms_norm_reference(x64, w64, eps), moved) for name, build in RMS_NORM]


# ---------------------------------------------------------------------------------------------- QKV split + RoPE
def _angles(s: int, d: int) -> torch.Tensor:
    """Llama 3's RoPE angles (base 500,000) of positions 0..s-1, [s, 1, 1, d] fp32, as megatron-core makes them."""
    inv = 500000.0 ** (-torch.arange(0, d, 2, device="cuda", dtype=torch.float32) / d)
    half = torch.outer(torch.arange(s, device="cuda", dtype=torch.float32), inv)
    return torch.cat([half, half], dim=-1).view(s, 1, 1, d)


def _rope_litespark(p, freqs, mixed):
    from litespark_megatron.kernels import qkv_rope as qr
    if qr.qkv_rope_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    return (lambda: qr.qkv_rope_triton(mixed, freqs, freqs, p)), (mixed,)


def _rope_te(p, freqs, mixed):
    """megatron-core's split (views), TE's fused RoPE on the query and key, the value made contiguous (what the
    Litespark attention does without the flag)."""
    _import_te()
    from megatron.core.models.common.embeddings.rope_utils import fused_apply_rotary_pos_emb
    if fused_apply_rotary_pos_emb is None:
        raise Unavailable("megatron-core found no fused RoPE in Transformer Engine")
    s, b, groups, width = mixed.shape
    d = width // (p + 2)

    def run():
        query, key, value = torch.split(mixed, [p * d, d, d], dim=3)
        query = query.reshape(s, b, groups * p, d)
        return (fused_apply_rotary_pos_emb(query, freqs), fused_apply_rotary_pos_emb(key, freqs),
                value.contiguous())
    return run, (mixed,)


def _rope_eager(p, freqs, mixed):
    from litespark_megatron.kernels.qkv_rope import qkv_rope_reference
    return (lambda: qkv_rope_reference(mixed, freqs, freqs, p)), (mixed,)


QKV_ROPE = (("litespark", _rope_litespark), ("megatron split + te RoPE", _rope_te), ("torch eager", _rope_eager))


def bench_qkv_rope(heads: int, groups: int, head_size: int, seq: int, batch: int, dtype: torch.dtype) -> List[dict]:
    """Rows of the QKV split + RoPE table: the projection's [seq, batch, groups, (heads / groups + 2) * d] output."""
    from litespark_megatron.kernels.qkv_rope import qkv_rope_reference

    torch.manual_seed(0)
    p = heads // groups
    mixed = torch.randn(seq, batch, groups, (p + 2) * head_size, device="cuda", dtype=dtype)
    freqs = _angles(seq, head_size)
    upstream = (torch.randn(seq, batch, heads, head_size, device="cuda", dtype=dtype),
                torch.randn(seq, batch, groups, head_size, device="cuda", dtype=dtype),
                torch.randn(seq, batch, groups, head_size, device="cuda", dtype=dtype))
    moved = (2 * mixed.numel() * mixed.element_size(),) * 2  # each way: the buffer read once, written once

    def reference(m):
        return qkv_rope_reference(m, freqs.double(), freqs.double(), p)
    row = dict(kernel="qkv-rope", shape=f"{seq} x {batch} x {groups} x ({p} + 2) x {head_size}",
               dtype=str(dtype).split(".")[-1])
    return [_measure(dict(row, candidate=name), build, (p, freqs), (mixed,), upstream, reference, moved)
            for name, build in QKV_ROPE]


# ---------------------------------------------------------------------------------------------- FP8 SwiGLU
# The MLP's activation under FP8 is two passes that autograd does not join (fc2 takes the forward's FP8 tensor, fc1's
# backward the backward's), so each candidate gives both passes and how to read its FP8 result as values.
def _swiglu_litespark(x, dy):
    from litespark_megatron.kernels import swiglu_fp8 as sf
    if sf.swiglu_fp8_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    scale, amax = torch.ones(1, device="cuda"), torch.zeros(1, device="cuda")
    return (lambda: sf.swiglu_fp8_triton(x, scale, amax, torch.float8_e4m3fn),
            lambda: sf.dswiglu_fp8_triton(dy, x, scale, amax, torch.float8_e5m2),
            lambda out: out[0].float() * out[2])


def _swiglu_te(x, dy, fused: bool):
    """TE's kernels: its bf16 SwiGLU pair, each result cast to FP8 row- and column-major by a TE quantizer (the
    Litespark MLP without the flag, fc2 and fc1 casting); `fused`: TE's SwiGLU writing row-major FP8 and the
    transpose after it (its op fuser's path on Hopper)."""
    _import_te()
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def quantizer(dtype):
        return Float8Quantizer(torch.ones(1, device="cuda"), torch.zeros(1, device="cuda"), dtype,
                               rowwise=True, columnwise=not fused)
    forward_q, backward_q = quantizer(tex.DType.kFloat8E4M3), quantizer(tex.DType.kFloat8E5M2)
    if fused:
        def both_layouts(q):
            q.update_usage(columnwise_usage=True)
            return q
        return (lambda: both_layouts(tex.swiglu(x, forward_q)), lambda: both_layouts(tex.dswiglu(dy, x, backward_q)),
                lambda out: out.dequantize(dtype=torch.float32))
    return (lambda: forward_q(tex.swiglu(x, None)), lambda: backward_q(tex.dswiglu(dy, x, None)),
            lambda out: out.dequantize(dtype=torch.float32))


SWIGLU_FP8 = (("litespark", _swiglu_litespark), ("te + cast/transpose", lambda x, dy: _swiglu_te(x, dy, False)),
              ("te fused cast, then transpose (op fuser)", lambda x, dy: _swiglu_te(x, dy, True)))


def bench_swiglu_fp8(ffn: int, tokens: int) -> List[dict]:
    """Rows of the FP8 SwiGLU table: [tokens, 2 * ffn] bf16 [gate | up] to FP8 (e4m3) in both layouts, and the
    backward from a bf16 [tokens, ffn] gradient to FP8 (e5m2) in both layouts. "forward+backward" is the two
    passes; the errors are the FP8 values' against fp64 (FP8's own rounding, about 2^-4 of the largest)."""
    from litespark_megatron.kernels.swiglu_fp8 import dswiglu_reference

    torch.manual_seed(0)
    x = torch.randn(tokens, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(tokens, ffn, device="cuda", dtype=torch.bfloat16)
    gate, up = x.double().chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up, dswiglu_reference(dy.double(), x.double())
    # Bytes a pass must move at least: forward reads [gate | up] and writes two FP8 layouts of f; backward reads dy
    # and [gate | up] and writes two FP8 layouts of 2f.
    moved = (2 * x.numel() + 2 * dy.numel(), 2 * dy.numel() + 2 * x.numel() + 2 * x.numel())
    rows = []
    for name, build in SWIGLU_FP8:
        row = dict(kernel="swiglu-fp8", candidate=name, shape=f"{tokens} x 2 x {ffn}", dtype="bf16 -> fp8")
        try:
            forward, backward, values = build(x, dy)
            got = values(forward()), values(backward())
        except Unavailable as e:
            rows.append(dict(row, unavailable=str(e)))
            continue

        def passes():
            forward()
            backward()
        fk, bk = _kernel_ms(forward), _kernel_ms(passes)
        rows.append(dict(row, forward_ms=_median_ms(forward), forward_kernel_ms=fk,
                         forward_backward_ms=_median_ms(passes), forward_backward_kernel_ms=bk, forward_gb_s=moved[0] / fk / 1e6,
                         forward_backward_gb_s=(moved[0] + moved[1]) / bk / 1e6,
                         error_outputs=_error(got[0], want[0]), error_gradients=_error(got[1], want[1])))
    return rows


# ---------------------------------------------------------------------------------------------- FP8 output layer
def _logits_litespark(target, h, w, seed=12345):
    """Litespark's FP8 output layer, its loss gradient rounded stochastically as in training (output_loss.py draws
    a seed per micro-batch); seed None: rounded to nearest."""
    from litespark_megatron.kernels import fp8_logits as fl
    if fl.fp8_logits_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    if torch.cuda.get_device_capability() < (8, 9):
        raise Unavailable("FP8 GEMMs need compute capability 8.9 or more")
    return (lambda: (fl.fp8_logits_loss(h, w, target, seed=seed),)), (h, w)


def _logits_bf16(target, h, w):
    """The BF16 output layer (megatron-core's GEMMs, here torch's: the same cuBLAS) and Litespark's cross-entropy,
    which writes the gradient over the logits: the Litespark default."""
    from litespark_megatron.kernels.cross_entropy import cross_entropy, cross_entropy_path
    if cross_entropy_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    return (lambda: (cross_entropy(h @ w.t(), target),)), (h, w)


FP8_LOGITS = (("litespark fp8 (GEMMs and loss gradient in FP8)", _logits_litespark),
              ("litespark fp8, gradient rounded to nearest", lambda *a: _logits_litespark(*a, seed=None)),
              ("bf16 GEMMs + litespark cross-entropy", _logits_bf16))


def bench_fp8_logits(hidden: int, vocab: int, tokens: int) -> List[dict]:
    """Rows of the output-layer table: tokens [tokens, hidden] bf16 and the weight [vocab, hidden] to the per-token
    loss, and back to both gradients (the loss's gradient 1 / tokens, a mean's). Errors against fp64; bytes are the
    logits' (written once and read once each way at least, bf16)."""
    torch.manual_seed(0)
    h = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(vocab, hidden, device="cuda") * hidden ** -0.5).to(torch.bfloat16)
    target = torch.randint(0, vocab, (tokens,), device="cuda")
    upstream = (torch.full((tokens,), 1.0 / tokens, device="cuda"),)
    moved = (4 * tokens * vocab, 4 * tokens * vocab)
    row = dict(kernel="fp8-logits", shape=f"{tokens} x {hidden} x {vocab}", dtype="bf16")

    def reference(h64, w64):
        return torch.nn.functional.cross_entropy(h64 @ w64.t(), target, reduction="none")
    return [_measure(dict(row, candidate=name), build, (target,), (h, w), upstream, reference, moved)
            for name, build in FP8_LOGITS]


# ---------------------------------------------------------------------------------------------- the harness
# ---------------------------------------------------------------------------------------------- Adam
def parameter_shapes(flags: dict) -> List[tuple]:
    """The shapes of a Llama preset's parameters on one GPU: embedding (and output layer unless tied), per layer QKV,
    projection, fc1 (gate and up), fc2 and two norms, the final norm."""
    h, ffn, layers = int(flags["hidden-size"]), int(flags["ffn-hidden-size"]), int(flags["num-layers"])
    heads = int(flags["num-attention-heads"])
    qkv = h + 2 * int(flags.get("num-query-groups", heads)) * (h // heads)
    vocab = int(flags["vocab-size"])
    outer = [(vocab, h)] * (2 if flags.get("untie-embeddings-and-output-weights") else 1) + [(h,)]
    return outer + [s for _ in range(layers) for s in ((qkv, h), (h, h), (2 * ffn, h), (h, ffn), (h,), (h,))]


def _adam_state(shapes, moments: torch.dtype, seed: int = 0):
    """bf16 parameters, bf16 gradients (`decoupled_grad`, as megatron-core hands them) in two groups, as
    megatron-core's precision-aware optimizer builds them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.nn.Parameter((torch.randn(s, device="cuda", generator=g) * 0.02).bfloat16()) for s in shapes]
    for p in params:
        p.decoupled_grad = (torch.randn(p.shape, device="cuda", generator=g) * 1e-3).bfloat16()
    groups = [{"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
              {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}]
    return params, groups, dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True, master_weights=True,
                                use_decoupled_grad=True, store_param_remainders=True, exp_avg_dtype=moments,
                                exp_avg_sq_dtype=moments)


def _adam_differs(optimizer, params, start) -> float:
    """Share of elements whose master weight differs in any bit from the reference's after the step just taken
    from `start` (zero moments, step 1)."""
    from litespark_megatron.kernels import adam as A

    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    differ = total = 0
    for p, (param0, grad) in zip(params, start):
        group, state = group_of[id(p)], optimizer.state[p]
        param, remainders = param0.clone(), torch.zeros_like(param0, dtype=torch.int16)
        m, v = (torch.zeros_like(state[n]) for n in ("exp_avg", "exp_avg_sq"))
        hyper = A.AdamHyper(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1], eps=group["eps"],
                            weight_decay=group["weight_decay"], step=1)
        A.adam_reference(param, grad, m, v, remainders, hyper, "remainders")
        got = A.master_from_remainders(p.data, state["master_param"])
        differ += int((got != A.master_from_remainders(param, remainders)).sum())
        total += p.numel()
    return differ / total


def bench_adam(flags: dict, moments: torch.dtype) -> List[dict]:
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError as e:
        return [dict(kernel="adam", candidate=c, unavailable=f"Transformer Engine does not import ({type(e).__name__})")
                for c in ("te", "litespark")]
    from litespark_megatron.kernels import adam as A
    from litespark_megatron.platform.fused_adam import litespark_fused_adam

    shapes = parameter_shapes(flags)
    n = sum(torch.Size(s).numel() for s in shapes)
    per = 2 + 4 + 4 + (8 if moments == torch.bfloat16 else 16)  # gradient read; parameter, remainder, moments r+w
    row = dict(kernel="adam", shape=f"{len(shapes)} tensors, {n / 1e9:.2f} B parameters",
               dtype=f"bf16 parameters + remainders, bf16 gradients, {str(moments)[6:]} moments")
    rows = []
    for name, cls in (("te", FusedAdam), ("litespark", litespark_fused_adam())):
        if name == "litespark" and A.adam_path("cuda") != "litespark":
            rows.append(dict(row, candidate=name, unavailable="Triton does not import here"))
            continue
        params, groups, kwargs = _adam_state(shapes, moments)
        start = [(p.detach().clone(), p.decoupled_grad.clone()) for p in params]
        optimizer = cls(groups, **kwargs)
        optimizer.step()
        differs = _adam_differs(optimizer, params, start)
        del start
        ms, kernel_ms = _median_ms(optimizer.step), _kernel_ms(optimizer.step)
        rows.append(dict(row, candidate=name, step_ms=ms, step_kernel_ms=kernel_ms, gb_s=n * per / kernel_ms / 1e6,
                         master_bits_differ=differs))
        del optimizer, params, groups
        torch.cuda.empty_cache()
    return rows


def render_adam(rows: Sequence[dict]) -> str:
    return _table("| kernel | candidate | parameters | dtype | step: kernels ms / GB/s / wall ms | master weights "
                  "differing from the reference |", rows,
                  lambda r: f"{r['step_kernel_ms']:.2f} / {r['gb_s']:,.0f} / {r['step_ms']:.2f} | "
                            f"{r['master_bits_differ']:.3%}")


# ---------------------------------------------------------------------------------------------- int4 linear
def linear_shapes(flags: dict) -> List[tuple]:
    """(name, out, in) of a Llama block's linear layers: QKV, projection, fc1 (gate and up), fc2."""
    h, ffn, heads = int(flags["hidden-size"]), int(flags["ffn-hidden-size"]), int(flags["num-attention-heads"])
    qkv = h + 2 * int(flags.get("num-query-groups", heads)) * (h // heads)
    return [("qkv", qkv, h), ("proj", h, h), ("fc1", 2 * ffn, h), ("fc2", h, ffn)]


def bench_int4_linear(flags: dict, rows_list: Sequence[int]) -> List[dict]:
    from litespark_megatron.kernels import int4_linear as L

    out = []
    for name, n, k in linear_shapes(flags):
        g = torch.Generator(device="cuda").manual_seed(0)
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        packed, scale, zero = L.quantize_int4(w)
        int4_bytes = sum(t.numel() * t.element_size() for t in (packed, scale, zero))
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
            row = dict(kernel="int4-linear", shape=f"{name} {rows} x {k} -> {n}", dtype="bf16 activations")

            def dense():
                return torch.nn.functional.linear(x, w)

            def int4():
                return L.int4_linear(x, packed, scale, zero)
            kernel_ms = _kernel_ms(dense)
            out.append(dict(row, candidate="torch bf16", step_ms=_median_ms(dense), step_kernel_ms=kernel_ms,
                            gb_s=w.numel() * 2 / kernel_ms / 1e6, error=0.0))
            if L.int4_path("cuda") != "litespark":
                out.append(dict(row, candidate="litespark int4", unavailable="Triton does not import here"))
                continue
            want = x.double() @ L.dequantize_int4(packed, scale, zero).to(torch.bfloat16).double().t()
            kernel_ms = _kernel_ms(int4)
            out.append(dict(row, candidate="litespark int4", step_ms=_median_ms(int4), step_kernel_ms=kernel_ms,
                            gb_s=int4_bytes / kernel_ms / 1e6,
                            error=float((int4().double() - want).abs().max() / want.abs().max())))
    return out


def render_products(rows: Sequence[dict]) -> str:
    return _table("| kernel | candidate | product | dtype | kernels ms / weight GB/s / wall ms | error (vs fp64) |",
                  rows, lambda r: f"{r['step_kernel_ms']:.4f} / {r['gb_s']:,.0f} / {r['step_ms']:.4f} | "
                                  f"{r['error']:.1e}")


def _import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise Unavailable(f"Transformer Engine does not import ({e.__class__.__name__})") from None
    return te


def _median_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _kernel_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU time of the kernels of one call, from torch.profiler over `calls` calls."""
    from litespark_megatron.apps.profile import profile_steps
    return profile_steps(fn, calls, cuda=True)["kernel_ms_per_step"]


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference from the fp64 reference, relative to the reference's largest value."""
    want = want.detach()
    return float((got.detach().double() - want).abs().max() / want.abs().max())


def _measure(row: dict, build, settings: tuple, inputs: tuple, upstream: tuple, reference, moved) -> dict:
    """One candidate: `build(*settings, *leaves)` on fresh leaves of `inputs`; its outputs and the leaves' gradients
    (for `upstream`) against `reference(*inputs in fp64)`; forward and forward+backward timed both ways."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    try:
        run, grad_of = build(*settings, *leaves)
    except Unavailable as e:
        return dict(row, unavailable=str(e))
    outputs = run()
    grads = torch.autograd.grad(outputs, grad_of, upstream)
    wide = [t.detach().double().requires_grad_() for t in inputs]
    want = reference(*wide)
    want = want if isinstance(want, tuple) else (want,)
    want_grads = torch.autograd.grad(want, wide, [u.double() for u in upstream])
    with torch.no_grad():
        forward, forward_kernels = _median_ms(run), _kernel_ms(run)

    def forward_backward():
        for t in grad_of:
            t.grad = None
        torch.autograd.backward(run(), upstream)
    both, both_kernels = _median_ms(forward_backward), _kernel_ms(forward_backward)
    return dict(row, forward_ms=forward, forward_kernel_ms=forward_kernels, forward_backward_ms=both,
                forward_backward_kernel_ms=both_kernels, forward_gb_s=moved[0] / forward_kernels / 1e6,
                forward_backward_gb_s=(moved[0] + moved[1]) / both_kernels / 1e6,
                error_outputs=max(_error(g, w) for g, w in zip(outputs, want)),
                error_gradients=max(_error(g, w) for g, w in zip(grads, want_grads)))


def _table(header: str, rows: Sequence[dict], cells: Callable[[dict], str]) -> str:
    """A markdown table: the kernel, candidate, shape and dtype of each row, then `cells(row)`, or why it did not
    run (the header's other columns left empty)."""
    columns = header.count("|") - 1
    lines = [header, "|" + "---|" * columns]
    for r in rows:
        head = f"| {r['kernel']} | {r['candidate']} | {r.get('shape', '')} | {r.get('dtype', '')} |"
        if "unavailable" in r:
            lines.append(f"{head} not run: {r['unavailable']} |" + " |" * (columns - 5))
        else:
            lines.append(f"{head} {cells(r)} |")
    return "\n".join(lines)


def render(rows: Sequence[dict]) -> str:
    return _table("| kernel | candidate | shape | dtype | forward: kernels ms / GB/s / wall ms | "
                  "forward+backward: kernels ms / GB/s / wall ms | error outputs / gradients (vs fp64) |", rows,
                  lambda r: f"{r['forward_kernel_ms']:.3f} / {r['forward_gb_s']:,.0f} / {r['forward_ms']:.3f} | "
                            f"{r['forward_backward_kernel_ms']:.3f} / {r['forward_backward_gb_s']:,.0f} / "
                            f"{r['forward_backward_ms']:.3f} | {r['error_outputs']:.1e} / {r['error_gradients']:.1e}")


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="kernel_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=["rms-norm", "qkv-rope", "swiglu-fp8", "fp8-logits", "adam", "int4-linear"],
                   default="rms-norm")
    p.add_argument("--model", choices=sorted(PRESETS), help="take the shape (hidden size, heads) from this preset")
    p.add_argument("--hidden", type=cli.positive_int, action="append",
                   help="rms-norm: hidden size (repeatable; default the --model's)")
    p.add_argument("--tokens", type=cli.positive_int, default=16384,
                   help="rms-norm, swiglu-fp8, fp8-logits: rows, micro-batch x sequence length (default 16384, "
                        "llama-3b's micro-batch 4 x 4096)")
    p.add_argument("--seq-length", type=cli.positive_int, default=4096, help="qkv-rope: sequence length")
    p.add_argument("--micro-batch-size", type=cli.positive_int, default=4, help="qkv-rope: micro-batch")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--rows", type=cli.positive_int, action="append",
                   help="int4-linear: rows of activations, decode's batch (repeatable; default 1, 8 and 32)")
    p.add_argument("--moments", choices=("bf16", "fp32"), default="bf16",
                   help="adam: the moments' dtype (--exp-avg-dtype and --exp-avg-sq-dtype)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines instead of a table")
    return p


def _refuse(message: str, see_help: bool = True) -> int:
    print(f"kernel_bench.py: error: {message}{' (see --help)' if see_help else ''}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    flags = PRESETS[opts.model].flags if opts.model else {}
    hidden = list(opts.hidden or []) or ([int(flags["hidden-size"])] if flags else [])
    if opts.kernel == "rms-norm" and not hidden:
        return _refuse("give --hidden N or --model NAME")
    if opts.kernel in ("qkv-rope", "swiglu-fp8", "fp8-logits", "adam", "int4-linear") and not flags:
        what = {"qkv-rope": "heads, query groups and head size", "swiglu-fp8": "FFN size",
                "fp8-logits": "hidden size and vocabulary", "adam": "parameters' shapes",
                "int4-linear": "linear layers' shapes"}[opts.kernel]
        return _refuse(f"--kernel {opts.kernel} takes its {what} from --model NAME")
    if not torch.cuda.is_available():
        return _refuse("no CUDA device here; the kernels it compares run on a GPU", see_help=False)
    rows: List[Dict] = []
    if opts.kernel == "rms-norm":
        for h in hidden:
            rows += bench_rms_norm(h, opts.tokens, DTYPES[opts.dtype])
    elif opts.kernel == "swiglu-fp8":
        rows += bench_swiglu_fp8(int(flags["ffn-hidden-size"]), opts.tokens)
    elif opts.kernel == "fp8-logits":
        rows += bench_fp8_logits(int(flags["hidden-size"]), int(flags["vocab-size"]), opts.tokens)
    elif opts.kernel == "adam":
        rows += bench_adam(flags, DTYPES[opts.moments])
    elif opts.kernel == "int4-linear":
        rows += bench_int4_linear(flags, opts.rows or [1, 8, 32])
    else:
        heads = int(flags["num-attention-heads"])
        rows += bench_qkv_rope(heads, int(flags.get("num-query-groups", heads)),
                               int(flags["hidden-size"]) // heads, opts.seq_length, opts.micro_batch_size,
                               DTYPES[opts.dtype])
    table = {"adam": render_adam, "int4-linear": render_products}.get(opts.kernel, render)(rows)
    print("\n".join(json.dumps(r) for r in rows) if opts.json else
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + table)
    return 0
