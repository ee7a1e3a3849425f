#!/usr/bin/env bash
# Sourced by the other scripts: a project virtualenv (.venv) with litespark-megatron installed (editable).
# Reuses an importable torch; otherwise installs torch ${TORCH_VERSION:-2.13.0}. GPU users: install the CUDA torch
# you want first, and `pip install -e '.[te]'` for Transformer Engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$ROOT/.venv/bin/python" ]; then
    "$PYTHON" -m venv "$ROOT/.venv"
  fi
  # shellcheck disable=SC1091
  . "$ROOT/.venv/bin/activate"
fi
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
stamp="$VIRTUAL_ENV/.litespark-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ]; then
  python -m pip install -q -e "$ROOT[dev]"
  touch "$stamp"
fi
