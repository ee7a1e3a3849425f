"""Builds the tiny model with two specs from the same seed and prints the largest logit and gradient differences.

    python tests/workers/spec_worker.py SPEC_A SPEC_B [litespark-train flags...]

A SPEC may carry flags of its own after the spec's name ("litespark --core-attention te").
"""
import json
import sys

import torch

import bare_model


def main():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    spec_a, spec_b, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    plat = bare_model.start()
    # Plain .grad on a bare model: fused accumulation would write into megatron DDP's main_grad, absent here.
    base = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--no-gradient-accumulation-fusion",
            *flags]
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(7))
    results = {}
    for spec in (spec_a, spec_b):
        name, *own = spec.split()
        _, model = bare_model.build(base + ["--spec", name, *own], plat)
        device = next(model.parameters()).device
        t = tokens.to(device)
        logits = model(t, torch.arange(32, device=device).expand(2, 32), None)   # [b, s, v]
        logits.float().square().mean().backward()
        grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}
        # Which layers the spec made MoE (megatron-core's MoELayer) and how many parameters it built.
        moe_layers = [i for i, layer in enumerate(model.decoder.layers) if isinstance(layer.mlp, MoELayer)]
        numel = sum(p.numel() for p in model.parameters())
        results[spec] = (logits.detach().float(), grads, sorted(model.state_dict()), moe_layers, numel)
    (la, ga, ka, ma, na), (lb, gb, kb, mb, nb) = results[spec_a], results[spec_b]
    common = sorted(set(ga) & set(gb))
    print(json.dumps({
        "logit_max_abs_diff": (la - lb).abs().max().item(),
        "logit_max_abs": la.abs().max().item(),
        "grad_max_rel_diff": max(((ga[n] - gb[n]).norm() / gb[n].norm().clamp_min(1e-12)).item() for n in common),
        "params_compared": len(common), "params_a": len(ga), "params_b": len(gb),
        "moe_layers_a": ma, "moe_layers_b": mb, "numel_a": na, "numel_b": nb,
        "same_keys": [k for k in ka if not k.endswith("_extra_state")] == [k for k in kb if not k.endswith("_extra_state")],
    }))
    bare_model.stop()


if __name__ == "__main__":
    main()
