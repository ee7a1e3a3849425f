"""--use-transformer-engine-op-fuser in the Litespark layer: its MLP (norm, fc1, SwiGLU, fc2) runs as one sequence
of Transformer Engine ops (layers/mlp.py, megatron-core's TEFusedMLP), the flag a stock user already gives; refused
where that MLP cannot be built; on a GPU it resumes a checkpoint of the plain MLP and trains as it does."""
import pytest
import torch

import litespark_megatron.kernels
from conftest import ok, records, train
from test_arguments import GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError

FUSER = ["--use-transformer-engine-op-fuser"]
TE_BF16 = TINY + ["--spec", "litespark", "--transformer-impl", "transformer_engine", "--bf16"]


@pytest.fixture
def triton(monkeypatch):
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: True)


@pytest.mark.parametrize("flags, message", [
    (["--transformer-impl", "local"], "--use-transformer-engine-op-fuser runs the MLP as Transformer Engine ops: it "
                                      "needs --transformer-impl transformer_engine"),
    (["--peft", "lora", "--peft-base", "ckpt"], "--use-transformer-engine-op-fuser with --peft lora: the fused MLP "
                                                "reads fc1's and fc2's weights itself, past their adapters; drop one"),
    (["--litespark-rmsnorm"], "--litespark-rmsnorm with --use-transformer-engine-op-fuser: the fused MLP runs its "
                              "norm as one of Transformer Engine's ops; drop one"),
], ids=["local", "peft", "litespark-rmsnorm"])
def test_where_the_fused_mlp_cannot_be_built_the_flag_is_refused(triton, flags, message):
    argv = TE_BF16 + FUSER + flags
    if "local" in flags:
        argv = [a for a in argv if a != "--bf16"]
    with pytest.raises(ConfigError) as err:
        check(argv, GPU_TE)
    assert str(err.value) == message


def test_the_rmsnorm_kernels_default_leaves_the_norm_to_the_fuser(triton):
    """BF16 on the te backend turns Litespark's norm on by default; the op fuser owns the MLP's norm, so the default
    turns it off there (and the other two kernels stay on)."""
    args = check(TE_BF16 + FUSER, GPU_TE)
    assert (args.litespark_cross_entropy, args.litespark_rmsnorm, args.litespark_rope) == (True, False, True)


def test_the_spec_refuses_a_fused_mlp_without_tes_norm_and_linear():
    from litespark_megatron.specs import get_litespark_layer_spec

    for kw in ({"backend": "local"}, {"backend": "te", "norm": "litespark"}, {"backend": "te", "adapters": True}):
        with pytest.raises(ConfigError, match="needs the te backend, without Litespark's RMSNorm or adapters"):
            get_litespark_layer_spec(mlp_op_fuser=True, **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the op fuser runs Transformer Engine's ops on a GPU")
@pytest.mark.parametrize("precision", [["--bf16"], ["--bf16", "--fp8-format", "hybrid"]], ids=["bf16", "fp8"])
def test_the_fused_mlp_resumes_the_plain_mlps_checkpoint_and_trains_as_it_does(tmp_path, precision):
    """A checkpoint of the plain Litespark MLP (step 2) resumes under the op fuser (the same parameters and keys)
    and trains step 3 as the run without it, to the two paths' rounding; the record names the fused MLP."""
    pytest.importorskip("transformer_engine.pytorch")
    from megatron.core.extensions.transformer_engine import TEFusedMLP
    from litespark_megatron.layers.mlp import fused_mlp_class
    from litespark_megatron.specs import get_litespark_layer_spec

    assert issubclass(fused_mlp_class(), TEFusedMLP)
    assert get_litespark_layer_spec("te", mlp_op_fuser=True).submodules.mlp.module is fused_mlp_class()
    te = ["--model", "tiny", "--mock-data", "--seq-length", "128", "--global-batch-size", "8", "--micro-batch-size",
          "4", "--lr", "3e-3", "--train-iters", "3", "--eval-iters", "0", "--eval-interval", "100", "--seed", "1234",
          "--log-interval", "1", "--spec", "litespark", "--transformer-impl", "transformer_engine", *precision]
    ok(train(1, *te, "--save", tmp_path / "ckpt", "--save-interval", "2", "--exit-interval", "2",
             "--metrics-file", tmp_path / "plain.jsonl"))
    proc = ok(train(1, *te, *FUSER, "--load", tmp_path / "ckpt", "--metrics-file", tmp_path / "fused.jsonl"))
    ok(train(1, *te, "--metrics-file", tmp_path / "fresh.jsonl"))
    fused, fresh = (records(tmp_path / f"{name}.jsonl") for name in ("fused", "fresh"))
    got = [r["loss"] for r in fused if r["kind"] == "train"]
    want = [r["loss"] for r in fresh if r["kind"] == "train" and r["step"] == 3]
    assert len(got) == 1 and abs(got[0] - want[0]) <= 1e-2 * abs(want[0]), (got, want)
    assert [r for r in fused if r["kind"] == "health"][0]["fusions"]["mlp"] == "te-ops"
    assert "MLP te-ops" in proc.stdout and "DEGRADED" not in proc.stdout, proc.stdout[-3000:]


@pytest.mark.parametrize("spec", ["litespark", "stock-te"])
def test_an_fp8_delayed_scaling_run_that_saves_is_told_its_resume_is_not_bit_exact(triton, capsys, spec):
    """Measured on an H200 (docs/benchmarks/2026-11-27-op-fuser-stock-rows-fp8-resume-h200.md): stopped at step 3
    and resumed, such a run differs from the uninterrupted one from step 4 on, stock's layer as the Litespark one."""
    argv = TINY + ["--spec", spec, "--transformer-impl", "transformer_engine", "--bf16", "--fp8-format", "hybrid"]
    check(argv + FUSER, GPU_TE)
    assert capsys.readouterr().out == ""  # no checkpoints, nothing to say
    check(argv + FUSER + ["--save", "ckpt", "--save-interval", "10"], GPU_TE)
    assert "the MLP's FP8 delayed-scaling state (its amax history) is not in the checkpoints" in capsys.readouterr().out
    check(argv + ["--save", "ckpt", "--save-interval", "10"], GPU_TE)
    assert capsys.readouterr().out == ""
