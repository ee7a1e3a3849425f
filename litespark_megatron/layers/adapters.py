"""LoRA and DoRA adapters on the Litespark layer's linears, in the tensor-parallel layout of the linear they adapt.

`AdaptedLinear` wraps one of megatron-core's linears (local ColumnParallelLinear / RowParallelLinear, or Transformer
Engine's plain column / row linears) and adds a low-rank update to its output, as HF peft computes it
(peft.tuners.lora: `Linear` and `DoraLinearLayer`), so that an adapter trained here is HF peft's adapter:

    LoRA   y = W x + s B A drop(x)                                   s = alpha / r, or alpha / sqrt(r) (RSLoRA)
    DoRA   y = W x + (g - 1) W x' + g s B A x',  g = m / ||W + s B A||_row   x' = drop(x); the norm detached
                                                                      (the DoRA paper, section 4.3)

Projections. HF's Llama has separate q/k/v and gate/up projections; megatron-core fuses them into linear_qkv
(per KV group: [the group's query heads; its key; its value]) and linear_fc1 ([gate; up]; each TP rank holds its
[gate_r; up_r]). An adapter on a fused linear is one LoRA per HF projection, each with its own A, B (and DoRA
magnitude), whose outputs are interleaved into the fused layout. One A shared by q, k and v (Megatron-Bridge's
"performant" LoRA) is another model than HF peft's three adapters and would not export exactly; separate adapters
export as they are. The A GEMMs of a fused linear still run as one (the A's concatenated), the B GEMMs one per
projection.

Tensor parallelism, as Megatron-Bridge's adapters (they follow the module they wrap):
    column-parallel base (qkv, fc1): A replicated, B and m split by output rows as W is. The r-wide output of A is
        all-gathered over the sequence under SP (each rank's A gradient then covers its own positions: summed over
        TP, the `sequence_parallel` attribute megatron-core's gradient finalization reads), else its gradient is
        summed over TP in the backward (copy_to_tensor_model_parallel_region).
    row-parallel base (proj, fc2): A split by input columns as W is, B and m replicated. The r-wide output of A is
        summed over TP (all-reduce; a reduce-scatter over the sequence under SP, and then B's and m's gradients are
        summed over TP ranks).
    DoRA's row norm of a row-parallel W sums the squares of every rank's columns over TP.

Checkpoints. The base keeps its keys: the wrapper's state dict and sharded state dict are the base's (its tensors
named without the wrapper's `base.`), plus `adapter.lora_A.<proj>`, `adapter.lora_B.<proj>` and `adapter.magnitude.
<proj>` in HF's per-projection shapes (split over TP as above; dist_checkpointing reshards them), so a base
checkpoint loads into the adapted model's base and an adapted model's checkpoint holds the base's tensors under
their own keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region,
                                                    reduce_from_tensor_model_parallel_region,
                                                    reduce_scatter_to_sequence_parallel_region)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


@dataclass(frozen=True)
class AdapterSettings:
    method: str  # "lora" or "dora"
    rank: int
    alpha: float
    dropout: float = 0.0
    rslora: bool = False

    @property
    def scale(self) -> float:
        """LoRA's scaling of B A: alpha / r, or RSLoRA's alpha / sqrt(r) (HF peft's use_rslora)."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclass(frozen=True)
class Projections:
    """What a target linear computes in HF's terms."""
    parallel: str  # "column" or "row": the base's tensor-parallel split
    names: Tuple[str, ...]  # HF's projection names, in the fused order
    rows: Tuple[int, ...]  # each projection's output rows per group, whole model
    groups: int  # groups the fused output interleaves (the QKV's KV groups; 1 otherwise)
    in_features: int  # the whole model's input size


def projections(target: str, config) -> Projections:
    """The HF projections of megatron-core's linear `target` in a Llama layer of `config` (a TransformerConfig)."""
    heads, d = config.num_attention_heads, config.kv_channels
    groups = config.num_query_groups or heads
    hidden, ffn = config.hidden_size, config.ffn_hidden_size
    if target == "linear_qkv":
        return Projections("column", ("q_proj", "k_proj", "v_proj"), (heads // groups * d, d, d), groups, hidden)
    if target == "linear_proj":
        return Projections("row", ("o_proj",), (hidden,), 1, heads * d)
    if target == "linear_fc1":
        return Projections("column", ("gate_proj", "up_proj"), (ffn, ffn), 1, hidden)
    if target == "linear_fc2":
        return Projections("row", ("down_proj",), (hidden,), 1, ffn)
    raise ValueError(f"no adapter target {target!r}; the targets are {', '.join(TARGETS)}")


def interleave(parts: Sequence[torch.Tensor], groups: int, dim: int) -> torch.Tensor:
    """Per-projection tensors -> the fused linear's layout along `dim`: for each of `groups` groups, that group's
    slice of every part in order (megatron-core's QKV: per KV group [q; k; v]; [gate; up] with one group)."""
    if len(parts) == 1:
        return parts[0]
    dim = dim % parts[0].dim()
    return torch.cat([p.unflatten(dim, (groups, -1)) for p in parts], dim=dim + 1).flatten(dim, dim + 1)


def deinterleave(fused: torch.Tensor, rows: Sequence[int], groups: int) -> List[torch.Tensor]:
    """The inverse of interleave along dim 0: the fused tensor's rows -> each projection's, `rows` per group."""
    per_group = fused.unflatten(0, (groups, -1)).split(list(rows), dim=1)
    return [p.flatten(0, 1) for p in per_group]


class LoraAdapter(torch.nn.Module):
    """The adapter's parameters, by HF projection name: lora_A [r, in], lora_B [out, r], magnitude [out] (DoRA), each
    this rank's slice of them."""

    def __init__(self, names, a_shape, b_rows, with_magnitude: bool, dtype, device) -> None:
        super().__init__()

        def empty(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))

        self.names = tuple(names)  # the fused order (a ParameterDict built from a dict sorts its keys)
        self.lora_A = torch.nn.ParameterDict({n: empty(*a_shape) for n in names})
        self.lora_B = torch.nn.ParameterDict({n: empty(rows, a_shape[0]) for n, rows in zip(names, b_rows)})
        self.magnitude = torch.nn.ParameterDict({n: empty(rows) for n, rows in zip(names, b_rows)}) \
            if with_magnitude else None

    def ordered(self, kind: str) -> List[torch.nn.Parameter]:
        """The `kind` ("lora_A", "lora_B", "magnitude") parameters in the fused order."""
        params = getattr(self, kind)
        return [params[n] for n in self.names]


class AdaptedLinear(torch.nn.Module):
    """A megatron-core (or TE) linear with a LoRA or DoRA adapter; returns what the base returns, (output, bias)."""

    def __init__(self, base: torch.nn.Module, what: Projections, settings: AdapterSettings, config,
                 tp_group) -> None:
        super().__init__()
        self.base = base
        self.settings, self.projections = settings, what
        self.column = what.parallel == "column"
        self.tp_group = tp_group
        tp = tp_group.size()
        self.sequence_parallel = bool(config.sequence_parallel) and tp > 1
        # Under TP a rank holds whole KV groups of the QKV ([q; k; v] of groups/TP groups), and of fc1's one group
        # each projection's rows split ([gate_r; up_r]).
        self.local_groups = what.groups // tp if what.groups > 1 else 1
        r = settings.rank
        if self.column:
            a_shape, b_rows = (r, what.in_features), [rows * what.groups // tp for rows in what.rows]
        else:
            a_shape, b_rows = (r, what.in_features // tp), list(what.rows)
        weight = base.weight
        self.adapter = LoraAdapter(what.names, a_shape, b_rows, settings.method == "dora", config.params_dtype,
                                   weight.device)
        self._mark_parallel_layout()
        self._fused_rows: Dict[torch.device, torch.Tensor] = {}  # _fused_b's row order, per device
        # The base's tensors keep the base's names in this module's state dict (see the module docstring).
        self.register_state_dict_post_hook(_base_names_as_own)
        self.register_load_state_dict_pre_hook(_own_names_to_base)

    def _mark_parallel_layout(self) -> None:
        """megatron-core's attributes of each parameter: TP-split ones (their dim), and the replicated ones whose
        gradient covers this rank's sequence positions only under SP (summed over TP by megatron-core)."""
        split = {"lora_B": 0, "magnitude": 0} if self.column else {"lora_A": 1}
        for kind, params in self._parameter_groups():
            for param in params.values():
                if kind in split and self.tp_group.size() > 1:
                    tensor_parallel.set_tensor_model_parallel_attributes(param, True, split[kind], 1)
                elif self.sequence_parallel:
                    param.sequence_parallel = True

    def _parameter_groups(self) -> List[Tuple[str, torch.nn.ParameterDict]]:
        groups = [("lora_A", self.adapter.lora_A), ("lora_B", self.adapter.lora_B)]
        return groups + ([("magnitude", self.adapter.magnitude)] if self.adapter.magnitude is not None else [])

    def __getattr__(self, name):
        """Other code reads the base's attributes (weight, config, ...) through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            base = self.__dict__.get("_modules", {}).get("base")  # (none yet in a copy being made)
            if base is None:
                raise
            return getattr(base, name)

    # ------------------------------------------------------------------------------------------- forward
    def forward(self, x):
        out, bias = self.base(x)
        s = self.settings
        dropped = self._dropout(x)
        if s.method == "lora":
            return self._plus_low_rank(out, dropped), bias
        delta = self._low_rank(dropped) * s.scale
        # DoRA (peft's DoraLinearLayer.forward): with dropout the base output is recomputed on the dropped input
        base_result = out if dropped is x else self.base(dropped)[0]
        g = self.magnitude_scale()
        return out + (g - 1) * base_result + g * delta, bias

    def _plus_low_rank(self, out, x):
        """out + s B A x (LoRA's forward), in as few operations as the layout allows: the A's as one GEMM, the B's as
        one block matrix already in the fused output's row order (`_fused_b`), and the scaling and the sum in that
        GEMM's epilogue (addmm), so that no separate scaling, sum or interleaving copy of the output runs, forward or
        backward. It computes `out + self._low_rank(x) * scale`, the definition (tests/test_adapters.py)."""
        u = self._down(x)
        b = self._fused_b()
        return torch.addmm(out.reshape(-1, out.shape[-1]), u.reshape(-1, u.shape[-1]), b.t(),
                           alpha=self.settings.scale).view(out.shape)

    def _down(self, x):
        """A x for every projection (the A's concatenated), in the layout B reads: gathered over the sequence (SP) or
        marked for the TP gradient sum (column); summed over TP (row)."""
        a = self.adapter.ordered("lora_A")
        u = F.linear(x, a[0] if len(a) == 1 else torch.cat(a))
        if self.tp_group.size() == 1:
            return u
        if self.column:
            return gather_from_sequence_parallel_region(u, group=self.tp_group) if self.sequence_parallel else \
                copy_to_tensor_model_parallel_region(u, group=self.tp_group)
        return reduce_scatter_to_sequence_parallel_region(u, group=self.tp_group) if self.sequence_parallel else \
            reduce_from_tensor_model_parallel_region(u, group=self.tp_group)

    def _fused_b(self) -> torch.Tensor:
        """The B's as one [this rank's output rows, projections x r] matrix: B_p in projection p's rows of the fused
        layout and its r columns of A x, zeros elsewhere, so that one GEMM gives the interleaved output."""
        b = self.adapter.ordered("lora_B")
        if len(b) == 1:
            return b[0]
        rows = self._fused_rows.get(b[0].device)
        if rows is None:  # where each fused output row comes from in the projection-major block matrix
            starts = [0]
            for t in b:
                starts.append(starts[-1] + t.shape[0])
            parts = [torch.arange(start, end, device=b[0].device) for start, end in zip(starts, starts[1:])]
            rows = self._fused_rows[b[0].device] = interleave(parts, self.local_groups, dim=0)
        return torch.block_diag(*b).index_select(0, rows)

    def _dropout(self, x):
        p = self.settings.dropout
        if p == 0 or not self.training:
            return x
        if self.column and not self.sequence_parallel:
            return F.dropout(x, p, True)  # x is the same on every TP rank, and so is the default generator
        with tensor_parallel.get_cuda_rng_tracker().fork():  # this rank's slice of x: its own mask
            return F.dropout(x, p, True)

    def _low_rank(self, x):
        """B A x in the base's output layout (this rank's rows, or the whole output): LoRA's definition, one B GEMM
        per projection (DoRA's path; LoRA runs `_plus_low_rank`)."""
        u = self._down(x)
        if not self.column:
            return F.linear(u, self.adapter.ordered("lora_B")[0])
        r = self.settings.rank
        parts = [F.linear(u_p, b) for u_p, b in zip(u.split(r, dim=-1), self.adapter.ordered("lora_B"))]
        return interleave(parts, self.local_groups, dim=-1)

    def delta_weight(self) -> torch.Tensor:
        """s B A in the layout of this rank's base weight."""
        parts = [b @ a for a, b in zip(self.adapter.ordered("lora_A"), self.adapter.ordered("lora_B"))]
        return interleave(parts, self.local_groups, dim=0) * self.settings.scale

    @torch.no_grad()
    def row_norm(self) -> torch.Tensor:
        """||W + s B A|| of each output row this rank computes (a constant to autograd, as in peft's DoRA)."""
        norm = torch.linalg.vector_norm(self.base.weight + self.delta_weight(), dim=1)
        if not self.column and self.tp_group.size() > 1:  # each rank holds some columns of every row
            squares = norm.square()
            torch.distributed.all_reduce(squares, group=self.tp_group)
            norm = squares.sqrt()
        return norm

    def magnitude_scale(self) -> torch.Tensor:
        """DoRA's m / ||W + s B A||, per output row of this rank's output."""
        return interleave(self.adapter.ordered("magnitude"), self.local_groups, dim=0) / self.row_norm()

    def local_rows(self) -> List[int]:
        """Each projection's output rows per group on this rank."""
        return [b.shape[0] // self.local_groups for b in self.adapter.ordered("lora_B")]

    # ------------------------------------------------------------------------------------------- state
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None) -> Dict:
        state = self.base.sharded_state_dict(prefix, sharded_offsets, metadata)
        split = {"lora_B": 0, "magnitude": 0} if self.column else {"lora_A": 1}
        axes = {f"{kind}.{name}": split[kind] for kind, params in self._parameter_groups() if kind in split
                for name in params}
        state.update(make_sharded_tensors_for_checkpoint(
            self.adapter.state_dict(prefix="", keep_vars=True), f"{prefix}adapter.", axes, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
        return state


def _base_names_as_own(module, state_dict, prefix, local_metadata) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + "base.")]:
        state_dict[prefix + key[len(prefix) + len("base."):]] = state_dict.pop(key)


def _own_names_to_base(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    for key in [k for k in state_dict if k.startswith(prefix) and
                not k[len(prefix):].startswith(("adapter.", "base."))]:
        state_dict[prefix + "base." + key[len(prefix):]] = state_dict.pop(key)
