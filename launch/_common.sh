# Helpers shared by the launch scripts (sourced, not run).
# shellcheck shell=bash

# Names of the environment variables every worker needs: AWS_* (S3
# credentials and endpoint), HOROVOD_*, NCCL_*, TF_*, HVD_TRAIN_VERBOSE, HVD_TRAIN_KERAS, KERAS_BACKEND,
# PYTHONPATH, and PATH / LD_LIBRARY_PATH so the workers find the same
# programs and libraries.
# Only names are forwarded (mpirun -x NAME): values are never printed.
forwarded_names() {
  compgen -e | grep -E '^(AWS_|HOROVOD_|NCCL_|TF_)|^(HVD_TRAIN_VERBOSE|HVD_TRAIN_KERAS|KERAS_BACKEND|PYTHONPATH|PATH|LD_LIBRARY_PATH)$' | sort
}

# Prints the command (shell-quoted) on stderr; runs it unless DRY_RUN=1.
run_or_print() {
  local quoted
  quoted=$(printf '%q ' "$@")
  printf '+ %s\n' "${quoted% }" >&2
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    return 0
  fi
  exec "$@"
}

# Prints the command like run_or_print, then runs it as a child that gets
# SIGUSR1 when this script gets SIGTERM, SIGINT or SIGUSR1, and exits with its
# status. For mpirun: it passes SIGUSR1 on to every rank at once (each rank
# checkpoints and exits with 75, which mpirun returns), while a SIGTERM reaches
# the ranks only after odls_base_sigkill_timeout seconds (default 1) and is
# followed by SIGKILL as long after: too short to save a checkpoint.
run_forwarding_stop() {
  local quoted child status
  quoted=$(printf '%q ' "$@")
  printf '+ %s\n' "${quoted% }" >&2
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    return 0
  fi
  # Its own process group (job control on): a signal to this script's group
  # (Ctrl-C, kill -- -PGID) reaches the child only as the SIGUSR1 below, not
  # also as itself; mpirun would act on its own SIGTERM/SIGINT by killing
  # the ranks 2 s later.
  set -m
  "$@" &
  child=$!
  set +m
  trap 'kill -USR1 "$child" 2>/dev/null || true' TERM INT USR1
  while :; do
    if wait "$child"; then status=0; else status=$?; fi
    kill -0 "$child" 2>/dev/null || break # a trapped signal interrupted wait; the child still runs
  done
  exit "$status"
}

# Prints the comment block at the top of the calling script (its --help).
usage() {
  sed -n '2,/^set -euo/p' "$1" | sed '$d; s/^# \{0,1\}//'
}

# Stops a multi-host Gloo launch on a host whose name does not resolve, or
# resolves to loopback: Horovod's Gloo controller binds to that name's
# address, which the other hosts cannot reach (single-host jobs are fine:
# hvd-train makes them use loopback).
check_hostname_for_hosts() {
  local name address problem=""
  name=$(hostname)
  address=$(getent hosts "$name" | awk '{print $1; exit}' || true)
  if [[ -z "$address" ]]; then
    problem="this host's name '$name' does not resolve, and Horovod's Gloo binds to it: add '<cluster address> $name' to /etc/hosts (and give --network-interface), or use --mpi"
  elif [[ "$address" == 127.* || "$address" == ::1 ]]; then
    problem="this host's name '$name' resolves to $address (loopback), which the other hosts cannot reach: map it to this host's cluster address in /etc/hosts (and give --network-interface), or use --mpi"
  fi
  [[ -z "$problem" ]] && return 0
  # A dry run shows the command all the same.
  [[ "${DRY_RUN:-0}" == 1 ]] && { printf '%s: warning: %s\n' "$(basename "$0")" "$problem" >&2; return 0; }
  die "$problem"
}

die() {
  printf '%s: %s\n' "$(basename "$0")" "$*" >&2
  exit 2
}
