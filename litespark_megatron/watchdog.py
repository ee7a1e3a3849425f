"""A run that stopped making progress ends, instead of holding every GPU of the job until the scheduler's time limit:

- --hang-timeout-factor: a training step that takes far longer than the run's usual step;
- --max-skipped-steps: fp16 steps skipped one after another for inf/NaN gradients (the loss scale cannot recover).

Each rank runs a thread that knows when this rank last finished a step (telemetry's per-iteration hook calls
`step_done`; evaluation and checkpoint saves pause it). When the current step has run longer than the factor times
the median of the last 100 steps (and at least --hang-timeout-min-seconds), the rank prints one line naming itself
and the step, then the stack of each of its threads (where it is stuck: a collective that another rank never
joined, I/O, a data loader), and exits 1; torchrun then ends the other ranks. The stuck rank is the one whose stack
is not waiting in a collective. NCCL's own timeout (--distributed-timeout-minutes) stays the backstop.
"""
from __future__ import annotations

import faulthandler
import os
import socket
import statistics
import sys
import threading
import time
from collections import deque
from typing import Optional

from .arguments import PROG

WARM_UP_STEPS = 3  # start-up, compilation and the first allocations make the first steps slow


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


current: Optional[StepWatchdog] = None


def start(args) -> None:
    global current
    if (args.hang_timeout_factor or args.max_skipped_steps) and current is None:
        current = StepWatchdog(args.hang_timeout_factor, args.hang_timeout_min_seconds,
                               max_skipped=args.max_skipped_steps)


def step_done(iteration: int, skipped: bool = False) -> None:
    if current is not None:
        current.step_done(iteration, skipped)


def pause() -> None:
    if current is not None:
        current.pause()


def resume() -> None:
    if current is not None:
        current.resume()
