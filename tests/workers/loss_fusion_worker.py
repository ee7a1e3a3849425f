"""One model, one batch: per-token losses and gradients with megatron-core's unfused cross-entropy and with each
fused implementation (the config is read at loss time, so the same weights serve every run). Prints the largest
differences as JSON.

    python tests/workers/loss_fusion_worker.py [litespark-train flags...]
"""
import json
import sys

import torch

import bare_model


def main():
    plat = bare_model.start()
    # Plain .grad on a bare model: TE's fused accumulation would write into megatron DDP's main_grad, absent here.
    _, model = bare_model.build(["--seq-length", "64", "--vocab-size", "1024", "--no-gradient-accumulation-fusion",
                                 *sys.argv[1:]], plat)
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(7)
    tokens, labels = (torch.randint(0, 1024, (2, 64), generator=g).to(device) for _ in range(2))
    position_ids = torch.arange(64, device=device).expand(2, 64)
    runs = {}
    for name, fused, impl in (("unfused", False, "native"), ("native", True, "native"), ("te", True, "te")):
        model.config.cross_entropy_loss_fusion, model.config.cross_entropy_fusion_impl = fused, impl
        model.zero_grad(set_to_none=True)
        loss = model(tokens, position_ids, None, labels=labels)  # [b, s] per-token losses
        loss.float().sum().backward()
        runs[name] = (loss.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()})
    ref_loss, ref_grads = runs["unfused"]
    report = {"loss_mean": ref_loss.mean().item()}
    for name in ("native", "te"):
        loss, grads = runs[name]
        report[name] = {
            "loss_max_abs_diff": (loss - ref_loss).abs().max().item(),
            "grad_max_rel_diff": max(((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-12)).item()
                                     for n in ref_grads),
        }
    print(json.dumps(report))
    bare_model.stop()


if __name__ == "__main__":
    main()
