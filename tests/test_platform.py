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


WGRAD_KERNEL = """
import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, layers
from litespark_megatron import config, model as model_lib, platform

args = config.resolve(["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--bf16"])
plat = platform.init_distributed(args)
kernel = platform.provide_wgrad_accumulation_kernel()
cfg = model_lib.transformer_config(args, "local", plat.device_type)
print("KERNEL", kernel, "FUSION", cfg.gradient_accumulation_fusion)
if kernel is not None:
    linear = ColumnParallelLinear(256, 384, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                                  gather_output=False).cuda()
    linear.weight.main_grad = torch.zeros(linear.weight.shape, dtype=torch.float32, device="cuda")
    x = torch.randn(64, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(64, 2, 384, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # two micro-batches accumulate
        linear(x)[0].backward(dy)
    want = 2 * (dy.reshape(-1, 384).double().t() @ x.detach().reshape(-1, 256).double())
    err = (linear.weight.main_grad.double() - want).abs().max().item() / want.abs().max().item()
    print("REL ERR", err, "GRAD", linear.weight.grad)
"""


def test_wgrad_accumulation_kernel_needs_apex_or_te(py):
    """megatron-core's own linears fuse weight-gradient accumulation only with Apex's kernel; without Apex it comes
    from TE's GEMM, and with neither (CPU) the fusion is off rather than refused. On a GPU with TE: main_grad
    holds the sum of two micro-batches' dY^T X (fp32 accumulation of bf16 products, relative error < 1e-2, i.e.
    bf16 inputs), and no bf16 .grad was written."""
    r = py("-c", WGRAD_KERNEL)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    first = r.stdout.splitlines()[0]
    import torch

    from litespark_megatron import platform

    if not torch.cuda.is_available():
        assert first == "KERNEL None FUSION False", r.stdout
        return
    assert first in ("KERNEL te FUSION True", "KERNEL apex FUSION True") or not platform.te_importable(), r.stdout
    if platform.te_importable():
        line = r.stdout.splitlines()[1]
        assert line.endswith("GRAD None") and float(line.split()[2]) < 1e-2, r.stdout


def test_megatron_linears_still_take_the_apex_kernel_by_name():
    """platform.provide_wgrad_accumulation_kernel replaces layers.fused_weight_gradient_mlp_cuda and the
    _grad_accum_fusion_available flag: if megatron-core renames either, or stops calling the two functions in its
    linears' backward, the shim no longer serves and this fails."""
    import inspect

    from megatron.core.tensor_parallel import layers

    source = inspect.getsource(layers)
    assert hasattr(layers, "_grad_accum_fusion_available")
    for call in ("fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(",
                 "fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16("):
        assert call in source, call
