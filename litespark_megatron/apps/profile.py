"""Where a training step's time goes: torch.profiler over a few steps, kernels grouped by what they do.

`profile_steps(step_fn, steps, cuda)` runs steps of an in-process model under torch.profiler (the benchmark's HF
systems); `summarize_trace(path)` reads the Chrome trace megatron.training writes with `--profile
--use-pytorch-profiler` (litespark-train, and the benchmark's megatron systems). Both give the same summary:
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


def summarize_trace(path: str, top: int = 25) -> dict:
    """The summary of a Chrome trace (a .json or .json.gz torch.profiler export). GPU traces: the kernel, memcpy
    and memset events; CPU traces: the aten operators' self time. The steps and their wall time come from the
    trace's ProfilerStep#N ranges."""
    import gzip
    import json

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X"]
    # Each step is a CPU range ("user_annotation") and, in a GPU trace, that range again on the GPU's timeline
    # ("gpu_user_annotation"): the CPU one is the step.
    steps = [e for e in events if str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") != "gpu_user_annotation"]
    wall_us = sum(e["dur"] for e in steps)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels: Dict[str, float] = {}
    calls: Dict[str, int] = {}
    if gpu:
        for e in gpu:
            kernels[e["name"]] = kernels.get(e["name"], 0.0) + e["dur"]
            calls[e["name"]] = calls.get(e["name"], 0) + 1
    else:
        for name, us in _cpu_self_times([e for e in events if e.get("cat") == "cpu_op"]):
            if name.startswith("aten::"):
                kernels[name] = kernels.get(name, 0.0) + us
                calls[name] = calls.get(name, 0) + 1
    summary = summarize(kernels, calls, max(len(steps), 1), wall_us / 1e6, "cuda" if gpu else "cpu", top=top)
    if gpu and steps:
        summary["idle"] = gpu_idle(events, steps, gpu)
    return summary


# A gap in the GPU's work shorter than this is the launch latency between two queued kernels, not a wait.
GAP_US = 10.0


def gpu_idle(events, steps, gpu, top: int = 12) -> dict:
    """Where the GPU waited inside the profiled steps: per step, the wall time no kernel, memcpy or memset covered
    (on any stream), and the gaps longer than GAP_US charged to the host's work that ended them: the innermost
    CPU operator around the launch of the first GPU event after the gap (through the events' correlation ids),
    with the kernel the GPU had finished before it. A synchronization shows as the operator after it; launch-bound
    stretches as many small gaps charged to the operators that launch slowly."""
    busy = sorted(gpu, key=lambda e: (e["ts"], e["dur"]))
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    idle_us, found = 0.0, []  # found: (gap start, gap end, the launch ending it or None, the kernel before it)
    for step in steps:
        start, end = step["ts"], step["ts"] + step["dur"]
        covered_to, before = start, "(step start)"
        for evt in busy:
            b, e = evt["ts"], evt["ts"] + evt["dur"]
            if b >= end:  # sorted by start: the rest begin after this step
                break
            if e <= start:
                continue
            if b > covered_to:
                idle_us += b - covered_to
                if b - covered_to > GAP_US:
                    found.append((covered_to, b, launches.get(evt.get("args", {}).get("correlation")), before))
            if e > covered_to:
                covered_to, before = e, evt["name"]
        idle_us += max(end - covered_to, 0.0)
    host_ops = _innermost_ops([e for e in events if e.get("cat") in ("cpu_op", "user_annotation")
                               and not str(e.get("name", "")).startswith("ProfilerStep#")],
                              [launch for _, _, launch, _ in found if launch is not None])
    gaps: Dict[tuple, list] = {}
    for b, e, launch, before in found:
        key = (host_ops.get(id(launch), "(no operator)") if launch is not None else "(no launch found)", before)
        total = gaps.setdefault(key, [0.0, 0])
        total[0] += e - b
        total[1] += 1
    n = len(steps)
    ranked = sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]
    waits = sorted(_host_calls_in([(b, e) for b, e, _, _ in found], events).items(), key=lambda kv: -kv[1])[:top]
    return dict(ms_per_step=idle_us / 1e3 / n, gap_us=GAP_US,
                gaps=[dict(host_op=op, after_kernel=prev, ms_per_step=us / 1e3 / n, count_per_step=count / n)
                      for (op, prev), (us, count) in ranked],
                host_calls=[dict(call=name, ms_per_step=us / 1e3 / n) for name, us in waits])


