"""Exact training-FLOP count of a Llama-style decoder (dense or MoE MLP, GQA/MHA or MLA attention).

What is counted: every matrix multiplication of the model, at 2 FLOPs per multiply-add. Everything else
(norms, rotary embeddings, softmax, activations, residual adds, the loss, the optimizer) is left out: together
it is well under 1% of the total for these shapes, and leaving it out is what Megatron-LM, NeMo and the
PaLM/Chinchilla MFU papers do, so numbers stay comparable. Embedding lookups are gathers: 0 FLOPs.

Training = forward + backward, and the backward of every GEMM is two GEMMs of the forward's size (the
gradient with respect to the input and with respect to the weight), so model FLOPs = 3 x forward. The two
attention-core matmuls (Q K^T and P V) also take 2x their forward in backward (dQ, dK and dP, dV), so the 3x
holds for them too. Activation recomputation runs part of the forward again: that is hardware FLOPs, not model
FLOPs (MFU uses model FLOPs, HFU hardware FLOPs; Korthikanti et al. 2022).

Attention-core conventions (the only place where published counters disagree):

* ``"half"``: causal attention counts half of the s x s score and value matmuls (each query attends to s/2
  keys on average), as current Megatron-LM ``num_floating_point_operations`` does and as causal
  flash-attention kernels actually compute.
* ``"full"``: the full s x s matmuls, with no causal skipping: Megatron-LM's formula before it was halved and
  NeMo's ``flops_formulas`` before causal halving was added there (the basis of its published performance
  tables). It is also what ``torch.utils.flop_counter.FlopCounterMode`` measures on explicit matmuls. (On the
  CUDA SDPA kernels FlopCounterMode ignores ``is_causal`` too, but counts 5 backward matmuls, the flash
  backward's recomputation of Q K^T included: 3.5x the forward attention core instead of 3x. On CPU it does
  not count SDPA at all.)

The two differ by 6 * L * s * n * d_head training FLOPs per token (10% of the "half" total for llama-3b at
s=4096, growing with s), so an MFU figure means little unless its convention is named.

Fine-tuning (``peft``: a ``PeftShape``) has a second convention, ``"peft"``, beside ``"standard"`` (every weight
trains, 3 x forward): a frozen weight gets no weight gradient, and a GEMM's input gradient is counted only where its
input carries a gradient (a trainable parameter comes before it in the forward), as autograd and megatron-core's
frozen linear compute them. So a frozen linear costs 4 FLOPs per weight per token above the lowest trainable
parameter and 2 (forward only) below it, the attention core 3x its forward above it and 1x below, and the adapters
are GEMMs of their own (A: r x in, B: out x r; DoRA also recomputes B A and, with dropout, the base GEMM on the
dropped input: peft's DoraLinearLayer).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple, Union

CAUSAL_CONVENTIONS = {
    "half": "causal attention counted as half of the s x s score and value matmuls "
            "(Megatron-LM/Megatron-Core convention)",
    "full": "attention counted as the full s x s score and value matmuls, no causal skipping "
            "(NeMo performance-table convention; what torch FlopCounterMode measures on explicit matmuls)",
}
RECOMPUTE_CHOICES = (None, "full", "selective")
FLOP_CONVENTIONS = {
    "standard": "every weight trains: training = 3 x forward (an input and a weight gradient per GEMM)",
    "peft": "frozen weights get no weight gradient; a GEMM's input gradient only where a trainable parameter comes "
            "before it in the forward (forward only below the lowest trainable layer); adapter GEMMs counted",
}
# The linears of a dense Llama layer that LoRA/DoRA adapt (megatron-core's names; layers/adapters.py TARGETS).
ADAPTER_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _check_causal(causal: str) -> None:
    if causal not in CAUSAL_CONVENTIONS:
        raise ValueError(f"causal must be 'half' or 'full', got {causal!r}")


@dataclass(frozen=True)
class MoEShape:
    """Mixture-of-experts MLP, megatron-core TransformerConfig names and defaults.

    ``moe_layer_freq``: an int N makes layers 0, N, 2N, ... MoE (1 = every layer, Megatron's rule
    ``i % N == 0``); a sequence of 0/1 of length num_layers gives the pattern explicitly.
    """

    num_experts: int
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # None: the model's ffn_hidden_size, as in megatron-core
    moe_shared_expert_intermediate_size: Optional[int] = None  # total size of all shared experts; None = none
    moe_layer_freq: Union[int, Tuple[int, ...]] = 1

    def __post_init__(self):
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {self.num_experts}")
        if not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"moe_router_topk must be between 1 and num_experts ({self.num_experts}), "
                             f"got {self.moe_router_topk}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1 (or None), got {v}")
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq < 1:
                raise ValueError(f"moe_layer_freq must be >= 1 or a 0/1 pattern, got {freq}")
        else:
            pattern = tuple(int(x) for x in freq)
            if any(x not in (0, 1) for x in pattern):
                raise ValueError(f"moe_layer_freq pattern must contain only 0 and 1, got {list(freq)}")
            object.__setattr__(self, "moe_layer_freq", pattern)


@dataclass(frozen=True)
class MLAShape:
    """Multi-latent attention, megatron-core MLATransformerConfig names and defaults.

    ``q_lora_rank=None`` projects queries straight from the hidden state (no query compression), as in
    megatron-core.
    """

    q_lora_rank: Optional[int] = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128

    def __post_init__(self):
        if self.q_lora_rank is not None and self.q_lora_rank < 1:
            raise ValueError(f"q_lora_rank must be >= 1 (or None for no query compression), got {self.q_lora_rank}")
        for name in ("kv_lora_rank", "qk_head_dim", "v_head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.qk_pos_emb_head_dim < 0:
            raise ValueError(f"qk_pos_emb_head_dim must be >= 0, got {self.qk_pos_emb_head_dim}")


@dataclass(frozen=True)
class NSAShape:
    """Native sparse attention (litespark --attention-variant nsa; layers/nsa.py): block size, selected blocks,
    sliding window."""

    block_size: int = 64
    selected_blocks: int = 16
    window: int = 512

    def attended_pairs(self, s: int) -> int:
        """(query, key) pairs a sequence of s tokens attends, summed over its queries: each query's visible
        compressed blocks (complete ones), the tokens up to it of its selected blocks (its own block and
        min(selected, own + 1) - 1 complete ones) and its window. Both conventions count these: there is no dense
        s x s product to halve."""
        bs = self.block_size
        return sum((t + 1) // bs + (min(self.selected_blocks, t // bs + 1) - 1) * bs + t % bs + 1
                   + min(self.window, t + 1) for t in range(s))


@dataclass(frozen=True)
class PeftShape:
    """What trains in a fine-tuning run (litespark --peft): ``lora``/``dora``: adapters of rank ``rank`` on the
    ``targets`` of every layer (with ``dropout`` on their input; DoRA then runs the base GEMM a second time), all
    else frozen; ``freeze``: the last ``trainable_layers`` layers, all else (embedding, final norm, output layer)
    frozen."""

    method: str
    rank: int = 0
    targets: Tuple[str, ...] = ADAPTER_TARGETS
    trainable_layers: Optional[int] = None
    dropout: float = 0.0

    def __post_init__(self):
        if self.method not in ("lora", "dora", "freeze"):
            raise ValueError(f"PeftShape.method must be lora, dora or freeze, got {self.method!r}")
        if self.method == "freeze":
            if not isinstance(self.trainable_layers, int) or self.trainable_layers < 1:
                raise ValueError(f"freeze needs trainable_layers >= 1, got {self.trainable_layers!r}")
            return
        if self.rank < 1:
            raise ValueError(f"{self.method} needs rank >= 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in ADAPTER_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"targets must be some of {', '.join(ADAPTER_TARGETS)}, got {list(self.targets)}")
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def adapters(self) -> bool:
        return self.method in ("lora", "dora")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions that decide FLOPs and parameter counts.

    ``vocab_size`` is the padded vocabulary the output layer actually has (that GEMM is what runs).
    ``num_query_groups`` equal to ``num_attention_heads`` is multi-head attention. ``kv_channels`` (head dim)
    defaults to hidden_size / num_attention_heads. ``gated_linear_unit`` True is SwiGLU (three h x ffn
    matrices), False a two-matrix GELU MLP. Biases are not modelled (Llama-style layers have none).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    kv_channels: Optional[int] = None
    gated_linear_unit: bool = True
    untie_embeddings_and_output_weights: bool = True
    moe: Optional[MoEShape] = None
    mla: Optional[MLAShape] = None
    nsa: Optional[NSAShape] = None

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                     "vocab_size", "seq_length"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"ModelShape.{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_query_groups ({self.num_query_groups})")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                                 f"({self.num_attention_heads}); give kv_channels (the head dimension) explicitly")
            object.__setattr__(self, "kv_channels", self.hidden_size // self.num_attention_heads)
        elif self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if self.moe is not None and not isinstance(self.moe.moe_layer_freq, int) \
                and len(self.moe.moe_layer_freq) != self.num_layers:
            raise ValueError(f"moe_layer_freq pattern has {len(self.moe.moe_layer_freq)} entries; it needs one per "
                             f"layer ({self.num_layers})")

    # ---- derived ----
    @property
    def ffn_matrices(self) -> int:
        """Weight matrices of h x ffn size per MLP: 3 for SwiGLU (gate, up, down), 2 for GELU (up, down)."""
        return 3 if self.gated_linear_unit else 2

    def is_moe_layer(self, index: int) -> bool:
        if self.moe is None:
            return False
        freq = self.moe.moe_layer_freq
        if isinstance(freq, int):
            return index % freq == 0
        return bool(freq[index])

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @classmethod
    def from_args(cls, args, padded_vocab: Optional[int] = None) -> "ModelShape":
        """Build from a parsed litespark/Megatron-LM argument namespace.

        The vocabulary is, in order: ``padded_vocab`` when given, ``args.padded_vocab_size`` when the namespace
        has one (Megatron-LM sets it), else ``vocab_size`` padded as Megatron-LM pads it (to a multiple of
        make_vocab_size_divisible_by x TP). MoE fields are read when ``num_experts`` is set, MLA fields when
        ``multi_latent_attention`` is true; missing MoE/MLA attributes take megatron-core's defaults.
        """
        heads = args.num_attention_heads
        groups = getattr(args, "num_query_groups", None)
        # Megatron-LM keeps num_query_groups=1 as a placeholder unless --group-query-attention is on.
        if groups is None or getattr(args, "group_query_attention", None) is False:
            groups = heads
        if padded_vocab is None:
            padded_vocab = getattr(args, "padded_vocab_size", None)
        if padded_vocab is None:
            multiple = (getattr(args, "make_vocab_size_divisible_by", None) or 1) * \
                (getattr(args, "tensor_model_parallel_size", None) or 1)
            padded_vocab = -(-args.vocab_size // multiple) * multiple  # Megatron-LM's padding
        moe = None
        if getattr(args, "num_experts", None):
            # Megatron-LM flags default to None where megatron-core has a default: take the core default then.
            kwargs = {}
            for f in dataclasses.fields(MoEShape):
                if f.name != "num_experts":
                    value = getattr(args, f.name, None)
                    kwargs[f.name] = f.default if value is None else value
            moe = MoEShape(num_experts=args.num_experts, **kwargs)
        mla = None
        if getattr(args, "multi_latent_attention", False):
            kwargs = {}
            for f in dataclasses.fields(MLAShape):
                value = getattr(args, f.name, f.default)
                # q_lora_rank=None is meaningful (no query compression); elsewhere None means "not set".
                kwargs[f.name] = value if (value is not None or f.name == "q_lora_rank") else f.default
            mla = MLAShape(**kwargs)
        nsa = None
        if getattr(args, "attention_variant", "dense") == "nsa":
            nsa = NSAShape(args.nsa_block_size, args.nsa_selected_blocks, args.nsa_window)
        return cls(
            num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
            num_attention_heads=heads, num_query_groups=groups, vocab_size=padded_vocab,
            seq_length=args.seq_length, kv_channels=getattr(args, "kv_channels", None),
            gated_linear_unit=bool(getattr(args, "swiglu", True)),
            untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
            moe=moe, mla=mla, nsa=nsa)


@dataclass(frozen=True)
class FlopBreakdown:
    """FLOPs by part of the model. ``mlp`` is the dense MLPs; ``experts`` the routed experts (top-k per token);
    ``shared_experts`` the MoE shared experts; ``router`` the MoE gating GEMM."""

    qkv: float = 0
    proj: float = 0
    attn_scores: float = 0
    attn_values: float = 0
    mlp: float = 0
    router: float = 0
    experts: float = 0
    shared_experts: float = 0
    logits: float = 0
    adapters: float = 0  # fine-tuning: LoRA/DoRA's A and B GEMMs and DoRA's recomputed B A

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def attention_core(self) -> float:
        return self.attn_scores + self.attn_values

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __add__(self, other: "FlopBreakdown") -> "FlopBreakdown":
        return FlopBreakdown(**{k: v + getattr(other, k) for k, v in self.as_dict().items()})

    def scaled(self, factor) -> "FlopBreakdown":
        return FlopBreakdown(**{k: v * factor for k, v in self.as_dict().items()})


def layer_forward_per_sequence(shape: ModelShape, index: int, causal: str) -> FlopBreakdown:
    """Forward FLOPs of transformer layer ``index`` for one sequence of seq_length tokens (exact integers)."""
    s, h, n = shape.seq_length, shape.hidden_size, shape.num_attention_heads
    if shape.mla is None:
        d, g = shape.kv_channels, shape.num_query_groups
        qkv_weights = h * d * (n + 2 * g)          # Q: h -> n*d; K and V: h -> g*d each
        out_in = n * d                              # the output projection reads n*d values per token
        qk_dim, v_dim = d, d
    else:
        m = shape.mla
        q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
        if m.q_lora_rank is None:
            q_weights = h * n * q_head                                  # linear_q_proj
        else:
            q_weights = h * m.q_lora_rank + m.q_lora_rank * n * q_head  # linear_q_down_proj + linear_q_up_proj
        kv_weights = (h * (m.kv_lora_rank + m.qk_pos_emb_head_dim)     # linear_kv_down_proj (+ shared rope key)
                      + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim))  # linear_kv_up_proj
        qkv_weights = q_weights + kv_weights
        out_in = n * m.v_head_dim
        qk_dim, v_dim = q_head, m.v_head_dim
    if shape.nsa is not None:
        qkv_weights += h * 3 * n  # the gates of the three branches, one per query head each
    # Q K^T: s queries x s keys x qk_dim per head; P V: s x s x v_dim per head. "half" counts s*s/2 pairs.
    pairs_x2 = 2 * s * s if causal == "full" else s * s
    if shape.nsa is not None:
        pairs_x2 = 2 * shape.nsa.attended_pairs(s)
    parts = dict(qkv=2 * s * qkv_weights, proj=2 * s * out_in * h,
                 attn_scores=pairs_x2 * n * qk_dim, attn_values=pairs_x2 * n * v_dim)
    per_matrix = 2 * s * h  # one h x width GEMM per unit of width, per sequence
    if shape.is_moe_layer(index):
        moe = shape.moe
        f_moe = moe.moe_ffn_hidden_size or shape.ffn_hidden_size
        parts["router"] = per_matrix * moe.num_experts
        # Each token runs through its top-k experts only: k expert MLPs per token.
        parts["experts"] = per_matrix * shape.ffn_matrices * f_moe * moe.moe_router_topk
        parts["shared_experts"] = per_matrix * shape.ffn_matrices * (moe.moe_shared_expert_intermediate_size or 0)
    else:
        parts["mlp"] = per_matrix * shape.ffn_matrices * shape.ffn_hidden_size
    return FlopBreakdown(**parts)


def _adapted_linears(shape: ModelShape) -> dict:
    """target -> (input width, output rows of each projection an adapter has on it), as layers/adapters.py builds
    them: one adapter per projection of a fused linear (q, k, v of linear_qkv; gate and up of linear_fc1)."""
    h, n, g, d, f = (shape.hidden_size, shape.num_attention_heads, shape.num_query_groups, shape.kv_channels,
                     shape.ffn_hidden_size)
    return {"linear_qkv": (h, (n * d, g * d, g * d)), "linear_proj": (n * d, (h,)),
            "linear_fc1": (h, (f,) * (shape.ffn_matrices - 1)), "linear_fc2": (f, (h,))}


def _check_peft(shape: ModelShape, peft: "PeftShape") -> None:
    if peft.adapters and (shape.moe is not None or shape.mla is not None or shape.nsa is not None):
        raise ValueError(f"--peft {peft.method}: adapters are counted on the dense Llama layer's four linears (no MoE, "
                         "MLA or NSA), as they are built")


def _peft_layer(shape: ModelShape, peft: "PeftShape", index: int, causal: str, carried: bool):
    """(training FLOPs, forward FLOPs) of layer `index` for one sequence in the peft convention, and whether its
    output carries a gradient. `carried`: whether its input does (a trainable parameter before it)."""
    s = shape.seq_length
    forward = layer_forward_per_sequence(shape, index, causal)
    if peft.method == "freeze":
        if index >= shape.num_layers - peft.trainable_layers:  # a trained layer: its input norm trains too
            return forward.scaled(3), forward, True
        if not carried:
            return forward, forward, False
        # frozen, with a gradient through it: input gradients alone (the attention core's are all of its backward)
        frozen = forward.scaled(2) + FlopBreakdown(attn_scores=forward.attn_scores, attn_values=forward.attn_values)
        return frozen, forward, True
    # lora/dora: walk the layer's GEMMs in forward order; a frozen GEMM's input gradient only where its input
    # carries one, an adapter's A likewise, its B always (A before it trains).
    train, fwd = dict(mlp=0), dict(mlp=0)
    part = {"linear_qkv": "qkv", "linear_proj": "proj", "linear_fc1": "mlp", "linear_fc2": "mlp"}
    adapters_train = adapters_fwd = 0
    dropout_rerun = peft.method == "dora" and peft.dropout > 0  # peft's DoRA: W on the dropped input again

    def linear(target, c):
        nonlocal adapters_train, adapters_fwd
        width, outs = _adapted_linears(shape)[target]
        weight_fwd = 2 * s * width * sum(outs)
        runs = 2 if (dropout_rerun and target in peft.targets) else 1
        train[part[target]] = train.get(part[target], 0) + runs * weight_fwd * (2 if c else 1)
        fwd[part[target]] = fwd.get(part[target], 0) + runs * weight_fwd
        if target not in peft.targets:
            return c
        a_fwd, b_fwd = 2 * s * peft.rank * width * len(outs), 2 * s * peft.rank * sum(outs)
        adapters_train += a_fwd * (3 if c else 2) + 3 * b_fwd
        adapters_fwd += a_fwd + b_fwd
        return True

    c = linear("linear_qkv", carried)
    train["attn_scores"], train["attn_values"] = (forward.attn_scores * (3 if c else 1),
                                                  forward.attn_values * (3 if c else 1))
    fwd["attn_scores"], fwd["attn_values"] = forward.attn_scores, forward.attn_values
    c = linear("linear_proj", c)
    c = linear("linear_fc1", c)  # the residual adds the layer's input: c already covers it
    c = linear("linear_fc2", c)
    return (FlopBreakdown(adapters=adapters_train, **train), FlopBreakdown(adapters=adapters_fwd, **fwd), c)


def _dora_weight_norms(shape: ModelShape, peft: "PeftShape", layers) -> int:
    """DoRA's B A of every adapted projection of `layers`, once per forward call (its row norm, detached)."""
    if peft.method != "dora":
        return 0
    per_layer = sum(2 * out * peft.rank * width for target, (width, outs) in _adapted_linears(shape).items()
                    if target in peft.targets for out in outs)
    return per_layer * len(list(layers))


