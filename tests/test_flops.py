"""The FLOP counter against three independent references.

1. torch's FlopCounterMode on tiny plain-torch models (dense MHA/GQA, SwiGLU/GELU, top-k MoE, MLA), forward
   plus backward. Attention is written as explicit matmuls (Q K^T, P V) with the causal mask applied by
   masking: FlopCounterMode then counts the full s x s products, which is the counter's "full" convention.
   (On CPU, FlopCounterMode does not count F.scaled_dot_product_attention at all, hence explicit matmuls.)
2. Megatron-LM's published formula, ``num_floating_point_operations`` of megatron/training/training.py,
   transcribed below from NVIDIA/Megatron-LM main at commit 001b00c2734d8f0fad096fe48a382fedf755d321: it halves
   causal attention (the counter's "half" convention; the formula of mid-2024, e.g. commit c3677e0, counted the
   full square: the "full" convention).
3. Values worked out by hand for the llama-3b and llama-30b presets.
"""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from conftest import preset
from litespark_megatron.metrics.flops import (
    MLAShape,
    ModelShape,
    MoEShape,
    PeftShape,
    flops_per_token_forward,
    layer_forward_per_sequence,
    param_count,
    recompute_from_args,
    trainable_params,
    training_flops_per_step,
)


# ----------------------------------------------------------------------------------------------------------
# 1. Plain-torch reference models, measured with FlopCounterMode
# ----------------------------------------------------------------------------------------------------------
def _causal_attention(q, k, v):
    """q: [b, n, s, dq], k: [b, n, s, dq], v: [b, n, s, dv]; explicit matmuls, masked (not skipped)."""
    s = q.shape[-2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


class GQAAttention(nn.Module):
    def __init__(self, h, n, g, d):
        super().__init__()
        self.n, self.g, self.d = n, g, d
        self.q = nn.Linear(h, n * d, bias=False)
        self.k = nn.Linear(h, g * d, bias=False)
        self.v = nn.Linear(h, g * d, bias=False)
        self.o = nn.Linear(n * d, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.n, self.d).transpose(1, 2)
        # KV heads are shared by n/g query heads: repeating them is a copy, not arithmetic.
        k = self.k(x).view(b, s, self.g, self.d).transpose(1, 2).repeat_interleave(self.n // self.g, dim=1)
        v = self.v(x).view(b, s, self.g, self.d).transpose(1, 2).repeat_interleave(self.n // self.g, dim=1)
        out = _causal_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, self.n * self.d))


class MLAttention(nn.Module):
    """Multi-latent attention laid out as megatron-core's MLASelfAttention (training path)."""

    def __init__(self, h, n, m: MLAShape):
        super().__init__()
        self.n, self.m = n, m
        qh = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, n * qh, bias=False)
        else:
            self.q_down = nn.Linear(h, m.q_lora_rank, bias=False)
            self.q_norm = nn.RMSNorm(m.q_lora_rank)
            self.q_up = nn.Linear(m.q_lora_rank, n * qh, bias=False)
        self.kv_down = nn.Linear(h, m.kv_lora_rank + m.qk_pos_emb_head_dim, bias=False)
        self.kv_norm = nn.RMSNorm(m.kv_lora_rank)
        self.kv_up = nn.Linear(m.kv_lora_rank, n * (m.qk_head_dim + m.v_head_dim), bias=False)
        self.o = nn.Linear(n * m.v_head_dim, h, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        m, n = self.m, self.n
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_up(self.q_norm(self.q_down(x)))
        q = q.view(b, s, n, m.qk_head_dim + m.qk_pos_emb_head_dim)
        kv_c, k_pos = self.kv_down(x).split([m.kv_lora_rank, m.qk_pos_emb_head_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(kv_c)).view(b, s, n, m.qk_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_head_dim, m.v_head_dim], dim=-1)
        # The rotary key part is one vector per token shared by all heads (rotation itself: elementwise).
        k = torch.cat([k_nope, k_pos.unsqueeze(2).expand(b, s, n, m.qk_pos_emb_head_dim)], dim=-1)
        out = _causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).reshape(b, s, n * m.v_head_dim))


