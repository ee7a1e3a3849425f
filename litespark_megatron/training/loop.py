"""`litespark-train`: the pretraining entry point, readable top to bottom.

    main(argv) -> check everything that can be checked (config, data, tokenizer, --save, --load)
               -> train(args): process groups -> model -> optimizer -> data -> [resume] -> loop -> summary
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch.distributed as dist

from .. import config as config_lib
from .. import health as health_lib
from .. import platform
from ..config import UserError


def log0(msg: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def main(argv=None) -> int:
    platform.quiet_library_noise()
    try:
        args, plat, corpus = prepare(argv)
    except UserError as e:
        print(f"litespark-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        train(args, plat, corpus)
    except UserError as e:  # raised identically on every rank (same inputs, same checks)
        print(f"litespark-train: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            platform.shutdown()
    return 0


# --------------------------------------------------------------------------------------------- before any work
def prepare(argv):
    """Resolve and validate the run, its data and its checkpoints. Writes nothing but the (cached) default
    corpus and the --save directory itself."""
    from .. import data
    from . import checkpoint

    args = config_lib.resolve(argv)
    plat = platform.detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config_lib.validate(args, world, cuda=plat.device_type == "cuda", te=plat.te, fp8_capable=plat.fp8_capable)
    corpus = None
    if not args.mock_data and not args.data_path:
        from ..corpus import prepare_stdlib_corpus

        cache = args.data_cache_path or os.path.join(
            os.environ.get("LITESPARK_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "litespark-megatron")),
            "stdlib-corpus")
        corpus = prepare_stdlib_corpus(cache)
        args.data_path, args.tokenizer_model, args.tokenizer_type = [corpus.prefix], corpus.tokenizer_dir, None
    if not args.mock_data:
        prefixes, _ = data.parse_data_path(args.data_path)  # missing prefixes, corrupt indices
    tokenizer = data.tokenizer_from_args(args)
    args.global_batch_size = args.global_batch_size or args.micro_batch_size * config_lib.data_parallel_size(
        args, world)
    if not args.mock_data:
        if "vocab_size" in args.preset_fields:
            args.vocab_size = tokenizer.vocab_size
        data.check_vocab(tokenizer, args.vocab_size)
        data.check_split([data.inspect_prefix(p) for p in prefixes], args.split, sample_counts(args))
    if args.load:
        checkpoint.latest_iteration(args.load)
    if args.save:
        checkpoint.check_writable(args.save)
    args.tokenizer = tokenizer
    return args, plat, corpus


def sample_counts(args) -> list:
    """Samples the run draws from the train, valid and test parts (megatron-core sizes its indices by these)."""
    gbs = args.global_batch_size
    evals = (args.train_iters // args.eval_interval if args.eval_interval else 0) + 1
    return [args.train_iters * gbs, evals * args.eval_iters * gbs, args.eval_iters * gbs]


def _run_files(args):
    run_dir = args.save or args.tensorboard_dir
    metrics = args.metrics_file or (os.path.join(run_dir, "metrics.jsonl") if run_dir else None)
    return run_dir, metrics


def _save_config(args, run_dir) -> None:
    import yaml

    os.makedirs(run_dir, exist_ok=True)
    plain = {k: v for k, v in sorted(vars(args).items())
             if k not in ("tokenizer", "preset_fields") and isinstance(v, (int, float, str, bool, list, type(None)))}
    tmp = os.path.join(run_dir, "config.yaml.tmp")
    with open(tmp, "w") as f:
        yaml.safe_dump(plain, f, sort_keys=True)
    os.replace(tmp, os.path.join(run_dir, "config.yaml"))


# --------------------------------------------------------------------------------------------- the run
def train(args, plat, corpus=None) -> dict:
    from megatron.core import parallel_state as ps

    from .. import data
    from ..metrics.sinks import MetricsSink
    from . import checkpoint, optim, step as step_lib
    from .telemetry import Telemetry

    platform.init_distributed(args, plat)
    rank0 = dist.get_rank() == 0
    backend = config_lib.resolved_backend(args, cuda=plat.device_type == "cuda", te=plat.te)
    tokenizer = args.tokenizer

    # Model, optimizer, schedule.
    chunks, model, optimizer, scheduler = optim.build_training(args, backend, plat.device_type)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())

    # Resume.
    iteration, state = 0, {}
    if args.load:
        iteration, state = checkpoint.load(args, model, optimizer, scheduler)
        log0(f"resumed from {args.load} at iteration {iteration}")
    consumed_train = state.get("consumed_train_samples", iteration * args.global_batch_size)
    consumed_valid = state.get("consumed_valid_samples", 0)
    skipped_total = state.get("skipped_steps", 0)

    # Data.
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gbs, mbs = args.global_batch_size, args.micro_batch_size
    num_micro = gbs // (mbs * dp)
    train_ds, valid_ds, _ = data.build_datasets(args, tokenizer, sample_counts(args))

    def iterators(dataset, consumed):
        return [data.build_iterator(dataset, consumed, mbs, dp_rank, dp, args.num_workers) for _ in model]

    train_iters = iterators(train_ds, consumed_train)

    # Sinks: console, TensorBoard, metrics.jsonl; the resolved config next to them.
    run_dir, metrics_path = _run_files(args)
    if rank0 and run_dir:
        _save_config(args, run_dir)
    sink = MetricsSink(metrics_path, args.tensorboard_dir, enabled=rank0)
    telemetry = Telemetry(args, gbs, plat.device_type, plat.device_name)
    log0(f"litespark-train: {args.model} ({n_params / 1e6:.1f}M params on rank 0), spec {args.spec}/{backend}, "
         f"TP{args.tensor_model_parallel_size} PP{args.pipeline_model_parallel_size} "
         f"CP{args.context_parallel_size} DP{dp}, global batch {gbs} x {args.seq_length} tokens, "
         f"{plat.device_type} x {dist.get_world_size()}")
    for note in (telemetry.peak_note, telemetry.energy_note):
        if note:
            log0(note)
    if rank0:
        warning = health_lib.te_attention_check(args.hidden_size // args.num_attention_heads,
                                                args.num_attention_heads, args.num_query_groups)
        if warning:
            log0(f"WARNING: {warning}")
    sink.log(iteration, "run", dict(params=n_params, world_size=dist.get_world_size(),
                                    flops_per_step_full=telemetry.flops_full.model_flops,
                                    flops_per_step_causal=telemetry.flops_causal.model_flops))

    def evaluate(it: int) -> dict:
        nonlocal consumed_valid
        if valid_ds is None or args.eval_iters == 0:
            return {}
        telemetry.pause()
        valid_iters = iterators(valid_ds, consumed_valid)
        total, tokens = 0.0, 0
        for _ in range(args.eval_iters):
            loss, n = step_lib.eval_step(model, valid_iters, num_micro, args)
            total, tokens = total + loss * n, tokens + n
        consumed_valid += args.eval_iters * gbs
        telemetry.resume()
        result = dict(loss=total / max(tokens, 1), ppl=math.exp(min(total / max(tokens, 1), 50.0)))
        sink.log(it, "val", result)
        log0(f"  validation at step {it}: loss {result['loss']:.4f}, perplexity {result['ppl']:.2f}")
        return result

    def save(it: int) -> None:
        telemetry.pause()
        checkpoint.save(args, it, model, optimizer, scheduler, dict(
            consumed_train_samples=consumed_train, consumed_valid_samples=consumed_valid,
            skipped_steps=skipped_total))
        telemetry.resume()
        log0(f"  saved checkpoint {checkpoint.iteration_dir(args.save, it)}")

    # The loop.
    start_iteration, t_start = iteration, time.time()
    interval_losses, interval_skipped, last_val, first_loss, last_loss = [], 0, {}, None, None
    profiling = args.profile and dist.get_rank() in args.profile_ranks
    if args.profile and iteration > args.profile_step_start:
        log0(f"--profile: resumed at iteration {iteration}, after --profile-step-start {args.profile_step_start}: "
             "nothing is profiled in this run")
    profiler = None
    telemetry.start_interval()
    while iteration < args.train_iters:
        if profiling and iteration == args.profile_step_start:
            profiler = _start_profiler(plat)
        if iteration == start_iteration:  # the first step of this run: what attention and fused paths ran
            with health_lib.BackendProbe(chunks) as probe:
                result = step_lib.train_step(model, optimizer, scheduler, train_iters, num_micro, args)
            _log_health(probe.report(config=chunks[0].config, requested=health_lib.requested_fusions(args),
                                     device_type=plat.device_type), sink, iteration + 1)
        else:
            result = step_lib.train_step(model, optimizer, scheduler, train_iters, num_micro, args)
        iteration += 1
        consumed_train += gbs
        telemetry.step_done()
        if profiler is not None:
            profiler.step()
            if iteration == args.profile_step_end:
                profiler = _finish_profiler(profiler, run_dir, iteration)
        skipped_total += result.skipped
        interval_skipped += result.skipped
        if not result.skipped:
            interval_losses.append(result.loss)
            first_loss = result.loss if first_loss is None else first_loss
            last_loss = result.loss

        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            m = telemetry.end_interval()
            loss = sum(interval_losses) / len(interval_losses) if interval_losses else float("nan")
            record = dict(loss=loss, lr=scheduler.get_lr(optimizer.param_groups[0]), grad_norm=result.grad_norm,
                          skipped_steps=skipped_total, skipped_in_interval=interval_skipped,
                          consumed_samples=consumed_train, tokens_seen=consumed_train * args.seq_length, **m)
            if args.fp16:
                record["loss_scale"] = float(optimizer.get_loss_scale())
            sink.log(iteration, "train", record)
            eta = (args.train_iters - iteration) * m["step_time_s"]
            mfu = f"{100 * m['mfu']:.1f}%" if m["mfu"] is not None else "n/a"
            power = f" | {m['gpu_power_w']:.0f} W/GPU {m['joules_per_token']:.3f} J/tok" \
                if m.get("gpu_power_w") is not None else ""
            log0(f"step {iteration:>6}/{args.train_iters} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                 f"grad {result.grad_norm if result.grad_norm is not None else float('nan'):.3f} | "
                 f"{m['tokens_per_sec']:,.0f} tok/s | {m['tflops_per_gpu']:.2f} TFLOP/s/GPU | MFU {mfu}{power} | "
                 f"skipped {skipped_total} | ETA {_duration(eta)}")
            interval_losses, interval_skipped = [], 0

        did_other = False
        if args.eval_interval and iteration % args.eval_interval == 0 and iteration < args.train_iters:
            last_val = evaluate(iteration) or last_val
            did_other = True
        if args.save and args.save_interval and iteration % args.save_interval == 0 and iteration < args.train_iters:
            save(iteration)
            did_other = True
        if did_other:
            telemetry.start_interval()  # eval and saves are not training throughput
        if args.exit_interval and iteration % args.exit_interval == 0:
            log0(f"exit interval reached at iteration {iteration}")
            break

    # End of run: final validation, checkpoint, summary.
    if profiler is not None:  # the run ended (--exit-interval) inside the profiled span
        profiler = _finish_profiler(profiler, run_dir, iteration)
    if iteration > start_iteration or not last_val:
        last_val = evaluate(iteration) or last_val
    if args.save and iteration > start_iteration:
        save(iteration)
    elapsed = time.time() - t_start
    summary = dict(iterations=iteration, steps_this_run=iteration - start_iteration, seconds=elapsed,
                   first_loss=first_loss, final_loss=last_loss, val_loss=last_val.get("loss"),
                   val_ppl=last_val.get("ppl"), skipped_steps=skipped_total,
                   energy_kwh=telemetry.total_joules / 3.6e6 if telemetry.total_joules else None)
    if corpus is not None:
        summary["unigram_entropy_nats"] = corpus.unigram_entropy_nats
    sample_text = _sample(args, model, tokenizer) if not args.mock_data and iteration > 0 else None
    if sample_text is not None:
        summary["sample"] = sample_text
        sink.text("sample", sample_text, iteration)
    sink.log(iteration, "run", {k: v for k, v in summary.items() if k != "sample"})
    sink.close()
    telemetry.close()
    _print_summary(summary)
    return summary


def _log_health(health, sink, step: int) -> None:
    """One line saying what ran (rank 0's stages), a WARNING line if it fell back; a "health" record in
    metrics.jsonl, which the layout sweep and the efficiency suite put next to their numbers."""
    log0(f"what ran: {health.summary()}")
    if health.degraded:
        log0(f"WARNING: this run is DEGRADED: {'; '.join(health.degraded)}")
    sink.log(step, "health", health.to_dict())
    sink.text("health", health.summary(), step)


def _start_profiler(plat):
    from ..metrics.profile import StepProfiler

    profiler = StepProfiler(cuda=plat.device_type == "cuda")
    profiler.start()
    return profiler


def _finish_profiler(profiler, run_dir: str, iteration: int) -> None:
    """Stop profiling; write this rank's summary (Markdown, JSON) and trace into <run dir>/profile/."""
    from ..metrics.profile import render

    summary = profiler.stop()
    rank = dist.get_rank()
    out = os.path.join(run_dir, "profile")
    os.makedirs(out, exist_ok=True)
    stem = os.path.join(out, f"rank{rank}")
    first = iteration - profiler.steps + 1
    title = f"rank {rank}, steps {first}-{iteration}"
    with open(stem + ".md", "w") as f:
        f.write(render(summary, title))
    with open(stem + ".json", "w") as f:
        json.dump(dict(rank=rank, first_step=first, last_step=iteration, **summary), f, indent=1)
    profiler.export_trace(stem + ".trace.json.gz")
    busy = summary["busy_fraction"]
    print(f"  profile of {title}: {summary['kernel_ms_per_step']:.1f} ms of "
          f"{'kernels' if summary['device'] == 'cuda' else 'CPU operators'} per step in "
          f"{summary['wall_ms_per_step']:.1f} ms" + (f" (GPU busy {busy:.0%})" if summary["device"] == "cuda" else "")
          + f" -> {stem}.md", flush=True)
    return None


def _sample(args, model, tokenizer):
    from ..generate import can_sample, sample

    why = can_sample(args)
    if why:
        log0(f"(no text sample: {why})")
        return None
    return sample(model[0], tokenizer, prompt="def ", seq_length=args.seq_length, seed=args.seed)


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def _print_summary(s: dict) -> None:
    lines = [f"done: {s['steps_this_run']} steps in {_duration(s['seconds'])} (iteration {s['iterations']}), "
             f"{s['skipped_steps']} skipped"]
    if s["first_loss"] is not None:
        lines.append(f"  train loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}")
    if s.get("val_loss") is not None:
        lines.append(f"  validation loss {s['val_loss']:.4f}, perplexity {s['val_ppl']:.2f}")
    if s.get("unigram_entropy_nats") is not None and s.get("val_loss") is not None:
        h = s["unigram_entropy_nats"]
        verdict = "below" if s["val_loss"] < h else "NOT below"
        lines.append(f"  unigram entropy of the data {h:.4f} nats/token: validation loss is {verdict} it "
                     f"(a model that ignores context cannot beat it)")
    if s.get("energy_kwh") is not None:
        lines.append(f"  GPU energy {s['energy_kwh']:.4f} kWh")
    if s.get("sample") is not None:
        lines.append("  sample (prompt 'def '):\n    def " + s["sample"].replace("\n", "\n    "))
    log0("\n".join(lines))
    if not dist.is_initialized() or dist.get_rank() == 0:
        print("summary: " + json.dumps({k: v for k, v in s.items() if k != "sample"}), flush=True)
