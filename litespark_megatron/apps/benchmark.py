"""Training throughput, memory and energy of Litespark, stock Megatron-Core and HF transformers on one GPU.

    python tools/benchmark.py --out runs/bench      # llama-3b, seq 4096, micro-batch 2, the five default systems
    python tools/benchmark.py --systems hf-eager,litespark-bf16 --best-micro-batch --global-batch-size 8
    python tools/benchmark.py --systems litespark-fp8,stock-te-fp8 --best-micro-batch --micro-batch-candidates 4,8

Every system trains the same model shape on random tokens, uniform over the vocabulary (same sequence length, same
tokens per optimizer step; the megatron systems read them from an indexed dataset written once per benchmark, the HF
systems draw them in the worker). Token values do change FP8 speed: on megatron-core's mock dataset (counting
sequences, which a model learns within steps) Litespark FP8 ran slower and less repeatably than on random tokens
(docs/benchmarks/2026-11-23-megatron-training-base-h200.md). Each system runs in a FRESH process, so that GPU
memory, compile caches and megatron-core's global state never carry over from one system to the next. A worker runs
`--warmup` steps, then `--steps` timed steps (wall time, with a CUDA synchronize after every step), and reports:

* tokens/s, and model TFLOP/s per GPU from the exact counter (`metrics.flops.training_flops_per_step`: logits
  included, attention counted in full, and also causal-halved);
* MFU against the dense BF16 peak of the GPU (`metrics.peaks.detect_peak`, or `--peak-tflops`), also for FP8;
* peak allocated GPU memory (`torch.cuda.max_memory_allocated`, the whole worker), and in the notes and the JSON the
  peak reserved (`torch.cuda.max_memory_reserved`: cached blocks and CUDA graphs' pools included);
* mean GPU power and J/token from NVML's total-energy counter over the timed steps only (`EnergyMeter`);
* the tokens/s and J/token ratios to the HF eager baseline, and to the best stock row of the same precision: the
  fastest stock Megatron-Core row that did not fall back, a `--variant` of stock-te included (CUDA graphs, FP8
  attention, ...), so that Litespark is compared with the best stock configuration measured, not the default.

Systems (`--systems`, comma list):

* `hf-eager`, `hf-compile`, `hf-liger`: HF transformers `LlamaForCausalLM` built from a `LlamaConfig` of the same
  shape, SDPA attention, bf16 parameters, `torch.optim.AdamW(fused=True)`, gradient clipping at 1.0, gradient
  accumulation for several micro-batches; `hf-compile` wraps the model in `torch.compile`; `hf-liger` patches in
  Liger-Kernel (`apply_liger_kernel_to_llama`'s defaults: Triton RMSNorm, SwiGLU and RoPE, and the fused linear
  cross-entropy), checks on the model that each took, and names them in its row. They need `pip install
  transformers` (and `liger-kernel` for hf-liger, a CUDA GPU), which are not dependencies of this package.
* `litespark-bf16`, `litespark-fp8` (FP8 hybrid, delayed scaling), `stock-te-bf16`, `stock-te-fp8`,
  `litespark-local-bf16` (the no-TE backend): trained by litespark-train itself (megatron.training's loop, in the
  worker process) on megatron-core's mock data, one process, megatron micro-batching; each step's time (with a
  device synchronize), energy and memory come from its metrics.jsonl (one log interval per step).

`--variant NAME=SYSTEM:FLAGS` adds a system that is SYSTEM plus some litespark-train flags (a recipe, a fusion,
a recompute setting), so that one change is measured side by side with what it changes, in the same run. FLAGS may
start with VAR=value words, as a shell command may: that system's worker runs with them in its environment (e.g.
Transformer Engine's cuDNN norms, `NVTE_NORM_FWD_USE_CUDNN=1 NVTE_NORM_BWD_USE_CUDNN=1`, for a best-stock row).

What each system ran is part of its row (backend_probe.py): the attention kernel, observed on an untimed step (the
trainer's first; for HF one more after the timed ones) (TE's FusedAttention / FlashAttention /
UnfusedDotProductAttention with the cuDNN TE loaded; the kernel torch's SDPA picked), and its fused paths (cross-entropy, RoPE, weight-gradient accumulation). A system that fell
back is flagged DEGRADED and the benchmark exits 1 unless --allow-degraded; before anything runs, a fresh process
checks that TE's fused attention works here for the model's head shape, and the benchmark refuses to start if not.

A system that cannot run (no Transformer Engine, no FP8, out of memory, an import error, a timeout) is reported
as failed with a one-line reason; the others still run. Without CUDA everything runs in fp32 on the CPU (no bf16
tensor cores to measure) and the GPU-only columns read "n/a", so the tool can be checked end to end anywhere.
Writes OUT/benchmark.md and OUT/benchmark.json (raw numbers) with `--out`, worker logs in OUT/logs.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .. import backend_probe
from ..arguments import cuda_graph_capture_step, cuda_graph_impl, resolve_quietly
from ..errors import ConfigError, UserError
from ..spec_choice import SpecChoice
from .hf_model import build_hf_llama, hf_adamw, token_batches

BASELINE = "hf-eager"
MICRO_BATCH_CANDIDATES = (1, 2, 4, 8)
# With --best-micro-batch and no --global-batch-size: the largest candidate, so that every candidate runs.
BEST_MICRO_BATCH_GLOBAL_DEFAULT = 8
# Optimizer settings shared by every system: litespark-train's defaults, constant LR so every step does the same.
LR, WEIGHT_DECAY, BETAS, EPS, CLIP_GRAD = 3e-4, 0.1, (0.9, 0.95), 1e-8, 1.0
_FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "delayed")
_TE = ("--spec", "litespark", "--transformer-impl", "transformer_engine")
PREFLIGHT_TIMEOUT = 300  # seconds for the fused-attention check: importing TE and one small attention call


@dataclass(frozen=True)
class System:
    kind: str                   # "hf" or "megatron"
    flags: Tuple[str, ...]      # litespark-train flags that select spec, backend and precision (megatron)
    description: str
    compile: bool = False       # hf: torch.compile the model
    needs_te: bool = False
    liger: bool = False         # hf: Liger-Kernel's Triton kernels patched in (liger_kernels)
    env: Tuple[Tuple[str, str], ...] = ()  # environment variables of its worker (a variant's VAR=value tokens)


SYSTEMS: Dict[str, System] = {
    "hf-eager": System("hf", (), "HF transformers LlamaForCausalLM, SDPA attention, eager; torch AdamW (fused on "
                                 "GPU), parameters, gradients and optimizer states in the parameter dtype"),
    "hf-compile": System("hf", (), "as hf-eager, model under torch.compile (compilation falls in the warm-up "
                                   "steps)", compile=True),
    "hf-liger": System("hf", (), "as hf-eager, with Liger-Kernel's Triton RMSNorm, SwiGLU, RoPE and fused linear "
                                 "cross-entropy (logits never materialized): what a speed-minded HF user runs",
                       liger=True),
    "litespark-bf16": System("megatron", _TE,
                             "Litespark layers, Transformer Engine backend, Litespark's cross-entropy, RMSNorm and "
                             "RoPE kernels (their default on a GPU)", needs_te=True),
    "litespark-fp8": System("megatron", _TE + _FP8,
                            "Litespark layers, Transformer Engine backend, FP8 hybrid with delayed scaling, "
                            "Litespark's cross-entropy, RoPE and FP8 SwiGLU kernels (their default under FP8)",
                            needs_te=True),
    "stock-te-bf16": System("megatron", ("--spec", "stock-te"), "Megatron-Core's own Transformer Engine layer",
                            needs_te=True),
    "stock-te-fp8": System("megatron", ("--spec", "stock-te") + _FP8,
                           "Megatron-Core's own Transformer Engine layer, FP8 hybrid with delayed scaling",
                           needs_te=True),
    "litespark-local-bf16": System("megatron", ("--spec", "litespark", "--transformer-impl", "local"),
                                   "Litespark layers, local backend (megatron-core linears, torch SDPA, compiled "
                                   "RMSNorm; no TE modules, TE's SwiGLU and RoPE kernels where TE is installed)"),
}
DEFAULT_SYSTEMS = ("hf-eager", "hf-liger", "litespark-bf16", "litespark-fp8", "stock-te-bf16", "stock-te-fp8")
MEGATRON_NOTE = ("megatron systems (GPU): bf16 parameters and compute with fp32 main parameters, fp32 gradient "
                 "accumulation (fused into TE's weight-gradient GEMMs) and fp32 Adam states (megatron-core's "
                 "mixed-precision optimizer), except where the precision column names lower main gradients or "
                 "moments (the precision-aware optimizer); every system clips gradients at 1.0")
SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "vocab_size")
CONTROLLED = SHAPE_FLAGS + ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "seed")


# ============================================================================================ the parent (CLI)
def build_parser():
    from . import cli

    p = cli.OneLineParser(prog="benchmark", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma list of: {', '.join(SYSTEMS)}; empty (--systems '') with --variant: the variants "
                        "only")
    p.add_argument("--model", default="llama-3b", help="litespark-train preset")
    p.add_argument("--seq-length", type=cli.positive_int, default=4096)
    p.add_argument("--micro-batch-size", type=cli.positive_int, default=None, help="default 2")
    p.add_argument("--global-batch-size", type=cli.positive_int, default=None,
                   help="sequences per optimizer step (default: one micro-batch; 8 with --best-micro-batch); more "
                        "than a micro-batch is megatron micro-batching and HF gradient accumulation")
    p.add_argument("--best-micro-batch", action="store_true",
                   help=f"try micro-batches {', '.join(map(str, MICRO_BATCH_CANDIDATES))} (those dividing the global "
                        "batch) for each system at the same tokens per step and keep the fastest that fits; the notes "
                        "say the largest that fits")
    p.add_argument("--micro-batch-candidates", type=micro_batch_list, default=None, metavar="LIST",
                   help="with --best-micro-batch: the micro-batches to try instead, a comma list such as 4,8 (each "
                        "must divide the global batch): skip the small ones a large model is known to run slower at")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SYSTEM:FLAGS",
                   help="one more system, run after --systems: SYSTEM (a megatron one) with extra litespark-train "
                        "FLAGS, to measure one change side by side with SYSTEM in the same run, e.g. --variant "
                        "\"litespark-fp8-tensorwise=litespark-fp8:--fp8-recipe tensorwise\"; FLAGS may start with "
                        "VAR=value words for the worker's environment; repeatable")
    p.add_argument("--megatron-flags", default="",
                   help="extra litespark-train flags for every megatron system (Litespark and stock), quoted as one "
                        "string after an equals sign, e.g. --megatron-flags=\"--cross-entropy-loss-fusion\"")
    p.add_argument("--warmup", type=cli.non_negative_int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed steps")
    p.add_argument("--log-interval", type=cli.positive_int, default=1,
                   help="megatron systems: steps per megatron.training log interval, which ends in synchronizing "
                        "reads (the loss, the telemetry); 1 times each step alone, more (dividing --warmup and "
                        "--steps) times the steps as a training run that logs that often runs them; HF systems are "
                        "timed per step")
    p.add_argument("--profile-steps", type=cli.non_negative_int, default=0,
                   help="after the timed steps, run this many more under torch.profiler and report where the GPU "
                        "time goes (GEMM, attention, optimizer, ...): a table per system in benchmark.md, top kernels "
                        "in logs/<system>-mb<k>.profile.md; not part of the timed numbers")
    p.add_argument("--peak-tflops", type=cli.positive_float, default=None,
                   help="dense BF16 TFLOP/s per GPU for MFU, instead of the peak table")
    p.add_argument("--timeout", type=cli.positive_int, default=600, help="seconds per worker process")
    p.add_argument("--seed", type=cli.non_negative_int, default=1234)
    p.add_argument("--out", default=None, help="directory for benchmark.md, benchmark.json and logs/")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT/benchmark.json: systems it holds with the same flags and settings, measured "
                        "or out of memory, are kept; the others run (a machine taken back, a time limit per call: "
                        "repeat the same command); the table says when each system was measured")
    p.add_argument("--allow-degraded", action="store_true",
                   help="exit 0 even if a system fell back (attention that materializes the score matrix or no "
                        "attention kernel, a fused path asked for but off); such rows stay flagged DEGRADED in the "
                        "table. Without it the benchmark exits 1: a comparison against a degraded system is not one")
    g = p.add_argument_group("model shape overrides (litespark-train names)")
    for name in SHAPE_FLAGS:
        g.add_argument("--" + name.replace("_", "-"), type=cli.positive_int, default=None)
    return p


def parse_systems(text: str, variants: Sequence[str] = (), flags: Sequence[str] = ()) -> Dict[str, System]:
    """The systems of this run, in order: those named in --systems, then each --variant (its flags checked against
    litespark-train's parser on top of `flags`, the common ones)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names and not variants:
        raise UserError("--systems is empty and no --variant given; name at least one of: " + ", ".join(SYSTEMS))
    for n in names:
        if n not in SYSTEMS:
            raise UserError(f"unknown system '{n}' in --systems; choose from: {', '.join(SYSTEMS)}")
    seen = set()
    for n in names:
        if n in seen:
            raise UserError(f"system '{n}' is listed twice in --systems")
        seen.add(n)
    systems = {n: SYSTEMS[n] for n in names}
    for text in variants:
        name, system = parse_variant(text, flags)
        if name in systems:
            raise UserError(f"--variant {text}: the name '{name}' is already taken; give the variant its own name")
        systems[name] = system
    return systems


def parse_variant(text: str, flags: Sequence[str] = ()) -> Tuple[str, System]:
    """NAME=SYSTEM:FLAGS -> (NAME, SYSTEM's definition with FLAGS appended: later flags win in litespark-train)."""
    name, eq, rest = text.partition("=")
    base, colon, extra = rest.partition(":")
    name, base = name.strip(), base.strip()
    if not (eq and colon and name and base and extra.strip()):
        raise UserError(f"--variant {text}: expected NAME=SYSTEM:FLAGS, e.g. "
                        "\"litespark-fp8-tensorwise=litespark-fp8:--fp8-recipe tensorwise\"")
    if not re.fullmatch(r"[a-z0-9][a-z0-9.-]*", name):
        raise UserError(f"--variant {text}: the name '{name}' may hold only lower-case letters, digits, '.' and '-' "
                        "(it names the log files)")
    if base not in SYSTEMS:
        raise UserError(f"--variant {text}: unknown system '{base}'; choose from: {', '.join(SYSTEMS)}")
    if SYSTEMS[base].kind != "megatron":
        raise UserError(f"--variant {text}: '{base}' is an HF system, which takes no litespark-train flags; vary a "
                        "megatron system")
    system = SYSTEMS[base]
    tokens = shlex.split(extra)
    env = []
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", tokens[0]):  # leading VAR=value: the worker's environment
        env.append(tuple(tokens.pop(0).split("=", 1)))
    check_megatron_flags(list(flags) + list(system.flags), shlex.join(tokens), what=f"--variant {name}")
    return name, replace(system, flags=system.flags + tuple(tokens), env=tuple(env),
                         description=f"{system.description}, plus `{extra.strip()}`")


def base_flags(opts) -> List[str]:
    """litespark-train flags common to every system (precision is added by the worker, which knows the device)."""
    # One extra step at the end: the HF worker's backend probe (the trainer probes its first step).
    flags = ["--model", opts.model, "--mock-data", "--seq-length", str(opts.seq_length), "--seed", str(opts.seed),
             "--lr", str(LR), "--min-lr", str(LR), "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
             "--weight-decay", str(WEIGHT_DECAY), "--adam-beta1", str(BETAS[0]), "--adam-beta2", str(BETAS[1]),
             "--adam-eps", str(EPS), "--clip-grad", str(CLIP_GRAD), "--eval-iters", "0", "--eval-interval",
             str(10 ** 9), "--train-iters", str(opts.warmup + opts.steps + opts.profile_steps)]
    for name in SHAPE_FLAGS:
        value = getattr(opts, name)
        if value is not None:
            flags += ["--" + name.replace("_", "-"), str(value)]
    return flags


def random_token_flags(flags: List[str], args, prefix: str, sequences: int, seed: int) -> List[str]:
    """`flags` reading `sequences` sequences of random tokens, uniform over the model's vocabulary, written to
    PREFIX.bin/.idx, instead of megatron-core's mock dataset (the shape check's data source)."""
    import numpy as np

    from ..corpus import IndexedDatasetWriter

    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, args.vocab_size) as writer:
        for _ in range(sequences):
            writer.add_document(rng.integers(0, args.vocab_size, args.seq_length + 1))
        writer.commit()
    return [f for f in flags if f != "--mock-data"] + ["--data-path", prefix, "--split", "100,0,0",
                                                       "--tokenizer-type", "NullTokenizer",
                                                       "--vocab-size", str(args.vocab_size)]


