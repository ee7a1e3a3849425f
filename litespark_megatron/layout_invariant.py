"""A parameter's identity in every layout: its name in the whole model (pipeline stages and expert-parallel ranks
resolved), the generator it is drawn from, and its tensor-parallel shard. The model's initialization and the
adapters of --peft both draw from these, so one seed gives the same model in every layout."""
from __future__ import annotations

import re
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel

_GROUPED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(linear_fc[12])\.(weight|bias)(\d+)$")
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.local_experts\.(\d+)\.(.*)$")


def global_name(model: GPTModel, name: str) -> str:
    """The parameter's name in the whole model, the same in every layout and backend:
    decoder.layers.<local index>.… -> decoder.layers.<global index>.… (pipeline stages), and experts by their
    global index (expert_global_name)."""
    if name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        return "embedding.word_embeddings.weight"  # the last stage's copy of the tied embedding
    if name.startswith("decoder.layers."):
        parts = name.split(".")
        parts[2] = str(model.decoder.layers[int(parts[2])].layer_number - 1)
        name = ".".join(parts)
    if model.config.num_moe_experts and ".mlp.experts." in name:
        ep_size = parallel_state.get_expert_model_parallel_world_size()
        name = expert_global_name(name, parallel_state.get_expert_model_parallel_rank(),
                                  model.config.num_moe_experts // ep_size)
    return name


def expert_global_name(name: str, ep_rank: int, num_local_experts: int) -> str:
    """An expert parameter as mlp.experts.local_experts.<global expert>.…: expert-parallel rank r holds experts
    r * local + i, and TEGroupedMLP's `linear_fc1.weight<i>` is local expert i's `linear_fc1.weight`. Other names
    are returned unchanged."""
    grouped = _GROUPED_EXPERT.match(name)
    if grouped:
        prefix, linear, kind, local = grouped.groups()
        name = f"{prefix}.local_experts.{local}.{linear}.{kind}"
    sequential = _SEQUENTIAL_EXPERT.match(name)
    if sequential:
        prefix, local, rest = sequential.groups()
        name = f"{prefix}.local_experts.{ep_rank * num_local_experts + int(local)}.{rest}"
    return name


def is_expert(gname: str) -> bool:
    return ".mlp.experts.local_experts." in gname


def parameter_generator(seed: int, gname: str, device) -> torch.Generator:
    """The generator a parameter is drawn from: the run's seed and the parameter's global name."""
    return torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))


def shard(full: torch.Tensor, dim: int, stride: int, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s piece of the whole tensor, split along `dim` with megatron-core's stride."""
    pieces = torch.chunk(full, size * stride, dim=dim)
    return torch.cat(pieces[rank::size], dim=dim)
