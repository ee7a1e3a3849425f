"""The Triton kernel of Litespark's Adam step (adam.py defines it and says why): one launch per kind of tensors, a
program per chunk of one tensor, found through a table of the tensors' offsets from the first of each list, walking
its chunk in blocks.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

# Measured on an H200 over llama-3b's parameters (docs/benchmarks/): four elements a thread, a few blocks a program.
BLOCK = 512    # elements a program loads at once
CHUNK = 16384  # elements a program walks
WARPS = 4

MASTER_CODES = {"none": 0, "fp32": 1, "remainders": 2}
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 rounded to nearest even, as its bits (int16): what the GPU's conversion does, written out so
    that Triton's interpreter (which truncates) computes the same bits; NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _store(ptr, offs, x, mask, DTYPE: tl.constexpr):
    """x (fp32) stored as DTYPE at ptr (an int16 pointer when DTYPE is bf16)."""
    if DTYPE == tl.bfloat16:
        tl.store(ptr + offs, _bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + offs, x.to(DTYPE), mask=mask)


@triton.jit
def _load(ptr, offs, mask, DTYPE: tl.constexpr):
    """fp32 values of a DTYPE tensor at ptr (an int16 pointer when DTYPE is bf16)."""
    x = tl.load(ptr + offs, mask=mask, other=0)
    if DTYPE == tl.bfloat16:
        y = (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        y = x.to(tl.float32)
    return y


@triton.jit
def adam_step_kernel(g_base, p_base, m_base, v_base, r_base, offsets, chunk_tensor, chunk_start, grad_scale, lr, beta1,
                     beta2, one_minus_beta1, one_minus_beta2, eps, decay, c1, c2, SCALED: tl.constexpr,
                     MASTER: tl.constexpr,
                     ADAM_W: tl.constexpr, PARAM: tl.constexpr, GRAD: tl.constexpr, MOMENT: tl.constexpr,
                     MOMENT_SQ: tl.constexpr, ALIGN_G: tl.constexpr, ALIGN_P: tl.constexpr, ALIGN_M: tl.constexpr,
                     ALIGN_V: tl.constexpr, ALIGN_R: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    # Each tensor is its list's base pointer plus an offset in elements (its row of `offsets`), a multiple of its
    # list's ALIGN_ elements: so Triton knows the blocks' alignment and loads them in 16-byte pieces (addresses read
    # from a table would tell it nothing, and it would load element by element, as TE's kernel does).
    pid = tl.program_id(0)
    t = tl.load(chunk_tensor + pid)
    start = tl.load(chunk_start + pid)
    row = offsets + t * 6
    n = tl.load(row + 5)
    g_ptr = g_base + tl.multiple_of(tl.load(row + 0), ALIGN_G)
    p_ptr = p_base + tl.multiple_of(tl.load(row + 1), ALIGN_P)
    m_ptr = m_base + tl.multiple_of(tl.load(row + 2), ALIGN_M)
    v_ptr = v_base + tl.multiple_of(tl.load(row + 3), ALIGN_V)
    r_ptr = r_base + tl.multiple_of(tl.load(row + 4), ALIGN_R)
    end = tl.minimum(start + CHUNK, n)
    if SCALED:
        c = tl.load(grad_scale)
    for i in range(0, CHUNK // BLOCK):
        first = tl.multiple_of(start + i * BLOCK, BLOCK)
        offs = first + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < end
        g = _load(g_ptr, offs, mask, GRAD)
        if SCALED:
            g = g * c
        m = _load(m_ptr, offs, mask, MOMENT)
        v = _load(v_ptr, offs, mask, MOMENT_SQ)
        if MASTER == 2:  # bf16 parameter + int16 remainders, read and written as their bits
            high = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
            low = tl.load(r_ptr + offs, mask=mask, other=0).to(tl.int32)
            high = tl.where(low < 0, high - 1, high)  # the parameter was rounded up: undo it
            p = ((high << 16) | (low & 0xFFFF)).to(tl.float32, bitcast=True)
        elif MASTER == 1:
            p = tl.load(r_ptr + offs, mask=mask, other=0.0)
        else:
            p = _load(p_ptr, offs, mask, PARAM)
        if not ADAM_W:
            g = g + decay * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * g * g
        update = tl.div_rn(tl.div_rn(m, c1), tl.sqrt_rn(tl.div_rn(v, c2)) + eps)
        if ADAM_W:
            update = update + decay * p
        p = p - lr * update
        _store(m_ptr, offs, m, mask, MOMENT)
        _store(v_ptr, offs, v, mask, MOMENT_SQ)
        if MASTER == 2:
            bits = p.to(tl.int32, bitcast=True)
            low = (bits & 0xFFFF).to(tl.int16)  # two's complement: the top bit set is a negative remainder
            high = tl.where(low < 0, (bits >> 16) + 1, bits >> 16)
            tl.store(p_ptr + offs, high.to(tl.int16), mask=mask)
            tl.store(r_ptr + offs, low, mask=mask)
        elif MASTER == 1:
            _store(p_ptr, offs, p, mask, PARAM)
            tl.store(r_ptr + offs, p, mask=mask)
        else:
            _store(p_ptr, offs, p, mask, PARAM)


# The tables of a list of tensors, by their addresses and sizes: the optimizer's tensors stay where they are from
# step to step, so each list's tables are built (and copied to the GPU) once.
_TABLES: Dict[Tuple, tuple] = {}
ALIGN_BYTES = 16


def _storage(t: torch.Tensor) -> torch.Tensor:
    """A tensor as the kernel reads it: bf16 as its bits (int16), as the kernel's loads and stores of bf16 take."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def _tables(tensors) -> tuple:
    """(offsets [tensors, 6]: the five offsets in elements from each list's first tensor and the size, chunk ->
    tensor, chunk -> first element, each list's alignment in elements) of a list of tensors. (The tables hold no
    tensor of the optimizer's: the first of each list is passed again at each launch.)"""
    lists = [tensors.grads, tensors.params, tensors.exp_avgs, tensors.exp_avg_sqs,
             tensors.masters if tensors.how != "none" else tensors.params]
    ptrs = [[t.data_ptr() for t in x] for x in lists]
    dtypes = tuple(x[0].dtype for x in lists)
    sizes = tuple(p.numel() for p in tensors.params)
    key = (tensors.how, dtypes, tensors.params[0].device, sizes) + tuple(map(tuple, ptrs))
    found = _TABLES.get(key)
    if found is not None:
        return found
    tensors.check()  # once per list of tensors: what the table holds was checked when it was built
    element = [_storage(x[0]).element_size() for x in lists]
    offsets = np.zeros((len(sizes), 6), dtype=np.int64)
    for j in range(5):
        offsets[:, j] = (np.array(ptrs[j], dtype=np.int64) - ptrs[j][0]) // element[j]
    offsets[:, 5] = sizes
    # Each list's alignment in elements: the largest power of two (up to 16 bytes) dividing every address of it
    # (its base included, which Triton is told as a pointer argument).
    aligns = []
    for j in range(5):
        align = ALIGN_BYTES
        while align > element[j] and any(p % align for p in ptrs[j]):
            align //= 2
        aligns.append(max(1, align // element[j]))
    chunks = -(-offsets[:, 5] // CHUNK)
    chunk_tensor = np.repeat(np.arange(len(sizes), dtype=np.int64), chunks)
    first_chunk = np.concatenate(([0], np.cumsum(chunks)[:-1]))
    chunk_start = (np.arange(len(chunk_tensor), dtype=np.int64) - first_chunk[chunk_tensor]) * CHUNK
    device = tensors.params[0].device
    found = tuple(torch.from_numpy(a).to(device) for a in (offsets, chunk_tensor, chunk_start)) + (aligns,)
    if len(_TABLES) > 64:  # tensors that moved (a rebuilt optimizer): forget the old tables
        _TABLES.clear()
    _TABLES[key] = found
    return found


def adam_multi_tensor(tensors, hyper, grad_scale=None) -> None:
    """One Adam step of `tensors` (adam.AdamTensors) in one launch, the gradients multiplied by `grad_scale` (one
    fp32 value on the GPU) if given. No fused multiply-adds: each operation rounds as the reference's does, so the
    kernel writes the reference's bytes."""
    offsets, chunk_tensor, chunk_start, aligns = _tables(tensors)
    bases = [_storage(x[0]) for x in (tensors.grads, tensors.params, tensors.exp_avgs, tensors.exp_avg_sqs,
                                      tensors.masters if tensors.how != "none" else tensors.params)]
    s = hyper.scalars()
    scale = offsets if grad_scale is None else grad_scale  # (a pointer the kernel does not read when unscaled)
    adam_step_kernel[(chunk_tensor.numel(),)](
        *bases, offsets, chunk_tensor, chunk_start, scale, float(s["lr"]), float(s["beta1"]), float(s["beta2"]),
        float(s["one_minus_beta1"]), float(s["one_minus_beta2"]), float(s["eps"]), float(s["decay"]),
        float(s["c1"]), float(s["c2"]), SCALED=grad_scale is not None, MASTER=MASTER_CODES[tensors.how],
        ADAM_W=bool(hyper.adam_w_mode), PARAM=_TL[tensors.params[0].dtype], GRAD=_TL[tensors.grads[0].dtype],
        MOMENT=_TL[tensors.exp_avgs[0].dtype], MOMENT_SQ=_TL[tensors.exp_avg_sqs[0].dtype], ALIGN_G=aligns[0],
        ALIGN_P=aligns[1], ALIGN_M=aligns[2], ALIGN_V=aligns[3], ALIGN_R=aligns[4], BLOCK=BLOCK, CHUNK=CHUNK,
        num_warps=WARPS, enable_fp_fusion=False)
