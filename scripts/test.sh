#!/usr/bin/env bash
# The test suite (CPU is enough: multi-rank tests spawn gloo processes). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
# Two or more worker processes (pytest-xdist, up to 4): most of a test's time is processes starting (imports), which
# another core overlaps; on 2 cores the suite takes 20-23 minutes instead of 32. LITESPARK_TEST_WORKERS=0: one process.
WORKERS="${LITESPARK_TEST_WORKERS:-$(python -c 'import os; print(max(2, min(len(os.sched_getaffinity(0)), 4)))')}"
exec python -m pytest -q -p no:cacheprovider -n "$WORKERS" tests "$@"
