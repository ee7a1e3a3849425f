"""Layer specs: a transformer layer as data (Megatron-Core ModuleSpec trees).

`litespark_layer_spec` is what Megatron-LM's `--spec litespark_megatron.specs litespark_layer_spec` (or
litespark-train's `--spec litespark`) builds: the project's attention and MLP (layers/) in megatron-core's
TransformerLayer, on Transformer Engine modules (`--transformer-impl transformer_engine`) or megatron-core's
local ones (`--transformer-impl local`, runs anywhere, CPUs included). `--spec stock` is megatron-core's own layer.

As megatron-core's gpt_layer_specs: the backend is a spec provider (spec_providers.py: which linear, norm and core
attention fill each slot, and whether a norm lives inside the GEMM after it), and one layer body,
`litespark_layer`, builds the layer from whichever provider it is given.

Checkpoint keys. Litespark-local and stock-local have identical state-dict keys. The te backend (both specs) fuses
the pre-norms into the next GEMM, so its norm weights live at `self_attention.linear_qkv.layer_norm_weight` and
`mlp.linear_fc1.layer_norm_weight` instead of `input_layernorm.weight` and `pre_mlp_layernorm.weight`; a Litespark
layer whose norms are modules of their own there (local; te with Litespark's RMSNorm or adapters) declares that map
(`sharded_state_dict_keys_map`), so dist_checkpointing checkpoints load across all of them. With MLA the fused
norms are the latent norms (`self_attention.q_layernorm` / `kv_layernorm` -> `linear_q_up_proj` /
`linear_kv_up_proj.layer_norm_weight`); MLA's input norm and an MoE layer's pre-MLP norm are separate modules on
every backend.
"""
from __future__ import annotations

from typing import Optional

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from .errors import ConfigError
from .spec_providers import LitesparkSpecProvider, litespark_spec_provider

LOCAL_TO_TE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
# MLA on the te backend fuses its latent norms into the up projections that follow them.
MLA_LOCAL_TO_TE_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def _refuse_unbuildable(backend: str, core_attention: str, norm: str, rope: str, multi_latent_attention: bool,
                        nsa, swiglu: str = "default") -> None:
    """The option combinations no Litespark layer is built for, each with its reason."""
    if core_attention not in ("sdpa", "te"):
        raise ConfigError(f"unknown Litespark core attention '{core_attention}'; choose 'sdpa' or 'te'")
    if core_attention == "te" and backend != "te":
        raise ConfigError("the Litespark core attention 'te' (Transformer Engine's DotProductAttention) needs the te "
                          "backend (--transformer-impl transformer_engine)")
    if core_attention == "te" and nsa is not None:
        raise ConfigError("native sparse attention is its own core attention: the core attention 'te' does not "
                          "apply to it")
    if norm not in ("default", "litespark"):
        raise ConfigError(f"unknown Litespark norm '{norm}'; choose 'default' or 'litespark'")
    if rope not in ("default", "litespark", "litespark-fp8-grad"):
        raise ConfigError(f"unknown Litespark RoPE '{rope}'; choose 'default', 'litespark' or 'litespark-fp8-grad'")
    if rope != "default" and (multi_latent_attention or nsa is not None):
        raise ConfigError("Litespark's QKV split + RoPE builds the dense GQA attention's query, key and value; MLA "
                          "and native sparse attention build their own")
    if swiglu not in ("default", "litespark"):
        raise ConfigError(f"unknown Litespark SwiGLU '{swiglu}'; choose 'default' or 'litespark'")
    if swiglu == "litespark" and backend != "te":
        raise ConfigError("Litespark's FP8 SwiGLU writes Transformer Engine's FP8 tensors: it needs the te backend")
    if norm == "litespark" and multi_latent_attention:
        raise ConfigError("Litespark's RMSNorm with multi-latent attention: MLA's latent norms stay inside TE's up "
                          "projections")


