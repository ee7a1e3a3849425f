"""Checkpoints with megatron-core dist_checkpointing: save in one layout, load in another.

Layout on disk (Megatron-LM's): `<dir>/iter_0000100/` (a dist_checkpointing directory) and
`<dir>/latest_checkpointed_iteration.txt`. A save is written to `iter_XXXXXXX.partial` and renamed only after every
rank finished; the tracker is replaced atomically after that. A crash mid-save therefore leaves the previous
checkpoint as the latest, never a half-written one.

What is saved: the model (sharded by its own layout), the optimizer (the distributed optimizer in its fully
reshardable form, so DP/TP/PP may change on resume), the LR scheduler, the iteration, the train state (consumed
samples, counters), the resolved config, and each rank's RNG states (restored only when the layout is unchanged:
RNG streams have no meaning across layouts).
"""
from __future__ import annotations

import os
import shutil
from typing import Optional

import numpy as np
import random
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from ..config import UserError

TRACKER = "latest_checkpointed_iteration.txt"
LAYOUT_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
               "expert_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "world_size")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded or a directory that cannot be written."""


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def check_writable(root: str) -> None:
    """Fail before training, not at the first save, if --save cannot be written."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".write_probe_{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--save {root} is not writable ({e.strerror}); choose a directory you can write") \
            from None


def latest_iteration(root: str) -> int:
    """The iteration the tracker names, after checking that its checkpoint is complete."""
    if not os.path.isdir(root):
        raise CheckpointError(f"--load {root}: no such directory")
    tracker = os.path.join(root, TRACKER)
    if not os.path.isfile(tracker):
        raise CheckpointError(f"--load {root}: no checkpoint there ({TRACKER} is missing); "
                              f"point --load at a --save directory of an earlier run")
    text = open(tracker).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load {root}: {TRACKER} holds '{text[:40]}', not an iteration number")
    iteration = int(text)
    path = iteration_dir(root, iteration)
    if not os.path.isfile(os.path.join(path, "metadata.json")) or not os.path.isfile(
            os.path.join(path, "common.pt")):
        raise CheckpointError(f"--load {root}: checkpoint {path} is incomplete (metadata.json or common.pt "
                              f"missing); delete it and point {TRACKER} at an earlier iteration")
    return iteration


def _layout(args) -> dict:
    return {k: (dist.get_world_size() if k == "world_size" else getattr(args, k)) for k in LAYOUT_KEYS}


def _saved_layout(common: dict) -> dict:
    layout = dict(common.get("layout") or {})
    # Checkpoints from before expert parallelism existed ran at EP 1.
    layout.setdefault("expert_model_parallel_size", common.get("args", {}).get("expert_model_parallel_size") or 1)
    return layout


def _sharded_metadata(args) -> dict:
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if args.use_distributed_optimizer:
        metadata["distrib_optim_sharding_type"] = "fully_reshardable"
    return metadata


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "np": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["np"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(state) -> ShardedObject:
    ps = parallel_state
    shape = (ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size(),
             ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size())
    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
              ps.get_context_parallel_rank(), ps.get_data_parallel_rank())
    return ShardedObject("rng_state", state, shape, offset, replica_id=0)


def _unwrap(chunk):
    """DDP(Float16Module(GPTModel)) -> GPTModel: checkpoints hold the model's own keys, not the wrappers'."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def _model_key(i: int, n: int) -> str:
    return "model" if n == 1 else f"model{i}"


def _state_dict(args, model, optimizer, scheduler, *, is_loading: bool, with_rng: bool, metadata: dict,
                iteration: int = 0, train_state: Optional[dict] = None) -> dict:
    sd = {_model_key(i, len(model)): _unwrap(chunk).sharded_state_dict(metadata=metadata)
          for i, chunk in enumerate(model)}
    if optimizer is not None:
        if is_loading:
            _allocate_distributed_optimizer_state(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(sd, is_loading=is_loading, metadata=metadata)
        sd["opt_param_scheduler"] = scheduler.state_dict()
    if with_rng:
        sd["rng_state"] = _rng_sharded_object(_rng_state())
    sd["iteration"] = iteration
    sd["train_state"] = train_state or {}
    sd["args"] = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, list, type(None)))}
    sd["layout"] = _layout(args)
    return sd


def _allocate_distributed_optimizer_state(optimizer) -> None:
    """A fresh DistributedOptimizer has no Adam state yet; the fully reshardable loader copies into it."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def save(args, iteration: int, model, optimizer, scheduler, train_state: dict) -> str:
    root = args.save
    final = iteration_dir(root, iteration)
    partial = final + ".partial"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        os.makedirs(partial)
    dist.barrier()
    if args.overlap_param_gather:
        for chunk in model:  # updated params are otherwise gathered only at the next forward
            chunk.start_param_sync(force_sync=True)
    metadata = _sharded_metadata(args)
    sd = _state_dict(args, model, None if args.no_save_optim else optimizer, scheduler, is_loading=False,
                     with_rng=True, metadata=metadata, iteration=iteration, train_state=train_state)
    if args.no_save_optim:
        sd["opt_param_scheduler"] = scheduler.state_dict()
    dist_checkpointing.save(sd, partial, content_metadata=metadata)
    dist.barrier()
    if rank0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(partial, final)
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as f:
            f.write(str(iteration))
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    return final


def load(args, model, optimizer, scheduler) -> tuple:
    """Restore into freshly built model/optimizer/scheduler. Returns (iteration, train_state)."""
    root = args.load
    iteration = latest_iteration(root)
    path = iteration_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    metadata = dist_checkpointing.load_content_metadata(path) or _sharded_metadata(args)
    saved_layout = _saved_layout(common)
    same_layout = saved_layout == _layout(args)
    has_optim = not common.get("args", {}).get("no_save_optim", False)
    saved_ep = common.get("args", {}).get("expert_model_parallel_size") or 1
    if has_optim and args.num_experts and saved_ep != args.expert_model_parallel_size:
        # megatron-core 0.16.1 groups MoE optimizer state per expert-parallel layout; loading it into another one
        # fails deep inside the optimizer (KeyError 'optimizer' / 'pre_wd_mult').
        raise CheckpointError(f"--load {root}: its optimizer state was saved at --expert-model-parallel-size "
                              f"{saved_ep} and cannot be resharded to {args.expert_model_parallel_size}; resume "
                              f"with EP {saved_ep} (model weights alone reshard: a --no-save-optim checkpoint "
                              f"loads at any EP)")
    template = _state_dict(args, model, optimizer if has_optim else None, scheduler, is_loading=True,
                           with_rng=same_layout, metadata=metadata)
    loaded = dist_checkpointing.load(template, path)
    for i, chunk in enumerate(model):
        _unwrap(chunk).load_state_dict(loaded[_model_key(i, len(model))], strict=True)
    if has_optim:
        optimizer.load_state_dict(loaded["optimizer"])
    if "opt_param_scheduler" in common:
        scheduler.load_state_dict(common["opt_param_scheduler"])
    if same_layout:
        _set_rng_state(loaded["rng_state"])
    return iteration, dict(common.get("train_state", {}))
