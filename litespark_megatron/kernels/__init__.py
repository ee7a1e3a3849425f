"""Litespark's own kernels, each beside the plain-torch reference that defines it (the tests hold one to the other).
"""
import functools


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether the Triton kernels can be built here: a torch without Triton (CPU-only wheels) runs the references."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True
