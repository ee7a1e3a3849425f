#!/usr/bin/env bash
# The efficiency suite's base model, from its recipe: train examples/efficiency-base.yaml into RUN_DIR/ckpt (the
# fine-tuning axis's --peft-base) and export it to RUN_DIR/hf with its tokenizer (the inference axis's --hf).
# Extra arguments go to litespark-train (e.g. --train-iters 50 for a quick look). Started again, the training
# resumes from its last checkpoint; the export runs once the training has finished (exit status 3: not yet).
#
#   bash scripts/efficiency_base.sh runs/base
#   python tools/efficiency_suite.py --axis finetune --peft-base runs/base/ckpt --model llama-1b --out runs/ft ...
#   python tools/efficiency_suite.py --axis inference --hf runs/base/hf --out runs/inf ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="efficiency_base.sh"
# shellcheck source=scripts/_lib.sh
. "$ROOT/scripts/_lib.sh"
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || die "give the run directory first: $PROG RUN_DIR [litespark-train flags]"
RUN_DIR="$1"
shift
[ -e "$RUN_DIR/hf" ] && die "$RUN_DIR/hf exists: this base was exported already (another RUN_DIR trains another)"
RUN_DIR="$RUN_DIR" bash "$ROOT/scripts/pretrain.sh" --config "$ROOT/examples/efficiency-base.yaml" \
  --save "$RUN_DIR/ckpt" --load "$RUN_DIR/ckpt" --tensorboard-dir "$RUN_DIR/tb" \
  --metrics-file "$RUN_DIR/metrics.jsonl" "$@"
pick_python
# A run stopped early (a signal, --exit-duration-in-mins) saved where it was: export only the finished model.
LEFT="$("$PYTHON" - "$RUN_DIR/ckpt" <<'PY'
import sys
from litespark_megatron.checkpoint_dir import tracked_iteration
from litespark_megatron.hf_convert import checkpoint_arguments, checkpoint_dir
print(checkpoint_arguments(checkpoint_dir(sys.argv[1])).train_iters - tracked_iteration(sys.argv[1]))
PY
)"
if [ "$LEFT" -gt 0 ]; then
  echo "$PROG: the training stopped $LEFT steps before its end; run the same command again to continue it" >&2
  exit 3
fi
"$PYTHON" -m litespark_megatron.hf_convert export "$RUN_DIR/ckpt" "$RUN_DIR/hf" --dtype bf16
