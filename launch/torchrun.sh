#!/usr/bin/env bash
# Train on one node with torchrun: NPROC processes (one per GPU, or CPU processes).
#
#   NPROC=8 launch/torchrun.sh launch/configs/qwen3_30b_a3b.yaml model.hf_dir=/ckpt/Qwen3-30B-A3B
#   NPROC=2 launch/torchrun.sh launch/configs/tiny_cpu.yaml train.max_steps=5
#
# Everything after the config file is passed to `python -m gspo_megatron.train` as dotted
# overrides (section.key=value). Check a layout first with
#   python -m gspo_megatron.planner --config FILE --world-size "$NPROC"
#
# Environment:
#   NPROC         processes (default: the visible GPUs, else 1)
#   PYTHON        interpreter (default: <repo>/.venv/bin/python if present, else python3). The
#                 .venv `make` builds has a CPU-only torch: when GPUs are visible and that torch has
#                 no CUDA, the script stops with one line (set PYTHON, e.g. PYTHON=python3 in an
#                 NGC container)
#   MASTER_PORT   fixed rendezvous port on localhost (default: torchrun --standalone picks a free one)
#   OMP_NUM_THREADS  CPU threads per process (default: cores / NPROC, at least 1)
#   DRY_RUN=1     print the command instead of running it
set -euo pipefail

REPO_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
    echo "usage: [NPROC=N] $0 CONFIG.yaml [section.key=value ...]" >&2
}

if [[ $# -lt 1 || $1 == -h || $1 == --help ]]; then
    usage
    exit 2
fi
config=$1
shift
if [[ ! -f $config ]]; then
    echo "torchrun.sh: config file not found: $config" >&2
    exit 2
fi

# Visible GPUs (nvidia-smi -L lists them); 0 without nvidia-smi, as on CPU machines.
ngpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    ngpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU') || ngpus=0
fi
if [[ -z ${NPROC:-} ]]; then
    NPROC=$((ngpus > 0 ? ngpus : 1))
fi
if ! [[ $NPROC =~ ^[1-9][0-9]*$ ]]; then
    echo "torchrun.sh: NPROC must be a positive integer, got '$NPROC'" >&2
    exit 2
fi

if [[ -z ${PYTHON:-} ]]; then
    if [[ -x $REPO_DIR/.venv/bin/python ]]; then
        PYTHON=$REPO_DIR/.venv/bin/python
        # The repo's .venv on a GPU machine: `make` installed a CPU-only torch there, which would
        # train on the CPU. Asked only when GPUs are visible (importing torch takes seconds).
        if ((ngpus > 0)) && [[ -z $("$PYTHON" -c 'import torch; print(torch.version.cuda or torch.version.hip or "")' 2>/dev/null) ]]; then
            echo "torchrun.sh: $ngpus GPU(s) visible but $PYTHON has no CUDA torch (make installs the CPU build); set PYTHON to an interpreter with CUDA torch, e.g. PYTHON=python3 in an NGC container" >&2
            exit 2
        fi
    else
        PYTHON=python3
    fi
fi

cores=$(nproc 2>/dev/null || echo 1)
threads=$((cores / NPROC))
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
export PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}
# Megatron: TP/SP communication is issued in order on one CUDA stream queue.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [[ -n ${MASTER_PORT:-} ]]; then
    rdzv=(--rdzv-backend=c10d "--rdzv-endpoint=localhost:$MASTER_PORT")
else
    rdzv=(--standalone)
fi

# Preemption: forward SIGUSR1 too, and give the workers SHUTDOWN_TIMEOUT s to save (checkpoint.save_on_signals)
sig=()
if [[ ${DRY_RUN:-0} != 1 ]] && "$PYTHON" -m torch.distributed.run --help 2>/dev/null | grep -q -- --signals-to-handle; then
    sig=("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" "--shutdown-timeout=${SHUTDOWN_TIMEOUT:-600}")
fi
cmd=("$PYTHON" -m torch.distributed.run --nnodes=1 "--nproc-per-node=$NPROC" "${rdzv[@]}" "${sig[@]}"
    -m gspo_megatron.train --config "$config" "$@")

if [[ ${DRY_RUN:-0} == 1 ]]; then
    printf '%q ' "${cmd[@]}"
    printf '\n'
    exit 0
fi

# torchrun answers a failed worker with ~40 lines of its own (ChildFailedError): keep a copy of
# stderr and end with the failing rank's one-line error, so that is the last thing on the screen.
errlog=$(mktemp "${TMPDIR:-/tmp}/gspo-torchrun.XXXXXX")
trap 'rm -f "$errlog"' EXIT
set +e
"${cmd[@]}" 2> >(tee "$errlog" >&2)
rc=$?
wait 2>/dev/null || true  # the tee of the process substitution
set -e
if [[ $rc -ne 0 ]]; then
    line=$(grep -m1 -E '^(\[rank[0-9]+\]: )?[A-Za-z0-9_.-]+: error: ' "$errlog" || true)
    if [[ -n $line ]]; then
        echo "torchrun.sh: failed (exit $rc): ${line#\[rank*\]: }" >&2
    else
        echo "torchrun.sh: failed (exit $rc); the first traceback above is the cause" >&2
    fi
fi
exit $rc
