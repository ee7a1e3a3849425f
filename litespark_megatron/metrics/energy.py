"""GPU energy of the training steps, from NVML's total-energy counter.

``nvmlDeviceGetTotalEnergyConsumption`` returns the millijoules a GPU has used since the driver loaded, as an
unsigned 64-bit integer (Volta and newer). Differencing it gives the exact energy of a window, including the
short bursts a sampled power reading misses. The meter keeps only the windows in which training steps run:
``pause()`` before evaluation or a checkpoint save, ``resume()`` after, so those are left out.

This module measures the GPU(s) of one rank. Summing across ranks is the trainer's job (an all-reduce of the
lap joules); ``summarize`` then turns the totals into W per GPU, J per token and kWh.

Failure is never silent and never invented: no NVML, no GPU or a GPU without the counter gives
``available=False`` with ``reason``; a read failing mid-run, or a counter that went backwards (driver reload),
makes that lap "not measured": ``lap()`` returns None and ``last_reason`` says why.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Union

DeviceId = Union[int, str]  # an NVML index, or a UUID string ("GPU-...")
Reader = Callable[[DeviceId], int]

COUNTER_MODULUS = 2 ** 64  # the counter is an unsigned long long


@dataclass(frozen=True)
class EnergyReading:
    """Energy of the active (unpaused) time of one lap, summed over this rank's GPUs."""

    joules: float
    seconds: float
    per_device_joules: Dict[str, float]

    @property
    def watts(self) -> Optional[float]:
        """Mean power over the lap (all of this rank's GPUs together); None for a zero-length lap."""
        return self.joules / self.seconds if self.seconds > 0 else None


def _nvml_reader(devices: Sequence[DeviceId]) -> Reader:
    """NVML-backed reader: resolves handles once; raises whatever NVML raises."""
    import pynvml  # imported here: CPU-only machines and tools never need it

    pynvml.nvmlInit()
    handles = {}
    for dev in devices:
        if isinstance(dev, int):
            handles[dev] = pynvml.nvmlDeviceGetHandleByIndex(dev)
        else:
            handles[dev] = pynvml.nvmlDeviceGetHandleByUUID(dev)

    def read(dev: DeviceId) -> int:
        return int(pynvml.nvmlDeviceGetTotalEnergyConsumption(handles[dev]))

    read.shutdown = pynvml.nvmlShutdown  # type: ignore[attr-defined]
    return read


