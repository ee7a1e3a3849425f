"""The Litespark kernels' default: a kernel flag left out is on where the kernels were measured (a GPU with Triton,
--spec litespark on the te backend, BF16 or FP8, pretraining without CP; RMSNorm not under FP8 unless asked for, the
FP8 SwiGLU under FP8 with delayed scaling only) and off everywhere else; a flag given either way is obeyed
(arguments.resolve_kernels_auto)."""
import pytest

import litespark_megatron.kernels
from test_arguments import CPU, GPU_TE, TINY, check
from litespark_megatron import arguments
from litespark_megatron.arguments import ConfigError

KERNELS = ("litespark_cross_entropy", "litespark_rmsnorm", "litespark_rope", "litespark_swiglu")
TE_BF16 = TINY + ["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16"]
FP8 = ["--fp8-format", "hybrid"]


@pytest.fixture
def triton(monkeypatch):
    """A GPU with Triton, as far as the checks can tell (this machine may have neither)."""
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: True)


def kernels(argv, plat=GPU_TE):
    args = check(argv, plat)
    return tuple(getattr(args, k) for k in KERNELS)


def test_the_measured_bf16_setting_runs_the_three_bf16_kernels(triton):
    assert kernels(TE_BF16) == (True, True, True, False)


def test_fp8_runs_the_loss_rope_and_fp8_swiglu_and_keeps_tes_norm(triton):
    """Under FP8 TE's fused norm stays the default (the Litespark norm's FP8 path is asked for: not measured yet); the
    FP8 SwiGLU runs under delayed scaling (Megatron-LM's default recipe) and nowhere else, nor beside the op fuser."""
    assert kernels(TE_BF16 + FP8) == (True, False, True, True)
    assert kernels(TE_BF16 + FP8 + ["--litespark-rmsnorm"]) == (True, True, True, True)
    assert kernels(TE_BF16 + FP8 + ["--fp8-recipe", "tensorwise"]) == (True, False, True, False)
    assert kernels(TE_BF16 + FP8 + ["--use-transformer-engine-op-fuser"]) == (True, False, True, False)
    assert kernels(TE_BF16 + FP8 + ["--no-litespark-swiglu"]) == (True, False, True, False)


@pytest.mark.parametrize("flags, plat", [
    ([], CPU),  # a CPU: every layer runs its reference, and so do these
    (["--spec", "stock-te"], GPU_TE),  # a stock row stays stock
    (["--transformer-impl", "local"], GPU_TE),  # not measured on the local backend
    (["--fp16"], GPU_TE),
    (["--context-parallel-size", "2"], GPU_TE),
    (["--peft", "lora", "--peft-base", "ckpt"], GPU_TE),
    (["--sft"], GPU_TE),
    (["--embedded-sft", "stdlib"], GPU_TE),
], ids=["cpu", "stock", "local", "fp16", "cp", "peft", "megatron-sft", "sft-rows"])
def test_outside_the_measured_setting_all_are_off(triton, flags, plat):
    argv = [a for a in TE_BF16 if a != "--bf16"] if "--fp16" in flags else TE_BF16
    args = arguments.resolve(argv + flags, plat)
    if "--context-parallel-size" in flags:
        args.world_size = 2
    arguments.resolve_kernels_auto(args, plat)
    assert tuple(getattr(args, k) for k in KERNELS) == (False, False, False, False)


def test_a_gpu_without_triton_runs_none_and_refuses_nothing(monkeypatch):
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    assert kernels(TE_BF16) == (False, False, False, False)
    assert kernels(TE_BF16 + FP8) == (False, False, False, False)


@pytest.mark.parametrize("flags, expected", [
    (["--cross-entropy-loss-fusion"], (False, True, True, False)),  # megatron-core's fused loss asked for: it runs
    (["--qk-layernorm"], (True, True, False, False)),  # norms between the split and RoPE: megatron-core's path
    (["--no-litespark-rope"], (True, True, False, False)),
    (["--no-litespark-cross-entropy", "--no-litespark-rmsnorm"], (False, False, True, False)),
], ids=["megatron-fused-loss", "qk-layernorm", "no-rope", "no-loss-no-norm"])
def test_a_kernel_that_cannot_run_or_is_turned_off_is_off_alone(triton, flags, expected):
    assert kernels(TE_BF16 + flags) == expected


def test_a_kernel_asked_for_is_still_refused_where_it_cannot_run(triton):
    with pytest.raises(ConfigError) as e:
        kernels(TE_BF16 + FP8 + ["--fp8-recipe", "tensorwise", "--litespark-rmsnorm"])
    assert str(e.value).startswith("--litespark-rmsnorm with --fp8-format on the te backend writes delayed-scaling")


def test_a_config_file_says_off_with_false_and_on_with_true(triton, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("litespark-rope: false\nlitespark-rmsnorm: true\n")
    assert kernels(TE_BF16 + ["--config", str(config)]) == (True, True, False, False)
    assert arguments.as_flags({"litespark-rope": False}, "x.yaml") == ["--no-litespark-rope"]
    assert arguments.as_flags({"litespark-rope": True}, "x.yaml") == ["--litespark-rope"]


def test_a_planned_gpu_node_has_triton_whatever_this_machine_has(monkeypatch):
    """The planner and launch_check --assume-gpu check a run for a GPU node (torch's CUDA wheels ship Triton), so
    their plans run the kernels as that node would, even when planned on a machine without Triton."""
    from dataclasses import replace

    from litespark_megatron.apps.plan import platform_of
    from litespark_megatron.apps.gpus import accelerator

    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    assert platform_of(accelerator("H100")).triton is True
    assert kernels(TE_BF16, replace(GPU_TE, triton=True)) == (True, True, True, False)
    assert kernels(TE_BF16, GPU_TE) == (False, False, False, False)  # this machine's GPU, as it is
