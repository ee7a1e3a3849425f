"""Dense peak tensor-core throughput of data-center GPUs, and MFU against it.

Every number is the DENSE figure. NVIDIA datasheets print the 2:4-structured-sparsity figure for tensor
cores (marked with an asterisk): dense is exactly half of it. The famous "1,979 TFLOPS" of H100/H200 BF16 is
the sparse figure; dense BF16 is 989.4. Training never uses 2:4 sparsity, so MFU against a sparse peak would
understate utilisation by 2x.

MFU convention: MFU is always taken against the dense BF16/FP16 peak, also for FP8 runs
(``mfu_basis="bf16-dense"``). FP8 changes how fast the GEMMs run, not how much work the model needs, and
quoting FP8 MFU against the 2x FP8 peak would make an FP8 run that is faster look less efficient than the BF16
run. The FP8 dense peak is still reported alongside (``precision_peak_tflops``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union


class PeakError(ValueError):
    """A peak that cannot be determined; the message says what to pass instead."""


class UnknownGPUError(PeakError):
    """The device is not in the peak table (or is a MIG slice); pass --peak-tflops."""


# Dense tensor-core TFLOP/s per GPU. Sources: the datasheet (or whitepaper) of each product; the comment gives
# the printed figures, where "sparse" means the datasheet's asterisked with-sparsity value (= 2 x dense).
# None: the GPU has no tensor-core support for that precision.
PEAK_TFLOPS = {
    # H100 SXM5 (NVIDIA H100 Tensor Core GPU datasheet and Hopper whitepaper, H100 SXM5 column):
    # TF32 989 sparse / 494.7 dense; BF16 and FP16 1,979 sparse / 989.4 dense; FP8 3,958 sparse / 1,978.9 dense.
    "H100-SXM": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    # H100 PCIe (same datasheet, PCIe column): TF32 756 sparse; BF16/FP16 1,513 sparse; FP8 3,026 sparse.
    "H100-PCIE": {"tf32": 378.0, "bf16": 756.5, "fp16": 756.5, "fp8": 1513.0},
    # H100 NVL, per GPU (same datasheet, H100 NVL column): TF32 835 sparse; BF16/FP16 1,671 sparse;
    # FP8 3,341 sparse.
    "H100-NVL": {"tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # H200 SXM (NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column): same tensor cores and clocks as
    # H100 SXM: TF32 989 sparse; BF16/FP16 1,979 sparse; FP8 3,958 sparse.
    "H200": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    # H200 NVL (same datasheet, H200 NVL column): TF32 835 sparse; BF16/FP16 1,671 sparse; FP8 3,341 sparse.
    "H200-NVL": {"tf32": 417.5, "bf16": 835.5, "fp16": 835.5, "fp8": 1670.5},
    # GH200 Grace Hopper Superchip, GPU part (GH200 datasheet): TF32 494 dense / 989 sparse; BF16/FP16 990 dense /
    # 1,979 sparse; FP8 1,979 dense / 3,958 sparse: the H100 SXM tensor cores, so the H100 SXM dense values.
    "GH200": {"tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9},
    # A100 SXM4 40/80 GB (NVIDIA A100 Tensor Core GPU datasheet): TF32 156 dense / 312 sparse; BF16/FP16 312 dense /
    # 624 sparse. No FP8.
    "A100-SXM": {"tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": None},
    # A100 PCIe 40/80 GB (same datasheet): the same tensor-core peaks as SXM4 (312 BF16 dense).
    "A100-PCIE": {"tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "fp8": None},
    # L40S (NVIDIA L40S datasheet): TF32 183 / 366 sparse; BF16/FP16 362.05 / 733 sparse; FP8 733 / 1,466 sparse.
    "L40S": {"tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0},
    # B200, per GPU (NVIDIA HGX B200 datasheet, 8 GPUs: TF32 18 PFLOPS, FP16/BF16 36 PFLOPS, FP8 72 PFLOPS, all
    # with sparsity): per GPU TF32 2.25 PF sparse, BF16 4.5 PF sparse, FP8 9 PF sparse -> halved for dense.
    "B200": {"tf32": 1125.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0},
}

# Name patterns, most specific first: "GH200" contains "H200", and "H100 NVL"/"H100 PCIe" contain "H100".
# Names are upper-cased with "-" and "_" turned into spaces before matching, so "NVIDIA A100-SXM4-80GB",
# "H100-PCIe" and "h200" all work.
_NAME_PATTERNS = (
    (r"\bGH200\b", "GH200"),
    (r"\bH200\b.*\bNVL\b", "H200-NVL"),
    (r"\bH200\b", "H200"),
    (r"\bH100\b.*\bNVL\b", "H100-NVL"),
    (r"\bH100\b.*\bPCIE\b", "H100-PCIE"),
    # "NVIDIA H100 80GB HBM3" (the SXM5 board's name), "H100 SXM5", or plain "H100".
    (r"\bH100\b", "H100-SXM"),
    (r"\bA100\b.*\bPCIE\b", "A100-PCIE"),
    (r"\bA100\b", "A100-SXM"),
    (r"\bL40S\b", "L40S"),
    (r"\bB200\b", "B200"),
)

_PRECISION_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp8": "fp8", "e4m3": "fp8", "hybrid": "fp8",
    "tf32": "tf32",
}


def normalize_precision(precision: str) -> str:
    key = str(precision).strip().lower().removeprefix("torch.")  # also accepts torch.bfloat16 / torch.float16
    if key not in _PRECISION_ALIASES:
        raise PeakError(f"unknown precision {precision!r}; use one of bf16, fp16, fp8, tf32")
    return _PRECISION_ALIASES[key]


def match_device(device_name: str) -> Optional[str]:
    """Table key for a device name (torch.cuda.get_device_name / nvidia-smi / a short name like 'H200'), or
    None when the device is not in the table."""
    name = re.sub(r"[-_]", " ", str(device_name).upper())
    if re.search(r"\bMIG\b", name):
        return None  # a MIG slice has a fraction of the GPU's SMs: no whole-GPU peak applies
    for pattern, key in _NAME_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


@dataclass(frozen=True)
class Peak:
    """The peak an MFU is taken against.

    ``tflops`` is the MFU denominator (dense, per GPU). ``mfu_basis`` names it: "bf16-dense", "fp16-dense",
    "tf32-dense", or "override" for a value given with --peak-tflops. ``precision_peak_tflops`` is the dense
    peak of the run's own precision (for FP8 runs the FP8 peak), None when not known (override).
    """

    device: str
    precision: str
    tflops: float
    mfu_basis: str
    precision_peak_tflops: Optional[float]
    source: str

    def as_dict(self) -> dict:
        return dict(device=self.device, precision=self.precision, tflops=self.tflops, mfu_basis=self.mfu_basis,
                    precision_peak_tflops=self.precision_peak_tflops, source=self.source)


def detect_peak(device_name: Optional[str], dtype: str, override: Optional[float] = None) -> Peak:
    """Dense peak for MFU of a run in ``dtype`` on ``device_name``.

    ``override`` (TFLOP/s, from --peak-tflops) wins over the table and is used as given. An unknown device
    without override raises UnknownGPUError.
    """
    precision = normalize_precision(dtype)
    if override is not None:
        if not override > 0:
            raise PeakError(f"--peak-tflops must be a positive number of TFLOP/s, got {override}")
        key = match_device(device_name) if device_name else None
        return Peak(device=key or str(device_name or "unspecified"), precision=precision, tflops=float(override),
                    mfu_basis="override", precision_peak_tflops=None, source="--peak-tflops")
    key = match_device(device_name) if device_name else None
    if key is None:
        what = f"GPU {device_name!r}" if device_name else "no GPU name"
        why = " is a MIG slice, whose peak is a fraction of the full GPU's;" if device_name and \
            re.search(r"\bMIG\b", str(device_name).upper()) else " is not in the peak table;"
        raise UnknownGPUError(f"{what}{why} pass --peak-tflops with its dense BF16 tensor TFLOP/s "
                              f"(known: {', '.join(PEAK_TFLOPS)})")
    table = PEAK_TFLOPS[key]
    own = table[precision]
    if own is None:
        raise PeakError(f"{key} has no {precision.upper()} tensor cores; use --precision bf16")
    # FP8 runs are measured against the BF16 dense peak (see the module docstring).
    basis = "bf16" if precision == "fp8" else precision
    return Peak(device=key, precision=precision, tflops=table[basis], mfu_basis=f"{basis}-dense",
                precision_peak_tflops=own, source="datasheet")


def mfu(achieved_flops_per_s: float, peak: Union[Peak, float]) -> float:
    """Model FLOPs utilisation (a fraction): achieved FLOP/s per GPU / peak FLOP/s per GPU.

    ``peak`` is a Peak or a number of TFLOP/s.
    """
    tflops = peak.tflops if isinstance(peak, Peak) else float(peak)
    if not tflops > 0:
        raise ValueError(f"peak must be a positive number of TFLOP/s, got {tflops}")
    if not achieved_flops_per_s >= 0:
        raise ValueError(f"achieved FLOP/s must be >= 0, got {achieved_flops_per_s}")
    return achieved_flops_per_s / (tflops * 1e12)
