"""Telemetry as a plug-in to megatron.training: tokens/s, TFLOP/s and MFU in both conventions, GPU power, energy and
J/token, memory, and `metrics.jsonl`, beside Megatron-LM's own log line and TensorBoard tags (and its W&B run, under
the same names).

`attach()` makes it a listener of megatron.training's loop (platform.callbacks, which wraps the loop's functions):

- `on_train_step_end` (every iteration): on log iterations, closes the measurement interval (time with a device
  synchronize, NVML energy of every GPU of the job), writes a "train" record and adds Litespark's TensorBoard tags
  next to Megatron-LM's (`lm loss`, `learning-rate`, `grad-norm`, `throughput`, ... stay its own);
- `on_eval_*` / `on_test_*`: pauses the interval (evaluation is not training) and records the loss ("val", or
  "test" for the test set);
- `on_save_*`: pauses the interval and records the save time ("save");
- `on_load_end`: records the load time ("load", written at the first step).

tests/test_telemetry.py fails if megatron.training renames the functions behind these events or stops calling them
from train(). One schema
(docs/metrics.md): every record has "step" and "kind"; None means "not measured", never a number. One
steady-state definition: an interval is the training time between two log iterations, evaluation and checkpoint
saves excluded; tools drop the first interval (start-up, compilation). The file and the tags are written by the
last rank, where megatron.training's TensorBoard writer and the loss are.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from .metrics.energy import EnergyMeter
from .metrics.flops import (FLOP_CONVENTIONS, ModelShape, PeftShape, param_count, recompute_from_args, trainable_params,
                            training_flops_per_step)
from .metrics.peaks import PeakError, detect_peak
from .platform import callbacks

# The functions of megatron.training.training whose events telemetry hears (platform.callbacks wraps them).
HOOKED = ("training_log", "evaluate_and_print_results", "evaluate", "save_checkpoint_and_time", "load_checkpoint")
TB_PREFIX = "litespark/"
# The caching allocator's work in an interval (torch.cuda.memory_stats' cumulative counters): memory asked of the
# driver, memory given back (cudaFree synchronizes the device), and allocations that found the device full and
# freed the whole cache to retry. A steady run does none of them; a run near its memory limit shows it here first.
ALLOCATOR_COUNTS = {"device_mallocs": "num_device_alloc", "device_frees": "num_device_free",
                    "alloc_retries": "num_alloc_retries"}


def allocator_counts(stats: dict) -> list:
    """The cumulative counters of ALLOCATOR_COUNTS, in its order, from torch.cuda.memory_stats()."""
    return [int(stats.get(key, 0)) for key in ALLOCATOR_COUNTS.values()]


def _data_description(args) -> str:
    """What the run trains on, in one line: comparisons of runs need the same data (an embedded corpus is named by
    its content, which depends on the machine's Python)."""
    if args.mock_data:
        return "mock data (megatron-core's MockGPTDataset)"
    if getattr(args, "sft_data", None):
        if getattr(args, "embedded_sft", None):
            from .stdlib_sft import describe_stdlib_sft

            return describe_stdlib_sft(args.sft_data) or f"{args.embedded_sft} SFT set"
        return f"sft data: {args.sft_data}"
    if getattr(args, "embedded_corpus", None) and args.data_path:
        from .corpus import describe_stdlib_corpus

        return describe_stdlib_corpus(args.data_path[-1]) or f"{args.embedded_corpus} corpus"
    return "data: " + " ".join(map(str, args.data_path or args.train_data_path or []))


def _peft_shape(args) -> Optional[PeftShape]:
    """What a --peft run trains, for the FLOP counter's "peft" convention (None: every weight trains)."""
    from .peft import settings

    peft = settings(args)
    if peft is None:
        return None
    if peft.method == "freeze":
        return PeftShape("freeze", trainable_layers=peft.trainable_layers)
    return PeftShape(peft.method, rank=peft.adapter.rank, targets=peft.targets, dropout=peft.adapter.dropout)


def _precision(args) -> str:
    return "fp8" if args.fp8 else "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


class Telemetry:
    def __init__(self, args, plat):
        self.args = args
        self.cuda = plat.device_type == "cuda"
        self.device_name = plat.device_name
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.is_writer = int(os.environ.get("RANK", "0")) == self.world - 1
        self.metrics_path = args.metrics_file or _default_metrics_path(args)
        self._file = None
        self._t0: Optional[float] = None
        self._paused_at: Optional[float] = None
        self._steps = 0
        self._loss_sum, self._loss_count, self._skipped = None, 0, 0
        self._forward_s, self._forward_events = 0.0, []
        self.first_loss = self.last_loss = self.val = None
        self.load_seconds: Optional[float] = None
        self.iteration = 0
        self.total_joules = 0.0
        self.energy, self.energy_ok = None, False
        shape = ModelShape.from_args(args, padded_vocab=args.padded_vocab_size)
        recompute = recompute_from_args(args)
        gbs = args.global_batch_size
        # A --peft run's frozen weights get no weight gradient (and no input gradient below the lowest trainable
        # parameter): its model FLOPs are counted so ("peft"), and the run record says which convention it used.
        peft = _peft_shape(args)
        counted = dict(peft=peft, micro_batch_size=args.micro_batch_size, **recompute)
        full = training_flops_per_step(shape, gbs, causal="full", **counted)
        self.flops_full = full.model_flops
        self.flops_causal = training_flops_per_step(shape, gbs, causal="half", **counted).model_flops
        self.flops_convention = full.flops_convention
        self.trainable_params = trainable_params(shape, peft)
        self.tokens_per_step = gbs * args.seq_length
        # --sft-data: the samples' non-padding tokens, summed over the sample order (sft_data.train_input_tokens);
        # built at the first interval's end, the interval's first sample marked at its start
        self._sft_tokens, self._consumed_mark = None, 0
        self.peak, self.peak_note = None, None
        if self.cuda or args.peak_tflops:
            precision = _precision(args)
            try:
                self.peak = detect_peak(self.device_name if self.cuda else None,
                                        precision if precision != "fp32" else "tf32", args.peak_tflops)
            except PeakError as e:
                self.peak_note = f"MFU not measured: {e}"
        else:
            self.peak_note = "MFU not measured: CPU run (no tensor-core peak; --peak-tflops sets one)"
        # Written at the first step, not here: a run refused before it (its --save directory locked by another
        # run) must leave that directory's metrics.jsonl as it was.
        self._run_record = dict(
            world_size=self.world, params=param_count(shape).total, flops_per_step_full=self.flops_full,
            flops_per_step_causal=self.flops_causal, flops_convention=self.flops_convention,
            trainable_params=self.trainable_params, tokens_per_step=self.tokens_per_step, precision=_precision(args),
            device=self.device_name if self.cuda else "cpu", spec=getattr(args, "litespark_spec", None),
            transformer_impl=args.transformer_impl, data=self.describe_data(args))

    def describe_data(self, args) -> str:
        """The run record's data line (a trainer that draws its own tokens says so instead)."""
        return _data_description(args)

    def begin(self):
        """Called before the first forward of the run (megatron has set this rank's device): the first interval
        starts here, so that it holds the first step (and with it start-up costs: tools drop it)."""
        if self._t0 is not None:
            return
        self.iteration = self._start_iteration()  # > 0 when resumed
        if self.is_writer and self.metrics_path and os.path.exists(self.metrics_path):
            _rewind(self.metrics_path, self.iteration)
        self.write(0, "run", self._run_record)
        self._scalar("trainable-params", self.trainable_params, 0)
        writer = self._tensorboard_writer()
        if writer is not None:
            writer.add_text(TB_PREFIX + "flops-convention",
                            f"{self.flops_convention}: {FLOP_CONVENTIONS[self.flops_convention]}", 0)
        if self.load_seconds is not None:
            self.write(self.iteration, "load", dict(seconds=self.load_seconds))
            self._scalar("load-seconds", self.load_seconds, self.iteration)
        if self.cuda:
            self.energy = EnergyMeter()
            self.energy_ok = self.energy.start()
        if self.is_writer:
            for note in (self.peak_note, self.energy_note):
                if note:
                    print(note, flush=True)
        if self.cuda and int(os.environ.get("RANK", "0")) == 0:
            self._warn_without_te_fused_attention()
        self._restart()

    def _warn_without_te_fused_attention(self) -> None:
        """A GPU run whose TE cannot run its fused attention for this head shape says so at start-up."""
        from .backend_probe import te_attention_check

        args = self.args
        groups = args.num_query_groups if args.group_query_attention else args.num_attention_heads
        warning = te_attention_check(args.kv_channels, args.num_attention_heads, groups)
        if warning:
            print(f"WARNING: {warning}", flush=True)

    def _start_iteration(self) -> int:
        """The step the run starts from: megatron.training's, after it loaded a checkpoint."""
        from megatron.training import get_args

        return getattr(get_args(), "iteration", 0) or 0

    @property
    def energy_note(self) -> Optional[str]:
        if not self.cuda:
            return "GPU energy not measured: CPU run"
        if not self.energy_ok:
            return f"GPU energy not measured: {self.energy.reason}"
        return None

    # -- intervals ------------------------------------------------------------------------------------------------
    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def _restart(self):
        self._sync()
        self._t0 = time.perf_counter()
        self._paused_at = None
        self._steps = 0
        self._loss_sum, self._loss_count, self._skipped = None, 0, 0
        self._forward_s, self._forward_events = 0.0, []
        self._consumed_mark = getattr(self.args, "consumed_train_samples", 0)
        if self.cuda:
            self._allocator_before = allocator_counts(torch.cuda.memory_stats())
        if self.energy_ok:
            self.energy.lap()  # what ran before this interval (set-up, evaluation, a save) is not counted

    def pause(self):
        if self._t0 is None or self._paused_at is not None:
            return
        self._sync()
        self._paused_at = time.perf_counter()
        if self.energy_ok:
            self.energy.pause()

    def resume(self):
        if self._paused_at is None:
            return
        self._sync()
        self._t0 += time.perf_counter() - self._paused_at
        self._paused_at = None
        if self.energy_ok:
            self.energy.resume()

    def on_iteration(self, iteration, loss_dict, learning_rate, loss_scale, skipped, grad_norm):
        if self._t0 is None:
            self.begin()
        self.iteration = iteration
        self._steps += 1
        if skipped:
            self._skipped += 1
        elif "lm loss" in loss_dict:
            value = loss_dict["lm loss"].detach().float().reshape(-1)[0]
            self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
            self._loss_count += 1
        args = self.args
        if iteration % args.log_interval == 0 or iteration == args.train_iters:
            self._end_interval(iteration, learning_rate, loss_scale, grad_norm)

    def _end_interval(self, iteration, learning_rate, loss_scale, grad_norm):
        args = self.args
        self._sync()
        seconds = time.perf_counter() - self._t0
        steps = max(self._steps, 1)
        tokens, tokens_seen = self.tokens_per_step * steps, args.consumed_train_samples * args.seq_length
        if getattr(args, "sft_data", None):
            tokens, tokens_seen = self._sft_interval_tokens()
        tflops = self.flops_full * steps / seconds / self.world / 1e12
        tflops_causal = self.flops_causal * steps / seconds / self.world / 1e12
        loss = float(self._loss_sum.item() / self._loss_count) if self._loss_count else None
        if loss is not None:
            self.first_loss = loss if self.first_loss is None else self.first_loss
            self.last_loss = loss
        record = dict(
            loss=loss, lr=learning_rate, grad_norm=grad_norm, loss_scale=loss_scale if args.fp16 else None,
            skipped_in_interval=self._skipped, consumed_samples=args.consumed_train_samples,
            tokens_seen=tokens_seen, steps=steps, step_time_s=seconds / steps,
            tokens_per_sec=tokens / seconds, tokens_per_sec_per_gpu=tokens / seconds / self.world,
            tflops_per_gpu=tflops, tflops_per_gpu_causal=tflops_causal,
            mfu=tflops / self.peak.tflops if self.peak else None,
            mfu_causal=tflops_causal / self.peak.tflops if self.peak else None,
            num_gpus=self.world if self.cuda else 0)
        record.update(self._forward_times(steps))
        record.update(self._memory())
        record.update(self._energy(tokens, seconds))
        self.write(iteration, "train", record)
        self._tensorboard(iteration, record)
        self._restart()

    def _sft_interval_tokens(self):
        """(non-padding tokens of the interval's samples, of every sample so far): an SFT sequence is mostly
        padding, and tokens/s and J/token count the example tokens (the FLOPs, the positions computed)."""
        from .sft_data import train_input_tokens

        if self._sft_tokens is None:
            self._sft_tokens = train_input_tokens(self.args)
        last = len(self._sft_tokens) - 1
        start, end = (min(int(c), last) for c in (self._consumed_mark, self.args.consumed_train_samples))
        return int(self._sft_tokens[end] - self._sft_tokens[start]), int(self._sft_tokens[end])

    # -- forward time per rank (stragglers) ----------------------------------------------------------------------
    @contextlib.contextmanager
    def timed_forward(self):
        """Around this rank's forward_step (its batch and forward): CUDA events on a GPU (the GPU's timeline between
        them, host gaps included), the host clock on a CPU. Evaluation is not counted."""
        if self._t0 is None or self._paused_at is not None:
            yield
            return
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._forward_events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._forward_s += time.perf_counter() - t0

    def _forward_times(self, steps: int) -> dict:
        """Every rank's forward time per step in the interval (after _sync), gathered: the slowest and fastest rank.
        In data parallelism every rank waits for the slowest at the gradient reduction, so step times are equal;
        the forward is where a slow GPU, host or data loader shows. Ranks of one tensor- or context-parallel group
        wait for each other inside the forward too, and pipeline stages differ by design (embedding, output layer):
        compare ranks that do the same work."""
        mine = self._forward_s + sum(start.elapsed_time(end) for start, end in self._forward_events) / 1e3
        every = [torch.zeros(1, dtype=torch.float64, device="cuda" if self.cuda else "cpu") for _ in range(self.world)]
        if self.world > 1:
            dist.all_gather(every, torch.tensor([mine / steps], dtype=torch.float64, device=every[0].device))
        else:
            every[0][0] = mine / steps
        per_rank = torch.cat(every).tolist()  # one copy to the host
        slowest = max(range(self.world), key=per_rank.__getitem__)
        return dict(forward_s_max=per_rank[slowest], forward_s_min=min(per_rank), slowest_rank=slowest)

    def _memory(self) -> dict:
        if self.cuda:
            interval = [now - before for now, before in
                        zip(allocator_counts(torch.cuda.memory_stats()), self._allocator_before)]
            # the peak reserved: what the GPU held, CUDA graphs' private pools and cached blocks included
            stats = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved(),
                                  torch.cuda.max_memory_reserved(), *interval], dtype=torch.float64, device="cuda")
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            torch.cuda.reset_peak_memory_stats()
            stats = stats.tolist()  # one copy to the host
            return dict(mem_max_allocated_gb=stats[0] / 2**30, mem_reserved_gb=stats[1] / 2**30,
                        mem_max_reserved_gb=stats[2] / 2**30,
                        **{name: int(n) for name, n in zip(ALLOCATOR_COUNTS, stats[3:])})
        import psutil

        return dict(host_rss_gb=psutil.Process().memory_info().rss / 2**30)

    def _energy(self, tokens: int, seconds: float) -> dict:
        none = dict(gpu_power_w=None, joules_per_token=None, energy_kwh_total=None)
        if not self.cuda:
            return none
        reading = self.energy.lap() if self.energy_ok else None
        # Every rank contributes (joules, 1 if measured): an interval counts only if every GPU measured it.
        buf = torch.tensor([reading.joules if reading else 0.0, 1.0 if reading else 0.0], dtype=torch.float64,
                           device="cuda")
        dist.all_reduce(buf)
        if buf[1].item() < self.world:
            return none
        joules = buf[0].item()
        self.total_joules += joules
        return dict(gpu_power_w=joules / seconds / self.world, joules_per_token=joules / tokens,
                    energy_kwh_total=self.total_joules / 3.6e6)

    # -- records --------------------------------------------------------------------------------------------------
    def write(self, step: int, kind: str, values: dict) -> None:
        if not self.is_writer or not self.metrics_path:
            return
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.metrics_path)), exist_ok=True)
            self._file = open(self.metrics_path, "a", buffering=1)  # line-buffered: a crash loses one record
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in values.items()}
        self._file.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")

    def _tensorboard_writer(self):
        """megatron.training's TensorBoard writer (opened on the last rank with --tensorboard-dir), or None."""
        from megatron.training.global_vars import get_tensorboard_writer

        return get_tensorboard_writer() if self.is_writer else None

    def _wandb_writer(self):
        """megatron.training's W&B run (the wandb module, initialised on the last rank with --wandb-project), or
        None."""
        from megatron.training.global_vars import get_wandb_writer

        return get_wandb_writer() if self.is_writer else None

    def _tensorboard(self, iteration: int, record: dict) -> None:
        self._scalars({key.replace("_", "-"): record.get(key) for key in (
            "tokens_per_sec", "tokens_per_sec_per_gpu", "tflops_per_gpu", "tflops_per_gpu_causal", "mfu",
            "mfu_causal", "gpu_power_w", "joules_per_token", "energy_kwh_total", "mem_max_allocated_gb",
            "forward_s_max", "forward_s_min", "slowest_rank")}, iteration)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self._scalars({tag: value}, step)

    def _scalars(self, values: dict, step: int) -> None:
        """The measured values as litespark/<tag> on TensorBoard and, with --wandb-project, on W&B under the same
        names (megatron.training logs its own values to both under its TensorBoard tags)."""
        measured = {TB_PREFIX + tag: value for tag, value in values.items()
                    if value is not None and math.isfinite(value)}
        writer = self._tensorboard_writer()
        if writer is not None:
            for tag, value in measured.items():
                writer.add_scalar(tag, value, step)
        wandb = self._wandb_writer()
        if wandb is not None and measured:
            wandb.log(measured, step)

    def record_eval(self, iteration: int, loss_dict, kind: str) -> None:
        if "lm loss" not in (loss_dict or {}):
            return
        loss = float(loss_dict["lm loss"].item())
        result = dict(loss=loss, ppl=math.exp(min(loss, 50.0)))
        if kind == "val":
            self.val = result
        self.write(iteration, kind, result)

    def record_health(self, health) -> None:
        from megatron.training.global_vars import get_tensorboard_writer

        step = self.iteration + 1
        self.write(step, "health", health.to_dict())
        writer = get_tensorboard_writer() if self.is_writer else None
        if writer is not None:
            writer.add_text(TB_PREFIX + "health", health.summary(), step)
        if int(os.environ.get("RANK", "0")) == 0:
            args = self.args
            print(f"what ran: {health.summary()} | spec {args.litespark_spec}, "
                  f"transformer-impl {args.transformer_impl}, {_precision(args)}, "
                  f"{self.device_name if self.cuda else 'cpu'}", flush=True)
            if health.degraded:
                print(f"WARNING: this run is DEGRADED: {'; '.join(health.degraded)}", flush=True)

    def finish(self, iteration: int) -> None:
        summary = dict(iterations=iteration, first_loss=self.first_loss, final_loss=self.last_loss,
                       val_loss=(self.val or {}).get("loss"), val_ppl=(self.val or {}).get("ppl"),
                       energy_kwh=self.total_joules / 3.6e6 if self.total_joules else None,
                       flops_convention=self.flops_convention, trainable_params=self.trainable_params)
        self.write(iteration, "run", summary)
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.energy is not None:
            self.energy.close()
        if self.is_writer:
            print("summary: " + json.dumps(summary), flush=True)


