#!/usr/bin/env bash
# Checks a GPU install end to end: the suite's GPU pass (TE spec equivalence, fused kernels), then the tiny model
# for a few steps with each spec/backend and precision on one GPU, then (with >= 2 GPUs) TP2, TP2+SP, PP2, DP2
# and CP2. Logs go to ${OUT_DIR:-runs/gpu_check}; the last lines are a table. Stops at once (exit 1) when TE's
# fused attention does not run on a Hopper GPU; exits 1 if a test or a run failed.
#   bash scripts/gpu_check.sh            # PARTS="tests single multi" by default; pick a subset with PARTS=...
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT_DIR="${OUT_DIR:-runs/gpu_check}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" CUDA_DEVICE_MAX_CONNECTIONS=1
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
FP8=$(python3 -c "import torch; print(int(torch.cuda.get_device_capability() >= (8, 9)))")
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT_DIR/gpus.txt"
# On Hopper, TE's attention must run its fused cuDNN kernel: a stock baseline without it (TE loading another cuDNN
# than torch's) made every earlier "vs stock" ratio wrong. Stop here rather than measure anything.
if ! python3 - <<'PY'
import sys, torch
from litespark_megatron import backend_probe, platform
if torch.cuda.get_device_capability()[0] == 9:
    if not platform.te_importable():
        sys.exit("gpu_check: Transformer Engine is not importable on this Hopper GPU: pip install -e '.[te]'")
    warning = backend_probe.te_attention_check(128, 32, 8)
    if warning:
        sys.exit(f"gpu_check: {warning}")
    print(f"TE fused attention: yes (TE's cuDNN {backend_probe.te_cudnn_version()}, "
          f"torch's {backend_probe.torch_cudnn_version()})")
PY
then
  exit 1
fi

PARTS="${PARTS:-tests single multi}"
failed=0
has() { [[ " $PARTS " == *" $1 "* ]]; }
if has tests; then
  # the suite's GPU pass: the tests marked gpu, on this machine's GPUs (tests/conftest.py)
  LITESPARK_TEST_GPU=1 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT_DIR/pytest_gpu.log" |
    tail -3 || failed=1
fi

TINY=(--model tiny --mock-data --seq-length 256 --vocab-size 4096 --micro-batch-size 4 --global-batch-size 16
      --train-iters 30 --log-interval 10 --eval-iters 0 --eval-interval 30 --lr 1e-3 --seed 5)
results=()
run() {  # name nproc flags...
  local name=$1 nproc=$2; shift 2
  local log="$OUT_DIR/$name.log"
  torchrun --standalone --nproc-per-node "$nproc" -m litespark_megatron "${TINY[@]}" "$@" >"$log" 2>&1
  local rc=$?
  [ "$rc" = 0 ] || failed=1
  local line; line=$(grep -E "iteration +30/ +30 " "$log" | sed -E 's/.*(iteration)/\1/' | tail -1)
  results+=("$(printf '%-28s rc=%s  %s' "$name" "$rc" "${line:-$(grep -m1 -E 'Error|error' "$log")}")")
  # What ran (the trainer's first-step line); a fallback is shown, e.g. stock-local's unfused attention by design.
  results+=("$(printf '%-28s %s' '' "$(grep -m1 -E '^what ran:' "$log")")")
  grep -q "DEGRADED" "$log" && results+=("$(printf '%-28s %s' '' "$(grep -m1 DEGRADED "$log")")")
}
if has single; then
  run litespark-te-bf16 1 --transformer-impl transformer_engine --bf16
  run litespark-local-bf16 1 --transformer-impl local --bf16
  run litespark-local-fp32 1 --transformer-impl local
  run stock-te-bf16 1 --spec stock-te --bf16
  run stock-local-bf16 1 --spec stock-local --bf16
  run litespark-te-mla 1 --transformer-impl transformer_engine --bf16 --multi-latent-attention
  if [ "$FP8" = 1 ]; then
    run litespark-te-fp8 1 --transformer-impl transformer_engine --bf16 --fp8-format hybrid --fp8-recipe delayed
    run litespark-te-fp8-tensorwise 1 --transformer-impl transformer_engine --bf16 --fp8-format e4m3 --fp8-recipe tensorwise
  fi
fi
if has multi && [ "$NGPU" -ge 2 ]; then
  run te-tp2 2 --transformer-impl transformer_engine --bf16 --tensor-model-parallel-size 2
  run te-tp2-sp 2 --transformer-impl transformer_engine --bf16 --tensor-model-parallel-size 2 --sequence-parallel
  run te-pp2 2 --transformer-impl transformer_engine --bf16 --pipeline-model-parallel-size 2
  run te-dp2-distopt 2 --transformer-impl transformer_engine --bf16 --use-distributed-optimizer
  run te-cp2 2 --transformer-impl transformer_engine --bf16 --context-parallel-size 2
  [ "$FP8" = 1 ] && run te-cp2-fp8 2 --transformer-impl transformer_engine --bf16 --fp8-format hybrid --context-parallel-size 2
  run stock-te-cp2 2 --spec stock-te --bf16 --context-parallel-size 2
  run te-mla-cp2 2 --transformer-impl transformer_engine --bf16 --multi-latent-attention --context-parallel-size 2
  run local-tp2-sp 2 --transformer-impl local --bf16 --tensor-model-parallel-size 2 --sequence-parallel
  run local-dp2 2 --transformer-impl local --bf16
  run local-cp2 2 --transformer-impl local --bf16 --context-parallel-size 2
fi
printf '%s\n' "${results[@]}" | tee "$OUT_DIR/summary.txt"
exit "$failed"
