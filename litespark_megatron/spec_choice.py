"""Which layer a run builds: litespark-train's --spec, as one typed choice.

arguments.resolve_spec decides it once from the command line (and follow_checkpoint_args again where
--use-checkpoint-args takes the checkpoint's --spec); every decision that depends on it reads `SpecChoice.of(args)`.
The arguments keep it as its name, `args.litespark_spec`: Megatron-LM saves the arguments in every checkpoint and
reads them back with torch's weights_only unpickler, which would refuse a class of this package. The name is also
what the run record, the "what ran" line and the benchmark's rows print (a trainer of another kind, the HF
baselines of apps/hf_parallel.py, writes its own name there, "hf-ddp" or "hf-fsdp2", which names no SpecChoice).
"""
from __future__ import annotations

import enum
from typing import List, Optional, Sequence

from .errors import ConfigError

# --spec litespark as Megatron-LM's --spec holds it (and a checkpoint's arguments save it): a module and a function.
LITESPARK_SPEC = ["litespark_megatron.specs", "litespark_layer_spec"]


class SpecChoice(enum.Enum):
    """The layer --spec names; its value is the name."""

    LITESPARK = "litespark"  # the Litespark layer (specs.litespark_layer_spec)
    STOCK = "stock"  # megatron-core's own layer, on --transformer-impl's modules
    STOCK_TE = "stock-te"  # megatron-core's own layer on Transformer Engine's modules
    STOCK_LOCAL = "stock-local"  # megatron-core's own layer on its local modules
    CUSTOM = "custom"  # a layer spec of the user's: --spec MODULE FUNCTION, as Megatron-LM takes it

    @classmethod
    def names(cls) -> List[str]:
        """The names --spec takes."""
        return [choice.value for choice in cls if choice is not cls.CUSTOM]

    @classmethod
    def from_flag(cls, spec: Optional[Sequence[str]]) -> "SpecChoice":
        """--spec as given on the command line: one of the names, or a module and a function."""
        spec = list(spec or [])
        if len(spec) == 2:
            return cls.of_megatron_spec(spec)
        if len(spec) != 1 or spec[0] not in cls.names():
            raise ConfigError(f"--spec {' '.join(spec)}: name one of {', '.join(cls.names())}, or give a module and "
                              "a function as Megatron-LM does (--spec my.module my_layer_spec)")
        return cls(spec[0])

    @classmethod
    def of_megatron_spec(cls, spec: Sequence[str]) -> "SpecChoice":
        """Megatron-LM's --spec (a module and a function, as a checkpoint's arguments hold it): Litespark's own is
        the Litespark layer, any other the user's."""
        return cls.LITESPARK if list(spec) == LITESPARK_SPEC else cls.CUSTOM

    @classmethod
    def of(cls, args) -> "SpecChoice":
        """The choice arguments.resolve_spec made for these arguments."""
        return cls(args.litespark_spec)

    @classmethod
    def named(cls, name: Optional[str]) -> Optional["SpecChoice"]:
        """The choice a recorded name (a run record's, a benchmark row's) stands for; None for another trainer's."""
        return next((choice for choice in cls if choice.value == name), None)

    def megatron_spec(self, given: Optional[Sequence[str]]) -> Optional[List[str]]:
        """What Megatron-LM's --spec holds for this choice: a module and a function (the given pair for a custom
        spec), or None for megatron-core's own layer."""
        if self is SpecChoice.LITESPARK:
            return list(LITESPARK_SPEC)
        return list(given) if self is SpecChoice.CUSTOM else None

    @property
    def transformer_impl(self) -> Optional[str]:
        """The --transformer-impl this choice means, where its name says one (stock-te, stock-local)."""
        return {SpecChoice.STOCK_TE: "transformer_engine", SpecChoice.STOCK_LOCAL: "local"}.get(self)

    @property
    def is_litespark(self) -> bool:
        return self is SpecChoice.LITESPARK

    @property
    def is_stock(self) -> bool:
        """megatron-core's own layer, on whichever backend."""
        return self in (SpecChoice.STOCK, SpecChoice.STOCK_TE, SpecChoice.STOCK_LOCAL)

    def uses_te_attention(self, transformer_impl: str, core_attention: str) -> bool:
        """Whether the core attention is Transformer Engine's DotProductAttention: megatron-core's layer on TE, or
        the Litespark layer on TE with --core-attention te."""
        return transformer_impl == "transformer_engine" and \
            (self.is_stock or (self.is_litespark and core_attention == "te"))
