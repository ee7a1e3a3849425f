"""Litespark's FP8 output layer (litespark_megatron/kernels/fp8_logits.py) on gloo ranks, its Triton kernels through
Triton's interpreter (TRITON_INTERPRET=1 in the environment, before anything imports Triton). Run by torchrun with 2
ranks: a TP group of 2 splits the vocabulary as megatron-core does, against one rank holding it whole. Rank 0 prints
one JSON line:

    kernel_mismatched / kernel_elements / kernel_max_step   FP8 bytes of the Triton kernels that differ from the
                                         reference's (cast and gradient, both layouts, the gradient rounded to
                                         nearest and stochastically), over all cases
    layouts_agree                        the column-major bytes are the row-major ones transposed
    over_logits                          both layouts of the loss's gradient live in the logits' memory
    triton_vs_reference_loss / _grad_h / _grad_w   the whole function, Triton kernels against the reference
    tp2_vs_tp1_loss / _grad_h / _grad_w  TP2 against TP1 (relative to the largest value)
    padded_loss                          padded columns (-inf) against the same logits without them
"""
import json

import torch
import torch.distributed as dist

from litespark_megatron.kernels import fp8_logits as fl

TOKENS, HIDDEN, SHARD = 37, 48, 40  # odd token count; a vocabulary of 80 in two shards


def rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


SEED = 987654321  # the loss gradient's stochastic rounding, the same on both ranks (as a TP group's)


def run(triton: bool, h, weight, target, group, padded_from=None, grad_loss=None):
    h = h.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    loss = fl._FP8LogitsLoss.apply(h, w, target, group, padded_from, False, triton, SEED)
    grad_loss = torch.ones_like(loss) if grad_loss is None else grad_loss
    gh, gw = torch.autograd.grad(loss, (h, w), grad_loss)
    return loss.detach(), gh, gw


def kernels(out):
    """Each Triton kernel against the reference, odd shapes, both input dtypes; the gradient with targets in and out
    of the shard, padded (-inf) columns, masked (zero-gradient) tokens."""
    g = torch.Generator().manual_seed(1)
    # 70, 129 and 300 rows: the gradient's launches over doubling row ranges after its first 64 rows, a last one short
    for rows, cols in ((3, 5), (70, 37), (129, 64), (1, 130), (300, 17)):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(rows, cols, generator=g) * 3).to(dtype)
            scale = fl.amax_scale(x, fl.FORWARD)
            for got, want in zip(fl.quantize_triton(x, scale, fl.FORWARD), fl.quantize_reference(x, scale, fl.FORWARD)):
                compare(out, got, want)
            logits = (torch.randn(rows, cols, generator=g) * 4).to(dtype)
            logits[:, cols - cols // 4:] = float("-inf")
            vocab_start = cols
            target = torch.randint(0, 3 * cols, (rows,), generator=g)
            lse = torch.logsumexp(logits.float(), dim=-1) + 0.5  # as if other shards added mass
            grad = torch.randn(rows, generator=g) * 1e-3
            grad[::3] = 0.0
            scale = fl.current_scale(grad.abs().amax(), fl.BACKWARD)
            for seed in (None, SEED):  # rounded to nearest, stochastically
                want = fl.gradient_fp8_reference(logits, target, lse, grad, scale, vocab_start, seed=seed)
                over = logits.clone()
                got = fl.gradient_fp8_over_logits(over, target, lse, grad, scale, vocab_start, seed=seed)
                out["over_logits"] &= all(t.untyped_storage().data_ptr() == over.untyped_storage().data_ptr()
                                          for t in got)
                for a, b in zip(got, want):
                    compare(out, a, b)
                out["layouts_agree"] &= torch.equal(got[1].view(torch.uint8), got[0].view(torch.uint8).t())


def compare(out, got, want):
    a, b = got.view(torch.uint8), want.view(torch.uint8)
    out["kernel_mismatched"] += (a != b).sum().item()
    out["kernel_elements"] += a.numel()
    out["kernel_max_step"] = max(out["kernel_max_step"], (a.int() - b.int()).abs().max().item())


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp2 = dist.new_group([0, 1])
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(TOKENS, HIDDEN, generator=g) * 2).to(torch.bfloat16)
    weight = (torch.randn(2 * SHARD, HIDDEN, generator=g) * 0.05).to(torch.bfloat16)
    target = torch.randint(0, 2 * SHARD, (TOKENS,), generator=g)
    grad_loss = torch.rand(TOKENS, generator=g) / TOKENS
    out = {}
    # TP1 on every rank (the whole vocabulary), then TP2 (this rank's shard)
    whole = run(False, h, weight, target, None, grad_loss=grad_loss)
    mine = run(False, h, weight[rank * SHARD:(rank + 1) * SHARD], target, tp2, grad_loss=grad_loss)
    out["tp2_vs_tp1_loss"] = rel(mine[0], whole[0])
    out["tp2_vs_tp1_grad_h"] = rel(dist_sum(mine[1]), whole[1])
    out["tp2_vs_tp1_grad_w"] = rel(mine[2], whole[2][rank * SHARD:(rank + 1) * SHARD])
    fast = run(True, h, weight[rank * SHARD:(rank + 1) * SHARD], target, tp2, grad_loss=grad_loss)
    for i, key in enumerate(("loss", "grad_h", "grad_w")):
        out[f"triton_vs_reference_{key}"] = rel(fast[i], mine[i])
    if rank == 0:
        # padded columns: the loss of the first 60 of 80 columns, with the last 20 as -inf
        cut = 60
        padded = run(False, h, weight, target % cut, None, padded_from=cut, grad_loss=grad_loss)
        plain = run(False, h, weight[:cut], target % cut, None, grad_loss=grad_loss)
        out["padded_loss"] = rel(padded[0], plain[0])
        out["padded_grad_w_zero"] = padded[2][cut:].abs().max().item()
        out.update(kernel_mismatched=0, kernel_elements=0, kernel_max_step=0, layouts_agree=True, over_logits=True)
        kernels(out)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if rank == 0:
        report = dict(gathered[0])
        for key in ("tp2_vs_tp1_loss", "tp2_vs_tp1_grad_h", "tp2_vs_tp1_grad_w", "triton_vs_reference_loss",
                    "triton_vs_reference_grad_h", "triton_vs_reference_grad_w"):
            report[key] = max(o[key] for o in gathered)
        print(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def dist_sum(t):
    """dh summed over the TP ranks (megatron-core's mapping all-reduces it in the backward)."""
    t = t.float().clone()
    dist.all_reduce(t)
    return t


if __name__ == "__main__":
    main()
