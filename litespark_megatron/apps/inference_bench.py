"""Inference benchmark: precisions of one HF Llama (bf16, fp16, torchao int4 with round-to-nearest, HQQ or AWQ
scales, float8, bitsandbytes NF4), each measured in a fresh process on the same prompts and held-out text.

    python tools/inference_bench.py --hf DIR --out runs/inf --variants bf16,fp16,int4 --batch-sizes 1,8,32 \\
        --prompt-tokens 256 --new-tokens 256 --repeats 3

DIR is any HF Llama directory, normally `litespark-convert export` of a model trained here (with its tokenizer:
export --tokenizer, or --tokenizer here). Per variant: weight bytes as stored (scales and zeros included) beside
the nominal bits, perplexity and top-1 next-token accuracy on held-out text, top-1 agreement with bf16, the model
compression rate (MCR) both measured (bytes) and nominal (bits); per variant and batch size: time to first token,
decode latency per token, IT (generated tokens/s), peak memory, GPU power and J/token (NVML), decode bandwidth and
its fraction of the GPU's peak (MBU). Engine and definitions: inference_engine.py; quality: inference_quality.py;
precisions: inference_variants.py.

Resumable as the efficiency suite is: OUT/bench_state.json records every run; the same command again skips the
runs that finished and re-runs the ones that were interrupted or failed (--rerun NAME forces one). A variant that
cannot run here (float8 without a recent GPU, NF4 without bitsandbytes) is a row saying why.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..errors import UserError
from . import run_state
from .inference_variants import DEFAULT_VARIANTS, VARIANTS, cannot_run_reason, parse_variant_names

STATE_FILE = "bench_state.json"
STATE_VERSION = 1
CANNOT_RUN = "cannot run here"
REPEAT_MARK = ".r"
OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|CUDA error: out of memory")
FINAL = ("done", "oom")
MAX_BATCH = 4096  # a sanity bound on a batch-size typo, far above the 32 the suite measures


# --------------------------------------------------------------------------------------------- settings
def batch_sizes(text: str) -> List[int]:
    """'1,8,32' -> [1, 8, 32]: distinct positive integers."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"positive integers separated by commas expected, got {text!r}") from None
    bad = [v for v in values if not 1 <= v <= MAX_BATCH]
    if bad:
        raise argparse.ArgumentTypeError(f"batch sizes must be between 1 and {MAX_BATCH}, got {bad[0]}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"a batch size is named twice: {text!r}")
    return values


@dataclass
class Settings:
    hf: Path
    out: Path
    variants: List[str]
    batch_sizes: List[int]
    prompt_tokens: int
    new_tokens: int
    warmup: int
    timed_calls: int
    repeats: int
    compile: bool
    cpu: bool
    tokenizer: Optional[Path]
    eval_text: Optional[Path]
    calibration_text: Optional[Path]
    eval_tokens: int
    eval_seq_length: int
    eval_batch: int
    quantize_lm_head: bool
    timeout: int
    rerun: List[str] = field(default_factory=list)
    peak_bandwidth_gbs: Optional[float] = None
    seed: int = 1234

    def run_ids(self, name: str) -> List[str]:
        return [name] + [f"{name}{REPEAT_MARK}{k}" for k in range(2, self.repeats + 1)]

    def identity(self) -> dict:
        """What makes two invocations the same benchmark (the variant list and the repeats may grow)."""
        return dict(hf=str(self.hf), batch_sizes=self.batch_sizes, prompt_tokens=self.prompt_tokens,
                    new_tokens=self.new_tokens, warmup=self.warmup, timed_calls=self.timed_calls,
                    compile=self.compile, cpu=self.cpu, tokenizer=str(self.tokenizer) if self.tokenizer else None,
                    eval_text=str(self.eval_text) if self.eval_text else None,
                    calibration_text=str(self.calibration_text) if self.calibration_text else None,
                    eval_tokens=self.eval_tokens, eval_seq_length=self.eval_seq_length,
                    quantize_lm_head=self.quantize_lm_head, seed=self.seed)


PROG = "inference_bench"


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    from .cli import OneLineParser, non_negative_int, positive_float, positive_int

    p = OneLineParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                      description="Measure precisions of one HF Llama (16-bit, int4, float8, NF4), each in a fresh "
                                  "process: latency, throughput, memory, energy, bandwidth, perplexity and "
                                  "agreement with bf16.")
    p.add_argument("--hf", required=True, help="HF Llama directory (config.json + safetensors)")
    p.add_argument("--out", required=True,
                   help="directory for the runs, state, inference.md, inference.json and findings.md")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help="comma list of: " + ", ".join(VARIANTS) + "; or all")
    p.add_argument("--batch-sizes", type=batch_sizes, default=[1, 8, 32], help="comma list of prompts per call")
    p.add_argument("--prompt-tokens", type=positive_int, default=256, help="P: tokens of every prompt (prefill)")
    p.add_argument("--new-tokens", type=positive_int, default=256, help="N: tokens generated per prompt")
    p.add_argument("--warmup", type=non_negative_int, default=1, help="untimed calls of each kind first")
    p.add_argument("--timed-calls", type=positive_int, default=3, help="timed calls of each kind, averaged")
    p.add_argument("--repeats", type=positive_int, default=1,
                   help="fresh processes per variant: the table gives means and 95%% intervals over them")
    p.add_argument("--compile", action="store_true",
                   help="let transformers torch.compile the decode step (GPU only)")
    p.add_argument("--cpu", action="store_true", help="measure on the CPU even where a GPU is visible")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or tokenizer.json (default: --hf's)")
    p.add_argument("--eval-text", default=None,
                   help="held-out text file (.txt, or .jsonl with 'text'); default: the validation documents of "
                        "--embedded-corpus stdlib")
    p.add_argument("--calibration-text", default=None,
                   help="text AWQ calibrates on; default: the test documents of --embedded-corpus stdlib")
    p.add_argument("--eval-tokens", type=positive_int, default=65536, help="tokens of held-out text evaluated")
    p.add_argument("--eval-seq-length", type=positive_int, default=512, help="tokens per evaluation window")
    p.add_argument("--eval-batch", type=positive_int, default=8, help="evaluation windows per forward")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the output layer too (the embedding always stays 16-bit)")
    p.add_argument("--peak-bandwidth-gbs", type=positive_float, default=None,
                   help="the GPU's peak memory bandwidth for MBU (default: known for H100, H200, A100)")
    p.add_argument("--timeout", type=positive_int, default=3600, help="seconds per variant run")
    p.add_argument("--rerun", default="", help="comma list of variants to run again even if recorded as done")
    return p


def parse_settings(argv: Sequence[str], prog: str = PROG) -> Settings:
    parser = build_parser(prog)
    try:
        ns = parser.parse_args(list(argv))
    except SystemExit as e:
        if e.code == 0:  # --help
            raise
        raise UserError("") from None  # argparse printed its one line already
    variants = parse_variant_names(ns.variants)
    rerun = [n.strip() for n in ns.rerun.split(",") if n.strip()]
    unknown = [n for n in rerun if n not in variants]
    if unknown:
        raise UserError(f"--rerun {unknown[0]}: not one of the --variants ({', '.join(variants)})")
    return Settings(hf=Path(ns.hf).resolve(), out=Path(ns.out), variants=variants, batch_sizes=ns.batch_sizes,
                    prompt_tokens=ns.prompt_tokens, new_tokens=ns.new_tokens, warmup=ns.warmup,
                    timed_calls=ns.timed_calls, repeats=ns.repeats, compile=ns.compile, cpu=ns.cpu,
                    tokenizer=Path(ns.tokenizer).resolve() if ns.tokenizer else None,
                    eval_text=Path(ns.eval_text).resolve() if ns.eval_text else None,
                    calibration_text=Path(ns.calibration_text).resolve() if ns.calibration_text else None,
                    eval_tokens=ns.eval_tokens, eval_seq_length=ns.eval_seq_length, eval_batch=ns.eval_batch,
                    quantize_lm_head=ns.quantize_lm_head, timeout=ns.timeout, rerun=rerun,
                    peak_bandwidth_gbs=ns.peak_bandwidth_gbs)


# --------------------------------------------------------------------------------------------- the machine
@dataclass(frozen=True)
class Machine:
    device: str  # "cuda" or "cpu"
    name: str
    capability: Optional[tuple]

    @staticmethod
    def detect(cpu: bool) -> "Machine":
        import platform

        import torch

        if not cpu and torch.cuda.is_available():
            return Machine("cuda", torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0)))
        return Machine("cpu", f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)", None)


