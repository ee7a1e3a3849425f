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

The fine-tuning findings (`--axis finetune`) carry the paper's confounds beside them: its released configs put every
LoRA-family method on a 4-bit (bitsandbytes NF4) base, while LLaMA-Factory refuses quantization for freeze and full
fine-tuning, so those most likely ran in bf16; every method shared one learning rate and alpha 128 at rank 64 (RSLoRA's
scale alpha / sqrt(r) = 16 against LoRA's alpha / r = 2). The suite runs every method on the same bf16 (or fp32) base.
A finding about models this suite cannot train here is a row saying why.

The inference findings (`--axis inference`, the inference benchmark's findings.md) compare the precisions at one
batch size: the paper measured 1.5-32B models whose int4 was an AWQ checkpoint served by vLLM with its own int4
kernels, where the benchmark runs HF transformers with torchao's (each row of its report names the method), so a
verdict on speed or energy is about the kernel as much as about the precision.
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
NOT_RUNNABLE = "not runnable here"


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
    kind: str = "lowest"    # "lowest", "highest" or "lower"
    ratio: Optional[tuple] = None  # (numerator, denominator) variants: the measured ratio the paper's size is about
    confounds: str = ""     # what differs between the paper's runs and the suite's, beyond the model and data
    not_runnable: str = ""  # why the suite cannot test it (the row says so instead of a verdict)
    group: tuple = ()       # a claim about a family: its best member (lowest mean) is the subject

    def subject_of(self, spreads) -> str:
        """The variant the claim is about: its own, or the family member with the lowest mean of the metric."""
        ran = [(spreads[n][self.metric].mean, n) for n in self.group
               if spreads.get(n, {}).get(self.metric) is not None]
        return min(ran)[1] if ran else self.subject

    def verdict(self, spreads: Dict[str, Dict[str, Optional[Spread]]]) -> str:
        subject = spreads.get(self.subject_of(spreads), {}).get(self.metric)
        others = [spreads.get(o, {}).get(self.metric) for o in self.others if o in spreads]
        if not others:
            return NOT_MEASURED
        if self.kind == "lowest":
            return lowest(subject, others)
        if self.kind == "highest":  # the subject above every other: each other lower than it
            verdicts = [lower(other, subject) for other in others]
            if NOT_MEASURED in verdicts:
                return NOT_MEASURED
            return DISAGREE if DISAGREE in verdicts else AGREE if all(v == AGREE for v in verdicts) else INCONCLUSIVE
        return lower(subject, others[0])


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


_LORA_FAMILY = ("lora", "rslora", "dora", "lora-plus")
_NF4_BASE = ("its LoRA-family rows ran on a 4-bit NF4 base (bitsandbytes, quantization_bit 4), freeze and full most "
             "likely in bf16 (LLaMA-Factory refuses quantization for them)")
FINETUNE_FINDINGS = (
    Finding("The LoRA family reaches the lowest loss at 1-3B parameters (its best member against freezing and full "
            "fine-tuning)", "Llama-3.2-1B: LoRA-plus 0.7442, best of the LoRA family; the project page ranks Freeze "
                            "1st and LoRA last on performance at 1-3B", "val_loss", "lora-plus", ("freeze", "full"),
            group=_LORA_FAMILY, confounds=_NF4_BASE + "; one learning rate and alpha 128 at rank 64 for every method; "
            "1,000 OpenO1-SFT rows x 3 epochs; the prose claim is loss among adapters, not against freezing"),
    Finding("RSLoRA reaches a lower loss than LoRA at 14B parameters and more", "Qwen-2.5-14B: 0.4126 vs LoRA 0.4795; "
            "Mistral-Small-24B: RSLoRA best", "val_loss", "rslora", ("lora",), kind="lower",
            confounds="alpha 128 at rank 64 for both: RSLoRA's scale alpha / sqrt(r) = 16 against LoRA's 2, i.e. an "
                      "8x larger adapter learning rate; " + _NF4_BASE,
            not_runnable="needs a trained base of 14B parameters or more: none can be fetched here (no model hub) or "
                         "pretrained in a suite's time, and the suite's presets stop at eff-1.5b; at this suite's "
                         "size the rslora and lora rows of the table compare them"),
    Finding("Freezing has the lowest tuning latency (~3x lower)", "~3x lower AL; the one pair with both numbers: "
            "Qwen-2.5-14B Freeze 0.6227 vs RSLoRA 2.7855 s/iter (x0.22)", "al_s", "freeze",
            ("full", "lora", "rslora", "dora", "lora-plus"), ratio=("freeze", "lora"),
            confounds=_NF4_BASE + ": the LoRA rows pay NF4 dequantization in every GEMM, so part of the gap is not "
            "the frozen layers; LLaMA-Factory's freeze trains the last 2 layers (the paper's text: the first 8 "
            "frozen)"),
    Finding("DoRA is the slowest method", "last on AL in every model group (project page)", "al_s", "dora",
            ("full", "lora", "rslora", "lora-plus", "freeze"), kind="highest", ratio=("dora", "lora"),
            confounds=_NF4_BASE + "; HF peft's DoRA (the paper's and this project's) recomputes the weight norm "
            "||W + s B A|| in every forward and, with dropout 0.1, runs the base GEMM twice"),
)
_SERVING = ("the paper's int4 was an AWQ checkpoint served by vLLM (its int4 kernels) on 1.5-32B models; here HF "
            "transformers generate with the method the report names")
INFERENCE_FINDINGS = (
    Finding("bf16 draws less power than fp16 at inference", "DeepSeek-R1-Distill-Qwen-1.5B: 144 vs 159 W (x0.906)",
            "power_w", "bf16", ("fp16",), kind="lower", ratio=("bf16", "fp16"), confounds=_SERVING),
    Finding("bf16 generates more tokens per second than fp16", "1.5B: IT 39.68 vs 37.70 (x1.053)",
            "it_tokens_per_s", "bf16", ("fp16",), kind="highest", ratio=("bf16", "fp16"), confounds=_SERVING),
    Finding("int4 needs less memory than bf16", "about 1.5x less measured (14-32B); first on AMU in every group",
            "peak_memory_gb", "int4", ("bf16",), kind="lower", ratio=("int4", "bf16"), confounds=_SERVING),
    Finding("int4 draws less power than bf16", "10-23% less (14-32B)", "power_w", "int4", ("bf16",), kind="lower",
            ratio=("int4", "bf16"), confounds=_SERVING),
    Finding("int4 generates more tokens per second than bf16", "7-10% more (14-32B); first on IT in every group",
            "it_tokens_per_s", "int4", ("bf16",), kind="highest", ratio=("int4", "bf16"), confounds=_SERVING),
    Finding("int4 costs quality (bf16's perplexity is the lower)", "1.5B: score 0.2420 -> 0.2341 (-3.3% relative); "
            "3-5 points in general", "perplexity", "bf16", ("int4",), kind="lower", ratio=("int4", "bf16"),
            confounds=_SERVING + "; the paper scores tasks, the benchmark perplexity on held-out text"),
)
AXIS_FINDINGS = {"pretrain": FINDINGS, "finetune": FINETUNE_FINDINGS, "inference": INFERENCE_FINDINGS}


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


METRIC_FORMATS = {"amu_gb": "{:.2f} GB", "al_s": "{:.4f} s", "val_ppl": "{:.2f}", "j_per_token": "{:.4g} J",
                  "val_loss": "{:.4f}", "power_w": "{:.0f} W", "it_tokens_per_s": "{:.1f}/s",
                  "peak_memory_gb": "{:.3f} GB", "perplexity": "{:.3f}"}


def evaluate(spreads: Dict[str, Dict[str, Optional[Spread]]], axis: str = "pretrain") -> List[dict]:
    """Every finding whose variants the suite ran (or named), with our numbers and its verdict; a finding the suite
    cannot test here is a row saying why."""
    rows = []
    for f in AXIS_FINDINGS[axis]:
        if f.not_runnable:
            rows.append(dict(claim=f.claim, paper=f.paper, metric=f.metric, ours=f.not_runnable, ratio="",
                             verdict=NOT_RUNNABLE, confounds=f.confounds))
            continue
        subject = f.subject_of(spreads)
        names = (subject,) + tuple(f.others)
        if subject not in spreads or not any(n in spreads for n in f.others):
            continue  # the suite did not run what the finding compares
        spec = METRIC_FORMATS.get(f.metric, "{:.4g}")
        ours = "; ".join(f"{n} {_cell(spreads.get(n, {}).get(f.metric), spec)}" for n in names if n in spreads)
        missing = [n for n in names if n not in spreads]
        verdict = f.verdict(spreads)
        if missing and verdict != NOT_MEASURED:
            verdict = f"{verdict} (without {', '.join(missing)}: not in this suite)"
        if f.group:
            ours = f"best of the LoRA family here: {subject}; " + ours
        rows.append(dict(claim=f.claim, paper=f.paper, metric=f.metric, ours=ours, ratio=_ratio_text(f, spreads),
                         verdict=verdict, confounds=f.confounds))
    return rows


def markdown(rows: List[dict], header: str) -> str:
    confounds = any(r.get("confounds") for r in rows)  # the fine-tuning findings' column
    lines = [header, "",
             "| EfficientLLM finding | paper | metric | ours (mean ± 95% interval, repeats) | ratio | verdict |" +
             (" the paper's confounds |" if confounds else ""),
             "|---|---|---|---|---|---|" + ("---|" if confounds else "")]
    for r in rows:
        lines.append(f"| {r['claim']} | {r['paper']} | {r['metric']} | {r['ours']} | {r['ratio'] or '-'} | "
                     f"**{r['verdict']}** |" + (f" {r.get('confounds') or '-'} |" if confounds else ""))
    lines += ["", __doc__.split("\n\n", 1)[1].strip()]
    return "\n".join(lines) + "\n"
