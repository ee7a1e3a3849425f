"""The benchmark's hf-liger peer (HF transformers + Liger-Kernel): its two refusals, the check that every Liger
kernel took on the model (a peer measured on HF's own modules must fail, not pass as Liger), and on a GPU a run
whose loss is HF eager's and whose row names the kernels."""
import importlib.util
import json
import sys

import pytest

from litespark_megatron.apps import benchmark, hf_model
from litespark_megatron.arguments import UserError, resolve_quietly

HAVE_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAVE_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def test_without_liger_kernel_the_row_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # makes `import liger_kernel...` raise ImportError
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    with pytest.raises(UserError, match=r"^hf-liger needs Liger-Kernel, not importable here \(.*\): "
                                        r"pip install liger-kernel$"):
        benchmark.patch_liger(cuda=True)


@pytest.mark.skipif(not HAVE_LIGER, reason="needs liger-kernel (pip install liger-kernel)")
def test_on_a_cpu_hf_liger_is_refused():
    with pytest.raises(UserError, match="^hf-liger runs Liger-Kernel's Triton kernels, which need a CUDA GPU; on a "
                                        "CPU, measure hf-eager$"):
        benchmark.patch_liger(cuda=False)


@pytest.mark.skipif(not (HAVE_LIGER and HAVE_TRANSFORMERS), reason="needs liger-kernel and transformers")
def test_liger_fusions_checks_each_kernel_took(monkeypatch):
    import torch
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers.models.llama import modeling_llama

    args = resolve_quietly(["--model", "tiny"])
    with pytest.raises(RuntimeError, match=r"Liger-Kernel did not take on the HF model \(this transformers "
                                           r"version\?\): RMSNorm \(0 of 9 norms\), SwiGLU \(0 of 4 MLPs\), RoPE, "
                                           r"fused linear cross-entropy$"):
        benchmark.liger_fusions(hf_model.build_hf_llama(args, False, torch.device("cpu")))
    # Liger patches HF's classes in place: restored after this test (monkeypatch undoes its own setattr).
    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    monkeypatch.setattr(modeling_llama.LlamaForCausalLM, "forward", modeling_llama.LlamaForCausalLM.forward)
    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                fused_linear_cross_entropy=True)
    model = hf_model.build_hf_llama(args, False, torch.device("cpu"))
    fusions, note = benchmark.liger_fusions(model)
    assert fusions == {"cross_entropy": "liger fused linear", "rope": "liger", "wgrad_accumulation": "n/a"}
    assert note.startswith("Liger-Kernel 0.") and note.endswith(": RMSNorm (9 norms), SwiGLU (4 MLPs), RoPE, fused "
                                                                "linear cross-entropy (logits never materialized)")
    # One kernel missing is named alone.
    model.model.norm.__class__ = torch.nn.Module
    with pytest.raises(RuntimeError, match=r": RMSNorm \(8 of 9 norms\)$"):
        benchmark.liger_fusions(model)


@pytest.mark.integration  # its processes start inside the package
@pytest.mark.gpu
def test_hf_liger_trains_as_hf_eager_does(tmp_path):
    """On a GPU: hf-liger and hf-eager from the same seed on the same tokens start at the same loss (Liger computes
    HF's function), and the row names Liger's kernels. On a CPU the row is the refusal, and the run exits 1."""
    import torch

    out = tmp_path / "bench"
    rc = benchmark.main(["--model", "tiny", "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size",
                         "4", "--steps", "2", "--warmup", "1", "--systems", "hf-eager,hf-liger", "--out", str(out)])
    rows = {r["system"]: r for r in json.loads((out / "benchmark.json").read_text())["systems"]}
    if not torch.cuda.is_available() or not HAVE_LIGER:
        assert rc == 1 and rows["hf-liger"]["status"] == "failed"
        return
    assert rc == 0, rows
    eager, liger = rows["hf-eager"], rows["hf-liger"]
    assert liger["health"]["fusions"]["cross_entropy"] == "liger fused linear"
    assert liger["health"]["degraded"] == []
    assert any(n.startswith("Liger-Kernel ") for n in liger["notes"])
    # The same weights and tokens through two bf16 implementations of one function: they differ by rounding only, a
    # half of bf16's relative step (2^-8) at most (passed on an H100; a peer with another function, e.g. another
    # RoPE layout, is off by far more)
    assert liger["loss_first"] == pytest.approx(eager["loss_first"], rel=2e-3)
    md = (out / "benchmark.md").read_text()
    assert "| hf-liger | bf16 (params, grads, AdamW states) | " in md and "liger fused linear / liger / n/a" in md
