"""EfficientLLM's pretraining findings (Yuan et al. 2025, arXiv 2505.13840) against the efficiency suite's own
numbers: each finding, the paper's number, ours with its spread, and a verdict decided from the intervals.

Spread: a variant's repeats (different seeds, same data) give a mean and a 95% confidence interval of the mean
(Student's t; `interval`). A verdict compares intervals, never bare means:

- "A is lower than B": agree when A's interval lies wholly below B's, disagree when wholly above, otherwise
  inconclusive; "A is the lowest of a set": agree when A's lies below every other's, disagree when another's lies
  wholly below A's.
- One run of a variant has no interval: every verdict that needs it is inconclusive.
- A metric this machine did not measure (memory, power on a CPU), or a variant that did not run: not measured.

The verdict is about the direction the paper states. Where the paper gives a size ("~40% more memory"), our ratio
is printed beside it to read, not judged: the paper's model sizes, data and step counts differ from the suite's.
The paper's "MoE needs fewer FLOPs per token" compares with a dense model of the MoE's total size, which the suite
does not train; FLOPs per token are arithmetic here (`flops_per_token` in efficiency.json: `moe-active` costs the
dense model's plus its router).
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

# Two-sided 95% quantiles of Student's t with n - 1 degrees of freedom, for n = 2..30 (beyond: the normal's 1.96).
_T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262, 11: 2.228,
        12: 2.201, 13: 2.179, 14: 2.160, 15: 2.145, 16: 2.131, 17: 2.120, 18: 2.110, 19: 2.101, 20: 2.093,
        21: 2.086, 22: 2.080, 23: 2.074, 24: 2.069, 25: 2.064, 26: 2.060, 27: 2.056, 28: 2.052, 29: 2.048, 30: 2.045}

AGREE, DISAGREE, INCONCLUSIVE, NOT_MEASURED = "agree", "disagree", "inconclusive", "not measured"


@dataclass(frozen=True)
class Spread:
    n: int
    mean: float
    min: float
    max: float
    half_width: Optional[float]  # of the 95% interval of the mean; None for one value

    @property
    def low(self) -> Optional[float]:
        return None if self.half_width is None else self.mean - self.half_width

    @property
    def high(self) -> Optional[float]:
        return None if self.half_width is None else self.mean + self.half_width

    @property
    def relative_range(self) -> float:
        """(max - min) / mean: how far the repeats spread, as a fraction."""
        return (self.max - self.min) / abs(self.mean) if self.mean else 0.0

    def as_dict(self) -> dict:
        return dict(n=self.n, mean=self.mean, min=self.min, max=self.max, ci95_half_width=self.half_width,
                    ci95_low=self.low, ci95_high=self.high)


def interval(values: Sequence[float]) -> Optional[Spread]:
    values = [float(v) for v in values if v is not None and math.isfinite(v)]
    if not values:
        return None
    n, mean = len(values), statistics.fmean(values)
    half = None
    if n > 1:
        half = _T95.get(n, 1.96) * statistics.stdev(values) / math.sqrt(n)
    return Spread(n, mean, min(values), max(values), half)


def lower(a: Optional[Spread], b: Optional[Spread]) -> str:
    """Is a lower than b?"""
    if a is None or b is None:
        return NOT_MEASURED
    if a.half_width is None or b.half_width is None:
        return INCONCLUSIVE
    if a.high < b.low:
        return AGREE
    if b.high < a.low:
        return DISAGREE
    return INCONCLUSIVE


def lowest(subject: Optional[Spread], others: Sequence[Optional[Spread]]) -> str:
    """Is subject the lowest of subject and others?"""
    verdicts = [lower(subject, other) for other in others]
    if not verdicts or NOT_MEASURED in verdicts:
        return NOT_MEASURED
    if DISAGREE in verdicts:
        return DISAGREE
    return AGREE if all(v == AGREE for v in verdicts) else INCONCLUSIVE


# --------------------------------------------------------------------------------------------- the findings
@dataclass(frozen=True)
class Finding:
    claim: str              # the paper's finding, in words
    paper: str              # the paper's number or ordering
    metric: str             # the summary key compared (lower is what the claim is about)
    subject: str            # the variant the claim is about
    others: tuple           # lowest: the variants it must be lower than; lower: the one variant
    kind: str = "lowest"    # "lowest" or "lower"
    ratio: Optional[tuple] = None  # (numerator, denominator) variants: the measured ratio the paper's size is about

    def verdict(self, spreads: Dict[str, Dict[str, Optional[Spread]]]) -> str:
        subject = spreads.get(self.subject, {}).get(self.metric)
        others = [spreads.get(o, {}).get(self.metric) for o in self.others if o in spreads]
        if self.kind == "lowest":
            return lowest(subject, others) if others else NOT_MEASURED
        return lower(subject, others[0]) if others else NOT_MEASURED


FINDINGS = (
    Finding("MQA uses the least memory of the attention variants", "lowest of MQA/GQA/MLA/NSA", "amu_gb", "mqa",
            ("gqa", "mha", "mla", "nsa")),
    Finding("MQA has the lowest latency of the attention variants", "lowest of MQA/GQA/MLA/NSA", "al_s", "mqa",
            ("gqa", "mha", "mla", "nsa")),
    Finding("MLA reaches the lowest perplexity of the attention variants", "lowest of MQA/GQA/MLA/NSA", "val_ppl",
            "mla", ("mqa", "gqa", "mha", "nsa")),
    Finding("NSA uses the least energy per token of the attention variants", "lowest of MQA/GQA/MLA/NSA",
            "j_per_token", "nsa", ("mqa", "gqa", "mha", "mla")),
    Finding("MoE at matched active parameters needs more memory than the dense model", "~40% more (x1.4)",
            "amu_gb", "dense", ("moe-active",), kind="lower", ratio=("moe-active", "dense")),
    Finding("MoE at matched active parameters reaches a lower perplexity than the dense model", "lower",
            "val_ppl", "moe-active", ("dense",), kind="lower", ratio=("moe-active", "dense")),
    Finding("MoE with 8 experts of the dense FFN size (top-2) needs more memory than the dense model",
            "~40% more at matched active parameters (this MoE has 2x the active FFN)", "amu_gb", "dense", ("moe",),
            kind="lower", ratio=("moe", "dense")),
    Finding("BF16 has lower latency than FP16 on Hopper", "~6% lower", "al_s", "bf16", ("fp16",), kind="lower",
            ratio=("bf16", "fp16")),
    Finding("BF16 uses less energy per token than FP16 on Hopper", "~9% less", "j_per_token", "bf16", ("fp16",),
            kind="lower", ratio=("bf16", "fp16")),
)


def _ratio_text(finding: Finding, spreads) -> str:
    """The measured ratio the paper's size is about, with the range the repeats allow (min/max to max/min)."""
    if finding.ratio is None:
        return ""
    num, den = (spreads.get(name, {}).get(finding.metric) for name in finding.ratio)
    if num is None or den is None or not den.mean:
        return ""
    text = f"x{num.mean / den.mean:.3f}"
    if num.n > 1 and den.n > 1 and den.min > 0:
        text += f" ({num.min / den.max:.3f}-{num.max / den.min:.3f})"
    return text


