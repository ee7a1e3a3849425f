"""Elementwise kernels of the Litespark layer, each with its plain-torch reference.

The references define the function; the fused versions must match them (tests compare both on random inputs).
On CUDA the fused versions are torch.compile'd into one kernel each (one read of the input, one write of the
output instead of several); on the CPU the reference runs as is.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2f] laid out as [gate | up] -> silu(gate) * up, [..., f]."""
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    return F.silu(gate) * up


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: statistics in (at least) fp32, result in the input dtype, then scaled by the weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight.to(x.dtype)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        return _compiled(swiglu_reference)(gate_up)
    return swiglu_reference(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _compiled(rms_norm_reference)(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
