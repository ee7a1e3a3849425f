"""Each CPU shim fixes a real failure of megatron-core 0.16.1 on a CPU-only torch: the scenario of each shim
fails without it (with that exact error) and passes with all of them."""
import pytest

from conftest import TESTS

ALL = ["dev", "rng", "misc", "mode", "spnorm", "optckpt", "moe"]

# scenario -> what megatron-core raises without its shim (exception text and where)
FAILURES = {
    "dev": ("Torch not compiled with CUDA enabled", "current_device"),
    "rng": ("Torch not compiled with CUDA enabled", "get_rng_state"),
    "misc": ("Torch not compiled with CUDA enabled", "synchronize"),
    "mode": ("Torch not compiled with CUDA enabled", "_get_megatron_optimizer_based_on_param_groups"),
    "spnorm": ("sequence parallel not supported by torch LayerNorm", "__new__"),
    "moe": ("torch.cuda.Stream requires CUDA support", ""),
}


@pytest.mark.parametrize("shim", list(FAILURES))
def test_shim_fixes_its_failure(shim, py):
    without = ",".join(s for s in ALL if s != shim)
    bad = py(TESTS / "shim_scenarios.py", shim, LITESPARK_CPU_SHIMS=without)
    assert bad.returncode == 1, f"{shim}: scenario passed without its shim:\n{bad.stdout}{bad.stderr[-2000:]}"
    message, where = FAILURES[shim]
    last = bad.stdout.strip().splitlines()[-1]
    assert last.startswith("FAILED") and message in last and where in last, last
    good = py(TESTS / "shim_scenarios.py", shim)
    assert good.returncode == 0 and good.stdout.strip().endswith("OK"), good.stdout + good.stderr[-3000:]


def test_shims_are_idempotent_and_selectable(py):
    code = ("import torch; from litespark_megatron import platform as p; a = p.apply_cpu_shims(); "
            "f = torch.cuda.current_device; b = p.apply_cpu_shims(); "
            "assert a == b and torch.cuda.current_device is f, (a, b); print(','.join(a))")
    proc = py("-c", code, LITESPARK_CPU_SHIMS="dev,misc")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "dev,misc"
    proc = py("-c", "from litespark_megatron import platform as p; p.apply_cpu_shims()", LITESPARK_CPU_SHIMS="dev,gpu")
    assert proc.returncode != 0 and "unknown shim(s) ['gpu']" in proc.stderr


def test_detect_on_this_machine():
    import torch

    from litespark_megatron import platform

    plat = platform.detect()
    if torch.cuda.is_available():
        assert plat.device_type == "cuda" and plat.dist_backend == "nccl"
    else:
        assert plat == platform.Platform("cpu", "gloo", False, False, "cpu")


WGRAD_FUSION = """
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear
from litespark_megatron import config, model as model_lib, platform

args = config.resolve(["--model", "tiny", "--seq-length", "32", "--vocab-size", "128"])
plat = platform.init_distributed(args)
cfg = model_lib.transformer_config(args, "local", plat.device_type)
assert cfg.gradient_accumulation_fusion is False  # CPU: no TE modules to fuse in
cfg.gradient_accumulation_fusion = True           # what a TE backend on a GPU without Apex asks for
kw = dict(config=cfg, init_method=torch.nn.init.zeros_, bias=False, gather_output=False)
try:
    ColumnParallelLinear(16, 16, **kw)
    print("BUILT WITHOUT CONTEXT")
except RuntimeError as e:
    print("REFUSED:", str(e).splitlines()[0][:80])
with platform.te_wgrad_fusion_without_apex():
    linear = ColumnParallelLinear(16, 16, **kw)
print("SWITCHED", platform.unfuse_megatron_linears(linear), linear.gradient_accumulation_fusion)
(chunk,) = model_lib.build_model(args, cfg, "local", 128)
fused = [n for n, m in chunk.named_modules() if getattr(m, "gradient_accumulation_fusion", False)]
print("FUSED AFTER BUILD", fused)
"""


def test_te_wgrad_fusion_without_apex_keeps_megatron_linears_unfused(py):
    """TE linears may fuse weight-gradient accumulation without Apex; megatron-core's own linears (the output layer)
    refuse the flag without Apex: build_model lifts the refusal and switches those linears back to unfused."""
    r = py("-c", WGRAD_FUSION)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    out = r.stdout
    assert "REFUSED: ColumnParallelLinear was called with gradient_accumulation_fusion set to True" in out, out
    assert "SWITCHED 1 False" in out and "FUSED AFTER BUILD []" in out, out