class MLP(nn.Module):
    def __init__(self, h, f, gated):
        super().__init__()
        self.gated = gated
        self.up = nn.Linear(h, f, bias=False)
        self.gate = nn.Linear(h, f, bias=False) if gated else None
        self.down = nn.Linear(f, h, bias=False)

    def forward(self, x):
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x)))


class TopKMoE(nn.Module):
    """Router GEMM, softmax, top-k; each expert runs on the tokens routed to it only (index/gather), so the
    counted GEMMs are exactly k expert MLPs per token."""

    def __init__(self, h, f, num_experts, topk, gated, shared_size=None):
        super().__init__()
        self.topk = topk
        self.router = nn.Linear(h, num_experts, bias=False)
        self.experts = nn.ModuleList(MLP(h, f, gated) for _ in range(num_experts))
        self.shared = MLP(h, shared_size, gated) if shared_size else None

    def forward(self, x):
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        probs = torch.softmax(self.router(tokens), dim=-1)
        weights, chosen = probs.topk(self.topk, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel():
                out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot].unsqueeze(-1))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, s, h)


class RefDecoder(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        h = shape.hidden_size
        self.embed = nn.Embedding(shape.vocab_size, h)
        self.layers = nn.ModuleList()
        for i in range(shape.num_layers):
            if shape.mla is None:
                attn = GQAAttention(h, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels)
            else:
                attn = MLAttention(h, shape.num_attention_heads, shape.mla)
            if shape.is_moe_layer(i):
                moe = shape.moe
                mlp = TopKMoE(h, moe.moe_ffn_hidden_size or shape.ffn_hidden_size, moe.num_experts,
                              moe.moe_router_topk, shape.gated_linear_unit, moe.moe_shared_expert_intermediate_size)
            else:
                mlp = MLP(h, shape.ffn_hidden_size, shape.gated_linear_unit)
            self.layers.append(nn.ModuleList([nn.RMSNorm(h), attn, nn.RMSNorm(h), mlp]))
        self.norm = nn.RMSNorm(h)
        self.output = nn.Linear(h, shape.vocab_size, bias=False)
        if not shape.untie_embeddings_and_output_weights:
            self.output.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for n1, attn, n2, mlp in self.layers:
            x = x + attn(n1(x))
            x = x + mlp(n2(x))
        return self.output(self.norm(x))


def measured_training_flops(shape: ModelShape, batch: int) -> int:
    torch.manual_seed(0)
    model = RefDecoder(shape)
    ids = torch.randint(0, shape.vocab_size, (batch, shape.seq_length))
    with FlopCounterMode(display=False) as counter:
        logits = model(ids)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    return counter.get_total_flops()


def tiny(**kw) -> ModelShape:
    base = dict(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=4,
                vocab_size=128, seq_length=16)
    base.update(kw)
    return ModelShape(**base)


REFERENCE_CASES = {
    "dense-mha-swiglu": tiny(),
    "gqa-swiglu": tiny(num_query_groups=2),
    "gqa-gelu-head-dim": tiny(num_query_groups=1, kv_channels=24, gated_linear_unit=False),
    "tied-embeddings": tiny(num_query_groups=2, untie_embeddings_and_output_weights=False),
    "moe-top2": tiny(num_query_groups=2, moe=MoEShape(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)),
    "moe-shared-alternate": tiny(num_layers=3, moe=MoEShape(num_experts=3, moe_router_topk=1,
                                                            moe_shared_expert_intermediate_size=48,
                                                            moe_layer_freq=2)),
    "mla-q-lora": tiny(mla=MLAShape(q_lora_rank=24, kv_lora_rank=16, qk_head_dim=12, qk_pos_emb_head_dim=4,
                                    v_head_dim=10)),
    "mla-no-q-lora-gelu": tiny(gated_linear_unit=False, mla=MLAShape(q_lora_rank=None, kv_lora_rank=16,
                                                                     qk_head_dim=8, qk_pos_emb_head_dim=8,
                                                                     v_head_dim=16)),
}


@pytest.mark.parametrize("name", list(REFERENCE_CASES))
def test_full_convention_equals_flop_counter_mode(name):
    shape = REFERENCE_CASES[name]
    measured = measured_training_flops(shape, batch=2)
    counted = training_flops_per_step(shape, 2, causal="full").model_flops
    # Both count the same GEMMs, so they agree exactly (well inside the 1% the counter promises).
    assert counted == measured, f"{name}: counter {counted} vs FlopCounterMode {measured}"


def test_reference_sees_moe_routing():
    """Guard the MoE reference itself: if it ran every expert on every token, the test above would be
    comparing against the wrong thing. Top-2 of 4 must count half the expert GEMMs of all-4."""
    shape = REFERENCE_CASES["moe-top2"]
    all_experts = ModelShape(**{**shape.__dict__, "moe": MoEShape(num_experts=4, moe_router_topk=4,
                                                                  moe_ffn_hidden_size=32)})
    top2, top4 = measured_training_flops(shape, 2), measured_training_flops(all_experts, 2)
    expert_part = training_flops_per_step(shape, 2, causal="full").model_breakdown.experts
    assert top4 - top2 == expert_part


def test_half_convention_halves_only_the_attention_core():
    shape = REFERENCE_CASES["gqa-swiglu"]
    full = training_flops_per_step(shape, 2, causal="full")
    half = training_flops_per_step(shape, 2, causal="half")
    core_full = full.model_breakdown.attention_core
    assert half.model_breakdown.attention_core * 2 == core_full
    assert full.model_flops - half.model_flops == core_full // 2
    assert half.causal == "half" and "Megatron" in half.convention
    assert full.causal == "full" and "FlopCounterMode" in full.convention


# ----------------------------------------------------------------------------------------------------------
# 2. Megatron-LM's formula (transcribed; dense/GQA, MoE and MLA branches, no MTP/hybrid/latent MoE)
# ----------------------------------------------------------------------------------------------------------
def megatron_lm_flops(args, batch_size):
    if not args.group_query_attention:
        args.num_query_groups = args.num_attention_heads
    if args.num_experts is None:
        num_dense_layers, num_moe_layers, num_experts_routed_to = args.num_layers, 0, 0
    else:
        pattern = [1 if i % args.moe_layer_freq == 0 else 0 for i in range(args.num_layers)]
        num_moe_layers = sum(pattern)
        num_dense_layers = args.num_layers - num_moe_layers
        num_experts_routed_to = args.moe_router_topk
    num_layers = args.num_layers
    moe_ffn = args.moe_ffn_hidden_size if args.moe_ffn_hidden_size is not None else args.ffn_hidden_size
    shared = args.moe_shared_expert_intermediate_size or 0
    fb, fma = 3, 2
    ffn_factor = 3 if args.swiglu else 2
    if args.multi_latent_attention:
        if args.q_lora_rank is None:
            q_term = args.hidden_size * args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)
        else:
            q_term = args.q_lora_rank * (args.hidden_size + args.num_attention_heads
                                         * (args.qk_head_dim + args.qk_pos_emb_head_dim) + 1)
        attn = fb * fma * (
            q_term
            + args.kv_lora_rank * (args.hidden_size
                                   + args.num_attention_heads * (args.qk_head_dim + args.v_head_dim) + 1)
            + args.hidden_size * args.qk_pos_emb_head_dim
            + (args.num_attention_heads * args.v_head_dim) * args.hidden_size
            + args.seq_length * (args.num_attention_heads * (args.qk_head_dim + args.qk_pos_emb_head_dim)) / 2
            + args.seq_length * args.num_attention_heads * args.v_head_dim / 2)
    else:
        qp = args.kv_channels * args.num_attention_heads
        kp = vp = args.kv_channels * args.num_query_groups
        attn = fb * fma * (args.hidden_size * (qp + kp + vp) + qp * args.seq_length / 2 * 2 + qp * args.hidden_size)
    return batch_size * args.seq_length * (
        fb * fma * args.hidden_size * (
            args.ffn_hidden_size * ffn_factor * num_dense_layers
            + moe_ffn * num_experts_routed_to * ffn_factor * num_moe_layers
            + shared * ffn_factor * num_moe_layers)
        + attn * num_layers
        + fb * fma * args.hidden_size * args.padded_vocab_size)