def plan(settings: Settings, machine: Machine, config: dict) -> Dict[str, Optional[str]]:
    """variant -> why it cannot run here (None: it runs). Raises UserError for settings no variant can run with."""
    positions = config.get("max_position_embeddings")
    if positions and settings.prompt_tokens + settings.new_tokens > positions:
        raise UserError(f"--prompt-tokens {settings.prompt_tokens} + --new-tokens {settings.new_tokens} exceed the "
                        f"model's {positions} positions (max_position_embeddings)")
    if positions and settings.eval_seq_length > positions:
        raise UserError(f"--eval-seq-length {settings.eval_seq_length} exceeds the model's {positions} positions")
    if settings.compile and machine.device != "cuda":
        raise UserError("--compile: transformers compiles the decode step on a GPU only, and this run has none")
    reasons = {name: cannot_run_reason(name, machine.capability) for name in settings.variants}
    if all(reasons.values()):
        raise UserError("no variant can run here: " + "; ".join(f"{n}: {r}" for n, r in reasons.items()))
    return reasons


# --------------------------------------------------------------------------------------------- text
def tokenizer_source(settings: Settings) -> Path:
    """--tokenizer, else the model directory's own tokenizer; refused when neither exists."""
    if settings.tokenizer is not None:
        if not settings.tokenizer.exists():
            raise UserError(f"--tokenizer {settings.tokenizer}: no such file or directory")
        return settings.tokenizer
    if not (settings.hf / "tokenizer.json").is_file():
        raise UserError(f"--hf {settings.hf} has no tokenizer.json: pass --tokenizer (the model's tokenizer "
                        f"directory; litespark-convert export --tokenizer ships it with the model)")
    return settings.hf


