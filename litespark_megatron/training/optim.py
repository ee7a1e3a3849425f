"""Model chunks -> megatron DDP wrappers, the megatron optimizer (Adam, optionally distributed) and LR schedule."""
from __future__ import annotations

from typing import List

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer.module import Float16Module

from .. import model as model_lib
from ..model import params_dtype


def build_training(args, backend: str, device_type: str):
    """What a training job holds, built the one way litespark-train (and the benchmark) build it: this rank's model
    chunks, their megatron DDP wrappers, the optimizer and the LR schedule."""
    tconfig = model_lib.transformer_config(args, backend, device_type)
    chunks = model_lib.build_model(args, tconfig, backend, args.vocab_size)
    model = wrap_model(args, tconfig, chunks)
    optimizer = build_optimizer(args, model)
    return chunks, model, optimizer, build_scheduler(args, optimizer)


def wrap_model(args, config, chunks: List[torch.nn.Module]) -> List[DistributedDataParallel]:
    """Float16Module (bf16/fp16) inside megatron DDP, one per virtual stage; only the first chunk buckets."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        check_for_nan_in_grad=False,  # inf/nan steps are detected by the optimizer and counted as skipped
    )
    wrapped = []
    for i, chunk in enumerate(chunks):
        if args.bf16 or args.fp16:
            chunk = Float16Module(config, chunk)
        # Buckets of later chunks would be reduced before their grads exist under interleaving.
        wrapped.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                               disable_bucketing=i > 0))
    return wrapped


def build_optimizer(args, model: List[DistributedDataParallel]):
    opt_config = OptimizerConfig(
        optimizer="adam",
        lr=args.lr,
        min_lr=args.min_lr,
        weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps,
        clip_grad=args.clip_grad,
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype(args),
        loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_param_gather=args.overlap_param_gather,
        log_num_zeros_in_grad=False,
    )
    optimizer = get_megatron_optimizer(opt_config, model)
    _connect_schedule_hooks(args, model, optimizer)
    return optimizer


def _connect_schedule_hooks(args, model, optimizer) -> None:
    """What megatron's pipeline schedules call back into: grad sync, param sync, loss scaling, finalize."""
    config = model[0].config
    no_sync = [chunk.no_sync for chunk in model]
    config.no_sync_func = no_sync[0] if len(model) == 1 else no_sync
    if args.overlap_grad_reduce:
        sync = [chunk.start_grad_sync for chunk in model]
        config.grad_sync_func = sync[0] if len(model) == 1 else sync
    if args.overlap_param_gather:
        sync = [chunk.start_param_sync for chunk in model]
        config.param_sync_func = sync[0] if len(model) == 1 else sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss


def build_scheduler(args, optimizer) -> OptimizerParamScheduler:
    """LR schedule in iterations: linear warmup to --lr, then --lr-decay-style down to --min-lr."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if args.lr_warmup_iters else args.lr,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters,
        lr_decay_steps=max(args.lr_decay_iters, args.lr_warmup_iters + 1),
        lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay,
        end_wd=args.weight_decay,
        wd_incr_steps=max(args.train_iters, 1),
        wd_incr_style="constant",
        wsd_decay_steps=max(args.lr_decay_iters // 10, 1) if args.lr_decay_style == "WSD" else None,
        lr_wsd_decay_style="linear" if args.lr_decay_style == "WSD" else None,
    )
