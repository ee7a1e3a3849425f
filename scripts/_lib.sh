# Helpers shared by the launch scripts; sourced, not run. The sourcing script sets PROG (its name in messages).

# One clear error on stderr, exit status 2 (bad input).
die() {
  printf '%s: error: %s\n' "$PROG" "$*" >&2
  exit 2
}

# The sourcing script's header comment (line 2 up to `set -euo pipefail`) is its --help.
usage() {
  sed -n '2,/^set -euo pipefail$/p' "${BASH_SOURCE[1]}" | sed -e '$d' -e 's/^# \{0,1\}//'
}

# $1 name, $2 value, $3 smallest allowed value
check_int() {
  if ! [[ $2 =~ ^[0-9]+$ ]] || [ "$((10#$2))" -lt "$3" ]; then
    die "$1='$2' must be an integer >= $3"
  fi
}

# PYTHON: the interpreter with litespark-megatron (default: the active virtualenv's or conda's python, else the
# checkout's .venv, else python3); this checkout's package ($ROOT) wins over any other installed copy, on every node
# and in every worker.
pick_python() {
  if [ -z "${PYTHON:-}" ]; then
    if [ -n "${VIRTUAL_ENV:-}" ] || [ -n "${CONDA_PREFIX:-}" ]; then
      PYTHON=python
    elif [ -x "$ROOT/.venv/bin/python" ]; then
      PYTHON="$ROOT/.venv/bin/python"
    else
      PYTHON=python3
    fi
  fi
  command -v "$PYTHON" >/dev/null 2>&1 \
    || die "PYTHON=$PYTHON is not an executable: set PYTHON to the python where litespark-megatron is installed"
  export PYTHON PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
}
