"""Resolved config -> TransformerConfig -> this rank's GPTModel chunks (one per virtual pipeline stage).

Parameters are initialized *layout-invariantly*: every parameter is drawn in full from a generator seeded by the
run seed and the parameter's global name, then sliced for this rank. The same seed therefore gives the same model
under every TP/PP/VP/DP layout (megatron-core's own init differs across pipeline layouts), which is what lets the
parallel layouts be checked against one process, and lets a run change layout without changing its numbers.
"""
from __future__ import annotations

import math
import zlib
from typing import List

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from . import specs
from .platform import current_device
from .config import padded_vocab_size, virtual_pipeline_size


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _apex_fused_wgrad() -> bool:
    """megatron's own ColumnParallelLinear (the output layer) fuses weight-gradient accumulation only with Apex's
    fused_weight_gradient_mlp_cuda extension; TE modules have their own."""
    try:
        import fused_weight_gradient_mlp_cuda  # noqa: F401
    except ImportError:
        return False
    return True


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
    return TransformerConfig(
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
        # Fusions that need TE/Apex/CUDA only where they exist; the Litespark modules bring their own.
        apply_rope_fusion=te,
        bias_activation_fusion=False,
        masked_softmax_fusion=te,
        bias_dropout_fusion=device_type == "cuda",
        persist_layer_norm=False,  # an Apex FusedLayerNorm option; TE norms and torch norms have no such mode
        gradient_accumulation_fusion=te and device_type == "cuda" and _apex_fused_wgrad(),
        deallocate_pipeline_outputs=device_type == "cuda",
        **recompute,
        **fp8,
    )


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
            position_embedding_type="rope",
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


def global_name(model: GPTModel, name: str) -> str:
    """decoder.layers.<local index>.… -> decoder.layers.<global index>.… (the same in every pipeline layout)."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        return ".".join(parts)
    return name


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
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        gname = global_name(model, name)
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