def _peft_training_per_sequence(shape: ModelShape, peft: "PeftShape", causal: str, carried: bool = False):
    """(training FLOPs, forward FLOPs by layer) of one sequence in the peft convention; the embedding is frozen, so
    the first layer's input carries no gradient unless `carried` (a run whose embedding output is made to need one)."""
    total, forwards = FlopBreakdown(), []
    for i in range(shape.num_layers):
        train, fwd, carried = _peft_layer(shape, peft, i, causal, carried)
        total, forwards = total + train, forwards + [fwd]
    logits = 2 * shape.seq_length * shape.hidden_size * shape.vocab_size  # frozen output layer: no weight gradient
    return total + FlopBreakdown(logits=logits * (2 if carried else 1)), forwards


def _forward_per_sequence(shape: ModelShape, causal: str) -> FlopBreakdown:
    total = FlopBreakdown()
    for i in range(shape.num_layers):
        total = total + layer_forward_per_sequence(shape, i, causal)
    # The output layer (logits) GEMM runs whether or not its weight is tied to the embedding.
    return total + FlopBreakdown(logits=2 * shape.seq_length * shape.hidden_size * shape.vocab_size)


def flops_per_token_forward(shape: ModelShape, causal: str = "half") -> FlopBreakdown:
    """Forward FLOPs per token (averaged over a full sequence: the attention part depends on the position)."""
    _check_causal(causal)
    return _forward_per_sequence(shape, causal).scaled(1 / shape.seq_length)


