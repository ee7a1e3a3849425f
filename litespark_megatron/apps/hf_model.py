"""HF transformers' Llama of the trainer's shape, its optimizer as megatron-core sets one up, and random tokens: the
model every HF baseline trains (the benchmark's hf-* systems on one GPU, `hf_parallel` under torch's DDP or FSDP2).

transformers is imported only when a model is built: it is not a dependency of the trainer.
"""
from __future__ import annotations

from ..errors import UserError


def hf_config_kwargs(args) -> dict:
    """LlamaConfig keywords for the resolved litespark shape (same layers, widths, heads, vocab, RoPE base)."""
    return dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.ffn_hidden_size,
                num_hidden_layers=args.num_layers, num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_query_groups if args.group_query_attention else args.num_attention_heads,
                head_dim=args.hidden_size // args.num_attention_heads,
                hidden_act="silu", max_position_embeddings=max(args.max_position_embeddings, args.seq_length),
                rms_norm_eps=args.layernorm_epsilon, initializer_range=args.init_method_std,
                tie_word_embeddings=not args.untie_embeddings_and_output_weights, attention_bias=False,
                mlp_bias=False, attention_dropout=args.attention_dropout, use_cache=False)


def build_hf_llama(args, cuda: bool, device):
    """HF LlamaForCausalLM of the resolved litespark shape, SDPA attention, initialized on `device` in bf16 (fp32
    on the CPU)."""
    import torch

    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise UserError(f"the HF systems need HuggingFace transformers, not importable here ({e}): "
                        "pip install transformers") from None
    import inspect

    kwargs = hf_config_kwargs(args)
    # transformers 5 takes RoPE settings as rope_parameters; 4.x as rope_theta.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": float(args.rotary_base)}
    else:
        kwargs["rope_theta"] = float(args.rotary_base)
    config = LlamaConfig(attn_implementation="sdpa", **kwargs)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(args.seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        # Built and initialized directly on the GPU in its dtype: a 3B model built on the CPU in fp32 first would
        # take 14 GB of host memory and a slow CPU init.
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    theta = (getattr(model.config, "rope_parameters", None) or {}).get("rope_theta",
                                                                       getattr(model.config, "rope_theta", None))
    attn = getattr(model.config, "_attn_implementation", None)
    wrong = [f"{p.dtype}/{p.device}" for p in model.parameters() if p.dtype != dtype or p.device.type != device.type]
    if float(theta) != float(args.rotary_base) or attn != "sdpa" or wrong:
        raise RuntimeError(f"HF model not as configured: rope_theta {theta}, attention {attn}, "
                           f"parameters {sorted(set(wrong))[:3]}")
    return model


def hf_adamw(model, lr: float, weight_decay: float, betas, eps: float, cuda: bool):
    """torch's AdamW for an HF model as megatron-core sets up its own: no weight decay on the norms (1-D
    parameters); fused on a GPU."""
    import torch

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps,
                             **({"fused": True} if cuda else {}))


def iter_token_batches(count: int, global_batch_size: int, seq_length: int, vocab_size: int, seed: int):
    """`count` global batches of (global_batch_size, seq_length + 1) random tokens, uniform over the vocabulary,
    drawn one at a time on the CPU (as a data loader hands them over): the same sequence for every system."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        yield torch.randint(0, vocab_size, (global_batch_size, seq_length + 1), generator=g)


def token_batches(count: int, global_batch_size: int, seq_length: int, vocab_size: int, seed: int):
    """iter_token_batches' batches, all made before timing starts."""
    return list(iter_token_batches(count, global_batch_size, seq_length, vocab_size, seed))
