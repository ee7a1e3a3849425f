"""EfficientLLM-style efficiency suite: architecture and precision variants of one base model, each trained for the
same steps on the same data by `litespark-train`, and their AMU, PCU, AL, TT, AEC, J/token and perplexity.

    python tools/efficiency_suite.py --out runs/eff --model eff-0.5b --variants all --repeats 3 -- \
        --micro-batch-size 16 ...

`--axis finetune --peft-base CKPT` is EfficientLLM's other training axis: full fine-tuning and the PEFT methods
(LoRA, RSLoRA, DoRA, LoRA-plus, freezing) of one base checkpoint on the same SFT rows, with the same measurements plus
trainable parameters, checkpoint size and validation loss. `--axis inference --hf DIR` is its third axis: the
precisions of one HF Llama at inference (16-bit, int4, float8), run by the inference benchmark (inference_bench.py,
whose options it takes).

Every variant runs in a fresh `python -m litespark_megatron` (torchrun with --nproc > 1) that writes its own
metrics.jsonl: the trainer's telemetry is the measurement, and this module only aggregates what it logged
(docs/metrics.md, "EfficientLLM metrics"). A value the trainer did not measure (GPU memory, MFU, power on a CPU
run) stays None here: "not measured" in the table, null in JSON/CSV, left out of plots with a note.

`--repeats N` runs each variant N times (other model seeds, the same data): the table gives each number's mean and
95% interval, and findings.md (findings.py) EfficientLLM's findings beside them with a verdict.

The suite is resumable: OUT/suite_state.json records each run's status as it goes. A second invocation with the
same settings skips variants that completed (or ran out of GPU memory) and re-runs the ones that were interrupted or
failed. Every variant is validated in-process (arguments.check_run) before anything runs; one that cannot run on
this machine is a row saying why.
"""
from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import math
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from .. import arguments
from .. import backend_probe
from ..errors import ConfigError, UserError
from . import run_state

STATE_FILE = "suite_state.json"
STATE_VERSION = 1
# Flags the suite sets itself, per variant or from its own options.
RESERVED_FLAGS = ("--save", "--load", "--metrics-file", "--tensorboard-dir", "--bf16", "--fp16", "--fp8-format",
                  "--train-iters", "--log-interval", "--eval-iters", "--eval-interval", "--exit-interval",
                  "--peft-base", "--pretrained-checkpoint", "--save-interval")
AXES = ("pretrain", "finetune", "inference")
INFERENCE_PROG = "efficiency_suite --axis inference"
KERNEL_FLAGS = tuple(name.replace("_", "-") for name, _ in arguments.KERNELS_AUTO)  # held off unless named
PRECISIONS = {"fp32": [], "bf16": ["--bf16"], "fp16": ["--fp16"]}
# Subprocess output that means the GPU ran out of memory (torch's allocator, cuBLAS/cuDNN workspaces, raw CUDA).
OOM_PATTERNS = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|"
                          r"CUDNN_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation|CUDA error: out of memory")
FINAL = ("done", "oom")  # outcomes a resumed suite keeps; anything else runs again
CANNOT_RUN = "cannot run here"  # recorded for the report; a machine that can run the variant runs it


# --------------------------------------------------------------------------------------------- variants
# The optimizer recipe every variant trains with unless the shared flags say otherwise (they come after it): peak
# LR 3e-4 with cosine decay to 0, AdamW with weight decay 0.1 and beta2 0.95 (Megatron-LM's defaults otherwise:
# beta1 0.9, clip 1.0). The suite's earlier tables were measured with exactly these settings.
RECIPE = ["--lr", "3e-4", "--min-lr", "0", "--lr-decay-style", "cosine", "--weight-decay", "0.1", "--adam-beta2",
          "0.95"]


# The fine-tuning axis's recipe: EfficientLLM's released LLaMA-Factory settings for its 1B models (learning rate 5e-5,
# cosine decay, 10% warm-up; HF Trainer's AdamW defaults: no weight decay, beta2 0.999, clip 1.0), one for every method.
# The distributed optimizer for every variant alike: the trainer refuses freeze with --save on the plain one (whose
# optimizer state for the last layers of the stacked layer tensors only fails megatron-core's sharding validation).
FINETUNE_RECIPE = ["--lr", "5e-5", "--min-lr", "0", "--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.1",
                   "--weight-decay", "0", "--adam-beta2", "0.999", "--use-distributed-optimizer"]


@dataclass(frozen=True)
class Variant:
    name: str
    what: str
    flags: Callable  # (base args, te backend?) -> litespark-train flags added to the base command line
    precision: Optional[str] = None  # None: the suite's --precision
    base_flag: Optional[str] = None  # fine-tuning: the flag that names the base checkpoint (--peft-base CKPT)


def _gqa_groups(heads: int, groups: int) -> int:
    """The preset's KV groups when it is GQA; for an MHA/MQA preset the largest divisor of the heads <= heads/4
    (Llama-2-70B/Llama-3 use heads/8 .. heads/4)."""
    if 1 < groups < heads:
        return groups
    divisors = [g for g in range(2, heads) if heads % g == 0]
    small = [g for g in divisors if g <= heads // 4]
    if small or divisors:
        return max(small or divisors)
    raise ConfigError(f"variant 'gqa': {heads} attention heads have no divisor between 1 and {heads}, so no "
                      f"grouped-query attention exists for this model")


def _moe_flags(args, te: bool) -> list:
    # EfficientLLM's "N x 8" MoE: 8 experts the size of the dense FFN, top-2, a small load-balancing loss;
    # all-to-all dispatch (what expert parallelism uses); grouped GEMM where Transformer Engine runs the layer.
    flags = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
             "--moe-token-dispatcher-type", "alltoall"]
    return flags + (["--moe-grouped-gemm"] if te else [])