@dataclass(frozen=True)
class TrainingFlops:
    """FLOPs of one optimizer step.

    ``model_flops`` = 3 x forward (MFU numerator). ``hardware_flops`` = model_flops + the forward work run again
    by activation recomputation (HFU numerator). Breakdowns are per step.
    """

    model_flops: int
    hardware_flops: int
    tokens: int
    causal: str
    convention: str
    recompute: Optional[str]
    recomputed_layers: int
    model_breakdown: FlopBreakdown
    recompute_breakdown: FlopBreakdown
    flops_convention: str = "standard"  # FLOP_CONVENTIONS: "peft" for a fine-tuning run with frozen weights

    @property
    def model_flops_per_token(self) -> float:
        return self.model_flops / self.tokens

    @property
    def hardware_flops_per_token(self) -> float:
        return self.hardware_flops / self.tokens

    def as_dict(self) -> dict:
        return dict(model_flops=self.model_flops, hardware_flops=self.hardware_flops, tokens=self.tokens,
                    model_flops_per_token=self.model_flops_per_token,
                    hardware_flops_per_token=self.hardware_flops_per_token, causal=self.causal,
                    convention=self.convention, recompute=self.recompute,
                    recomputed_layers=self.recomputed_layers, model_breakdown=self.model_breakdown.as_dict(),
                    recompute_breakdown=self.recompute_breakdown.as_dict(), flops_convention=self.flops_convention)


