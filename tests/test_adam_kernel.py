"""Litespark's Adam step (kernels/adam.py, --litespark-adam): the reference is Adam (torch's AdamW and Adam in fp64 to
fp32's rounding), its master weights' remainders hold the fp32 master exactly; the Triton kernel writes the
reference's bytes for every kind of tensors it takes (through Triton's interpreter on the CPU, compiled on a GPU);
each tensor it cannot take is one clear error; the flag is refused where megatron-core would not step TE's FusedAdam
with such tensors; on a GPU the optimizer steps as Transformer Engine's FusedAdam does and a run says it ran."""

import pytest
import torch

from conftest import child_env, free_port, losses, ok, records, run_interpreted, train
from test_arguments import CPU, GPU_TE, TINY, check
from litespark_megatron.arguments import ConfigError
import litespark_megatron.kernels
from litespark_megatron.kernels import adam as A

SHARED = """
import torch
from litespark_megatron.kernels import adam as A

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _tensors(how, param_dtype, grad_dtype, moment_dtype, sizes, seed=1, device="cpu"):
    g = torch.Generator(device="cpu").manual_seed(seed)
    params, grads, ms, vs, masters = [], [], [], [], []
    for n in sizes:
        master = torch.randn(n, generator=g) * 0.05
        if how == "remainders":
            p, r = A.split_master(master)
        elif how == "fp32":
            p, r = master.to(param_dtype), master.clone()
        else:
            p, r = master.to(param_dtype), None
        params.append(p.to(device))
        masters.append(None if r is None else r.to(device))
        grads.append((torch.randn(n, generator=g) * 1e-2).to(grad_dtype).to(device))
        ms.append((torch.randn(n, generator=g) * 1e-3).to(moment_dtype).to(device))
        vs.append((torch.rand(n, generator=g) * 1e-5).to(moment_dtype).to(device))
    return A.AdamTensors(how, params, grads, ms, vs, masters)


def _differing(kernel, how, dtypes, sizes, adam_w, steps, scale=None, device="cpu"):
    # Steps `kernel(tensors, hyper, scale)` and the reference on the same tensors; the lists whose bytes differ.
    got, want = (_tensors(how, *dtypes, sizes, device=device) for _ in range(2))
    for step in range(1, steps + 1):
        hyper = A.AdamHyper(**HYPER, step=step, adam_w_mode=adam_w)
        kernel(got, hyper, scale)
        for p, g, m, v, r in zip(want.params, want.grads, want.exp_avgs, want.exp_avg_sqs, want.masters):
            A.adam_reference(p, g, m, v, r, hyper, how, scale)
    lists = ("params", "exp_avgs", "exp_avg_sqs") + (("masters",) if how != "none" else ())
    return [name for name in lists if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                                              for a, b in zip(getattr(got, name), getattr(want, name)))]


def _master(t, i):
    if t.how == "remainders":
        return A.master_from_remainders(t.params[i], t.masters[i])
    return t.masters[i] if t.how == "fp32" else t.params[i].float()


# (how, parameter, gradient, moments, adam_w_mode): every kind of tensors megatron-core's precision-aware optimizer and
# its fp32 main parameters make, and TE's FusedAdam without master weights.
KINDS = [("remainders", "bfloat16", "bfloat16", "bfloat16", True),
         ("remainders", "bfloat16", "float32", "float32", False),
         ("fp32", "bfloat16", "float32", "bfloat16", True), ("fp32", "float16", "bfloat16", "float32", True),
         ("none", "float32", "float32", "float32", True), ("none", "bfloat16", "bfloat16", "bfloat16", False)]
"""
exec(SHARED)  # the same tensors here and in the interpreted process