def _mla_flags(args, te: bool) -> list:
    """DeepSeek-V2(-Lite)'s proportions of the preset's head dim d: q/k and v head dims d, RoPE part d/2, KV latent
    4d, no query compression, plain RoPE at the preset's base. Its latent RMSNorms need TE's norm+linear without
    query compression (megatron-core), so they are on where TE runs the layer."""
    d = args.hidden_size // args.num_attention_heads
    flags = ["--multi-latent-attention", "--qk-head-dim", str(d), "--v-head-dim", str(d), "--qk-pos-emb-head-dim",
             str(d // 2), "--kv-lora-rank", str(4 * d), "--rope-type", "rope",
             "--no-rope-fusion"]  # megatron-core fuses MLA's RoPE only in its YaRN form (0.19 refuses it here)
    return flags + (["--qk-layernorm"] if te else [])


VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("dense", "the base model (preset attention, dense SwiGLU MLP, RoPE, --precision)", lambda a, te: []),
    Variant("mha", "multi-head attention: one KV head per query head",
            lambda a, te: ["--num-query-groups", str(a.num_attention_heads)]),
    Variant("gqa", "grouped-query attention (the preset's KV groups, or heads/4 for an MHA preset)",
            lambda a, te: ["--num-query-groups", str(_gqa_groups(a.num_attention_heads, a.num_query_groups))]),
    Variant("mqa", "multi-query attention: one KV head", lambda a, te: ["--num-query-groups", "1"]),
    Variant("mla", "multi-latent attention (DeepSeek-V2 proportions of the head dim; latent norms with TE)",
            lambda a, te: _mla_flags(a, te)),
    Variant("nsa", "native sparse attention (compressed, selected and window branches, learned gates; fla-core "
                   "kernels on a GPU) with heads/16 KV heads, the kernels' smallest group: compare with mqa",
            lambda a, te: ["--attention-variant", "nsa", "--num-query-groups", str(max(a.num_attention_heads // 16,
                                                                                       1))]),
    Variant("moe", "mixture of experts: 8 experts of the dense FFN size, top-2, aux loss 0.01", _moe_flags),
    Variant("moe-active", "mixture of experts at the dense model's active parameters: 8 experts of half the FFN, "
                          "top-2", lambda a, te: _moe_flags(a, te) + ["--moe-ffn-hidden-size",
                                                                        str(a.ffn_hidden_size // 2)]),
    Variant("nope", "no positional encoding (NoPE)", lambda a, te: ["--position-embedding-type", "none"]),
    Variant("bf16", "BF16 parameters and compute", lambda a, te: [], precision="bf16"),
    Variant("fp16", "FP16 with dynamic loss scaling", lambda a, te: [], precision="fp16"),
    Variant("fp8", "FP8 (TE, hybrid E4M3/E5M2, delayed scaling) over BF16", lambda a, te: ["--fp8-format", "hybrid"],
            precision="bf16"),
)}


# EfficientLLM's PEFT settings (its released LLaMA-Factory configs, for every model): rank 64, alpha 128, dropout 0.1
# on all linears; LoRA-plus's B at 16 times the learning rate (the LoRA+ paper's ratio); freezing trains the last 2
# layers. The LoRA-family variants save their adapters alone (what a LoRA checkpoint is).
EFFICIENTLLM_ADAPTER = ["--lora-rank", "64", "--lora-alpha", "128", "--lora-dropout", "0.1", "--save-adapters-only"]
FINETUNE_VARIANTS: Dict[str, Variant] = {v.name: v for v in (
    Variant("full", "every weight trains, from the base", lambda a, te: [], base_flag="--pretrained-checkpoint"),
    Variant("lora", "LoRA on the four linears, rank 64, alpha 128, dropout 0.1",
            lambda a, te: ["--peft", "lora", *EFFICIENTLLM_ADAPTER], base_flag="--peft-base"),
    Variant("rslora", "LoRA with RSLoRA's scaling alpha / sqrt(r)",
            lambda a, te: ["--peft", "lora", *EFFICIENTLLM_ADAPTER, "--lora-scaling", "rs"], base_flag="--peft-base"),
    Variant("dora", "DoRA (magnitude and direction), rank 64, alpha 128, dropout 0.1",
            lambda a, te: ["--peft", "dora", *EFFICIENTLLM_ADAPTER], base_flag="--peft-base"),
    Variant("lora-plus", "LoRA with B's learning rate 16 times A's (LoRA+)",
            lambda a, te: ["--peft", "lora", *EFFICIENTLLM_ADAPTER, "--lora-plus-ratio", "16"],
            base_flag="--peft-base"),
    Variant("freeze", "the last 2 layers train, all else frozen (LLaMA-Factory's freeze_trainable_layers 2)",
            lambda a, te: ["--peft", "freeze", "--trainable-layers", "2"], base_flag="--peft-base"),
)}
AXIS_VARIANTS = {"pretrain": VARIANTS, "finetune": FINETUNE_VARIANTS}


def parse_variant_names(text: str, axis: str = "pretrain") -> List[str]:
    variants = AXIS_VARIANTS[axis]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(variants)
    unknown = [n for n in names if n not in variants]
    if unknown:
        raise UserError(f"unknown variant{'s' if len(unknown) > 1 else ''} {', '.join(repr(n) for n in unknown)}; "
                        f"choose from: {', '.join(variants)} (or 'all')" +
                        (f" (the {axis} axis)" if axis != "pretrain" else ""))
    if not names:
        raise UserError("--variants is empty; name at least one of: " + ", ".join(variants))
    if len(set(names)) != len(names):
        raise UserError(f"--variants names a variant twice: {text}")
    return names


# --------------------------------------------------------------------------------------------- settings
REPEAT_MARK = ".r"  # repeat K of variant NAME is the run NAME.rK


def variant_of(run_id: str) -> str:
    return run_id.split(REPEAT_MARK)[0]


@dataclass
class Settings:
    out: Path
    model: str
    variants: List[str]
    precision: str
    train_iters: int
    log_interval: int
    eval_iters: int
    nproc: int
    mock_data: bool
    warmup_intervals: int
    timeout: int
    time_budget: Optional[float]
    rerun: List[str]
    variant_flags: Dict[str, List[str]]
    shared: List[str]  # litespark-train flags after '--'
    allow_degraded: bool = False
    repeats: int = 1
    report_only: bool = False
    axis: str = "pretrain"
    peft_base: Optional[str] = None  # the fine-tuning axis's base checkpoint
    parallel: int = 1  # runs at once, each on its own --nproc GPUs

    @property
    def variant_table(self) -> Dict[str, Variant]:
        return AXIS_VARIANTS[self.axis]

    def run_ids(self, name: str) -> List[str]:
        """The runs of one variant: its name for the first repeat (so a suite of one repeat is what it always
        was), NAME.rK for repeat K (variant_of reads it back)."""
        return [name] + [f"{name}{REPEAT_MARK}{k}" for k in range(2, self.repeats + 1)]

    def identity(self) -> dict:
        """What makes two invocations the same suite (the variant list may grow between them)."""
        identity = dict(model=self.model, precision=self.precision, train_iters=self.train_iters,
                        log_interval=self.log_interval, eval_iters=self.eval_iters, nproc=self.nproc,
                        mock_data=self.mock_data, shared=self.shared, variant_flags=self.variant_flags)
        if self.axis != "pretrain":  # (a pretraining suite's identity is what it was before the axes)
            identity.update(axis=self.axis, peft_base=self.peft_base)
        return identity

    def base_flags(self) -> List[str]:
        # Validation once, after training (megatron.training's final evaluation), on --eval-iters batches.
        flags = ["--model", self.model, "--train-iters", str(self.train_iters), "--log-interval",
                 str(self.log_interval), "--eval-iters", str(self.eval_iters), "--eval-interval", str(10 ** 9)]
        given = {f.split("=", 1)[0] for f in self.shared}
        # The Litespark kernels held off in every variant unless the flags name them: their default follows the
        # precision and the attention (FP8 keeps TE's norm, MLA its own RoPE), which would make them a difference
        # between variants that the variants do not name.
        flags += [f"--no-{k}" for k in KERNEL_FLAGS if f"--{k}" not in given and f"--no-{k}" not in given]
        if self.axis == "finetune":
            # the SFT rows every machine has, unless the flags name others
            sft = [] if {"--sft-data", "--embedded-sft"} & given else ["--embedded-sft", "stdlib"]
            return flags + FINETUNE_RECIPE + sft + self.shared
        flags += RECIPE
        named = {"--mock-data", "--data-path", "--embedded-corpus"} & given
        if self.mock_data and "--mock-data" not in named:
            flags.append("--mock-data")
        elif not named:
            flags += ["--embedded-corpus", "stdlib"]  # the suite's default data, which every machine has
        return flags + self.shared


def _build_parser() -> argparse.ArgumentParser:
    from .cli import OneLineParser, non_negative_int, positive_float, positive_int

    p = OneLineParser(
        prog="efficiency_suite",
        description="Train architecture/precision variants of one base model for the same steps on the same data, "
                    "each in a fresh litespark-train process, and tabulate/plot AMU, PCU, AL, TT, AEC, J/token and "
                    "validation perplexity (EfficientLLM definitions, docs/metrics.md). Flags after '--' go to "
                    "every litespark-train run (layout, batch, learning rate, data).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="directory for runs, state, table, JSON, CSV, plots and tb/")
    p.add_argument("--model", default="eff-0.5b", help="base preset: " + ", ".join(arguments.PRESETS))
    p.add_argument("--axis", choices=AXES, default="pretrain",
                   help="pretrain: architecture and precision variants trained from scratch; finetune: full "
                        "fine-tuning and the PEFT methods of --peft-base on SFT rows (--embedded-sft stdlib unless "
                        "the flags after '--' name --sft-data); inference: the precisions of an HF Llama (--hf DIR) "
                        "at inference, with the inference benchmark's options (--axis inference --help lists them)")
    p.add_argument("--peft-base", default=None, metavar="CKPT",
                   help="--axis finetune: the base checkpoint every variant starts from (a pretraining run's --save "
                        "directory of the same --model, or a litespark-convert import)")
    p.add_argument("--variants", default="all",
                   help="comma list of: " + ", ".join(VARIANTS) + " (--axis finetune: " +
                        ", ".join(FINETUNE_VARIANTS) + "); or all")
    p.add_argument("--precision", choices=list(PRECISIONS), default="bf16",
                   help="precision of the non-precision variants")
    p.add_argument("--train-iters", type=positive_int, default=200, help="optimizer steps per variant")
    p.add_argument("--log-interval", type=positive_int, default=10, help="steps per measurement interval")
    p.add_argument("--eval-iters", type=positive_int, default=10,
                   help="validation batches for the final perplexity")
    p.add_argument("--nproc", type=positive_int, default=1, help="processes per run (torchrun) on this host")
    p.add_argument("--parallel", type=positive_int, default=1,
                   help="runs at once, each on its own --nproc GPUs of this host (CUDA_VISIBLE_DEVICES per run): a "
                        "suite of many runs on a machine of several GPUs; the runs share the host's CPUs and disks")
    p.add_argument("--mock-data", action="store_true", help="megatron-core mock data instead of the embedded corpus")
    p.add_argument("--warmup-intervals", type=non_negative_int, default=1,
                   help="log intervals left out of AL/PCU/TT/AEC/AMU (compilation, allocator warm-up); all are "
                        "used when a run has no more than this many")
    p.add_argument("--timeout", type=positive_int, default=3600, help="seconds per variant run")
    p.add_argument("--time-budget", type=positive_float, default=None,
                   help="start no new variant after this many seconds; run the same command again to continue")
    p.add_argument("--rerun", default="", help="comma list of variants to run again even if recorded as done")
    p.add_argument("--variant-flags", action="append", default=[], metavar="NAME=FLAGS",
                   help="extra litespark-train flags for one variant, e.g. moe='--num-experts 4'")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="runs of each variant, with seeds --seed, --seed + 1, ... and the same data (--data-seed "
                        "--seed): the table gives each number's mean and 95%% interval, findings.md the verdicts; "
                        "a suite may be continued with more repeats")
    p.add_argument("--report-only", action="store_true",
                   help="train nothing: write the table, findings, JSON/CSV, plots and tb/ again from the runs "
                        "recorded in --out (same command as the suite's; --variants may differ, e.g. to reorder "
                        "or leave out rows), on any machine")
    p.add_argument("--allow-degraded", action="store_true",
                   help="exit 0 even if a variant fell back (unfused attention, a fused path asked for but off); it "
                        "stays flagged DEGRADED in the table")
    return p


def parse_settings(argv: Sequence[str]) -> Settings:
    argv = list(argv)
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    ns = _build_parser().parse_args(own)
    names = parse_variant_names(ns.variants, ns.axis)
    variants = AXIS_VARIANTS[ns.axis]
    rerun = [n.strip() for n in ns.rerun.split(",") if n.strip()]
    unknown = [n for n in rerun if n not in variants]
    if unknown:
        raise UserError(f"--rerun: unknown variant(s) {', '.join(unknown)}; choose from: {', '.join(variants)}")
    variant_flags: Dict[str, List[str]] = {}
    for item in ns.variant_flags:
        name, sep, flags = item.partition("=")
        if not sep or name not in variants:
            raise UserError(f"--variant-flags {item!r}: expected NAME=FLAGS with NAME one of {', '.join(variants)}")
        variant_flags.setdefault(name, []).extend(shlex.split(flags))
    for flag in shared + [f for flags in variant_flags.values() for f in flags]:
        key = flag.split("=", 1)[0]
        if key in RESERVED_FLAGS:
            raise UserError(f"{key} is set by the suite (per variant, or by its own --precision/--train-iters/"
                            f"--log-interval/--eval-iters options): leave it out of the litespark-train flags")
    if ns.model not in arguments.PRESETS:
        raise UserError(f"unknown --model '{ns.model}'; choose one of: {', '.join(arguments.PRESETS)}")
    peft_base = _check_axis(ns, shared)
    return Settings(out=Path(ns.out), model=ns.model, variants=names, precision=ns.precision,
                    train_iters=ns.train_iters, log_interval=ns.log_interval, eval_iters=ns.eval_iters,
                    nproc=ns.nproc, mock_data=ns.mock_data, warmup_intervals=ns.warmup_intervals,
                    timeout=ns.timeout, time_budget=ns.time_budget, rerun=rerun, variant_flags=variant_flags,
                    shared=shared, allow_degraded=ns.allow_degraded, repeats=ns.repeats,
                    report_only=ns.report_only, axis=ns.axis, peft_base=peft_base, parallel=ns.parallel)


def _check_axis(ns, shared: List[str]) -> Optional[str]:
    """The fine-tuning axis's base and data against the options; its base as an absolute path (the runs' flags and
    the suite's identity name it so)."""
    if ns.axis == "pretrain":
        if ns.peft_base is not None:
            raise UserError("--peft-base is the base of --axis finetune; the pretraining axis trains from scratch: add "
                            "--axis finetune, or drop it")
        return None
    if ns.peft_base is None:
        raise UserError("--axis finetune fine-tunes a base model: give --peft-base CKPT (a pretraining run's --save "
                        "directory of the same --model, or a litespark-convert import)")
    data = {"--mock-data", "--data-path", "--embedded-corpus"} & {f.split("=", 1)[0] for f in shared}
    if ns.mock_data or data:
        raise UserError(f"{'--mock-data' if ns.mock_data else sorted(data)[0]} with --axis finetune: the fine-tuning "
                        "axis trains on SFT rows (--embedded-sft stdlib by default, or --sft-data after '--')")
    if not ns.report_only:
        from ..checkpoint_dir import latest_checkpoint_dir

        if latest_checkpoint_dir(ns.peft_base) is None:
            raise UserError(f"--peft-base {ns.peft_base}: no checkpoint there (no latest_checkpointed_iteration.txt)")
    return os.path.abspath(ns.peft_base)


# --------------------------------------------------------------------------------------------- validation
def plan(settings: Settings, plat) -> Dict[str, dict]:
    """Each requested variant's litespark-train flags and resolved configuration, validated for this machine and
    --nproc. A variant that cannot run here is planned with the reason (`cannot_run`): its row says why. Raises
    UserError, listing every reason, when no variant can run (nothing has run yet)."""
    base = arguments.resolve_quietly(settings.base_flags() + PRECISIONS[settings.precision], plat)
    arguments.check_run(base, plat, settings.nproc)
    te = base.transformer_impl == "transformer_engine"
    planned, problems = {}, []
    base_vocab = functools.lru_cache(maxsize=None)(lambda: arguments.model_vocab_size(base))
    for name in settings.variants:
        variant = settings.variant_table[name]
        flags = []
        try:
            flags = settings.base_flags() + PRECISIONS[variant.precision or settings.precision] + \
                variant.flags(base, te) + settings.variant_flags.get(name, []) + \
                ([variant.base_flag, settings.peft_base] if variant.base_flag else [])
            args = arguments.resolve_quietly(flags, plat)
            arguments.check_run(args, plat, settings.nproc)
        except UserError as e:
            problems.append(f"variant '{name}' cannot run here: {e}")
            try:  # its shape, for the parameter count of its row
                args = arguments.resolve_quietly(flags, plat) if flags else None
            except UserError:
                args = None
            planned[name] = dict(flags=flags, key=None, args=args, cannot_run=str(e), vocab=base_vocab())
            continue
        check_graph_warmup(name, args, settings)
        resolved = dict(sorted(vars(args).items()))
        key = hashlib.sha256(json.dumps(resolved, sort_keys=True, default=str).encode()).hexdigest()[:16]
        planned[name] = dict(flags=flags, key=key, args=args, seed=args.seed)
    if len(problems) == len(settings.variants):
        raise UserError("\n".join(problems))
    return planned


def check_graph_warmup(name: str, args, settings: Settings) -> None:
    """A variant with CUDA graphs captures them at the start of step --cuda-graph-warmup-steps + 1: the intervals
    left out of the time must cover that step, or the capture is timed as a step."""
    capture, left_out = arguments.cuda_graph_capture_step(args), settings.warmup_intervals * settings.log_interval
    if capture is not None and left_out < capture:
        need = -(-capture // settings.log_interval)
        raise UserError(f"variant '{name}' captures CUDA graphs (--cuda-graph-impl "
                        f"{arguments.cuda_graph_impl(args)}) in step {capture}, and --warmup-intervals "
                        f"{settings.warmup_intervals} x --log-interval {settings.log_interval} leaves out {left_out} "
                        f"step(s): give --warmup-intervals {need} or more")


def run_flags(settings: Settings, entry: dict, repeat: int) -> List[str]:
    """A variant's flags for repeat K (1-based): another model seed, the first repeat's data order."""
    if repeat == 1:
        return entry["flags"]
    return entry["flags"] + ["--seed", str(entry["seed"] + repeat - 1), "--data-seed", str(entry["seed"])]


# --------------------------------------------------------------------------------------------- state
def load_state(out: Path, identity: dict) -> dict:
    return run_state.load_state(out, STATE_FILE, STATE_VERSION, identity, entries="variants", what="suite",
                                restart="start the suite over")


def save_state(out: Path, state: dict) -> None:
    run_state.save_state(out, STATE_FILE, state)


# --------------------------------------------------------------------------------------------- running
def classify_failure(returncode, log_text: str) -> str:
    """'oom' when the run's output shows the GPU running out of memory, else 'failed'."""
    return "oom" if OOM_PATTERNS.search(log_text or "") else "failed"


def failure_summary(returncode, log_text: str) -> str:
    """One line saying why a run ended badly: the trainer's own error line, an OOM line, or the last output."""
    lines = [l.strip() for l in (log_text or "").splitlines() if l.strip()]
    for pattern in (r"^litespark-train: error: ", None):
        if pattern:
            hits = [l for l in lines if re.match(pattern, l)]
        else:
            hits = [l for l in lines if OOM_PATTERNS.search(l)]
        if hits:
            return hits[-1][:400]
    if isinstance(returncode, int) and returncode < 0:
        try:
            return f"killed by signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    if returncode == "timeout":
        return "timed out"
    return (" | ".join(lines[-3:]) or f"exit status {returncode}")[-400:]


def trainer_command(settings: Settings, argv: List[str]) -> List[str]:
    if settings.nproc == 1:
        return [sys.executable, "-m", "litespark_megatron", *argv]
    # --standalone: torchrun binds a free port itself and holds it
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(settings.nproc),
            "-m", "litespark_megatron", *argv]


def run_variant(settings: Settings, name: str, flags: List[str], log=print, gpus: Optional[str] = None) -> dict:
    """One fresh litespark-train run (on the GPUs `gpus` names, as CUDA_VISIBLE_DEVICES, when given); returns the
    state entry (status done / oom / failed)."""
    run_dir = settings.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-done run's metrics would otherwise be appended to
    run_dir.mkdir(parents=True)
    argv = flags + ["--metrics-file", str(run_dir / "metrics.jsonl"), "--tensorboard-dir", str(run_dir / "tb")]
    if settings.axis == "finetune":  # one checkpoint at the end: its size is a fine-tuning method's measurement
        argv += ["--save", str(run_dir / CHECKPOINT_DIR), "--save-interval", str(settings.train_iters)]
    cmd = trainer_command(settings, argv)
    started = time.time()
    with open(run_dir / "log.txt", "w") as out:
        out.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        out.flush()
        env = None if gpus is None else dict(os.environ, CUDA_VISIBLE_DEVICES=gpus)
        with _LIVE_LOCK:
            if _STOPPING.is_set():  # the suite is being interrupted: start nothing more
                return dict(flags=flags, returncode="interrupted", seconds=0.0, status="failed", error="interrupted")
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            _LIVE.add(proc)
        try:
            rc = proc.wait(timeout=settings.timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc = "timeout"
        except BaseException:  # the suite itself is interrupted: leave no training process behind on the GPU
            _stop(proc)
            raise
        finally:
            _LIVE.discard(proc)
    text = (run_dir / "log.txt").read_text(errors="replace")
    entry = dict(flags=flags, returncode=rc, seconds=round(time.time() - started, 1))
    if rc == 0 and _completed(run_dir / "metrics.jsonl"):
        entry["status"] = "done"
        if settings.axis == "finetune":
            entry["checkpoint_bytes"] = _checkpoint_bytes(run_dir / CHECKPOINT_DIR)
    else:
        entry["status"] = classify_failure(rc, text) if rc != 0 else "failed"
        entry["error"] = failure_summary(rc, text) if rc != 0 else "the run ended without its final record"
    return entry


CHECKPOINT_DIR = "checkpoint"
# The training processes running now (several with --parallel), for an interrupted suite to stop; once it is stopping,
# no run starts.
_LIVE: set = set()
_LIVE_LOCK = threading.Lock()
_STOPPING = threading.Event()


def _checkpoint_bytes(directory: Path) -> Optional[int]:
    """Bytes of the run's last checkpoint (the iteration directory its tracker names), or None when none was saved.
    The checkpoint is removed once measured: a suite of whole-model checkpoints (with optimizer state) per variant
    and repeat would fill the disk, and only its size is a measurement."""
    from ..checkpoint_dir import latest_checkpoint_dir

    latest = latest_checkpoint_dir(str(directory)) if directory.exists() else None
    size = sum(f.stat().st_size for f in Path(latest).rglob("*") if f.is_file()) if latest else None
    shutil.rmtree(directory, ignore_errors=True)
    return size


def _stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM first (torchrun forwards it to its workers), SIGKILL if the run has not ended after `grace` s."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stop_all(procs: Sequence[subprocess.Popen], grace: float = 30.0) -> None:
    """_stop for several runs at once: every one asked first, then each waited for."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _records(metrics: Path) -> List[dict]:
    out = []
    for line in metrics.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut by a crash: the run is then incomplete anyway
    return out


def _completed(metrics: Path) -> bool:
    """A run is complete when its end-of-run summary record (kind run, with `iterations`) is in the file."""
    return metrics.exists() and any(r.get("kind") == "run" and "iterations" in r for r in _records(metrics))


# --------------------------------------------------------------------------------------------- measurements
def _weighted(values, weights) -> Optional[float]:
    pairs = [(v, w) for v, w in zip(values, weights) if v is not None]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if pairs and total > 0 else None


def summarize_metrics(records: List[dict], warmup_intervals: int = 1, params_override: Optional[int] = None) -> dict:
    """The EfficientLLM numbers of one run from its metrics.jsonl records (docs/metrics.md, "EfficientLLM metrics").

    Intervals are the trainer's log intervals; each lasts step_time_s x its steps. The first `warmup_intervals` are
    left out when more remain. Time averages weight each interval by its seconds. None: not measured."""
    start = next((r for r in records if r.get("kind") == "run" and "params" in r), {})
    end = next((r for r in reversed(records) if r.get("kind") == "run" and "iterations" in r), {})
    train = [r for r in records if r.get("kind") == "train"]
    intervals, previous = [], 0
    for r in train:
        steps = r["step"] - previous
        previous = r["step"]
        if steps > 0 and r.get("step_time_s") is not None:
            intervals.append((r, steps, r["step_time_s"] * steps))
    used = intervals[warmup_intervals:] if len(intervals) > warmup_intervals else intervals
    seconds = [s for _, _, s in used]
    steps = sum(n for _, n, _ in used)
    total_s = sum(seconds)
    tokens = [r["tokens_per_sec"] * s for r, _, s in used]
    params = params_override or start.get("params")
    world = start.get("world_size") or 1
    gpus = [r.get("num_gpus") or 0 for r, _, _ in used]

    power_total = [r["gpu_power_w"] * g if r.get("gpu_power_w") is not None and g else None
                   for (r, _, _), g in zip(used, gpus)]
    measured_tokens = [t for (r, _, _), t in zip(used, tokens) if r.get("joules_per_token") is not None]
    joules = sum(r["joules_per_token"] * t for (r, _, _), t in zip(used, tokens) if r.get("joules_per_token") is not None)
    val = [r for r in records if r.get("kind") == "val"]
    health = backend_probe.from_metrics(records)
    out = dict(
        params=params,
        trainable_params=start.get("trainable_params"),
        flops_convention=start.get("flops_convention"),
        world_size=world,
        flops_per_token=(start["flops_per_step_full"] / start["tokens_per_step"]
                         if start.get("flops_per_step_full") and start.get("tokens_per_step") else None),
        intervals_used=len(used),
        intervals_total=len(intervals),
        steps_measured=steps,
        al_s=total_s / steps if steps else None,
        tokens_per_sec=sum(tokens) / total_s if total_s else None,
        tt=(sum(tokens) / total_s / params) if total_s and params else None,
        pcu=_weighted([r.get("mfu") for r, _, _ in used], seconds),
        pcu_causal=_weighted([r.get("mfu_causal") for r, _, _ in used], seconds),
        amu_gb=_weighted([r.get("mem_reserved_gb") for r, _, _ in used], seconds),
        peak_mem_gb=max((r["mem_max_allocated_gb"] for r, _, _ in used
                         if r.get("mem_max_allocated_gb") is not None), default=None),
        aec_w=_weighted(power_total, seconds),
        aec_w_per_gpu=_weighted([r.get("gpu_power_w") for r, _, _ in used], seconds),
        j_per_token=joules / sum(measured_tokens) if measured_tokens else None,
        energy_intervals_measured=len(measured_tokens),
        host_rss_gb=_weighted([r.get("host_rss_gb") for r, _, _ in used], seconds),
        val_loss=end.get("val_loss", val[-1]["loss"] if val else None),
        val_ppl=end.get("val_ppl", val[-1]["ppl"] if val else None),
        final_train_loss=end.get("final_loss"),
        skipped_steps=end.get("skipped_steps"),
        energy_kwh=end.get("energy_kwh"),
        attention=" + ".join(health.attention) if health else None,
        degraded="; ".join(health.degraded) if health else None,
        data=start.get("data"),
    )
    return out


def _params_of(args, vocab: Optional[int] = None) -> dict:
    """Total and active (MoE: top-k experts) parameters of the whole model, counted from its shape with the
    vocabulary megatron.training builds for it (its tokenizer's: the corpus's, not the preset's), or `vocab`."""
    from ..metrics.flops import ModelShape, param_count

    count = param_count(ModelShape.from_args(args, padded_vocab=vocab or arguments.model_vocab_size(args)))
    return dict(total=count.total, active=count.active)


# --------------------------------------------------------------------------------------------- report
METRICS = (  # (key, column title, format) in table order
    ("val_ppl", "PPL", "{:.2f}"),
    ("amu_gb", "AMU (GB)", "{:.2f}"),
    ("pcu", "PCU", "{:.1%}"),
    ("al_s", "AL (s/it)", "{:.4f}"),
    ("tt", "TT (tok/param/s)", "{:.3g}"),
    ("aec_w", "AEC (W)", "{:.0f}"),
    ("j_per_token", "J/token", "{:.4g}"),
    ("tokens_per_sec", "tokens/s", "{:,.0f}"),
    ("peak_mem_gb", "peak alloc (GB)", "{:.2f}"),
)
# The fine-tuning axis's table: EfficientLLM's fine-tuning metrics (AMU, PCU, AL, AEC, loss) with tokens/s, J/token,
# peak memory and the checkpoint a method saves; PCU there is MFU in the trainer's "peft" FLOP convention.
FINETUNE_METRICS = (
    ("val_loss", "val loss", "{:.4f}"),
    ("amu_gb", "AMU (GB)", "{:.2f}"),
    ("pcu", "PCU", "{:.1%}"),
    ("al_s", "AL (s/it)", "{:.4f}"),
    ("tokens_per_sec", "tokens/s", "{:,.0f}"),
    ("aec_w", "AEC (W)", "{:.0f}"),
    ("j_per_token", "J/token", "{:.4g}"),
    ("peak_mem_gb", "peak alloc (GB)", "{:.2f}"),
    ("checkpoint_mb", "checkpoint (MB)", "{:,.2f}"),
)
# The numbers given with their spread over repeats (mean and 95% interval; findings.py).
SPREAD_KEYS = ("val_ppl", "val_loss", "amu_gb", "peak_mem_gb", "pcu", "pcu_causal", "al_s", "tt", "tokens_per_sec",
               "aec_w", "aec_w_per_gpu", "j_per_token", "checkpoint_mb")
CSV_FIELDS = ("variant", "status", "same_run_as", "what", "params", "params_active", "repeats_done", "val_ppl",
              "val_loss", "amu_gb", "peak_mem_gb", "pcu", "pcu_causal", "al_s", "tt", "tokens_per_sec", "aec_w",
              "aec_w_per_gpu", "j_per_token", "val_ppl_ci95", "amu_gb_ci95", "pcu_ci95", "al_s_ci95",
              "tokens_per_sec_ci95", "j_per_token_ci95", "tokens_per_sec_range", "flops_per_token", "energy_kwh",
              "trainable_params", "flops_convention", "checkpoint_mb", "val_loss_ci95",
              "host_rss_gb", "intervals_used", "steps_measured", "attention", "degraded", "data", "error", "flags")


def _run_summary(settings: Settings, run_id: str, counts: dict) -> Optional[dict]:
    metrics = settings.out / "runs" / run_id / "metrics.jsonl"
    if not metrics.exists():
        return None
    records = _records(metrics)
    world = next((r.get("world_size") for r in records if r.get("kind") == "run" and "params" in r), 1)
    # The run record counts rank 0's parameters: the whole model only on one process.
    override = counts["total"] if (world or 1) > 1 else None
    summary = summarize_metrics(records, settings.warmup_intervals, params_override=override)
    summary["params_source"] = "run record" if override is None else "parameter count of the shape"
    return summary


def collect_rows(settings: Settings, planned: Dict[str, dict], state: dict) -> List[dict]:
    """One row per variant: the mean of each number over its finished repeats, its spread (`spread`: n, mean, min,
    max, 95% interval) and the status of the whole (done when every repeat is)."""
    from .findings import interval

    rows = []
    for name in settings.variants:
        entry = planned[name]
        row = dict(variant=name, what=settings.variant_table[name].what, status="not run", same_run_as=None,
                   flags=" ".join(entry["flags"]), error=None, repeats_done=0, spread={})
        args = entry.get("args")
        counts = _params_of(args, entry.get("vocab")) if args is not None else dict(total=None, active=None)
        if entry.get("cannot_run"):
            row.update(status=CANNOT_RUN, error=entry["cannot_run"])
        else:
            summaries, statuses, errors = [], [], []
            for run_id in settings.run_ids(name):
                recorded = state["variants"].get(run_id, {})
                source = recorded.get("same_as") or run_id
                if recorded.get("same_as"):
                    row["same_run_as"] = variant_of(source)
                source_entry = state["variants"].get(source, {})
                statuses.append(source_entry.get("status", "not run"))
                if source_entry.get("gpus") and source_entry.get("status") == "done":
                    row.setdefault("gpus", []).append(source_entry["gpus"])
                summary = _run_summary(settings, source, counts) if statuses[-1] == "done" else None
                if summary is not None:
                    size = source_entry.get("checkpoint_bytes")
                    summary["checkpoint_mb"] = size / 1e6 if size is not None else None
                    summaries.append(summary)
                elif source_entry.get("error"):
                    errors.append(source_entry["error"])
            row["repeats_done"] = len(summaries)
            if len(summaries) == settings.repeats:
                row["status"] = "done"
            elif summaries:
                row["status"] = f"{len(summaries)} of {settings.repeats} repeats done"
            else:
                row["status"] = next((st for st in statuses if st != "not run"), "not run")
            row["error"] = errors[-1] if errors else None
            if summaries:
                row.update(summaries[0])
                for key in SPREAD_KEYS:
                    spread = interval([m.get(key) for m in summaries])
                    row[key] = spread.mean if spread else None
                    row["spread"][key] = spread
                row["degraded"] = "; ".join(sorted({m["degraded"] for m in summaries if m.get("degraded")}))
                row["data"] = " | ".join(sorted({m["data"] for m in summaries if m.get("data")})) or None
        if "params" not in row or row["params"] is None:
            row["params"] = counts["total"]
            row["params_source"] = "parameter count of the shape"
        # MoE: the parameters one token runs through (router, top-k experts, shared experts, the rest).
        row["params_active"] = counts["active"] if args is not None and args.num_experts else row["params"]
        rows.append(row)
    return rows


def _fmt_spread(row: dict, key: str, spec: str) -> str:
    text = _fmt(row.get(key), spec)
    spread = row["spread"].get(key)
    if spread is not None and spread.half_width is not None and spread.mean:
        text += f" ±{spread.half_width / abs(spread.mean):.1%}"
    return text


def _fmt(value, spec: str) -> str:
    if value is None:
        return "not measured"
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    return spec.format(value)


def table_metrics(settings: Settings) -> tuple:
    return FINETUNE_METRICS if settings.axis == "finetune" else METRICS


def markdown_table(rows: List[dict], settings: Settings, device: str) -> str:
    metrics = table_metrics(settings)
    head = ["variant", "params"] + [title for _, title, _ in metrics] + ["attention", "status"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        params = f"{r['params'] / 1e6:,.1f}M" if r.get("params") else "?"
        if r.get("params_active") and r.get("params") and r["params_active"] != r["params"]:
            params += f" ({r['params_active'] / 1e6:,.1f}M active)"
        if settings.axis == "finetune" and r.get("trainable_params") is not None:
            params += f", {r['trainable_params'] / 1e6:,.3f}M trainable"
        status = r["status"] + (f" (same run as {r['same_run_as']})" if r.get("same_run_as") else "")
        if not r["repeats_done"]:
            cells = [r["status"].upper() if r["status"] == "oom" else "-" for _ in metrics] + ["-"]
            status += f": {r.get('error') or ''}".rstrip(": ")
        else:
            cells = [_fmt_spread(r, key, spec) for key, _, spec in metrics] + [r.get("attention") or "not recorded"]
            if r.get("degraded"):
                status += f", DEGRADED: {r['degraded']}"
        lines.append("| " + " | ".join([r["variant"], params] + cells + [status.replace("|", "/")]) + " |")
    notes = []
    if settings.repeats > 1:
        # Each measured configuration once (rows that share a run repeat its spread).
        spreads = sorted({r["variant"] if not r.get("same_run_as") else r["same_run_as"]:
                          r["spread"]["tokens_per_sec"].relative_range for r in rows
                          if r["repeats_done"] > 1 and r["spread"].get("tokens_per_sec")}.items(),
                         key=lambda item: -item[1])
        notes.append(f"{settings.repeats} repeats per variant (seeds --seed, --seed + 1, ...; the same data): each "
                     "number is the mean, ± the half-width of its 95% confidence interval (Student's t), relative; "
                     "min and max in efficiency.json." +
                     (" Spread of tokens/s between repeats, (max - min) / mean: " +
                      ", ".join(f"{name} {spread:.1%}" for name, spread in spreads) + "." if spreads else ""))
    beside = sorted({g for r in rows for g in r.get("gpus", [])})
    if beside:
        notes.append(f"Runs ran side by side (--parallel), each on its own GPU(s) of the machine (CUDA_VISIBLE_DEVICES "
                     f"{', '.join(beside)}; suite_state.json says which run had which), sharing its CPUs and disks: a "
                     f"host-bound step can be slower beside other runs than alone.")
    data = {}
    for r in rows:
        if r["repeats_done"] and r.get("data"):
            data.setdefault(r["data"], []).append(r["variant"])
    if len(data) == 1:
        notes.append(f"Data of every run: {next(iter(data))}.")
    elif data:  # runs on other machines (another Python's standard library) or other data flags
        notes.append("**The runs did not all train on the same data**: " +
                     "; ".join(f"{d} ({', '.join(names)})" for d, names in data.items()) + ".")
    if settings.axis == "finetune":
        notes += [
            f"Fine-tuning axis: every variant starts from `{settings.peft_base}` (`{settings.model}`) and trains "
            f"{settings.train_iters} steps, precision {settings.precision}, {settings.nproc} process(es) on {device}; "
            f"recipe `{' '.join(FINETUNE_RECIPE)}`; shared flags: `{' '.join(settings.shared) or '(none)'}`.",
            f"Intervals of {settings.log_interval} steps; the first {settings.warmup_intervals} left out of the time "
            f"averages when more remain. val loss: validation loss per response token at the end "
            f"({settings.eval_iters} batches). tokens/s and J/token count the rows' non-padding tokens. PCU: "
            "time-averaged MFU in the trainer's FLOP convention (`peft` for the PEFT variants: no weight gradient for "
            "frozen weights, forward only below the lowest trainable layer; `standard` for full). trainable: the "
            "parameters the optimizer updates. checkpoint: the bytes of the checkpoint the run saves at its end "
            "(full: the model and its optimizer state; the LoRA family: the adapters and theirs, "
            "--save-adapters-only; freeze: the model and the trained layers' optimizer state). Definitions: "
            "docs/metrics.md, 'EfficientLLM metrics'.",
            "\"not measured\": the trainer could not measure it on this machine (GPU memory, MFU and power need a "
            "GPU; MFU needs a known peak or --peak-tflops).",
        ]
        return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n"
    notes += [
        f"Base `{settings.model}`, {settings.train_iters} steps per variant, precision {settings.precision} unless "
        f"the variant is a precision, {settings.nproc} process(es) on {device}; shared flags: "
        f"`{' '.join(settings.shared) or '(none)'}`.",
        f"Intervals of {settings.log_interval} steps; the first {settings.warmup_intervals} left out of the time "
        f"averages when more remain. PPL: validation perplexity at the end ({settings.eval_iters} batches). "
        "AMU: time-averaged GPU memory reserved; PCU: time-averaged MFU (model FLOPs, attention counted in full, "
        "dense BF16 peak for FP8); AL: seconds per iteration; TT: tokens / parameter / second (total parameters); "
        "AEC: time-averaged GPU power of the job; J/token: GPU energy per training token. Definitions: "
        "docs/metrics.md, 'EfficientLLM metrics'.",
        "\"not measured\": the trainer could not measure it on this machine (GPU memory, MFU and power need a GPU; "
        "MFU needs a known peak or --peak-tflops).",
    ]
    return "\n".join(lines) + "\n\n" + "\n\n".join(notes) + "\n"


def write_json_csv(rows: List[dict], settings: Settings, device: str) -> None:
    doc = dict(settings=settings.identity() | dict(variants=settings.variants, repeats=settings.repeats,
                                                   warmup_intervals=settings.warmup_intervals),
               device=device, definitions_doc="docs/metrics.md#efficientllm-metrics",
               variants=[dict(r, spread={k: v.as_dict() for k, v in r["spread"].items() if v is not None})
                         for r in rows])
    (settings.out / "efficiency.json").write_text(json.dumps(doc, indent=1, default=str))
    with open(settings.out / "efficiency.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            flat = dict(r)
            for key, spread in r["spread"].items():
                if spread is not None:
                    flat[f"{key}_ci95"] = spread.half_width
                    flat[f"{key}_range"] = f"{spread.min}-{spread.max}"
            writer.writerow({k: ("" if flat.get(k) is None else flat.get(k)) for k in CSV_FIELDS})


def write_plots(rows: List[dict], out: Path) -> List[Path]:
    """PNG trade-off plots. A variant whose metric was not measured (or whose run failed) is left out, and the
    figure says so; a plot with no measured point at all is still written, saying why it is empty."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = out / "plots"
    shutil.rmtree(plots, ignore_errors=True)
    plots.mkdir(parents=True)
    # One point/bar per training run: variants measured by the same run share it ("dense=gqa").
    done, failed = [], [f"{r['variant']} ({r['status']})" for r in rows if not r["repeats_done"]]
    names = {r["variant"] for r in rows}
    for r in rows:
        if r["repeats_done"] and r.get("same_run_as") not in names:
            twins = [t["variant"] for t in rows if t.get("same_run_as") == r["variant"]]
            done.append(dict(r, variant="=".join([r["variant"]] + twins)))
    written = []
    repeated = any(v is not None and v.half_width is not None for r in done for v in r["spread"].values())

    def error(r, key, scale=1.0):
        """The 95% interval's half-width of a mean over repeats (0: one run, no interval)."""
        spread = r["spread"].get(key)
        return spread.half_width * scale if spread is not None and spread.half_width is not None else 0.0

    def finish(fig, ax, name, left_out, title):
        notes = []
        if repeated:
            notes.append("error bars: 95% interval of the mean over the repeats (Student's t)")
        if left_out:
            notes.append("not measured (GPU memory, MFU and power need a GPU), left out: " + ", ".join(left_out))
        if failed:
            notes.append("no result: " + ", ".join(failed))
        if notes:
            fig.text(0.01, 0.01, "\n".join(notes), fontsize=8, color="0.35", va="bottom", wrap=True)
        ax.set_title(title)
        fig.tight_layout(rect=(0, 0.06 * len(notes), 1, 1))
        path = plots / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

    def scatter(xkey, ykey, xlabel, ylabel, name, title):
        fig, ax = plt.subplots(figsize=(7, 5))
        have = [r for r in done if r.get(xkey) is not None and r.get(ykey) is not None]
        left_out = [r["variant"] for r in done if r not in have]
        for r in have:
            ax.errorbar(r[xkey], r[ykey], xerr=error(r, xkey), yerr=error(r, ykey), fmt="o", markersize=8, capsize=3)
            ax.annotate(r["variant"], (r[xkey], r[ykey]), textcoords="offset points", xytext=(6, 4))
        if not have:
            ax.text(0.5, 0.5, "no variant has both values measured", ha="center", va="center",
                    transform=ax.transAxes, color="0.4")
        ax.margins(0.15)  # room for the labels of the outermost points
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        finish(fig, ax, name, left_out, title)

    def bars(key, label, name, title, scale=1.0):
        fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(done) + 2), 4.5))
        have = [r for r in done if r.get(key) is not None]
        left_out = [r["variant"] for r in done if r not in have]
        ax.bar([r["variant"] for r in have], [r[key] * scale for r in have], color="tab:blue",
               yerr=[error(r, key, scale) for r in have], capsize=4, ecolor="0.2")
        for i, r in enumerate(have):
            ax.annotate(f"{r[key] * scale:.3g}", (i, (r[key] + error(r, key)) * scale), ha="center", va="bottom",
                        fontsize=8)
        if not have:
            ax.text(0.5, 0.5, "not measured for any variant", ha="center", va="center", transform=ax.transAxes,
                    color="0.4")
        ax.set_ylabel(label)
        if len(have) > 5:
            ax.tick_params(axis="x", labelrotation=20)
        ax.grid(axis="y", alpha=0.3)
        finish(fig, ax, name, left_out, title)

    scatter("j_per_token", "val_ppl", "GPU energy per training token (J)", "validation perplexity",
            "ppl_vs_joules_per_token.png", "Perplexity vs energy (lower-left is better)")
    scatter("al_s", "amu_gb", "AL: seconds per iteration", "AMU: time-averaged GPU memory (GB)",
            "memory_vs_latency.png", "Memory vs latency (lower-left is better)")
    bars("pcu", "PCU: time-averaged MFU (%)", "pcu_per_variant.png", "Compute utilization per variant", scale=100)
    bars("al_s", "AL: seconds per iteration", "latency_per_variant.png", "Latency per variant")
    bars("tt", "TT: tokens / parameter / second", "tt_per_variant.png", "Training throughput per parameter")
    bars("val_ppl", "validation perplexity", "ppl_per_variant.png", "Perplexity after the same steps")
    return written


def write_tensorboard(rows: List[dict], out: Path, table: str) -> None:
    """One TensorBoard run per variant under OUT/tb/<variant>: scalars suite/<metric> (measured ones only) at the
    step count, the flags as text; OUT/tb/summary holds the table."""
    from torch.utils.tensorboard import SummaryWriter

    tb = out / "tb"
    shutil.rmtree(tb, ignore_errors=True)  # rewritten from the state every time: no duplicated points
    for r in rows:
        writer = SummaryWriter(log_dir=str(tb / r["variant"]))
        step = r.get("steps_measured") or 0
        if r["repeats_done"]:
            for key in ("val_ppl", "amu_gb", "peak_mem_gb", "pcu", "pcu_causal", "al_s", "tt", "tokens_per_sec",
                        "aec_w", "aec_w_per_gpu", "j_per_token", "params", "val_loss", "trainable_params",
                        "checkpoint_mb"):
                value = r.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    writer.add_scalar(f"suite/{key}", value, step)
        writer.add_text("suite/config", f"status: {r['status']}\n\n`{r['flags']}`", step)
        writer.close()
    writer = SummaryWriter(log_dir=str(tb / "summary"))
    writer.add_text("suite/table", table, 0)
    writer.close()


def write_report(settings: Settings, planned: Dict[str, dict], state: dict, device: str) -> List[dict]:
    from . import findings

    rows = collect_rows(settings, planned, state)
    table = markdown_table(rows, settings, device)
    axis = " (fine-tuning axis)" if settings.axis == "finetune" else ""
    (settings.out / "efficiency.md").write_text(f"# Efficiency suite: {settings.model}{axis}\n\n" + table)
    spreads = {r["variant"]: r["spread"] for r in rows}
    header = (f"# EfficientLLM's findings against this suite: {settings.model}, {settings.repeats} repeat(s), "
              f"{settings.train_iters} steps per run, on {device}")
    (settings.out / "findings.md").write_text(findings.markdown(findings.evaluate(spreads, settings.axis), header))
    write_json_csv(rows, settings, device)
    write_plots(rows, settings.out)
    write_tensorboard(rows, settings.out, table)
    return rows


def _recorded_device(settings: Settings, state: dict) -> str:
    """Where the recorded runs ran: the suite state says it; a state written before it did, the first run's
    metrics (the run record's device, the health record's device type)."""
    if state.get("device"):
        return state["device"]
    for run_id, entry in state["variants"].items():
        metrics = settings.out / "runs" / run_id / "metrics.jsonl"
        if entry.get("status") == "done" and metrics.exists():
            records = _records(metrics)
            name = next((r["device"] for r in records if r.get("kind") == "run" and r.get("device")), None)
            kind = next((r["device_type"] for r in records if r.get("kind") == "health" and r.get("device_type")),
                        None)
            if name:
                return f"{name} ({kind})" if kind else name
    return "an unrecorded device"


def recorded_plan(settings: Settings, state: dict) -> Dict[str, dict]:
    """The plan of runs made before (--report-only): each variant's flags as its first run recorded them, resolved
    here only for its shape (parameter counts); a variant that could not run keeps its reason."""
    planned = {}
    for name in settings.variants:
        entry = state["variants"].get(name, {})
        flags = entry.get("flags") or []
        try:
            args = arguments.resolve_quietly(flags) if flags else None
        except UserError:
            args = None  # flags this machine cannot parse: the row's parameters come from its run record
        if args is not None:
            arguments.default_tokenizer(args)  # what check_run would set: the vocabulary of the parameter count
        planned[name] = dict(flags=flags, key=entry.get("key"), args=args)
        if entry.get("status") == CANNOT_RUN:
            planned[name]["cannot_run"] = entry.get("error") or ""
    return planned


def report_recorded(settings: Settings, log=print) -> int:
    """--report-only: the report of the runs recorded in --out, written again; nothing trains."""
    if not (settings.out / STATE_FILE).exists():
        raise UserError(f"{settings.out} holds no suite ({STATE_FILE} is missing): --report-only rewrites the "
                        f"report of runs made before; run the suite without it first")
    state = load_state(settings.out, settings.identity())
    write_report(settings, recorded_plan(settings, state), state, _recorded_device(settings, state))
    log((settings.out / "efficiency.md").read_text())
    log(f"wrote {settings.out / 'efficiency.md'}, findings.md, efficiency.json, efficiency.csv, plots/, tb/ "
        f"(from the recorded runs)")
    return 0


# --------------------------------------------------------------------------------------------- main
def run_suite(settings: Settings, log=print) -> int:
    from .. import platform

    if settings.report_only:
        return report_recorded(settings, log)
    plat = platform.detect()
    planned = plan(settings, plat)  # raises before anything runs when no variant can run
    groups = gpu_groups(settings.parallel, settings.nproc, visible_gpus() if settings.parallel > 1 else [])
    settings.out.mkdir(parents=True, exist_ok=True)
    state = load_state(settings.out, settings.identity())
    device = state["device"] = f"{plat.device_name} ({plat.device_type})"
    for name, entry in planned.items():
        if entry.get("cannot_run"):
            log(f"{name}: cannot run here: {entry['cannot_run']}")
            state["variants"].setdefault(name, dict(status=CANNOT_RUN, error=entry["cannot_run"],
                                                    flags=entry["flags"]))

    def kept(run_id: str, entry: dict) -> bool:
        """A recorded outcome a resumed suite keeps: done with its complete metrics, or out of memory."""
        if entry.get("same_as") or variant_of(run_id) in settings.rerun or entry.get("status") not in FINAL:
            return False
        return entry["status"] == "oom" or _completed(settings.out / "runs" / run_id / "metrics.jsonl")

    # Runs that resolve to the same configuration (e.g. dense and gqa on a GQA preset) are measured once.
    runner_for = {}
    for run_id, entry in state["variants"].items():
        if kept(run_id, entry):
            runner_for.setdefault(entry.get("key"), run_id)
    # (run_id, variant, repeat, key, flags) in launch order: every variant once, then the second repeats, ...
    jobs = []
    for repeat in range(1, settings.repeats + 1):
        for name in settings.variants:
            if planned[name].get("cannot_run"):
                continue
            run_id = settings.run_ids(name)[repeat - 1]
            if _an_earlier_repeat_ran_out_of_memory(settings, state, name, repeat):
                continue  # another seed would run out of memory as well
            key = planned[name]["key"] + ("" if repeat == 1 else f"/r{repeat}")
            flags = run_flags(settings, planned[name], repeat)
            entry = state["variants"].get(run_id, {})
            runner = runner_for.get(key)
            if runner and runner != run_id:
                state["variants"][run_id] = dict(key=key, same_as=runner, flags=flags)
                save_state(settings.out, state)
                log(f"{run_id}: same configuration as {runner}, measured once")
                continue
            runner_for.setdefault(key, run_id)
            if kept(run_id, entry) and entry.get("key") == key:
                log(f"{run_id}: already {entry['status']}, skipped")
                continue
            jobs.append((run_id, name, repeat, key, flags))
    stopped = _run_jobs(settings, jobs, state, groups, log)
    rows = write_report(settings, planned, state, device)
    log((settings.out / "efficiency.md").read_text())
    log(f"wrote {settings.out / 'efficiency.md'}, findings.md, efficiency.json, efficiency.csv, plots/, tb/")
    if stopped:
        log(f"--time-budget reached: not started {', '.join(stopped)}; run the same command again to continue")
        return 3
    degraded = [f"{r['variant']}: {r['degraded']}" for r in rows if r["repeats_done"] and r.get("degraded")]
    for what in degraded:
        log(f"DEGRADED variant {what}" +
            ("" if settings.allow_degraded else " (fix the environment, or pass --allow-degraded to accept it)"))
    return 0 if all(r["status"] == "done" for r in rows) and (settings.allow_degraded or not degraded) else 1


def _an_earlier_repeat_ran_out_of_memory(settings: Settings, state: dict, name: str, repeat: int) -> bool:
    return any(state["variants"].get(r, {}).get("status") == "oom" for r in settings.run_ids(name)[:repeat - 1])


def visible_gpus() -> List[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), else 0 .. count - 1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_groups(parallel: int, nproc: int, gpus: Sequence[str]) -> List[Optional[str]]:
    """The CUDA_VISIBLE_DEVICES of each of `parallel` run slots, `nproc` GPUs apiece; [None] (the run sees what the
    suite sees) when runs go one at a time."""
    if parallel == 1:
        return [None]
    if parallel * nproc > len(gpus):
        raise UserError(f"--parallel {parallel} with --nproc {nproc} needs {parallel * nproc} GPUs, one set per run, "
                        f"and this machine shows {len(gpus)}" +
                        (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                         if "CUDA_VISIBLE_DEVICES" in os.environ else "") +
                        f": use --parallel {max(1, len(gpus) // nproc)} or fewer")
    return [",".join(gpus[k * nproc:(k + 1) * nproc]) for k in range(parallel)]


def _run_jobs(settings: Settings, jobs: list, state: dict, groups: List[Optional[str]], log) -> List[str]:
    """Run the planned runs, --parallel at a time, each on its own GPUs; record each outcome in the state as it
    comes. A repeat waits for its variant's earlier repeats (one that ran out of memory means the later ones would
    too). Returns the runs the time budget left unstarted. Interrupted, it stops every run it started."""
    free, pending, started_at, stopped = list(groups), list(jobs), time.time(), []
    running: Dict[str, tuple] = {}  # run_id -> (future, gpus, key)
    done_events: "queue.Queue[str]" = queue.Queue()

    def startable(run_id: str, name: str, repeat: int) -> bool:
        """Not when an earlier repeat ran out of memory, nor past the time budget (then it is one `stopped`)."""
        if _an_earlier_repeat_ran_out_of_memory(settings, state, name, repeat):
            return False
        if settings.time_budget is not None and time.time() - started_at > settings.time_budget:
            stopped.append(run_id)
            return False
        return True

    def waiting_for_an_earlier_repeat(name: str, repeat: int) -> bool:
        earlier = set(settings.run_ids(name)[:repeat - 1])
        return any(j[0] in earlier for j in pending) or any(r in earlier for r in running)

    def launch(run_id, name, key, flags, gpus):
        state["variants"][run_id] = dict(key=key, status="running", flags=flags,
                                         started=time.strftime("%Y-%m-%dT%H:%M:%S"), **({"gpus": gpus} if gpus else {}))
        save_state(settings.out, state)  # a crash from here on leaves it 'running': the next invocation re-runs it
        log(f"{run_id}: training ({settings.variant_table[name].what})" + (f" on GPU {gpus}" if gpus else "") + " ...")

    def record(run_id, key, gpus, result):
        state["variants"][run_id] = dict(key=key, **result, **({"gpus": gpus} if gpus else {}))
        save_state(settings.out, state)
        log(f"{run_id}: {result['status']} in {result['seconds']:.0f} s" +
            (f": {result['error']}" if result.get("error") else ""))

    if groups == [None]:  # one at a time, in this thread: an interruption reaches run_variant, which stops its run
        for run_id, name, repeat, key, flags in jobs:
            if not startable(run_id, name, repeat):
                continue
            launch(run_id, name, key, flags, None)
            record(run_id, key, None, run_variant(settings, run_id, flags))
        return stopped
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(groups))
    try:
        while pending or running:
            for job in list(pending):
                run_id, name, repeat, key, flags = job
                if not free:
                    break
                if waiting_for_an_earlier_repeat(name, repeat):
                    continue
                pending.remove(job)
                if not startable(run_id, name, repeat):
                    continue
                gpus = free.pop(0)
                launch(run_id, name, key, flags, gpus)
                future = pool.submit(run_variant, settings, run_id, flags, gpus=gpus)
                future.add_done_callback(lambda _, r=run_id: done_events.put(r))
                running[run_id] = (future, gpus, key)
            if not running:
                continue
            try:
                run_id = done_events.get(timeout=1.0)  # (a timeout keeps Ctrl-C and SIGTERM prompt)
            except queue.Empty:
                continue
            future, gpus, key = running.pop(run_id)
            free.append(gpus)
            record(run_id, key, gpus, future.result())
    except BaseException:
        with _LIVE_LOCK:
            _STOPPING.set()
            training = list(_LIVE)
        _stop_all(training)  # their threads then return, and nothing records them: they run again when resumed
        raise
    finally:
        pool.shutdown(wait=True)
        _STOPPING.clear()
    return stopped


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def inference_axis_argv(argv: Sequence[str]) -> Optional[List[str]]:
    """The inference benchmark's arguments when `argv` asks for --axis inference (argv less that option); None for a
    training axis. Refused: flags after '--' (the inference axis trains nothing)."""
    argv = list(argv)
    own = argv[: argv.index("--")] if "--" in argv else argv
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    probe.add_argument("--axis")
    try:
        axis, rest = probe.parse_known_args(own)
    except argparse.ArgumentError:  # "--axis" without a value: the suite's own parser says so
        return None
    if axis.axis != "inference":
        return None
    if "--" in argv:
        raise UserError("--axis inference runs no litespark-train: the flags after '--' have no run to go to; give "
                        "the inference benchmark's options (--axis inference --help)")
    return rest


def main(argv: Optional[Sequence[str]] = None) -> int:
    from ..platform import quiet_library_noise

    quiet_library_noise()
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        inference = inference_axis_argv(argv)
    except UserError as e:
        print(f"{INFERENCE_PROG}: error: {e}", file=sys.stderr, flush=True)
        return 2
    if inference is not None:
        from . import inference_bench

        return inference_bench.main(inference, prog=INFERENCE_PROG)
    # A SIGTERM (a job scheduler, `timeout`) unwinds like Ctrl-C, so the running variant's process is stopped too.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        settings = parse_settings(argv)
        return run_suite(settings)
    except UserError as e:
        for line in str(e).splitlines():
            print(f"efficiency_suite: error: {line}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("efficiency_suite: interrupted; the variant that was running will run again when the same command "
              "is repeated", file=sys.stderr, flush=True)
        return 130
