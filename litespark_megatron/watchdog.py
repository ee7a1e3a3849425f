"""--hang-timeout-factor: a training step that takes far longer than the run's usual step ends the run, instead of
holding every GPU of the job until the scheduler's time limit.

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
    def __init__(self, factor: float, min_seconds: float, poll_seconds: float = 1.0):
        self.factor, self.min_seconds, self.poll = factor, min_seconds, poll_seconds
        self.durations: deque = deque(maxlen=100)
        self.steps = 0
        self.iteration: Optional[int] = None
        self.last = time.monotonic()
        self.paused = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="litespark-watchdog", daemon=True)
        self._thread.start()

    def step_done(self, iteration: int) -> None:
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
    if args.hang_timeout_factor and current is None:
        current = StepWatchdog(args.hang_timeout_factor, args.hang_timeout_min_seconds)


def step_done(iteration: int) -> None:
    if current is not None:
        current.step_done(iteration)


def pause() -> None:
    if current is not None:
        current.pause()


def resume() -> None:
    if current is not None:
        current.resume()
