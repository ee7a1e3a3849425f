"""The model: megatron.training's GPTModelConfig from the run's arguments, with the layer spec --spec names and a
layout-invariant initialization.

Parameters are initialized *layout-invariantly*: every parameter is drawn in full from a generator seeded by the
run seed and the parameter's global name, then sliced for this rank. The same seed therefore gives the same model
under every TP/PP/VP/DP/CP/EP layout and with every spec (megatron-core's own init differs across pipeline
layouts), which is what lets the parallel layouts be checked against one process, lets a run change layout
without changing its numbers, and lets Litespark and stock start from the same weights. It runs as a pre-wrap
hook, before megatron.training moves, wraps and (with --load) overwrites the parameters.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

from .layout_invariant import global_name, is_expert, parameter_generator, shard


def model_config_from_args(args):
    """Megatron-LM's GPTModelConfig for these arguments (its own derivation: layer sizes, fusions, precision,
    vocabulary padding), with the layout-invariant initialization added as a pre-wrap hook."""
    from megatron.training.argument_utils import gpt_config_from_args

    model_config = gpt_config_from_args(args)
    bound = {}  # what the Litespark spec takes from litespark-train's own flags
    if getattr(args, "attention_variant", "dense") == "nsa":
        from .layers.nsa import NSASettings

        bound["nsa"] = NSASettings(args.nsa_block_size, args.nsa_selected_blocks, args.nsa_window)
    if getattr(args, "core_attention", "sdpa") != "sdpa":
        bound["core_attention"] = args.core_attention
    if getattr(args, "litespark_rmsnorm", False):
        bound["norm"] = "litespark"
    if getattr(args, "litespark_rope", False):
        bound["rope"] = "litespark-fp8-grad" if getattr(args, "litespark_rope_fp8_grad", False) else "litespark"
    if getattr(args, "litespark_swiglu", False):
        bound["swiglu"] = "litespark"
    if getattr(args, "peft", None) in ("lora", "dora"):
        bound["adapters"] = True  # te: the norms before the adapted linears become modules of their own
    if bound:
        from .specs import litespark_layer_spec

        model_config.transformer_layer_spec = functools.partial(litespark_layer_spec, **bound)
    seed = args.seed
    model_config.pre_wrap_hooks.append(lambda chunks: _init_chunks(chunks, seed))
    vocab = _unpadded_vocab(args)
    model_config.pre_wrap_hooks.append(lambda chunks: mask_padded_vocab(chunks, vocab))
    if getattr(args, "litespark_rmsnorm", False) and args.fp8 and args.transformer_impl == "transformer_engine":
        model_config.pre_wrap_hooks.append(link_fp8_norms)
    if getattr(args, "peft", None):
        from . import peft

        peft.attach(model_config, args)  # the base loaded, adapters attached, the rest frozen (after the init)
    return model_config


def _unpadded_vocab(args) -> int:
    """The model's own vocabulary (own_vocab) with megatron.training's global tokenizer (built from the arguments),
    else --vocab-size."""
    from megatron.training.global_vars import _GLOBAL_TOKENIZER

    return own_vocab(args, _GLOBAL_TOKENIZER.vocab_size if _GLOBAL_TOKENIZER is not None else args.vocab_size)


# --------------------------------------------------------------------------------------------- vocabulary padding
def own_vocab(args, tokenizer_vocab: Optional[int]) -> Optional[int]:
    """The model's rows before Megatron-LM pads them: the tokenizer's vocabulary, unless the arguments give the
    model's size, --padded-vocab-size with --no-pad-vocab-size (what an import of a model with more rows than its
    tokenizer has tokens writes, as many published models have). Megatron-LM then builds exactly those rows, pads
    none, and all of them are the model's."""
    if not getattr(args, "pad_vocab_size", True) and getattr(args, "padded_vocab_size", None):
        return args.padded_vocab_size
    return tokenizer_vocab


