"""Load a checkpoint as litespark-train does (megatron.training's setup_model_and_optimizer, any TP/PP layout)
and save the model's logits on given tokens, the vocabulary gathered over TP, as a torch file.

    torchrun ... tests/workers/hf_logits_worker.py TOKENS.json OUT.pt -- [litespark-train flags, e.g. --load DIR]

One micro-batch of all the rows, forward only, through megatron-core's pipeline schedule.
"""
import json
import sys

import torch
from leave_together import leave_together  # beside this script


def main():
    tokens = torch.tensor(json.load(open(sys.argv[1]))["tokens"])
    out = sys.argv[2]
    flags = sys.argv[sys.argv.index("--") + 1:]
    from litespark_megatron import arguments, model, platform

    plat = platform.prepare_libraries()
    args = arguments.parse(flags + ["--micro-batch-size", str(tokens.size(0)), "--seq-length", str(tokens.size(1))],
                           plat)
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    initialize_megatron(allow_no_cuda=True)
    cfg = pretrain_cfg_container_from_args(args, model.model_config_from_args(args))
    chunks, _, _ = setup_model_and_optimizer(ModelType.encoder_or_decoder, cfg_container=cfg,
                                             pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    for chunk in chunks:
        chunk.eval()
    device = platform.current_device()
    inputs = tokens.to(device)
    positions = torch.arange(inputs.size(1), device=device).expand_as(inputs)

    def loss_func(logits):
        full = gather_from_tensor_model_parallel_region(logits)  # [b, s, vocab]
        return full.sum() * 0, {"logits": full}

    def forward_step(data_iterator, net):
        return net(inputs, positions, None), loss_func

    with torch.no_grad():
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter([None])] * len(chunks), model=chunks,
            num_microbatches=1, seq_length=inputs.size(1), micro_batch_size=inputs.size(0), forward_only=True)
    if mpu.is_pipeline_last_stage() and mpu.get_tensor_model_parallel_rank() == 0 and \
            mpu.get_data_parallel_rank() == 0:
        torch.save(results[0]["logits"].float().cpu(), out)
    leave_together()


if __name__ == "__main__":
    main()
