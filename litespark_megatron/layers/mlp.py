"""Litespark MLP: the Llama SwiGLU feed-forward, fc2(silu(gate) * up), as a Megatron-Core MLP module.

The gate and up projections are one GEMM (megatron-core's `linear_fc1` with the GLU layout: each TP rank holds
[gate_r; up_r]), the SwiGLU is one fused elementwise kernel (see elementwise.py), and fc2 is a row-parallel GEMM.
On the te backend fc1 also carries the pre-MLP RMSNorm (TE's LayerNormLinear), so norm + fc1 is one module.
Parameters and their layout are megatron-core's, so checkpoints are interchangeable with the stock specs.

With --litespark-swiglu (the FP8 default on a GPU), under FP8 (TE's delayed scaling) the SwiGLU is Litespark's
(kernels/swiglu_fp8.py): it writes fc2's FP8 input, and in the backward fc1's FP8 output gradient, in both layouts
in one pass, so neither GEMM casts a bf16 tensor again; after fc2's forward only the column-major copy its weight
gradient reads is kept. The MLP then runs on [tokens, hidden] rows (a view): TE keeps a gradient's column-major
layout only where its shape stays the same.

With --use-transformer-engine-op-fuser (te backend) the same modules run as one sequence of Transformer Engine ops
(`fused_mlp_class`, megatron-core's TEFusedMLP): TE then hands each op the next GEMM's quantizer, so under FP8 the
norm and the SwiGLU write fc1's and fc2's FP8 inputs themselves instead of a bf16 tensor cast again.
"""
from __future__ import annotations

import functools

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from ..kernels.swiglu_fp8 import swiglu_fp8_path, swiglu_to_fp8
from ..kernels.te_fp8 import (delayed_scaling_fp8, drop_row_major, drop_row_major_if_quantized,
                              fp8_grad_output_quantizer, module_quantizer, rows_of)
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
    def __init__(self, *args, swiglu: str = "default", **kwargs):
        """swiglu "default": Transformer Engine's SwiGLU where TE is installed (elementwise.py); "litespark"
        (--litespark-swiglu): Litespark's FP8 SwiGLU where fc1 and fc2 run in FP8 under delayed scaling, the
        default elsewhere (a layer kept in BF16, a CPU)."""
        if swiglu not in ("default", "litespark"):
            raise ValueError(f"unknown SwiGLU kernel '{swiglu}'; choose 'default' or 'litespark'")
        super().__init__(*args, **kwargs)
        self.swiglu = swiglu
        self.swiglu_ran = None  # what the last forward ran, with --litespark-swiglu (the run's health record)

    def forward(self, hidden_states, **unused):
        # TransformerLayer also passes padding_mask=...; padding is handled by the loss mask, not here.
        # (an FP8 norm's output, layers/norm.py: fc1 keeps it for its weight gradient, which reads only the
        # column-major layout)
        if self.swiglu == "default":
            gate_up, _ = self.linear_fc1(hidden_states)
            drop_row_major_if_quantized(hidden_states)
            return self.linear_fc2(elementwise.swiglu(gate_up))
        shape = hidden_states.shape
        rows = rows_of(hidden_states)
        gate_up, _ = self.linear_fc1(rows)
        drop_row_major_if_quantized(rows)
        quantizers = fp8_swiglu_quantizers(self.linear_fc1, self.linear_fc2) if gate_up.is_cuda else None
        if quantizers:
            activation = swiglu_to_fp8(gate_up, *quantizers)
            self.swiglu_ran = "litespark-fp8" + ("" if swiglu_fp8_path("cuda") == "litespark" else " (reference)")
        else:  # this layer's GEMMs are not in FP8 under delayed scaling
            activation = elementwise.swiglu(gate_up)
            self.swiglu_ran = elementwise.swiglu_impl(gate_up.device.type)
        out, bias = self.linear_fc2(activation)
        if quantizers:
            # fc2 keeps its input for the weight gradient, which reads the column-major layout only: TE drops the
            # row-major data of inputs it quantized itself, and of this one it keeps what it was handed.
            drop_row_major(activation)
        return out.view(*shape[:-1], out.size(-1)), bias


def fp8_swiglu_quantizers(fc1, fc2):
    """(fc2's input quantizer, fc1's output-gradient quantizer) where both GEMMs run in FP8 under delayed scaling
    (Transformer Engine's Float8Quantizer: a scale to read, an amax to max into), else None: BF16, a layer megatron
    keeps in BF16 (--first-last-layers-bf16), another recipe, the local backend. Called after fc1's forward, which
    set fc1's up; fc2's FP8 state is set up here as its own forward would (the call is idempotent)."""
    if not hasattr(fc2, "init_fp8_metadata") or not delayed_scaling_fp8():
        return None
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer
    import transformer_engine_torch as tex

    fc2.init_fp8_metadata()
    found = (module_quantizer(fc2, "scaling_fwd", tex.FP8FwdTensors.GEMM1_INPUT), fp8_grad_output_quantizer(fc1))
    return found if all(isinstance(q, Float8Quantizer) for q in found) else None


@functools.lru_cache(maxsize=None)
def fused_mlp_class() -> type:
    """The Litespark MLP run by Transformer Engine's op fuser: megatron-core's TEFusedMLP (fc1 a TE norm+linear,
    fc2 a TE linear, the same parameters and keys) behind the Litespark MLP's constructor. Built on first use: the
    class exists only where TE imports."""
    from megatron.core.extensions.transformer_engine import TEFusedMLP

    return type("LitesparkFusedMLP", (_LlamaMLP, TEFusedMLP), {"__module__": __name__})
