"""Litespark attention: GQA self-attention with RoPE, as a Megatron-Core attention module.

`LitesparkSelfAttention` keeps megatron-core's parameters and their tensor-parallel layout (so checkpoints are
interchangeable with the stock specs) but runs a short training forward: QKV projection, RoPE on q and k, core
attention, output projection. Inference with a KV cache goes through megatron-core's own path.

`LitesparkCoreAttention` is the core attention of both backends: torch's scaled_dot_product_attention with a causal
mask and grouped KV heads, which dispatches to cuDNN / flash / memory-efficient kernels and never materializes the
[b, heads, s, s] score matrix that megatron-core's DotProductAttention (and TE's unfused fallback) builds.

Context parallelism is all-gather attention (as in Llama 3's training): each CP rank holds sequence chunks i and
2*CP-1-i of 2*CP (megatron-core's load-balanced split), gathers every rank's keys and values (small under GQA: KV
heads are a fraction of the query heads), and attends its two query chunks to the keys up to their own position.
The gradient of the gathered keys and values is reduce-scattered back in the backward. It needs no attention
kernel of TE's, so CP runs on both backends, on CPU too. A query chunk's attention to the keys before and up to
it: layers/prefix_attention.py.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..kernels.qkv_rope import qkv_rope, qkv_rope_fp8_grad
from ..kernels.te_fp8 import drop_row_major_if_quantized, fp8_grad_output_quantizer, rows_of
from .elementwise import rope
from .prefix_attention import prefix_causal_attention


class LitesparkCoreAttention(MegatronModule):
    """softmax(q k^T / sqrt(d) + causal) v over [s, b, heads, d] inputs; returns [s, b, heads * d]."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 cp_comm_type: Optional[str] = None, softmax_scale: Optional[float] = None,
                 pg_collection=None, **unused):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"LitesparkCoreAttention supports causal masks only, got {attn_mask_type}")
        self.cp_group = None
        if config.context_parallel_size > 1:
            self.cp_group = pg_collection.cp if pg_collection is not None else \
                parallel_state.get_context_parallel_group()
        self.dropout = config.attention_dropout
        kv_channels = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(kv_channels)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        if packed_seq_params is not None:
            raise ValueError("packed sequences need the te backend")
        if attention_bias is not None:
            raise ValueError("attention bias is not supported by LitesparkCoreAttention")
        if self.cp_group is not None:
            return self._context_parallel_forward(query, key, value)
        s, b = query.size(0), query.size(1)
        return self._attend(query, key, value).permute(2, 0, 1, 3).reshape(s, b, -1)

    def _attend(self, query, key, value):
        """Causal attention of [sq, b, h, d] queries that are the last sq positions of [sk, b, hk, d] keys/values
        (sk >= sq): the causal diagonal is aligned to the end of the keys. Returns [b, h, sq, d]."""
        # [s, b, h, d] -> [b, h, s, d]; SDPA repeats the grouped KV heads internally (no copy).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout = self.dropout if self.training else 0.0
        if k.size(2) != q.size(2):  # the queries are the last positions: the causal diagonal is bottom-right
            return prefix_causal_attention(q, k, v, self.softmax_scale, dropout)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale, dropout_p=dropout,
                                              enable_gqa=q.size(1) != k.size(1))

    def _context_parallel_forward(self, query, key, value):
        cp, rank = self.cp_group.size(), self.cp_group.rank()
        s, b = query.size(0), query.size(1)
        c = s // 2  # this rank holds global chunks `rank` and `2*cp-1-rank`, c positions each
        # One all-gather for keys and values (autograd: reduce-scatter of their gradients in the backward).
        kv = gather_from_sequence_parallel_region(torch.cat([key, value], dim=-1), group=self.cp_group)
        # Gathered in rank order (rank r's chunks r, 2cp-1-r); put the chunks in sequence order: the first halves
        # of the ranks in rank order, then their second halves in reverse. One copy, from views (an index tensor
        # built on the GPU would copy from the host and synchronize the stream in every layer).
        per_rank = kv.view(cp, 2, c, *kv.shape[1:])
        kv = torch.cat([*per_rank[:, 0], *reversed(per_rank[:, 1].unbind(0))])
        key, value = kv.split([key.size(-1), value.size(-1)], dim=-1)
        outs = [self._attend(q_chunk, key[: (chunk + 1) * c], value[: (chunk + 1) * c])
                for q_chunk, chunk in ((query[:c], rank), (query[c:], 2 * cp - 1 - rank))]
        return torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(s, b, -1)


ROPE_KERNELS = ("default", "litespark", "litespark-fp8-grad")


