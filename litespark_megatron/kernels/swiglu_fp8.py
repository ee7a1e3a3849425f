"""Litespark's FP8 SwiGLU: the Llama MLP's activation writing the next GEMM's FP8 input, and its backward writing
the previous GEMM's FP8 output gradient, each in both layouts in one pass.

Under FP8 the MLP is fc1 -> SwiGLU -> fc2. Transformer Engine's standalone SwiGLU writes bf16, which fc2 then reads
again to cast it to FP8 row-major (its GEMM) and column-major (its weight gradient); in the backward TE's dSwiGLU
writes a bf16 gradient twice fc2's width, which fc1 reads again for the same two casts. TE's own fused
activation + quantize (its op fuser) writes the row-major FP8 only, and a separate kernel transposes it on Hopper.
These kernels compute in fp32 and write FP8 straight from the registers, both layouts, with the tensor's amax:

    forward   [rows, 2f] bf16 [gate | up] -> silu(gate) * up: [rows, f] and [f, rows] FP8
    backward  dy [rows, f] and the saved input -> [d gate | d up]: [rows, 2f] and [2f, rows] FP8

The scaling is Transformer Engine's delayed scaling: the quantizer's current `scale` multiplies, the value is
saturated to the format's largest finite number and rounded to nearest even, the tensor's max |value| (before
scaling) is maxed into the quantizer's `amax` (the amax history's current row, which TE reduces and turns into the
next scales), and 1 / scale travels with the data.

`swiglu_fp8_reference` / `dswiglu_fp8_reference` define the functions (plain torch, fp32); the tests hold the
Triton kernels to them (Triton's interpreter on a CPU, compiled on a GPU). `swiglu_to_fp8` is the autograd
function the Litespark MLP runs (layers/mlp.py): Transformer Engine's Float8Tensor out, so fc2 takes its input as
it is and fc1 its output gradient.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernel_path
from .te_fp8 import float8_tensor, is_quantized, quantized_reference, torch_dtype


def swiglu_fp8_reference(gate_up: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype):
    """[rows, 2f] [gate | up] -> (silu(gate) * up in FP8 [rows, f], the same [f, rows], 1 / scale); amax updated."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return quantized_reference(F.silu(gate) * up, scale, amax, dtype)


def dswiglu_reference(dy: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """The gradient of silu(gate) * up with respect to [gate | up] for dy [rows, f], in (at least) fp32."""
    dtype = torch.promote_types(gate_up.dtype, torch.float32)
    gate, up = gate_up.to(dtype).chunk(2, dim=-1)
    dy, sig = dy.to(dtype), torch.sigmoid(gate)
    return torch.cat([dy * up * sig * (1 + gate * (1 - sig)), dy * gate * sig], dim=-1)


def dswiglu_fp8_reference(dy: torch.Tensor, gate_up: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor,
                          dtype: torch.dtype):
    """dswiglu_reference in FP8, [rows, 2f] and [2f, rows]; amax updated."""
    return quantized_reference(dswiglu_reference(dy, gate_up).float(), scale, amax, dtype)


def _launch(kernel, tile, inputs, rows: int, channels: int, width: int, scale, amax, dtype):
    """Run one of the kernels on [rows, 2 * channels] inputs in tiles of (rows, channels, warps); its FP8 outputs
    are [rows, width] and [width, rows]."""
    from . import swiglu_fp8_triton as kernels
    from .fp8_bytes_triton import format_arguments

    like = inputs[-1]
    row = torch.empty(rows, width, device=like.device, dtype=torch.uint8)
    col = torch.empty(width, rows, device=like.device, dtype=torch.uint8)
    scale_inv = torch.empty(1, device=like.device, dtype=torch.float32)
    kernel[kernels.grid(rows, channels, tile)](
        *(t.contiguous() for t in inputs), row, col, scale, amax, scale_inv, rows, channels,
        *format_arguments(dtype), BLOCK_ROWS=tile[0], BLOCK_CHANNELS=tile[1], num_warps=tile[2])
    return row.view(dtype), col.view(dtype), scale_inv


def swiglu_fp8_triton(gate_up, scale, amax, dtype):
    """swiglu_fp8_reference's function through the Triton kernel."""
    from . import swiglu_fp8_triton as kernels

    rows, channels = gate_up.size(0), gate_up.size(1) // 2
    return _launch(kernels.swiglu_fp8_forward, kernels.FORWARD_TILE, (gate_up,), rows, channels, channels, scale,
                   amax, dtype)


def dswiglu_fp8_triton(dy, gate_up, scale, amax, dtype):
    """dswiglu_fp8_reference's function through the Triton kernel."""
    from . import swiglu_fp8_triton as kernels

    rows, channels = gate_up.size(0), gate_up.size(1) // 2
    return _launch(kernels.swiglu_fp8_backward, kernels.BACKWARD_TILE, (dy, gate_up), rows, channels, 2 * channels,
                   scale, amax, dtype)


swiglu_fp8_path = kernel_path  # what the MLP's FP8 SwiGLU runs on a device of this type


class _SwiGLUToFP8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, forward_quantizer, backward_quantizer):
        dtype = torch_dtype(forward_quantizer.dtype)
        fn = swiglu_fp8_triton if swiglu_fp8_path(gate_up.device.type) == "litespark" else swiglu_fp8_reference
        row, col, scale_inv = fn(gate_up, forward_quantizer.scale, forward_quantizer.amax, dtype)
        ctx.save_for_backward(gate_up)
        ctx.backward_quantizer = backward_quantizer
        return float8_tensor(row, col, scale_inv, forward_quantizer, gate_up.dtype)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        quantizer = ctx.backward_quantizer
        if is_quantized(dy):  # fc2's input gradient is bf16 unless TE was asked to quantize it
            dy = dy.dequantize(dtype=gate_up.dtype)
        dtype = torch_dtype(quantizer.dtype)
        fn = dswiglu_fp8_triton if swiglu_fp8_path(gate_up.device.type) == "litespark" else dswiglu_fp8_reference
        row, col, scale_inv = fn(dy, gate_up, quantizer.scale, quantizer.amax, dtype)
        return float8_tensor(row, col, scale_inv, quantizer, gate_up.dtype), None, None


def swiglu_to_fp8(gate_up: torch.Tensor, forward_quantizer, backward_quantizer) -> torch.Tensor:
    """silu(gate) * up of [rows, 2f] [gate | up] as a Float8Tensor quantized by `forward_quantizer` (the next
    GEMM's input quantizer, TE's delayed-scaling Float8Quantizer), whose gradient with respect to gate_up is a
    Float8Tensor quantized by `backward_quantizer` (the previous GEMM's output-gradient quantizer)."""
    if gate_up.dim() != 2 or gate_up.size(1) % 2:
        raise ValueError(f"FP8 SwiGLU: input of shape {tuple(gate_up.shape)}; it takes [rows, 2f] laid out "
                         "[gate | up]")
    return _SwiGLUToFP8.apply(gate_up, forward_quantizer, backward_quantizer)
