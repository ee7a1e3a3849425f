"""What the tiny model keeps for the backward of one forward with labels (the training forward):

    python tests/workers/saved_tensors_worker.py "FLAGS" ["FLAGS" ...]   # litespark-train flags of one model each

Builds each model in turn in this one process and prints a JSON list, one entry per model: `layers`;
`qkv_outputs_kept`, how many layers keep their QKV projection's output (the buffer query, key and value are split
from) among the saved tensors; `logits_saved` and `logits_shapes`, the saved tensors that are logits-shaped (last
dimension the output layer's rows, not its weight); and, with --chunked-output-loss, `logits_max_diff`, how far the
chunked processor's logits without labels (generation) are from megatron-core's own.
"""
import json
import shlex
import sys

import torch

import bare_model


def main():
    plat = bare_model.start()
    print(json.dumps([saved_by(shlex.split(flags), plat) for flags in sys.argv[1:]]))
    bare_model.stop()


def saved_by(flags, plat) -> dict:
    # vocabulary 256: the output layer's rows differ from every other dimension of the tiny model (hidden 128)
    base = ["--model", "tiny", "--seq-length", "32", "--vocab-size", "256", "--no-gradient-accumulation-fusion"]
    args, model = bare_model.build(base + flags, plat)
    processor = {}
    if args.chunked_output_loss:
        from litespark_megatron.output_loss import chunked_output_loss

        processor = {"output_processor": chunked_output_loss(args.chunked_output_loss)}
    qkv_outputs = []  # each layer's linear_qkv output (held here: identity, not addresses a freed buffer reuses)
    for layer in model.decoder.layers:
        layer.self_attention.linear_qkv.register_forward_hook(
            lambda module, inputs, output: qkv_outputs.append(output[0]))
    rows = model.output_layer.weight.size(0)
    kept, logits_saved = set(), []

    def pack(t):
        base = t if t._base is None else t._base  # a view's root tensor
        kept.update(i for i, out in enumerate(qkv_outputs) if base is out)
        # logits, or the loss's copies of them (a GPU's attention also saves 0-dim tensors: its RNG seed and offset)
        if t.dim() and t.size(-1) == rows and not isinstance(base, torch.nn.Parameter):
            logits_saved.append(tuple(t.shape))
        return t

    g = torch.Generator().manual_seed(7)  # drawn on the CPU (the same tokens on every machine), then moved
    device = bare_model.platform_device()
    tokens, labels = (torch.randint(0, 256, (2, 32), generator=g).to(device) for _ in range(2))
    position_ids = torch.arange(32, device=device).expand(2, 32)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, None, labels=labels, **processor)
    assert loss.shape == (2, 32), loss.shape
    loss.sum().backward()  # the saved tensors were usable
    out = dict(layers=len(qkv_outputs), qkv_outputs_kept=len(kept), logits_saved=len(logits_saved),
               logits_shapes=logits_saved)
    if processor:
        with torch.no_grad():
            own, chunked = model(tokens, position_ids, None), model(tokens, position_ids, None, **processor)
        out["logits_max_diff"] = (own - chunked).abs().max().item()
    return out


if __name__ == "__main__":
    main()
