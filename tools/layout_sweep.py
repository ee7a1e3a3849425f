#!/usr/bin/env python3
"""Train the same model under several parallel layouts, one after another, and tabulate their throughput.

    python tools/layout_sweep.py --out runs/sweep --layout 1:"" --layout 2:"--tensor-model-parallel-size 2" \
        -- --model llama-1b --mock-data --bf16 --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 \
           --train-iters 20 --log-interval 5

Each layout is `NPROC:FLAGS`; the flags after `--` are shared. Each run is a fresh `torchrun -m litespark_megatron`
writing its own metrics.jsonl; the table takes the mean over the log records after the first (warm-up) of
tokens/s per GPU, TFLOP/s per GPU, MFU, peak memory, GPU power and J/token, and the ratio of each layout's
tokens/s per GPU to the first layout's (the first that trained, where an earlier one failed: sweep.md names it).
Writes OUT/sweep.md and OUT/sweep.json.

A layout whose FLAGS start with `hf-ddp` or `hf-fsdp2` trains HF transformers' Llama of the same shape and batch
data-parallel instead (`litespark_megatron.apps.hf_parallel`: torch DDP, or FSDP2 with every decoder layer sharded;
bf16 parameters, gradients and AdamW states), measured and tabulated the same way, e.g. the baseline of a team without
Megatron next to Litespark's layouts: `--layout "2:hf-fsdp2" --layout "2:hf-ddp" --layout "2:--tensor-model-parallel-size
2 --sequence-parallel"`. Each row names what trained (spec and precision from its metrics' run record). HF layouts
train on random tokens; megatron layouts beside them must too: `--random-tokens` writes one dataset of random tokens
(uniform over the vocabulary, the shared flags' shape and batch) and trains every megatron layout on it instead of
`--mock-data` (the sweep refuses the mix without it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a source checkout: the package next to tools/
    sys.path.insert(0, str(ROOT))

from litespark_megatron.arguments import (ConfigError, cuda_graph_capture_step, launch_environment,  # noqa: E402
                                          resolve_quietly)

HF_LAYOUTS = ("hf-ddp", "hf-fsdp2")  # a layout's first word: HF transformers under torch's data parallelism
REFUSALS = ("litespark-train: error: ", "hf_parallel: error: ")  # the trainers' one-line refusals
ABORT_GRACE_S = 10  # seconds a timed-out run's ranks get to print their stacks before SIGKILL
FIELDS = ("tokens_per_sec_per_gpu", "tflops_per_gpu", "mfu", "mem_max_allocated_gb", "gpu_power_w",
          "joules_per_token")


def run_env(flags) -> dict:
    """The environment of a layout's run: the package importable from the checkout, and on a Hopper or older GPU
    one hardware work queue (CUDA_DEVICE_MAX_CONNECTIONS=1) where TP or CP overlap communication with compute, which
    Megatron-LM refuses to start without (scripts/pretrain.sh sets it the same way); a value set by the user wins."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    sizes = {"--tensor-model-parallel-size": 1, "--context-parallel-size": 1}
    pairs = [f.split("=", 1) if f.startswith("--") and "=" in f else [f] for f in flags]
    words = [w for pair in pairs for w in pair]
    for flag, value in zip(words, words[1:]):  # the last one given wins, as in argparse
        if flag in sizes and value.isdigit():
            sizes[flag] = int(value)
    tp, cp = sizes["--tensor-model-parallel-size"], sizes["--context-parallel-size"]
    if tp * cp > 1:  # (the GPU's generation asked of NVML only then)
        env.update(launch_environment(tp, cp, _hopper_or_older(), env))
    return env