def _megatron_args(name, **kw):
    p = preset(name)
    args = SimpleNamespace(
        num_layers=p.num_layers, hidden_size=p.hidden_size, ffn_hidden_size=p.ffn_hidden_size,
        num_attention_heads=p.num_attention_heads, num_query_groups=p.num_query_groups,
        group_query_attention=p.num_query_groups != p.num_attention_heads,
        kv_channels=p.hidden_size // p.num_attention_heads, seq_length=p.seq_length,
        padded_vocab_size=p.vocab_size, swiglu=True, num_experts=None, moe_router_topk=2, moe_layer_freq=1,
        moe_ffn_hidden_size=None, moe_shared_expert_intermediate_size=None, multi_latent_attention=False,
        q_lora_rank=None, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
        untie_embeddings_and_output_weights=True)
    for k, v in kw.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("preset", ["llama-3b", "llama3-8b"])
def test_half_convention_equals_megatron_lm_formula(preset):
    args = _megatron_args(preset)
    expected = megatron_lm_flops(SimpleNamespace(**vars(args)), batch_size=256)
    counted = training_flops_per_step(ModelShape.from_args(args), 256, causal="half").model_flops
    assert counted == pytest.approx(expected, rel=1e-12)


def test_moe_matches_megatron_lm_plus_router():
    # Megatron-LM leaves the router GEMM (h x num_experts) out; the counter includes it.
    args = _megatron_args("llama-3b", num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=2048,
                          moe_shared_expert_intermediate_size=4096, moe_layer_freq=2)
    shape = ModelShape.from_args(args)
    result = training_flops_per_step(shape, 4, causal="half")
    expected = megatron_lm_flops(SimpleNamespace(**vars(args)), batch_size=4)
    assert shape.num_moe_layers == 14
    assert result.model_breakdown.router == 3 * 2 * 4 * 4096 * 3072 * 8 * 14
    assert result.model_flops - result.model_breakdown.router == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("q_lora_rank", [None, 1536])
