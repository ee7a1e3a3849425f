"""Litespark's Adam step: the update Transformer Engine's FusedAdam computes for megatron-core's optimizer, with
every tensor read and written once in wide loads.

TE's multi-tensor Adam kernels load each element of each tensor on its own (two bytes at a time for bf16 parameters,
moments and the master weights' 16-bit remainders), which holds a memory-bound update to a fraction of the GPU's
bandwidth. The Triton kernel (adam_triton.py) reads blocks of every tensor in 16-byte pieces, and runs one launch
per kind of tensors (the dtypes below) over a table of their offsets, chunk by chunk.

The update, in fp32 for every element of a parameter p with gradient g (TE's, term for term, each operation rounded
on its own: TE's kernel fuses its multiply-adds, so the two differ by a rounding where an update cancels):

    g  <- g * c                              (c: megatron-core's gradient-clipping coefficient, when the step was
                                              given it instead of megatron-core scaling the gradients in place)
    g  <- g + decay * p                      (adam_w_mode False: L2 regularization)
    m  <- beta1 * m + (1 - beta1) * g
    v  <- beta2 * v + (1 - beta2) * g * g
    u  <- (m / c1) / (sqrt(v / c2) + eps)    c1 = 1 - beta1^step, c2 = 1 - beta2^step (1 without bias correction)
    u  <- u + decay * p                      (adam_w_mode True: decoupled weight decay)
    p  <- p - lr * u

p is the fp32 master weight. Three ways to hold it, as TE's FusedAdam does (`MASTERS`):

    "none"        the parameter itself: fp32 (megatron-core's fp32 main parameters without the precision-aware
                  optimizer), or 16-bit, rounded after each step (TE's FusedAdam without master weights)
    "fp32"        an fp32 copy beside a 16-bit parameter, which takes its rounding
    "remainders"  a bf16 parameter plus the low 16 bits of the fp32 master (int16), stored so that the parameter is
                  the master rounded to nearest (ties away from zero): a negative remainder means the parameter was
                  rounded up, and the master is (parameter - 1 in its last place, remainder) as bits

The moments are fp32 or bf16 (rounded to nearest after the update); the gradient fp32 or bf16. The scalars are fp32,
as TE passes them (1 - beta in fp32; the bias corrections from beta^step in fp64, then fp32).

`adam_reference` defines the update for one tensor (plain torch, any device); tests/test_adam_kernel.py holds the
Triton path to it. `adam_step` runs the Triton kernel on CUDA tensors and the reference elsewhere; `adam_path` says
which (the run's "what ran" record).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from . import kernel_path

MASTERS = ("none", "fp32", "remainders")
MOMENT_DTYPES = (torch.float32, torch.bfloat16)
GRAD_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(frozen=True)
class AdamHyper:
    """One parameter group's scalars for one step, as TE's FusedAdam passes them to its kernel."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    step: int
    adam_w_mode: bool = True
    bias_correction: bool = True

    def scalars(self) -> dict:
        """The fp32 values the update uses (each rounded to fp32 where TE rounds it)."""
        f32 = np.float32
        b1, b2 = f32(self.beta1), f32(self.beta2)
        c1 = f32(1.0 - float(b1) ** self.step) if self.bias_correction else f32(1.0)
        c2 = f32(1.0 - float(b2) ** self.step) if self.bias_correction else f32(1.0)
        return dict(lr=f32(self.lr), beta1=b1, beta2=b2, one_minus_beta1=f32(1) - b1, one_minus_beta2=f32(1) - b2,
                    eps=f32(self.eps), decay=f32(self.weight_decay), c1=c1, c2=c2)


# --------------------------------------------------------------------------------------------- the master weights
def master_from_remainders(param: torch.Tensor, remainders: torch.Tensor) -> torch.Tensor:
    """The fp32 master weights a bf16 parameter and its int16 remainders hold."""
    high = param.view(torch.int16).to(torch.int32)
    low = remainders.to(torch.int32)
    high = torch.where(low < 0, high - 1, high)  # the parameter was rounded up: undo it
    return ((high << 16) | (low & 0xFFFF)).view(torch.float32)


def split_master(master: torch.Tensor) -> tuple:
    """(bf16 parameter rounded to nearest by the remainder's top bit, ties away from zero; int16 remainders) of fp32
    master weights."""
    bits = master.view(torch.int32)
    low = (bits & 0xFFFF).to(torch.int16)  # two's complement: the top bit set is a negative remainder
    high = bits >> 16
    high = torch.where(low < 0, high + 1, high)
    return high.to(torch.int16).view(torch.bfloat16), low


