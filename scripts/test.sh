#!/usr/bin/env bash
# The test suite (CPU is enough: multi-rank tests spawn gloo processes). Extra arguments go to pytest.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m pytest -q -p no:cacheprovider tests "$@"
