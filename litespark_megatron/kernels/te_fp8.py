"""Transformer Engine's FP8 tensors and quantizers where Litespark's FP8 kernels meet them: TE's format names, delayed
scaling's quantization in plain torch (the kernels' references), a Float8Tensor built from a kernel's two layouts, the
quantizer a TE linear reads its input with, and the layouts a saved input keeps.

TE imports inside the functions that need it: the references run where it is not installed.
"""
from __future__ import annotations

import torch

# Transformer Engine's FP8 formats by name (its DType enum), as torch dtypes (kernels.FP8_FORMATS holds their bits).
TE_FP8_DTYPES = {"kFloat8E4M3": torch.float8_e4m3fn, "kFloat8E5M2": torch.float8_e5m2}


def torch_dtype(te_dtype) -> torch.dtype:
    """The torch dtype of one of Transformer Engine's FP8 formats."""
    name = getattr(te_dtype, "name", str(te_dtype)).rsplit(".", 1)[-1]
    if name not in TE_FP8_DTYPES:
        raise ValueError(f"no FP8 format {name}; Transformer Engine's {sorted(TE_FP8_DTYPES)} only")
    return TE_FP8_DTYPES[name]


def quantized_reference(y: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """y [rows, n] fp32 in FP8 row-major and column-major; amax maxed with max |y|; the reciprocal scale."""
    fp8_max = torch.finfo(dtype).max
    amax.copy_(torch.maximum(amax, y.abs().max().reshape(amax.shape)))
    q = (y * scale.float()).clamp(-fp8_max, fp8_max).to(dtype)
    return q, q.t().contiguous(), (1.0 / scale.float()).reshape(1)


def float8_tensor(row, col, scale_inv, quantizer, nominal: torch.dtype, shape=None):
    """Transformer Engine's Float8Tensor of both layouts, as its own quantizer would have written it: of row's shape,
    or of `shape` (same last dimension), whose column-major data TE lays out [last, *the others]."""
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

    shape = tuple(row.shape if shape is None else shape)
    return Float8Tensor(shape=shape, dtype=nominal, data=row.view(torch.uint8).view(shape), fp8_scale_inv=scale_inv,
                        fp8_dtype=quantizer.dtype, data_transpose=col.view(torch.uint8).view(shape[-1], *shape[:-1]),
                        quantizer=quantizer, requires_grad=False, device=row.device)


def is_quantized(t: torch.Tensor) -> bool:
    """Whether t is one of Transformer Engine's quantized tensors (torch's own Tensor.dequantize copies a plain one to
    fp32)."""
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensorStorage

    return isinstance(t, QuantizedTensorStorage)


def delayed_scaling_fp8() -> bool:
    """Whether Transformer Engine runs FP8 here under delayed scaling (inside its autocast)."""
    try:
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
    except ImportError:  # TE before the module's rename
        from transformer_engine.pytorch.fp8 import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled() and FP8GlobalStateManager.get_fp8_recipe().delayed()


def module_quantizer(module, kind: str, index):
    """One of a Transformer Engine module's quantizers ("scaling_fwd" / "scaling_bwd", by TE's tensor index), or
    None."""
    quantizers = module.quantizers.get(kind) or ()
    return quantizers[int(index)] if int(index) < len(quantizers) else None


def fp8_input_quantizer(linear):
    """The input quantizer of a Transformer Engine linear that runs in FP8 under delayed scaling and takes its input
    as it is (no all-gather: TE gathers FP8 row-major only), with its FP8 state set up as its own forward would (the
    call is idempotent); else None (BF16, a layer kept in BF16, another recipe, sequence parallelism, not TE)."""
    if not hasattr(linear, "init_fp8_metadata") or not delayed_scaling_fp8():
        return None
    if getattr(linear, "sequence_parallel", False) and getattr(linear, "parallel_mode", None) == "column":
        return None
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    import transformer_engine_torch as tex

    linear.init_fp8_metadata()
    found = module_quantizer(linear, "scaling_fwd", tex.FP8FwdTensors.GEMM1_INPUT)
    return found if isinstance(found, Float8Quantizer) and getattr(linear, "fp8", False) else None


def fp8_grad_output_quantizer(linear):
    """The output-gradient quantizer of a Transformer Engine linear whose last forward ran in FP8 under delayed
    scaling (TE's Float8Quantizer: a scale to read, an amax to max into), for a kernel that writes that gradient in
    FP8 itself; else None (BF16, a layer kept in BF16, another recipe, not TE). Called after the linear's forward,
    which set its FP8 state up."""
    if not (hasattr(linear, "quantizers") and getattr(linear, "fp8", False)) or not delayed_scaling_fp8():
        return None
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    import transformer_engine_torch as tex

    found = module_quantizer(linear, "scaling_bwd", tex.FP8BwdTensors.GRAD_OUTPUT1)
    return found if isinstance(found, Float8Quantizer) else None


def drop_row_major(t) -> None:
    """Free the row-major data of a Float8Tensor once its GEMM ran: what a TE linear saves of its input for the weight
    gradient is the tensor object itself, whose column-major data is all that gradient reads (on Hopper; where TE
    reads one layout both ways it keeps that one)."""
    t.update_usage(rowwise_usage=False)


class _Rows(torch.autograd.Function):
    """A Float8Tensor [..., n] as [rows, n], both layouts kept: the column-major data, [n, *the others] contiguous,
    is [n, rows] already (Transformer Engine's own reshape drops it where the shapes differ)."""

    @staticmethod
    def forward(ctx, t):
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor

        ctx.shape = t.shape
        n = t.shape[-1]
        rows = t.numel() // n
        data = None if t._data is None else t._data.view(rows, n)
        transpose = None if t._transpose is None or t._transpose_invalid else t._transpose.view(n, rows)
        return Float8Tensor(shape=(rows, n), dtype=t.dtype, data=data, fp8_scale_inv=t._scale_inv,
                            fp8_dtype=t._fp8_dtype, data_transpose=transpose, quantizer=t._quantizer,
                            requires_grad=False, device=t.device)

    @staticmethod
    def backward(ctx, grad):
        return grad.reshape(ctx.shape)


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """t [..., n] as [rows, n]: a view, and for one of Transformer Engine's FP8 tensors (an FP8 norm's output) one
    that keeps its column-major layout."""
    if hasattr(t, "_transpose") and hasattr(t, "update_usage"):
        return _Rows.apply(t)
    return t.reshape(-1, t.size(-1))


def drop_row_major_if_quantized(t) -> None:
    """drop_row_major for one of Transformer Engine's quantized tensors (an FP8 norm's output, once its GEMM ran); a
    plain tensor is left as it is."""
    if hasattr(t, "update_usage"):
        drop_row_major(t)
