"""What a model really runs, observed: its attention kernel and its fused paths, and whether it fell back.

A comparison is only as fair as its weakest row. The project's first "vs stock" ratios were measured against a
stock baseline whose Transformer Engine had silently lost its fused attention (TE loaded another cuDNN than torch;
cuDNN then failed to load a sub-library and TE fell back to unfused attention: docs/benchmarks/README.md). So every
tool that compares systems records what each one ran, and flags a system that fell back.

    probe = BackendProbe(model_chunks)
    with probe:
        one forward (or training step)
    health = probe.report(models=model_chunks, config=config, requested=..., device_type="cuda")
    health.degraded  # [] or the reasons, one line each

Attention is observed, not inferred from settings:
- Transformer Engine's DotProductAttention: forward hooks on its backend submodules (`FusedAttention`, cuDNN;
  `FlashAttention`; `UnfusedDotProductAttention`), with the cuDNN version TE loaded;
- megatron-core's `DotProductAttention` (the stock local spec): softmax over materialized scores, unfused;
- a Litespark core attention that names its own kernels (`observed_attention`: native sparse attention);
- torch's `scaled_dot_product_attention` (the Litespark core attention, HF transformers): a TorchFunctionMode sees
  each call and asks torch's dispatcher which kernel it picks for exactly those tensors (`torch._fused_sdp_choice`);
  the direct cuDNN calls of the Litespark context-parallel path are seen as themselves.
The fused paths are read from the built modules and their config (they are fixed at build time): cross-entropy
fusion, RoPE (TE's fused kernel, the compiled one, or megatron-core's unfused ops) and weight-gradient
accumulation fusion, counted per linear.
"""
from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
from torch.overrides import TorchFunctionMode

# Kinds of attention, best first. The first three never build the [s, s] score matrix.
ATTENTION_KINDS = ("fused", "flash", "efficient", "unfused", "none")
HEALTHY_ATTENTION = ("fused", "flash", "efficient")

# torch.nn.attention.SDPBackend values, as torch._fused_sdp_choice returns them.
_SDPA_KERNELS = {3: ("cuDNN", "fused"), 1: ("FlashAttention", "flash"), 2: ("memory-efficient", "efficient"),
                 0: ("math (materialized scores)", "unfused"), -1: ("no kernel", "none")}
_TE_BACKENDS = {"FusedAttention": "fused", "FlashAttention": "flash", "UnfusedDotProductAttention": "unfused"}
# Fused attention calls the Litespark context-parallel path makes directly (layers/prefix_attention.py).
_ATEN_ATTENTION = {"_scaled_dot_product_cudnn_attention": ("cuDNN", "fused"),
                   "_scaled_dot_product_flash_attention": ("FlashAttention", "flash"),
                   "_scaled_dot_product_efficient_attention": ("memory-efficient", "efficient")}


@dataclass(frozen=True)
class AttentionUse:
    backend: str  # what ran, in words: "TE FusedAttention (cuDNN 9.19.0)", "torch SDPA cuDNN", ...
    kind: str     # one of ATTENTION_KINDS


def sdpa_use(choice: int, device_type: str) -> AttentionUse:
    """The kernel torch's SDPA dispatcher chose (an SDPBackend value) as an AttentionUse."""
    name, kind = _SDPA_KERNELS.get(int(choice), (f"unknown kernel {choice}", "none"))
    where = " (CPU)" if device_type == "cpu" and kind != "none" else ""
    return AttentionUse(f"torch SDPA {name}{where}", kind)


def te_use(class_name: str, cudnn: Optional[str] = None) -> AttentionUse:
    """Transformer Engine's attention backend module `class_name` as an AttentionUse (the cuDNN version TE loaded
    is part of the name: it is what decides whether FusedAttention can run)."""
    kind = _TE_BACKENDS.get(class_name, "none")
    return AttentionUse(f"TE {class_name}" + (f" (TE's cuDNN {cudnn})" if cudnn else ""), kind)


def worst_kind(uses: Sequence[AttentionUse]) -> str:
    """The worst attention kind among `uses`; "none" when nothing was seen."""
    if not uses:
        return "none"
    return max((u.kind for u in uses), key=ATTENTION_KINDS.index)


