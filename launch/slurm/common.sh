#!/usr/bin/env bash
# shellcheck disable=SC2034  # globals set here (TORCHRUN_CMD, LOG_DIR, ...) are read by the sbatch scripts
# Helpers sourced by the sbatch scripts in this directory (no Python logic lives here).
#
# Every command that would start a process goes through run_cmd / run_bg: with DRY_RUN=1 they
# print the shell-quoted command line on stdout instead (one line each) so a test can render the
# launch without Slurm; explanations go to stderr.

# The repository root: where the job was submitted from (sbatch copies the script away, so its
# own path is useless), or REPO_DIR.
REPO_DIR=${REPO_DIR:-${SLURM_SUBMIT_DIR:-$PWD}}
DRY_RUN=${DRY_RUN:-0}

log() {
    printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2
}

die() {
    log "error: $*"
    exit 2
}

quote_cmd() {
    printf '%q ' "$@"
    printf '\n'
}

# run_cmd CMD...: run in the foreground (or print it).
run_cmd() {
    if [[ $DRY_RUN == 1 ]]; then
        quote_cmd "$@"
    else
        "$@"
    fi
}

# run_bg CMD...: start in the background and append its pid to BG_PIDS (or print it).
BG_PIDS=()
run_bg() {
    if [[ $DRY_RUN == 1 ]]; then
        quote_cmd "$@"
    else
        "$@" &
        BG_PIDS+=("$!")
    fi
}

# kill_bg: stop the background commands this script started (by pid), then reap them.
kill_bg() {
    local pid
    for pid in "${BG_PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${BG_PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}

# The trainer's interpreter: PYTHON, else python3 from PATH (inside CONTAINER_IMAGE when set).
# Never the repo's .venv: `make` puts a CPU-only torch there, which on GPU nodes would train on
# the CPU (or fail late); set PYTHON=<repo>/.venv/bin/python to use it deliberately.
pick_python() {
    echo "${PYTHON:-python3}"
}

# log_python WHAT PYTHON IMAGE: say which interpreter a command runs (once per job, on stderr).
log_python() {
    local what=$1 py=$2 image=${3:-} where
    if [[ -n $image ]]; then
        where="inside $image"
    else
        where=$(command -v "$py" 2>/dev/null || echo "not found on $(hostname 2>/dev/null || echo this node)")
    fi
    if [[ -n ${PYTHON:-} && $py == "$PYTHON" ]]; then
        log "$what python: $py ($where; from PYTHON)"
    else
        log "$what python: $py ($where; PYTHON unset: python3 from PATH, never the repo's .venv)"
    fi
}

# SMOKE=1: the trainer runs its pre-flight check (--smoke) instead of training.
smoke_args() {
    SMOKE_ARGS=()
    case ${SMOKE:-0} in
        0 | "") ;;
        1) SMOKE_ARGS=(--smoke) ;;
        *) die "SMOKE must be 0 or 1, got '$SMOKE'" ;;
    esac
}

# The allocation's hostnames, one per line.
job_nodes() {
    [[ -n ${SLURM_JOB_NODELIST:-} ]] || die "SLURM_JOB_NODELIST is not set (submit with sbatch)"
    scontrol show hostnames "$SLURM_JOB_NODELIST"
}

# node_addr HOST: the host's IPv4 address as the cluster resolves it (loopback answers, e.g. a
# Debian 127.0.1.1 entry, are skipped), else the hostname itself.
node_addr() {
    local addr
    addr=$(timeout 5 getent ahostsv4 "$1" 2>/dev/null | awk '$1 !~ /^127\./ {print $1; exit}') || true
    echo "${addr:-$1}"
}

