"""megatron-core's Adam stepped by Litespark's kernel (--litespark-adam).

megatron-core builds its Adam from the module global `megatron.core.optimizer.Adam`, Transformer Engine's FusedAdam
where TE imports. `use_litespark_adam()` puts a subclass there whose `step` runs Litespark's Adam kernel
(kernels/adam.py) instead of TE's multi-tensor kernels; everything else is TE's: the states it creates (bf16 or fp32
moments, fp32 master weights whole or as bf16 remainders), their checkpoint form, zero_grad. The step mirrors TE
2.20's for the tensors the kernel takes (the step count advanced in every group, empty ones too; the gradient read
from `decoupled_grad` under the precision-aware optimizer) and raises, naming the tensor, for any other:
arguments._check_litespark_adam refuses the flags that would make them, so a run never falls back to TE's kernel
unseen. tests/test_adam_kernel.py holds a step to TE's on a GPU and fails when megatron-core stops reading the
global.

Gradient clipping: megatron-core scales every gradient in place by its clipping coefficient (a tensor on the GPU,
1 when the norm is under the limit), a pass that reads and writes all the gradients just before the step reads
them again. `use_litespark_adam()` also wraps the clipping function megatron-core's optimizers call
(`megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32`): the gradients of parameters a LitesparkFusedAdam
steps are left as they are and their coefficient is handed to that optimizer, whose next step multiplies them by it
on the way in (in fp32: bf16 gradients are not rounded again after the scaling); any other parameter is clipped by
megatron-core's own function.
"""
from __future__ import annotations

import functools
import weakref

import torch


@functools.lru_cache(maxsize=None)
def litespark_fused_adam():
    """The FusedAdam subclass (built once: TE imports only where it is installed)."""
    from torch.distributed.tensor import DTensor
    from transformer_engine.pytorch.optimizers import FusedAdam
    from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

    from ..kernels.adam import AdamHyper, AdamTensors, adam_step

    class LitesparkFusedAdam(FusedAdam):
        """Transformer Engine's FusedAdam whose step runs Litespark's Adam kernel."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _built.append(type(self))
            self.deferred = DeferredGradScale()
            _optimizers.add(self)

        def param_ids(self) -> set:
            """The ids of the parameters it steps (kept while their number stays)."""
            count = sum(len(group["params"]) for group in self.param_groups)
            if getattr(self, "_ids", (None, -1))[1] != count:
                self._ids = ({id(q) for group in self.param_groups for q in group["params"]}, count)
            return self._ids[0]

        def step(self, closure=None, grad_scaler=None):
            if grad_scaler is not None or self.capturable:
                raise RuntimeError("Litespark's Adam step takes no grad scaler and is not capturable "
                                   "(--optimizer-cuda-graph): drop --litespark-adam")
            loss = closure() if closure is not None else None
            scales = self.deferred.take()
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1  # every group, empty or not: TE's rule
                kinds = {}
                for p in group["params"]:
                    tensors = self._tensors_of(p)
                    if tensors is None:
                        continue
                    scale = scales.get(id(p))
                    key = tuple(t.dtype for t in tensors[:4]) + (tensors[5], id(scale))
                    kind = kinds.setdefault(key, (AdamTensors(tensors[5], [], [], [], [], []), scale))[0]
                    for into, t in zip((kind.params, kind.grads, kind.exp_avgs, kind.exp_avg_sqs, kind.masters),
                                       tensors[:5]):
                        into.append(t)
                if not kinds:
                    continue
                beta1, beta2 = group["betas"]
                hyper = AdamHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], step=group["step"],
                                  adam_w_mode=bool(self.adam_w_mode), bias_correction=bool(group["bias_correction"]))
                for kind, scale in kinds.values():
                    adam_step(kind, hyper, scale)
            return loss

        def _tensors_of(self, p):
            """(param, grad, exp_avg, exp_avg_sq, master or None, how) of one parameter, its state made as TE
            makes it; None without a gradient."""
            state = self.state[p]
            remainders = self.store_param_remainders and p.dtype == torch.bfloat16
            if len(state) == 0:
                self.initialize_state(p, remainders)
            grad = getattr(p, "decoupled_grad", None) if self.use_decoupled_grad else p.grad
            if grad is None:
                return None
            if isinstance(p, (DTensor, QuantizedTensor)) or grad.is_sparse:
                raise RuntimeError(f"Litespark's Adam step takes plain tensors, and a parameter of shape "
                                   f"{tuple(p.shape)} is a {type(p).__name__} (gradient sparse: {grad.is_sparse}): "
                                   "drop --litespark-adam")
            if p.dtype == torch.float32 or not self.master_weights:
                how, master = "none", None
            else:
                how, master = ("remainders" if remainders else "fp32"), state["master_param"]
            return p.data, grad.data, state["exp_avg"], state["exp_avg_sq"], master, how

    return LitesparkFusedAdam


class DeferredGradScale:
    """Clipping coefficients handed to an optimizer's next step, by parameter (id)."""

    def __init__(self):
        self.scales = {}

    def defer(self, params, coefficient) -> bool:
        """Take `coefficient` for `params`, unless one of them already has one (clipped twice before a step: left to
        megatron-core, which scales in place)."""
        if any(id(p) in self.scales for p in params):
            return False
        self.scales.update((id(p), coefficient) for p in params)
        return True

    def take(self) -> dict:
        scales, self.scales = self.scales, {}
        return scales