def get_litespark_layer_spec(backend: str = "local", multi_latent_attention: bool = False,
                             num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                             q_lora_rank: Optional[int] = None, qk_layernorm: bool = False,
                             nsa=None, core_attention: str = "sdpa", norm: str = "default",
                             adapters: bool = False, rope: str = "default",
                             mlp_op_fuser: bool = False, swiglu: str = "default") -> ModuleSpec:
    """ModuleSpec of a TransformerLayer made of Litespark modules. backend: "local" (runs anywhere) or "te".

    core_attention "sdpa" (both backends): torch's scaled_dot_product_attention (LitesparkCoreAttention); on Hopper
    it runs cuDNN's / flash attention's fused kernels straight from torch, and under context parallelism it
    all-gathers keys and values over the CP group (see layers/attention.py). "te" (te backend): Transformer Engine's
    DotProductAttention, as the stock TE layer has it: cuDNN's fused attention on the [s, b, h, d] tensors as they
    are (no permutes), FP8 attention with fp8_dot_product_attention, TE's own context parallelism. Which kernel ran
    is observed and logged on the first step (backend_probe.py); a run whose attention fell back to an unfused kernel is
    flagged, not accepted.

    Attention: Litespark GQA/MHA/MQA self-attention, or (multi_latent_attention) megatron-core's MLASelfAttention
    with the core attention above and, with qk_layernorm (--qk-layernorm, as DeepSeek), RMSNorm latent norms (local)
    or TE's norm+linear up projections (te), as megatron-core's own MLA specs. MLP: the Litespark SwiGLU MLP,
    or (num_experts) megatron-core's MoELayer, whose experts are megatron-core SwiGLU MLPs made of the same
    linears (local: SequentialMLP; te: TEGroupedMLP with moe_grouped_gemm, else SequentialMLP of TE linears).
    nsa (layers.nsa.NSASettings): native sparse attention instead of dense attention, its gates a second
    column-parallel linear beside QKV, both reading the input norm's output (a module of its own then).
    norm "litespark" (--litespark-rmsnorm): every norm is a LitesparkRMSNorm running Litespark's kernel
    (kernels/rms_norm.py), on te a module of its own before plain TE linears, its keys mapped to the fused ones.
    rope "litespark" (--litespark-rope): the Litespark attention splits the QKV output and applies RoPE with
    Litespark's kernels (kernels/qkv_rope.py) instead of megatron-core's split and TE's RoPE; "litespark-fp8-grad"
    (--litespark-rope-fp8-grad, te) the same, its backward writing the QKV GEMM's FP8 output gradient under FP8.
    adapters (--peft lora|dora): the linears get LoRA/DoRA adapters after the model is built (peft.py), which read
    the linear's input; on te the norms before QKV and fc1 are then modules of their own (TENorm) before plain TE
    linears, their keys mapped to the fused ones, so the adapters see the normed input.
    mlp_op_fuser (--use-transformer-engine-op-fuser, te): the dense MLP runs as one sequence of Transformer Engine
    ops (layers/mlp.py), as stock's TEFusedMLP.
    swiglu "litespark" (--litespark-swiglu, te): the dense MLP's SwiGLU writes fc2's FP8 input and fc1's FP8 output
    gradient itself under FP8 (kernels/swiglu_fp8.py).
    """
    _refuse_unbuildable(backend, core_attention, norm, rope, multi_latent_attention, nsa, swiglu)
    provider = litespark_spec_provider(backend, core_attention=core_attention, norm=norm, adapters=adapters)
    return litespark_layer(provider, multi_latent_attention=multi_latent_attention, num_experts=num_experts,
                           moe_grouped_gemm=moe_grouped_gemm, q_lora_rank=q_lora_rank, qk_layernorm=qk_layernorm,
                           nsa=nsa, rope=rope, mlp_op_fuser=mlp_op_fuser, swiglu=swiglu)


