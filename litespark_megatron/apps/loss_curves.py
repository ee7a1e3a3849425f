"""Do two or more training runs follow the same loss curve? (`tools/compare_losses.py`)

Each run is a `metrics.jsonl` (or the run directory holding one). Its train records give the loss of each log
interval (the mean over the interval's steps). Every run is compared with the reference run on the steps both
logged, from `start_step` on:

    deviation(step) = |smoothed_run(step) - smoothed_ref(step)| / smoothed_ref(step)

where `smoothed` is the trailing mean over the last `smooth` logged points (1 = as logged). A run is within
tolerance when its largest deviation is at most `tolerance`. This is how "Litespark stays within 1% of the stock
Megatron-Core loss curve" is checked; the smoothing removes the step-to-step noise of different kernels (FP8
scaling, fused reductions) without hiding a drift.

The table also gives the signed mean deviation, mean((run - ref) / ref): rounding noise wanders both ways and
averages out, a systematic difference (a run that learns faster or slower) does not. Read both against a run of
the reference's own function that differs only in rounding (e.g. stock with --no-gradient-accumulation-fusion):
at small batches two such runs can part by more than 1% pointwise, and that is the noise floor.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Dict, List, Sequence


class CurveError(ValueError):
    """A run that cannot be compared (missing file, no train records, no steps in common)."""


def metrics_path(run: str) -> str:
    """A metrics.jsonl path, or the run directory that holds one (litespark-train writes it there)."""
    path = os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run
    if not os.path.isfile(path):
        where = f"{run} has no metrics.jsonl" if os.path.isdir(run) else f"{run} does not exist"
        raise CurveError(f"{where}: give a litespark-train metrics.jsonl or the run directory holding it")
    return path


def read_losses(run: str) -> Dict[int, float]:
    """step -> train loss of that log interval. A resumed run's later records win over earlier ones."""
    path = metrics_path(run)
    losses: Dict[int, float] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise CurveError(f"{path}, line {number}: not JSON") from None
            if record.get("kind") == "train" and record.get("loss") is not None:
                losses[int(record["step"])] = float(record["loss"])
    if not losses:
        raise CurveError(f"{path}: no train records with a loss (did the run log any interval?)")
    return losses


def smoothed(values: Sequence[float], window: int) -> List[float]:
    out = []
    for i in range(len(values)):
        chunk = values[max(0, i - window + 1): i + 1]
        out.append(sum(chunk) / len(chunk))
    return out


@dataclass
class Comparison:
    run: str
    steps: List[int]              # the common steps compared (>= start_step)
    losses: List[float]           # this run's smoothed losses at those steps
    reference: List[float]        # the reference's smoothed losses at those steps
    deviations: List[float]
    tolerance: float

    @property
    def max_deviation(self) -> float:
        return max(self.deviations)

    @property
    def worst_step(self) -> int:
        return self.steps[self.deviations.index(self.max_deviation)]

    @property
    def mean_deviation(self) -> float:
        """Signed: below zero, the run's loss is lower than the reference's on average."""
        return sum((g - r) / abs(r) for g, r in zip(self.losses, self.reference)) / len(self.steps)

    @property
    def final_deviation(self) -> float:
        return self.deviations[-1]

    @property
    def within(self) -> bool:
        return self.max_deviation <= self.tolerance


def compare(reference: Dict[int, float], run: Dict[int, float], name: str, tolerance: float, smooth: int = 1,
            start_step: int = 0) -> Comparison:
    common = sorted(set(reference) & set(run))
    if not common:
        raise CurveError(f"{name}: no logged step in common with the reference (use the same --log-interval)")
    # Smooth over all common points, then keep those from start_step: the window then never reaches back into
    # steps that only one of the runs logged.
    ref = smoothed([reference[s] for s in common], smooth)
    got = smoothed([run[s] for s in common], smooth)
    keep = [i for i, s in enumerate(common) if s >= start_step]
    if not keep:
        raise CurveError(f"{name}: no common logged step at or after --start-step {start_step} "
                         f"(last common step {common[-1]})")
    steps = [common[i] for i in keep]
    ref, got = [ref[i] for i in keep], [got[i] for i in keep]
    deviations = [abs(g - r) / abs(r) if r else float("inf") for g, r in zip(got, ref)]
    return Comparison(name, steps, got, ref, deviations, tolerance)


def render(reference_name: str, comparisons: List[Comparison], smooth: int, start_step: int) -> str:
    lines = [f"reference: {reference_name}; trailing mean over {smooth} logged point(s); steps >= {start_step}", "",
             "| run | steps compared | final loss (run / reference) | final deviation | max deviation (at step) "
             "| mean deviation (signed) | tolerance | within |",
             "|---|---|---|---|---|---|---|---|"]
    for c in comparisons:
        lines.append(f"| {c.run} | {len(c.steps)} ({c.steps[0]}-{c.steps[-1]}) | {c.losses[-1]:.4f} / "
                     f"{c.reference[-1]:.4f} | {c.final_deviation:.2%} | {c.max_deviation:.2%} ({c.worst_step}) | "
                     f"{c.mean_deviation:+.2%} | {c.tolerance:.2%} | {'yes' if c.within else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(reference_name: str, reference: Dict[int, float], runs: Dict[str, Dict[int, float]], path: str) -> None:
    """The raw curves (as logged) of the reference and every run, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, losses in [(reference_name, reference)] + list(runs.items()):
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], label=name + (" (reference)" if name == reference_name else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("train loss (log-interval mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def run_names(paths: Sequence[str]) -> List[str]:
    """Short labels: the run directory's name (or the file's parent directory for a metrics.jsonl path)."""
    names = []
    for p in paths:
        p = os.path.normpath(p)
        base = os.path.basename(p)
        names.append(os.path.basename(os.path.dirname(p)) or base if base == "metrics.jsonl" else base)
    if len(set(names)) < len(names):  # two runs/<x>/tb directories, say: the paths tell them apart
        return [os.path.normpath(p) for p in paths]
    return names


__all__ = ["CurveError", "read_losses", "compare", "render", "plot", "run_names", "Comparison", "smoothed"]
