"""Build a --peft model as litespark-train does (megatron.training's setup_model_and_optimizer, any TP/PP layout),
then, on given tokens (one micro-batch, through megatron-core's pipeline schedule):

    1. the logits with the adapters as initialized, and with the adapted linears replaced by their bases: equal bit
       for bit (B = 0);
    2. the adapters set to random values (drawn whole by global name, then split, so every layout holds one model),
       their logits, and the model saved with megatron.training's save_checkpoint to --save (iteration 1);
    3. --train-iters steps of megatron-core's optimizer on the same batch (the run's learning-rate schedule), each
       step's loss and gradient norm; the first step's gradient of every adapter parameter (after megatron-core's
       gradient finalization: the TP/SP sums), gathered whole.

    torchrun ... tests/workers/peft_worker.py TOKENS.json OUT.pt -- [litespark-train flags, with --peft ... --save DIR]

OUT.pt (rank 0): {"identity": bool, "base_logits", "logits": [b, s, vocab], "losses", "grad_norms": [per step],
"grads": {global parameter name: tensor}, "learning_rates": {the optimizer's parameters: (max_lr, min_lr)}}.
TOKENS.json holds b rows of s + 1 tokens: the mean cross-entropy of the next token is the loss.
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
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    # (megatron-core checks gradients for NaN inside megatron.training's rerun loop only, which this is not)
    args = arguments.parse(flags + ["--micro-batch-size", str(inputs.size(0)), "--seq-length", str(inputs.size(1)),
                                    "--no-check-for-nan-in-loss-and-grad"], plat)
    from megatron.core import mpu, parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.enums import ModelType
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_model_config, unwrap_model
    from megatron.training.argument_utils import pretrain_cfg_container_from_args
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer

    from litespark_megatron.layers.adapters import AdaptedLinear

    initialize_megatron(allow_no_cuda=True)
    cfg = pretrain_cfg_container_from_args(args, model.model_config_from_args(args))
    chunks, optimizer, scheduler = setup_model_and_optimizer(
        ModelType.encoder_or_decoder, cfg_container=cfg, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    bare = unwrap_model(chunks)
    get_model_config(chunks[0]).finalize_model_grads_func = finalize_model_grads  # as megatron.training's train()
    device = platform.current_device()
    inputs, labels = inputs.to(device), labels.to(device)
    positions = torch.arange(inputs.size(1), device=device).expand_as(inputs)
    schedule = get_forward_backward_func()

    def run(forward_only):
        """The last stage's {"logits"} (forward only) or {"loss"}; None on the other stages."""
        def loss_func(output):
            if forward_only:  # logits [b, s, vocab / TP]
                full = gather_from_tensor_model_parallel_region(output)
                return full.sum() * 0, {"logits": full.detach().float().cpu()}
            loss = output.float().mean()  # per-token cross-entropy [b, s]
            return loss, {"loss": loss.detach().cpu()}

        def forward_step(data_iterator, net):
            return net(inputs, positions, None, labels=None if forward_only else labels), loss_func

        for chunk in chunks:
            chunk.zero_grad_buffer()
            chunk.train(not forward_only)
        optimizer.zero_grad()
        results = schedule(forward_step_func=forward_step, data_iterator=[iter([None])] * len(chunks), model=chunks,
                           num_microbatches=1, seq_length=inputs.size(1), micro_batch_size=inputs.size(0),
                           forward_only=forward_only)
        return results[0] if results else None

    # what the optimizer holds: each parameter's learning rates (LoRA-plus's overrides)
    names = {id(p): model.global_name(chunk, n) for chunk in bare for n, p in chunk.named_parameters()}
    mine = {"learning_rates": {names[id(p)]: (group["max_lr"], group["min_lr"]) for group in optimizer.param_groups
                               for p in group["params"]}}

    # 1. B = 0: the adapted model computes its base, bit for bit
    with torch.no_grad():
        adapted = run(True)
        wrappers = [(parent, name, child) for chunk in bare for parent in chunk.modules()
                    for name, child in parent.named_children() if isinstance(child, AdaptedLinear)]
        for parent, name, wrapper in wrappers:
            setattr(parent, name, wrapper.base)
        plain = run(True)
        for parent, name, wrapper in wrappers:
            setattr(parent, name, wrapper)
    if adapted is not None:
        mine["identity"] = torch.equal(adapted["logits"], plain["logits"])
        mine["base_logits"] = plain["logits"]

    # 2. random adapters, one model in every layout; their logits; the checkpoint
    tp_rank, tp = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    with torch.no_grad():
        for chunk in bare:
            for name, param in chunk.named_parameters():
                if ".adapter." not in name:
                    continue
                dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
                shape = list(param.shape)
                if dim is not None:
                    shape[dim] *= tp
                full = torch.randn(shape, generator=model.parameter_generator(7, model.global_name(chunk, name),
                                                                              "cpu"))
                if dim is not None:
                    full = full.chunk(tp, dim=dim)[tp_rank]
                if ".magnitude." in name:
                    param.mul_(1 + 0.1 * full)
                elif ".lora_B." in name:
                    param.copy_(0.02 * full)
                else:
                    param.add_(0.02 * full)
        optimizer.reload_model_params()  # the optimizer's fp32 copies (bf16/fp16 runs) follow the parameters
    trained = run(True)
    if trained is not None:
        mine["logits"] = trained["logits"]
    save_checkpoint(1, chunks, None, None, 0)

    # 3. training steps; the first step's gradients
    losses, grad_norms, grads = [], [], {}
    for step in range(args.train_iters):
        result = run(False)  # ends with the gradients' finalization (DP, SP and pipeline sums)
        if step == 0:
            for chunk in bare:
                for name, param in chunk.named_parameters():
                    if not param.requires_grad:
                        continue
                    grad = param.main_grad.detach().clone()
                    if getattr(param, "tensor_model_parallel", False) and tp > 1:
                        parts = [torch.empty_like(grad) for _ in range(tp)]
                        torch.distributed.all_gather(parts, grad, group=mpu.get_tensor_model_parallel_group())
                        grad = torch.cat(parts, dim=param.partition_dim)
                    grads[model.global_name(chunk, name)] = grad.float().cpu()
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=args.global_batch_size)
        losses.append(None if result is None else result["loss"].item())
        grad_norms.append(grad_norm)
    mine.update(losses=losses, grad_norms=grad_norms, grads=grads)

    everything = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everything, mine)
    if torch.distributed.get_rank() == 0:
        report = {"grads": {}, "learning_rates": {}}
        for theirs in everything:  # the last stage's logits and losses; every stage's gradients and parameters
            report["grads"].update(theirs.pop("grads"))
            report["learning_rates"].update(theirs.pop("learning_rates"))
            if theirs["losses"][0] is not None:
                report.update(theirs)
        torch.save(report, out)
    leave_together()


if __name__ == "__main__":
    main()
