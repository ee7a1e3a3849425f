"""Litespark's RMSNorm: Llama's norm in one read of the row forward and one of the row and its gradient backward, at
any hidden size.

Transformer Engine's RMSNorm (inside its LayerNormLinear, the te backend's norm) has tuned kernels for some hidden
sizes only (512 to 8,192 in powers of two and a few more); other sizes (3,072: Llama-3.2-3B) take its general kernel,
which moves a third of the bytes per second the tuned ones do. These kernels read a row in one block of the next
power of two, whatever its size:

    forward   one program per row: rsqrt(mean(x^2) + eps) in fp32, the row normalized and rounded to the input's
              dtype, times the weight (rounded again, as torch's bf16 product is); the row's rsqrt kept (4 bytes).
    backward  a program per block of rows: the input's gradient of each row, and the block's partial sum of the
              weight's gradient (fp32), which torch sums over the blocks.

`rms_norm_reference` defines the function (statistics in at least fp32, the result in the input's dtype, then
scaled by the weight); tests/test_rms_norm_kernel.py holds the Triton path to it. `rms_norm` runs the Triton path on
CUDA and the reference elsewhere; `rms_norm_path` says which (the run's "what ran" record).
"""
from __future__ import annotations

import torch

from . import kernel_path


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: statistics in (at least) fp32, result in the input dtype, then scaled by the weight."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight.to(x.dtype)


def check_weight(weight: torch.Tensor, columns: int) -> None:
    """The norm's weight is one value per column of its rows (a kernel would read past a shorter one)."""
    if weight.shape != (columns,):
        raise ValueError(f"RMSNorm: weight of shape {tuple(weight.shape)} for rows of {columns}")


def _programs(device: torch.device) -> int:
    """Backward programs in flight: a few per multiprocessor (each sums its own weight-gradient partial)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


class _TritonRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, rows_per_program):
        from . import rms_norm_triton as kernels

        columns = x.size(-1)
        check_weight(weight, columns)
        rows_in = x.reshape(-1, columns).contiguous()
        rows = rows_in.size(0)
        y = torch.empty_like(rows_in)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        w = weight.contiguous()
        block = kernels.block_size(columns)
        kernels.rms_norm_forward[(rows,)](rows_in, w, y, rstd, eps, columns, BLOCK=block,
                                          num_warps=kernels.warps(block))
        ctx.save_for_backward(rows_in, w, rstd)
        ctx.block, ctx.rows_per_program, ctx.weight_dtype, ctx.shape = block, rows_per_program, weight.dtype, x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward_triton(dy.reshape(x.shape), x, w, rstd, ctx.rows_per_program, ctx.block)
        return dx.view(ctx.shape), dw.to(ctx.weight_dtype), None, None


def rms_norm_backward_triton(dy, x, w, rstd, rows_per_program: int = 0, block: int = 0):
    """(dx in x's dtype, dw in fp32) of rows x [rows, columns] normalized with their rsqrt `rstd` and scaled by w, for
    the output gradient dy: the Triton backward kernel, `rows_per_program` rows a program (0: spread over the
    device), their partial weight gradients summed by torch."""
    from . import rms_norm_triton as kernels

    rows, columns = x.shape
    block = block or kernels.block_size(columns)
    per_program = rows_per_program or -(-rows // _programs(x.device))
    programs = -(-rows // per_program)
    dy = dy.contiguous()
    dx = torch.empty_like(x)
    partial = torch.empty(programs, columns, device=x.device, dtype=torch.float32)
    kernels.rms_norm_backward[(programs,)](dy, x, w, rstd, dx, partial, rows, columns,
                                           ROWS_PER_PROGRAM=per_program, BLOCK=block, num_warps=kernels.warps(block))
    return dx, partial.sum(0)


def rms_norm_backward_reference(dy, x, w, rstd):
    """rms_norm_backward_triton's function in plain torch (fp32 at least): dx = rstd (g - xhat mean(g xhat)) with
    g = dy w and xhat = x rstd, and dw = the sum over rows of dy times xhat rounded to x's dtype (as the forward
    rounds it)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    xf, dyf, wf, r = x.to(dtype), dy.to(dtype), w.to(x.dtype).to(dtype), rstd.to(dtype)[:, None]
    xhat = xf * r
    g = dyf * wf
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x.dtype), (dyf * xhat.to(x.dtype).to(dtype)).sum(0)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, rows_per_program: int = 0) -> torch.Tensor:
    """The reference's function through the Triton kernels. `rows_per_program`: rows per backward program (tests
    force several programs, and a last one with fewer rows, on small inputs); 0 spreads them over the device."""
    return _TritonRMSNorm.apply(x, weight, eps, rows_per_program)


rms_norm_path = kernel_path  # what `rms_norm` runs on a device of this type


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if rms_norm_path(x.device.type) == "litespark":
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)
