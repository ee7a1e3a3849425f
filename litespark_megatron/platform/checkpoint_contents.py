"""What megatron.training's checkpoints hold of the model: with --save-adapters-only, the trainable parameters alone.

A --peft run reads its frozen base from --peft-base at every start, so its checkpoints need not hold it.
megatron.training builds both the state dict it saves and the one it asks a checkpoint for in
`checkpointing.generate_state_dict` (the model's sharded state dict, then the optimizer's, built from the model's),
and takes no filter. `save_trainable_only()` wraps it (once per process): afterwards every entry of the model's
state that is not a trainable parameter (the frozen tensors, the modules' _extra_state) is megatron-core's
LocalNonpersistentObject, which a save does not write and a load gives back as what the model holds; the
optimizer's state (of the trainable parameters only) is built before, from the whole model state, as megatron.training
builds it. Saves and loads alike, so such a run resumes from its own checkpoints and from whole ones.
tests/test_peft.py fails without it (the checkpoint would hold the base).
"""
from __future__ import annotations

import functools


def save_trainable_only() -> None:
    from megatron.training import checkpointing

    original = checkpointing.generate_state_dict
    if getattr(original, "_litespark", False):
        return

    @functools.wraps(original)
    def generate_state_dict(args, model, *rest, **kwargs):
        state_dict = original(args, model, *rest, **kwargs)
        for i in range(len(model)):
            key = "model" if len(model) == 1 else f"model{i}"
            if key in state_dict:
                state_dict[key] = _trainable_only(state_dict[key])
        return state_dict

    generate_state_dict._litespark = True
    checkpointing.generate_state_dict = generate_state_dict


def _trainable_only(model_state: dict) -> dict:
    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase

    def keep(entry):
        data = getattr(entry, "data", None)
        if isinstance(entry, ShardedBase) and not getattr(data, "requires_grad", False):
            return LocalNonpersistentObject(data)
        return entry

    return {name: keep(entry) for name, entry in model_state.items()}