def test_mla_matches_megatron_lm_minus_norm_terms(q_lora_rank):
    # Megatron-LM adds "+1" per q/kv LoRA rank for the q/kv RMSNorms (6 x rank FLOPs per token per layer);
    # norms are not matmuls and the counter leaves every norm out.
    args = _megatron_args("llama-3b", multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=512,
                          qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, group_query_attention=False)
    tokens = 4 * args.seq_length
    shape = ModelShape.from_args(args)
    norm_terms = 6 * args.num_layers * tokens * ((q_lora_rank or 0) + 512)
    expected = megatron_lm_flops(SimpleNamespace(**vars(args)), batch_size=4) - norm_terms
    assert shape.mla.q_lora_rank == q_lora_rank
    assert training_flops_per_step(shape, 4, causal="half").model_flops == pytest.approx(expected, rel=1e-12)


# ----------------------------------------------------------------------------------------------------------
# 3. Hand-computed values for the presets
# ----------------------------------------------------------------------------------------------------------
def preset_shape(name):
    p = preset(name)
    return ModelShape(num_layers=p.num_layers, hidden_size=p.hidden_size, ffn_hidden_size=p.ffn_hidden_size,
                      num_attention_heads=p.num_attention_heads, num_query_groups=p.num_query_groups,
                      vocab_size=p.vocab_size, seq_length=p.seq_length,
                      untie_embeddings_and_output_weights=p.untie_embeddings_and_output_weights)


