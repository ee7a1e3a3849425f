"""A --peft lora|dora run's adapters out to Hugging Face: as HF peft's adapter files (`litespark-convert
export-adapter CKPT DIR`: adapter_config.json and adapter_model.safetensors, for peft.PeftModel.from_pretrained on
the base's HF export), or merged into the weights of a plain HF Llama (`litespark-convert export CKPT DIR
--merge-adapters`).

The checkpoint stores each adapter in HF peft's own terms (layers/adapters.py): per layer and HF projection
(q/k/v/o_proj, gate/up/down_proj) its lora_A [r, in], lora_B [out, r] and, for DoRA, its magnitude [out], so the
adapter files are a renaming; `use_rslora` and `use_dora` say what the run trained. Merging computes, in fp32 and
then the output's dtype, what peft's merge_and_unload computes:

    LoRA  W' = W + s B A                    DoRA  W' = m / ||W + s B A||_row * (W + s B A)

with B A of the fused QKV and [gate; up] interleaved into megatron-core's fused layout before hf_convert.py splits it. A
--save-adapters-only run's checkpoint holds the adapters alone: the merge reads the base from its --peft-base.
"""
from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import List, Optional, Tuple

import torch

from .hf_convert import (DTYPES, CheckpointTensors, ConversionError, Shape, checkpoint_arguments, checkpoint_dir,
                         check_output_target, commit_output, model_shape, single_process_group, start_output)
from .layers.adapters import interleave, projections

HF_MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
              "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def _target(key: str) -> str:
    """decoder.layers.self_attention.linear_qkv.weight -> linear_qkv"""
    return key.rsplit(".", 2)[-2]


class Adapters:
    """A checkpoint's adapters, read one layer and linear at a time."""

    def __init__(self, args) -> None:
        from .peft import settings

        self.peft = settings(args)
        self.dora = self.peft.method == "dora"
        self._whole = {}  # adapter key -> its tensor of every layer (adapters are small: read once each)

    def projections(self, target: str, shape: Shape):
        return projections(target, SimpleNamespace(num_attention_heads=shape.heads, kv_channels=shape.head_dim,
                                                   num_query_groups=shape.groups, hidden_size=shape.hidden,
                                                   ffn_hidden_size=shape.ffn))

    def read(self, tensors: CheckpointTensors, target: str, shape: Shape,
             layer: int) -> List[Tuple[str, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]]:
        """(HF projection, A, B, magnitude or None) of `target` in `layer`, in the fused order."""
        prefix = f"decoder.layers.{'mlp' if 'fc' in target else 'self_attention'}.{target}.adapter."

        def get(key):
            if key not in self._whole:
                self._whole[key] = tensors.get(key)
            return self._whole[key][layer]

        found = []
        for name in self.projections(target, shape).names:
            a, b = get(f"{prefix}lora_A.{name}"), get(f"{prefix}lora_B.{name}")
            found.append((name, a, b, get(f"{prefix}magnitude.{name}") if self.dora else None))
        return found

    def merged(self, key: str, layer: int, weight: torch.Tensor, tensors: CheckpointTensors,
               shape: Shape) -> torch.Tensor:
        """The weight of megatron-core's layer tensor `key` with its adapter merged (fp32), or as it is."""
        target = _target(key)
        if not key.endswith(".weight") or target not in self.peft.targets:
            return weight
        what = self.projections(target, shape)
        parts = self.read(tensors, target, shape, layer)
        scale = self.peft.adapter.scale
        merged = weight.float() + interleave([b.float() @ a.float() for _, a, b, _ in parts], what.groups, 0) * scale
        if self.dora:
            magnitude = interleave([m.float() for *_, m in parts], what.groups, 0)
            merged = (magnitude / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1) * merged
        return merged


