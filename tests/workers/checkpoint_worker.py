"""Load a checkpoint exactly as litespark-train does (megatron.training's setup_model_and_optimizer with the
model litespark-train builds) and print the model's mean token loss on given tokens, as JSON.

    python tests/workers/checkpoint_worker.py TOKENS.json -- [litespark-train flags, e.g. --load DIR --finetune]

TOKENS.json holds {"tokens": [[...], ...]}: each row is an input sequence plus its last label (inputs row[:-1],
labels row[1:]). One process, no pipeline parallelism.
"""
import json
import sys

import torch
from leave_together import leave_together  # beside this script


def main():
    tokens = torch.tensor(json.load(open(sys.argv[1]))["tokens"])
    flags = sys.argv[sys.argv.index("--") + 1:]
    from litespark_megatron import arguments, model, platform

    plat = platform.prepare_libraries()
    args = arguments.parse(flags, plat)
    from megatron.core.enums import ModelType
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    initialize_megatron(allow_no_cuda=True)
    cfg = pretrain_cfg_container_from_args(args, model.model_config_from_args(args))
    chunks, _, _ = setup_model_and_optimizer(ModelType.encoder_or_decoder, cfg_container=cfg,
                                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    net = chunks[0]
    net.eval()
    device = platform.current_device()
    inputs, labels = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    positions = torch.arange(inputs.size(1), device=device).expand_as(inputs)
    with torch.no_grad():
        losses = net(inputs, positions, None, labels=labels)
    print(json.dumps({"mean_loss": float(losses.float().mean())}), flush=True)
    leave_together()


if __name__ == "__main__":
    main()