class LitesparkSelfAttention(SelfAttention):
    """Causal self-attention with the training forward written out; see the module docstring."""

    def __init__(self, config, submodules, layer_number: int, attn_mask_type=AttnMaskType.causal,
                 cp_comm_type: Optional[str] = None, pg_collection=None, rope_kernel: str = "default", **unused):
        """rope_kernel "litespark" (--litespark-rope): the QKV output split and rotated by Litespark's kernels
        (kernels/qkv_rope.py); "litespark-fp8-grad" (--litespark-rope-fp8-grad): the same, and where the QKV GEMM
        runs in FP8 under delayed scaling the backward writes its FP8 output gradient; "default": megatron-core's
        split and RoPE (TE's fused kernel where configured)."""
        if rope_kernel not in ROPE_KERNELS:
            raise ValueError(f"unknown RoPE kernel '{rope_kernel}'; choose one of {', '.join(ROPE_KERNELS)}")
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.rope_kernel = rope_kernel
        self.rope_fp8_grad_ran = False  # the last forward's gradient is written in FP8 (the run's health record)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, attention_bias=None, packed_seq_params=None, **kwargs):
        if inference_context is not None or kwargs.get("inference_params") is not None:
            return super().forward(hidden_states, attention_mask, key_value_states=key_value_states,
                                   inference_context=inference_context, rotary_pos_emb=rotary_pos_emb,
                                   attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                                   **kwargs)
        if self.rope_kernel != "default" and rotary_pos_emb is not None:
            if packed_seq_params is not None:
                raise ValueError("--litespark-rope with packed sequences: the kernel rotates one sequence per sample; "
                                 "drop the flag for packed data")
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            heads_per_group = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
            if self.rope_kernel == "litespark-fp8-grad":
                query, key, value = self._rows_and_rotate(hidden_states, q_freqs, k_freqs, heads_per_group)
            else:
                mixed, _ = self.get_query_key_value_tensors(hidden_states, split_qkv=False)
                query, key, value = qkv_rope(mixed, q_freqs, k_freqs, heads_per_group)
        else:
            query, key, value = self._split_and_rotate(hidden_states, rotary_pos_emb, packed_seq_params)
        # an FP8 norm's output (layers/norm.py): the QKV GEMM keeps it for its weight gradient, which reads only the
        # column-major layout
        drop_row_major_if_quantized(hidden_states)
        return self._attend(query, key, value, attention_mask, attention_bias, packed_seq_params)

    def _rows_and_rotate(self, hidden_states, q_freqs, k_freqs, heads_per_group: int):
        """The QKV GEMM on [tokens, hidden] rows (a view; an FP8 norm's output keeps both layouts), then Litespark's
        split + RoPE, whose backward writes the GEMM's FP8 output gradient in both layouts where the GEMM runs in FP8
        under delayed scaling (TE keeps a gradient's column-major layout only where its shape is the output's)."""
        batch, groups = hidden_states.size(1), self.num_query_groups_per_partition
        rows = rows_of(hidden_states)
        mixed, _ = self.linear_qkv(rows)
        drop_row_major_if_quantized(rows)
        quantizer = fp8_grad_output_quantizer(self.linear_qkv) if mixed.is_cuda else None
        self.rope_fp8_grad_ran = quantizer is not None
        if quantizer is not None:
            return qkv_rope_fp8_grad(mixed, batch, groups, q_freqs, k_freqs, heads_per_group, quantizer)
        mixed = mixed.view(mixed.size(0) // batch, batch, groups, mixed.size(1) // groups)
        return qkv_rope(mixed, q_freqs, k_freqs, heads_per_group)

    def _split_and_rotate(self, hidden_states, rotary_pos_emb, packed_seq_params):
        """megatron-core's split of the QKV output, then RoPE (TE's fused kernel where configured)."""
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            cu_seqlens = None if packed_seq_params is None else packed_seq_params.cu_seqlens_q
            cp_group = self.pg_collection.cp
            query = rope(query, q_freqs, self.config, cu_seqlens=cu_seqlens, cp_group=cp_group)
            key = rope(key, k_freqs, self.config, cu_seqlens=cu_seqlens, cp_group=cp_group)
        # Key and value (under MHA the query too) are views of the QKV projection's one output buffer. Saved for the
        # backward as views, they would keep all of it alive: with RoPE the pre-RoPE query and key, 2 (h + hk) d
        # bytes per token and layer (llama-3b: 3.5 GiB at micro-batch 4). A copy of the views frees it, as TE's
        # attention does by copying its inputs; RoPE's outputs are no views, for them this is a no-op.
        return tuple(t.contiguous() for t in (query, key, value))

    def _attend(self, query, key, value, attention_mask, attention_bias, packed_seq_params):
        if self.checkpoint_core_attention and self.training:
            context = self._checkpointed_attention_forward(
                query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        else:
            context = self.core_attention(query, key, value, attention_mask, attn_mask_type=self.attn_mask_type,
                                          attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            context = context.reshape(context.size(0), 1, -1)
        return self.linear_proj(context)
