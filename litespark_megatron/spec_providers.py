"""The Litespark layer's backends, as megatron-core's spec providers (`megatron.core.models.backends`).

A provider answers which module fills each slot of the layer on its backend: the linears, the norm, the core
attention, whether a norm lives inside the GEMM that follows it. `LitesparkLocalSpecProvider` is megatron-core's
`LocalSpecProvider` (its modules run anywhere, CPUs included) and `LitesparkTESpecProvider` its `TESpecProvider`
(Transformer Engine's modules), each with what the Litespark layer chooses differently: Litespark's RMSNorm, torch
SDPA core attention, and on te the norms taken out of TE's norm+linear modules where a Litespark kernel or an
adapter needs them apart. specs.py builds one layer body from either, as megatron-core's `gpt_layer_specs` does.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider
from megatron.core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron.core.transformer.spec_utils import ModuleSpec

from .errors import ConfigError
from .layers import LitesparkCoreAttention, LitesparkRMSNorm


class LitesparkSpecProvider(BackendSpecProvider, Protocol):
    """What the Litespark layer asks of a backend beyond megatron-core's BackendSpecProvider."""

    @abstractmethod
    def mla_down_projection(self) -> type:
        """Which linear MLA's down projections (to the query and key-value latents) are."""
        ...


def _kernel_norm() -> ModuleSpec:
    """norm "litespark" (--litespark-rmsnorm): Litespark's RMSNorm running Litespark's kernel (kernels/rms_norm.py)."""
    return ModuleSpec(module=LitesparkRMSNorm, params={"kernel": "litespark"})


class LitesparkLocalSpecProvider(LocalSpecProvider, LitesparkSpecProvider):
    """megatron-core's local modules, every norm Litespark's RMSNorm (torch's, or with norm "litespark" Litespark's
    kernel), the core attention torch SDPA (LitesparkCoreAttention, context parallelism included)."""

    def __init__(self, norm: str = "default"):
        self.norm = norm

    def layer_norm(self, rms_norm: bool = True, for_qk: bool = False, has_residual: bool = False):
        return _kernel_norm() if self.norm == "litespark" else LitesparkRMSNorm

    def core_attention(self) -> type:
        return LitesparkCoreAttention

    def mla_down_projection(self) -> type:
        # Column-parallel, their outputs gathered by megatron-core (its local spec's choice: without TE,
        # MLASelfAttention takes no replicated linear).
        return self.column_parallel_linear()


class LitesparkTESpecProvider(TESpecProvider, LitesparkSpecProvider):
    """Transformer Engine's modules. core_attention "sdpa": torch SDPA (LitesparkCoreAttention), "te": TE's
    DotProductAttention, as the stock TE layer has it. The norms before QKV and fc1 live inside TE's norm+linear
    modules, except with norm "litespark" (Litespark's kernel is a module of its own) or adapters (a LoRA/DoRA
    adapter reads its linear's input, which must be the normed one): those norms are then modules of their own
    before plain TE linears."""

    def __init__(self, norm: str = "default", core_attention: str = "sdpa", adapters: bool = False):
        self.norm, self.attention, self.adapters = norm, core_attention, adapters

    def fuse_layernorm_and_linear(self) -> bool:
        return self.norm != "litespark" and not self.adapters

    def layer_norm(self, rms_norm: bool = True, for_qk: bool = False, has_residual: bool = False):
        return _kernel_norm() if self.norm == "litespark" else super().layer_norm()  # TENorm

    def core_attention(self) -> type:
        return super().core_attention() if self.attention == "te" else LitesparkCoreAttention

    def mla_down_projection(self) -> type:
        return self.linear()  # replicated on every TP rank (TE's 'duplicated' linear)


def litespark_spec_provider(backend: str, core_attention: str = "sdpa", norm: str = "default",
                            adapters: bool = False) -> LitesparkSpecProvider:
    """The provider of a backend: "local" (megatron-core's modules) or "te" (Transformer Engine's)."""
    if backend == "te":
        return LitesparkTESpecProvider(norm=norm, core_attention=core_attention, adapters=adapters)
    if backend == "local":
        return LitesparkLocalSpecProvider(norm=norm)
    raise ConfigError(f"unknown Litespark backend '{backend}'; choose 'local' or 'te'")