def _rewind(path: str, iteration: int) -> None:
    """A resumed run continues the metrics file of the run it resumes, from its checkpoint's iteration: records of
    later steps (trained after that checkpoint by a run that then died) are dropped, so that every step has one
    record, and so is a line a killed writer left half-written. A run from step 0 continues no run: the file starts
    anew (a run killed before its first checkpoint leaves records, its run record too, that nothing continues).
    Rewritten beside, then renamed."""
    kept, dropped = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
                keep = 0 < iteration and record["step"] <= iteration
            except (ValueError, KeyError, TypeError):
                keep = False
            if keep:
                kept.append(line if line.endswith("\n") else line + "\n")
            else:
                dropped += 1
    if dropped:
        with open(path + ".rewind", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".rewind", path)


def _default_metrics_path(args) -> Optional[str]:
    if args.save:
        return os.path.join(args.save, "metrics.jsonl")
    if args.tensorboard_dir:
        return os.path.join(os.path.dirname(os.path.abspath(args.tensorboard_dir)), "metrics.jsonl")
    return None


# --------------------------------------------------------------------------------------------- the listener
_telemetry: Optional[Telemetry] = None


class _Listener(callbacks.Listener):
    """megatron.training's loop, as platform.callbacks tells it: intervals end on log iterations, evaluation and
    saves are paused out of them, and each is recorded."""

    def __init__(self, t: Telemetry):
        self.t = t

    def on_train_step_end(self, iteration, loss_dict, learning_rate, loss_scale, skipped, grad_norm):
        self.t.on_iteration(iteration, loss_dict, learning_rate, loss_scale, skipped, grad_norm)

    def on_eval_start(self):
        self.t.pause()

    def on_eval_end(self, loss_dict, kind="val"):
        self.t.resume()
        if loss_dict:
            self.t.record_eval(self.t.iteration, loss_dict, kind)

    on_test_start = on_eval_start

    def on_test_end(self, loss_dict):
        self.on_eval_end(loss_dict, "test")

    def on_save_start(self, iteration):
        self.t.pause()

    def on_save_end(self, iteration, seconds, error):
        self.t.write(iteration, "save", dict(seconds=seconds))
        self.t._scalar("save-seconds", seconds, iteration)
        self.t.resume()

    def on_load_end(self, seconds):
        from megatron.training.checkpointing import checkpoint_exists

        args = self.t.args
        if any(d and checkpoint_exists(d) for d in (args.load, args.pretrained_checkpoint)):  # else nothing loaded
            self.t.load_seconds = seconds


def attach(args, plat) -> Telemetry:
    """Measure this run: a Telemetry listening to megatron.training's loop (platform.callbacks)."""
    global _telemetry
    _telemetry = Telemetry(args, plat)
    callbacks.listen("telemetry", _Listener(_telemetry))
    return _telemetry


def timed_forward():
    return _telemetry.timed_forward() if _telemetry is not None else contextlib.nullcontext()


def begin() -> None:
    if _telemetry is not None:
        _telemetry.begin()


def record_health(health) -> None:
    if _telemetry is not None:
        _telemetry.record_health(health)


def finish() -> None:
    if _telemetry is not None:
        _telemetry.finish(_telemetry.iteration)