def run_layout(cmd, log, env, timeout: float):
    """One layout's torchrun, in a process group of its own: its exit status, or "timeout". A run past the timeout
    is stopped as a whole (torchrun alone killed would leave its ranks holding the GPUs for the next layout): first
    SIGABRT, on which every rank's Python prints where it was (PYTHONFAULTHANDLER), then SIGKILL."""
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**env, "PYTHONFAULTHANDLER": "1"},
                            start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGABRT, ABORT_GRACE_S), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        return "timeout"
    except BaseException:  # Ctrl-C: no run may keep the GPUs after the sweep
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _hopper_or_older() -> bool:
    """GPU 0's compute capability below 10, read through NVML: asking torch would open a CUDA context on GPU 0 in
    this process, memory every run after it would lack. Without a GPU (or NVML): True, the variable is harmless."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return True
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return True
        major, _ = pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(0))
        return major < 10
    except Exception:
        return True
    finally:
        pynvml.nvmlShutdown()


def steady_state(metrics: Path) -> dict:
    from litespark_megatron.backend_probe import from_metrics

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train = [r for r in records if r.get("kind") == "train"][1:]  # the first interval holds warm-up/compilation
    health = from_metrics(records)
    run = next((r for r in records if r.get("kind") == "run" and "spec" in r), {})
    out = {"health": health.to_dict() if health else None, "spec": run.get("spec"), "precision": run.get("precision")}
    for field in FIELDS:
        values = [r[field] for r in train if r.get(field) is not None]
        out[field] = sum(values) / len(values) if values else None
    out["intervals"] = len(train)
    return out


DATA_FLAGS = ("--mock-data", "--data-path", "--train-data-path", "--embedded-corpus")


def is_hf(flags) -> bool:
    return bool(flags) and flags[0] in HF_LAYOUTS


def data_error(layouts, shared, random_tokens: bool):
    """Why the sweep's data would make its rows incomparable, or None. The HF layouts train on random tokens; a
    megatron layout beside them must too: Litespark FP8's speed differs between megatron-core's mock data
    (counting sequences) and random tokens (docs/benchmarks/2026-11-25-two-gpu-tp2-graphs-dp2-hf-pao-loss.md), so
    such a table could favour the megatron rows."""
    hf = any(is_hf(flags) for _, flags in layouts)
    megatron = any(not is_hf(flags) for _, flags in layouts)
    layout_data = [f for _, flags in layouts for f in flags if f.split("=", 1)[0] in DATA_FLAGS]
    if random_tokens:
        given = [f for f in shared if f.split("=", 1)[0] in DATA_FLAGS and f != "--mock-data"] + layout_data
        if given:
            return (f"--random-tokens replaces the megatron layouts' data; drop {given[0]} (from the shared flags "
                    "and the layouts)")
        return None
    if hf and megatron:
        return ("HF layouts train on random tokens and the megatron layouts on the shared flags' data: pass "
                "--random-tokens so that every row trains on the same kind of tokens")
    return None


def random_token_data(shared, args, prefix: Path):
    """The shared flags with --mock-data replaced by a dataset of random tokens: one step's sequences for each of
    --train-iters steps (the shape and batch of the shared flags, `args`; a layout that asks for more reads it
    again)."""
    from litespark_megatron.apps.benchmark import random_token_flags

    return random_token_flags(shared, args, str(prefix), args.global_batch_size * args.train_iters, args.seed)


def failure_reason(lines) -> str:
    """Why a run failed, in one line, from its log: torchrun's report at the end names only exit codes and signals.
    The trainer's one-line refusal if there is one; else running out of GPU memory (the allocation that failed);
    else the last exception a rank raised."""
    lines = [line.strip() for line in lines if line.strip()]
    refusals = [line for line in lines if line.startswith(REFUSALS)]
    if refusals:
        return refusals[-1]
    oom = [line for line in lines if "OutOfMemoryError: CUDA out of memory." in line]
    if oom:
        detail = oom[0].split("CUDA out of memory.", 1)[1].strip().split(". ")[0]
        return f"out of GPU memory ({detail})"
    raised = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in lines
              if re.match(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b:?", line)
              and "ChildFailedError" not in line]
    if raised:
        return raised[-1][:300]
    return " | ".join(lines[-3:])[-300:]


def graph_capture_error(layouts, shared) -> str:
    """A megatron layout with CUDA graphs captures them at the start of step --cuda-graph-warmup-steps + 1; the sweep
    leaves out only the first log interval, which must hold that step, or the capture is averaged in. Flags that do
    not resolve are left to the run, which says why."""
    for nproc, flags in layouts:
        if is_hf(flags):
            continue
        try:
            run = resolve_quietly([*shared, *flags])
        except ConfigError:
            continue
        capture = cuda_graph_capture_step(run)
        if capture is not None and run.log_interval < capture:
            return (f"--layout {nproc}:{shlex.join(flags)} captures CUDA graphs in step {capture} "
                    f"(--cuda-graph-warmup-steps {run.cuda_graph_warmup_steps}), after the first log interval, the "
                    f"only one the sweep leaves out (--log-interval {run.log_interval}): give --log-interval "
                    f"{capture} or more")
    return ""


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    shared = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(prog="layout_sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for runs, sweep.md and sweep.json")
    p.add_argument("--layout", action="append", required=True, metavar="NPROC:FLAGS")
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--allow-degraded", action="store_true",
                   help="exit 0 even if a layout fell back (unfused attention, a fused path asked for but off); "
                        "it stays flagged DEGRADED in the table")
    p.add_argument("--random-tokens", action="store_true",
                   help="the megatron layouts train on random tokens, uniform over the vocabulary (the HF layouts' "
                        "data), written once to OUT/random-tokens.bin/.idx, instead of the shared flags' --mock-data; "
                        "needed to compare with an HF layout")
    args = p.parse_args(own)
    layouts = []
    for spec in args.layout:
        nproc, _, flags = spec.partition(":")
        if not nproc.isdigit() or int(nproc) < 1:
            print(f"layout_sweep: error: --layout {spec!r}: expected NPROC:FLAGS, e.g. 2:'--use-distributed-optimizer'",
                  file=sys.stderr)
            return 2
        layouts.append((int(nproc), shlex.split(flags)))
    for nproc, flags in layouts:
        if flags and flags[0].startswith("hf") and flags[0] not in HF_LAYOUTS:
            print(f"layout_sweep: error: --layout {nproc}:{flags[0]}: unknown HF layout; use one of "
                  f"{', '.join(HF_LAYOUTS)}", file=sys.stderr)
            return 2
    error = data_error(layouts, shared, args.random_tokens) or graph_capture_error(layouts, shared)
    if error:
        print(f"layout_sweep: error: {error}", file=sys.stderr)
        return 2
    if args.random_tokens:
        try:
            shape = resolve_quietly(shared)
        except ConfigError as e:
            print(f"layout_sweep: error: --random-tokens needs the model's shape from the shared flags: {e}",
                  file=sys.stderr)
            return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    megatron_shared = random_token_data(shared, shape, out / "random-tokens") if args.random_tokens else shared
    rows = []
    for i, (nproc, flags) in enumerate(layouts):
        name = f"{i}_np{nproc}_" + ("_".join(f.lstrip("-") for f in flags) or "base")
        run_dir = out / name[:120]
        if is_hf(flags):
            trainer, own, common = ("litespark_megatron.apps.hf_parallel",
                                    ["--parallel", flags[0][len("hf-"):], *flags[1:]], shared)
        else:
            trainer, own, common = "litespark_megatron", flags, megatron_shared
        # --standalone: torchrun binds its own free port and holds it (a port chosen here and bound later by the run
        # could be taken in between)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
               trainer, *common, *own, "--metrics-file", str(run_dir / "metrics.jsonl")]
        run_dir.mkdir(parents=True, exist_ok=True)
        with open(run_dir / "log.txt", "w") as log:
            log.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
            log.flush()
            rc = run_layout(cmd, log, run_env([*shared, *flags]), args.timeout)
        row = {"nproc": nproc, "flags": " ".join(flags) or "(none)", "rc": rc}
        metrics = run_dir / "metrics.jsonl"
        if rc == 0 and metrics.exists():
            row.update(steady_state(metrics))
        else:
            row["error"] = (f"no result within --timeout {args.timeout} s; each rank's Python stack at the stop is in "
                            f"{run_dir / 'log.txt'}" if rc == "timeout" else
                            failure_reason((run_dir / "log.txt").read_text(errors="replace").splitlines()))
        rows.append(row)
        print(json.dumps(row), flush=True)
    # Ratios against the first layout that trained: a first layout that failed would leave every ratio empty.
    base_row = next((r for r in rows if r.get("tokens_per_sec_per_gpu")), None)
    base = base_row["tokens_per_sec_per_gpu"] if base_row else None
    for row in rows:
        value = row.get("tokens_per_sec_per_gpu")
        row["ratio_per_gpu_vs_first"] = value / base if value and base else None
    ratio_base = f"{base_row['nproc']}:{base_row['flags']}" if base_row else None
    (out / "sweep.json").write_text(json.dumps({"shared_flags": shared, "random_tokens": args.random_tokens,
                                                "ratio_base": ratio_base, "rows": rows}, indent=1))

    def fmt(v, spec):
        return "n/a" if v is None else format(v, spec)

    lines = ["| GPUs | layout | trained | tokens/s/GPU | ratio vs first | TFLOP/s/GPU | MFU | peak mem GB | W/GPU | "
             "J/token | what ran (rank 0) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    degraded = []
    for r in rows:
        if r["rc"] != 0:
            lines.append(f"| {r['nproc']} | {r['flags']} | failed ({r['rc']}): {r.get('error', '')[:120]} |||||||||")
            continue
        health = r.get("health")
        if health is None:
            ran = "not recorded"
        else:
            ran = ("**DEGRADED**: " + "; ".join(health["degraded"]) + "; " if health["degraded"] else "") + \
                " + ".join(health["attention"]) + "; fused: " + \
                (", ".join(f"{k} {v}" for k, v in health["fusions"].items()) or "none")
            if health["degraded"]:
                degraded.append(f"{r['nproc']}:{r['flags']}: " + "; ".join(health["degraded"]))
        trained = " ".join(str(r[k]) for k in ("spec", "precision") if r.get(k)) or "n/a"
        lines.append(f"| {r['nproc']} | {r['flags']} | {trained} | {fmt(r['tokens_per_sec_per_gpu'], ',.0f')} | "
                     f"{fmt(r['ratio_per_gpu_vs_first'], '.3f')} | {fmt(r['tflops_per_gpu'], '.1f')} | "
                     f"{fmt(r['mfu'], '.1%')} | {fmt(r['mem_max_allocated_gb'], '.1f')} | "
                     f"{fmt(r['gpu_power_w'], '.0f')} | {fmt(r['joules_per_token'], '.4f')} | {ran} |")
    table = "\n".join(lines)
    data = ("\n\ndata: random tokens, uniform over the vocabulary, for every layout (megatron layouts: "
            f"{out / 'random-tokens'})" if args.random_tokens else "")
    if base_row is not None and base_row is not rows[0]:
        data += f"\n\nratios against the first layout that trained: {ratio_base}"
    (out / "sweep.md").write_text("shared flags: `" + " ".join(shared) + "`" + data + "\n\n" + table + "\n")
    print(table)
    for what in degraded:
        print(f"layout_sweep: DEGRADED layout {what}" +
              ("" if args.allow_degraded else " (fix the environment, or pass --allow-degraded to accept it)"),
              file=sys.stderr)
    return 0 if all(r["rc"] == 0 for r in rows) and (args.allow_degraded or not degraded) else 1


if __name__ == "__main__":
    sys.exit(main())
