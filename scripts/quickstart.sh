#!/usr/bin/env bash
# The main job: prepare the embedded corpus (once, cached) and pretrain the tiny preset on every local GPU, or on
# the CPU when there is none. Extra arguments go to litespark-train (e.g. --train-iters 100).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
. "$ROOT/scripts/env.sh"
cd "$ROOT"
NPROC=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
# Started again, it resumes from its last checkpoint (a run never writes over checkpoints it did not load);
# RUN_DIR=another/dir starts afresh.
RUN_DIR="${RUN_DIR:-runs/quickstart}"
set -x
exec torchrun --standalone --nproc-per-node "$NPROC" -m litespark_megatron \
  --config examples/quickstart.yaml --save "$RUN_DIR" --load "$RUN_DIR" --tensorboard-dir "$RUN_DIR/tb" "$@"
