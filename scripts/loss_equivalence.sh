#!/usr/bin/env bash
# Train the same model with stock Megatron-Core and with Litespark (BF16, FP8) from the same seed on the same data,
# then check that every Litespark loss curve stays within TOLERANCE of the stock one (tools/compare_losses.py).
# Arguments go unchanged to every run (data, tokenizer, shape; a run's own flags in RUNS come after them and win);
# the knobs are environment variables:
#
#   MODEL=llama-1b         litespark-train preset
#   STEPS=300              optimizer steps per run
#   NPROC=1                processes per run (torchrun --standalone); the layout flags go in the arguments
#   OUT_DIR=runs/equivalence   one directory per run (metrics.jsonl, TensorBoard), report.md, losses.png
#   TOLERANCE=0.01         largest relative deviation of the smoothed curves
#   SMOOTH=5               trailing mean over this many logged points before comparing
#   START_STEP=20          compare from this step on (the first steps move too fast to compare pointwise)
#   WARMUP=STEPS/10        --lr-warmup-iters (early loss spikes are where runs part ways; warm-up softens them);
#                          an argument --lr-warmup-iters wins
#   KEEP_DONE=0            1: keep a run whose directory already logged step STEPS instead of training it again
#                          (to spread the runs over several sessions; delete a run's directory to redo it)
#   RESUME=0               1: every run saves a checkpoint into its directory's ckpt/ every SAVE_INTERVAL steps
#                          (keeping the newest), and a run that stopped before STEPS (a time limit, a lost machine)
#                          goes on from it instead of starting over; resume is bit-exact, so the curve is the one an
#                          unbroken run draws. Finished runs are kept, as with KEEP_DONE=1
#   SAVE_INTERVAL=STEPS/10 with RESUME=1: steps between checkpoints
#   CONCURRENT=1           train this many runs at once, run k of each wave on GPUs k*NPROC .. k*NPROC+NPROC-1
#                          (CUDA_VISIBLE_DEVICES): the check takes about one run's time on a node with enough GPUs
#                          (the first run starts alone and the others once it logged a step: the data's index cache)
#   SHARE_GPUS=0           1: the concurrent runs share the visible GPUs instead of taking NPROC each (small models
#                          on one large GPU)
#   RUNS                   "name:flags;name:flags..."; the first is the reference. Default (GPU with TE):
#                          stock-te-bf16:--spec stock-te --bf16;litespark-bf16:--spec litespark
#                          --transformer-impl transformer_engine --bf16;litespark-fp8:<the same> --fp8-format hybrid
#                          Add a noise floor to read the others against: the reference with other rounding only,
#                          e.g. "stock-noise:--spec stock-te --bf16 --no-gradient-accumulation-fusion" (at small
#                          batches two such runs can part by more than 1%:
#                          docs/benchmarks/2026-11-22-loss-equivalence-llama-1b.md)
#
#   bash scripts/loss_equivalence.sh --micro-batch-size 4 --global-batch-size 32
#   CONCURRENT=3 bash scripts/loss_equivalence.sh --micro-batch-size 4 --global-batch-size 32   # 3 GPUs at once
#   RUNS="stock-local:--spec stock-local;litespark-local:--transformer-impl local" MODEL=tiny STEPS=50 \
#       bash scripts/loss_equivalence.sh        # anywhere, CPU included
# Exit status: 0 all within tolerance, 1 one is not (report.md says which), 2 bad input or a run failed or stopped.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="loss_equivalence.sh"
# shellcheck source=scripts/_lib.sh
. "$ROOT/scripts/_lib.sh"  # die, usage, check_int
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  usage
  exit 0
fi

MODEL="${MODEL:-llama-1b}"
STEPS="${STEPS:-300}"
NPROC="${NPROC:-1}"
OUT_DIR="${OUT_DIR:-runs/equivalence}"
TOLERANCE="${TOLERANCE:-0.01}"
SMOOTH="${SMOOTH:-5}"
START_STEP="${START_STEP:-20}"
CONCURRENT="${CONCURRENT:-1}"
TE="--spec litespark --transformer-impl transformer_engine --bf16"
RUNS="${RUNS:-stock-te-bf16:--spec stock-te --bf16;litespark-bf16:$TE;litespark-fp8:$TE --fp8-format hybrid}"
PY="${PYTHON:-python3}"
if [ -n "${VIRTUAL_ENV:-}" ]; then PY=python; fi