def micro_batch_list(text: str) -> Tuple[int, ...]:
    """'4,8' -> (4, 8): distinct positive integers, ascending (the runs stop at the first that is out of memory)."""
    try:
        sizes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"expected a comma list of positive integers such as 4,8, got '{text}'")
    return tuple(sizes)


def check_log_interval(opts) -> None:
    """The warm-up and the timed steps are whole log intervals (the timed ones are read from interval records)."""
    n = getattr(opts, "log_interval", 1)
    odd = [f"--{name} {getattr(opts, name)}" for name in ("warmup", "steps") if getattr(opts, name) % n]
    if odd:
        raise UserError(f"--log-interval {n} does not divide {' and '.join(odd)}: the warm-up and the timed steps "
                        "are read as whole log intervals")


def micro_batch_plan(opts) -> Tuple[int, List[int]]:
    """(global batch, micro-batch sizes to try) after checking that they fit together."""
    chosen = getattr(opts, "micro_batch_candidates", None)
    if chosen is not None and not opts.best_micro_batch:
        raise UserError("--micro-batch-candidates needs --best-micro-batch (it says which micro-batches that tries); "
                        "for one micro-batch use --micro-batch-size")
    if opts.best_micro_batch:
        if opts.micro_batch_size is not None:
            raise UserError("--micro-batch-size and --best-micro-batch are exclusive: the latter tries micro-batches "
                            + ", ".join(map(str, chosen or MICRO_BATCH_CANDIDATES)))
        gbs = opts.global_batch_size or (max(chosen) if chosen else BEST_MICRO_BATCH_GLOBAL_DEFAULT)
        if chosen:
            odd = [m for m in chosen if gbs % m]
            if odd:
                raise UserError(f"--micro-batch-candidates {','.join(map(str, odd))} does not divide the global batch "
                                f"{gbs}: every micro-batch tried must run the same tokens per step")
            return gbs, list(chosen)
        return gbs, [m for m in MICRO_BATCH_CANDIDATES if gbs % m == 0]
    mbs = opts.micro_batch_size or 2
    gbs = opts.global_batch_size or mbs
    if gbs % mbs:
        raise UserError(f"--global-batch-size {gbs} is not a multiple of --micro-batch-size {mbs}")
    return gbs, [mbs]


