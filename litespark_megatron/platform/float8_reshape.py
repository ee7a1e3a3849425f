"""Transformer Engine's Float8Tensor.reshape given its shape as one tuple, as torch's reshape is.

The gap: `Float8Tensor.reshape(*shape)` (TE 2.20.2, tensor/float8_tensor.py `_ReshapeFunc`) builds the shape of the
column-major (transposed) data from `shape[-1]` and `shape[:-1]`, which are the whole tuple and nothing when the
shape comes as one argument, `t.reshape((-1, n))`: the transposed data of a [rows, n] tensor is then labelled
[rows, n] instead of [n, rows], and a GEMM that reads it takes the wrong shape. TE's own backward calls it that way
on every output gradient (`grad_output.reshape((-1, grad_output.shape[-1]))`, module/base.py); TE's quantizers never
hand a module a gradient with both layouts, so TE does not meet it, and Litespark's FP8 SwiGLU does
(kernels/swiglu_fp8.py: fc1's FP8 output gradient, both layouts).

The fix: one tuple (or list, or torch.Size) argument is unpacked into the shape before TE's reshape sees it.
"""
from __future__ import annotations


def reshape_takes_a_shape_tuple() -> None:
    """Idempotent; a TE without Float8Tensor (older, or moved) is left as it is: tests/test_swiglu_fp8_kernel.py
    says so on a GPU."""
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
    except ImportError:
        return
    reshape = Float8Tensor.reshape
    if getattr(reshape, "litespark_fixed", False):
        return

    def reshape_shape(self, *shape):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return reshape(self, *shape)

    reshape_shape.litespark_fixed = True
    reshape_shape.unfixed = reshape
    Float8Tensor.reshape = reshape_shape
