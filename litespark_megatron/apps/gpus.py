"""The accelerators litespark-plan plans for: memory, MFU peak, memory bandwidth and links, by type name.

Memory is what the driver reports for the card (nvidia-smi's total, in GiB); a layout fits when the memory model's
peak is at most memory_model.USABLE_SHARE of it. `cpu` plans ranks of a CPU-only machine (gloo, fp32), for trying a
plan end to end without a GPU: its memory is the host's share given with --gpu-memory-gib, its speed a measured one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import UserError
from .scaling_estimate import CX7_400G_GBPS_PER_GPU, NVLINK4_GBPS_PER_DIRECTION


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gib: Optional[float]  # None: give --gpu-memory-gib
    peak_name: Optional[str]  # metrics.peaks' device name (MFU and HBM tables); None: no MFU
    hbm_tbps: float  # for the optimizer step's time (scaling.estimate)
    fp8: bool
    link_gbps: float  # between two accelerators of a node, per direction
    network_gbps: float  # per accelerator, per direction, between nodes

    @property
    def cpu(self) -> bool:
        return self.peak_name is None


ACCELERATORS = {
    # HGX/DGX nodes: NVLink 4 through NVSwitch, one 400 Gb/s NIC per GPU (scaling_estimate.s defaults)
    "H100": Accelerator("H100", 81_559 / 1024, "H100-SXM", 3.35, True, NVLINK4_GBPS_PER_DIRECTION,
                        CX7_400G_GBPS_PER_GPU),
    "H200": Accelerator("H200", 143_771 / 1024, "H200", 4.8, True, NVLINK4_GBPS_PER_DIRECTION,
                        CX7_400G_GBPS_PER_GPU),
    # A CPU-only machine's ranks: host memory bandwidth and gloo over shared memory, rough figures for the
    # optimizer's and the collectives' share of a step (a CPU plan's speed comes from its measured rate).
    "cpu": Accelerator("cpu", None, None, 0.05, False, 5.0, 1.0),
}


def accelerator(name: str) -> Accelerator:
    for key, value in ACCELERATORS.items():
        if key.lower() == str(name).lower():
            return value
    raise UserError(f"unknown --gpu '{name}': litespark-plan knows {', '.join(ACCELERATORS)}")