[[ $STEPS =~ ^[0-9]+$ ]] && WARMUP="${WARMUP:-$((10#$STEPS / 10))}"
[[ $STEPS =~ ^[0-9]+$ ]] && SAVE_INTERVAL="${SAVE_INTERVAL:-$((10#$STEPS / 10 > 0 ? 10#$STEPS / 10 : 1))}"
for v in STEPS NPROC SMOOTH CONCURRENT SAVE_INTERVAL; do check_int "$v" "${!v}" 1; done
for v in START_STEP WARMUP; do check_int "$v" "${!v}" 0; done
SHARE_GPUS="${SHARE_GPUS:-0}"
[[ $SHARE_GPUS =~ ^[01]$ ]] || die "SHARE_GPUS='$SHARE_GPUS' must be 0 or 1"
RESUME="${RESUME:-0}"
[[ $RESUME =~ ^[01]$ ]] || die "RESUME='$RESUME' must be 0 or 1"
KEEP_DONE="${KEEP_DONE:-0}"
[ "$RESUME" = 0 ] || KEEP_DONE=1
[ "$START_STEP" -lt "$STEPS" ] || die "START_STEP=$START_STEP must be below STEPS=$STEPS"
[ "$WARMUP" -lt "$STEPS" ] || die "WARMUP=$WARMUP must be below STEPS=$STEPS"

# The last training step a run's directory logged (0: none).
last_step() {
  "$PY" -c "import json, sys; print(max([r['step'] for r in map(json.loads, open(sys.argv[1]))
      if r.get('kind') == 'train'] or [0]))" "$1/metrics.jsonl" 2>/dev/null || echo 0
}

names=()
flags=()
IFS=';' read -r -a entries <<<"$RUNS"
for entry in "${entries[@]}"; do
  [ -n "${entry// /}" ] || continue
  [[ $entry == *:* ]] || die "RUNS entry '$entry' is not name:flags"
  name="${entry%%:*}"
  [[ $name =~ ^[A-Za-z0-9._-]+$ ]] || die "RUNS name '$name' must be letters, digits, '.', '_' or '-'"
  for n in "${names[@]}"; do [ "$n" != "$name" ] || die "RUNS names '$name' twice"; done
  names+=("$name")
  flags+=("${entry#*:}")
done
[ "${#names[@]}" -ge 2 ] || die "RUNS needs at least two runs (a reference first), got ${#names[@]}"

# Logging every step keeps the curves comparable point by point; no evaluation. The optimizer recipe is the
# efficiency suite's (peak 3e-4, cosine to 0, weight decay 0.1, beta2 0.95), with which the earlier curves were
# measured; arguments win over it.
COMMON=(--model "$MODEL" --train-iters "$STEPS" --lr-warmup-iters "$WARMUP" --log-interval 1 --eval-iters 0
        --eval-interval "$STEPS" --lr 3e-4 --min-lr 0 --lr-decay-style cosine --weight-decay 0.1 --adam-beta2 0.95
        --seed "${SEED:-1234}")
mkdir -p "$OUT_DIR"
dirs=()
todo=()
for i in "${!names[@]}"; do
  dir="$OUT_DIR/${names[$i]}"
  dirs+=("$dir")
  if [ "$KEEP_DONE" = 1 ] && [ "$(last_step "$dir")" -eq "$((10#$STEPS))" ]; then
    echo "[$((i + 1))/${#names[@]}] ${names[$i]}: kept ($([ "$RESUME" = 1 ] && echo RESUME || echo KEEP_DONE)=1, $dir logged step $STEPS)"
  else
    todo+=("$i")
  fi
done

