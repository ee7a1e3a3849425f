"""Litespark's int4 weight-only linear layer: decode reads four bits a weight.

Decode multiplies a few rows of activations by every weight of the model once per token, so it runs at the speed
the weights are read. torchao's int4 on Hopper is an Ampere kernel (aten's tinygemm) that reads its packed weights
at a tenth of the bandwidth bf16's GEMM does, and lost to bf16 (docs/efficiency/). This layer keeps the weights as
4-bit integers with a scale and a zero per group of GROUP input columns (round-to-nearest, asymmetric: what torchao's
tinygemm variant quantizes too) and multiplies by them in a Triton kernel that reads the packed bytes once, at
bandwidth (int4_linear_triton.py); a larger batch of rows (a prefill) dequantizes the weight and runs torch's GEMM,
where arithmetic, not reading, is the cost.

The format, for a weight W [out, in]:

    q[o, i]       = round((W[o, i] - zero[o, g]) / scale[o, g]), clamped to 0..15, g = i // GROUP
    scale[o, g]   = (max - min) / 15 of the group's weights (a group of equal weights: 1), fp32 then bf16
    zero[o, g]    = min of the group's weights, bf16
    packed[o, j]  = q[o, 2j] | q[o, 2j + 1] << 4   (uint8 [out, in / 2])
    W~[o, i]      = q[o, i] * scale[o, g] + zero[o, g]   in fp32, rounded to the activations' dtype

`int4_linear_reference(x, packed, scale, zero)` defines the layer: x @ W~^T summed in fp32, rounded to x's dtype.
tests/test_int4_linear_kernel.py holds the Triton kernel to it. `Int4Linear.from_linear` quantizes an nn.Linear.
"""
from __future__ import annotations

import torch

from . import kernel_path

GROUP = 128
# Rows of activations up to which the Triton kernel runs; more (a prefill) dequantize the weight for torch's GEMM.
DECODE_ROWS = 64


def quantize_int4(weight: torch.Tensor, group: int = GROUP) -> tuple:
    """(packed uint8 [out, in / 2], scale [out, in / group], zero [out, in / group]) of a weight [out, in]; the
    scale and zero in the weight's dtype (bf16 or fp16; fp32 stays fp32)."""
    out_features, in_features = weight.shape
    if in_features % group or group % 2:
        raise ValueError(f"int4: {in_features} input columns are not whole groups of {group}")
    w = weight.detach().float().reshape(out_features, in_features // group, group)
    low, high = w.amin(-1), w.amax(-1)
    scale = ((high - low) / 15).to(weight.dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # a group of equal weights: q = 0, W~ = zero
    zero = low.to(weight.dtype)
    q = torch.round((w - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8)
    q = q.reshape(out_features, in_features)
    return q[:, 0::2] | (q[:, 1::2] << 4), scale, zero


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """W~ [out, in] in fp32."""
    out_features, half = packed.shape
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(out_features, 2 * half).float()
    group = 2 * half // scale.shape[1]
    q = q.reshape(out_features, scale.shape[1], group)
    return (q * scale.float()[..., None] + zero.float()[..., None]).reshape(out_features, 2 * half)


def int4_linear_reference(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                          bias: torch.Tensor = None) -> torch.Tensor:
    """x [..., in] @ W~^T (+ bias): W~ in x's dtype, the products summed in fp32, rounded to x's dtype (and the bias
    added in it)."""
    y = (x.float() @ dequantize_int4(packed, scale, zero).to(x.dtype).float().t()).to(x.dtype)
    return y if bias is None else y + bias


@torch.library.custom_op("litespark::int4_linear", mutates_args=())
def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W~^T: the Triton kernel for a few rows on CUDA, W~ in x's dtype and torch's GEMM for more
    (prefill), the reference elsewhere. An opaque operator to torch.compile (its fake below gives the shape)."""
    if kernel_path(x.device.type) != "litespark":
        return int4_linear_reference(x, packed, scale, zero)
    if x.shape[0] > DECODE_ROWS:
        return torch.nn.functional.linear(x, dequantize_int4(packed, scale, zero).to(x.dtype))
    from .int4_linear_triton import int4_matmul

    return int4_matmul(x, packed, scale, zero)


@int4_linear.register_fake
def _(x, packed, scale, zero):
    return x.new_empty((x.shape[0], packed.shape[0]))


class Int4Linear(torch.nn.Module):
    """An nn.Linear whose weight is int4 (the format above); the bias, if any, stays in its dtype. The packed weight,
    scale and zero are frozen parameters: what the model's parameters hold is what it stores."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bias: torch.Tensor = None):
        super().__init__()
        self.in_features, self.out_features = 2 * packed.shape[1], packed.shape[0]
        self.packed = torch.nn.Parameter(packed, requires_grad=False)
        self.scale = torch.nn.Parameter(scale, requires_grad=False)
        self.zero = torch.nn.Parameter(zero, requires_grad=False)
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, group: int = GROUP) -> "Int4Linear":
        return cls(*quantize_int4(linear.weight, group), linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        y = int4_linear(rows.contiguous(), self.packed, self.scale, self.zero).reshape(*x.shape[:-1], -1)
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> torch.Tensor:
        """W~ [out, in] in the scale's dtype: the weight the layer multiplies by."""
        return dequantize_int4(self.packed, self.scale, self.zero).to(self.scale.dtype)

    def extra_repr(self) -> str:
        group = self.in_features // self.scale.shape[1]
        return f"in_features={self.in_features}, out_features={self.out_features}, int4, group={group}"


def int4_path(device_type: str) -> str:
    """What the int4 layers run on a device of this type (the result's record)."""
    return kernel_path(device_type)
