"""One kernel against the stock ones it replaces, at a model's shapes: time, bandwidth and error, side by side.

    python tools/kernel_bench.py --kernel rms-norm --hidden 3072 --tokens 16384
    python tools/kernel_bench.py --kernel rms-norm --model llama-3b --json

Each candidate runs the same inputs forward, and forward+backward, two ways: under triton.testing.do_bench (the L2
flushed between repeats, the median of its repeats: the time a caller waits, the host's launch work included, which
a short kernel's backward through autograd can exceed), and under torch.profiler (the GPU time of its kernels alone:
what a training step pays, where the host runs ahead of the GPU). The row gives both, the bytes each pass must move
over the kernels' time (GB/s: a memory-bound kernel's grade), and its largest difference from the reference computed
in fp64 (relative to the reference's largest value), so a fast row that is wrong shows it. A candidate that cannot run here (no
Transformer Engine, no Triton, no GPU) is a row saying why, never a number.
"""
from __future__ import annotations

import json
import sys
from typing import Callable, Dict, List, Optional, Sequence

import torch

from litespark_megatron.apps import cli
from litespark_megatron.presets import PRESETS

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# RMSNorm: (name, builder). A builder takes (eps, weight) and returns (fn(x) -> y, the weight tensor whose gradient
# it computes), or raises Unavailable with the reason.
class Unavailable(Exception):
    pass


def _litespark(eps, w):
    from litespark_megatron.kernels import rms_norm as rn
    if rn.rms_norm_path("cuda") != "litespark":
        raise Unavailable("Triton does not import here")
    return (lambda x: rn.rms_norm_triton(x, w, eps)), w


def _te(eps, w):
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise Unavailable(f"Transformer Engine does not import ({e.__class__.__name__})") from None
    module = te.RMSNorm(w.numel(), eps=eps, params_dtype=w.dtype, device="cuda")
    with torch.no_grad():
        module.weight.copy_(w)
    return module, module.weight


def _compiled(eps, w):
    from litespark_megatron.layers import elementwise
    return (lambda x: elementwise.rms_norm(x, w, eps)), w


def _eager(eps, w):
    from litespark_megatron.kernels.rms_norm import rms_norm_reference
    return (lambda x: rms_norm_reference(x, w, eps)), w


RMS_NORM = (("litespark", _litespark), ("te", _te), ("torch.compile", _compiled), ("torch eager", _eager))


def _median_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench
    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _kernel_ms(fn: Callable[[], object], calls: int = 20) -> float:
    """GPU time of the kernels of one call, from torch.profiler over `calls` calls."""
    from litespark_megatron.apps.profile import profile_steps
    return profile_steps(fn, calls, cuda=True)["kernel_ms_per_step"]


def bench_rms_norm(hidden: int, tokens: int, dtype: torch.dtype, eps: float = 1e-5) -> List[dict]:
    """Rows of the RMSNorm table: one per candidate."""
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=dtype)
    w = (torch.rand(hidden, device="cuda") + 0.5).to(dtype)
    dy = torch.randn_like(x)
    size = x.element_size()
    # Bytes a pass must move at least: forward reads x, writes y; backward reads x and dy, writes dx.
    fwd_bytes, bwd_bytes = 2 * x.numel() * size, 3 * x.numel() * size
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    from litespark_megatron.kernels.rms_norm import rms_norm_reference
    y64 = rms_norm_reference(x64, w64, eps)
    gx64, gw64 = torch.autograd.grad(y64, (x64, w64), dy.double())
    rows = []
    for name, build in RMS_NORM:
        row = dict(kernel="rms-norm", candidate=name, hidden=hidden, tokens=tokens, dtype=str(dtype).split(".")[-1])
        try:
            fn, wi = build(eps, w.detach().clone().requires_grad_())
        except Unavailable as e:
            rows.append(dict(row, unavailable=str(e)))
            continue
        xi = x.detach().clone().requires_grad_()
        y = fn(xi)
        gx, gw = torch.autograd.grad(y, (xi, wi), dy)

        def err(got, want):
            want = want.detach()
            return float((got.detach().double() - want).abs().max() / want.abs().max())

        with torch.no_grad():
            fwd, fwd_kernels = _median_ms(lambda: fn(x)), _kernel_ms(lambda: fn(x))

        def fwd_bwd():
            xi.grad = wi.grad = None
            fn(xi).backward(dy)
        both, both_kernels = _median_ms(fwd_bwd), _kernel_ms(fwd_bwd)
        rows.append(dict(row, forward_ms=fwd, forward_backward_ms=both, forward_kernel_ms=fwd_kernels,
                         forward_backward_kernel_ms=both_kernels, forward_gb_s=fwd_bytes / fwd_kernels / 1e6,
                         forward_backward_gb_s=(fwd_bytes + bwd_bytes) / both_kernels / 1e6,
                         error_y=err(y, y64), error_dx=err(gx, gx64), error_dw=err(gw, gw64)))
    return rows


def render(rows: Sequence[dict]) -> str:
    lines = ["| kernel | candidate | hidden | tokens | dtype | forward: kernels ms / GB/s / wall ms | "
             "forward+backward: kernels ms / GB/s / wall ms | error y / dx / dw (vs fp64) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['kernel']} | {r['candidate']} | {r['hidden']} | {r['tokens']} | {r['dtype']} |"
        if "unavailable" in r:
            lines.append(f"{head} not run: {r['unavailable']} | | |")
            continue
        lines.append(f"{head} {r['forward_kernel_ms']:.3f} / {r['forward_gb_s']:,.0f} / {r['forward_ms']:.3f} | "
                     f"{r['forward_backward_kernel_ms']:.3f} / {r['forward_backward_gb_s']:,.0f} / "
                     f"{r['forward_backward_ms']:.3f} | {r['error_y']:.1e} / {r['error_dx']:.1e} / "
                     f"{r['error_dw']:.1e} |")
    return "\n".join(lines)


def build_parser() -> cli.OneLineParser:
    p = cli.OneLineParser(prog="kernel_bench.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--kernel", choices=["rms-norm"], default="rms-norm")
    p.add_argument("--model", choices=sorted(PRESETS), help="take the hidden size from this preset")
    p.add_argument("--hidden", type=cli.positive_int, action="append", help="hidden size (repeatable)")
    p.add_argument("--tokens", type=cli.positive_int, default=16384,
                   help="rows: micro-batch x sequence length (default 16384, llama-3b's micro-batch 4 x 4096)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines instead of a table")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    opts = build_parser().parse_args(argv)
    hidden = list(opts.hidden or [])
    if opts.model:
        hidden.append(int(PRESETS[opts.model].flags["hidden-size"]))
    if not hidden:
        print("kernel_bench.py: error: give --hidden N or --model NAME (see --help)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("kernel_bench.py: error: no CUDA device here; the kernels it compares run on a GPU", file=sys.stderr)
        return 2
    rows: List[Dict] = []
    for h in hidden:
        rows += bench_rms_norm(h, opts.tokens, DTYPES[opts.dtype])
    print("\n".join(json.dumps(r) for r in rows) if opts.json else
          f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n\n" + render(rows))
    return 0
