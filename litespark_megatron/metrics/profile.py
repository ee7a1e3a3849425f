"""Where a training step's time goes: torch.profiler over a few steps, kernels grouped by what they do.

`profile_steps(step_fn, steps, cuda)` (the benchmark) and `StepProfiler` (litespark-train --profile) run training
steps under torch.profiler and return a summary:
per category (GEMM, attention, optimizer, communication, ...) the GPU time per step, the share of the step, and the
top kernels by GPU time. On the CPU (no kernels) it groups the CPU operators instead, so the tool runs anywhere.
`busy_fraction` is the summed kernel time over the wall time of the profiled steps: well below 1 means the GPU
waits for the host (launch overhead, synchronizations), which no faster kernel can fix.

Categories come from kernel names (cuBLAS/CUTLASS/cuDNN/TE/NCCL naming), checked in order; `kernel_category`
documents the patterns. The profiler itself adds some host overhead, so the benchmark times steps without it.
"""
from __future__ import annotations

import time
from typing import Callable, Dict, List

# (category, substrings of a lower-cased kernel name), first match wins: attention before GEMM, because cuDNN's
# and flash's attention kernels contain "gemm"-like names too.
CATEGORIES = (
    ("communication", ("nccl",)),
    # TE's scaled_(upper_triang_)masked_softmax kernels are its unfused attention's softmax.
    ("attention", ("fmha", "flash", "sdpa", "attn", "attention", "fort_native", "scaled_dot_product",
                   "masked_softmax")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "matmul", "addmm", "aten::mm", "aten::bmm")),
    ("optimizer", ("adam", "multi_tensor", "l2norm", "foreach", "_amp_")),
    ("cross-entropy/softmax", ("cross_entropy", "softmax", "log_softmax", "nll_loss", "logsumexp")),
    ("norm", ("rmsnorm", "rms_norm", "layernorm", "layer_norm")),
    ("rope", ("rope", "rotary")),
    ("fp8 cast/transpose", ("cast_transpose", "quantize", "amax", "fp8")),
    ("elementwise/other", ("triton_",)),  # torch.compile'd fusions ("fused_cat_mul_silu..." is not a copy)
    ("copy/fill", ("memcpy", "memset", "copy", "fill", "zero", "cat")),
)
OTHER = "elementwise/other"


def kernel_category(name: str) -> str:
    lowered = name.lower()
    for category, needles in CATEGORIES:
        if any(n in lowered for n in needles):
            return category
    return OTHER


def summarize(kernels: Dict[str, float], calls: Dict[str, int], steps: int, wall_s: float, device: str,
              top: int = 25) -> dict:
    """Kernel name -> total microseconds over `steps` steps, into per-step milliseconds by category."""
    total_us = sum(kernels.values())
    by_cat: Dict[str, float] = {}
    for name, us in kernels.items():
        cat = kernel_category(name)
        by_cat[cat] = by_cat.get(cat, 0.0) + us
    categories = [dict(category=c, ms_per_step=us / 1e3 / steps, share=us / total_us if total_us else 0.0)
                  for c, us in sorted(by_cat.items(), key=lambda kv: -kv[1])]
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    top_kernels = [dict(name=n, category=kernel_category(n), ms_per_step=us / 1e3 / steps,
                        calls_per_step=calls.get(n, 0) / steps, share=us / total_us if total_us else 0.0)
                   for n, us in ranked]
    wall_ms = wall_s * 1e3 / steps
    return dict(device=device, steps=steps, wall_ms_per_step=wall_ms, kernel_ms_per_step=total_us / 1e3 / steps,
                busy_fraction=(total_us / 1e3 / steps) / wall_ms if wall_ms else None,
                categories=categories, top_kernels=top_kernels)


class StepProfiler:
    """torch.profiler around a span of training steps: `start()`, `step()` after each step, `stop()` -> summary.
    `export_trace(path)` after stop writes the Chrome/Perfetto trace (gzip-compressed when path ends in .gz)."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.steps = 0
        self._prof = None
        self._t0 = 0.0

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self.cuda:
            torch.cuda.synchronize()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities)
        self._prof.__enter__()
        self._t0 = time.perf_counter()

    def step(self) -> None:
        self.steps += 1

    def stop(self) -> dict:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        return _summarize_profiler(self._prof, max(self.steps, 1), wall, self.cuda)

    def export_trace(self, path: str) -> None:
        self._prof.export_chrome_trace(path)


def profile_steps(step_fn: Callable[[], float], steps: int, cuda: bool) -> dict:
    """Run `steps` training steps under torch.profiler; the summary (see module docstring)."""
    profiler = StepProfiler(cuda)
    profiler.start()
    for _ in range(steps):
        step_fn()
        profiler.step()
    return profiler.stop()


def _summarize_profiler(prof, steps: int, wall: float, cuda: bool) -> dict:
    from torch.autograd import DeviceType

    kernels: Dict[str, float] = {}
    calls: Dict[str, int] = {}
    if cuda:
        for evt in prof.events():
            # Kernels and memcpys on the GPU timeline; not the user-annotation ranges ("Optimizer.step#...") that
            # torch mirrors onto it, which would count their kernels twice.
            if evt.device_type != DeviceType.CUDA or getattr(evt, "is_user_annotation", False) or \
                    evt.name.startswith(("Optimizer.", "ProfilerStep")):
                continue
            us = evt.time_range.elapsed_us()
            kernels[evt.name] = kernels.get(evt.name, 0.0) + us
            calls[evt.name] = calls.get(evt.name, 0) + 1
    else:
        for evt in prof.key_averages():
            # CPU: the leaf aten operators' own time (self time, so nested calls are not counted twice).
            if not evt.key.startswith("aten::") or evt.self_cpu_time_total <= 0:
                continue
            kernels[evt.key] = evt.self_cpu_time_total
            calls[evt.key] = evt.count
    return summarize(kernels, calls, steps, wall, "cuda" if cuda else "cpu")


def render(summary: dict, title: str) -> str:
    """The summary as Markdown: categories, then the top kernels."""
    unit = "kernels" if summary["device"] == "cuda" else "CPU operators (self time)"
    busy = summary["busy_fraction"]
    lines = [f"### {title}", "",
             f"{summary['steps']} profiled step(s): wall {summary['wall_ms_per_step']:.1f} ms/step, {unit} "
             f"{summary['kernel_ms_per_step']:.1f} ms/step"
             + (f" (GPU busy {busy:.0%} of the wall time)" if busy is not None and summary["device"] == "cuda"
                else ""),
             "", "| category | ms/step | share |", "|---|---|---|"]
    lines += [f"| {c['category']} | {c['ms_per_step']:.1f} | {c['share']:.1%} |" for c in summary["categories"]]
    lines += ["", "| top kernel | category | ms/step | calls/step | share |", "|---|---|---|---|---|"]
    for k in summary["top_kernels"]:
        name = k["name"].replace("|", "\\|")
        name = name if len(name) <= 110 else name[:107] + "..."
        lines.append(f"| `{name}` | {k['category']} | {k['ms_per_step']:.2f} | {k['calls_per_step']:g} | "
                     f"{k['share']:.1%} |")
    return "\n".join(lines) + "\n"


def category_ms(summary: dict) -> Dict[str, float]:
    return {c["category"]: c["ms_per_step"] for c in summary["categories"]}


__all__: List[str] = ["kernel_category", "summarize", "StepProfiler", "profile_steps", "render", "category_ms"]
