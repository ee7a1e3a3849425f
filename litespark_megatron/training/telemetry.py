"""Per-log-interval measurements of a run: tokens/s, TFLOP/s per GPU, MFU, memory, GPU power and energy.

Conventions (docs/metrics.md): FLOPs are model FLOPs (3 x forward, no recompute), counted with attention in full
(`mfu`, the NeMo/DGXC convention) and halved for causality (`mfu_causal`, Megatron-Core's convention). MFU is
against the dense peak of the run's precision; FP8 runs are measured against the BF16 dense peak. Energy is the
NVML total-energy counter of every GPU of the job, summed over ranks, with evaluation and checkpoint saves paused.
On the CPU, or where a GPU has no such counter, GPU metrics are None ("not measured").
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from ..config import padded_vocab_size
from ..metrics.energy import EnergyMeter
from ..metrics.flops import ModelShape, recompute_from_args, training_flops_per_step
from ..metrics.peaks import PeakError, detect_peak


def _precision(args) -> str:
    return "fp8" if args.fp8_format else "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


class Telemetry:
    def __init__(self, args, global_batch_size: int, device_type: str, device_name: str):
        self.world_size = dist.get_world_size()
        self.device_type = device_type
        shape = ModelShape.from_args(args, padded_vocab=padded_vocab_size(args.vocab_size,
                                                                           args.make_vocab_size_divisible_by))
        recompute = recompute_from_args(args)
        self.flops_full = training_flops_per_step(shape, global_batch_size, causal="full", **recompute)
        self.flops_causal = training_flops_per_step(shape, global_batch_size, causal="half", **recompute)
        self.tokens_per_step = global_batch_size * args.seq_length
        self.peak = None
        self.peak_note = None
        if device_type == "cuda" or args.peak_tflops:
            try:
                self.peak = detect_peak(device_name if device_type == "cuda" else None, _precision(args)
                                        if _precision(args) != "fp32" else "tf32", args.peak_tflops)
            except PeakError as e:
                self.peak_note = f"MFU not measured: {e}"
        else:
            self.peak_note = "MFU not measured: CPU run (no tensor-core peak; pass --peak-tflops to set one)"
        self.energy = EnergyMeter() if device_type == "cuda" else None
        self.energy_ok = bool(self.energy and self.energy.start())
        self.total_joules = 0.0
        self._t0 = None
        self._steps = 0

    # -- windows -------------------------------------------------------------------------------------------
    def start_interval(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()
        self._steps = 0
        if self.energy_ok:
            self.energy.lap()  # discard what was spent before the window (set-up, eval, saves)

    def step_done(self) -> None:
        self._steps += 1

    def pause(self) -> None:
        if self.energy_ok:
            self.energy.pause()

    def resume(self) -> None:
        if self.energy_ok:
            self.energy.resume()

    def _sync(self) -> None:
        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def end_interval(self) -> dict:
        """Measurements over the steps since start_interval(); every rank must call it (it all-reduces)."""
        self._sync()
        seconds = time.perf_counter() - self._t0
        steps = max(self._steps, 1)
        step_time = seconds / steps
        tokens_per_sec = self.tokens_per_step * steps / seconds
        tflops = self.flops_full.model_flops * steps / seconds / self.world_size / 1e12
        tflops_causal = self.flops_causal.model_flops * steps / seconds / self.world_size / 1e12
        out = dict(step_time_s=step_time, tokens_per_sec=tokens_per_sec,
                   tokens_per_sec_per_gpu=tokens_per_sec / self.world_size,
                   tflops_per_gpu=tflops, tflops_per_gpu_causal=tflops_causal,
                   mfu=tflops / self.peak.tflops if self.peak else None,
                   mfu_causal=tflops_causal / self.peak.tflops if self.peak else None,
                   num_gpus=self.world_size if self.device_type == "cuda" else 0)
        out.update(self._memory())
        out.update(self._energy(tokens=self.tokens_per_step * steps, seconds=seconds))
        self._t0 = time.perf_counter()
        self._steps = 0
        return out

    def _memory(self) -> dict:
        if self.device_type == "cuda":
            stats = torch.tensor([torch.cuda.max_memory_allocated(), torch.cuda.memory_reserved()],
                                 dtype=torch.float64, device="cuda")
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
            torch.cuda.reset_peak_memory_stats()
            return dict(mem_max_allocated_gb=stats[0].item() / 2**30, mem_reserved_gb=stats[1].item() / 2**30)
        import psutil

        return dict(host_rss_gb=psutil.Process().memory_info().rss / 2**30)

    def _energy(self, tokens: int, seconds: float) -> dict:
        none = dict(gpu_power_w=None, joules_per_token=None, energy_kwh_total=None)
        if self.device_type != "cuda":
            return none
        reading = self.energy.lap() if self.energy_ok else None
        # Every rank contributes (joules, 1 if measured): a window counts only if all GPUs measured it.
        device = torch.device("cuda", torch.cuda.current_device())
        buf = torch.tensor([reading.joules if reading else 0.0, 1.0 if reading else 0.0], dtype=torch.float64,
                           device=device)
        dist.all_reduce(buf)
        if buf[1].item() < self.world_size:
            return none
        joules = buf[0].item()
        self.total_joules += joules
        return dict(gpu_power_w=joules / seconds / self.world_size, joules_per_token=joules / tokens,
                    energy_kwh_total=self.total_joules / 3.6e6)

    @property
    def energy_note(self) -> Optional[str]:
        if self.device_type != "cuda":
            return "GPU energy not measured: CPU run"
        if not self.energy_ok:
            return f"GPU energy not measured: {self.energy.reason}"
        return None

    def close(self) -> None:
        if self.energy:
            self.energy.close()
