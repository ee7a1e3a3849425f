"""A run that stopped making progress ends, instead of holding every GPU of the job until the scheduler's time limit:

- --hang-timeout-factor: a training step that takes far longer than the run's usual step;
- --max-skipped-steps: fp16 steps skipped one after another for inf/NaN gradients (the loss scale cannot recover);
- --loss-spike-factor: a loss far above the recent median (warns, or stops before the spiked step is saved).

Each rank runs a thread that knows when this rank last finished a step (a listener of megatron.training's loop,
platform.callbacks: each step's end calls `step_done`; evaluation and checkpoint saves pause it). When the current step has run longer than the factor times
the median of the last 100 steps (and at least --hang-timeout-min-seconds), the rank prints one line naming itself
and the step, then the stack of each of its threads (where it is stuck: a collective that another rank never
joined, I/O, a data loader), and exits 1; torchrun then ends the other ranks. The stuck rank is the one whose stack
is not waiting in a collective. NCCL's own timeout (--distributed-timeout-minutes) stays the backstop.
"""
from __future__ import annotations

import faulthandler
import math
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from typing import Optional

from .errors import PROG
from .platform import callbacks

WARM_UP_STEPS = 3  # start-up, compilation and the first allocations make the first steps slow
SPIKE_WINDOW = 100  # the median of this many recent losses is the reference of --loss-spike-factor
SPIKE_MIN_HISTORY = 5  # a median of fewer losses is no reference yet


class StepWatchdog:
    def __init__(self, factor: Optional[float], min_seconds: float, poll_seconds: float = 1.0,
                 max_skipped: Optional[int] = None):
        self.factor, self.min_seconds, self.poll = factor, min_seconds, poll_seconds
        self.max_skipped, self.skipped_in_a_row = max_skipped, 0
        self.durations: deque = deque(maxlen=100)
        self.steps = 0
        self.iteration: Optional[int] = None
        self.last = time.monotonic()
        self.paused = False
        self._lock = threading.Lock()
        if factor:
            threading.Thread(target=self._watch, name="litespark-watchdog", daemon=True).start()

    def step_done(self, iteration: int, skipped: bool = False) -> None:
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        if self.max_skipped and self.skipped_in_a_row >= self.max_skipped:
            # Every rank sees the same skip decision (the loss scaler's), so every rank stops here.
            if os.environ.get("RANK", "0") == "0":
                print(f"{PROG}: error: {self.skipped_in_a_row} steps in a row (up to step {iteration}) were skipped "
                      f"for inf/NaN gradients (--max-skipped-steps {self.max_skipped}): the loss scale cannot "
                      "recover; lower --lr or --initial-loss-scale, or train in bf16", file=sys.stderr, flush=True)
            sys.exit(1)
        now = time.monotonic()
        with self._lock:
            self.steps += 1
            if self.steps > WARM_UP_STEPS:
                self.durations.append(now - self.last)
            self.last, self.iteration = now, iteration

    def pause(self) -> None:
        with self._lock:
            self.paused = True

    def resume(self) -> None:
        with self._lock:
            self.paused, self.last = False, time.monotonic()

    def limit(self) -> Optional[float]:
        """Seconds a step may take, None until enough steps were seen."""
        if len(self.durations) < WARM_UP_STEPS:
            return None
        return max(self.factor * statistics.median(self.durations), self.min_seconds)

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll)
            with self._lock:
                limit = self.limit()
                elapsed = time.monotonic() - self.last
                if self.paused or limit is None or elapsed <= limit:
                    continue
                median = statistics.median(self.durations)
                step = (self.iteration or 0) + 1
            rank = os.environ.get("RANK", "0")
            print(f"{PROG}: error: rank {rank} ({socket.gethostname()}, pid {os.getpid()}) has been in step {step} "
                  f"for {elapsed:.0f} s, more than {self.factor:g} x the median step ({median:.2f} s; at least "
                  f"{self.min_seconds:g} s): stopping the run as hung; where each thread of this rank is:",
                  file=sys.stderr, flush=True)
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            os._exit(1)  # the main thread is stuck: no exception could reach it


class LossSpikeGuard:
    """--loss-spike-factor F: the loss of a step above F times the median of the last SPIKE_WINDOW losses. Called on
    every rank with the same loss (`world_loss`), so every rank takes the same decision."""

    def __init__(self, factor: float, action: str):
        self.factor, self.action = factor, action
        self.losses: deque = deque(maxlen=SPIKE_WINDOW)

    def check(self, iteration: int, loss: Optional[float]) -> None:
        if loss is None:
            return
        if len(self.losses) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self.losses)
            if loss > self.factor * median:
                what = (f"loss spike at step {iteration}: {loss:.4g} is {loss / median:.1f} x the median "
                        f"{median:.4g} of the last {len(self.losses)} steps (--loss-spike-factor {self.factor:g})")
                if self.action == "stop":
                    if os.environ.get("RANK", "0") == "0":
                        print(f"{PROG}: error: {what}: stopping before the step is saved; resume from the last "
                              f"checkpoint with --iterations-to-skip {iteration} (skips that step's data) or a lower "
                              "--lr", file=sys.stderr, flush=True)
                    sys.exit(1)
                if os.environ.get("RANK", "0") == "0":
                    print(f"WARNING: {what}; training on (--loss-spike-action stop ends the run instead)",
                          flush=True)
        self.losses.append(loss)


def world_loss(loss_dict) -> Optional[float]:
    """The step's loss on every rank: megatron.training hands it to the last pipeline stage only (averaged over
    data-parallel ranks there), so one MAX all-reduce over all ranks gives it to the other stages too."""
    import torch
    import torch.distributed as dist

    value = loss_dict["lm loss"].detach().float().reshape(-1)[0].item() if "lm loss" in loss_dict else -math.inf
    if dist.is_initialized() and dist.get_world_size() > 1:
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        buf = torch.tensor([value], dtype=torch.float64, device=device)
        dist.all_reduce(buf, op=dist.ReduceOp.MAX)
        value = buf.item()
    return value if math.isfinite(value) else None


current: Optional[StepWatchdog] = None
spikes: Optional[LossSpikeGuard] = None


class _Listener(callbacks.Listener):
    """megatron.training's loop, as platform.callbacks tells it: steps end; evaluation and saves are not steps."""

    def on_train_step_end(self, iteration, loss_dict, learning_rate, loss_scale, skipped, grad_norm):
        step_done(iteration, bool(skipped), loss_dict)

    def on_eval_start(self):
        pause()

    def on_eval_end(self, loss_dict):
        resume()

    on_test_start, on_test_end = on_eval_start, on_eval_end

    def on_save_start(self, iteration):
        pause()

    def on_save_end(self, iteration, seconds, error):
        resume()


def start(args) -> None:
    global current, spikes
    if (args.hang_timeout_factor or args.max_skipped_steps) and current is None:
        current = StepWatchdog(args.hang_timeout_factor, args.hang_timeout_min_seconds,
                               max_skipped=args.max_skipped_steps)
    if args.loss_spike_factor and spikes is None:
        spikes = LossSpikeGuard(args.loss_spike_factor, args.loss_spike_action)
    callbacks.listen("watchdog", _Listener())


def step_done(iteration: int, skipped: bool = False, loss_dict=None) -> None:
    if current is not None:
        current.step_done(iteration, skipped)
    if spikes is not None:
        spikes.check(iteration, None if skipped else world_loss(loss_dict or {}))


def pause() -> None:
    if current is not None:
        current.pause()


def resume() -> None:
    if current is not None:
        current.resume()
