"""Litespark's FP8 RMSNorm: the norm before QKV and fc1 writing the next GEMM's FP8 input, both layouts, in one kernel.

Under FP8, Transformer Engine's norm+linear (LayerNormLinear, the te backend's fused norm) writes the normed rows in
FP8 row-major and, on Hopper, launches a separate transpose for the column-major copy its weight gradient reads; at
hidden sizes without a tuned kernel (3,072: Llama-3.2-3B) its norm is its general kernel, unless its cuDNN norms are
asked for (NVTE_NORM_FWD_USE_CUDNN=1). This one writes both layouts from the registers, with delayed scaling's
bookkeeping (the FP8 SwiGLU's conventions, te_fp8.py: the quantizer's `scale` multiplies, values saturate and round
to nearest even, max |value| is maxed into the quantizer's `amax`, and 1 / scale travels with the data):

    forward   x [rows, H] (bf16), weight [H] -> y = round(x rsqrt(mean(x^2) + eps)) * weight in fp32 (the rounding to
              x's dtype is the BF16 norm's, rms_norm.py), as [rows, H] and [H, rows] FP8; each row's rsqrt kept
    backward  dy [rows, H] (the linear's input gradient, bf16) -> dx, dweight: the BF16 norm's backward kernel

`rms_norm_fp8_reference` defines the forward (plain torch); the tests hold the Triton kernel to it (Triton's
interpreter on a CPU, compiled on a GPU). `rms_norm_to_fp8` is the autograd function the Litespark layer's norms run
under FP8 (layers/norm.py): a Transformer Engine Float8Tensor out, which TE's linear takes as its input as it is.
"""
from __future__ import annotations

import torch

from .rms_norm import check_weight, rms_norm_backward_reference, rms_norm_backward_triton, rms_norm_path
from .te_fp8 import float8_tensor, is_quantized, quantized_reference, torch_dtype


def rms_norm_fp8_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor,
                           amax: torch.Tensor, dtype: torch.dtype):
    """x [rows, H] -> (the normed rows in FP8 [rows, H], the same [H, rows], 1 / scale, each row's rsqrt in fp32);
    amax updated."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = (xf * rstd[:, None]).to(x.dtype).to(xf.dtype) * weight.to(x.dtype).to(xf.dtype)
    return (*quantized_reference(y.float(), scale, amax, dtype), rstd.float())


def rms_norm_fp8_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: torch.Tensor, amax: torch.Tensor,
                        dtype: torch.dtype):
    """rms_norm_fp8_reference's function through the Triton kernel."""
    from . import rms_norm_triton as kernels
    from .fp8_bytes_triton import format_arguments

    x = x.contiguous()
    rows, columns = x.shape
    row = torch.empty(rows, columns, device=x.device, dtype=torch.uint8)
    col = torch.empty(columns, rows, device=x.device, dtype=torch.uint8)
    rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
    scale_inv = torch.empty(1, device=x.device, dtype=torch.float32)
    block_rows, block_columns, warps = kernels.FP8_TILE
    kernels.rms_norm_fp8_forward[kernels.fp8_grid(rows)](
        x, weight.contiguous(), row, col, rstd, scale, amax, scale_inv, eps, rows, columns,
        *format_arguments(dtype), BLOCK_ROWS=block_rows, BLOCK_COLUMNS=block_columns, num_warps=warps)
    return row.view(dtype), col.view(dtype), scale_inv, rstd


class _RMSNormToFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, quantizer):
        check_weight(weight, x.size(-1))
        rows = x.reshape(-1, x.size(-1)).contiguous()  # (what the backward kernel reads, saved as it read it)
        triton = rms_norm_path(x.device.type) == "litespark"
        fn = rms_norm_fp8_triton if triton else rms_norm_fp8_reference
        row, col, scale_inv, rstd = fn(rows, weight, eps, quantizer.scale, quantizer.amax,
                                       torch_dtype(quantizer.dtype))
        ctx.save_for_backward(rows, weight, rstd)
        ctx.triton, ctx.shape = triton, x.shape
        return float8_tensor(row, col, scale_inv, quantizer, x.dtype, shape=x.shape)

    @staticmethod
    def backward(ctx, dy):
        rows, weight, rstd = ctx.saved_tensors
        if is_quantized(dy):
            dy = dy.dequantize(dtype=rows.dtype)
        dy = dy.reshape(rows.shape)
        backward = rms_norm_backward_triton if ctx.triton else rms_norm_backward_reference
        dx, dw = backward(dy, rows, weight, rstd)
        return dx.view(ctx.shape), dw.to(weight.dtype), None, None


def rms_norm_to_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, quantizer) -> torch.Tensor:
    """RMSNorm of x [..., H] by weight [H] as a Float8Tensor of x's shape quantized by `quantizer` (the next GEMM's
    input quantizer, Transformer Engine's delayed-scaling Float8Quantizer), both layouts; its gradient with respect
    to x and weight as the BF16 norm's."""
    return _RMSNormToFP8.apply(x, weight, eps, quantizer)
