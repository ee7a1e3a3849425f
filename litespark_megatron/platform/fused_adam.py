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
"""
from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def litespark_fused_adam():
    """The FusedAdam subclass (built once: TE imports only where it is installed)."""
    from transformer_engine.pytorch.optimizers import FusedAdam

    from ..kernels.adam import AdamHyper, AdamTensors, adam_step

    class LitesparkFusedAdam(FusedAdam):
        """Transformer Engine's FusedAdam whose step runs Litespark's Adam kernel."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _built.append(type(self))

        def step(self, closure=None, grad_scaler=None):
            if grad_scaler is not None or self.capturable:
                raise RuntimeError("Litespark's Adam step takes no grad scaler and is not capturable "
                                   "(--optimizer-cuda-graph): drop --litespark-adam")
            loss = closure() if closure is not None else None
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1  # every group, empty or not: TE's rule
                kinds = {}
                for p in group["params"]:
                    tensors = self._tensors_of(p)
                    if tensors is None:
                        continue
                    key = tuple(t.dtype for t in tensors[:4]) + (tensors[5],)
                    kind = kinds.setdefault(key, AdamTensors(tensors[5], [], [], [], [], []))
                    for into, t in zip((kind.params, kind.grads, kind.exp_avgs, kind.exp_avg_sqs, kind.masters),
                                       tensors[:5]):
                        into.append(t)
                if not kinds:
                    continue
                beta1, beta2 = group["betas"]
                hyper = AdamHyper(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                                  weight_decay=group["weight_decay"], step=group["step"],
                                  adam_w_mode=bool(self.adam_w_mode), bias_correction=bool(group["bias_correction"]))
                for kind in kinds.values():
                    adam_step(kind, hyper)
            return loss

        def _tensors_of(self, p):
            """(param, grad, exp_avg, exp_avg_sq, master or None, how) of one parameter, its state made as TE
            makes it; None without a gradient."""
            from torch.distributed.tensor import DTensor
            from transformer_engine.pytorch.quantized_tensor import QuantizedTensor

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


def use_litespark_adam() -> None:
    """megatron-core's Adam becomes LitesparkFusedAdam (before the optimizer is built). Idempotent."""
    from megatron.core import optimizer

    cls = litespark_fused_adam()
    if optimizer.Adam is cls:
        return
    if optimizer.Adam is not cls.__mro__[1]:
        raise RuntimeError(f"--litespark-adam replaces Transformer Engine's FusedAdam as megatron-core's Adam, and "
                           f"megatron-core's Adam is {optimizer.Adam.__module__}.{optimizer.Adam.__name__}: drop the "
                           "flag")
    optimizer.Adam = cls


_built: list = []  # the LitesparkFusedAdam classes of the optimizers built in this process


def adam_in_use() -> bool:
    """Whether megatron-core built its optimizer as LitesparkFusedAdam in this process (the run's "what ran" record,
    written after the optimizer is built): false if megatron-core stopped reading its `Adam` global."""
    return bool(_built)