def test_llama_3b_by_hand():
    # L=28, h=3072, f=8192, n=24, g=8, d=128, V=128256, s=4096. Forward FLOPs per token, per layer:
    #   qkv   2*3072*(24+2*8)*128 = 31,457,280     proj 2*3072*3072 = 18,874,368
    #   mlp   2*3*3072*8192 = 150,994,944          attention core, full: 2*2*4096*24*128 = 50,331,648
    # logits 2*3072*128256 = 788,004,864.
    # full: 28*(31,457,280+18,874,368+150,994,944+50,331,648) + 788,004,864 = 7,834,435,584 -> x3 = 23,503,306,752
    # half: attention core 25,165,824 -> 7,129,792,512 -> x3 = 21,389,377,536
    shape = preset_shape("llama-3b")
    assert flops_per_token_forward(shape, "full").total == 7_834_435_584
    assert flops_per_token_forward(shape, "half").total == 7_129_792_512
    step = training_flops_per_step(shape, 512, causal="half")
    assert step.model_flops == 21_389_377_536 * 512 * 4096
    assert step.hardware_flops == step.model_flops
    assert training_flops_per_step(shape, 1, causal="full").model_flops == 23_503_306_752 * 4096
    per_token = flops_per_token_forward(shape, "half")
    assert per_token.logits == 788_004_864 and per_token.mlp == 28 * 150_994_944
    # Parameters: embedding 128256*3072 = 394,002,432 (and the untied output layer the same); per layer
    # 3072*5120 + 3072*3072 + 3*3072*8192 + 2*3072 (RMSNorms) = 100,669,440; final norm 3072.
    # Total 2*394,002,432 + 28*100,669,440 + 3072 = 3,606,752,256 (tied: 3,212,749,824 = Llama-3.2-3B's 3.21B).
    params = param_count(shape)
    assert params.total == 3_606_752_256 and params.active == params.total
    assert params.embedding == params.output_layer == 394_002_432
    tied = param_count(ModelShape(**{**shape.__dict__, "untie_embeddings_and_output_weights": False}))
    assert tied.total == 3_212_749_824
    # Tying changes parameters, not FLOPs: the logit GEMM runs either way.
    assert flops_per_token_forward(ModelShape(**{**shape.__dict__, "untie_embeddings_and_output_weights": False}),
                                   "half").total == 7_129_792_512


def test_llama_30b_by_hand():
    # L=60, h=6656, f=17920, n=g=52, d=128, V=32000, s=4096. Forward per token, per layer:
    #   qkv 2*3*6656^2 = 265,814,016    proj 2*6656^2 = 88,604,672    mlp 2*3*6656*17920 = 715,653,120
    #   attention core full 4*4096*6656 = 109,051,904 (half 54,525,952); logits 2*6656*32000 = 425,984,000.
    # full: 60*1,179,123,712 + 425,984,000 = 71,173,406,720 -> x3 = 213,520,220,160 per token
    # half: 60*1,124,597,760 + 425,984,000 = 67,901,849,600 -> x3 = 203,705,548,800 per token
    shape = preset_shape("llama-30b")
    assert training_flops_per_step(shape, 1, causal="full").model_flops_per_token == 213_520_220_160
    assert training_flops_per_step(shape, 1, causal="half").model_flops_per_token == 203_705_548_800
    # Parameters: per layer 4*6656^2 + 3*6656*17920 + 2*6656 = 535,049,216; x60 = 32,102,952,960;
    # + 2*32000*6656 + 6656 = 32,528,943,616 (LLaMA-30B's published 32.5B).
    assert param_count(shape).total == 32_528_943_616


# ----------------------------------------------------------------------------------------------------------
# Recomputation, from_args, validation
# ----------------------------------------------------------------------------------------------------------
def test_recompute_adds_forward_work_to_hardware_flops_only():
    shape = preset_shape("llama-3b")
    base = training_flops_per_step(shape, 8)
    full = training_flops_per_step(shape, 8, recompute="full")
    sel = training_flops_per_step(shape, 8, recompute="selective")
    layers_forward = (base.model_flops - base.model_breakdown.logits) // 3
    assert full.model_flops == sel.model_flops == base.model_flops
    assert full.hardware_flops - full.model_flops == layers_forward
    assert sel.hardware_flops - sel.model_flops == base.model_breakdown.attention_core // 3
    assert full.recompute_breakdown.logits == 0
    block = training_flops_per_step(shape, 8, recompute="full", recomputed_layers=range(7))
    assert block.hardware_flops - block.model_flops == layers_forward // 4