def training_flops_per_step(shape: ModelShape, global_batch_size: int, causal: str = "half",
                            recompute: Optional[str] = None,
                            recomputed_layers: Optional[Iterable[int]] = None,
                            peft: Optional[PeftShape] = None,
                            micro_batch_size: Optional[int] = None) -> TrainingFlops:
    """Model and hardware FLOPs of one step of ``global_batch_size`` sequences of ``shape.seq_length`` tokens.

    ``recompute``: None; ``"full"``: the transformer layers listed in ``recomputed_layers`` (default: all) run
    their forward twice (the logits GEMM is outside the checkpointed layers and is not rerun);
    ``"selective"``: the attention core (Q K^T and P V, megatron-core's default ``core_attn`` module) runs twice.

    ``peft``: a fine-tuning run, counted in the "peft" convention (module docstring); DoRA's weight norms run once
    per forward call, so a DoRA run needs ``micro_batch_size`` (global batch / micro-batch calls per step). With full
    recomputation the frozen embedding's output is made to need a gradient (peft.apply: a reentrant checkpoint
    trains nothing otherwise), so hardware FLOPs then add the input gradients below the lowest trainable layer too.
    """
    _check_causal(causal)
    if not isinstance(global_batch_size, int) or isinstance(global_batch_size, bool) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}")
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute must be None, 'full' or 'selective', got {recompute!r}")
    if recomputed_layers is not None and recompute != "full":
        raise ValueError("recomputed_layers only applies to recompute='full'")
    if peft is not None:
        return _peft_training_flops(shape, global_batch_size, causal, recompute, recomputed_layers, peft,
                                    micro_batch_size)
    forward = _forward_per_sequence(shape, causal)
    extra = FlopBreakdown()
    layers = []
    if recompute == "full":
        layers = sorted(set(range(shape.num_layers) if recomputed_layers is None else recomputed_layers))
        if layers and not 0 <= layers[0] <= layers[-1] < shape.num_layers:
            raise ValueError(f"recomputed_layers must be layer indices in [0, {shape.num_layers}), got {layers}")
        for i in layers:
            extra = extra + layer_forward_per_sequence(shape, i, causal)
    elif recompute == "selective":
        layers = list(range(shape.num_layers))
        for i in layers:
            layer = layer_forward_per_sequence(shape, i, causal)
            extra = extra + FlopBreakdown(attn_scores=layer.attn_scores, attn_values=layer.attn_values)
    # Per-sequence counts are integers; keep them integers so the per-step totals are exact.
    model = forward.scaled(3 * global_batch_size)
    extra = extra.scaled(global_batch_size)
    model_total, extra_total = int(model.total), int(extra.total)
    return TrainingFlops(model_flops=model_total, hardware_flops=model_total + extra_total,
                         tokens=global_batch_size * shape.seq_length, causal=causal,
                         convention=CAUSAL_CONVENTIONS[causal], recompute=recompute,
                         recomputed_layers=len(layers), model_breakdown=model, recompute_breakdown=extra)