def adapters_of(args, directory: str, merge: bool) -> Optional[Adapters]:
    """The adapters export merges: those of a --peft lora|dora checkpoint with --merge-adapters; a checkpoint with
    adapters does not export without merging them (its base alone is not what it trained)."""
    method = getattr(args, "peft", None)
    if method in ("lora", "dora"):
        if not merge:
            raise ConversionError(f"{directory} holds a --peft {method} run, its adapters beside the base: add "
                                  "--merge-adapters (a plain HF Llama with them merged), or export them for HF peft "
                                  "with litespark-convert export-adapter")
        return Adapters(args)
    if merge:
        raise ConversionError(f"--merge-adapters: {directory} holds no adapters (no --peft lora|dora run): drop the "
                              "flag")
    return None


def base_of(args, directory: str, peft_base: Optional[str]) -> Optional[CheckpointTensors]:
    """The base tensors of a --save-adapters-only run's checkpoint (which holds its adapters alone): its --peft-base,
    or `peft_base`; None for a checkpoint that holds its model whole."""
    if not getattr(args, "save_adapters_only", False):
        return None
    from .arguments import latest_checkpoint_dir

    where = peft_base or args.peft_base
    found = latest_checkpoint_dir(where) if where and os.path.isdir(where) else None
    if found is None:
        raise ConversionError(f"{directory} holds the adapters alone (--save-adapters-only), and its base {where} "
                              "holds no checkpoint: give the base with --peft-base")
    return CheckpointTensors(found)


def adapter_config(peft, base_model: Optional[str]) -> dict:
    """HF peft's LoraConfig of these adapters, as peft's save_pretrained writes its main fields."""
    adapter = peft.adapter
    alpha = int(adapter.alpha) if float(adapter.alpha).is_integer() else adapter.alpha
    names = sorted({n for target in peft.targets for n in projections(target, _ANY_SHAPE).names})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": adapter.rank, "lora_alpha": alpha, "lora_dropout": adapter.dropout, "target_modules": names,
            "use_rslora": adapter.rslora, "use_dora": peft.method == "dora", "bias": "none", "fan_in_fan_out": False,
            "init_lora_weights": True, "inference_mode": True, "modules_to_save": None,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


# projections' names do not depend on the sizes
_ANY_SHAPE = SimpleNamespace(num_attention_heads=1, kv_channels=1, num_query_groups=1, hidden_size=1,
                             ffn_hidden_size=1)


def export_adapter(ckpt: str, out: str, dtype: Optional[str] = None, base_model: Optional[str] = None) -> None:
    """A --peft lora|dora checkpoint's adapters -> HF peft's adapter directory `out`."""
    from safetensors.torch import save_file

    check_output_target(out)
    directory = checkpoint_dir(ckpt)
    with single_process_group():
        args = checkpoint_arguments(directory)
        method = getattr(args, "peft", None)
        if method not in ("lora", "dora"):
            what = f"a --peft {method} run: its trained layers are the model's, export" if method else \
                "a model without adapters (no --peft lora|dora run): export"
            raise ConversionError(f"{directory} holds {what} it with litespark-convert export")
        tensors = CheckpointTensors(directory)
        shape = model_shape(args, vocab=0)  # (the adapters do not depend on the vocabulary)
        adapters = Adapters(args)
        weights = {}
        for layer in range(shape.layers):
            for target in adapters.peft.targets:
                for name, a, b, m in adapters.read(tensors, target, shape, layer):
                    where = f"base_model.model.model.layers.{layer}.{HF_MODULES[name]}.{name}"
                    weights[f"{where}.lora_A.weight"], weights[f"{where}.lora_B.weight"] = a, b
                    if m is not None:
                        weights[f"{where}.lora_magnitude_vector"] = m
    if dtype:
        weights = {k: v.to(DTYPES[dtype]) for k, v in weights.items()}
    tmp = start_output(out)
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(tmp, ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
            json.dump(adapter_config(adapters.peft, base_model), f, indent=2)
        commit_output(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
