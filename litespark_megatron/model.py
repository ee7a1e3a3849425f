"""Resolved config -> TransformerConfig -> this rank's GPTModel chunks (one per virtual pipeline stage).

Parameters are initialized *layout-invariantly*: every parameter is drawn in full from a generator seeded by the
run seed and the parameter's global name, then sliced for this rank. The same seed therefore gives the same model
under every TP/PP/VP/DP layout (megatron-core's own init differs across pipeline layouts), which is what lets the
parallel layouts be checked against one process, and lets a run change layout without changing its numbers.
"""
from __future__ import annotations

import math
import re
import zlib
from typing import List

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from . import specs
from .layers.kernels import te_rope_available
from .platform import current_device, provide_wgrad_accumulation_kernel
from .config import padded_vocab_size, virtual_pipeline_size


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def transformer_config(args, backend: str, device_type: str) -> TransformerConfig:
    # Transformer Engine modules are in the layer only with these specs; fusions below follow the modules in use.
    te = args.spec == "stock-te" or (args.spec == "litespark" and backend == "te")
    dtype = params_dtype(args)
    vp = virtual_pipeline_size(args)
    recompute = {}
    if args.recompute_granularity:
        recompute = dict(recompute_granularity=args.recompute_granularity)
        if args.recompute_granularity == "full":
            recompute.update(recompute_method=args.recompute_method or "uniform",
                             recompute_num_layers=args.recompute_num_layers or 1)
    fp8 = {}
    if args.fp8_format:
        fp8 = dict(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe)
    arch = architecture_fields(args)
    config_class = MLATransformerConfig if args.multi_latent_attention else TransformerConfig
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        attention_dropout=args.attention_dropout,
        hidden_dropout=args.hidden_dropout,
        init_method_std=args.init_method_std,
        # megatron-core's init also tags tensor-parallel parameters (partition dim, stride), which grad-norm and
        # our layout-invariant init (below, it overwrites the values) rely on: keep it.
        perform_initialization=True,
        use_cpu_initialization=device_type == "cpu",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=args.bf16,
        fp16=args.fp16,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        # Interleaved schedules with batched p2p match sends to the wrong receives when prev == next peer
        # (PP=2; Megatron-LM issues #750, #1450): unbatched, overlapped p2p is correct and is Megatron-LM's default.
        batch_p2p_comm=vp is None,
        overlap_p2p_comm=vp is not None,
        # Loss is summed over tokens and divided by the global token count: every layout reduces the same way.
        calculate_per_token_loss=True,
        # Fusions that need TE/Apex/CUDA only where they exist. RoPE: TE's kernel wherever TE is installed, with
        # every spec (megatron-core calls it from its own RoPE function); the Litespark layer runs a compiled one on
        # GPUs without TE (layers/kernels.py). MLA's fused RoPE kernel implements YaRN only; its plain RoPE runs
        # unfused.
        apply_rope_fusion=args.rope_fusion and not args.multi_latent_attention and device_type == "cuda"
        and te_rope_available(),
        bias_activation_fusion=False,
        masked_softmax_fusion=te,
        bias_dropout_fusion=device_type == "cuda",
        persist_layer_norm=False,  # an Apex FusedLayerNorm option; TE norms and torch norms have no such mode
        # TE's linears fuse it natively; megatron-core's own (the output layer, the local backends) through Apex's
        # kernel or, without Apex, TE's GEMM (platform.provide_wgrad_accumulation_kernel). Neither: unfused.
        gradient_accumulation_fusion=device_type == "cuda" and args.gradient_accumulation_fusion
        and provide_wgrad_accumulation_kernel() is not None,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
        deallocate_pipeline_outputs=device_type == "cuda",
        **recompute,
        **fp8,
        **arch,
    )


def _aux_loss_correction(args) -> int:
    """megatron-core 0.16.1 scales the MoE load-balancing loss's gradient (with calculate_per_token_loss) by the
    tokens of the router's input on this rank (TopKRouter.attach_and_log_load_balancing_loss), but divides all
    gradients by the tokens of the whole sequence. Under sequence parallelism the router sees 1/TP of the sequence,
    under context parallelism 1/CP of it, so its gradient comes out TP x CP times too small (a TP2+SP run then
    trains a different model than one process). Scaling the coefficient by TP x CP restores the single-process
    gradient; the aux loss megatron-core tracks is divided by the coefficient again, so it is unchanged."""
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return tp * args.context_parallel_size


