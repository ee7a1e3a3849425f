"""Checkpoints written by litespark-megatron's own trainer, before the trainer became megatron.training.

They are megatron-core dist_checkpointing directories in Megatron-LM's folder layout with the same model keys, but
their common state holds the arguments as a dict, a "layout" record and no checkpoint_version, and their
optimizer and RNG states have another structure. So:

- `--load OLD --finetune` works as Megatron-LM's --finetune does: megatron.training loads the model weights (in
  any layout: dist_checkpointing reshards them) and starts at iteration 0 with a fresh optimizer, scheduler and
  data position. A `--save` of that run is a Megatron-LM checkpoint: this is the conversion.
- `--load OLD` alone (an exact resume) would fail deep in megatron.training's loader (a KeyError on the optimizer
  state): it is refused here with one line that says to use --finetune.
"""
from __future__ import annotations

import os
from typing import Optional

def legacy_checkpoint_dir(load_dir: Optional[str]) -> Optional[str]:
    """The iteration directory of the latest checkpoint under `load_dir` if it was written by the old trainer,
    else None (no checkpoint there, or a Megatron-LM one)."""
    if not load_dir:
        return None
    from megatron.training.checkpointing import get_checkpoint_name, get_checkpoint_tracker_filename

    try:
        text = open(get_checkpoint_tracker_filename(load_dir)).read().strip()
    except OSError:
        return None
    if not text.isdigit():
        return None
    path = get_checkpoint_name(load_dir, int(text), return_base_dir=True)
    if not os.path.isfile(os.path.join(path, "common.pt")):
        return None
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(path)
    if isinstance(common.get("args"), dict) and "layout" in common and "checkpoint_version" not in common:
        return path
    return None


def check(args) -> None:
    """Refuse resuming a legacy checkpoint (its weights load with --finetune)."""
    from .errors import ConfigError

    if args.finetune or legacy_checkpoint_dir(args.load) is None:
        return
    raise ConfigError(f"--load {args.load}: a checkpoint of litespark-megatron's own trainer (before it ran on "
                      "megatron.training), which megatron.training cannot resume; load its model weights with "
                      "--finetune (iteration 0, fresh optimizer, scheduler and data position): a --save of that run "
                      "is a Megatron-LM checkpoint")
