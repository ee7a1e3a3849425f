"""Runs the first optimizer steps of a model on fixed random batches and writes the losses (rank 0) to a JSON file.

Started by the parity tests under torchrun with a parallel layout given as litespark-train flags:
    torchrun --nproc-per-node N tests/parity_worker.py OUT.json STEPS -- [flags...]
The global batch of each step depends only on the seed and the step, so every layout sees the same tokens.
"""
import json
import os
import sys

import torch


def global_batch(step: int, size: int, seq: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randint(0, vocab, (size, seq + 1), generator=g)


def micro_batches(tokens, micro_batch_size: int, dp_rank: int, dp_size: int):
    """Megatron's pretraining order: each slice of micro x DP consecutive samples, this rank's part of it."""
    seq = tokens.size(1) - 1
    for start in range(0, tokens.size(0), micro_batch_size * dp_size):
        mb = tokens[start + dp_rank * micro_batch_size: start + (dp_rank + 1) * micro_batch_size]
        yield dict(tokens=mb[:, :-1].contiguous(), labels=mb[:, 1:].contiguous(),
                   loss_mask=torch.ones(mb.size(0), seq), position_ids=torch.arange(seq).expand(mb.size(0), seq))


def main():
    out_path, steps = sys.argv[1], int(sys.argv[2])
    flags = sys.argv[sys.argv.index("--") + 1:]
    from litespark_megatron import config, platform
    from litespark_megatron.training import optim, step as step_lib
    from megatron.core import parallel_state as ps

    args = config.resolve(flags)
    plat = platform.detect()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    config.validate(args, world, cuda=plat.device_type == "cuda", te=plat.te, fp8_capable=plat.fp8_capable)
    platform.init_distributed(args, plat)
    backend = config.resolved_backend(args, cuda=plat.device_type == "cuda", te=plat.te)
    _, model, optimizer, scheduler = optim.build_training(args, backend, plat.device_type)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    gbs = args.global_batch_size or args.micro_batch_size * dp
    losses, norms = [], []
    for s in range(steps):
        tokens = global_batch(s, gbs, args.seq_length, args.vocab_size, args.seed)
        iters = [micro_batches(tokens, args.micro_batch_size, dp_rank, dp) for _ in model]
        result = step_lib.train_step(model, optimizer, scheduler, iters, gbs // (args.micro_batch_size * dp), args)
        losses.append(result.loss)
        norms.append(result.grad_norm)
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump({"losses": losses, "grad_norms": norms}, f)
    platform.shutdown()


if __name__ == "__main__":
    main()
