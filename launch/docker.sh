#!/usr/bin/env bash
# Run hvd-train from the Docker image: on one GPU box, or one worker
# container per node.
#
# Usage:
#   launch/docker.sh box [--np N] [--image IMG] [--dry-run] -- HVD_TRAIN_ARGS...
#       one container on this machine, N processes (default: one per GPU)
#   launch/docker.sh worker [--image IMG] [--ssh-port P] [--dry-run]
#       on every node but the first: a container that waits for the launcher (sshd)
#   launch/docker.sh primary --hosts H1:N,H2:N [--network-interface IF]
#                            [--image IMG] [--ssh-port P] [--dry-run] -- HVD_TRAIN_ARGS...
#       on the first node: horovodrun across the worker containers
#
# Data and outputs are mounted from the host: --mount HOST_DIR (repeatable)
# appears at the same path inside. AWS_*, HOROVOD_*, NCCL_* and TF_* set
# here are passed to the container by name (docker run -e NAME), never by
# value. Containers use the host network (for NCCL/Gloo across nodes) and all
# GPUs (--gpus all). The image defaults to hvd-train:latest (see Dockerfile).
#
# Example:
#   launch/docker.sh box --mount /data --mount /runs -- \
#       train --data /data/flowers --model ResNet50 --output /runs/flowers
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

mode=${1:-}
case "$mode" in
  box | worker | primary) shift ;;
  -h | --help) usage "$0"; exit 0 ;;
  *) die "first argument: box, worker or primary (see --help)" ;;
esac
image=${HVD_TRAIN_IMAGE:-hvd-train:latest} np="" hosts="" iface="" ssh_port=12345
mounts=()
while (($#)); do
  case "$1" in
    -n | --np) np=${2:?--np needs a number}; shift 2 ;;
    --image) image=${2:?--image needs a name}; shift 2 ;;
    -H | --hosts) hosts=${2:?--hosts needs H1:N,H2:N}; shift 2 ;;
    --network-interface) iface=${2:?--network-interface needs a name}; shift 2 ;;
    --ssh-port) ssh_port=${2:?--ssh-port needs a number}; shift 2 ;;
    --mount) mounts+=(-v "${2:?--mount needs a folder}:$2"); shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

cmd=(docker run --rm --gpus all --network host --ipc host --ulimit memlock=-1 "${mounts[@]}")
while read -r name; do
  [[ "$name" == PATH || "$name" == LD_LIBRARY_PATH ]] || cmd+=(-e "$name")
done < <(forwarded_names)

case "$mode" in
  box)
    (($#)) || die "give the hvd-train command after --"
    if [[ -z "$np" ]]; then
      np=$(nvidia-smi -L 2>/dev/null | wc -l)
      ((np > 0)) || np=1
    fi
    run_or_print "${cmd[@]}" --entrypoint horovodrun "$image" -np "$np" --gloo hvd-train "$@"
    ;;
  worker)
    # sshd of the image (user hvd, key from ~/.ssh of the host), as the launcher's target.
    run_or_print "${cmd[@]}" -d -v "$HOME/.ssh:/home/hvd/.ssh:ro" --entrypoint /usr/sbin/sshd \
      "$image" -D -p "$ssh_port" -f /etc/ssh/sshd_config_hvd
    ;;
  primary)
    [[ -n "$hosts" ]] || die "primary needs --hosts H1:N,H2:N (this node first)"
    (($#)) || die "give the hvd-train command after --"
    total=0
    IFS=, read -ra entries <<<"$hosts"
    for entry in "${entries[@]}"; do total=$((total + ${entry##*:})); done
    run=(horovodrun -np "${np:-$total}" --gloo -H "$hosts" -p "$ssh_port")
    [[ -n "$iface" ]] && run+=(--network-interface "$iface")
    run_or_print "${cmd[@]}" -v "$HOME/.ssh:/home/hvd/.ssh:ro" --entrypoint "${run[0]}" "$image" \
      "${run[@]:1}" hvd-train "$@"
    ;;
esac
