"""Which machine a run is on: CUDA + NCCL (with or without Transformer Engine, FP8-capable or not), or CPU + gloo."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class Platform:
    device_type: str          # "cuda" or "cpu"
    dist_backend: str         # "nccl" or "gloo"
    te: bool                  # Transformer Engine importable (only ever True with CUDA)
    fp8_capable: bool         # compute capability >= 8.9
    device_name: str
    triton: Optional[bool] = None  # Triton importable; None: as on this machine (a planned node says True)


def te_importable() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # TE raises OSError/ImportError/RuntimeError depending on what is missing
        return False
    return True


@functools.lru_cache(maxsize=None)
def detect() -> Platform:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return Platform("cuda", "nccl", te_importable(), (major, minor) >= (8, 9), torch.cuda.get_device_name())
    return Platform("cpu", "gloo", False, False, "cpu")


def current_device() -> torch.device:
    """This rank's device: its GPU (set by megatron's initialize from LOCAL_RANK), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
