"""The elementwise ops of the Litespark layer (SwiGLU, RoPE, RMSNorm), each with its plain-torch reference.

The references define the function; the fused versions must match them (tests compare both on random inputs,
forward and backward). On CUDA, SwiGLU is Transformer Engine's fused kernel pair (swiglu / dswiglu, through its
public `te.pytorch.ops.SwiGLU`) where TE is installed, else torch.compile'd; RMSNorm is torch.compile'd; RoPE is
TE's fused kernel where TE is installed (through megatron-core), else torch.compile'd. One read of the input and
one write of the output instead of several. On the CPU the reference runs as is.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils

from ..kernels.rms_norm import rms_norm_reference  # noqa: F401  (defined beside Litespark's own RMSNorm kernel)


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2f] laid out as [gate | up] -> silu(gate) * up, [..., f]."""
    gate, up = torch.chunk(gate_up, 2, dim=-1)
    return F.silu(gate) * up


def rope_reference(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of [s, b, h, d] by [s, 1, 1, r] angles (r <= d channels rotated, the rest passed through),
    halves rotated (Llama's layout, not interleaved); cos and sin are taken in the angles' dtype, then rounded to
    the input's, as megatron-core's unfused RoPE does."""
    r = freqs.size(-1)
    x, rest = t[..., :r], t[..., r:]
    x1, x2 = torch.chunk(x, 2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    x = x * torch.cos(freqs).to(t.dtype) + rotated * torch.sin(freqs).to(t.dtype)
    return torch.cat([x, rest], dim=-1) if rest.numel() else x


def te_rope_available() -> bool:
    """Whether megatron-core found TE's fused RoPE: what its TransformerConfig requires for apply_rope_fusion."""
    return rope_utils.fused_apply_rotary_pos_emb is not None


def rope_impl(t: torch.Tensor, config) -> str:
    """Which RoPE `rope` runs: 'te' (config.apply_rope_fusion: megatron-core calls TE's fused kernel),
    'compiled' (a GPU without TE: megatron-core refuses apply_rope_fusion there, so the layer fuses it itself) or
    'unfused' (megatron-core's plain torch ops: the CPU, and --no-rope-fusion where TE is installed)."""
    if config.apply_rope_fusion:
        return "te"
    if t.is_cuda and not te_rope_available() and not config.rotary_interleaved:
        return "compiled"
    return "unfused"


def rope(t: torch.Tensor, freqs: torch.Tensor, config, cu_seqlens=None, cp_group=None) -> torch.Tensor:
    if cu_seqlens is None and rope_impl(t, config) == "compiled":
        # megatron-core's unfused RoPE is several elementwise kernels each way, a measurable share of the local
        # backend's step (docs/benchmarks/2026-11-22-llama-3b-h200-fused-ce-fp8-local.md).
        return _compiled(rope_reference)(t, freqs)
    return rope_utils.apply_rotary_pos_emb(t, freqs, config=config, cu_seqlens=cu_seqlens, cp_group=cp_group)


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=True, fullgraph=True)


@functools.lru_cache(maxsize=None)
def _te_swiglu():
    """TE's SwiGLU op (silu of the first half times the second: the [gate | up] layout), or None without TE.
    It holds no parameters, so one instance serves every layer."""
    try:
        import transformer_engine.pytorch as te

        return te.ops.SwiGLU()
    except Exception:  # TE absent or unusable here (import errors of its extension): the compiled fallback
        return None


def swiglu_impl(device_type: str) -> str:
    """Which implementation `swiglu` runs on this device type: 'te', 'compiled' or 'reference'."""
    if device_type != "cuda":
        return "reference"
    return "te" if _te_swiglu() is not None else "compiled"


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.is_cuda:
        op = _te_swiglu()
        # TE's kernel pair where TE is installed: torch.compile's backward kernel moves far less than the HBM's
        # bandwidth (docs/benchmarks/2026-11-22-llama-3b-h200-profile-and-fix.md).
        return op(gate_up) if op is not None else _compiled(swiglu_reference)(gate_up)
    return swiglu_reference(gate_up)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        return _compiled(rms_norm_reference)(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