def check_shape(flags: List[str]):
    """The resolved model (preset + overrides) checked the way litespark-train checks it; ConfigError if it cannot
    exist. Uses the TE-free local backend, so it checks the shape, not this machine."""
    from .. import arguments
    from ..platform import Platform

    # The shape only: the micro-batch is chosen per system later; 1 stands in for it in this check.
    args = resolve_quietly(["--micro-batch-size", "1"] + flags + ["--spec", "litespark", "--transformer-impl", "local"])
    arguments.check(args, Platform("cpu", "gloo", False, False, "cpu"))
    head_dim = args.hidden_size // args.num_attention_heads
    if head_dim % 2:  # RoPE rotates pairs of channels; every system would fail on its first step
        raise ConfigError(f"head dimension {head_dim} (--hidden-size {args.hidden_size} / --num-attention-heads "
                          f"{args.num_attention_heads}) must be even for rotary embeddings")
    return args


def check_megatron_flags(flags: List[str], extra: str, what: str = "--megatron-flags") -> None:
    """Extra flags (`what` names the option they came from) must be litespark-train flags that parse (the workers
    would otherwise all fail alike)."""
    try:
        words = shlex.split(extra)
    except ValueError as e:
        raise UserError(f"{what}: {e}") from None
    if not words:
        return
    try:
        before, after = resolve_quietly(flags), resolve_quietly(flags + words)
    except ConfigError as e:  # a flag litespark-train does not have, a bad value, a preset or spec name
        raise UserError(f"{what}: {e}") from None
    # The tool sets these for every system alike and counts FLOPs from them: a system that changed one would be
    # measured on another model or batch than the table says.
    changed = [k for k in CONTROLLED if getattr(before, k) != getattr(after, k)]
    if changed:
        raise UserError(f"{what}: changes {', '.join('--' + k.replace('_', '-') for k in changed)}, which the "
                        "benchmark sets for every system alike; use the benchmark's own options for them")


def check_graph_warmup(systems: Dict[str, System], flags: List[str], opts) -> None:
    """A megatron system with CUDA graphs (--cuda-graph-impl) captures them at the start of step
    --cuda-graph-warmup-steps + 1: the warm-up must cover that step, or the first timed steps time the capture and
    the allocations around it (llama-3b FP8: 22,622 tokens/s with --warmup 3 against 35,317 with 4, the same
    command otherwise)."""
    extra = shlex.split(opts.megatron_flags)
    for name, system in systems.items():
        if system.kind != "megatron":
            continue
        args = resolve_quietly(flags + list(system.flags) + extra)
        capture = cuda_graph_capture_step(args)
        if capture is not None and opts.warmup < capture:
            raise UserError(f"{name} captures CUDA graphs (--cuda-graph-impl {cuda_graph_impl(args)}) in step "
                            f"{capture} (--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}), and --warmup "
                            f"{opts.warmup} would time the capture; give --warmup {capture} or more")


def flops_per_step(args, global_batch_size: int, vocab: int) -> Dict[str, int]:
    """Model FLOPs of one optimizer step, both attention conventions, for an output layer of `vocab` rows."""
    from ..metrics.flops import ModelShape, training_flops_per_step

    shape = ModelShape.from_args(args, padded_vocab=vocab)
    return {c: training_flops_per_step(shape, global_batch_size, causal=c).model_flops for c in ("full", "half")}


def padded_vocab(args) -> int:
    """megatron-core's own padding of --vocab-size (a multiple of --make-vocab-size-divisible-by x TP; TP is 1 in
    the benchmark). Unlike arguments.model_vocab_size it needs no tokenizer: the shape alone decides."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding

    return vocab_size_with_padding(args.vocab_size, args, logging_enabled=False)


def system_vocab(args, system: System) -> int:
    """Rows of the output layer: Megatron-LM pads the vocabulary to --make-vocab-size-divisible-by (128, one GPU);
    HF keeps the preset's (the llama presets are already multiples of 128, so both are the same there)."""
    if system.kind == "hf":
        return args.vocab_size
    return padded_vocab(args)


def derive(raw: dict, flops: Dict[str, int], peak_tflops: Optional[float]) -> dict:
    """Rates from a worker's raw measurement: steps, seconds and joules over the timed steps. Pure arithmetic."""
    steps, seconds = raw["steps"], raw["seconds"]
    tokens = raw["tokens_per_step"] * steps
    out = dict(tokens_per_sec=tokens / seconds, step_time_s=seconds / steps,
               tflops_per_gpu=flops["full"] * steps / seconds / 1e12,
               tflops_per_gpu_causal=flops["half"] * steps / seconds / 1e12,
               model_flops_per_step=flops["full"], model_flops_per_step_causal=flops["half"])
    out["mfu"] = out["tflops_per_gpu"] / peak_tflops if peak_tflops else None
    out["mfu_causal"] = out["tflops_per_gpu_causal"] / peak_tflops if peak_tflops else None
    joules = raw.get("joules")
    out["joules_per_token"] = joules / tokens if joules is not None else None
    out["gpu_power_w"] = joules / raw["energy_seconds"] if joules is not None and raw.get("energy_seconds") else None
    return out


def spec_of(system: System) -> Optional[str]:
    """The layer spec a megatron system trains (its last --spec: a variant's own wins), None for HF."""
    specs = [system.flags[i + 1] for i, f in enumerate(system.flags[:-1]) if f == "--spec"]
    return specs[-1] if specs else None


def precision_class(precision: str) -> str:
    """'fp8 hybrid, delayed scaling + bf16, ...' -> 'fp8'; 'bf16, fp32 main params' -> 'bf16'."""
    return precision.split()[0].rstrip(",")


def best_stock_rows(rows: Dict[str, dict]) -> Dict[str, Optional[str]]:
    """Per precision that a stock Megatron-Core row ran in: the fastest stock row (any --variant of stock-te
    included) that did not fall back; None where every stock row of that precision fell back (no fair baseline).
    Litespark is compared with this row, not with the default stock row."""
    best: Dict[str, Optional[str]] = {}
    for name, r in rows.items():
        spec = SpecChoice.named(r.get("spec"))
        if r["status"] != "ok" or not (spec and spec.is_stock):
            continue
        cls = precision_class(r["precision"])
        best.setdefault(cls, None)
        fell_back = bool(r.get("health") and r["health"].get("degraded"))
        if not fell_back and (best[cls] is None or r["tokens_per_sec"] > rows[best[cls]]["tokens_per_sec"]):
            best[cls] = name
    return best


def ratios_vs_best_stock(rows: Dict[str, dict], best: Dict[str, Optional[str]]) -> Dict[str, dict]:
    """Per megatron row (Litespark and stock) whose precision has a fair best stock row (`best`, from
    best_stock_rows): tokens/s and J/token divided by that row's, and its name."""
    out = {}
    for name, r in rows.items():
        against = best.get(precision_class(r["precision"])) if r["status"] == "ok" and r.get("spec") else None
        if against:
            b = rows[against]
            out[name] = dict(against=against, tokens_per_sec=r["tokens_per_sec"] / b["tokens_per_sec"],
                             joules_per_token=r["joules_per_token"] / b["joules_per_token"]
                             if r.get("joules_per_token") is not None and b.get("joules_per_token") else None)
    return out