def local_devices() -> List[DeviceId]:
    """NVML identity of this process's current CUDA device.

    By UUID, because NVML indexes GPUs physically while CUDA renumbers them under CUDA_VISIBLE_DEVICES: index
    ``torch.cuda.current_device()`` is the wrong GPU whenever the launcher narrows the visible set.
    Raises RuntimeError when there is no CUDA device.
    """
    import torch  # only when auto-detecting; the meter itself needs no torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to this process")
    index = torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        return [text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entry = visible.split(",")[index].strip()
        return [int(entry) if entry.isdigit() else entry]
    return [index]


class EnergyMeter:
    """Energy of the training steps of this rank's GPU(s).

    ``devices``: NVML indices or UUIDs; None = this process's current CUDA device. ``reader``: a callable
    device -> counter value in mJ (tests replay sequences with it); None = NVML. ``clock``: seconds, monotonic.

    Usage: ``start()`` once; then every log interval ``lap()``; ``pause()``/``resume()`` around evaluation and
    checkpoint saves.
    """

    def __init__(self, devices: Optional[Sequence[DeviceId]] = None, *, reader: Optional[Reader] = None,
                 clock: Callable[[], float] = time.monotonic):
        self._devices = list(devices) if devices is not None else None
        self._reader = reader
        self._clock = clock
        self.available = False
        self.reason: Optional[str] = "not started"
        self.last_reason: Optional[str] = None
        self.total_joules = 0.0      # over measured laps only
        self.total_seconds = 0.0     # active seconds of measured laps
        self.laps_not_measured = 0
        self._last: Dict[DeviceId, Optional[int]] = {}
        self._lap_mj: Dict[DeviceId, int] = {}
        self._lap_seconds = 0.0
        self._active_since: Optional[float] = None
        self._lap_problem: Optional[str] = None

    @property
    def devices(self) -> List[DeviceId]:
        return list(self._devices or [])

    @property
    def paused(self) -> bool:
        return self.available and self._active_since is None

    # ---- lifecycle ----
    def start(self) -> bool:
        """Open NVML (unless a reader was given), take the first reading and start the first lap.

        Returns ``available``; when False, ``reason`` says why and every later call is a no-op.
        """
        try:
            if self._devices is None:
                self._devices = local_devices()
            if not self._devices:
                raise RuntimeError("no GPU given to measure")
            if self._reader is None:
                self._reader = _nvml_reader(self._devices)
            first = {dev: self._reader(dev) for dev in self._devices}
        except ImportError as e:
            return self._unavailable(f"NVML is not importable (install nvidia-ml-py): {e}")
        except Exception as e:  # NVML raises its own error classes (LibraryNotFound, NotSupported, ...)
            return self._unavailable(f"GPU energy counter not readable: {type(e).__name__}: {e}")
        for dev, value in first.items():
            if not isinstance(value, int) or value < 0:
                return self._unavailable(f"GPU energy counter of {dev} returned {value!r}, not a counter value")
        self.available, self.reason = True, None
        self._last = dict(first)
        self._lap_mj = {dev: 0 for dev in self._devices}
        self._lap_seconds = 0.0
        self._lap_problem = None
        self._active_since = self._clock()
        return True

    def _unavailable(self, reason: str) -> bool:
        self.available, self.reason = False, reason
        return False

    def close(self) -> None:
        shutdown = getattr(self._reader, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # shutting down a broken NVML must not fail the run at exit
                pass
        self.available = False
        self.reason = "closed"

    # ---- windows ----
    def _accumulate(self) -> None:
        """Add the energy since the last reading of each device to the lap; re-baseline every device."""
        for dev in self._devices:
            try:
                now = self._reader(dev)
            except Exception as e:
                self._last[dev] = None
                self._note(f"reading {dev} failed ({type(e).__name__}: {e})")
                continue
            last = self._last.get(dev)
            self._last[dev] = now
            if last is None:
                # The device came back after a failed read: the energy in between is unknown.
                self._note(f"{dev} was not readable for part of this lap")
                continue
            delta = (now - last) % COUNTER_MODULUS
            # A real wrap of a 64-bit mJ counter takes ~10^8 years at 1 kW; a "delta" beyond half the range is the
            # counter starting again from 0 (driver reload, GPU reset), not energy used.
            if delta >= COUNTER_MODULUS // 2:
                self._note(f"energy counter of {dev} went backwards ({last} -> {now} mJ; driver reload or GPU reset?)")
                continue
            self._lap_mj[dev] += delta

    def _note(self, problem: str) -> None:
        if self._lap_problem is None:
            self._lap_problem = problem

    def pause(self) -> None:
        """Stop counting (evaluation, checkpoint save). Energy until now stays in the current lap."""
        if not self.available or self._active_since is None:
            return
        self._accumulate()
        self._lap_seconds += self._clock() - self._active_since
        self._active_since = None

    def resume(self) -> None:
        """Count again from now; what the GPUs used while paused is not counted."""
        if not self.available or self._active_since is not None:
            return
        for dev in self._devices:
            try:
                self._last[dev] = self._reader(dev)
            except Exception as e:
                self._last[dev] = None
                self._note(f"reading {dev} failed ({type(e).__name__}: {e})")
        self._active_since = self._clock()

    def lap(self) -> Optional[EnergyReading]:
        """Energy and active seconds since the previous lap (or start), then start a new lap.

        None when the meter is unavailable or the lap could not be measured completely (``last_reason``).
        """
        if not self.available:
            self.last_reason = self.reason
            return None
        if self._active_since is not None:
            self._accumulate()
            now = self._clock()
            self._lap_seconds += now - self._active_since
            self._active_since = now
        problem, mj, seconds = self._lap_problem, self._lap_mj, self._lap_seconds
        self._lap_mj = {dev: 0 for dev in self._devices}
        self._lap_seconds = 0.0
        self._lap_problem = None
        if problem is not None:
            self.last_reason = f"not measured: {problem}"
            self.laps_not_measured += 1
            return None
        self.last_reason = None
        per_device = {str(dev): value / 1000.0 for dev, value in mj.items()}
        joules = sum(mj.values()) / 1000.0
        self.total_joules += joules
        self.total_seconds += seconds
        return EnergyReading(joules=joules, seconds=seconds, per_device_joules=per_device)


@dataclass(frozen=True)
class EnergySummary:
    watts_per_gpu: float
    joules_per_token: float
    kwh: float

    def as_dict(self) -> dict:
        return dict(watts_per_gpu=self.watts_per_gpu, joules_per_token=self.joules_per_token, kwh=self.kwh)


JOULES_PER_KWH = 3.6e6


def summarize(joules_total: float, seconds: float, tokens: float, num_gpus: int) -> EnergySummary:
    """Totals over all GPUs of a run -> mean W per GPU, J per token (all GPUs), kWh (all GPUs)."""
    if not joules_total >= 0:
        raise ValueError(f"joules_total must be >= 0, got {joules_total}")
    for name, value in (("seconds", seconds), ("tokens", tokens), ("num_gpus", num_gpus)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    return EnergySummary(watts_per_gpu=joules_total / seconds / num_gpus, joules_per_token=joules_total / tokens,
                         kwh=joules_total / JOULES_PER_KWH)