# Starts run $1 in the background on slot $2 (its GPUs when CONCURRENT > 1) with the shared arguments after them;
# its pid goes to $pid.
start_run() {
  local i=$1 slot=$2 dir="${dirs[$1]}" gpus="" d
  shift 2
  # shellcheck disable=SC2206
  local extra=(${flags[$i]}) cmd
  if [ "$RESUME" = 1 ]; then
    # The run's own checkpoints, newest kept; its metrics file goes on from the checkpoint's step (telemetry.py).
    extra+=(--save "$dir/ckpt" --load "$dir/ckpt" --save-interval "$SAVE_INTERVAL" --keep-last-checkpoints 1)
    if [ -f "$dir/ckpt/latest_checkpointed_iteration.txt" ]; then
      echo "[$((i + 1))/${#names[@]}] ${names[$i]}: resumes from step $(cat "$dir/ckpt/latest_checkpointed_iteration.txt")"
    fi
  else
    rm -rf "$dir"
  fi
  if [ "$NPROC" -gt 1 ]; then
    cmd=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" -m litespark_megatron)
  else
    cmd=("$PY" -m litespark_megatron)
  fi
  # The run's own flags last: they win over the shared arguments (what differs between runs is the point).
  cmd+=("${COMMON[@]}" "$@" "${extra[@]}" --tensorboard-dir "$dir/tb" --metrics-file "$dir/metrics.jsonl")
  if [ "$CONCURRENT" -gt 1 ] && [ "$SHARE_GPUS" = 0 ]; then
    for ((d = slot * NPROC; d < (slot + 1) * NPROC; d++)); do gpus+="${gpus:+,}$d"; done
  fi
  echo "[$((i + 1))/${#names[@]}] ${names[$i]}:${gpus:+ CUDA_VISIBLE_DEVICES=$gpus} ${cmd[*]}"
  (
    [ -z "$gpus" ] || export CUDA_VISIBLE_DEVICES="$gpus"
    PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" exec "${cmd[@]}" >"$OUT_DIR/${names[$i]}.log" 2>&1
  ) &
  pid=$!
}

# Waves of CONCURRENT runs; a failed run stops the script after its wave (the others' logs stay complete).
# Interrupted, the script stops the runs it started.
trap 'kill $(jobs -p) 2>/dev/null; exit 130' INT TERM
for ((w = 0; w < ${#todo[@]}; w += CONCURRENT)); do
  wave=("${todo[@]:w:CONCURRENT}")
  pids=()
  for slot in "${!wave[@]}"; do
    start_run "${wave[$slot]}" "$slot" "$@"
    pids+=("$pid")
    if [ "$w" = 0 ] && [ "$slot" = 0 ] && [ "${#wave[@]}" -gt 1 ]; then
      # The others start once the first has logged a step: megatron-core writes its dataset index cache without
      # a lock, and a run that started at the same time could read it half-written.
      until grep -qs '"kind": "train"' "${dirs[${wave[0]}]}/metrics.jsonl" || ! kill -0 "$pid" 2>/dev/null; do
        sleep 1
      done
      kill -0 "$pid" 2>/dev/null || break
    fi
  done
  failed=()
  for slot in "${!pids[@]}"; do
    wait "${pids[$slot]}" || failed+=("${names[${wave[$slot]}]}")
  done
  for name in "${failed[@]}"; do tail -5 "$OUT_DIR/$name.log" >&2; done
  [ "${#failed[@]}" -eq 0 ] || die "run '${failed[0]}' failed (log: $OUT_DIR/${failed[0]}.log)"
done

# A run that exited before STEPS (--exit-interval, --exit-duration-in-mins, a signal megatron.training saved on)
# did not fail, but its curve is short: no verdict on part of a curve.
for i in "${!names[@]}"; do
  last=$(last_step "${dirs[$i]}")
  [ "$last" -eq "$((10#$STEPS))" ] || die "run '${names[$i]}' stopped at step $last of $STEPS (log: $OUT_DIR/${names[$i]}.log);\
 with RESUME=1 the next call goes on from its last checkpoint"
done

set +e
PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$ROOT/tools/compare_losses.py" "${dirs[@]}" \
  --tolerance "$TOLERANCE" --smooth "$SMOOTH" --start-step "$START_STEP" --plot "$OUT_DIR/losses.png" \
  | tee "$OUT_DIR/report.md"
rc=${PIPESTATUS[0]}
exit "$rc"