def litespark_layer(provider: LitesparkSpecProvider, multi_latent_attention: bool = False,
                    num_experts: Optional[int] = None, moe_grouped_gemm: bool = False,
                    q_lora_rank: Optional[int] = None, qk_layernorm: bool = False, nsa=None,
                    rope: str = "default", mlp_op_fuser: bool = False, swiglu: str = "default") -> ModuleSpec:
    """The layer body, the same on every backend: each module comes from the provider (spec_providers.py). The
    options as get_litespark_layer_spec's, which refuses the combinations this body is not built for."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.transformer.attention import SelfAttentionSubmodules
    from megatron.core.transformer.mlp import MLPSubmodules

    from .layers import LitesparkMLP, LitesparkSelfAttention
    from .layers.mlp import fused_mlp_class

    norm = provider.layer_norm(rms_norm=True)
    fused = provider.fuse_layernorm_and_linear()
    fused_norm = IdentityOp if fused else norm  # a norm inside the GEMM that follows it is no module of its own
    # QKV and fc1: the GEMMs after the pre-norms
    normed_linear = provider.column_parallel_layer_norm_linear() if fused else provider.column_parallel_linear()
    column, row = provider.column_parallel_linear(), provider.row_parallel_linear()

    if multi_latent_attention:
        input_norm = norm  # MLA's first GEMMs (the down projections) take no fused norm
        attention = _mla_attention(provider, q_lora_rank, qk_layernorm)
    elif nsa is not None:
        from .layers.nsa import LitesparkNSACoreAttention, LitesparkNSASelfAttention, NSASelfAttentionSubmodules

        input_norm = norm  # read by two linears, QKV and the gates
        attention = ModuleSpec(module=LitesparkNSASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                               submodules=NSASelfAttentionSubmodules(
                                   linear_qkv=column, linear_gate=column, linear_proj=row,
                                   core_attention=ModuleSpec(module=LitesparkNSACoreAttention,
                                                             params={"settings": nsa}),
                                   q_layernorm=IdentityOp, k_layernorm=IdentityOp))
    else:
        input_norm = fused_norm
        attention = ModuleSpec(module=LitesparkSelfAttention,
                               params={"attn_mask_type": AttnMaskType.causal, "rope_kernel": rope},
                               submodules=SelfAttentionSubmodules(linear_qkv=normed_linear,
                                                                  core_attention=provider.core_attention(),
                                                                  linear_proj=row, q_layernorm=IdentityOp,
                                                                  k_layernorm=IdentityOp))
    if num_experts:
        pre_mlp_norm = norm  # the router and the token dispatch sit between the norm and the expert GEMMs
        mlp = get_moe_module_spec_for_backend(provider, num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm)
    else:
        pre_mlp_norm = fused_norm
        if mlp_op_fuser and not fused:
            raise ConfigError("the Litespark MLP under Transformer Engine's op fuser takes its norm inside fc1 (TE's "
                              "norm+linear): it needs the te backend, without Litespark's RMSNorm or adapters")
        if mlp_op_fuser and swiglu != "default":
            raise ConfigError("Litespark's FP8 SwiGLU with Transformer Engine's op fuser: the fused MLP runs TE's "
                              "SwiGLU op; drop one")
        mlp_module = fused_mlp_class() if mlp_op_fuser else LitesparkMLP
        mlp = ModuleSpec(module=mlp_module, params={"swiglu": swiglu} if swiglu != "default" else {},
                         submodules=MLPSubmodules(linear_fc1=normed_linear, linear_fc2=row))

    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=_te_keys_map(provider, multi_latent_attention, qk_layernorm,
                                                     nsa is not None, bool(num_experts)),
        ),
    )


def _mla_attention(provider: LitesparkSpecProvider, q_lora_rank: Optional[int], qk_layernorm: bool) -> ModuleSpec:
    """megatron-core's MLASelfAttention. Its latent norms (qk_layernorm) live inside the up projections where the
    backend has norm+linear modules (te), as in megatron-core's own MLA specs, and are norms of their own elsewhere;
    the query latent's norm exists only with query compression (q_lora_rank: megatron-core refuses one that
    nothing would use)."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules

    norm_linear = provider.column_parallel_layer_norm_linear()
    if qk_layernorm and norm_linear is not None:
        up_proj, q_norm, kv_norm = norm_linear, IdentityOp, IdentityOp
    else:
        up_proj = provider.column_parallel_linear()
        kv_norm = provider.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp
        q_norm = kv_norm if q_lora_rank else IdentityOp
    down_proj = provider.mla_down_projection()
    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=provider.column_parallel_linear(), linear_q_down_proj=down_proj,
                          linear_q_up_proj=up_proj, linear_kv_down_proj=down_proj, linear_kv_up_proj=up_proj,
                          core_attention=provider.core_attention(), linear_proj=provider.row_parallel_linear(),
                          q_layernorm=q_norm, kv_layernorm=kv_norm))