# --------------------------------------------------------------------------------------------- versions
def format_cudnn(version: Optional[int]) -> Optional[str]:
    """cuDNN's integer version as text: cuDNN 9 encodes major*10000 + minor*100 + patch (91900 = 9.19.0),
    cuDNN 8 major*1000 + minor*100 + patch."""
    if not version:
        return None
    major, rest = (version // 10000, version % 10000) if version >= 10000 else (version // 1000, version % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def torch_cudnn_version() -> Optional[str]:
    return format_cudnn(torch.backends.cudnn.version()) if torch.cuda.is_available() else None


def te_cudnn_version() -> Optional[str]:
    """The cuDNN that Transformer Engine loaded (it may differ from torch's: TE finds its own through CUDNN_PATH,
    CUDNN_HOME or the system's library path), or None without TE."""
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version
    except Exception:  # TE absent or unusable: there is no TE cuDNN to report
        return None
    return ".".join(str(v) for v in get_cudnn_version())


# --------------------------------------------------------------------------------------------- observation
class _SdpaSpy(TorchFunctionMode):
    """Sees every torch call while active; records the kernel of each attention call."""

    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "scaled_dot_product_attention":
            q, k, v = args[:3]
            choice = torch._fused_sdp_choice(*args, **kwargs)
            self.record(sdpa_use(choice, q.device.type))
        elif name in _ATEN_ATTENTION:
            what, kind = _ATEN_ATTENTION[name]
            self.record(AttentionUse(f"torch {what} (direct call)", kind))
        return func(*args, **kwargs)


def _is_megatron_dot_product_attention(module) -> bool:
    cls = type(module)
    return cls.__name__ == "DotProductAttention" and cls.__module__.startswith("megatron.core")


class BackendProbe:
    """Records which attention implementations run inside the `with` block (any number of forwards)."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        self.models = list(models)
        self.seen: Dict[AttentionUse, int] = {}
        self._stack: Optional[contextlib.ExitStack] = None

    def _record(self, use: AttentionUse) -> None:
        self.seen[use] = self.seen.get(use, 0) + 1

    def __enter__(self) -> "BackendProbe":
        stack = contextlib.ExitStack()
        te_cudnn = None
        for model in self.models:
            for module in model.modules():
                cls = type(module)
                if cls.__name__ in _TE_BACKENDS and cls.__module__.startswith("transformer_engine"):
                    te_cudnn = te_cudnn or te_cudnn_version()
                    use = te_use(cls.__name__, te_cudnn)
                elif _is_megatron_dot_product_attention(module):
                    use = AttentionUse("megatron-core DotProductAttention (materialized scores)", "unfused")
                elif hasattr(module, "observed_attention"):  # a Litespark attention that says what it runs (NSA)
                    use = None
                else:
                    continue
                handle = module.register_forward_hook(
                    lambda mod, inputs, out, use=use: self._record(use or mod.observed_attention(inputs[0])))
                stack.callback(handle.remove)
        stack.enter_context(_SdpaSpy(self._record))
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self._stack = None

    @property
    def attention(self) -> List[AttentionUse]:
        return list(self.seen)

    def report(self, models=None, config=None, requested: Optional[dict] = None, device_type: str = "cuda",
               cross_entropy: Optional[str] = None, rms_norm: Optional[str] = None,
               rope: Optional[str] = None, output_layer: Optional[str] = None,
               optimizer: Optional[str] = None) -> "Health":
        """`cross_entropy`: the loss a GPTModel output processor runs instead of the config's (Litespark's kernel,
        kernels/cross_entropy.cross_entropy_path); `rms_norm`: the norm kernel the layers run where it is Litespark's
        (kernels/rms_norm.rms_norm_path); `rope`: the same for the QKV split + RoPE (kernels/qkv_rope.qkv_rope_path);
        `output_layer`: the FP8 output layer's path (kernels/fp8_logits.fp8_logits_path), which computes the loss
        with Litespark's cross-entropy kernels too; `optimizer`: the Adam step's path where it is Litespark's
        (kernels/adam.adam_path)."""
        fusions = fusion_states(models or self.models, config, device_type) if config is not None else {}
        if output_layer is not None:
            fusions["output_layer"] = output_layer.replace("litespark", "litespark-fp8", 1)
            cross_entropy = output_layer
        if cross_entropy is not None:
            fusions["cross_entropy"] = cross_entropy
        if rms_norm is not None:
            fusions["rms_norm"] = rms_norm
        if rope is not None:
            fusions["rope"] = rope
        if optimizer is not None:
            fusions["optimizer"] = optimizer
        return assess(self.attention, fusions, requested or {}, device_type)


# --------------------------------------------------------------------------------------------- fused paths
def cross_entropy_state(config) -> str:
    """'te' / 'native' (the fused vocab-parallel cross-entropy megatron-core's GPTModel runs) or 'off'. (Litespark's,
    'litespark', runs outside the config: BackendProbe.report's `cross_entropy`.)"""
    if not getattr(config, "cross_entropy_loss_fusion", False):
        return "off"
    return getattr(config, "cross_entropy_fusion_impl", "native")


def rope_state(models, config, device_type: str) -> str:
    """Which RoPE the model runs: 'te' (TE's fused kernel), 'compiled', 'unfused' or 'n/a' (no rotary embedding).
    megatron-core decides it from config.apply_rope_fusion; the Litespark attention adds a compiled kernel on GPUs
    without TE (layers/elementwise.py)."""
    kinds = {getattr(m, "position_embedding_type", None) for model in models for m in model.modules()}
    if not kinds & {"rope", "mrope", "yarn"}:
        return "n/a"
    if getattr(config, "apply_rope_fusion", False):
        return "te"
    if device_type == "cuda" and _has_litespark_attention(models) and not getattr(config, "multi_latent_attention",
                                                                                   False):
        from .layers.elementwise import te_rope_available

        if not te_rope_available() and not config.rotary_interleaved:
            return "compiled"
    return "unfused"


def _has_litespark_attention(models) -> bool:
    from .layers import LitesparkSelfAttention

    return any(isinstance(m, LitesparkSelfAttention) for model in models for m in model.modules())


def wgrad_fusion_counts(models) -> tuple:
    """(fused, total) trainable linears whose weight gradient is accumulated into main_grad inside the GEMM:
    TE's `fuse_wgrad_accumulation`, megatron-core's `gradient_accumulation_fusion`."""
    fused = total = 0
    for model in models:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.nn.Parameter) or not weight.requires_grad:
                continue
            if hasattr(module, "fuse_wgrad_accumulation"):
                flag = module.fuse_wgrad_accumulation
            elif hasattr(module, "gradient_accumulation_fusion"):
                flag = module.gradient_accumulation_fusion
            else:
                continue
            total += 1
            fused += bool(flag)
    return fused, total


