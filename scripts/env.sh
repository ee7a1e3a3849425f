#!/usr/bin/env bash
# Sourced by the other scripts: a project virtualenv (.venv, Python 3.12+) with litespark-megatron installed
# (editable). megatron-core 0.19 (its megatron.training is the trainer) needs Python >= 3.12: this finds one by
# itself ($PYTHON, then python3.12 / python3 on PATH, then pyenv's 3.12.x, whose shim refuses unless selected).
# Reuses an importable torch; otherwise installs torch ${TORCH_VERSION:-2.13.0}. GPU users: install the CUDA torch
# you want first, and `pip install -e '.[te]'` for Transformer Engine.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

_py_ok() {  # a Python that runs and is >= 3.12
  "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1
}

find_python() {
  local candidate
  for candidate in "${PYTHON:-}" python3.12 python3.13 python3; do
    [ -n "$candidate" ] && command -v "$candidate" >/dev/null 2>&1 && _py_ok "$candidate" && {
      command -v "$candidate"; return 0; }
  done
  if command -v pyenv >/dev/null 2>&1; then
    for candidate in "$(pyenv root)"/versions/3.1[2-9]*/bin/python3; do
      [ -x "$candidate" ] && _py_ok "$candidate" && { echo "$candidate"; return 0; }
    done
  fi
  return 1
}

if [ -z "${VIRTUAL_ENV:-}" ]; then
  if [ ! -x "$ROOT/.venv/bin/python" ] || ! _py_ok "$ROOT/.venv/bin/python"; then
    PY="$(find_python)" || {
      echo "env.sh: error: no Python 3.12 or newer found (megatron-core 0.19 needs it): install one, or set" \
           "PYTHON=/path/to/python3.12" >&2
      exit 2
    }
    rm -rf "$ROOT/.venv"
    "$PY" -m venv "$ROOT/.venv"
  fi
  # shellcheck disable=SC1091
  . "$ROOT/.venv/bin/activate"
elif ! _py_ok python; then
  echo "env.sh: error: the active virtualenv $VIRTUAL_ENV has Python $(python -V 2>&1 | cut -d' ' -f2);" \
       "megatron-core 0.19 needs 3.12 or newer" >&2
  exit 2
fi
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==${TORCH_VERSION:-2.13.0}"
fi
stamp="$VIRTUAL_ENV/.litespark-installed"
if [ ! -f "$stamp" ] || [ "$ROOT/setup.py" -nt "$stamp" ]; then
  python -m pip install -q -e "$ROOT[dev,hf]"
  touch "$stamp"
fi