# Defaults for NCCL / PyTorch distributed; each can be overridden from the environment.
#   CUDA_DEVICE_MAX_CONNECTIONS=1    Megatron: keeps TP/SP communication ordered with compute.
#   TORCH_NCCL_ASYNC_ERROR_HANDLING=1  a failed or timed-out collective aborts the job instead of
#                                    hanging it until the Slurm time limit.
#   NCCL_DEBUG=WARN                  INFO prints the transports chosen (use it to check IB).
# Set per cluster (left unset here, see docs/cluster.md):
#   NCCL_SOCKET_IFNAME=ib0|eth0      interface for NCCL's bootstrap / socket fallback
#   NCCL_IB_HCA=mlx5_0,mlx5_1,...    the InfiniBand HCAs to use (all rails)
#   NCCL_IB_GID_INDEX=3              RoCE clusters
#   NCCL_IB_TIMEOUT=22, NCCL_IB_RETRY_CNT=13   tolerate congested fabrics
#   NCCL_NVLS_ENABLE=0               if NVLink SHARP fails to initialise
setup_dist_env() {
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export PYTHONPATH=$REPO_DIR${PYTHONPATH:+:$PYTHONPATH}
}

# Extra srun arguments for a pyxis/enroot container (CONTAINER_IMAGE, CONTAINER_MOUNTS).
container_args() {
    CONTAINER_ARGS=()
    if [[ -n ${CONTAINER_IMAGE:-} ]]; then
        CONTAINER_ARGS+=("--container-image=$CONTAINER_IMAGE" "--container-workdir=$PWD")
        # the repo is the container's workdir: always mounted; CONTAINER_MOUNTS adds to it
        local mounts=$REPO_DIR:$REPO_DIR
        if [[ -n ${CONTAINER_MOUNTS:-} ]]; then mounts+=",$CONTAINER_MOUNTS"; fi
        CONTAINER_ARGS+=("--container-mounts=$mounts")
    fi
}

# resolve_config PATH: absolute path of an existing config file.
resolve_config() {
    [[ -n ${1:-} ]] || die "usage: sbatch $(basename "$0") CONFIG.yaml [section.key=value ...]"
    [[ -f $1 ]] || die "config file not found: $1"
    realpath "$1"
}

# The per-job log directory (stable across --requeue: the job id is kept).
setup_log_dir() {
    LOG_DIR=${LOG_DIR:-$REPO_DIR/logs/${SLURM_JOB_NAME:-gspo}-${SLURM_JOB_ID:-local}}
    if [[ $DRY_RUN != 1 ]]; then
        mkdir -p "$LOG_DIR"
    fi
    log "logs: $LOG_DIR (restart ${SLURM_RESTART_COUNT:-0})"
}

# torchrun_cmd NNODES NPROC HEAD_ADDR -- ARGS...: sets TORCHRUN_CMD to a multi-node torchrun with
# c10d rendezvous on HEAD_ADDR:MASTER_PORT running `-m gspo_megatron.train ARGS...`.
torchrun_cmd() {
    local nnodes=$1 nproc=$2 head=$3
    shift 4
    local python
    python=$(pick_python)
    local sig=()
    # Preemption: torchrun forwards SIGUSR1 (Slurm's --signal, see the sbatch headers) as well as
    # SIGTERM to the workers, which save a checkpoint at the end of the step (checkpoint.save_on_signals),
    # and waits SHUTDOWN_TIMEOUT seconds for them before SIGKILL (its default is 30 s). Older
    # torchruns lack the flags: then only SIGTERM reaches the workers, with torchrun's own grace.
    # Asked on the batch node; where its interpreter has no torch there (python3 outside the job's
    # container) the project's torch (>= 2.13, which has them) is assumed.
    local help
    if [[ ${DRY_RUN:-0} != 1 ]]; then
        help=$("$python" -m torch.distributed.run --help 2>/dev/null) || help=""
        if [[ -z $help ]] || grep -q -- --signals-to-handle <<<"$help"; then
            sig=("--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" "--shutdown-timeout=${SHUTDOWN_TIMEOUT:-600}")
        fi
    fi
    TORCHRUN_CMD=("$python" -m torch.distributed.run
        "--nnodes=$nnodes" "--nproc-per-node=$nproc"
        --rdzv-backend=c10d "--rdzv-endpoint=$head:$MASTER_PORT" "--rdzv-id=${SLURM_JOB_ID:-0}"
        --max-restarts=0 "${sig[@]}"
        -m gspo_megatron.train "$@")
}

# Rendezvous port: fixed per job so every node computes the same one.
MASTER_PORT=${MASTER_PORT:-$((20000 + ${SLURM_JOB_ID:-0} % 20000))}
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