def fusion_states(models, config, device_type: str) -> Dict[str, str]:
    fused, total = wgrad_fusion_counts(models)
    # no trainable linear (--peft lora|dora: the adapters are no fused linears): no weight gradient to accumulate
    wgrad = "n/a" if total == 0 else "off" if fused == 0 else "on" if fused == total else \
        f"partial ({fused} of {total} linears)"
    states = dict(cross_entropy=cross_entropy_state(config), rope=rope_state(models, config, device_type),
                  wgrad_accumulation=wgrad)
    if _has_op_fuser_mlp(models):
        states["mlp"] = "te-ops"
    swiglu = {m.swiglu_ran for model in models for m in model.modules() if getattr(m, "swiglu_ran", None)}
    if swiglu:  # --litespark-swiglu: what the MLPs' activations ran (layers/mlp.py)
        states["swiglu"] = " + ".join(sorted(swiglu))
    return states


def _has_op_fuser_mlp(models) -> bool:
    """Whether an MLP runs as Transformer Engine's op sequence (--use-transformer-engine-op-fuser: megatron-core's
    TEFusedMLP, stock's or the Litespark one built on it). By class name: the class exists only where TE imports."""
    return any(any(c.__name__ == "TEFusedMLP" for c in type(m).__mro__) for model in models for m in model.modules())


def requested_fusions(args) -> Dict[str, bool]:
    """The fused paths a run's flags ask for (Megatron-LM's flag names): cross-entropy only when asked (megatron-core's
    fused one or Litespark's), RoPE and weight-gradient accumulation unless switched off (--no-rope-fusion,
    --no-gradient-accumulation-fusion). MLA's plain RoPE has no fused kernel (megatron-core fuses only its YaRN
    variant): nothing to ask for there."""
    rope = getattr(args, "apply_rope_fusion", getattr(args, "rope_fusion", True)) and \
        not getattr(args, "multi_latent_attention", False)
    cross_entropy = getattr(args, "cross_entropy_loss_fusion", False) or getattr(args, "litespark_cross_entropy", False)
    return dict(cross_entropy=bool(cross_entropy), rope=bool(rope),
                wgrad_accumulation=bool(getattr(args, "gradient_accumulation_fusion", True)),
                swiglu=bool(getattr(args, "litespark_swiglu", False)))