# --------------------------------------------------------------------------------------------- the reference
def adam_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   master: Optional[torch.Tensor], hyper: AdamHyper, how: str,
                   grad_scale: Optional[torch.Tensor] = None) -> None:
    """One Adam step of one parameter, in place: `how` is one of MASTERS (`master` None for "none"); `grad_scale`
    (one fp32 value on the gradient's device) multiplies the gradient first."""
    if how not in MASTERS:
        raise ValueError(f"Adam: master weights held as {how!r}, not one of {MASTERS}")
    s = {k: torch.tensor(v, dtype=torch.float32, device=param.device) for k, v in hyper.scalars().items()}
    if how == "remainders":
        p = master_from_remainders(param, master)
    elif how == "fp32":
        p = master.clone()
    else:
        p = param.to(torch.float32)
    g = grad.to(torch.float32)
    if grad_scale is not None:
        g = g * grad_scale.to(torch.float32).reshape(())
    m = exp_avg.to(torch.float32)
    v = exp_avg_sq.to(torch.float32)
    if not hyper.adam_w_mode:
        g = g + s["decay"] * p
    m = s["beta1"] * m + s["one_minus_beta1"] * g
    v = s["beta2"] * v + s["one_minus_beta2"] * g * g
    # IEEE's fp32 quotients and square root, as TE's kernel computes them: torch divides by a lone scalar as a product
    # with its reciprocal, and its vectorized fp32 square root on CPUs is not always the nearest (fp64's is, rounded)
    root = torch.sqrt((v / s["c2"].expand_as(v)).double()).float()
    update = (m / s["c1"].expand_as(m)) / (root + s["eps"])
    if hyper.adam_w_mode:
        update = update + s["decay"] * p
    p = p - s["lr"] * update
    exp_avg.copy_(m)
    exp_avg_sq.copy_(v)
    if how == "remainders":
        high, low = split_master(p)
        param.copy_(high)
        master.copy_(low)
    else:
        param.copy_(p)
        if how == "fp32":
            master.copy_(p)


# --------------------------------------------------------------------------------------------- the step
@dataclass
class AdamTensors:
    """The tensors of one kind (one launch): parameters, gradients, moments and master weights (None for "none"),
    index by index, all contiguous and of one dtype per list."""
    how: str
    params: List[torch.Tensor]
    grads: List[torch.Tensor]
    exp_avgs: List[torch.Tensor]
    exp_avg_sqs: List[torch.Tensor]
    masters: List[Optional[torch.Tensor]]

    def check(self) -> None:
        """One clear error for tensors the kernel cannot take (a caller's bug, never a silent slow path)."""
        if self.how not in MASTERS:
            raise ValueError(f"Adam: master weights held as {self.how!r}, not one of {MASTERS}")
        lists = (self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, self.masters)
        if len({len(x) for x in lists}) != 1:
            raise ValueError("Adam: parameters, gradients, moments and master weights differ in number")
        for name, tensors in (("parameter", self.params), ("gradient", self.grads), ("exp_avg", self.exp_avgs),
                              ("exp_avg_sq", self.exp_avg_sqs)):
            if len({t.dtype for t in tensors}) > 1:
                got = sorted({str(t.dtype) for t in tensors})
                raise ValueError(f"Adam: one launch takes one {name} dtype, got {got}")
        for i, p in enumerate(self.params):
            tensors = [p, self.grads[i], self.exp_avgs[i], self.exp_avg_sqs[i]]
            tensors += [self.masters[i]] if self.how != "none" else []
            if any(t.numel() != p.numel() for t in tensors) or not all(t.is_contiguous() for t in tensors):
                raise ValueError(f"Adam: tensor {i} ({tuple(p.shape)}): its state differs in size or is not "
                                 "contiguous")
        if not self.params:
            return
        wanted = {"none": (torch.float32, torch.bfloat16, torch.float16), "fp32": (torch.bfloat16, torch.float16),
                  "remainders": (torch.bfloat16,)}
        if self.params[0].dtype not in wanted[self.how]:
            raise ValueError(f"Adam: {self.params[0].dtype} parameters with master weights held as {self.how!r}")
        if self.grads[0].dtype not in GRAD_DTYPES or self.exp_avgs[0].dtype not in MOMENT_DTYPES or \
                self.exp_avg_sqs[0].dtype not in MOMENT_DTYPES:
            raise ValueError(f"Adam: gradients {self.grads[0].dtype}, moments {self.exp_avgs[0].dtype} / "
                             f"{self.exp_avg_sqs[0].dtype}: the kernel takes fp32 or bf16 for each")
        master_dtype = {"fp32": torch.float32, "remainders": torch.int16}.get(self.how)
        if master_dtype is not None and any(t.dtype != master_dtype for t in self.masters):
            raise ValueError(f"Adam: master weights held as {self.how!r} must be {master_dtype}")


def adam_step(tensors: AdamTensors, hyper: AdamHyper, grad_scale: Optional[torch.Tensor] = None) -> None:
    """One Adam step of every tensor, in place: the Triton kernel for CUDA tensors, the reference elsewhere;
    `grad_scale` as adam_reference's."""
    if not tensors.params:
        return
    if kernel_path(tensors.params[0].device.type) == "litespark":
        from .adam_triton import adam_multi_tensor

        adam_multi_tensor(tensors, hyper, grad_scale)  # checks the tensors the first time it sees them
        return
    tensors.check()
    for p, g, m, v, master in zip(tensors.params, tensors.grads, tensors.exp_avgs, tensors.exp_avg_sqs,
                                  tensors.masters):
        adam_reference(p, g, m, v, master, hyper, tensors.how, grad_scale)


def adam_path(device_type: str) -> str:
    """What a run's Adam step runs on a device of this type (the "what ran" record)."""
    return kernel_path(device_type)