def test_recompute_from_args_block_counts_first_layers_of_each_chunk():
    args = SimpleNamespace(num_layers=28, recompute_granularity="full", recompute_method="block",
                           recompute_num_layers=2, pipeline_model_parallel_size=2,
                           num_layers_per_virtual_pipeline_stage=7)
    # 2 stages x 2 virtual chunks of 7 layers; the first 2 of each chunk: layers 0,1,7,8,14,15,21,22.
    assert recompute_from_args(args) == {"recompute": "full", "recomputed_layers": [0, 1, 7, 8, 14, 15, 21, 22]}
    args.recompute_method = "uniform"
    assert recompute_from_args(args) == {"recompute": "full", "recomputed_layers": None}
    args.recompute_granularity = "selective"
    assert recompute_from_args(args) == {"recompute": "selective"}
    args.recompute_granularity = None
    assert recompute_from_args(args) == {"recompute": None}


def test_from_args_pads_vocab_as_megatron_lm():
    from litespark_megatron import arguments, platform

    args = arguments.resolve(["--model", "llama-30b", "--vocab-size", "32001"], platform.detect())
    shape = ModelShape.from_args(args)
    assert shape.vocab_size == 32128  # padded to a multiple of 128 x TP, as Megatron-LM pads
    assert shape.num_query_groups == 52 and shape.kv_channels == 128 and shape.gated_linear_unit
    assert ModelShape.from_args(args, padded_vocab=32256).vocab_size == 32256


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_layers=0), "num_layers"),
    (dict(num_query_groups=3), "multiple of num_query_groups"),
    (dict(hidden_size=66), "give kv_channels"),
    (dict(moe=MoEShape(num_experts=4, moe_layer_freq=(1, 0, 1))), "one per layer"),
])
def test_bad_shapes_are_rejected_with_a_reason(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny(**kwargs)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="topk"):
        MoEShape(num_experts=2, moe_router_topk=3)
    with pytest.raises(ValueError, match="causal"):
        training_flops_per_step(tiny(), 1, causal="quarter")
    with pytest.raises(ValueError, match="global_batch_size"):
        training_flops_per_step(tiny(), 0)
    with pytest.raises(ValueError, match="recomputed_layers"):
        training_flops_per_step(tiny(), 1, recompute="full", recomputed_layers=[5])


# ----------------------------------------------------------------------------------------------------------
# Fine-tuning: the "peft" convention against FlopCounterMode on the reference with frozen weights and adapters
# ----------------------------------------------------------------------------------------------------------
class RefAdapted(nn.Module):
    """LoRA/DoRA on one linear as HF peft computes it (peft.tuners.lora Linear, DoraLinearLayer): A r x in, B out x r;
    DoRA's row norm of W + s B A detached, and with dropout the base GEMM again on the dropped input."""

    def __init__(self, base: nn.Linear, rank: int, dora: bool, dropout: float):
        super().__init__()
        self.base, self.dora, self.scale = base, dora, 2.0
        self.A = nn.Linear(base.in_features, rank, bias=False)
        self.B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.B.weight)
        self.drop = nn.Dropout(dropout)
        self.m = nn.Parameter(torch.ones(base.out_features)) if dora else None

    def forward(self, x):
        out, dropped = self.base(x), self.drop(x)
        delta = self.B(self.A(dropped)) * self.scale
        if not self.dora:
            return out + delta
        with torch.no_grad():
            norm = torch.linalg.vector_norm(self.base.weight + self.scale * (self.B.weight @ self.A.weight), dim=1)
        g = self.m / norm
        base_result = out if dropped is x else self.base(dropped)
        return out + (g - 1) * base_result + g * delta


