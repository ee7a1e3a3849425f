#!/usr/bin/env bash
# Launch litespark-train with torchrun on this node: a single-node run, or one node of a multi-node run (start this
# script once on every node, with the same arguments and the same knobs except NODE_RANK). Arguments go unchanged
# to `python -m litespark_megatron`; the knobs are environment variables (docs/launching.md explains each):
#
#   NNODES=1               nodes in the job
#   NODE_RANK=0            this node, 0..NNODES-1; node 0 hosts the rendezvous (static rendezvous only)
#   GPUS_PER_NODE          processes on this node: default every visible GPU, or 1 process on a CPU-only node
#                          (NPROC_PER_NODE, torchrun's name, is accepted too)
#   MASTER_ADDR            address of node 0 that every node can reach; required when NNODES > 1 (static)
#   MASTER_PORT=29500      port node 0 listens on for the rendezvous (static)
#   RDZV_ENDPOINT, RDZV_ID torchrun's c10d rendezvous instead of the static one: host[:port] of the store, and one
#                          id shared by every node of the job; torchrun then assigns the node ranks
#   RDZV_TIMEOUT=300       seconds the rendezvous waits for all NNODES nodes before the job fails
#   MASTER_WAIT_SECONDS=120  seconds a node with NODE_RANK > 0 waits for MASTER_ADDR:MASTER_PORT to accept
#   RUN_DIR=runs/<time>    gets launch.log (everything printed) and command.txt (the resolved command); on a
#                          multi-node run launch.node<R>.log and command.node<R>.txt, so nodes can share it
#   PYTHON                 interpreter with litespark-megatron installed (default: the active virtualenv's
#                          python, else this checkout's .venv, else python3)
#
#   bash scripts/pretrain.sh --config examples/llama3b-h200.yaml --data-path data/corpus --save ckpt/3b
#   NNODES=8 NODE_RANK=$i MASTER_ADDR=node0 bash scripts/pretrain.sh --config examples/llama30b-h200.yaml ...
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PROG="pretrain.sh"
# shellcheck source=scripts/_lib.sh
. "$ROOT/scripts/_lib.sh"  # die, usage, check_int, pick_python

# ------------------------------------------------------------------------------------------------ the interpreter
pick_python

for arg in "$@"; do
  if [ "$arg" = "-h" ] || [ "$arg" = "--help" ]; then
    usage
    echo
    exec "$PYTHON" -m litespark_megatron --help
  fi
done