def _te_keys_map(provider: LitesparkSpecProvider, multi_latent_attention: bool, qk_layernorm: bool, nsa: bool,
                 moe: bool) -> dict:
    """The norms this layer holds as modules of their own where the te layer fuses them into the next GEMM: their
    keys -> the te layer's (sharded_state_dict_keys_map), so dist_checkpointing checkpoints load across backends.
    The te layer fuses the dense attention's input norm, MLA's latent norms (with qk_layernorm) and a dense MLP's
    pre-norm; MLA's and NSA's input norm (nothing to fuse them into, or, for NSA, two linears that read the normed
    input) and an MoE layer's pre-MLP norm are modules of their own on every backend."""
    keys = {}
    own_pre_norms = not provider.fuse_layernorm_and_linear()
    if multi_latent_attention:
        if qk_layernorm and provider.column_parallel_layer_norm_linear() is None:
            keys.update(MLA_LOCAL_TO_TE_KEYS)
    elif not nsa and own_pre_norms:
        keys["input_layernorm."] = LOCAL_TO_TE_KEYS["input_layernorm."]
    if not moe and own_pre_norms:
        keys["pre_mlp_layernorm."] = LOCAL_TO_TE_KEYS["pre_mlp_layernorm."]
    return keys


def litespark_layer_spec(model_config, vp_stage: Optional[int] = None, nsa=None, core_attention: str = "sdpa",
                         norm: str = "default", adapters: bool = False,
                         rope: str = "default", swiglu: str = "default") -> TransformerBlockSubmodules:
    """The Litespark layers this pipeline stage (and virtual stage) builds, and the final norm: the callable
    megatron.training's GPTModelConfig takes as its transformer_layer_spec. The backend follows
    --transformer-impl; model.py binds `nsa` (--attention-variant nsa: native sparse attention),
    `core_attention` (--core-attention), `norm` (--litespark-rmsnorm), `rope` (--litespark-rope), `swiglu`
    (--litespark-swiglu) and `adapters` (--peft lora|dora).

    Which layers are MoE (--moe-layer-freq, an int or a 0/1 list pattern) and which layers this stage holds
    (--pipeline-model-parallel-layout, or the even split with its uneven-first/last variants) follow megatron-core's
    get_gpt_decoder_block_spec, so a Litespark model has stock's layers, parameters and checkpoint keys."""
    from megatron.core.models.gpt.experimental_attention_variant_module_specs import get_moe_layer_pattern
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = getattr(model_config, "transformer", model_config)
    backend = "te" if config.transformer_impl == "transformer_engine" else "local"
    multi_latent_attention = bool(config.multi_latent_attention)
    _refuse_unbuildable(backend, core_attention, norm, rope, multi_latent_attention, nsa, swiglu)
    provider = litespark_spec_provider(backend, core_attention=core_attention, norm=norm, adapters=adapters)

    def layer(num_experts):
        return litespark_layer(provider, multi_latent_attention=multi_latent_attention, num_experts=num_experts,
                               moe_grouped_gemm=bool(config.moe_grouped_gemm),
                               q_lora_rank=getattr(config, "q_lora_rank", None),
                               qk_layernorm=bool(config.qk_layernorm), nsa=nsa, rope=rope,
                               mlp_op_fuser=bool(getattr(config, "use_transformer_engine_op_fuser", False)),
                               swiglu=swiglu)

    dense = layer(None)
    moe = layer(config.num_moe_experts) if config.num_moe_experts else dense  # no experts: all dense, as stock
    pattern = get_moe_layer_pattern(config)  # 1: MoE, 0: dense, one per layer of the model
    if config.pipeline_model_parallel_layout is not None:
        local = config.pipeline_model_parallel_layout.get_layer_id_list(layer_type=LayerType.decoder,
                                                                       vp_stage=vp_stage)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
        local = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage))
    return TransformerBlockSubmodules(layer_specs=[moe if pattern[i] else dense for i in local],
                                      layer_norm=provider.layer_norm(rms_norm=True))
