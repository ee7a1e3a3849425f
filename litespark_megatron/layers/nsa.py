"""Native sparse attention (NSA; Yuan et al. 2025, arXiv 2502.11089) as a Litespark attention variant.

Each query attends through three branches, mixed by gates the model learns from the (normed) hidden state:

    o_t = g_cmp * Attn(q_t, K_cmp, V_cmp)        compressed: one key/value per block of `block_size` tokens
        + g_slc * Attn(q_t, K_slc(t), V_slc(t))  selected: the tokens of the `selected_blocks` blocks that the
                                                  compressed attention of the query's KV group weighs most
        + g_swa * Attn(q_t, K[t-w+1..t], V[..])   sliding window of `window` tokens

The branch definitions are those of fla-core's NSA (flash-linear-attention, `fla.ops.nsa`, pinned in setup.py's
`nsa` extra), whose Triton kernels run the compressed and selected branches on a GPU:

- compression is the mean of a block's keys (values), not the paper's small MLP, and the three branches share the
  keys and values (the paper gives each its own projection);
- a query sees a compressed block once the block's last token is in its past;
- selection ranks the visible blocks of one KV group by the compressed attention probabilities averaged over the
  group's query heads (all heads of a group read the same blocks, as the paper's kernel requires); the first block,
  the query's own block and the one before it are always selected; causality masks the tokens of the own block
  that lie ahead;
- a query with no visible compressed block (the first block_size - 1 positions) gets 0 from that branch.

`nsa_reference` is the definition in plain torch (dense masks: memory grows with the sequence squared; it is the CPU
path and the reference of the GPU test). `nsa_fused` is the GPU path: fla-core's `parallel_nsa` for the compressed
and selected branches, torch's FlexAttention for the sliding window (fla-core would call flash-attn there).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from .attention import LitesparkSelfAttention
from .elementwise import rope

FLA_VERSION = "0.6.0"  # the fla-core whose branch definitions nsa_reference follows (setup.py's `nsa` extra)


@dataclass(frozen=True)
class NSASettings:
    block_size: int = 64  # tokens per compressed block and per selected block
    selected_blocks: int = 16  # blocks each query's KV group selects (the first, own and previous included)
    window: int = 512  # tokens of the sliding-window branch, the query's own included


def nsa_reference(q, k, v, gates, settings: NSASettings, scale: float):
    """q [b, t, hq, d], k and v [b, t, hk, d] (hk divides hq), gates [b, t, hq, 3] (compressed, selected, window;
    after the sigmoid) -> [b, t, hq, d]. t must be a multiple of settings.block_size."""
    b, t, hq, d = q.shape
    hk, bs = k.size(2), settings.block_size
    g, nb = hq // hk, t // bs
    qg = q.reshape(b, t, hk, g, d).permute(0, 2, 3, 1, 4)  # [b, hk, g, t, d]
    kh, vh = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)  # [b, hk, t, d]
    pos = torch.arange(t, device=q.device)
    blk = torch.arange(nb, device=q.device)

    # Compressed branch: block means, visible once complete.
    k_cmp, v_cmp = (x.reshape(b, hk, nb, bs, d).mean(3) for x in (kh, vh))
    visible = (blk[None, :] + 1) * bs - 1 <= pos[:, None]  # [t, nb]
    scores = torch.einsum("bkgtd,bkcd->bkgtc", qg, k_cmp) * scale
    probs = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    o_cmp = torch.einsum("bkgtc,bkcd->bkgtd", probs, v_cmp)

    # Selection: the group's mean probability ranks the blocks; forced blocks first.
    own = pos[:, None] // bs
    forced = (blk[None, :] == own) | (blk[None, :] == 0) | (blk[None, :] == own - 1)
    rank = torch.where(forced, 1.0, probs.detach().mean(2))  # [b, hk, t, nb]
    top = rank.topk(min(settings.selected_blocks, nb), dim=-1).indices
    chosen = torch.zeros_like(rank, dtype=torch.bool).scatter_(-1, top, True) & (visible | forced)
    causal = pos[None, :] <= pos[:, None]  # [t, t]
    o_slc = _masked_attention(qg, kh, vh, chosen.repeat_interleave(bs, dim=-1)[:, :, None] & causal, scale)

    # Sliding window.
    window = causal & (pos[:, None] - pos[None, :] < settings.window)
    o_swa = _masked_attention(qg, kh, vh, window, scale)

    gates = gates.reshape(b, t, hk, g, 3).permute(0, 2, 3, 1, 4)[..., None]  # [b, hk, g, t, 3, 1]
    o = gates[..., 0, :] * o_cmp + gates[..., 1, :] * o_slc + gates[..., 2, :] * o_swa
    return o.permute(0, 3, 1, 2, 4).reshape(b, t, hq, d)


def _masked_attention(qg, kh, vh, mask, scale):
    """qg [b, hk, g, t, d] attends kh/vh [b, hk, t, d] where mask (broadcast to [b, hk, g, t, t]) is true."""
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, kh) * scale
    return torch.einsum("bkgts,bksd->bkgtd", torch.softmax(scores.masked_fill(~mask, -math.inf), dim=-1), vh)


# --------------------------------------------------------------------------------------------- GPU path
def fla_available() -> bool:
    try:
        from fla.ops.nsa import parallel_nsa  # noqa: F401
    except Exception:  # fla-core absent, or its Triton kernels cannot load here
        return False
    return True


def fused_group_problem(query_heads: int, kv_heads: int, head_dim: int, settings: NSASettings):
    """Why fla-core's kernels cannot run this shape (None if they can): query heads per KV head must be a power of 2
    of at least 16 (a tile dimension of its kernels), the head at most 256 channels, and a block at least twice the
    selected blocks (its top-k sorts within a block)."""
    group = query_heads // kv_heads
    if group < 16 or group & (group - 1):
        return (f"{query_heads} query heads over {kv_heads} KV heads is {group} per KV head; fla-core's kernels need "
                f"a power of 2 >= 16 (e.g. --num-query-groups {max(query_heads // 16, 1)})")
    if head_dim > 256:
        return f"head dimension {head_dim}: fla-core's kernels take at most 256"
    if settings.block_size < 2 * settings.selected_blocks:
        return (f"--nsa-block-size {settings.block_size} < 2 x --nsa-selected-blocks {settings.selected_blocks}: "
                "fla-core's top-k needs a block at least twice the selected blocks")
    return None


def nsa_fused(q, k, v, gates, settings: NSASettings, scale: float):
    """nsa_reference on a GPU: same arguments, same function."""
    from fla.ops.nsa import parallel_nsa

    g_cmp, g_slc, g_swa = gates.unbind(-1)
    o = parallel_nsa(q, k, v, g_cmp=g_cmp, g_slc=g_slc, block_counts=settings.selected_blocks,
                     block_size=settings.block_size, window_size=0, scale=scale)
    return torch.addcmul(o, _sliding_window(q, k, v, settings.window, scale), g_swa.unsqueeze(-1))


def _sliding_window(q, k, v, window: int, scale: float):
    """Causal attention to the last `window` keys: FlexAttention skips the blocks outside the band (compiled once
    per process: uncompiled, it would materialize the scores)."""
    out = _compiled_flex()(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=_window_mask(q.size(1), window,
                                                                                              q.device),
                           scale=scale, enable_gqa=q.size(2) != k.size(2))
    return out.transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=16)
def _window_mask(t: int, window: int, device):
    from torch.nn.attention.flex_attention import create_block_mask

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < window)

    return create_block_mask(in_window, B=None, H=None, Q_LEN=t, KV_LEN=t, device=device)


def nsa(q, k, v, gates, settings: NSASettings, scale: float):
    """The GPU kernels on a GPU (the trainer refuses NSA there without fla-core), the reference on a CPU."""
    if q.is_cuda:
        return nsa_fused(q, k, v, gates, settings, scale)
    return nsa_reference(q, k, v, gates, settings, scale)


# --------------------------------------------------------------------------------------------- the modules
@dataclass
class NSASelfAttentionSubmodules(SelfAttentionSubmodules):
    linear_gate: object = None  # hidden -> 3 gates per query head (column-parallel: split by heads like the queries)


class LitesparkNSACoreAttention(MegatronModule):
    """Native sparse attention over [s, b, heads, d] queries, keys and values and [s, b, heads, 3] gates; returns
    [s, b, heads * d]. Causal self-attention only; no context parallelism (refused before the model is built)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, settings: NSASettings,
                 softmax_scale=None, **unused):
        super().__init__(config=config)
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"native sparse attention is causal, got {attn_mask_type}")
        self.settings = settings
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, gates):
        s, b = query.size(0), query.size(1)
        q, k, v, g = (x.transpose(0, 1) for x in (query, key, value, gates))  # [b, s, ...]
        return nsa(q, k, v, g, self.settings, self.softmax_scale).transpose(0, 1).reshape(s, b, -1)

    def observed_attention(self, query):
        """What ran, for backend_probe.py."""
        from .. import backend_probe

        if query.is_cuda:
            return backend_probe.AttentionUse(f"NSA: fla-core {FLA_VERSION} Triton (compressed, selected) + torch "
                                       "FlexAttention (window)", "fused")
        return backend_probe.AttentionUse("NSA: torch reference (dense masks)", "unfused")