def _recomputed(shape: ModelShape, recompute: Optional[str], recomputed_layers) -> list:
    if recompute == "full":
        layers = sorted(set(range(shape.num_layers) if recomputed_layers is None else recomputed_layers))
        if layers and not 0 <= layers[0] <= layers[-1] < shape.num_layers:
            raise ValueError(f"recomputed_layers must be layer indices in [0, {shape.num_layers}), got {layers}")
        return layers
    return list(range(shape.num_layers)) if recompute == "selective" else []


def _peft_training_flops(shape, global_batch_size, causal, recompute, recomputed_layers, peft,
                         micro_batch_size) -> TrainingFlops:
    """training_flops_per_step of a fine-tuning run (its docstring)."""
    _check_peft(shape, peft)
    calls = 0
    if peft.method == "dora":
        if not micro_batch_size or global_batch_size % micro_batch_size:
            raise ValueError(f"DoRA's FLOPs need the micro-batch size (forward calls per step), a divisor of the "
                             f"global batch {global_batch_size}; got {micro_batch_size!r}")
        calls = global_batch_size // micro_batch_size
    train, forwards = _peft_training_per_sequence(shape, peft, causal)
    model = train.scaled(global_batch_size) + \
        FlopBreakdown(adapters=calls * _dora_weight_norms(shape, peft, range(shape.num_layers)))
    layers = _recomputed(shape, recompute, recomputed_layers)
    extra = FlopBreakdown()
    if recompute == "full":
        runs, _ = _peft_training_per_sequence(shape, peft, causal, carried=True)
        extra = (runs + FlopBreakdown(**{k: -v for k, v in train.as_dict().items()})).scaled(global_batch_size)
        for i in layers:
            extra = extra + forwards[i].scaled(global_batch_size)
        extra = extra + FlopBreakdown(adapters=calls * _dora_weight_norms(shape, peft, layers))
    elif recompute == "selective":
        for i in layers:
            extra = extra + FlopBreakdown(attn_scores=forwards[i].attn_scores,
                                          attn_values=forwards[i].attn_values).scaled(global_batch_size)
    model_total, extra_total = int(model.total), int(extra.total)
    return TrainingFlops(model_flops=model_total, hardware_flops=model_total + extra_total,
                         tokens=global_batch_size * shape.seq_length, causal=causal,
                         convention=CAUSAL_CONVENTIONS[causal], recompute=recompute, recomputed_layers=len(layers),
                         model_breakdown=model, recompute_breakdown=extra, flops_convention="peft")


