#!/usr/bin/env bash
# The test suite (CPU is enough: multi-rank tests spawn gloo processes; a GPU adds a second pass). Extra arguments go
# to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
# Two or more worker processes (pytest-xdist, up to 4): most of a test's time is processes starting (imports), which
# another core overlaps. LITESPARK_TEST_WORKERS=0: one process. Training runs are forked from a process per worker
# that imported torch and megatron-core once (tests/zygote.py; LITESPARK_TEST_FORK=0: real processes only).
# --dist loadgroup: tests handed out one at a time in the suite's own order, the longest first (tests/conftest.py).
WORKERS="${LITESPARK_TEST_WORKERS:-$(python -c 'import os; print(max(2, min(len(os.sched_getaffinity(0)), 4)))')}"
DIST=(--dist loadgroup --no-loadscope-reorder)
python -m pytest -q -p no:cacheprovider -n "$WORKERS" "${DIST[@]}" tests "$@"
# With a GPU here: the tests marked gpu again, on it (the pass above hid it: tests/conftest.py says why). Exit 5 is
# pytest's "no test selected" (arguments that chose none of them).
if python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  LITESPARK_TEST_GPU=1 python -m pytest -q -p no:cacheprovider -n "$WORKERS" "${DIST[@]}" -m gpu tests "$@" || [ $? -eq 5 ]
fi