# megatron-core's fused linears -> the reference's separate projections (one adapter each)
PROJECTIONS = {"linear_qkv": (("attn", "q"), ("attn", "k"), ("attn", "v")), "linear_proj": (("attn", "o"),),
               "linear_fc1": (("mlp", "gate"), ("mlp", "up")), "linear_fc2": (("mlp", "down"),)}


def peft_reference(shape: ModelShape, peft: PeftShape) -> nn.Module:
    torch.manual_seed(0)
    model = RefDecoder(shape)
    model.requires_grad_(False)
    if peft.method == "freeze":
        for layer in model.layers[shape.num_layers - peft.trainable_layers:]:
            layer.requires_grad_(True)
        return model
    for n1, attn, n2, mlp in model.layers:
        modules = {"attn": attn, "mlp": mlp}
        for target in peft.targets:
            for parent, name in PROJECTIONS[target]:
                setattr(modules[parent], name, RefAdapted(getattr(modules[parent], name), peft.rank,
                                                          peft.method == "dora", peft.dropout))
    return model


def measured_peft_flops(shape: ModelShape, peft: PeftShape, batch: int, micro_batch: int) -> int:
    model = peft_reference(shape, peft)
    ids = torch.randint(0, shape.vocab_size, (batch, shape.seq_length))
    with FlopCounterMode(display=False) as counter:
        for chunk in ids.split(micro_batch):  # one forward call per micro-batch, as the trainer's
            F.cross_entropy(model(chunk).flatten(0, 1), chunk.flatten()).backward()
    return counter.get_total_flops()


PEFT_CASES = {
    "lora-all-linears": (tiny(num_query_groups=2), PeftShape("lora", rank=4)),
    # the first two linears of every layer frozen and before any adapter: layer 0's are forward only
    "lora-fc2-only": (tiny(num_query_groups=2), PeftShape("lora", rank=3, targets=("linear_fc2",))),
    "lora-proj-gelu": (tiny(gated_linear_unit=False), PeftShape("lora", rank=2, targets=("linear_proj",))),
    "dora-dropout": (tiny(num_query_groups=2), PeftShape("dora", rank=4, dropout=0.1)),
    "dora-no-dropout-qkv": (tiny(), PeftShape("dora", rank=2, targets=("linear_qkv",))),
    "freeze-last-1": (tiny(num_layers=3, num_query_groups=2), PeftShape("freeze", trainable_layers=1)),
    "freeze-all-tied": (tiny(untie_embeddings_and_output_weights=False), PeftShape("freeze", trainable_layers=2)),
    "freeze-moe": (REFERENCE_CASES["moe-shared-alternate"], PeftShape("freeze", trainable_layers=2)),
}


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_peft_convention_equals_flop_counter_mode(name):
    shape, peft = PEFT_CASES[name]
    measured = measured_peft_flops(shape, peft, batch=4, micro_batch=2)
    counted = training_flops_per_step(shape, 4, causal="full", peft=peft, micro_batch_size=2)
    assert counted.model_flops == measured, f"{name}: counter {counted.model_flops} vs FlopCounterMode {measured}"
    assert counted.flops_convention == "peft"


@pytest.mark.parametrize("name", list(PEFT_CASES))
def test_trainable_params_are_the_references(name):
    shape, peft = PEFT_CASES[name]
    model = peft_reference(shape, peft)
    assert trainable_params(shape, peft) == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_the_reference_freezes_what_it_should():
    """Guard the references: frozen weights cost less than training everything, adapters more than nothing."""
    shape = tiny(num_query_groups=2)
    full = measured_training_flops(shape, 4)
    assert measured_peft_flops(shape, PeftShape("freeze", trainable_layers=1), 4, 4) < full
    lora = PeftShape("lora", rank=4)
    assert measured_peft_flops(shape, lora, 4, 4) != training_flops_per_step(shape, 4, causal="full").model_flops