# ----------------------------------------------------------------------------------- the reference and its masters
def test_remainders_hold_the_fp32_master_and_the_parameter_is_it_rounded_to_nearest():
    """Ties (a remainder of exactly half the parameter's last place) round away from zero, as TE's kernel does."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (200_000,), generator=g, dtype=torch.int64).to(torch.int32)
    master = bits.view(torch.float32)
    master = master[torch.isfinite(master) & (master.abs() < 3e38)]  # rounding up the largest finite is infinite
    master = torch.cat([master, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-40, -1e-40])])
    param, low = A.split_master(master)
    assert param.dtype == torch.bfloat16 and low.dtype == torch.int16
    tie = low == -2 ** 15
    assert 0 < tie.sum() < 10  # a few among random bits
    nearest = master.bfloat16().view(torch.int16)  # torch's: ties to even
    away = (master.view(torch.int32) >> 16).to(torch.int16) + 1  # the magnitude's next bf16
    assert torch.equal(param.view(torch.int16), torch.where(tie, away, nearest))
    assert torch.equal(A.master_from_remainders(param, low).view(torch.int32), master.view(torch.int32))


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_the_reference_is_adam(adam_w_mode):
    """fp32 parameters, three steps, against torch's AdamW (decoupled weight decay) / Adam (L2) in fp64: within a
    few fp32 roundings of the parameter's step."""
    torch.manual_seed(0)
    p64 = (torch.randn(1000) * 0.05).double().requires_grad_()
    opt = (torch.optim.AdamW if adam_w_mode else torch.optim.Adam)(
        [p64], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]), eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"])
    p, m, v = p64.detach().float().clone(), torch.zeros(1000), torch.zeros(1000)
    start = p.clone()
    for step in (1, 2, 3):
        grad = torch.randn(1000) * 1e-2
        p64.grad = grad.double()
        opt.step()
        A.adam_reference(p, grad, m, v, None, A.AdamHyper(**HYPER, step=step, adam_w_mode=adam_w_mode), "none")
    moved = (p64.detach() - start.double()).abs().max()
    assert ((p.double() - p64.detach()).abs().max() / moved).item() < 1e-5


