"""The backend probe: what attention and fused paths a model really ran, and the verdict on it. Synthetic cases for the
classification (fused / flash / efficient / unfused / none), the probe on real torch calls on the CPU, and on a GPU
with Transformer Engine the real thing."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from litespark_megatron import backend_probe
from litespark_megatron.backend_probe import AttentionUse, BackendProbe, assess, sdpa_use, te_use

FUSED = dict(cross_entropy="te", rope="te", wgrad_accumulation="on")
ASKED = dict(cross_entropy=True, rope=True, wgrad_accumulation=True)


@pytest.mark.parametrize("choice, device, backend, kind", [
    (3, "cuda", "torch SDPA cuDNN", "fused"),
    (1, "cuda", "torch SDPA FlashAttention", "flash"),
    (2, "cuda", "torch SDPA memory-efficient", "efficient"),
    (0, "cuda", "torch SDPA math (materialized scores)", "unfused"),
    (-1, "cuda", "torch SDPA no kernel", "none"),
    (1, "cpu", "torch SDPA FlashAttention (CPU)", "flash"),
])
def test_sdpa_kernels_are_classified(choice, device, backend, kind):
    assert sdpa_use(choice, device) == AttentionUse(backend, kind)


def test_sdpa_backend_numbers_are_torchs():
    # sdpa_use maps the integers torch._fused_sdp_choice returns: they must still mean these backends.
    assert [int(b) for b in (SDPBackend.MATH, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                             SDPBackend.CUDNN_ATTENTION, SDPBackend.ERROR)] == [0, 1, 2, 3, -1]


@pytest.mark.parametrize("name, kind", [("FusedAttention", "fused"), ("FlashAttention", "flash"),
                                        ("UnfusedDotProductAttention", "unfused"), ("SomethingNew", "none")])
def test_te_backends_are_classified(name, kind):
    use = te_use(name, "9.14.0")
    assert use.kind == kind and use.backend == f"TE {name} (TE's cuDNN 9.14.0)"


@pytest.mark.parametrize("uses, healthy", [
    ([AttentionUse("TE FusedAttention", "fused")], True),
    ([AttentionUse("torch SDPA FlashAttention", "flash")], True),
    ([AttentionUse("torch SDPA memory-efficient", "efficient")], True),
    ([AttentionUse("TE FusedAttention", "fused"), AttentionUse("TE UnfusedDotProductAttention", "unfused")], False),
    ([AttentionUse("torch SDPA no kernel", "none")], False),
    ([], False),
])
def test_attention_verdict(uses, healthy):
    verdict = assess(uses, FUSED, ASKED, "cuda")
    assert verdict.ok is healthy, verdict
    if not uses:
        assert verdict.degraded == ["no attention kernel ran"] and verdict.attention_kind == "none"
    elif not healthy and verdict.attention_kind == "unfused":
        assert verdict.degraded == ["unfused attention: TE UnfusedDotProductAttention"]


@pytest.mark.parametrize("fusions, asked, device, reason", [
    (dict(FUSED, cross_entropy="off"), ASKED, "cuda", "cross-entropy fusion asked for but off"),
    (dict(FUSED, rope="unfused"), ASKED, "cuda", "RoPE fusion asked for but RoPE runs unfused"),
    (dict(FUSED, wgrad_accumulation="partial (3 of 4 linears)"), ASKED, "cuda",
     "weight-gradient accumulation fusion asked for but partial (3 of 4 linears)"),
    (dict(FUSED, wgrad_accumulation="off"), ASKED, "cuda",
     "weight-gradient accumulation fusion asked for but off"),
    (dict(FUSED, rope="unfused", cross_entropy="off"), dict(ASKED, rope=False, cross_entropy=False), "cuda", None),
    (dict(FUSED, rope="compiled"), ASKED, "cuda", None),  # the Litespark layer's own fused RoPE on GPUs without TE
    (dict(FUSED, rope="n/a"), ASKED, "cuda", None),  # NoPE
    (dict(cross_entropy="off", rope="unfused", wgrad_accumulation="off"), ASKED, "cpu", None),  # none exists there
])
def test_fused_paths_asked_for_but_off_are_degraded_on_gpus(fusions, asked, device, reason):
    verdict = assess([AttentionUse("torch SDPA cuDNN", "fused")], fusions, asked, device)
    assert verdict.degraded == ([reason] if reason else [])


def test_probe_sees_the_kernel_sdpa_picks_and_a_forced_fallback():
    q = torch.randn(1, 4, 16, 8)
    with BackendProbe([]) as probe:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert probe.attention == [AttentionUse("torch SDPA FlashAttention (CPU)", "flash")]
    # The fallback the lesson was about, on the CPU: only the math kernel allowed.
    with BackendProbe([]) as probe, sdpa_kernel(SDPBackend.MATH):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    report = probe.report(device_type="cpu")
    assert report.attention_kind == "unfused" and not report.ok
    assert report.degraded == ["unfused attention: torch SDPA math (materialized scores) (CPU)"]
    # Outside the block nothing is recorded any more.
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert sum(probe.seen.values()) == 1


def test_probe_hooks_transformer_engine_backend_modules_by_class():
    # A stand-in for TE's fallback module: the probe recognizes TE's backends by class name and package.
    Unfused = type("UnfusedDotProductAttention", (torch.nn.Module,),
                   {"forward": lambda self, x: x, "__module__": "transformer_engine.pytorch.attention.backends"})
    Elsewhere = type("FusedAttention", (torch.nn.Module,), {"forward": lambda self, x: x, "__module__": "mypkg"})
    model = torch.nn.Sequential(Unfused(), Elsewhere())
    with BackendProbe([model]) as probe:
        model(torch.zeros(1))
        model(torch.zeros(1))
    # The cuDNN TE loaded is part of the name (none without TE).
    assert probe.attention == [te_use("UnfusedDotProductAttention", backend_probe.te_cudnn_version())]
    assert probe.seen[probe.attention[0]] == 2
    model(torch.zeros(1))  # hooks removed on exit
    assert probe.seen[probe.attention[0]] == 2


def test_health_round_trips_through_metrics_records():
    verdict = assess([AttentionUse("torch SDPA cuDNN", "fused")], FUSED, ASKED, "cuda")
    records = [{"step": 0, "kind": "run"}, {"step": 1, "kind": "health", **verdict.to_dict()}]
    assert backend_probe.from_metrics(records) == verdict
    assert backend_probe.from_metrics(records[:1]) is None
    assert verdict.summary() == ("attention torch SDPA cuDNN; fused: cross-entropy te, RoPE te, "
                                 "wgrad-accumulation on")


def test_wgrad_accumulation_is_not_applicable_without_a_trainable_linear():
    """--peft lora|dora freezes every linear (the adapters are plain parameters): nothing to accumulate, not a fused
    path that is off (which a run asking for it would report as degraded)."""
    linear = torch.nn.Linear(2, 2)
    linear.gradient_accumulation_fusion = True
    assert backend_probe.fusion_states([linear], SimpleNamespace(), "cuda")["wgrad_accumulation"] == "on"
    linear.requires_grad_(False)
    assert backend_probe.fusion_states([linear], SimpleNamespace(), "cuda")["wgrad_accumulation"] == "n/a"


def test_requested_fusions_follow_megatron_flag_names():
    from types import SimpleNamespace

    assert backend_probe.requested_fusions(SimpleNamespace()) == dict(cross_entropy=False, rope=True,
                                                                      wgrad_accumulation=True, swiglu=False)
    asked = SimpleNamespace(cross_entropy_loss_fusion=True, apply_rope_fusion=False,
                            gradient_accumulation_fusion=False)
    assert backend_probe.requested_fusions(asked) == dict(cross_entropy=True, rope=False, wgrad_accumulation=False,
                                                          swiglu=False)
    assert backend_probe.requested_fusions(SimpleNamespace(litespark_swiglu=True))["swiglu"] is True
    mla = SimpleNamespace(multi_latent_attention=True)
    assert backend_probe.requested_fusions(mla)["rope"] is False


@pytest.mark.parametrize("encoded, text", [(91900, "9.19.0"), (91400, "9.14.0"), (8907, "8.9.7"), (0, None)])
def test_cudnn_versions_are_decoded(encoded, text):
    assert backend_probe.format_cudnn(encoded) == text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU answer")
def test_te_attention_check_has_nothing_to_check_without_a_gpu():
    assert backend_probe.te_attention_check(64, 8, 2) is None


def _te_importable():
    from litespark_megatron.platform import te_importable

    return te_importable()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _te_importable(),
                    reason="needs a CUDA GPU with Transformer Engine")
def test_te_fused_attention_runs_on_this_gpu():
    """On the GPU machines: TE's attention runs its cuDNN fused kernel (on Hopper TE prefers it over flash), and the
    start-up check stays silent. Fails where TE loaded another cuDNN than torch (CUDNN_PATH unset)."""
    import transformer_engine.pytorch as te

    dpa = te.DotProductAttention(8, 128, num_gqa_groups=2, attn_mask_type="causal", qkv_format="sbhd").cuda()
    q = torch.randn(256, 2, 8, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(256, 2, 2, 128, device="cuda", dtype=torch.bfloat16)
    with BackendProbe([dpa]) as probe:
        dpa(q, k, k)
    kinds = {u.kind for u in probe.attention}
    assert kinds <= {"fused", "flash"} and kinds, probe.attention
    assert backend_probe.te_attention_check(128, 8, 2) is None
    assert backend_probe.te_cudnn_version() == backend_probe.torch_cudnn_version()


def test_the_fp8_swiglu_asked_for_and_not_run_is_degraded():
    """--litespark-swiglu where every MLP ran TE's SwiGLU (no layer in FP8 under delayed scaling): flagged; where the
    kernel ran: healthy, the record names what ran."""
    from types import SimpleNamespace

    use = [backend_probe.AttentionUse("cuDNN (torch SDPA)", "fused")]
    asked = dict(ASKED, swiglu=True)
    ran = lambda what: torch.nn.ModuleDict({"mlp": torch.nn.Module()}).apply(lambda m: setattr(m, "swiglu_ran", what))
    for what, degraded in (("te", ["Litespark's FP8 SwiGLU asked for but no layer ran it"]), ("litespark-fp8", [])):
        fusions = backend_probe.fusion_states([ran(what)], SimpleNamespace(), "cuda")
        assert fusions["swiglu"] == what
        health = backend_probe.assess(use, dict(fusions, cross_entropy="native", rope="te"), asked, "cuda")
        assert health.degraded == degraded
