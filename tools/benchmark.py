#!/usr/bin/env python3
"""Training throughput, memory and energy of Litespark vs stock Megatron-Core (TE) vs HF transformers, one GPU.

    python tools/benchmark.py --out runs/bench      # llama-3b, seq 4096, micro-batch 2, the five default systems
    python tools/benchmark.py --systems hf-eager,litespark-local-bf16 --model tiny --seq-length 64 \
        --micro-batch-size 2 --steps 2 --warmup 1   # runs anywhere: fp32 on the CPU without a GPU

Systems: hf-eager, hf-compile, litespark-bf16, litespark-fp8, stock-te-bf16, stock-te-fp8, litespark-local-bf16.
Each runs in a fresh process; the table (printed last, and OUT/benchmark.md) gives tokens/s, TFLOP/s per GPU (full
and causal attention), MFU, peak memory, GPU power and J/token, and the ratios to hf-eager; OUT/benchmark.json
holds the raw numbers. The hf-* systems need `pip install transformers`. Details: litespark_megatron/apps/benchmark.py.
Exit status: 0 all systems ran, 1 some failed (reported in the table), 2 bad input.
"""
from __future__ import annotations

import sys
from pathlib import Path

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps.benchmark import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
