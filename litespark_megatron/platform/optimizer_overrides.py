"""Per-parameter optimizer overrides added to megatron.training's: the hook LoRA-plus needs.

megatron-core's optimizer takes per-parameter overrides (learning rate, weight decay; `ParamKey` ->
`ParamGroupOverride`), and megatron.training builds them in `training.get_megatron_optimizer_config(args)` (its
standard ones: no weight decay on biases and norms, --decoupled-lr), which `setup_model_and_optimizer` calls by its
module global, with no way to add others. `add_optimizer_overrides(provider)` wraps that function (once per process)
to add each provider's overrides, `provider(config) -> {ParamKey: override}`, to megatron.training's own; megatron-core
combines the overrides a parameter matches (and refuses conflicting ones). tests/test_peft.py fails without it (B's
learning rate of --lora-plus-ratio).
"""
from __future__ import annotations

import functools
from typing import Callable, List

_providers: List[Callable] = []


def add_optimizer_overrides(provider: Callable) -> None:
    from megatron.training import training

    _providers.append(provider)
    original = training.get_megatron_optimizer_config
    if getattr(original, "_litespark", False):
        return

    @functools.wraps(original)
    def get_megatron_optimizer_config(args):
        config, overrides = original(args)
        overrides = dict(overrides or {})
        for add in _providers:
            overrides.update(add(config))
        return config, overrides

    get_megatron_optimizer_config._litespark = True
    training.get_megatron_optimizer_config = get_megatron_optimizer_config
