#!/usr/bin/env python3
"""EfficientLLM-style efficiency suite: attention variants, MoE, positional encoding and precisions of one base model,
each trained for the same steps on the same data in a fresh litespark-train process, compared on AMU, PCU, AL, TT,
AEC, J/token and validation perplexity.

    python tools/efficiency_suite.py --out runs/eff-0.5b --model eff-0.5b --variants all \\
        -- --micro-batch-size 4 --global-batch-size 32 --lr 3e-4 --lr-warmup-iters 20

Writes OUT/efficiency.md, efficiency.json, efficiency.csv, plots/*.png, tb/ (TensorBoard) and OUT/runs/<variant>/
(each run's log.txt and metrics.jsonl). Interrupted: run the same command again; finished variants are skipped.
Exit status: 0 all variants done, 1 some failed or ran out of memory, 2 bad input (nothing ran), 3 stopped by
--time-budget with variants left. Logic and definitions: litespark_megatron/apps/efficiency_suite.py, docs/metrics.md.
"""
import sys
from pathlib import Path

try:
    import litespark_megatron  # noqa: F401
except ImportError:  # run from a source checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from litespark_megatron.apps.efficiency_suite import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