def prepare_text(settings: Settings, config: dict, calibration: bool) -> Path:
    """OUT/text/: the token windows every variant evaluates (eval.pt), the prompt token stream (prompts.pt) and,
    for a calibrated variant, AWQ's calibration windows (calibration.pt). Made once; each file complete or absent."""
    import torch

    from . import inference_quality as quality

    text = settings.out / "text"
    text.mkdir(parents=True, exist_ok=True)
    wanted = ["eval.pt", "prompts.pt"] + (["calibration.pt"] if calibration else [])
    if all((text / name).exists() for name in wanted):
        return text
    from ..data import load_tokenizer

    tokenizer = load_tokenizer(None, str(tokenizer_source(settings)))
    vocab = config.get("vocab_size")

    def stream_of(documents, what):
        stream = quality.token_stream(tokenizer, documents, settings.eval_tokens)
        too_big = [t for t in stream if vocab and t >= vocab]
        if too_big:
            raise UserError(f"the tokenizer gives token id {too_big[0]} for the {what}, beyond the model's "
                            f"vocabulary of {vocab}: not this model's tokenizer")
        return stream

    def save(name, tensor):
        tmp = text / (name + ".tmp")
        torch.save(tensor, tmp)
        os.replace(tmp, text / name)

    if not (text / "eval.pt").exists() or not (text / "prompts.pt").exists():
        docs = (quality.text_file_documents(str(settings.eval_text)) if settings.eval_text
                else quality.embedded_corpus_documents("validation"))
        stream = stream_of(docs, "evaluation text")
        save("eval.pt", quality.windows(stream, settings.eval_seq_length))
        save("prompts.pt", torch.tensor(stream, dtype=torch.long))
    if calibration and not (text / "calibration.pt").exists():
        docs = (quality.text_file_documents(str(settings.calibration_text)) if settings.calibration_text
                else quality.embedded_corpus_documents("test"))
        save("calibration.pt", quality.windows(stream_of(docs, "calibration text"), settings.eval_seq_length))
    return text


# --------------------------------------------------------------------------------------------- state
def load_state(out: Path, identity: dict) -> dict:
    return run_state.load_state(out, STATE_FILE, STATE_VERSION, identity, entries="runs", what="benchmark",
                                restart="start over")


def save_state(out: Path, state: dict) -> None:
    run_state.save_state(out, STATE_FILE, state)


# --------------------------------------------------------------------------------------------- running
def failure_line(returncode, log_text: str) -> str:
    """One line saying why a run ended badly: an out-of-memory line, the exception's line, or the last output."""
    lines = [line.strip() for line in (log_text or "").splitlines() if line.strip()]
    for pick in (lambda l: OOM.search(l), lambda l: re.match(r"^[\w.]*(Error|Exception)\b", l)):
        hits = [l for l in lines if pick(l)]
        if hits:
            return hits[-1][:400]
    if returncode == "timeout":
        return "timed out"
    if isinstance(returncode, int) and returncode < 0:
        return f"killed by signal {-returncode}"
    return (" | ".join(lines[-3:]) or f"exit status {returncode}")[-400:]