def ratios_vs_baseline(rows: Dict[str, dict], baseline: str = BASELINE) -> Dict[str, dict]:
    """Per system: its tokens/s and J/token divided by the baseline's (None where either side is missing)."""
    base = rows.get(baseline) or {}

    def ratio(a, b):
        return a / b if a is not None and b else None

    return {name: dict(tokens_per_sec=ratio(r.get("tokens_per_sec"), base.get("tokens_per_sec")),
                       joules_per_token=ratio(r.get("joules_per_token"), base.get("joules_per_token")))
            for name, r in rows.items()}


def _software_versions() -> Dict[str, Optional[str]]:
    """Installed versions from package metadata (cheap: nothing is imported, no CUDA context in the parent)."""
    from importlib import metadata

    def version(*names):
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                continue
        return None

    return {"python": sys.version.split()[0], "torch": version("torch"),
            "transformer_engine": version("transformer_engine", "transformer-engine", "transformer_engine_torch"),
            "megatron_core": version("megatron-core", "megatron_core"), "transformers": version("transformers")}


def _child_env() -> dict:
    env = dict(os.environ)
    # Each worker is its own single-process job: torchrun's variables from an outer launcher would make it wait
    # for ranks that do not exist. platform.init_distributed fills in rank 0 of 1 and a free port.
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    # So that `-m litespark_megatron.apps.benchmark` imports from a source checkout too.
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def run_worker(name: str, system: System, flags: List[str], mbs: int, gbs: int, opts, log_dir: Path) -> dict:
    """One system at one micro-batch size in a fresh process; its result dict (status ok/failed/oom/timeout)."""
    stem = f"{name}-mb{mbs}"
    result_path, log_path = log_dir / f"{stem}.json", log_dir / f"{stem}.log"
    extra = shlex.split(opts.megatron_flags) if system.kind == "megatron" else []
    spec = dict(system=name, definition=asdict(system),
                flags=flags + extra + ["--micro-batch-size", str(mbs), "--global-batch-size", str(gbs)],
                warmup=opts.warmup, steps=opts.steps, profile_steps=opts.profile_steps,
                log_interval=opts.log_interval)
    cmd = [sys.executable, "-m", "litespark_megatron.apps.benchmark", "--worker", json.dumps(spec), str(result_path)]
    result_path.unlink(missing_ok=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(shlex.join(cmd) + "\n")
        log.flush()
        # A session of its own, so that a timeout ends the worker together with what it started (torch.compile's
        # compile workers), by process group.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**_child_env(), **dict(system.env)},
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return dict(system=name, micro_batch_size=mbs, status="timeout", log=str(log_path),
                        reason=f"no result within --timeout {opts.timeout} s", wall_s=time.monotonic() - t0)
        except BaseException:  # Ctrl-C: do not leave a GPU job running behind us
            _kill_group(proc)
            raise
        _kill_group(proc)  # helpers the worker left behind (it skips teardown): none may hold the GPU for the next
    if result_path.exists():
        result = json.loads(result_path.read_text())
        result_path.unlink()  # every number of it goes into benchmark.json; the log stays
        if result.get("profile"):
            from .profile import render

            (log_dir / f"{stem}.profile.md").write_text(render(result["profile"], f"{name}, micro-batch {mbs}"))
    else:  # killed (host OOM killer, a signal) or crashed in native code before it could write
        result = dict(system=name, status="failed", reason=f"worker exited with status {rc}: {_last_line(log_path)}")
    result.update(micro_batch_size=mbs, log=str(log_path), wall_s=time.monotonic() - t0)
    return result


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def largest_fitting(tries: List[dict]) -> Optional[dict]:
    """The largest micro-batch that trained, and the one above it that ran out of memory (None: none was tried, so
    the largest that fits may be larger); None when no micro-batch trained."""
    ok = [t["micro_batch_size"] for t in tries if t["status"] == "ok"]
    if not ok:
        return None
    oom = [t["micro_batch_size"] for t in tries if t["status"] == "oom" and t["micro_batch_size"] > max(ok)]
    return dict(micro_batch_size=max(ok), out_of_memory_at=min(oom) if oom else None)


def _largest_fitting_text(largest: Optional[dict]) -> str:
    if largest is None:
        return "none trained"
    if largest["out_of_memory_at"] is None:
        return f"{largest['micro_batch_size']} or more (no larger one ran out of memory)"
    return f"{largest['micro_batch_size']} ({largest['out_of_memory_at']} ran out of memory)"


def choose(tries: List[dict]) -> dict:
    """The fastest successful try; without one, the first failure (which says why)."""
    ok = [t for t in tries if t["status"] == "ok"]
    if ok:
        return max(ok, key=lambda t: t["tokens_per_step"] * t["steps"] / t["seconds"])
    return tries[0]


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        opts = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or one-line error (2)
        return e.code if isinstance(e.code, int) else 2
    try:
        gbs, candidates = micro_batch_plan(opts)
        check_log_interval(opts)
        flags = base_flags(opts)
        args = check_shape(flags)
        check_megatron_flags(flags, opts.megatron_flags)
        systems = parse_systems(opts.systems, opts.variant, flags)
        check_graph_warmup(systems, flags, opts)
        out = Path(opts.out) if opts.out else None
        if out is not None:
            if out.exists() and not out.is_dir():
                raise UserError(f"--out {out}: exists and is not a directory")
            try:
                (out / "logs").mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
        kept = resumed_rows(out, report_settings(opts, args, gbs, candidates), systems) if opts.resume else {}
    except UserError as e:
        print(f"benchmark: error: {e}", file=sys.stderr)
        return 2
    command = "python tools/benchmark.py " + shlex.join(argv)

    def write(report: dict) -> str:
        text = render_markdown(report)
        if out is not None:
            (out / "benchmark.json").write_text(json.dumps(report, indent=1) + "\n")
            (out / "benchmark.md").write_text(text)
        return text

    warning = None
    megatron = any(s.kind == "megatron" for s in systems.values())
    if megatron:
        warning = preflight(args)
        if warning and not opts.allow_degraded:
            print(f"benchmark: error: {warning}. Nothing was measured: a comparison against a system without fused "
                  "attention is not one (pass --allow-degraded to measure anyway, flagged)", file=sys.stderr)
            return 1
    with contextlib.ExitStack() as stack:
        log_dir = out / "logs" if out is not None else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="litespark-benchmark-")))
        if megatron:  # the HF systems draw their tokens themselves
            data_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="litespark-benchmark-data-"))
            sequences = gbs * (opts.warmup + opts.steps + opts.profile_steps + 1)
            flags = random_token_flags(flags, args, os.path.join(data_dir, "random"), sequences, opts.seed)
        report = run_all(systems, flags, gbs, candidates, opts, args, log_dir, command, on_progress=write,
                         environment_warning=warning, kept=kept)
    print(write(report), end="", flush=True)
    return exit_code(report, opts.allow_degraded)


def preflight(args, timeout: int = PREFLIGHT_TIMEOUT) -> Optional[str]:
    """Before any system runs: does Transformer Engine's fused attention work on this machine, for this model's head
    shape? Asked in a fresh process (the parent holds no CUDA context). Returns the warning line, or None (fine, no
    GPU, or no TE: then the systems that need TE fail on their own, saying so)."""
    spec = dict(head_dim=args.hidden_size // args.num_attention_heads, heads=args.num_attention_heads,
                kv_heads=args.num_query_groups)
    cmd = [sys.executable, "-m", "litespark_megatron.apps.benchmark", "--preflight", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_child_env())
    except subprocess.TimeoutExpired:
        return f"the fused-attention check did not finish within {timeout} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return f"the fused-attention check failed: {_one_line(proc.stderr.strip().splitlines()[-1:] or proc.stderr)}"
    return json.loads(lines[-1])["warning"]


def preflight_main(spec_json: str) -> None:
    from ..backend_probe import te_attention_check

    spec = json.loads(spec_json)
    print(json.dumps({"warning": te_attention_check(spec["head_dim"], spec["heads"], spec["kv_heads"])}), flush=True)


def degraded_systems(report: dict) -> Dict[str, List[str]]:
    """System -> why it is degraded, for the systems that ran but fell back."""
    return {r["system"]: r["health"]["degraded"] for r in report["systems"]
            if r["status"] == "ok" and r.get("health") and r["health"]["degraded"]}


def exit_code(report: dict, allow_degraded: bool) -> int:
    """1 if a system failed, or fell back without --allow-degraded (each said on stderr); else 0."""
    failed = [r["system"] for r in report["systems"] if r["status"] != "ok"]
    degraded = degraded_systems(report)
    for name, reasons in degraded.items():
        print(f"benchmark: {name} is DEGRADED: {'; '.join(reasons)}" +
              ("" if allow_degraded else " (fix the environment, or pass --allow-degraded to accept it)"),
              file=sys.stderr, flush=True)
    return 1 if failed or (degraded and not allow_degraded) else 0


