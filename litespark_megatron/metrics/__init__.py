"""Training metrics: exact FLOP counts, GPU peak throughput (MFU), and GPU energy from NVML.

Nothing here imports torch or pynvml at import time, so the command-line tools that use these modules start
fast and run on machines without a GPU.
"""
from litespark_megatron.metrics.energy import EnergyMeter, EnergyReading, EnergySummary, summarize
from litespark_megatron.metrics.flops import (
    FlopBreakdown,
    MLAShape,
    ModelShape,
    MoEShape,
    ParamCount,
    TrainingFlops,
    flops_per_token_forward,
    param_count,
    recompute_from_args,
    training_flops_per_step,
)
from litespark_megatron.metrics.peaks import Peak, PeakError, UnknownGPUError, detect_peak, mfu

__all__ = [
    "EnergyMeter", "EnergyReading", "EnergySummary", "summarize",
    "FlopBreakdown", "MLAShape", "ModelShape", "MoEShape", "ParamCount", "TrainingFlops",
    "flops_per_token_forward", "param_count", "recompute_from_args", "training_flops_per_step",
    "Peak", "PeakError", "UnknownGPUError", "detect_peak", "mfu",
]