def architecture_fields(args) -> dict:
    """The TransformerConfig / MLATransformerConfig fields of the MoE MLP and the MLA attention (none when dense GQA)."""
    fields = dict(expert_model_parallel_size=args.expert_model_parallel_size)
    if args.num_experts:
        fields.update(
            num_moe_experts=args.num_experts,
            moe_router_topk=args.moe_router_topk,
            moe_router_pre_softmax=args.moe_router_pre_softmax,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
            moe_aux_loss_coeff=args.moe_aux_loss_coeff * _aux_loss_correction(args),
            moe_token_dispatcher_type=args.moe_token_dispatcher_type,
            moe_grouped_gemm=args.moe_grouped_gemm,
        )
    if args.multi_latent_attention:
        fields.update(
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_head_dim=args.qk_head_dim,
            qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
            v_head_dim=args.v_head_dim,
            # Plain RoPE at the preset's base, like the GQA models it is compared with (MLATransformerConfig's
            # default is DeepSeek's YaRN long-context extension, scaling factor 40).
            rope_type="rope",
            rotary_base=args.rotary_base,
        )
    return fields


def build_model(args, config: TransformerConfig, backend: str, vocab_size: int) -> List[GPTModel]:
    """This rank's model chunks, initialized layout-invariantly from args.seed."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    vp = virtual_pipeline_size(args)
    chunks = []
    for vp_stage in range(vp or 1):
        stage = vp_stage if vp else None
        first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=specs.block_spec(args.spec, backend, config, vp_stage=stage, pp_rank=pp_rank),
            vocab_size=padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by),
            max_sequence_length=args.max_position_embeddings,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_base=args.rotary_base,
            vp_stage=stage,
        )
        chunks.append(model)
    device = current_device()
    for model in chunks:
        model.to(device)
        init_layout_invariant(model, config, args.seed)
    return chunks


# --------------------------------------------------------------------------------------------- initialization
_NORM_SUFFIXES = ("layernorm.weight", "layer_norm_weight", "final_layernorm.weight")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.*)$")


def global_name(model: GPTModel, name: str) -> str:
    """The parameter's name in the whole model, the same in every layout and backend:
    decoder.layers.<local index>.… -> decoder.layers.<global index>.… (pipeline stages), and experts by their
    global index (expert_global_name)."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        name = ".".join(parts)
    if model.config.num_moe_experts and ".mlp.experts." in name:
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        name = expert_global_name(name, parallel_state.get_expert_model_parallel_rank(),
                                  model.config.num_moe_experts // ep_size)
    return name


def expert_global_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """An expert parameter as mlp.experts.local_experts.<global expert>.…: expert-parallel rank r holds experts
    r * local + i, and TEGroupedMLP's `linear_fc1.weight<i>` is local expert i's `linear_fc1.weight`. Other names
    are returned unchanged."""
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        prefix, linear, kind, local = grouped.groups()
        name = f"{prefix}.local_experts.{local}.{linear}.{kind}"
    sequential = _SEQUENTIAL_EXPERT.match(name)
    if sequential:
        prefix, local, rest = sequential.groups()
        name = f"{prefix}.local_experts.{ep_rank * num_local_experts + int(local)}.{rest}"
    return name


def is_expert(gname: str) -> bool:
    return ".mlp.experts.local_experts." in gname


def _tp_layout(name: str, param: torch.Tensor, config: TransformerConfig):
    """(partition dim, stride) of a tensor-parallel parameter, or None if it is replicated across TP."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim = getattr(param, "partition_dim", 0)
    # GLU fc1 shards are [gate_r; up_r]: a stride-2 split of the full [gate; up] (also for TE's fc1).
    stride = 2 if name.endswith("linear_fc1.weight") and config.gated_linear_unit else \
        getattr(param, "partition_stride", 1)
    return dim, stride


def _shard(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)


@torch.no_grad()
def init_layout_invariant(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Norm weights (input/pre-MLP/final, MLA's q_layernorm and kv_layernorm, TE's fused layer_norm_weight) are 1,
    biases 0, everything else (projections, MLA's down/up projections, the MoE router, experts, embeddings) is
    N(0, init_method_std), residual output projections scaled by 1/sqrt(2 L)."""
    dense_tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
    expert_tp = dense_tp
    if config.num_moe_experts:
        # Experts are split over the expert-tensor-parallel group (megatron-core: the TP size unless set apart).
        expert_tp = (parallel_state.get_expert_tensor_parallel_rank(),
                     parallel_state.get_expert_tensor_parallel_world_size())
    for name, param in model.named_parameters():
        gname = global_name(model, name)
        tp_rank, tp_size = expert_tp if is_expert(gname) else dense_tp
        if gname.endswith(_NORM_SUFFIXES):
            param.fill_(1.0)
            continue
        if gname.endswith("bias"):
            param.zero_()
            continue
        layout = _tp_layout(gname, param, config)
        full_shape = list(param.shape)
        if layout:
            full_shape[layout[0]] *= tp_size
        std = config.init_method_std
        if gname.endswith(_OUTPUT_PROJECTIONS):
            std /= math.sqrt(2.0 * config.num_layers)  # GPT-2 / Megatron scaled init of residual projections
        generator = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
        full = torch.empty(full_shape, dtype=torch.float32, device=param.device).normal_(0.0, std,
                                                                                         generator=generator)
        shard = _shard(full, layout[0], layout[1], tp_rank, tp_size) if layout else full
        param.copy_(shard.to(param.dtype))