# ----------------------------------------------------------------------------------- the Triton kernel
INTERPRETED = SHARED + """
import json
from litespark_megatron.kernels import adam_triton

out = {}
for how, param, grad, moment, adam_w, scale in [kind + (None,) for kind in KINDS] + [KINDS[0] + (0.37,)]:
    dtypes = [getattr(torch, d) for d in (param, grad, moment)]
    sizes = [5, 1, 700] + ([adam_triton.CHUNK + 37] if how == "remainders" and adam_w else [])  # two chunks of one
    c = None if scale is None else torch.tensor([scale])
    out["-".join(map(str, (how, param, grad, moment, adam_w) + ((scale,) if scale else ())))] = _differing(
        adam_triton.adam_multi_tensor, how, dtypes, sizes, adam_w, 2, c)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory):
    return run_interpreted(tmp_path_factory, "adam-interpreted", INTERPRETED)


def test_triton_kernel_writes_the_reference_for_every_kind(interpreted):
    """Two steps: every tensor it writes (parameters, moments, master weights) byte for byte (the interpreter
    computes each operation as the reference does, in fp32, no fused multiply-add), the gradients scaled by a
    clipping coefficient too."""
    kinds = ["-".join(map(str, kind)) for kind in KINDS] + ["-".join(map(str, KINDS[0] + (0.37,)))]
    assert interpreted == {kind: [] for kind in kinds}  # the lists that differ: none


def test_the_cpu_runs_the_reference():
    got, want = (_tensors("remainders", torch.bfloat16, torch.bfloat16, torch.bfloat16, [9, 4]) for _ in range(2))
    hyper = A.AdamHyper(**HYPER, step=1)
    A.adam_step(got, hyper)
    for p, g, m, v, r in zip(want.params, want.grads, want.exp_avgs, want.exp_avg_sqs, want.masters):
        A.adam_reference(p, g, m, v, r, hyper, "remainders")
    assert all(torch.equal(a, b) for a, b in zip(got.params + got.masters, want.params + want.masters))
    assert A.adam_path("cpu") == "litespark (reference)"


def test_a_clipping_coefficient_scales_the_gradient_in_fp32_on_the_way_in():
    """The step given the coefficient is the step on the gradient multiplied by it in fp32 (not rounded to bf16 again,
    as megatron-core's in-place scaling would)."""
    got, want = (_tensors("remainders", torch.bfloat16, torch.bfloat16, torch.bfloat16, [300]) for _ in range(2))
    c = torch.tensor([0.37])
    hyper = A.AdamHyper(**HYPER, step=1)
    A.adam_step(got, hyper, c)
    A.adam_reference(want.params[0], want.grads[0].float() * 0.37, want.exp_avgs[0], want.exp_avg_sqs[0],
                     want.masters[0], hyper, "remainders")
    assert torch.equal(got.params[0], want.params[0]) and torch.equal(got.masters[0], want.masters[0])
    rounded = _tensors("remainders", torch.bfloat16, torch.bfloat16, torch.bfloat16, [300])
    A.adam_reference(rounded.params[0], (rounded.grads[0] * 0.37).bfloat16(), rounded.exp_avgs[0],
                     rounded.exp_avg_sqs[0], rounded.masters[0], hyper, "remainders")
    assert not torch.equal(rounded.masters[0], want.masters[0])  # the coefficient is applied before any rounding


def _bad(**change):
    t = _tensors("remainders", torch.bfloat16, torch.bfloat16, torch.bfloat16, [6, 4])
    for name, value in change.items():
        setattr(t, name, value(t))
    return t


@pytest.mark.parametrize("tensors, message", [
    (lambda: _bad(how=lambda t: "fp16"),
     "Adam: master weights held as 'fp16', not one of ('none', 'fp32', 'remainders')"),
    (lambda: _bad(grads=lambda t: t.grads[:1]),
     "Adam: parameters, gradients, moments and master weights differ in number"),
    (lambda: _bad(exp_avgs=lambda t: [t.exp_avgs[0], t.exp_avgs[1].float()]),
     "Adam: one launch takes one exp_avg dtype, got ['torch.bfloat16', 'torch.float32']"),
    (lambda: _bad(exp_avg_sqs=lambda t: [t.exp_avg_sqs[0], torch.zeros(8, dtype=torch.bfloat16)[::2]]),
     "Adam: tensor 1 ((4,)): its state differs in size or is not contiguous"),
    (lambda: _bad(masters=lambda t: [x.float() for x in t.masters]),
     "Adam: master weights held as 'remainders' must be torch.int16"),
    (lambda: _bad(params=lambda t: [x.float() for x in t.params]),
     "Adam: torch.float32 parameters with master weights held as 'remainders'"),
    (lambda: _bad(exp_avgs=lambda t: [x.half() for x in t.exp_avgs]),
     "Adam: gradients torch.bfloat16, moments torch.float16 / torch.bfloat16: the kernel takes fp32 or bf16 for each"),
])
def test_tensors_the_kernel_cannot_take_are_one_clear_error(tensors, message):
    with pytest.raises(ValueError) as e:
        A.adam_step(tensors(), A.AdamHyper(**HYPER, step=1))
    assert str(e.value) == message


# ----------------------------------------------------------------------------------- the flag
PAO = ["--use-distributed-optimizer", "--use-precision-aware-optimizer", "--bf16"]


@pytest.mark.parametrize("flags, plat, message", [
    ([], CPU, "--litespark-adam steps Transformer Engine's FusedAdam, megatron-core's Adam on a GPU with TE; here "
              "megatron-core runs torch's Adam: drop the flag"),
    (["--optimizer", "sgd"], GPU_TE,
     "--litespark-adam is an Adam step, and the optimizer is --optimizer sgd; drop one"),
    (["--optimizer-cuda-graph"], GPU_TE,
     "--litespark-adam with --optimizer-cuda-graph: TE's capturable step reads its learning rate and step count on "
     "the GPU; drop one"),
    (PAO + ["--exp-avg-dtype", "fp16"], GPU_TE,
     "--litespark-adam takes fp32 or bf16 moments, not --exp-avg-dtype fp16 --exp-avg-sq-dtype fp32 (scaled by TE's "
     "FusedAdam); use bf16 or fp32"),
    (PAO + ["--exp-avg-sq-dtype", "fp8"], GPU_TE,
     "--litespark-adam takes fp32 or bf16 moments, not --exp-avg-dtype fp32 --exp-avg-sq-dtype fp8 (scaled by TE's "
     "FusedAdam); use bf16 or fp32"),
    (PAO + ["--main-params-dtype", "fp16"], GPU_TE,
     "--litespark-adam takes fp32 master weights, not --main-params-dtype fp16 (scaled by TE's FusedAdam); drop one"),
    (PAO + ["--optimizer-cpu-offload"], GPU_TE,
     "--litespark-adam with --optimizer-cpu-offload: the step runs on the host's copy; drop one"),
    (["--bf16", "--use-megatron-fsdp"], GPU_TE,
     "--litespark-adam with --use-megatron-fsdp: its sharded parameters are DTensors; drop one"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"], GPU_TE,
     "--litespark-adam with --fp8-param-gather: FP8 parameters take TE's FP8 Adam kernel; drop one"),
])
def test_the_flag_is_refused_where_the_kernel_would_not_step(flags, plat, message):
    with pytest.raises(ConfigError) as e:
        check(TINY + ["--litespark-adam"] + flags, plat)
    assert str(e.value) == message


def test_the_flag_is_taken_with_the_precision_aware_optimizer_and_without(monkeypatch):
    for flags in ([], ["--bf16"], PAO + ["--exp-avg-dtype", "bf16", "--exp-avg-sq-dtype", "bf16",
                                         "--main-grads-dtype", "bf16"]):
        assert check(TINY + ["--litespark-adam"] + flags, GPU_TE).litespark_adam
    assert not check(TINY, GPU_TE).litespark_adam  # off unless given
    monkeypatch.setattr(litespark_megatron.kernels, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="^--litespark-adam on a GPU runs Triton kernels"):
        check(TINY + ["--litespark-adam"], GPU_TE)


# ----------------------------------------------------------------------------------- on a GPU
def _te_fused_adam():
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except ImportError:
        return None
    return FusedAdam


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
@pytest.mark.parametrize("how, param, grad, moment, adam_w", KINDS)
def test_compiled_kernel_writes_the_reference(how, param, grad, moment, adam_w):
    """A tensor of llama-3b's output layer's size / 8 (many chunks) and small ones, three steps, compiled: every
    tensor byte for byte (the kernel is compiled without fused multiply-adds)."""
    dtypes = [getattr(torch, d) for d in (param, grad, moment)]
    sizes = [3072, 1, 128256 * 3072 // 8 + 5]
    c = torch.tensor([0.37], device="cuda") if how == "remainders" else None  # a clipping coefficient, for some
    assert _differing(A.adam_step, how, dtypes, sizes, adam_w, 3, c, device="cuda") == []
    assert A.adam_path("cuda") == "litespark"


@pytest.mark.gpu
@pytest.mark.skipif(_te_fused_adam() is None, reason="Transformer Engine's FusedAdam runs on a GPU with TE")
@pytest.mark.parametrize("moments, grads, master_weights", [
    (torch.bfloat16, torch.bfloat16, True), (torch.float32, torch.float32, True),
    (torch.float32, torch.float32, False)])
def test_the_optimizer_steps_as_transformer_engines(moments, grads, master_weights):
    """LitesparkFusedAdam against TE's FusedAdam on the same parameters and gradients, as megatron-core builds them
    (master weights as bf16 remainders, decoupled gradients; or fp32 parameters), two parameter groups, three steps.
    TE's kernel rounds its multiply-adds once (fused) where Litespark's rounds twice, as the reference does: the
    master weights agree to the last bit on most elements, and beyond 4 roundings of the weight or its step on at
    most 1% (measured on an H200: up to 0.3%, where the moment's update cancels); the bf16 parameters on all but
    0.1% (measured: 0.03%). The same states and state_dict, which each loads from the other."""
    from litespark_megatron.platform.fused_adam import litespark_fused_adam

    FusedAdam = _te_fused_adam()
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3072, 1000), (3072,), (17, 5)]
    dtype = torch.bfloat16 if master_weights else torch.float32
    start = [torch.randn(s, device="cuda", generator=g, dtype=dtype) * 0.05 for s in shapes]
    grads = [[torch.randn(s, device="cuda", generator=g).to(grads) * 1e-2 for s in shapes] for _ in range(3)]
    kwargs = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, adam_w_mode=True, exp_avg_dtype=moments,
                  exp_avg_sq_dtype=moments)
    if master_weights:
        kwargs.update(master_weights=True, use_decoupled_grad=True, store_param_remainders=True)
    optimizers, params = [], []
    for cls in (FusedAdam, litespark_fused_adam()):
        ps = [torch.nn.Parameter(x.clone()) for x in start]
        optimizers.append(cls([{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}],
                              **kwargs))
        params.append(ps)
    for step_grads in grads:
        for opt, ps in zip(optimizers, params):
            for p, grad in zip(ps, step_grads):
                if master_weights:
                    p.decoupled_grad = grad.clone()
                else:
                    p.grad = grad.clone()
            opt.step()
    te, ours = optimizers
    ulps, differ = [], []
    for a, b, x in zip(*params, start):
        sa, sb = te.state[a], ours.state[b]
        assert sorted(sa) == sorted(sb)
        if master_weights:
            differ.append((a.data != b.data).flatten())
            ma, mb = (A.master_from_remainders(y, s["master_param"]) for y, s in ((a.data, sa), (b.data, sb)))
        else:
            ma, mb = a.data, b.data
        scale = torch.maximum(ma.abs(), (ma - x.float()).abs())
        ulps.append(((ma - mb).abs() / (scale * torch.finfo(torch.float32).eps)).flatten())
    ulps = torch.cat(ulps)  # over every element: the small tensors alone are too few for a share
    assert ulps.median().item() == 0 and (ulps > 4).float().mean().item() <= 1e-2
    assert not differ or torch.cat(differ).float().mean().item() <= 1e-3
    state_te, state_ours = te.state_dict(), ours.state_dict()
    assert [g["step"] for g in state_te["param_groups"]] == [g["step"] for g in state_ours["param_groups"]] == [3, 3]
    for k in state_te["state"]:
        assert {n: (t.dtype, t.shape) for n, t in state_te["state"][k].items()} == \
            {n: (t.dtype, t.shape) for n, t in state_ours["state"][k].items()}
    ours.load_state_dict(state_te)  # a checkpoint of TE's optimizer resumes in Litespark's