def _host_calls_in(spans, events) -> Dict[str, float]:
    """call name -> microseconds of the gaps `spans` ([start, end) of GPU idle) that the host spent inside that CUDA
    runtime or driver call: a synchronization (cudaStreamSynchronize, a device-to-host cudaMemcpyAsync), or
    memory the caching allocator asked the driver for or gave back (cudaMalloc, cudaFree, which synchronizes the
    device). Kernel launches are left out: idle the host spent elsewhere was Python and operator overhead."""
    import bisect

    spans = sorted(spans)
    starts = [b for b, _ in spans]
    found: Dict[str, float] = {}
    for e in events:
        name = str(e.get("name", ""))
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "Launch" in name:
            continue
        b, end = e["ts"], e["ts"] + e["dur"]
        i = max(bisect.bisect_right(starts, b) - 1, 0)
        while i < len(spans) and spans[i][0] < end:
            overlap = min(end, spans[i][1]) - max(b, spans[i][0])
            if overlap > 0:
                found[name] = found.get(name, 0.0) + overlap
            i += 1
    return found


def _innermost_ops(ops, launches) -> Dict[int, str]:
    """id(launch) -> the name of the innermost operator of its thread whose range holds it: one sweep per thread
    over the operators by start time (a stack of the open ranges) and the launches by time."""
    by_thread: Dict[object, tuple] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), ([], []))[0].append(e)
    for launch in launches:
        by_thread.setdefault((launch.get("pid"), launch.get("tid")), ([], []))[1].append(launch)
    names: Dict[int, str] = {}
    for thread_ops, thread_launches in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack, i = [], 0
        for launch in sorted(thread_launches, key=lambda e: e["ts"]):
            t = launch["ts"]
            while i < len(thread_ops) and thread_ops[i]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] < thread_ops[i]["ts"]:
                    stack.pop()
                stack.append(thread_ops[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            if stack:
                names[id(launch)] = stack[-1]["name"]
    return names


def _cpu_self_times(ops):
    """(name, self microseconds) of CPU operator events: their duration minus that of the operators they call
    (nested ranges of the same thread)."""
    by_thread: Dict[object, list] = {}
    for e in ops:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list = []  # [event, children's duration]
        for e in thread_ops:
            while stack and e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]:
                done, children = stack.pop()
                yield done["name"], done["dur"] - children
            if stack:
                stack[-1][1] += e["dur"]
            stack.append([e, 0.0])
        while stack:
            done, children = stack.pop()
            yield done["name"], done["dur"] - children


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
    idle = summary.get("idle")
    if idle:
        lines += ["", f"GPU idle {idle['ms_per_step']:.1f} ms/step; its gaps over {idle['gap_us']:g} us by the host "
                      "operator that launched the work ending each gap:", "",
                  "| host operator | kernel before the gap | ms/step | gaps/step |", "|---|---|---|---|"]
        for g in idle["gaps"]:
            lines.append(f"| `{_short(g['host_op'])}` | `{_short(g['after_kernel'])}` | {g['ms_per_step']:.2f} | "
                         f"{g['count_per_step']:g} |")
        calls = idle.get("host_calls") or []
        inside = sum(c["ms_per_step"] for c in calls)
        lines += ["", f"Of those gaps the host spent {inside:.1f} ms/step inside CUDA runtime calls other than "
                      "launches (the rest: Python and operator overhead between launches):"]
        if calls:
            lines += ["", "| host call during the gaps | ms/step |", "|---|---|"]
            lines += [f"| `{_short(c['call'])}` | {c['ms_per_step']:.2f} |" for c in calls]
    return "\n".join(lines) + "\n"


def _short(name: str, width: int = 80) -> str:
    name = name.replace("|", "\\|")
    return name if len(name) <= width else name[:width - 3] + "..."


def category_ms(summary: dict) -> Dict[str, float]:
    return {c["category"]: c["ms_per_step"] for c in summary["categories"]}


__all__: List[str] = ["kernel_category", "summarize", "StepProfiler", "profile_steps", "summarize_trace", "render",
                       "category_ms"]
