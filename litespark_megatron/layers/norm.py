"""RMSNorm for the local backend (the te backend fuses the norm into the following GEMM instead, unless
--litespark-rmsnorm), and under FP8 the norm that writes the next GEMM's FP8 input (`feeds`)."""
from __future__ import annotations

import torch

from ..kernels.rms_norm import rms_norm
from ..kernels.rms_norm_fp8 import rms_norm_to_fp8
from ..kernels.te_fp8 import fp8_input_quantizer
from . import elementwise


class LitesparkRMSNorm(torch.nn.Module):
    """Llama RMSNorm, usable under sequence parallelism.

    Built by TransformerLayer as `norm(config=..., hidden_size=..., eps=...)`. Under SP each TP rank normalizes its
    own slice of the sequence, so the weight's gradient is partial: tagging it `sequence_parallel` makes
    megatron-core's finalize_model_grads all-reduce it over the TP group.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, kernel: str = "default", **unused):
        """kernel "default": the compiled reference on a GPU; "litespark": Litespark's kernels (kernels/rms_norm.py,
        --litespark-rmsnorm). The reference on a CPU either way."""
        super().__init__()
        if kernel not in ("default", "litespark"):
            raise ValueError(f"unknown RMSNorm kernel '{kernel}'; choose 'default' or 'litespark'")
        self._norm = rms_norm if kernel == "litespark" else elementwise.rms_norm
        self.eps = eps
        # --apply-layernorm-1p (Megatron-LM's zero-centered gamma): the norm scales by 1 + weight, weight from 0.
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)
        self.fp8_ran = None  # whether the last forward wrote FP8 (the run's health record)

    def feeds(self, linear) -> None:
        """The GEMM this norm's output goes to, alone (model.py links them): where that Transformer Engine linear runs
        in FP8 under delayed scaling and does not all-gather its input, the norm writes its FP8 input, both
        layouts, with its quantizer (kernels/rms_norm_fp8.py), instead of bf16 that TE would cast again. Kept out of
        the module tree (the linear is the attention's or the MLP's)."""
        self.__dict__["_feeds"] = linear

    def forward(self, x: torch.Tensor):
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        linear = self.__dict__.get("_feeds")
        quantizer = fp8_input_quantizer(linear) if linear is not None and x.is_cuda else None
        self.fp8_ran = quantizer is not None
        if quantizer is not None:
            return rms_norm_to_fp8(x, weight, self.eps, quantizer)
        return self._norm(x, weight, self.eps)