# ------------------------------------------------------------------------------------------------ the knobs
NNODES="${NNODES:-1}"
check_int NNODES "$NNODES" 1
NNODES=$((10#$NNODES))
if [ -n "${GPUS_PER_NODE:-}" ] && [ -n "${NPROC_PER_NODE:-}" ] && [ "$GPUS_PER_NODE" != "$NPROC_PER_NODE" ]; then
  die "GPUS_PER_NODE=$GPUS_PER_NODE and NPROC_PER_NODE=$NPROC_PER_NODE disagree: set only one of them"
fi
NPROC="${GPUS_PER_NODE:-${NPROC_PER_NODE:-auto}}"
[ "$NPROC" = auto ] || check_int GPUS_PER_NODE "$NPROC" 1
RDZV_TIMEOUT="${RDZV_TIMEOUT:-300}"
check_int RDZV_TIMEOUT "$RDZV_TIMEOUT" 1
MASTER_WAIT_SECONDS="${MASTER_WAIT_SECONDS:-120}"
check_int MASTER_WAIT_SECONDS "$MASTER_WAIT_SECONDS" 0

RENDEZVOUS=standalone  # one node, nothing given: torchrun picks a free local port itself
if [ -n "${RDZV_ENDPOINT:-}" ]; then
  RENDEZVOUS=c10d
  [ -n "${RDZV_ID:-}" ] || die "RDZV_ENDPOINT=$RDZV_ENDPOINT needs RDZV_ID: give every node of the job the same" \
    "RDZV_ID (the scheduler's job id, for example)"
  if [ -n "${MASTER_ADDR:-}" ]; then
    echo "$PROG: note: RDZV_ENDPOINT is set, so the c10d rendezvous is used and MASTER_ADDR is ignored" >&2
  fi
elif [ -n "${MASTER_ADDR:-}" ] || [ "$NNODES" -gt 1 ]; then
  RENDEZVOUS=static
  [ -n "${MASTER_ADDR:-}" ] || die "NNODES=$NNODES needs MASTER_ADDR (an address of the NODE_RANK=0 node that" \
    "every node can reach), or RDZV_ENDPOINT and RDZV_ID for torchrun's c10d rendezvous"
  NODE_RANK="${NODE_RANK:-0}"
  check_int NODE_RANK "$NODE_RANK" 0
  NODE_RANK=$((10#$NODE_RANK))
  [ "$NODE_RANK" -lt "$NNODES" ] || die "NODE_RANK=$NODE_RANK is out of range for NNODES=$NNODES: give each node" \
    "a different NODE_RANK from 0 to $((NNODES - 1)), node 0 being the one at MASTER_ADDR"
  MASTER_PORT="${MASTER_PORT:-29500}"
  check_int MASTER_PORT "$MASTER_PORT" 1
  MASTER_PORT=$((10#$MASTER_PORT))
  [ "$MASTER_PORT" -le 65535 ] || die "MASTER_PORT=$MASTER_PORT is not a TCP port (1-65535)"
fi

# ------------------------------------------------------------------------------------------------ run directory
RUN_DIR="${RUN_DIR:-runs/$(date +%Y%m%d-%H%M%S)}"
NODE_TAG=""
if [ "$NNODES" -gt 1 ]; then
  # Nodes usually share RUN_DIR on a network filesystem: one log and one command file per node.
  if [ "$RENDEZVOUS" = static ]; then NODE_TAG=".node$NODE_RANK"; else NODE_TAG=".${HOSTNAME%%.*}"; fi
fi
mkdir -p "$RUN_DIR" 2>/dev/null || die "cannot create RUN_DIR=$RUN_DIR: set RUN_DIR to a writable directory"
LOG="$RUN_DIR/launch$NODE_TAG.log"
COMMAND_FILE="$RUN_DIR/command$NODE_TAG.txt"
{ : >>"$LOG"; } 2>/dev/null || die "cannot write $LOG: set RUN_DIR to a writable directory"
# This script's own lines go to the terminal and the log synchronously (so the log keeps their order, the error
# last); torchrun's output is teed at the end.
say() { printf '%s\n' "$*" | tee -a "$LOG"; }
say_err() { tee -a "$LOG" <"$1" >&2; }
say "$PROG: $(date '+%Y-%m-%d %H:%M:%S') on ${HOSTNAME:-$(hostname)}, log $LOG"

# ------------------------------------------------------------------------------------------------ layout check
# Processes per node and the training layout (TP x PP x CP from the arguments or their --config file) checked
# together, with the trainer's own validation, before any node starts torchrun. The check's error is held back and
# printed after the resolved command so that it is the last line.
CHECK_ERR="$(mktemp)"
CHECK_STDOUT="$(mktemp)"
trap 'rm -f "$CHECK_ERR" "$CHECK_STDOUT"' EXIT
CHECK_RC=0
CHECK_OUT="$("$PYTHON" -m litespark_megatron.apps.launch_check --prog "$PROG" layout --nnodes "$NNODES" \
  --nproc-per-node "$NPROC" -- "$@" 2>"$CHECK_ERR")" || CHECK_RC=$?
CHECK_OUT="${CHECK_OUT##*$'\n'}"  # its last line: an import may print before it
if [ -z "$CHECK_OUT" ]; then  # it did not get as far as resolving anything (a broken install): its own words
  say_err "$CHECK_ERR"
  exit "$((CHECK_RC == 0 ? 2 : CHECK_RC))"
fi
read -r NPROC DEVICE ARCH TP PP CP <<<"$CHECK_OUT"

# ------------------------------------------------------------------------------------------------ environment
# Defaults only: a value the user exported always wins.
if [ "$DEVICE" = cuda ]; then
  # Megatron-Core overlaps the tensor-parallel all-gather / reduce-scatter (sequence parallel) and all-reduce, and
  # TE's context-parallel ring (stock-te spec), with compute by issuing the communication kernel first; that order
  # holds only with a single hardware work queue, i.e. CUDA_DEVICE_MAX_CONNECTIONS=1 (otherwise the overlap is lost
  # and Megatron warns). Blackwell (compute capability 10+) schedules them in order without it; TP=1 and CP=1 have
  # nothing to overlap.
  if [ "$ARCH" -lt 10 ] && [ "$TP" != - ] && [ $((TP * CP)) -gt 1 ]; then
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
  fi
  # InfiniBand: retry for 4.096 us x 2^22 (about 17 s) before declaring a link dead, instead of NCCL's 2^20
  # (about 4 s), so that a congested fabric on a large job is not mistaken for a failure.
  export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"
  # NCCL prints nothing when it fails unless asked: WARN explains the failure (and nothing else).
  export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
  # A collective that exceeds --distributed-timeout-minutes (a dead node, a hung rank) makes the watchdog crash the
  # process (3 = without the NCCL abort, which can itself hang), so torchrun ends the job instead of it hanging
  # forever. TORCH_NCCL_BLOCKING_WAIT stays off: it would make the CPU wait on every collective and stall the
  # compute/communication overlap for the same protection.
  export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-3}"
fi

# ------------------------------------------------------------------------------------------------ the command
CMD=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts 0)
case "$RENDEZVOUS" in
  standalone) CMD+=(--standalone) ;;
  # timeout: how long node 0's store waits for all NNODES nodes (torchrun's static rendezvous).
  static) CMD+=(--node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
                --rdzv-conf "timeout=$RDZV_TIMEOUT") ;;
  # join_timeout: how long the c10d rendezvous waits for all NNODES nodes to join.
  c10d) CMD+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID"
              --rdzv-conf "join_timeout=$RDZV_TIMEOUT") ;;