def recompute_from_args(args, pipeline_model_parallel_size: Optional[int] = None,
                        virtual_pipeline_model_parallel_size: Optional[int] = None) -> dict:
    """``recompute``/``recomputed_layers`` keyword arguments for training_flops_per_step from Megatron flags.

    ``--recompute-method uniform`` (or no method) recomputes every layer; ``block`` recomputes the first
    ``--recompute-num-layers`` layers of every model chunk (a chunk = the layers of one pipeline stage, or of
    one virtual stage with interleaving), as megatron-core's TransformerBlock does.
    """
    granularity = getattr(args, "recompute_granularity", None)
    if granularity is None:
        return {"recompute": None}
    if granularity == "selective":
        return {"recompute": "selective"}
    if granularity != "full":
        raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', got {granularity!r}")
    method = getattr(args, "recompute_method", None)
    k = getattr(args, "recompute_num_layers", None)
    if method != "block" or k is None:
        return {"recompute": "full", "recomputed_layers": None}
    pp = pipeline_model_parallel_size or getattr(args, "pipeline_model_parallel_size", 1) or 1
    vp = virtual_pipeline_model_parallel_size
    if vp is None:
        per_virtual = getattr(args, "num_layers_per_virtual_pipeline_stage", None)
        vp = args.num_layers // (pp * per_virtual) if per_virtual else 1
    chunk = args.num_layers // (pp * vp)
    if chunk < 1 or chunk * pp * vp != args.num_layers:
        raise ValueError(f"num_layers {args.num_layers} does not split into {pp} pipeline x {vp} virtual stages")
    return {"recompute": "full", "recomputed_layers": [i for i in range(args.num_layers) if i % chunk < k]}


