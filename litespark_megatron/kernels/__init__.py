"""Litespark's own kernels, each beside the plain-torch reference that defines it (the tests hold one to the other).

A Triton kernel's function name is its name in a profile: each starts with what it computes (rms_norm_...,
cross_entropy_...), which is also how the profile tool files it (apps/profile.py's categories).
"""
import functools

# The FP8 formats as (mantissa bits, exponent bias): e4m3 (the forward's) and e5m2 (the backward's, TE's hybrid). Here,
# not beside the Triton kernels that use them: the plain-torch references need them where Triton does not import.
FP8_FORMATS = {"e4m3": (3, 7), "e5m2": (2, 15)}


def fp8_format(dtype) -> tuple:
    """(mantissa bits, exponent bias) of a torch FP8 dtype."""
    import torch

    return FP8_FORMATS["e4m3" if dtype == torch.float8_e4m3fn else "e5m2"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the Triton kernels can be built here: a torch without Triton (CPU-only wheels) runs the references."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def triton_on(plat) -> bool:
    """Whether the platform a run is checked for has Triton: a planned node says so, this machine is asked."""
    return plat.triton if plat.triton is not None else triton_available()


def kernel_path(device_type: str) -> str:
    """What a Litespark kernel runs on a device of this type (the run's "what ran" record): "litespark" (its Triton
    kernels, CUDA) or "litespark (reference)" (its plain-torch reference)."""
    return "litespark" if device_type == "cuda" and triton_available() else "litespark (reference)"