esac
# --exit-signal-handler: a stop signal (the scheduler's SIGTERM, Ctrl-C) saves a checkpoint at the next step and
# the run exits 0; the same command resumes it (--save X --load X).
CMD+=(-m litespark_megatron "$@" --exit-signal-handler)
# torchrun must not handle SIGTERM and SIGINT itself: it would forward them and then exit 1 whatever the workers did
# (its SignalException), failing a job that stopped cleanly. This script forwards them to the workers instead.
export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-SIGHUP,SIGQUIT}"
# ... and the workers, which inherit torchrun's ignored signals, restore them (litespark_megatron/pretrain.py).
export LITESPARK_RESTORE_STOP_SIGNALS=1

# The environment that decides how the run behaves goes into the recorded command too.
SHOWN_VARS='CUDA_VISIBLE_DEVICES|CUDA_DEVICE_MAX_CONNECTIONS|NCCL_[A-Z0-9_]*|TORCH_NCCL_[A-Z0-9_]*|GLOO_[A-Z0-9_]*'
SHOWN_VARS+='|OMP_NUM_THREADS|PET_SIGNALS_TO_HANDLE'
ENV_SHOWN=()
while IFS= read -r line; do
  ENV_SHOWN+=("$line")
done < <(env | grep -E "^($SHOWN_VARS)=" | LC_ALL=C sort)
quoted() { printf '%q ' "$@" | sed 's/ $//'; }
RESOLVED="$(quoted env ${ENV_SHOWN[@]+"${ENV_SHOWN[@]}"} PYTHONPATH="$PYTHONPATH" "${CMD[@]}")"
printf '%s\n' "$RESOLVED" >"$COMMAND_FILE"
if [ "$RENDEZVOUS" = static ]; then
  where="node $NODE_RANK of $NNODES, master $MASTER_ADDR:$MASTER_PORT"
elif [ "$RENDEZVOUS" = c10d ]; then
  where="one of $NNODES nodes, c10d rendezvous $RDZV_ENDPOINT id $RDZV_ID"
else
  where="single node"
fi
if [ "$TP" = - ]; then
  layout="layout not checked"
else
  layout="TP$TP PP$PP CP$CP DP$((NNODES * NPROC / (TP * PP * CP)))"
fi
say "$PROG: $where, $NPROC process(es) on $DEVICE, world size $((NNODES * NPROC)), $layout"
say "$PROG: command (also in $COMMAND_FILE):"
say "  $RESOLVED"
say_err "$CHECK_ERR"  # the check's error, or warnings of a passing check
[ "$CHECK_RC" -eq 0 ] || exit "$CHECK_RC"

# ------------------------------------------------------------------------------------------------ the master
# Node 0 checks that the rendezvous port is free; the other nodes wait (bounded) for node 0 to listen, so that a
# wrong MASTER_ADDR or a node 0 that never started is reported here rather than as a rendezvous timeout.
if [ "$RENDEZVOUS" = static ]; then
  if [ "$NODE_RANK" -gt 0 ]; then
    say "$PROG: waiting up to ${MASTER_WAIT_SECONDS} s for node 0 to listen at $MASTER_ADDR:$MASTER_PORT"
  fi
  "$PYTHON" -m litespark_megatron.apps.launch_check --prog "$PROG" master --addr "$MASTER_ADDR" --port "$MASTER_PORT" \
    --node-rank "$NODE_RANK" --wait "$MASTER_WAIT_SECONDS" >"$CHECK_STDOUT" 2>"$CHECK_ERR" || CHECK_RC=$?
  tee -a "$LOG" <"$CHECK_STDOUT"
  say_err "$CHECK_ERR"
  [ "$CHECK_RC" -eq 0 ] || exit "$CHECK_RC"
fi

rm -f "$CHECK_ERR" "$CHECK_STDOUT"
# Everything torchrun and the training print also goes to the log (stderr stays stderr). The tees ignore INT and
# TERM: they must outlive torchrun to record its shutdown messages, and end at EOF.
exec > >(trap '' INT TERM; exec tee -a "$LOG") 2> >(trap '' INT TERM; exec tee -a "$LOG" >&2)
# Stop signals: torchrun ignores SIGTERM and SIGINT (inherited, and not in PET_SIGNALS_TO_HANDLE); they go to its
# workers (this node's training processes), from here or directly from a scheduler that signals every process of
# the job. The workers save, all ranks agree on the step, they exit 0, and so do torchrun and this script.
( trap '' INT TERM; exec "${CMD[@]}" ) &
TORCHRUN=$!
stop() {
  echo "$PROG: $1: asking the training processes to save a checkpoint at the next step and exit"
  pkill -TERM -P "$TORCHRUN" 2>/dev/null || true
}
trap 'stop SIGTERM' TERM
trap 'stop SIGINT' INT
RC=0
wait "$TORCHRUN" || RC=$?
while kill -0 "$TORCHRUN" 2>/dev/null; do  # a trapped signal ends `wait` early: wait again for torchrun
  RC=0
  wait "$TORCHRUN" || RC=$?
done
exit "$RC"
