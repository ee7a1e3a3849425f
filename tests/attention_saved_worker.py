"""Which storages the tiny model's attention keeps for the backward: does any layer hold its QKV projection's
output (the buffer the query, key and value are split from) until the backward?

    python tests/attention_saved_worker.py [litespark-train flags...]

Prints JSON: layers, and how many of them keep that buffer among the saved tensors.
"""
import json
import sys

import torch

import bare_model


def main():
    plat = bare_model.start()
    base = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "128", "--no-gradient-accumulation-fusion"]
    _, model = bare_model.build(base + sys.argv[1:], plat)
    qkv_outputs = []  # each layer's linear_qkv output (held here: identity, not addresses a freed buffer reuses)
    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.register_forward_hook(
            lambda module, inputs, output: qkv_outputs.append(output[0]))
    kept = set()

    def pack(t):
        base = t if t._base is None else t._base  # a view's root tensor
        kept.update(i for i, out in enumerate(qkv_outputs) if base is out)
        return t

    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(7))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(tokens, torch.arange(32).expand(2, 32), None)
    logits.float().square().mean().backward()  # the saved tensors were usable
    print(json.dumps(dict(layers=len(qkv_outputs), qkv_outputs_kept=len(kept))))
    bare_model.stop()


if __name__ == "__main__":
    main()