def spec_of(settings: Settings, machine: Machine, name: str, repeat: int, text: Path) -> dict:
    from .inference_engine import peak_bandwidth_gbs

    return dict(hf=str(settings.hf), variant=name, device=machine.device, device_name=machine.name,
                seed=settings.seed + repeat - 1, text_dir=str(text.resolve()), eval_batch=settings.eval_batch,
                quantize_lm_head=settings.quantize_lm_head, compile=settings.compile,
                batch_sizes=settings.batch_sizes, prompt_tokens=settings.prompt_tokens,
                new_tokens=settings.new_tokens, warmup=settings.warmup, timed_calls=settings.timed_calls,
                peak_bandwidth_gbs=settings.peak_bandwidth_gbs or (peak_bandwidth_gbs(machine.name)
                                                                   if machine.device == "cuda" else None))


def run_variant(settings: Settings, run_id: str, spec: dict) -> dict:
    """One fresh process measuring one variant; the state entry it leaves (done / oom / failed)."""
    import shutil

    run_dir = settings.out / "runs" / run_id
    shutil.rmtree(run_dir, ignore_errors=True)  # a half-written run is never read
    run_dir.mkdir(parents=True)
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=1))
    cmd = [sys.executable, "-m", "litespark_megatron.apps.inference_run", str(run_dir)]
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # the package's checkout, whether installed or not
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else root
    if spec["device"] == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu: the measurement must not touch a GPU
    started = time.time()
    with open(run_dir / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=settings.timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = "timeout"
        except BaseException:  # the benchmark itself is interrupted: leave no measuring process behind
            proc.kill()
            proc.wait()
            raise
    entry = dict(returncode=rc, seconds=round(time.time() - started, 1))
    text = (run_dir / "log.txt").read_text(errors="replace")
    if rc == 0 and (run_dir / "result.json").exists():
        entry["status"] = "done"
    else:
        entry["status"] = "oom" if OOM.search(text) else "failed"
        entry["error"] = failure_line(rc, text) if rc != 0 else "the run ended without writing result.json"
    return entry


def run_bench(settings: Settings, log=print) -> int:
    from .inference_engine import check_llama_dir

    config = check_llama_dir(str(settings.hf))
    machine = Machine.detect(settings.cpu)
    reasons = plan(settings, machine, config)
    runnable = [n for n in settings.variants if not reasons[n]]
    tokenizer_source(settings)
    for path, flag in ((settings.eval_text, "--eval-text"), (settings.calibration_text, "--calibration-text")):
        if path is not None and not path.is_file():
            raise UserError(f"{flag} {path}: no such file")
    settings.out.mkdir(parents=True, exist_ok=True)
    state = load_state(settings.out, settings.identity())
    text = prepare_text(settings, config, any(VARIANTS[n].needs_calibration for n in runnable))
    state["device"] = machine.name
    for name, reason in reasons.items():
        if reason:
            log(f"{name}: cannot run here: {reason}")
            state["runs"][name] = dict(status=CANNOT_RUN, error=reason)
    save_state(settings.out, state)
    for repeat in range(1, settings.repeats + 1):
        for name in runnable:
            run_id = settings.run_ids(name)[repeat - 1]
            entry = state["runs"].get(run_id, {})
            if any(state["runs"].get(r, {}).get("status") == "oom" for r in settings.run_ids(name)[:repeat - 1]):
                continue  # another repeat would run out of memory as well
            if entry.get("status") in FINAL and name not in settings.rerun and (
                    entry["status"] == "oom" or (settings.out / "runs" / run_id / "result.json").exists()):
                log(f"{run_id}: already {entry['status']}, skipped")
                continue
            state["runs"][run_id] = dict(status="running", started=time.strftime("%Y-%m-%dT%H:%M:%S"))
            save_state(settings.out, state)  # interrupted from here on: 'running', run again next time
            log(f"{run_id}: measuring ({VARIANTS[name].what}) ...")
            result = run_variant(settings, run_id, spec_of(settings, machine, name, repeat, text))
            state["runs"][run_id] = result
            save_state(settings.out, state)
            log(f"{run_id}: {result['status']} in {result['seconds']:.0f} s" +
                (f": {result['error']}" if result.get("error") else ""))
    from .inference_report import write_report

    rows = write_report(settings, state)
    log((settings.out / "inference.md").read_text())
    log(f"wrote {settings.out / 'inference.md'}, inference.json and findings.md (EfficientLLM's inference findings)")
    return 0 if all(r["status"] in ("done", CANNOT_RUN) for r in rows) else 1


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None, prog: str = PROG) -> int:
    """`prog`: the command's name in its messages (the efficiency suite's inference axis runs this)."""
    signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop unwinds like Ctrl-C: the running variant stops
    try:
        settings = parse_settings(sys.argv[1:] if argv is None else argv, prog)
        return run_bench(settings)
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except UserError as e:
        if str(e):
            print(f"{prog}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; the variant that was running runs again when the same command is repeated",
              file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
