"""The bytes the tiny model saves for the backward of one training forward on the CPU, for the memory model's checks:

    python tests/workers/memory_worker.py "FLAGS" ["FLAGS" ...]   # litespark-train flags of one model each

Builds each model in turn in this one process (1 rank) and prints a JSON list: per model `saved_bytes`, the bytes of
every distinct storage the autograd graph keeps (views of one buffer count once, the buffer whole; parameters are
not activations and are left out).
"""
import json
import shlex
import sys

import torch

import bare_model


def saved_bytes(flags, plat) -> int:
    args, model = bare_model.build(["--no-gradient-accumulation-fusion", *flags], plat)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    b, s, vocab = args.micro_batch_size, args.seq_length, args.vocab_size
    g = torch.Generator().manual_seed(7)
    tokens, labels = (torch.randint(0, vocab, (b, s), generator=g) for _ in range(2))
    position_ids = torch.arange(s).expand(b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, position_ids, None, labels=labels)
    loss.sum().backward()  # what was saved served the backward
    return sum(storages.values())


def main():
    plat = bare_model.start()
    print(json.dumps([saved_bytes(shlex.split(flags), plat) for flags in sys.argv[1:]]))
    bare_model.stop()


if __name__ == "__main__":
    main()