BF16_RUN = ["--model", "tiny", "--mock-data", "--seq-length", "128", "--global-batch-size", "8", "--micro-batch-size",
            "4", "--lr", "3e-3", "--lr-warmup-iters", "2", "--train-iters", "6", "--log-interval", "1", "--eval-iters",
            "0", "--eval-interval", "100", "--seed", "7", "--save-interval", "100", "--bf16", "--spec", "litespark",
            "--transformer-impl", "transformer_engine", "--use-distributed-optimizer",
            "--use-precision-aware-optimizer", "--main-grads-dtype", "bf16", "--exp-avg-dtype", "bf16",
            "--exp-avg-sq-dtype", "bf16", "--clip-grad", "0.05"]


@pytest.mark.gpu
@pytest.mark.skipif(_te_fused_adam() is None, reason="Transformer Engine's FusedAdam runs on a GPU with TE")
def test_a_run_with_the_flag_trains_as_tes_adam_says_so_and_resumes_bit_exactly(tmp_path):
    """Six BF16 steps under the precision-aware optimizer (bf16 moments, master weights as remainders), the gradients
    clipped, with --litespark-adam (the coefficient applied in the step) against TE's step (the gradients scaled in
    place by megatron-core): the same losses to the fused multiply-adds' and the scaling's rounding, the record
    names the kernel (megatron-core built its optimizer from the global the flag replaced), and a run stopped at
    step 3 and resumed (the optimizer's state in TE's form) equals the uninterrupted one bit for bit."""
    def env():
        return child_env(MASTER_PORT=free_port())
    tes, straight, halves = tmp_path / "te", tmp_path / "straight", tmp_path / "halves"
    ok(train(1, *BF16_RUN, "--save", tes, env=env()))
    ok(train(1, *BF16_RUN, "--litespark-adam", "--save", straight, env=env()))
    ok(train(1, *BF16_RUN, "--litespark-adam", "--save", halves, "--load", halves, "--exit-interval", "3",
             env=env()))
    ok(train(1, *BF16_RUN, "--litespark-adam", "--save", halves, "--load", halves, env=env()))
    base, fast, resumed = (losses(d / "metrics.jsonl") for d in (tes, straight, halves))
    assert sorted(fast) == sorted(resumed) == [1, 2, 3, 4, 5, 6]
    assert [fast[s] for s in range(1, 7)] == [resumed[s] for s in range(1, 7)], (fast, resumed)
    assert all(abs(fast[s] - base[s]) <= 1e-2 * abs(base[s]) for s in range(1, 7)), (fast, base)
    health = [r for r in records(straight / "metrics.jsonl") if r["kind"] == "health"][0]
    assert health["fusions"]["optimizer"] == "litespark" and not health["degraded"], health
    assert "optimizer" not in [r for r in records(tes / "metrics.jsonl") if r["kind"] == "health"][0]["fusions"]