class LitesparkNSASelfAttention(LitesparkSelfAttention):
    """The Litespark self-attention with native sparse attention as its core and the branch gates: a sigmoid of a
    column-parallel projection of the layer's normed input (so the spec keeps the input norm a module of its own)."""

    def __init__(self, config, submodules: NSASelfAttentionSubmodules, layer_number: int,
                 attn_mask_type=AttnMaskType.causal, cp_comm_type=None, pg_collection=None, **unused):
        super().__init__(config=config, submodules=submodules, layer_number=layer_number,
                         attn_mask_type=attn_mask_type, cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        self.linear_gate = submodules.linear_gate(
            config.hidden_size, 3 * config.num_attention_heads, config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, is_expert=False, tp_group=self.pg_collection.tp)

    def forward(self, hidden_states, attention_mask=None, key_value_states=None, inference_context=None,
                rotary_pos_emb=None, attention_bias=None, packed_seq_params=None, **kwargs):
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise ValueError("native sparse attention has no inference path (KV cache) here")
        if packed_seq_params is not None:
            raise ValueError("native sparse attention takes whole sequences, not packed ones")
        query, key, value = self.get_query_key_value_tensors(hidden_states)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            query = rope(query, q_freqs, self.config)
            key = rope(key, k_freqs, self.config)
        gate_logits, _ = self.linear_gate(hidden_states)
        gates = torch.sigmoid(gate_logits.float()).to(query.dtype).view(*query.shape[:3], 3)
        if self.checkpoint_core_attention and self.training:  # --recompute-modules core_attn
            context = tensor_parallel.checkpoint(self.core_attention, False, query, key, value, gates)
        else:
            context = self.core_attention(query, key, value, gates)
        return self.linear_proj(context)