# --------------------------------------------------------------------------------------------- the verdict
@dataclass
class Health:
    attention: List[str]                    # the backends seen, in words
    attention_kind: str                     # the worst kind seen (ATTENTION_KINDS)
    fusions: Dict[str, str] = field(default_factory=dict)
    degraded: List[str] = field(default_factory=list)  # why this system is not at its best; empty when healthy
    device_type: str = "cuda"

    @property
    def ok(self) -> bool:
        return not self.degraded

    def summary(self) -> str:
        """One line: attention and fused paths."""
        text = "attention " + (" + ".join(self.attention) or "none seen")
        if self.fusions:
            text += "; fused: " + ", ".join(f"{FUSION_NAMES[k]} {v}" for k, v in self.fusions.items())
        return text

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Health":
        return cls(**d)


def from_metrics(records: Sequence[dict]) -> Optional[Health]:
    """The health a run logged into its metrics.jsonl (the trainer writes one "health" record on its first step),
    or None if it logged none."""
    record = next((r for r in records if r.get("kind") == "health"), None)
    if record is None:
        return None
    return Health.from_dict({k: record[k] for k in ("attention", "attention_kind", "fusions", "degraded",
                                                      "device_type")})


FUSION_NAMES = {"cross_entropy": "cross-entropy", "rope": "RoPE", "wgrad_accumulation": "wgrad-accumulation",
                "rms_norm": "RMSNorm", "mlp": "MLP", "swiglu": "SwiGLU", "output_layer": "output layer", "optimizer": "Adam"}


def assess(attention: Sequence[AttentionUse], fusions: Dict[str, str], requested: Dict[str, bool],
           device_type: str) -> Health:
    """The verdict on what ran. Degraded: attention that materializes the score matrix or that was never seen;
    on a GPU, a fused path that was asked for (requested[name] true) but is off."""
    kind = worst_kind(attention)
    degraded = []
    if kind == "none":
        degraded.append("no attention kernel ran" if not attention else
                        "attention: " + " + ".join(u.backend for u in attention if u.kind == "none"))
    elif kind not in HEALTHY_ATTENTION:
        slow = [u.backend for u in attention if u.kind not in HEALTHY_ATTENTION]
        degraded.append(f"unfused attention: {' + '.join(slow)}")
    if device_type == "cuda":
        if requested.get("cross_entropy") and fusions.get("cross_entropy") == "off":
            degraded.append("cross-entropy fusion asked for but off")
        if requested.get("rope") and fusions.get("rope") == "unfused":
            degraded.append("RoPE fusion asked for but RoPE runs unfused")
        if requested.get("swiglu") and "litespark-fp8" not in fusions.get("swiglu", ""):
            degraded.append("Litespark's FP8 SwiGLU asked for but no layer ran it")
        wgrad = fusions.get("wgrad_accumulation", "n/a")
        if requested.get("wgrad_accumulation") and wgrad != "on" and wgrad != "n/a":
            degraded.append(f"weight-gradient accumulation fusion asked for but {wgrad}")
    return Health([u.backend for u in attention], kind, dict(fusions), degraded, device_type)


# --------------------------------------------------------------------------------------------- start-up check
def te_attention_check(head_dim: int, num_heads: int, num_kv_heads: int) -> Optional[str]:
    """On a GPU with Transformer Engine: run TE's DotProductAttention once on a small causal bf16 input of the
    model's head shape and return one warning line if it did not pick a fused kernel (saying which cuDNN TE loaded
    and which torch loaded), else None. None where there is no GPU or no TE: there is nothing to check."""
    if not torch.cuda.is_available():
        return None
    try:
        import transformer_engine.pytorch as te
    except Exception:  # TE absent or unusable: the caller reports TE's absence where it matters
        return None
    heads, kv = max(num_heads, 1), max(num_kv_heads, 1)
    dpa = te.DotProductAttention(heads, head_dim, num_gqa_groups=kv, attn_mask_type="causal",
                                 qkv_format="sbhd").cuda()
    q = torch.randn(128, 1, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(128, 1, kv, head_dim, device="cuda", dtype=torch.bfloat16)
    probe = BackendProbe([dpa])
    error = None
    with probe:
        try:
            dpa(q, k, k)
        except Exception as e:  # no backend at all: TE raises; that is the finding
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    kind = worst_kind(probe.attention)
    if kind in ("fused", "flash") and error is None:
        return None
    ran = " + ".join(u.backend for u in probe.attention) or "no backend" + (f" ({error})" if error else "")
    return (f"Transformer Engine's fused attention is unavailable here: for head dim {head_dim} it ran {ran}; "
            f"TE loaded cuDNN {te_cudnn_version() or 'unknown'}, torch loaded cuDNN {torch_cudnn_version()} "
            "(a mix fails to load cuDNN's sub-libraries): point CUDNN_PATH at torch's cuDNN before starting, "
            "export CUDNN_PATH=\"$(python -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])')\"")