def mask_padded_vocab(chunks, vocab: int):
    """Megatron-LM pads the vocabulary to a multiple of --make-vocab-size-divisible-by x TP; the padded rows are no
    tokens, yet their logits would enter the softmax of the loss (and of sampling). Their logits are set to -inf
    in the output layer, so the loss is the unpadded model's: the loss of a HF model imported here equals
    transformers', whatever TP pads. `vocab` is the model's own vocabulary (own_vocab): rows of the model beyond
    its tokenizer's tokens are not padding. Only the ranks holding padded columns do anything, in place on those
    columns (their gradient is then 0)."""
    for chunk in chunks:
        layer = getattr(chunk, "output_layer", None) if getattr(chunk, "post_process", False) else None
        if layer is not None and vocab is not None and chunk.vocab_size > vocab:
            layer.register_forward_hook(functools.partial(_mask_logits, vocab=vocab, padded=chunk.vocab_size))
            layer.unpadded_vocab = vocab  # for the FP8 output layer, which runs the weight without the module
    return chunks


def _mask_logits(module, inputs, output, vocab: int, padded: int):
    logits = output[0]
    local = logits.size(-1)
    first = 0 if local == padded else parallel_state.get_tensor_model_parallel_rank() * local  # gathered or a slice
    start = max(vocab - first, 0)
    if start < local:
        logits.narrow(-1, start, local - start).fill_(float("-inf"))
    return output


def link_fp8_norms(chunks):
    """Each Litespark layer's two pre-norms to the GEMM their output goes to, alone (the dense attention's QKV, the
    Litespark MLP's fc1), so that under FP8 they write its FP8 input (layers/norm.py). Not linked: a norm read by
    more than a linear (NSA's input norm), or followed by anything else (MLA, an MoE router)."""
    from .layers import LitesparkMLP, LitesparkRMSNorm, LitesparkSelfAttention

    for chunk in chunks:
        for layer in getattr(getattr(chunk, "decoder", None), "layers", ()):
            for norm, owner, linear in ((layer.input_layernorm, layer.self_attention, "linear_qkv"),
                                        (layer.pre_mlp_layernorm, layer.mlp, "linear_fc1")):
                if isinstance(norm, LitesparkRMSNorm) and type(owner) in (LitesparkSelfAttention, LitesparkMLP):
                    norm.feeds(getattr(owner, linear))
    return chunks


def _init_chunks(chunks, seed: int):
    for chunk in chunks:
        init_layout_invariant(chunk, chunk.config, seed)
    return chunks


# --------------------------------------------------------------------------------------------- initialization
_NORM_SUFFIXES = ("layernorm.weight", "layer_norm_weight", "final_layernorm.weight")
_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def _tp_layout(name: str, param: torch.Tensor, config: TransformerConfig):
    """(partition dim, stride) of a tensor-parallel parameter, or None if it is replicated across TP."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim = getattr(param, "partition_dim", 0)
    # GLU fc1 shards are [gate_r; up_r]: a stride-2 split of the full [gate; up] (also for TE's fc1).
    stride = 2 if name.endswith("linear_fc1.weight") and config.gated_linear_unit else \
        getattr(param, "partition_stride", 1)
    return dim, stride


@torch.no_grad()
def init_layout_invariant(model: GPTModel, config: TransformerConfig, seed: int) -> None:
    """Norm weights (input/pre-MLP/final, MLA's q_layernorm and kv_layernorm, TE's fused layer_norm_weight) are 1
    (0 with --apply-layernorm-1p, whose norms scale by 1 + weight), biases 0, everything else (projections, MLA's
    down/up projections, the MoE router, experts, embeddings) is N(0, init_method_std), residual output
    projections scaled by 1/sqrt(2 L)."""
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
            param.fill_(0.0 if config.layernorm_zero_centered_gamma else 1.0)
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
        full = torch.empty(full_shape, dtype=torch.float32, device=param.device).normal_(
            0.0, std, generator=parameter_generator(seed, gname, param.device))
        piece = shard(full, layout[0], layout[1], tp_rank, tp_size) if layout else full
        param.copy_(piece.to(param.dtype))
