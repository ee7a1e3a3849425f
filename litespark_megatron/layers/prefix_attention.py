"""Causal attention of a chunk of queries that ends a longer key sequence: the attention of context parallelism.

Under context parallelism a rank attends each of its query chunks to every key up to the chunk's end, so the causal
diagonal sits at the end of the keys (bottom-right). torch's SDPA reaches that mask only through its lower-right
`CausalBias`, which runs FlashAttention-2; cuDNN's Hopper kernels run the usual square causal mask and unmasked
attention faster (docs/benchmarks/2026-11-22-context-parallelism.md). So on CUDA the chunk is split into an unmasked
part (the keys before the chunk) and a square causal part (the chunk's own keys), each a cuDNN call, merged with
their log-sum-exps; the backward runs each part's cuDNN backward with the merged output and log-sum-exp, which is
the exact gradient of the whole softmax (as ring attention does). Elsewhere (CPU, attention dropout, shapes cuDNN
refuses) SDPA with the lower-right mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_ops = torch.ops.aten


def prefix_causal_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> str:
    """Which implementation `prefix_causal_attention` runs: 'cudnn-split', 'sdpa-lower-right' or 'sdpa-mask'."""
    if not q.is_cuda:
        return "sdpa-mask"
    if dropout_p == 0.0:
        sq = q.size(2)
        # Asked for the square causal part, the call whose constraints are the stricter (equal lengths).
        params = torch.backends.cuda.SDPAParams(q, k[:, :, -sq:], v[:, :, -sq:], None, 0.0, True,
                                                q.size(1) != k.size(1))
        if torch.backends.cuda.can_use_cudnn_attention(params, False):
            return "cudnn-split"
    return "sdpa-lower-right"


def prefix_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                            dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v for q [b, h, sq, d] and k, v [b, hk, sk, d] with sk > sq and hk dividing h
    (grouped KV heads), where query i sees keys 0 .. sk - sq + i. Returns [b, h, sq, dv]."""
    impl = prefix_causal_impl(q, k, v, dropout_p)
    if impl == "cudnn-split":
        return _CudnnPrefixCausal.apply(q, k, v, scale)
    # (imported here: torch.nn.attention.bias imports TorchDynamo, a second of every process's start on 2 CPU cores)
    from torch.nn.attention.bias import causal_lower_right

    sq, sk = q.size(2), k.size(2)
    # causal_lower_right reaches FlashAttention on CUDA (grouped KV heads included); elsewhere it would warn about
    # every fused kernel it cannot use and materialize the mask anyway.
    mask = causal_lower_right(sq, sk) if impl == "sdpa-lower-right" else \
        torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=q.size(1) != k.size(1))


def _cudnn_forward(q, k, v, causal: bool, scale: float):
    out, lse, cum_q, cum_k, _, _, seed, offset, _ = _ops._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (seed, offset, cum_q, cum_k)


def _cudnn_backward(dout, q, k, v, out, lse, causal: bool, scale: float, aux):
    seed, offset, cum_q, cum_k = aux
    return _ops._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, q.size(2), k.size(2), 0.0, causal, scale=scale)


class _CudnnPrefixCausal(torch.autograd.Function):
    """Keys [0, p) unmasked + keys [p, sk) square-causal, p = sk - sq; see the module docstring."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        p = k.size(2) - q.size(2)
        out_pre, lse_pre, aux_pre = _cudnn_forward(q, k[:, :, :p], v[:, :, :p], False, scale)
        out_diag, lse_diag, aux_diag = _cudnn_forward(q, k[:, :, p:], v[:, :, p:], True, scale)
        if lse_pre.shape != (*q.shape[:3], 1):  # the private op's contract as of torch 2.11; it broadcasts below
            raise RuntimeError(f"cuDNN attention returned a log-sum-exp of shape {tuple(lse_pre.shape)}, expected "
                               f"{(*q.shape[:3], 1)}: this torch changed the op; prefix_attention.py needs updating")
        lse = torch.logaddexp(lse_pre, lse_diag)  # [b, h, sq, 1] fp32, cuDNN's own layout
        merged = out_pre.float() * (lse_pre - lse).exp() + out_diag.float() * (lse_diag - lse).exp()
        out = torch.empty_like(out_pre).copy_(merged)  # cuDNN's output layout, which its backward expects
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.aux = scale, (aux_pre, aux_diag)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        p = k.size(2) - q.size(2)
        dout = torch.empty_like(out).copy_(dout)  # the backward wants the output's strides
        dq_pre, dk_pre, dv_pre = _cudnn_backward(dout, q, k[:, :, :p], v[:, :, :p], out, lse, False, ctx.scale,
                                                 ctx.aux[0])
        dq_diag, dk_diag, dv_diag = _cudnn_backward(dout, q, k[:, :, p:], v[:, :, p:], out, lse, True, ctx.scale,
                                                    ctx.aux[1])
        return dq_pre + dq_diag, torch.cat([dk_pre, dk_diag], dim=2), torch.cat([dv_pre, dv_diag], dim=2), None