def run_all(systems: Dict[str, System], flags, gbs, candidates, opts, args, log_dir: Path, command: str,
            on_progress: Optional[Callable[[dict], None]] = None, environment_warning: Optional[str] = None,
            kept: Optional[Dict[str, dict]] = None) -> dict:
    """Run every system (each micro-batch candidate in turn) and return the report; `on_progress` gets the report
    so far after each system, so that a run cut short still leaves the finished systems on disk. `kept`: rows of
    an earlier invocation (--resume), not run again."""
    rows = []
    started = _now()  # one time per invocation: the table groups rows by it to say which ran together
    for i, (name, system) in enumerate(systems.items(), 1):
        if kept and name in kept:
            rows.append(kept[name])
            print(f"[{i}/{len(systems)}] {name}: kept from the report being resumed (measured "
                  f"{kept[name].get('measured') or 'before'})", flush=True)
            continue
        tries = []
        for mbs in candidates:
            r = run_worker(name, system, flags, mbs, gbs, opts, log_dir)
            tries.append(r)
            what = f"[{i}/{len(systems)}] {name} micro-batch {mbs} x {gbs // mbs}"
            if r["status"] == "ok":
                print(f"{what}: {r['tokens_per_step'] * r['steps'] / r['seconds']:,.0f} tokens/s "
                      f"({r['wall_s']:.0f} s)", flush=True)
            else:
                print(f"{what}: {r['status']}: {r['reason']} ({r['wall_s']:.0f} s)", flush=True)
                # Ascending micro-batches: after an OOM larger ones cannot fit, and any other failure (no TE, no
                # FP8, import error) does not depend on the micro-batch.
                break
        rows.append(dict(system=name, tries=tries, chosen=choose(tries), measured=started))
        if on_progress is not None and i < len(systems):
            on_progress(build_report(rows, systems, gbs, candidates, opts, args, command, environment_warning))
    return build_report(rows, systems, gbs, candidates, opts, args, command, environment_warning)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def report_settings(opts, args, gbs: int, candidates: List[int]) -> dict:
    """What every system of one report shares (a resumed report must have the same)."""
    return dict(model=opts.model, seq_length=args.seq_length, global_batch_size=gbs,
                tokens_per_step=gbs * args.seq_length, micro_batch_candidates=list(candidates),
                best_micro_batch=opts.best_micro_batch, warmup=opts.warmup, steps=opts.steps,
                log_interval=opts.log_interval,
                profile_steps=opts.profile_steps, seed=opts.seed, megatron_flags=opts.megatron_flags,
                timeout_s=opts.timeout, num_layers=args.num_layers, hidden_size=args.hidden_size,
                ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
                num_query_groups=args.num_query_groups, vocab_size=args.vocab_size, rotary_base=args.rotary_base,
                untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights)


def resumed_rows(out: Optional[Path], settings: dict, systems: Dict[str, System]) -> Dict[str, dict]:
    """--resume: the systems of OUT/benchmark.json to keep (same flags and environment; measured, or out of memory at
    every micro-batch tried), as run_all's rows. None there yet: nothing to keep (the first call of a resumed series)."""
    if out is None:
        raise UserError("--resume needs --out: it continues OUT/benchmark.json")
    path = out / "benchmark.json"
    if not path.exists():
        return {}
    try:
        report = json.loads(path.read_text())
        before, entries, device = report["settings"], report["systems"], report["device"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"--resume: {path} is not a benchmark report ({e}); use another --out") from None
    differ = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
    if differ:
        raise UserError(f"--resume: {path} was measured with other settings (different: {', '.join(differ)}); "
                        "use another --out, or the same settings to continue it")
    kept = {}
    for e in entries:
        name = e.get("system")
        same = e.get("flags") == list(systems[name].flags) and e.get("env", {}) == dict(systems[name].env) \
            if name in systems else False
        if same and e.get("status") in ("ok", "oom"):
            tries = [dict(t, device=device) for t in e["tries"]]
            kept[name] = dict(system=name, tries=tries, chosen=choose(tries), measured=e.get("measured"))
    return kept


def build_report(rows: List[dict], systems: Dict[str, System], gbs: int, candidates: List[int], opts, args,
                 command: str, environment_warning: Optional[str] = None) -> dict:
    """The report (benchmark.json) from the workers' results: rates, MFU and ratios derived here."""
    device = next((t["device"] for row in rows for t in row["tries"] if t.get("device")), None)
    on_gpu = bool(device and device.get("type") == "cuda")
    peak, peak_note = _peak(device, opts.peak_tflops, on_gpu)
    peak_tflops = peak["tflops"] if peak else None
    flops = {name: flops_per_step(args, gbs, system_vocab(args, system)) for name, system in systems.items()}
    results = {}
    for row in rows:
        name, c = row["system"], row["chosen"]
        system = systems[name]
        entry = dict(system=name, kind=system.kind, description=system.description, flags=list(system.flags),
                     env=dict(system.env), spec=spec_of(system), status=c["status"], reason=c.get("reason"),
                     micro_batch_size=c["micro_batch_size"], global_batch_size=gbs,
                     accumulation_steps=gbs // c["micro_batch_size"], vocab_rows=system_vocab(args, system),
                     tries=[{k: v for k, v in t.items() if k != "device"} for t in row["tries"]],
                     largest_fitting_micro_batch=largest_fitting(row["tries"]), measured=row.get("measured"))
        if c["status"] == "ok":
            entry.update({k: c.get(k) for k in ("precision", "steps", "seconds", "tokens_per_step", "step_times_s",
                                                  "joules", "energy_seconds", "energy_note", "peak_mem_gib",
                                                  "peak_mem_timed_gib", "peak_reserved_gib", "loss_first",
                                                  "loss_last", "params", "skipped_steps", "notes", "profile",
                                                  "health")})
            entry.update(derive(c, flops[name], peak_tflops))
        results[name] = entry
    for name, ratio in ratios_vs_baseline({n: e for n, e in results.items() if e["status"] == "ok"}).items():
        results[name]["vs_" + BASELINE.replace("-", "_")] = ratio
    best_stock = best_stock_rows(results)
    for name, ratio in ratios_vs_best_stock(results, best_stock).items():
        results[name]["vs_best_stock"] = ratio
    vocab_note = None
    padded = padded_vocab(args)
    if args.vocab_size != padded:
        vocab_note = (f"megatron pads the vocabulary {args.vocab_size} to {padded} rows (a multiple of "
                      f"{args.make_vocab_size_divisible_by}), HF keeps {args.vocab_size}: the FLOPs of each system "
                      "count its own output layer")
    return dict(
        command=command, date=_now(),
        device=device, software=_software_versions(), peak=peak, peak_note=peak_note,
        environment_warning=environment_warning,
        settings=report_settings(opts, args, gbs, candidates),
        flops_per_step=flops, vocab_note=vocab_note, baseline=BASELINE, best_stock=best_stock,
        pending=[n for n in systems if n not in results], systems=list(results.values()))


def _peak(device: Optional[dict], override: Optional[float], on_gpu: bool):
    from ..metrics.peaks import PeakError, detect_peak

    if not on_gpu and override is None:
        return None, "MFU n/a: CPU run (no tensor-core peak; --peak-tflops sets one)"
    try:
        return detect_peak(device["name"] if on_gpu else None, "bf16", override).as_dict(), None
    except PeakError as e:
        return None, f"MFU n/a: {e}"


# ============================================================================================ the report
def _fmt(v, spec: str, suffix: str = "") -> str:
    return "n/a" if v is None else format(v, spec) + suffix


def _tflops(v: float) -> str:
    # One decimal is right for GPUs; CPU runs are far below 1 TFLOP/s and would all print as 0.0.
    return f"{v:.1f}" if v >= 10 else f"{v:.3g}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}" + ("" if n == 1 else "s")


def _vs_best_stock(row: dict) -> str:
    vs = row.get("vs_best_stock")
    if not vs:
        return "n/a"
    return "best stock" if vs["against"] == row["system"] else f"{vs['tokens_per_sec']:.2f}x ({vs['against']})"