def _cell(spread: Optional[Spread], spec: str) -> str:
    if spread is None:
        return "not measured"
    text = spec.format(spread.mean)
    if spread.half_width is not None:
        text += f" ± {spec.format(spread.half_width)}"
    return text + f" (n={spread.n})"


METRIC_FORMATS = {"amu_gb": "{:.2f} GB", "al_s": "{:.4f} s", "val_ppl": "{:.2f}", "j_per_token": "{:.4g} J"}


def evaluate(spreads: Dict[str, Dict[str, Optional[Spread]]]) -> List[dict]:
    """Every finding whose variants the suite ran (or named), with our numbers and its verdict."""
    rows = []
    for f in FINDINGS:
        names = (f.subject,) + tuple(f.others)
        if f.subject not in spreads or not any(n in spreads for n in f.others):
            continue  # the suite did not run what the finding compares
        spec = METRIC_FORMATS.get(f.metric, "{:.4g}")
        ours = "; ".join(f"{n} {_cell(spreads.get(n, {}).get(f.metric), spec)}" for n in names if n in spreads)
        missing = [n for n in names if n not in spreads]
        verdict = f.verdict(spreads)
        if missing and verdict != NOT_MEASURED:
            verdict = f"{verdict} (without {', '.join(missing)}: not in this suite)"
        rows.append(dict(claim=f.claim, paper=f.paper, metric=f.metric, ours=ours, ratio=_ratio_text(f, spreads),
                         verdict=verdict))
    return rows


def markdown(rows: List[dict], header: str) -> str:
    lines = [header, "",
             "| EfficientLLM finding | paper | metric | ours (mean ± 95% interval, repeats) | ratio | verdict |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['claim']} | {r['paper']} | {r['metric']} | {r['ours']} | {r['ratio'] or '-'} | "
                     f"**{r['verdict']}** |")
    lines += ["", __doc__.split("\n\n", 1)[1].strip()]
    return "\n".join(lines) + "\n"