# ----------------------------------------------------------------------------------- gradient clipping
class _Owner:
    """A stand-in for a LitesparkFusedAdam: the parameters it steps and its deferred coefficients."""

    def __init__(self, params):
        from litespark_megatron.platform.fused_adam import DeferredGradScale

        self.ids, self.deferred = {id(p) for p in params}, DeferredGradScale()

    def param_ids(self):
        return self.ids


def test_clipping_hands_the_coefficient_to_the_optimizer_that_steps_the_parameters(monkeypatch):
    """The wrapped clip leaves the gradients of the parameters an optimizer of Litespark's steps, and gives it the
    coefficient megatron-core computes (max_norm / (norm + 1e-6), at most 1); the other parameters, a second clip
    of the same parameters before the step, and a norm that is a number go to megatron-core's function."""
    from litespark_megatron.platform import fused_adam

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(3)]
    owner = _Owner(params[:2])
    monkeypatch.setattr(fused_adam, "_optimizers", [owner])
    calls = []
    clip = fused_adam.clip_deferring_to_the_step(lambda *a, **k: calls.append((a, k)))
    clip(params, 1.0, torch.tensor([4.0]), use_decoupled_grad=True)
    (args, kwargs), = calls  # megatron-core's function, for the parameter no optimizer of Litespark's steps
    assert [id(p) for p in args[0]] == [id(params[2])] and args[1] == 1.0 and args[2].tolist() == [4.0]
    assert kwargs == {"use_decoupled_grad": True}
    assert all(p.grad is None for p in params)  # nothing scaled here: the stand-in clip touches nothing either
    scales = owner.deferred.take()
    assert sorted(scales) == sorted(map(id, params[:2]))
    assert scales[id(params[0])].item() == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-7)
    clip(params[:1], 1.0, torch.tensor([0.5]))
    assert owner.deferred.scales[id(params[0])].item() == 1.0  # under the limit: 1
    calls.clear()
    clip(params[:1], 1.0, torch.tensor([8.0]))  # clipped twice before a step: megatron-core scales this one
    clip(params[:1], 1.0, 8.0)  # a number: no coefficient on the GPU to hand over
    assert len(calls) == 2 and owner.deferred.take()[id(params[0])].item() == 1.0


def test_megatron_core_clips_through_the_function_the_flag_wraps():
    """megatron-core's optimizers call `clip_grad_by_total_norm_fp32` by their module's global, with this signature
    and this coefficient; when one of these changes, the wrapper (platform/fused_adam.py) must be read again."""
    import inspect

    from megatron.core.optimizer import clip_grads, optimizer

    assert list(inspect.signature(optimizer.clip_grad_by_total_norm_fp32).parameters) == [
        "parameters", "max_norm", "total_norm", "use_decoupled_grad"]
    for cls in (optimizer.MegatronOptimizer, optimizer.ChainedOptimizer):
        assert "clip_grad_by_total_norm_fp32(" in inspect.getsource(cls.clip_grad_norm), cls
    source = inspect.getsource(clip_grads.clip_grad_by_total_norm_fp32)
    assert "clip_coeff = max_norm / (total_norm + 1.0e-6)" in source and "clip_coeff.clamp_max_(1.0)" in source
