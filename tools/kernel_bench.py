#!/usr/bin/env python3
"""A Litespark kernel against the stock kernels it replaces, at a model's shapes (litespark_megatron/apps/kernel_bench.py).

    python tools/kernel_bench.py --kernel rms-norm --model llama-3b
"""
import sys
from pathlib import Path

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps.kernel_bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
