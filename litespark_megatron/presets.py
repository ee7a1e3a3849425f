"""The Llama shapes `--model NAME` names: each preset is data, the Megatron-LM flags of one shape.

A preset is nothing but flags (the command line and --config override them), so it needs nothing of the parser:
the command line, the tools that need a shape only (FLOPs, memory, parameter counts) and the HF converter read
them from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

from .errors import ConfigError

# What makes a Megatron-LM GPT a Llama: the layer the Litespark modules compute.
LLAMA = {"swiglu": True, "normalization": "RMSNorm", "disable-bias-linear": True, "position-embedding-type": "rope",
         "attention-dropout": 0.0, "hidden-dropout": 0.0, "norm-epsilon": 1e-5}


@dataclass(frozen=True)
class Preset:
    flags: Dict[str, object]  # Megatron-LM flag name (without --) -> value; True gives the switch
    description: str


def _llama(layers, hidden, ffn, heads, groups, seq, max_positions, rotary_base, vocab, description):
    shape = {"num-layers": layers, "hidden-size": hidden, "ffn-hidden-size": ffn, "num-attention-heads": heads,
             "seq-length": seq, "max-position-embeddings": max_positions, "rotary-base": rotary_base,
             "vocab-size": vocab, "untie-embeddings-and-output-weights": True}
    if groups != heads:
        shape.update({"group-query-attention": True, "num-query-groups": groups})
    return Preset({**LLAMA, **shape}, description)


PRESETS = {
    # Small enough for CPU tests and the quickstart; 4 layers so that PP2 x 2 virtual stages is possible.
    "tiny": _llama(4, 128, 352, 4, 2, 128, 4096, 10000, 4096, "test/quickstart model, ~2M parameters"),
    "llama-1b": _llama(16, 2048, 8192, 32, 8, 4096, 131072, 500000, 128256, "Llama-3.2-1B shape, untied"),
    "llama-3b": _llama(28, 3072, 8192, 24, 8, 4096, 131072, 500000, 128256, "Llama-3.2-3B shape, untied"),
    "llama3-8b": _llama(32, 4096, 14336, 32, 8, 8192, 131072, 500000, 128256, "Llama-3-8B"),
    "llama-30b": _llama(60, 6656, 17920, 52, 52, 4096, 4096, 10000, 32000, "LLaMA-30B shape (MHA, 32k vocab)"),
    # Bases of the efficiency suite: GQA with 4 KV groups, 4x FFN, untied, 32k vocabulary (docs/metrics.md).
    "eff-0.5b": _llama(28, 1024, 4096, 16, 4, 2048, 4096, 10000, 32000,
                       "efficiency-suite base, ~0.49B parameters (32k vocab)"),
    "eff-1.5b": _llama(22, 2048, 8192, 16, 4, 2048, 4096, 10000, 32000,
                       "efficiency-suite base, ~1.47B parameters (32k vocab)"),
}


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError(f"unknown --model '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]


def preset_values(name: str) -> Dict[str, object]:
    """A preset's flags as argument names (num_layers=..., swiglu=True, ...), for tools that need a shape only."""
    return {k.replace("-", "_"): v for k, v in preset(name).flags.items()}
