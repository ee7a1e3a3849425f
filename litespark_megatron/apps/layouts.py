"""The layouts litespark-plan chooses from, each accepted or refused by litespark-train's own checks.

A candidate is a set of layout flags (TP, PP, CP, virtual pipeline stages, sequence parallelism, the distributed
optimizer and its overlaps, micro-batch, full recomputation) on top of the user's litespark-train flags. Every
candidate is checked by `arguments.check_run`, the checks litespark-train and the launcher run before any process
group (litespark's own and Megatron-LM's validate_args), on the arguments the trainer parses from those flags; so a
plan never offers a command the trainer would refuse, and a rule added to the trainer applies here unchanged.

What a team would set is set rather than enumerated: TP stays inside a node, sequence parallelism comes with TP,
the distributed optimizer with its gradient-reduce and parameter-gather overlaps whenever gradients are reduced over
more than one rank. A layout flag the user names fixes that dimension.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Set

from ..errors import UserError

LAYOUT_FLAGS = ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
                "--num-layers-per-virtual-pipeline-stage", "--sequence-parallel", "--use-distributed-optimizer",
                "--overlap-grad-reduce", "--overlap-param-gather", "--micro-batch-size", "--recompute-granularity",
                "--recompute-method", "--recompute-num-layers")
# Layout flags whose layouts neither the memory model nor the scaling estimate describe.
UNMODELLED_FLAGS = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
                    "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                    "--account-for-loss-in-pipeline-split", "--num-virtual-stages-per-pipeline-rank",
                    "--virtual-pipeline-model-parallel-size", "--hierarchical-context-parallel-sizes",
                    "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--use-torch-fsdp2",
                    "--use-megatron-fsdp", "--recompute-modules", "--cpu-offloading")
MAX_MICRO_BATCH = 16
# What a run needs to pass the trainer's checks and a plan does not decide (placeholders, never printed).
RUN_PLACEHOLDERS = {("--lr",): ["--lr", "1e-4"], ("--train-iters", "--train-samples"): ["--train-iters", "1"],
                    ("--eval-interval",): ["--eval-interval", "1"],
                    ("--mock-data", "--data-path", "--train-data-path", "--embedded-corpus"): ["--mock-data"]}


def named_flags(argv: Sequence[str]) -> Set[str]:
    """The flags the user gave, on the command line or as keys of --config."""
    from ..arguments import _pre_parse, load_config_file

    named = {token.split("=", 1)[0] for token in argv if token.startswith("--")}
    config = _pre_parse(argv).config
    if config:
        named |= {"--" + str(key).strip().lstrip("-").replace("_", "-") for key in load_config_file(config)}
    return named


def refuse_unmodelled(named: Set[str]) -> None:
    for flag in UNMODELLED_FLAGS:
        if flag in named:
            raise UserError(f"{flag}: litespark-plan models even pipeline splits, dense layers and megatron-core's "
                            f"DDP with its distributed optimizer only; drop {flag} to plan")


def placeholders(named: Set[str]) -> List[str]:
    return [token for names, flags in RUN_PLACEHOLDERS.items() if not named & set(names) for token in flags]


@dataclass(frozen=True)
class Candidate:
    tp: int
    pp: int
    cp: int
    dp: int
    layers_per_virtual_stage: Optional[int]
    micro_batch_size: int
    recompute: Optional[str]  # None or "full" (uniform, one layer per group); the user's own when they named it
    sequence_parallel: bool
    distributed_optimizer: bool

    @property
    def overlap(self) -> bool:
        return self.dp * self.cp > 1

    def flags(self, named: Set[str] = frozenset()) -> List[str]:
        """The layout's litespark-train flags, but those the user named (they are in the user's flags)."""
        out = []
        for flag, value, wanted in (
                ("--tensor-model-parallel-size", self.tp, self.tp > 1),
                ("--pipeline-model-parallel-size", self.pp, self.pp > 1),
                ("--context-parallel-size", self.cp, self.cp > 1),
                ("--num-layers-per-virtual-pipeline-stage", self.layers_per_virtual_stage,
                 self.layers_per_virtual_stage is not None),
                ("--sequence-parallel", None, self.sequence_parallel),
                ("--use-distributed-optimizer", None, self.distributed_optimizer),
                ("--overlap-grad-reduce", None, self.overlap),
                ("--overlap-param-gather", None, self.overlap and self.distributed_optimizer),
                ("--micro-batch-size", self.micro_batch_size, True),
                ("--recompute-granularity", self.recompute, self.recompute == "full"),
                ("--recompute-method", "uniform", self.recompute == "full"),
                ("--recompute-num-layers", 1, self.recompute == "full")):
            if wanted and flag not in named:
                out += [flag] if value is None else [flag, str(value)]
        return out

    def describe(self) -> str:
        parts = [f"TP{self.tp}" + ("+SP" if self.sequence_parallel else ""), f"PP{self.pp}"
                 + (f" ({self.layers_per_virtual_stage}-layer virtual stages)" if self.layers_per_virtual_stage
                    else ""), f"CP{self.cp}", f"DP{self.dp}", f"mb {self.micro_batch_size}"]
        if self.distributed_optimizer:
            parts.append("dist-opt")
        if self.recompute:
            parts.append(f"recompute {self.recompute}")
        return " ".join(parts)

    def apply(self, args):
        """A copy of the parsed arguments with this layout, as if its flags had been given."""
        a = copy.deepcopy(args)
        a.tensor_model_parallel_size, a.pipeline_model_parallel_size = self.tp, self.pp
        a.context_parallel_size, a.micro_batch_size = self.cp, self.micro_batch_size
        a.num_layers_per_virtual_pipeline_stage = self.layers_per_virtual_stage
        a.sequence_parallel = self.sequence_parallel
        a.use_distributed_optimizer = self.distributed_optimizer
        a.overlap_grad_reduce = a.overlap_grad_reduce or self.overlap
        a.overlap_param_gather = a.overlap_param_gather or (self.overlap and self.distributed_optimizer)
        if self.recompute == "full" and a.recompute_granularity is None:
            a.recompute_granularity, a.recompute_method, a.recompute_num_layers = "full", "uniform", 1
        return a


def _divisors(n: int, limit: Optional[int] = None) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def candidates(args, world: int, gpus_per_node: int, named: Set[str]) -> Iterator[Candidate]:
    """Every layout of `world` ranks to check; a dimension the user named keeps the user's value."""
    def fixed(flag, value, choices):
        return [value] if flag in named else choices

    layers = args.num_layers
    for tp in fixed("--tensor-model-parallel-size", args.tensor_model_parallel_size, _divisors(gpus_per_node)):
        for cp in fixed("--context-parallel-size", args.context_parallel_size, _divisors(world // tp or 1)):
            for pp in fixed("--pipeline-model-parallel-size", args.pipeline_model_parallel_size,
                            _divisors(world // (tp * cp) or 1)):
                dp = max(1, world // (tp * cp * pp))
                virtual = [None] + ([layers // (2 * pp)] if pp > 1 and layers % (2 * pp) == 0 else [])
                batch = args.global_batch_size // dp if args.global_batch_size % dp == 0 else 1
                for per_virtual in fixed("--num-layers-per-virtual-pipeline-stage",
                                         args.num_layers_per_virtual_pipeline_stage, virtual):
                    for mb in fixed("--micro-batch-size", args.micro_batch_size, _divisors(batch, MAX_MICRO_BATCH)):
                        for recompute in fixed("--recompute-granularity", args.recompute_granularity,
                                               [None, "full"]):
                            yield Candidate(
                                tp=tp, pp=pp, cp=cp, dp=dp, layers_per_virtual_stage=per_virtual,
                                micro_batch_size=mb, recompute=recompute,
                                sequence_parallel=tp > 1 or bool(args.sequence_parallel),
                                distributed_optimizer=dp * cp > 1 or bool(args.use_distributed_optimizer))


def resolve(argv, plat, world: int):
    """litespark-train's parsed arguments of `argv` for a run of `world` ranks on `plat` (not yet checked)."""
    from .. import arguments

    saved = os.environ.get("WORLD_SIZE")
    os.environ["WORLD_SIZE"] = str(world)  # what Megatron-LM's parser reads the world size from
    try:
        return arguments.resolve_quietly(list(argv), plat)
    finally:
        if saved is None:
            os.environ.pop("WORLD_SIZE", None)
        else:
            os.environ["WORLD_SIZE"] = saved


def check(args, candidate: Candidate, plat, world: int):
    """The candidate's arguments, validated by the trainer's own checks (arguments.check_run), or its ConfigError."""
    from .. import arguments

    a = candidate.apply(args)
    arguments.resolve_core_attention(a)  # the attention kernel --core-attention auto takes depends on CP
    arguments.check_run(a, plat, world)
    return a
