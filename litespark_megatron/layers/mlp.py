"""Litespark MLP: the Llama SwiGLU feed-forward, fc2(silu(gate) * up), as a Megatron-Core MLP module.

The gate and up projections are one GEMM (megatron-core's `linear_fc1` with the GLU layout: each TP rank holds
[gate_r; up_r]), the SwiGLU is one fused elementwise kernel (see elementwise.py), and fc2 is a row-parallel GEMM.
On the te backend fc1 also carries the pre-MLP RMSNorm (TE's LayerNormLinear), so norm + fc1 is one module.
Parameters and their layout are megatron-core's, so checkpoints are interchangeable with the stock specs.

With --use-transformer-engine-op-fuser (te backend) the same modules run as one sequence of Transformer Engine ops
(`fused_mlp_class`, megatron-core's TEFusedMLP): TE then hands each op the next GEMM's quantizer, so under FP8 the
norm and the SwiGLU write fc1's and fc2's FP8 inputs themselves instead of a bf16 tensor cast again.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from . import elementwise


class _LlamaMLP:
    """The Litespark MLP's constructor, before either MLP class's own: a Llama MLP (SwiGLU, no biases), and
    TransformerLayer's extra keywords (pg_collection, is_mtp_layer, name) left out."""

    def __init__(self, config, submodules, is_expert: bool = False, input_size=None, ffn_hidden_size=None,
                 tp_group=None, **unused):
        if not (config.gated_linear_unit and config.activation_func is F.silu):
            raise ValueError("LitesparkMLP computes SwiGLU: it needs gated_linear_unit=True, activation silu")
        if config.add_bias_linear:
            raise ValueError("LitesparkMLP has no biases (Llama); set add_bias_linear=False")
        super().__init__(config=config, submodules=submodules, is_expert=is_expert, input_size=input_size,
                         ffn_hidden_size=ffn_hidden_size, tp_group=tp_group)


class LitesparkMLP(_LlamaMLP, MLP):
    def forward(self, hidden_states, **unused):
        # TransformerLayer also passes padding_mask=...; padding is handled by the loss mask, not here.
        gate_up, _ = self.linear_fc1(hidden_states)
        return self.linear_fc2(elementwise.swiglu(gate_up))


@functools.lru_cache(maxsize=None)
def fused_mlp_class() -> type:
    """The Litespark MLP run by Transformer Engine's op fuser: megatron-core's TEFusedMLP (fc1 a TE norm+linear,
    fc2 a TE linear, the same parameters and keys) behind the Litespark MLP's constructor. Built on first use: the
    class exists only where TE imports."""
    from megatron.core.extensions.transformer_engine import TEFusedMLP

    return type("LitesparkFusedMLP", (_LlamaMLP, TEFusedMLP), {"__module__": __name__})
