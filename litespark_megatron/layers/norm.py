"""RMSNorm for the local backend (the te backend fuses the norm into the following GEMM instead)."""
from __future__ import annotations

import torch

from . import kernels


class LitesparkRMSNorm(torch.nn.Module):
    """Llama RMSNorm, usable under sequence parallelism.

    Built by TransformerLayer as `norm(config=..., hidden_size=..., eps=...)`. Under SP each TP rank normalizes its
    own slice of the sequence, so the weight's gradient is partial: tagging it `sequence_parallel` makes
    megatron-core's finalize_model_grads all-reduce it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)
