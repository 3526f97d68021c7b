#!/usr/bin/env bash
# Run hvd-train from the Docker image: on one box, or one worker container
# per node.
#
# Usage:
#   launch/docker.sh box [--np N] [OPTIONS] -- HVD_TRAIN_ARGS...
#       one container on this machine, N processes (default: one per GPU, or 1);
#       `-- demo ...` runs the demo, which starts its own N processes
#   launch/docker.sh worker [--name NAME] [OPTIONS]
#       on every node but the first: a container that waits for the launcher (sshd)
#   launch/docker.sh primary --hosts H1:N,H2:N [--network-interface IF]
#                            [--name NAME] [OPTIONS] -- HVD_TRAIN_ARGS...
#       on the first node: horovodrun across the worker containers
#
# Options:
#   --image IMG        image (default $HVD_TRAIN_IMAGE or hvd-train:latest)
#   --mount DIR        host folder mounted at the same path (repeatable)
#   --network NET      host (default), none (box only), or a user-defined
#                      Docker network (docker network create NET); there the
#                      containers reach each other by --name
#   --name NAME        container name and hostname (worker/primary on a
#                      user-defined network)
#   --user UID:GID     user in the container for box (default: the caller's,
#                      so outputs in mounted folders belong to the caller)
#   --ssh-dir DIR      keys for worker/primary (default ~/.ssh): mounted as
#                      /home/hvd/.ssh, must be readable by uid 1000, with the
#                      public key in authorized_keys; worker/primary run as hvd
#   --ssh-port P       sshd port of the workers (default 12345)
#   --gpus all|none    GPUs for the container (default: all when nvidia-smi
#                      lists any, else none: the CPU image needs none)
#   --dry-run          print the docker command instead of running it
#
# AWS_*, HOROVOD_*, NCCL_*, TF_*, HVD_TRAIN_VERBOSE and HVD_TRAIN_KERAS set here are passed to
# the container by name (docker run -e NAME), never by value. The Docker client is $DOCKER or
# docker.
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
network=host name="" user="$(id -u):$(id -g)" ssh_dir="$HOME/.ssh" gpus=auto
mounts=()
while (($#)); do
  case "$1" in
    -n | --np) np=${2:?--np needs a number}; shift 2 ;;
    --image) image=${2:?--image needs a name}; shift 2 ;;
    -H | --hosts) hosts=${2:?--hosts needs H1:N,H2:N}; shift 2 ;;
    --network-interface) iface=${2:?--network-interface needs a name}; shift 2 ;;
    --ssh-port) ssh_port=${2:?--ssh-port needs a number}; shift 2 ;;
    --ssh-dir) ssh_dir=${2:?--ssh-dir needs a folder}; shift 2 ;;
    --mount) mounts+=(-v "${2:?--mount needs a folder}:$2"); shift 2 ;;
    --network) network=${2:?--network needs host, none or a network name}; shift 2 ;;
    --name) name=${2:?--name needs a name}; shift 2 ;;
    --user) user=${2:?--user needs UID:GID}; shift 2 ;;
    --gpus) gpus=${2:?--gpus needs all or none}; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
[[ "$network" != none || "$mode" == box ]] || die "--network none leaves $mode nothing to talk to: use host or a user-defined network"
[[ "$network" == host || "$network" == none || "$mode" == box || -n "$name" ]] \
  || die "$mode on the user-defined network $network needs --name (the other containers reach it by that name)"
if [[ "$gpus" == auto ]]; then
  gpus=none
  if command -v nvidia-smi >/dev/null && (($(nvidia-smi -L 2>/dev/null | wc -l) > 0)); then gpus=all; fi
fi
case "$gpus" in all | none) ;; *) die "--gpus: all or none, not $gpus" ;; esac

cmd=("${DOCKER:-docker}" run --rm --network "$network" --ipc host "${mounts[@]}")
# GPUs, and the locked memory NCCL's RDMA transports need (some hosts refuse that limit).
[[ "$gpus" == all ]] && cmd+=(--gpus all --ulimit memlock=-1)
[[ -n "$name" ]] && cmd+=(--name "$name" --hostname "$name")
while read -r var; do
  [[ "$var" == PATH || "$var" == LD_LIBRARY_PATH ]] || cmd+=(-e "$var")
done < <(forwarded_names)

case "$mode" in
  box)
    (($#)) || die "give the hvd-train command after --"
    if [[ -z "$np" ]]; then
      np=1
      [[ "$gpus" == all ]] && np=$(nvidia-smi -L | wc -l)
    fi
    # Any uid works: HOME points to a writable folder when it is not hvd's.
    [[ "${user%%:*}" == 1000 ]] || cmd+=(-e HOME=/tmp)
    if [[ "$1" == demo ]]; then # the demo starts horovodrun itself
      shift
      run_or_print "${cmd[@]}" --user "$user" "$image" demo --np "$np" "$@"
    else
      run_or_print "${cmd[@]}" --user "$user" --entrypoint hvd-train "$image" launch -np "$np" --gloo hvd-train "$@"
    fi
    ;;
  worker)
    # sshd of the image (user hvd), as the launcher's target.
    run_or_print "${cmd[@]}" -d -v "$ssh_dir:/home/hvd/.ssh:ro" --entrypoint /usr/sbin/sshd \
      "$image" -D -p "$ssh_port" -f /etc/ssh/sshd_config_hvd
    ;;
  primary)
    [[ -n "$hosts" ]] || die "primary needs --hosts H1:N,H2:N (this node first)"
    (($#)) || die "give the hvd-train command after --"
    total=0
    IFS=, read -ra entries <<<"$hosts"
    for entry in "${entries[@]}"; do
      slots=${entry##*:}
      # Checked before the arithmetic, which would evaluate any text (a name, a $(command)).
      [[ "$entry" == *:* && "$slots" =~ ^[1-9][0-9]*$ ]] || die "--hosts: '$entry' is not HOST:SLOTS (e.g. node1:4)"
      total=$((total + slots))
    done
    run=(hvd-train launch -np "${np:-$total}" --gloo -H "$hosts" -p "$ssh_port")
    [[ -n "$iface" ]] && run+=(--network-interface "$iface")
    run_or_print "${cmd[@]}" -v "$ssh_dir:/home/hvd/.ssh:ro" --entrypoint "${run[0]}" "$image" \
      "${run[@]:1}" hvd-train "$@"
    ;;
esac