def test_peft_convention_by_hand_on_a_tiny_shape():
    """2 layers, h 8, f 16 (SwiGLU), 2 heads of 4, 1 KV group, vocabulary 32, s 4, one sequence; full attention.
    Per token: qkv 8 x (8 + 4 + 4) = 128 weights, proj 64, fc1 256, fc2 128; attention core 2 x (2 s n d) = 128
    FLOPs forward; logits 8 x 32 = 256 weights."""
    shape = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=1,
                       vocab_size=32, seq_length=4)
    s, qkv, proj, fc1, fc2, core, logits = 4, 128, 64, 256, 128, 128, 256
    layer_weights = qkv + proj + fc1 + fc2
    # standard: 3 x (2 x weights + core) per token
    assert training_flops_per_step(shape, 1, causal="full").model_flops == \
        s * 3 * (2 * 2 * layer_weights + 2 * core + 2 * logits)
    # freeze, last layer trains: layer 0 forward only, layer 1 all of it, the output layer forward + input gradient
    freeze = training_flops_per_step(shape, 1, causal="full", peft=PeftShape("freeze", trainable_layers=1))
    assert freeze.model_flops == s * ((2 * layer_weights + core) + 3 * (2 * layer_weights + core) + 2 * 2 * logits)
    # LoRA rank 2 on fc2 alone: layer 0 forward only up to its fc2, whose A has no input gradient; then everything
    # frozen gets its input gradient (4 per weight) and the attention core its backward; each adapter: A 2 x 16,
    # B 8 x 2
    a, b = 2 * 16, 8 * 2
    lora = training_flops_per_step(shape, 1, causal="full",
                                   peft=PeftShape("lora", rank=2, targets=("linear_fc2",)))
    layer0 = 2 * (qkv + proj + fc1) + core + 2 * fc2 + 4 * a + 6 * b
    layer1 = 4 * layer_weights + 3 * core + 6 * a + 6 * b
    assert lora.model_flops == s * (layer0 + layer1 + 4 * logits)
    assert lora.model_breakdown.adapters == s * (4 * a + 6 * b + 6 * a + 6 * b)
    assert trainable_params(shape, PeftShape("lora", rank=2, targets=("linear_fc2",))) == 2 * (a + b)


def test_peft_recompute_adds_the_forward_and_the_embeddings_gradient():
    """Full recompute under --peft: the embedding's output needs a gradient (peft.apply), so frozen layers below
    the lowest trainable one run their input gradients too; the recomputed forward includes the adapters'."""
    shape = tiny(num_layers=3, num_query_groups=2)
    freeze = PeftShape("freeze", trainable_layers=1)
    plain = training_flops_per_step(shape, 2, causal="full", peft=freeze)
    full = training_flops_per_step(shape, 2, causal="full", peft=freeze, recompute="full")
    layer = layer_forward_per_sequence(shape, 0, "full").scaled(2)
    below = 2 * (layer.total - layer.attention_core) + 3 * layer.attention_core - layer.total  # per frozen layer
    assert full.model_flops == plain.model_flops
    assert full.hardware_flops - full.model_flops == 2 * below + 3 * layer.total
    lora = PeftShape("lora", rank=2)
    base = training_flops_per_step(shape, 2, causal="full", peft=lora)
    sel = training_flops_per_step(shape, 2, causal="full", peft=lora, recompute="selective")
    assert sel.hardware_flops - sel.model_flops == 3 * layer.attention_core


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="prefix"), "lora, dora or freeze"),
    (dict(method="freeze"), "trainable_layers"),
    (dict(method="lora", rank=0), "rank"),
    (dict(method="lora", rank=4, targets=("q_proj",)), "targets"),
])
def test_bad_peft_shapes_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PeftShape(**kwargs)


def test_peft_counts_refuse_what_cannot_be_built():
    with pytest.raises(ValueError, match="micro-batch"):
        training_flops_per_step(tiny(), 4, peft=PeftShape("dora", rank=2))
    with pytest.raises(ValueError, match="dense Llama layer"):
        training_flops_per_step(REFERENCE_CASES["moe-top2"], 4, peft=PeftShape("lora", rank=2))
