"""The Triton kernel of Litespark's int4 linear layer (int4_linear.py defines it and says why): a few rows of
activations times an int4 weight, the weight's packed bytes read once.

A program takes BLOCK_N output columns and one of SPLIT_K slices of the input columns: decode's outputs are too few
to keep the GPU busy otherwise. For each group of GROUP input columns it reads [BLOCK_N, GROUP / 2] packed bytes and
the group's scales and zeros, dequantizes the low and the high nibbles (the even and the odd input columns) to the
activations' dtype, and multiplies each by the matching columns of the activations on the tensor cores (the rows
padded to 16), summing in fp32. One slice writes the output itself; more write partial sums (fp32, [SPLIT_K, rows,
out]) that one torch reduction adds and rounds.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 32
BLOCK_M = 16  # the tensor cores' smallest tile of rows
WARPS = 4


@triton.jit
def int4_matmul_kernel(x, packed, scale, zero, partial, M, N, K, groups_per_split,
                       GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    half = tl.arange(0, GROUP // 2)
    n_ok, rows_ok = n < N, rows < M
    groups = K // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = split * groups_per_split
    for g in range(first, tl.minimum(first + groups_per_split, groups)):
        byte = tl.load(packed + n[:, None] * (K // 2) + g * (GROUP // 2) + half[None, :], mask=n_ok[:, None],
                       other=0)
        s = tl.load(scale + n * groups + g, mask=n_ok, other=0).to(tl.float32)
        z = tl.load(zero + n * groups + g, mask=n_ok, other=0).to(tl.float32)
        low = ((byte & 0xF).to(tl.float32) * s[:, None] + z[:, None]).to(x.dtype.element_ty)
        high = ((byte >> 4).to(tl.float32) * s[:, None] + z[:, None]).to(x.dtype.element_ty)
        column = g * GROUP + 2 * half
        x_even = tl.load(x + rows[:, None] * K + column[None, :], mask=rows_ok[:, None], other=0)
        x_odd = tl.load(x + rows[:, None] * K + column[None, :] + 1, mask=rows_ok[:, None], other=0)
        acc += tl.dot(x_even, tl.trans(low))
        acc += tl.dot(x_odd, tl.trans(high))
    tl.store(partial + split * M * N + rows[:, None] * N + n[None, :], acc.to(partial.dtype.element_ty),
             mask=rows_ok[:, None] & n_ok[None, :])


def _splits(n_blocks: int, groups: int, device: torch.device) -> int:
    """Slices of the input columns: enough programs for a few per multiprocessor, each slice whole groups."""
    if device.type != "cuda":
        return min(groups, 2)
    target = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(groups, -(-target // n_blocks)))


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                splits: int = 0) -> torch.Tensor:
    """x [M <= BLOCK_M * k, K] @ W~^T -> [M, N] in x's dtype (`splits`: the slices of K, 0 for the heuristic)."""
    M, K = x.shape
    N = packed.shape[0]
    groups = scale.shape[1]
    group = K // groups
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    n_blocks = triton.cdiv(N, BLOCK_N)
    splits = splits or _splits(n_blocks, groups, x.device)
    per_split = triton.cdiv(groups, splits)
    splits = triton.cdiv(groups, per_split)
    for start in range(0, M, BLOCK_M):  # decode's rows fit one tile; a few more take a few
        rows = x[start:start + BLOCK_M]
        # One slice writes the output itself; more write fp32 partial sums, added (and rounded) in one reduction.
        partial = out[start:start + BLOCK_M] if splits == 1 else \
            torch.empty((splits, rows.shape[0], N), dtype=torch.float32, device=x.device)
        int4_matmul_kernel[(n_blocks, splits)](rows, packed, scale, zero, partial, rows.shape[0], N, K, per_split,
                                               GROUP=group, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=WARPS)
        if splits > 1:
            torch.sum(partial, 0, dtype=x.dtype, out=out[start:start + BLOCK_M])
    return out