@dataclass(frozen=True)
class ParamCount:
    """Parameters. ``active`` counts, for MoE, only the top-k routed experts a token runs through (plus
    everything else); for a dense model it equals ``total``."""

    total: int
    embedding: int
    output_layer: int  # 0 when tied to the embedding
    transformer_layers: int
    final_norm: int
    active: int

    @property
    def non_embedding(self) -> int:
        return self.total - self.embedding - self.output_layer

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["non_embedding"] = self.non_embedding
        return d


def _layer_params(shape: ModelShape, index: int, attention_and_norms: int) -> Tuple[int, int]:
    """(all, active) parameters of layer `index`, given its attention's and norms' weights."""
    h = shape.hidden_size
    if shape.is_moe_layer(index):
        moe = shape.moe
        f_moe = moe.moe_ffn_hidden_size or shape.ffn_hidden_size
        expert = shape.ffn_matrices * h * f_moe
        shared = shape.ffn_matrices * h * (moe.moe_shared_expert_intermediate_size or 0)
        router = moe.num_experts * h
        base = attention_and_norms + router + shared
        return base + moe.num_experts * expert, base + moe.moe_router_topk * expert
    mlp = shape.ffn_matrices * h * shape.ffn_hidden_size
    return attention_and_norms + mlp, attention_and_norms + mlp


