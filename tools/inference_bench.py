#!/usr/bin/env python3
"""Inference benchmark: precisions of one HF Llama (bf16, fp16, torchao int4 with round-to-nearest, HQQ or AWQ
scales, float8, bitsandbytes NF4), each measured in a fresh process: time to first token, decode latency, tokens/s,
memory, GPU power and J/token, decode bandwidth, perplexity and top-1 agreement with bf16 on held-out text.

    python tools/inference_bench.py --hf hf_model/ --out runs/inf --variants bf16,fp16,int4 --batch-sizes 1,8,32

Writes OUT/inference.md, OUT/inference.json and OUT/runs/<variant>/ (spec, log, result, predictions). Interrupted:
run the same command again; finished variants are skipped. Exit status: 0 every variant done (or unable to run
here, with the reason), 1 some failed, 2 bad input (nothing ran). Logic: litespark_megatron/apps/inference_bench.py.
"""
import sys
from pathlib import Path

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps.inference_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