_optimizers = weakref.WeakSet()  # the LitesparkFusedAdam optimizers of this process


def clip_deferring_to_the_step(clip):
    """megatron-core's `clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad)`, whose
    coefficient (computed as it computes it, a tensor) goes to the LitesparkFusedAdam that steps each parameter,
    the gradients left unscaled; `clip` itself for the others, and for a norm that is a number (no coefficient on the
    GPU to hand over)."""
    @functools.wraps(clip)
    def clip_grad_by_total_norm_fp32(parameters, max_norm, total_norm, use_decoupled_grad=False):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if isinstance(total_norm, torch.Tensor):
            coefficient = (max_norm / (total_norm + 1.0e-6)).clamp_max(1.0)
            for optimizer in list(_optimizers):
                ids = optimizer.param_ids()
                mine = [p for p in params if id(p) in ids]
                if mine and optimizer.deferred.defer(mine, coefficient):
                    params = [p for p in params if id(p) not in ids]
        if params:
            return clip(params, max_norm, total_norm, use_decoupled_grad=use_decoupled_grad)
    clip_grad_by_total_norm_fp32._litespark = True
    return clip_grad_by_total_norm_fp32


def use_litespark_adam() -> None:
    """megatron-core's Adam becomes LitesparkFusedAdam (before the optimizer is built), and its clipping hands the
    coefficient to it. Idempotent."""
    from megatron.core import optimizer
    from megatron.core.optimizer import optimizer as optimizers

    cls = litespark_fused_adam()
    if optimizer.Adam is not cls:
        if optimizer.Adam is not cls.__mro__[1]:
            raise RuntimeError(f"--litespark-adam replaces Transformer Engine's FusedAdam as megatron-core's Adam, and "
                               f"megatron-core's Adam is {optimizer.Adam.__module__}.{optimizer.Adam.__name__}: drop "
                               "the flag")
        optimizer.Adam = cls
    if not getattr(optimizers.clip_grad_by_total_norm_fp32, "_litespark", False):
        optimizers.clip_grad_by_total_norm_fp32 = clip_deferring_to_the_step(optimizers.clip_grad_by_total_norm_fp32)


_built: list = []  # the LitesparkFusedAdam classes of the optimizers built in this process


def adam_in_use() -> bool:
    """Whether megatron-core built its optimizer as LitesparkFusedAdam in this process (the run's "what ran" record,
    written after the optimizer is built): false if megatron-core stopped reading its `Adam` global."""
    return bool(_built)