def param_count(shape: ModelShape) -> ParamCount:
    """Weights of a Llama-style model: RMSNorm weights (no bias), no linear biases."""
    h, n = shape.hidden_size, shape.num_attention_heads
    if shape.mla is None:
        d, g = shape.kv_channels, shape.num_query_groups
        attn = h * d * (n + 2 * g) + n * d * h
    else:
        m = shape.mla
        q_head = m.qk_head_dim + m.qk_pos_emb_head_dim
        q = h * n * q_head if m.q_lora_rank is None else h * m.q_lora_rank + m.q_lora_rank * n * q_head + m.q_lora_rank
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
        attn = q + kv + m.kv_lora_rank + n * m.v_head_dim * h  # + kv_layernorm weight, + output projection
    if shape.nsa is not None:
        attn += h * 3 * n  # the branch gates
    norms = 2 * h  # input_layernorm and pre_mlp_layernorm
    total_layers = active_layers = 0
    for i in range(shape.num_layers):
        total, active = _layer_params(shape, i, attn + norms)
        total_layers += total
        active_layers += active
    embedding = shape.vocab_size * h
    output = embedding if shape.untie_embeddings_and_output_weights else 0
    final_norm = h
    return ParamCount(total=embedding + output + total_layers + final_norm, embedding=embedding,
                      output_layer=output, transformer_layers=total_layers, final_norm=final_norm,
                      active=embedding + output + active_layers + final_norm)



def trainable_params(shape: ModelShape, peft: Optional[PeftShape] = None) -> int:
    """Parameters a run trains: all (``peft`` None), the last K layers (freeze), or the adapters (lora: A r x in and
    B out x r per projection; dora: and a magnitude per output row) of every layer."""
    if peft is None:
        return param_count(shape).total
    _check_peft(shape, peft)
    if peft.method == "freeze":
        per_layer = param_count(dataclasses.replace(shape, num_layers=1, moe=None)).transformer_layers
        if shape.moe is None:
            return per_layer * peft.trainable_layers
        attention_and_norms = per_layer - shape.ffn_matrices * shape.hidden_size * shape.ffn_hidden_size
        return sum(_layer_params(shape, i, attention_and_norms)[0]
                   for i in range(shape.num_layers - peft.trainable_layers, shape.num_layers))
    per_layer = sum(peft.rank * (width * len(outs) + sum(outs)) + (sum(outs) if peft.method == "dora" else 0)
                    for target, (width, outs) in _adapted_linears(shape).items() if target in peft.targets)
    return per_layer * shape.num_layers
