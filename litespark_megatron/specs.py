"""Layer specs: a transformer layer as data (Megatron-Core ModuleSpec trees), chosen by name.

- `litespark` (backends `local` and `te`): the project's attention and MLP (layers/) in a TransformerLayer.
- `stock-te`, `stock-local`: megatron-core's own GPT layer specs, for comparison.

Checkpoint keys. Litespark-local and stock-local have identical state-dict keys. The te backend (both specs) fuses
the pre-norms into the next GEMM, so its norm weights live at `self_attention.linear_qkv.layer_norm_weight` and
`mlp.linear_fc1.layer_norm_weight` instead of `input_layernorm.weight` and `pre_mlp_layernorm.weight`; the local
specs declare that map (`sharded_state_dict_keys_map`), so dist_checkpointing checkpoints load across all four.
"""
from __future__ import annotations

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .config import ConfigError, SPECS

LOCAL_TO_TE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}


def get_litespark_layer_spec(backend: str = "local") -> ModuleSpec:
    """ModuleSpec of a TransformerLayer made of Litespark modules. backend: "local" (runs anywhere) or "te"."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.mlp import MLPSubmodules

    from .layers import LitesparkCoreAttention, LitesparkMLP, LitesparkRMSNorm, LitesparkSelfAttention

    if backend == "te":
        from megatron.core.extensions.transformer_engine import (
            TEDotProductAttention, TELayerNormColumnParallelLinear, TERowParallelLinear)

        input_norm = pre_mlp_norm = IdentityOp  # fused into linear_qkv / linear_fc1
        qkv = fc1 = TELayerNormColumnParallelLinear
        core_attention, proj, fc2 = TEDotProductAttention, TERowParallelLinear, TERowParallelLinear
        keys_map = {}
    elif backend == "local":
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        input_norm = pre_mlp_norm = LitesparkRMSNorm
        qkv = fc1 = ColumnParallelLinear
        core_attention, proj, fc2 = LitesparkCoreAttention, RowParallelLinear, RowParallelLinear
        keys_map = dict(LOCAL_TO_TE_KEYS)
    else:
        raise ConfigError(f"unknown Litespark backend '{backend}'; choose 'local' or 'te'")

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=ModuleSpec(
                module=LitesparkSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(linear_qkv=qkv, core_attention=core_attention,
                                                   linear_proj=proj, q_layernorm=IdentityOp,
                                                   k_layernorm=IdentityOp)),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=ModuleSpec(module=LitesparkMLP, submodules=MLPSubmodules(linear_fc1=fc1, linear_fc2=fc2)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map,
        ),
    )


def get_layer_spec(spec: str, backend: str) -> ModuleSpec:
    """The layer spec named by --spec; `backend` ("te"/"local") applies to the litespark spec."""
    if spec == "litespark":
        return get_litespark_layer_spec(backend)
    if spec == "stock-te":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec()
    if spec == "stock-local":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        return get_gpt_layer_local_spec(normalization="RMSNorm")
    raise ConfigError(f"unknown --spec '{spec}'; choose one of: {', '.join(SPECS)}")


def final_norm(spec: str, backend: str):
    """The norm after the last layer: each spec's own family of modules."""
    if spec == "stock-te" or (spec == "litespark" and backend == "te"):
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if spec == "litespark":
        from .layers import LitesparkRMSNorm

        return LitesparkRMSNorm
    from megatron.core.models.gpt.gpt_layer_specs import LNImpl

    return LNImpl


def block_spec(spec: str, backend: str, config, vp_stage=None, pp_rank=None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage (and virtual stage) builds, and the final norm."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    layer = get_layer_spec(spec, backend)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=final_norm(spec, backend))