def render_markdown(report: dict) -> str:
    s, dev, sw = report["settings"], report["device"], report["software"]
    if dev and dev.get("type") == "cuda":
        te_cudnn = f", TE's cuDNN {dev['te_cudnn']}" if dev.get("te_cudnn") else ""
        device = (f"{dev['name']} (1 of {dev['count']} visible; compute capability {dev['capability']}), "
                  f"CUDA {dev.get('cuda')}, torch's cuDNN {dev.get('cudnn')}{te_cudnn}, "
                  f"driver {dev.get('driver') or 'n/a'}")
    elif dev:
        device = (f"CPU ({dev.get('name')}, {dev.get('threads')} threads): every system in fp32 (no bf16 tensor "
                  "cores to measure); GPU memory, power and energy n/a")
    else:
        device = "unknown (no worker reached the point of reporting it)"
    lines = [
        f"# Training throughput: {s['model']}, seq {s['seq_length']}, {s['global_batch_size']} sequences "
        f"({s['tokens_per_step']:,} tokens) per step",
        "",
        f"- date: {report['date']}",
        f"- device: {device}",
        f"- software: torch {sw['torch']}, Transformer Engine {sw['transformer_engine'] or 'not installed'}, "
        f"megatron-core {sw['megatron_core'] or 'not installed'}, "
        f"transformers {sw['transformers'] or 'not installed'}, Python {sw['python']}",
        f"- command: `{report['command']}`",
        f"- shape: {s['num_layers']} layers, hidden {s['hidden_size']}, FFN {s['ffn_hidden_size']}, "
        f"{s['num_attention_heads']} heads / {s['num_query_groups']} KV heads, vocab {s['vocab_size']}, "
        f"RoPE base {s['rotary_base']}, {'untied' if s['untie_embeddings_and_output_weights'] else 'tied'} embeddings",
        f"- each system in a fresh process: {_count(s['warmup'], 'warm-up step')}, then "
        f"{_count(s['steps'], 'timed step')} (wall time, "
        + ("CUDA-synchronized after each step" if s.get("log_interval", 1) == 1 else
           f"HF systems CUDA-synchronized after each step, megatron systems timed by log intervals of "
           f"{s['log_interval']} steps") + "), random tokens (uniform over the vocabulary), constant LR",
        "- TFLOP/s: model FLOPs (3 x forward GEMMs, logits included) with attention counted in full (NeMo tables) / "
        "causal-halved (Megatron-LM); docs/metrics.md",
    ]
    when: Dict[str, List[str]] = {}
    for r in report["systems"]:
        when.setdefault(r.get("measured") or "an unrecorded time", []).append(r["system"])
    if len(when) > 1:  # a resumed report: say which systems ran together
        lines.append("- measured in several invocations (--resume), same settings: " +
                     "; ".join(f"{date}: {', '.join(names)}" for date, names in when.items()))
    peak = report["peak"]
    if peak:
        basis = "--peak-tflops" if peak["mfu_basis"] == "override" else f"dense BF16 of {peak['device']}, datasheet"
        lines.append(f"- MFU: against {peak['tflops']} TFLOP/s ({basis}), FP8 systems too")
    else:
        lines.append(f"- {report['peak_note']}")
    lines.append("- power and J/token: NVML total-energy counter of the GPU over the timed steps only")
    if report.get("pending"):
        lines.append(f"- PARTIAL: still to run: {', '.join(report['pending'])}")
    if report.get("environment_warning"):
        lines.append(f"- **WARNING** (measured with --allow-degraded): {report['environment_warning']}")
    if report["vocab_note"]:
        lines.append(f"- {report['vocab_note']}")
    best = report.get("best_stock") or {}
    if best:
        lines.append("- best stock row (fastest stock Megatron-Core row of each precision that did not fall back; "
                     "'vs best stock' divides by it): " +
                     "; ".join(f"{cls}: {name or 'none (every stock row fell back: no fair ratio)'}"
                               for cls, name in best.items()))
    lines += ["", "| system | precision | attention | fused: cross-entropy / RoPE / wgrad-acc. | micro-batch x accum. "
                  "| tokens/s | vs HF eager | vs best stock | TFLOP/s/GPU full / causal | MFU full / causal "
                  "| peak mem GiB | W | J/token | J/token vs HF eager | loss first -> last |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    ratio_key = "vs_" + BASELINE.replace("-", "_")
    for r in report["systems"]:
        if r["status"] != "ok":
            reason = str(r["reason"]).replace("|", "\\|")  # a pipe in an error message would split the cell
            lines.append(f"| {r['system']} | {r['status']}: {reason} |" + " |" * 13)
            continue
        ratio = r.get(ratio_key) or {}
        attention, fused, flag = _health_cells(r.get("health"))
        lines.append(
            f"| {r['system']}{flag} | {r['precision']} | {attention} | {fused} | "
            f"{r['micro_batch_size']} x {r['accumulation_steps']} | "
            f"{r['tokens_per_sec']:,.0f} | {_fmt(ratio.get('tokens_per_sec'), '.2f', 'x')} | "
            f"{_vs_best_stock(r)} | {_tflops(r['tflops_per_gpu'])} / {_tflops(r['tflops_per_gpu_causal'])} | "
            f"{_fmt(r['mfu'], '.1%')} / {_fmt(r['mfu_causal'], '.1%')} | {_fmt(r['peak_mem_gib'], '.1f')} | "
            f"{_fmt(r['gpu_power_w'], '.0f')} | {_fmt(r['joules_per_token'], '.4f')} | "
            f"{_fmt(ratio.get('joules_per_token'), '.2f', 'x')} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    lines += ["", "Systems:", ""]
    for r in report["systems"]:
        lines.append(f"- `{r['system']}`: {r['description']}")
    if any(r["status"] == "ok" and r["kind"] == "megatron" for r in report["systems"]) \
            and dev and dev.get("type") == "cuda":
        lines.append(f"- {MEGATRON_NOTE}")
    degraded = degraded_systems(report)
    if degraded:
        lines += ["", "DEGRADED systems (they fell back: their numbers are not what the system can do, and no ratio "
                      "against them is fair):", ""]
        lines += [f"- `{name}`: {'; '.join(reasons)}" for name, reasons in degraded.items()]
    notes = []
    for r in report["systems"]:
        for note in r.get("notes") or []:
            notes.append(f"- `{r['system']}`: {note}")
        if r.get("energy_note"):
            notes.append(f"- `{r['system']}`: {r['energy_note']}")
        if s["best_micro_batch"] and len(r["tries"]) > 0:
            tried = ", ".join(
                f"{t['micro_batch_size']}: " + (f"{t['tokens_per_step'] * t['steps'] / t['seconds']:,.0f} tokens/s"
                                               if t["status"] == "ok" else t["status"])
                for t in r["tries"])
            notes.append(f"- `{r['system']}` micro-batches tried: {tried}; the largest that fits: "
                         f"{_largest_fitting_text(r.get('largest_fitting_micro_batch'))}")
    if notes:
        lines += ["", "Notes:", ""] + notes
    lines += render_profiles(report)
    return "\n".join(lines) + "\n"


def _health_cells(health: Optional[dict]) -> Tuple[str, str, str]:
    """(attention, fused paths, flag after the system's name) of a result's health record."""
    if not health:
        return "not recorded", "not recorded", ""
    attention = " + ".join(health["attention"]) or "none seen"
    f = health["fusions"]
    columns = ("cross_entropy", "rope", "wgrad_accumulation")
    fused = " / ".join(f.get(k, "n/a") for k in columns) if f else "n/a"
    # the paths only some systems have (the MLP as TE ops, Litespark's norm, FP8 SwiGLU, FP8 output layer), by name
    more = [f"{backend_probe.FUSION_NAMES.get(k, k)} {v}" for k, v in f.items() if k not in columns]
    return attention, fused + "".join(f"; {m}" for m in more), " **DEGRADED**" if health["degraded"] else ""


def render_profiles(report: dict) -> List[str]:
    """With --profile-steps: GPU time per step by category, the systems side by side (top kernels: logs/)."""
    profiled = [r for r in report["systems"] if r["status"] == "ok" and r.get("profile")]
    if not profiled:
        return []
    from .profile import category_ms

    per_system = {r["system"]: category_ms(r["profile"]) for r in profiled}
    categories = sorted({c for ms in per_system.values() for c in ms},
                        key=lambda c: -max(ms.get(c, 0.0) for ms in per_system.values()))
    unit = "GPU kernel" if profiled[0]["profile"]["device"] == "cuda" else "CPU operator (self)"
    lines = ["", f"Where the time goes ({unit} ms per step under torch.profiler, "
                 f"{_count(profiled[0]['profile']['steps'], 'step')} after the timed ones; top kernels in "
                 "logs/<system>-mb<k>.profile.md):", "",
             "| category | " + " | ".join(per_system) + " |", "|---|" + "---|" * len(per_system)]
    for c in categories:
        lines.append(f"| {c} | " + " | ".join(_fmt(ms.get(c), '.1f') for ms in per_system.values()) + " |")
    lines.append("| **all kernels** | " + " | ".join(f"{r['profile']['kernel_ms_per_step']:.1f}"
                                                      for r in profiled) + " |")
    lines.append("| wall | " + " | ".join(f"{r['profile']['wall_ms_per_step']:.1f}" for r in profiled) + " |")
    if any(r["profile"].get("idle") for r in profiled):
        lines.append("| GPU idle (gaps: logs/) | " + " | ".join(
            _fmt((r["profile"].get("idle") or {}).get("ms_per_step"), '.1f') for r in profiled) + " |")
    return lines


# ============================================================================================ the worker
def measure(step_fn: Callable[[], float], tokens_per_step: int, warmup: int, steps: int, cuda: bool) -> dict:
    """Run `warmup` untimed steps, then `steps` timed ones; wall time with a CUDA synchronize after every step
    (so each step's time is its own), NVML energy over the timed steps only. `step_fn` returns the step's loss."""
    import torch

    def sync():
        if cuda:
            torch.cuda.synchronize()

    losses = [step_fn() for _ in range(warmup)]
    sync()
    peak_warmup = torch.cuda.max_memory_allocated() if cuda else None
    peak_reserved_warmup = torch.cuda.max_memory_reserved() if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    meter, energy_note = None, None
    if cuda:
        from ..metrics.energy import EnergyMeter

        meter = EnergyMeter()
        if not meter.start():
            energy_note, meter = f"GPU energy not measured: {meter.reason}", None
    step_times = []
    t_start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step_fn())
        sync()
        step_times.append(time.perf_counter() - t0)
    seconds = time.perf_counter() - t_start
    joules = energy_seconds = None
    if meter is not None:
        reading = meter.lap()
        if reading is None:
            energy_note = f"GPU energy not measured: {meter.last_reason}"
        else:
            joules, energy_seconds = reading.joules, reading.seconds
        meter.close()
    out = dict(steps=steps, seconds=seconds, tokens_per_step=tokens_per_step, step_times_s=step_times,
               joules=joules, energy_seconds=energy_seconds, energy_note=energy_note,
               loss_first=losses[0], loss_last=losses[-1], peak_mem_gib=None, peak_mem_timed_gib=None,
               peak_reserved_gib=None)
    if cuda:
        timed = torch.cuda.max_memory_allocated()
        out.update(peak_mem_gib=max(timed, peak_warmup) / 2**30, peak_mem_timed_gib=timed / 2**30,
                   peak_reserved_gib=max(torch.cuda.max_memory_reserved(), peak_reserved_warmup) / 2**30)
    return out


def patch_liger(cuda: bool) -> None:
    """Liger-Kernel into HF's Llama classes, as its users do before building a model: `apply_liger_kernel_to_llama`
    with its defaults (Triton RMSNorm, SwiGLU and RoPE; the fused linear cross-entropy, which computes the loss chunk
    by chunk from the last hidden states and never materializes the logits). A worker runs one system, so the patch
    touches no other system's model."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as e:
        raise UserError(f"hf-liger needs Liger-Kernel, not importable here ({_one_line(str(e))}): "
                        "pip install liger-kernel") from None
    if not cuda:
        raise UserError("hf-liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU; on a CPU, measure "
                        "hf-eager")
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True)


def liger_fusions(model) -> Tuple[Dict[str, str], str]:
    """(fused paths for the health record, one note) of an HF Llama built after patch_liger: every norm, MLP, the
    RoPE function and the loss must be Liger's, or the peer would be measured on HF's own modules without saying so."""
    from liger_kernel.transformers.model.llama import lce_forward
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.rope import liger_rotary_pos_emb
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from transformers.models.llama import modeling_llama

    layers = model.config.num_hidden_layers
    norms = sum(isinstance(m, LigerRMSNorm) for m in model.modules())
    mlps = sum(isinstance(m, LigerSwiGLUMLP) for m in model.modules())
    missing = [what for what, took in (
        (f"RMSNorm ({norms} of {2 * layers + 1} norms)", norms == 2 * layers + 1),
        (f"SwiGLU ({mlps} of {layers} MLPs)", mlps == layers),
        ("RoPE", modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb),
        ("fused linear cross-entropy", getattr(type(model).forward, "__wrapped__", type(model).forward)
         is lce_forward)) if not took]
    if missing:
        raise RuntimeError("Liger-Kernel did not take on the HF model (this transformers version?): "
                           + ", ".join(missing))
    from importlib import metadata

    note = (f"Liger-Kernel {metadata.version('liger-kernel')}: RMSNorm ({norms} norms), SwiGLU ({mlps} MLPs), RoPE, "
            "fused linear cross-entropy (logits never materialized)")
    return dict(cross_entropy="liger fused linear", rope="liger", wgrad_accumulation="n/a"), note


def _profile(step_fn, profile_steps: int, cuda: bool) -> Optional[dict]:
    if not profile_steps:
        return None
    from .profile import profile_steps as run_profiled

    return run_profiled(step_fn, profile_steps, cuda)


def run_hf(args, system: System, cuda: bool, warmup: int, steps: int, profile_steps: int = 0) -> dict:
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if system.liger:
        patch_liger(cuda)
    model = build_hf_llama(args, cuda, device)
    fusions, notes = liger_fusions(model) if system.liger else ({}, None)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = hf_adamw(model, LR, WEIGHT_DECAY, BETAS, EPS, cuda)
    forward = torch.compile(model) if system.compile else model
    mbs, gbs = args.micro_batch_size, args.global_batch_size
    accumulation = gbs // mbs
    batches = token_batches(warmup + steps + profile_steps + 1, gbs, args.seq_length, args.vocab_size, args.seed)
    it = iter(batches)

    def step(forward=forward) -> float:
        tokens = next(it).to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device, dtype=torch.float32)
        for k in range(accumulation):
            # seq_length input tokens, as the megatron systems take; HF shifts labels inside (seq_length - 1 loss
            # positions, the same GEMMs).
            x = tokens[k * mbs:(k + 1) * mbs, :-1]
            loss = forward(input_ids=x, labels=x).loss / accumulation
            loss.backward()
            total += loss.detach().float()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_GRAD)
        optimizer.step()
        return float(total)

    result = measure(step, gbs * args.seq_length, warmup, steps, cuda)
    result["profile"] = _profile(step, profile_steps, cuda)
    # What ran, seen on one more step of the eager model (torch.compile lowers SDPA to the kernel the same dispatcher
    # picks for these tensors; the spy itself would make the compiled graph recompile).
    with backend_probe.BackendProbe([model]) as probe:
        step(forward=model)
    health = probe.report(device_type=device.type)
    health.fusions.update(fusions)
    result["health"] = health.to_dict()
    result.update(params=params, skipped_steps=0, notes=[notes] if notes else [],
                  precision="bf16 (params, grads, AdamW states)" if cuda else "fp32 (CPU run)")
    return result


def _micro_batches(tokens, micro_batch_size: int):
    seq = tokens.size(1) - 1
    import torch

    for start in range(0, tokens.size(0), micro_batch_size):
        mb = tokens[start:start + micro_batch_size]
        yield dict(tokens=mb[:, :-1].contiguous(), labels=mb[:, 1:].contiguous(),
                   loss_mask=torch.ones(mb.size(0), seq), position_ids=torch.arange(seq).expand(mb.size(0), seq))


def run_megatron(flags: List[str], system: System, warmup: int, steps: int, profile_steps: int = 0,
                 log_interval: int = 1) -> dict:
    """The system trained by litespark-train itself (megatron.training's loop, in this worker process) on mock
    data, `log_interval` steps per log interval; the timed steps, energy and memory from its metrics.jsonl, what ran
    from its health record, with --profile-steps megatron.training's torch.profiler trace summarized."""
    import tempfile

    import torch

    cuda = torch.cuda.is_available()
    run_dir = Path(tempfile.mkdtemp(prefix="litespark-benchmark-run-"))
    try:
        return _train_and_read(flags, system, warmup, steps, profile_steps, run_dir, cuda, log_interval)
    finally:
        import shutil

        shutil.rmtree(run_dir, ignore_errors=True)


def _train_and_read(flags, system, warmup, steps, profile_steps, run_dir: Path, cuda: bool,
                    log_interval: int = 1) -> dict:
    from .. import platform
    from .profile import summarize_trace
    from ..pretrain import prepare, train

    metrics = run_dir / "metrics.jsonl"
    argv = flags + list(system.flags) + (["--bf16"] if cuda else []) + [
        "--log-interval", str(log_interval), "--metrics-file", str(metrics), "--tensorboard-dir", str(run_dir / "tb")]
    if profile_steps:
        first = warmup + steps
        argv += ["--profile", "--use-pytorch-profiler", "--profile-step-start", str(first), "--profile-step-end",
                 str(first + profile_steps)]
    try:
        args, plat = prepare(argv)  # a refused flag or a missing TE: UserError, the table's one-line reason
    except ConfigError as e:
        if system.needs_te and cuda and not platform.te_importable():
            raise ConfigError(f"{e} [{_te_import_error()}]") from None
        raise
    try:
        code = train(args, plat)
    except SystemExit as e:  # megatron.training exits on its own terms (e.g. a fault its NaN check caught)
        code = e.code
    if code:
        raise RuntimeError(f"litespark-train exited with status {code} (see the log)")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train_rows = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    timed = [r for r in train_rows if warmup < r["step"] <= warmup + steps]
    if sum(r.get("steps", 1) for r in timed) != steps:
        raise RuntimeError(f"expected {steps} timed steps in the run's metrics, found "
                           f"{sum(r.get('steps', 1) for r in timed)}")
    tokens_per_step = timed[0]["tokens_per_sec"] * timed[0]["step_time_s"]
    # an interval's record holds its mean step time: each of its steps counted at it
    step_times = [r["step_time_s"] for r in timed for _ in range(r.get("steps", 1))]
    measured = all(r.get("joules_per_token") is not None for r in timed)
    memory = [r.get("mem_max_allocated_gb") for r in train_rows if r.get("mem_max_allocated_gb") is not None]
    memory_timed = [r["mem_max_allocated_gb"] for r in timed if r.get("mem_max_allocated_gb") is not None]
    health = next((r for r in records if r["kind"] == "health"), None)
    start = next(r for r in records if r["kind"] == "run")
    precision = precision_of(args) if cuda else "fp32 (CPU run)"
    n_skipped = sum(r["skipped_in_interval"] for r in timed)
    notes = [f"{n_skipped} timed step(s) skipped the update (inf/nan gradients): less work than a full step"] \
        if n_skipped else []
    note = _allocator_note(timed)
    notes += [note] if note else []
    reserved = max((r["mem_max_reserved_gb"] for r in train_rows if r.get("mem_max_reserved_gb") is not None),
                   default=None)
    notes += [_reserved_note(reserved, max(memory) if memory else None)] if reserved is not None else []
    profile = None
    if profile_steps:
        traces = sorted((run_dir / "torch_profile").glob("rank-0.json*"))
        profile = summarize_trace(str(traces[0])) if traces else None
    return dict(steps=steps, seconds=sum(step_times), tokens_per_step=round(tokens_per_step),
                step_times_s=step_times,
                joules=sum(r["joules_per_token"] * tokens_per_step * r.get("steps", 1) for r in timed)
                if measured else None,
                energy_seconds=sum(step_times) if measured else None,
                energy_note=None if measured or not cuda else "GPU energy not measured in every timed step",
                loss_first=train_rows[0]["loss"], loss_last=timed[-1]["loss"],
                peak_mem_gib=max(memory) if memory else None, peak_mem_timed_gib=max(memory_timed)
                if memory_timed else None, peak_reserved_gib=reserved, profile=profile, params=start["params"],
                skipped_steps=n_skipped,
                precision=precision, notes=notes, spec=args.litespark_spec, backend=args.transformer_impl,
                health={k: health[k] for k in ("attention", "attention_kind", "fusions", "degraded", "device_type")}
                if health else None)


def _reserved_note(reserved_gib: float, allocated_gib: Optional[float]) -> str:
    """The allocator's peak reserved memory beside the peak allocated one: what the GPU had to hold (cached blocks
    and CUDA graphs' private pools, which the allocated peak leaves out; the memory model's graph pools are fitted to
    it)."""
    beside = f" beside {allocated_gib:.1f} GiB allocated at most" if allocated_gib is not None else ""
    return (f"the caching allocator reserved {reserved_gib:.1f} GiB at most{beside} (reserved: what the GPU held, "
            "cached blocks and CUDA graphs' pools included)")


def _allocator_note(timed: List[dict]) -> Optional[str]:
    """A note where the caching allocator went to the driver during the timed steps (telemetry's allocator counts):
    a steady step reuses its cached memory, and a cudaFree (which synchronizes the device) or an out-of-memory retry
    (the whole cache freed) costs the row time no kernel shows."""
    from ..telemetry import ALLOCATOR_COUNTS

    totals = {k: sum(r.get(k) or 0 for r in timed) for k in ALLOCATOR_COUNTS}
    if not any(totals.values()):
        return None
    return (f"the caching allocator in the timed steps: {totals['device_mallocs']} cudaMalloc, "
            f"{totals['device_frees']} cudaFree, {totals['alloc_retries']} out-of-memory retries (each frees the "
            "cache); a cudaFree synchronizes the device: time no kernel shows")


def _dtype_name(dtype) -> str:
    """A megatron optimizer dtype, as its flag names it: 'bf16' from the flag's string or from the torch.dtype
    Megatron-LM's validation maps it to."""
    names = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "uint8": "fp8"}
    text = str(dtype).replace("torch.", "")
    return names.get(text, text)


def precision_of(args) -> str:
    """A megatron row's precision, from its resolved arguments: the FP8 recipe (and what else runs in FP8), the
    compute dtype, and the optimizer's own precision where the precision-aware optimizer lowers it (main gradients
    and Adam moments in bf16 change the numerics and the memory a row needs: its table must say so).
    The first word is the class rows are compared within ('fp8', 'bf16')."""
    compute = text = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    if args.fp8:
        scaling = "delayed scaling" if args.fp8_recipe == "delayed" else f"{args.fp8_recipe} scaling"
        also = [what for what, on in (("FP8 attention", args.fp8_dot_product_attention),
                                      ("FP8 parameters", args.fp8_param_gather)) if on]
        text = f"fp8 {args.fp8}, {', '.join([scaling] + also)} + {compute}"
    optimizer = ["fp32 main params"]  # megatron-core's mixed-precision optimizer: without the precision-aware one
    if args.use_precision_aware_optimizer:  # the dtype flags change nothing
        optimizer = [f"{_dtype_name(args.main_params_dtype)} main params"]
        grads, m, v = (_dtype_name(d) for d in (args.main_grads_dtype, args.exp_avg_dtype, args.exp_avg_sq_dtype))
        if grads != "fp32":
            optimizer.append(f"{grads} main grads")
        if (m, v) != ("fp32", "fp32"):
            optimizer.append(f"{m} Adam moments" if m == v else f"Adam moments {m} / {v}")
    return ", ".join([text] + optimizer)


def _te_import_error() -> str:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # what platform.te_importable() swallowed: the reason TE is unusable here
        return f"importing transformer_engine.pytorch: {type(e).__name__}: {_one_line(str(e))}"
    return "transformer_engine.pytorch imports in this process"


def _runtime_device() -> dict:
    import torch

    if not torch.cuda.is_available():
        import platform as pyplatform

        return dict(type="cpu", name=pyplatform.processor() or pyplatform.machine(), threads=torch.get_num_threads())
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    driver = None
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
        pynvml.nvmlShutdown()
    except Exception:  # the driver version is informative only; NVML's absence is reported by the energy column
        pass
    return dict(type="cuda", name=torch.cuda.get_device_name(index), count=torch.cuda.device_count(),
                capability=f"{major}.{minor}", cuda=torch.version.cuda, cudnn=backend_probe.torch_cudnn_version(),
                te_cudnn=backend_probe.te_cudnn_version(),
                driver=driver, memory_gib=torch.cuda.get_device_properties(index).total_memory / 2**30)


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def classify_failure(e: BaseException) -> Tuple[str, str]:
    """(status, one-line reason) of an exception raised while running a system."""
    try:
        import torch

        oom_types = (torch.cuda.OutOfMemoryError,)
    except ImportError:
        oom_types = ()
    text = _one_line(str(e))
    # cuBLAS/cuDNN report an exhausted GPU as *_STATUS_ALLOC_FAILED rather than torch's OutOfMemoryError.
    if isinstance(e, oom_types) or any(m in str(e).lower() for m in ("out of memory", "alloc_failed")):
        return "oom", f"out of memory: {text}"
    if isinstance(e, UserError):
        return "failed", text
    if isinstance(e, ImportError):
        return "failed", f"import error: {text}"
    return "failed", f"{type(e).__name__}: {text}"


def worker_main(spec_json: str, result_path: str) -> None:
    spec = json.loads(spec_json)
    name = spec["system"]
    definition = spec["definition"]
    system = System(**{**definition, "flags": tuple(definition["flags"]),
                       "env": tuple(tuple(pair) for pair in definition.get("env", ()))})
    result = dict(system=name, status="failed", reason=None)
    try:
        result["device"] = _runtime_device()
        if system.kind == "hf":
            import torch

            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(0)
            args = resolve_quietly(spec["flags"] + (["--bf16"] if cuda else []))
            args.global_batch_size = args.global_batch_size or args.micro_batch_size
            result.update(run_hf(args, system, cuda, spec["warmup"], spec["steps"], spec.get("profile_steps", 0)))
        else:
            result.update(run_megatron(spec["flags"], system, spec["warmup"], spec["steps"],
                                       spec.get("profile_steps", 0), spec.get("log_interval", 1)))
        result["status"] = "ok"
    except BaseException as e:  # every failure becomes a result line; the traceback goes to the worker's log
        traceback.print_exc()
        result["status"], result["reason"] = classify_failure(e)
        with contextlib.suppress(Exception):
            import torch

            if torch.cuda.is_available():
                result["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    sys.stderr.flush()
    # The result is written; skip interpreter teardown (NCCL communicators, TE and torch.compile worker pools),
    # which can block after a failure and would then cost the whole --timeout.
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        worker_main(sys.argv[2], sys.argv[3])
    if len(sys.argv) == 3 and sys.argv[1] == "--preflight":
        sys.exit(preflight_main(sys.argv[2]))
    sys.exit(main())
