#!/usr/bin/env bash
# Launch hvd-train with plain Open MPI mpirun, on one host or across the
# hosts of a hostfile.
#
# Usage: launch/mpirun.sh [options] [--] HVD_TRAIN_ARGS...
#
#   -n, --np N                 number of processes (default: 1 per slot)
#   --hostfile FILE            hosts, one "host slots=N" per line
#   -H, --hosts H1:N,H2:N      hosts inline instead of a hostfile
#   --network-interface IF     NIC for MPI, NCCL and Gloo traffic (never lo),
#                              e.g. eth0 or a CIDR such as 10.0.0.0/24 for MPI
#   --bind-to none|core|socket process binding (default: none, which lets
#                              TensorFlow's threads use every core of a rank)
#   --mpirun-arg ARG           pass ARG to mpirun (repeatable)
#   --dry-run                  print the command and exit
#   -h, --help                 this text
#
# Forwards by name (-x NAME, values never printed) the environment workers
# need: AWS_*, HOROVOD_*, NCCL_*, TF_*, HVD_TRAIN_VERBOSE, HVD_TRAIN_KERAS,
# KERAS_BACKEND, PYTHONPATH, PATH,
# LD_LIBRARY_PATH.
# HVD_TRAIN selects the program (default: hvd-train on PATH).
#
# Preemption: SIGTERM, SIGINT or SIGUSR1 to this script reaches every rank at
# once as SIGUSR1: the ranks stop after the same step, rank 0 writes a
# checkpoint, and this script exits with 75 (rerun the same command to
# continue). Plain mpirun would pass SIGTERM on only after 1 s and SIGKILL
# the ranks 1 s later.
#
# Example:
#   launch/mpirun.sh --np 16 --hostfile hosts --network-interface eth0 -- \
#       train --data s3://bucket/flowers/ --output /shared/runs/flowers
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

np="" hostfile="" hosts="" iface="" bind=none
extra=()
while (($#)); do
  case "$1" in
    -n | --np) np=${2:?--np needs a number}; shift 2 ;;
    --hostfile) hostfile=${2:?--hostfile needs a file}; shift 2 ;;
    -H | --hosts) hosts=${2:?--hosts needs H1:N,H2:N}; shift 2 ;;
    --network-interface) iface=${2:?--network-interface needs a name}; shift 2 ;;
    --bind-to) bind=${2:?--bind-to needs none, core or socket}; shift 2 ;;
    --mpirun-arg) extra+=("${2?--mpirun-arg needs an argument}"); shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
(($#)) || die "give the hvd-train command after the options, e.g. -- train --data DIR --output DIR (see --help)"
[[ -z "$hostfile" || -r "$hostfile" ]] || die "hostfile $hostfile cannot be read"
[[ -z "$hostfile" || -z "$hosts" ]] || die "give --hostfile or --hosts, not both"
[[ "$iface" != lo ]] || die "--network-interface lo: workers on other hosts cannot reach each other over loopback"
case "$bind" in none | core | socket) ;; *) die "--bind-to $bind: use none, core or socket" ;; esac

# The MPI Operator names its hostfile in OMPI_MCA_orte_default_hostfile, an
# Open MPI 4 setting that Open MPI 5 ignores (it would start every rank on
# the launcher): pass it on explicitly.
if [[ -z "$hostfile$hosts" && -n "${OMPI_MCA_orte_default_hostfile:-}" ]]; then
  hostfile=$OMPI_MCA_orte_default_hostfile
  [[ -r "$hostfile" ]] || die "OMPI_MCA_orte_default_hostfile=$hostfile cannot be read"
fi
cmd=(mpirun)
[[ -n "$np" ]] && cmd+=(-np "$np")
[[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
[[ -n "$hosts" ]] && cmd+=(-H "$hosts")
cmd+=(--bind-to "$bind" --map-by slot)
# TCP between hosts (Horovod's recommendation for Open MPI); no InfiniBand verbs probing.
cmd+=(--mca pml ob1 --mca btl ^openib)
if [[ -n "$iface" ]]; then
  cmd+=(--mca btl_tcp_if_include "$iface" --mca oob_tcp_if_include "$iface")
  if [[ "$iface" != */* ]]; then
    export NCCL_SOCKET_IFNAME="$iface" HOROVOD_GLOO_IFACE="$iface"
  fi
fi
while read -r name; do
  cmd+=(-x "$name")
done < <(forwarded_names)
cmd+=("${extra[@]}")
run_forwarding_stop "${cmd[@]}" "${HVD_TRAIN:-hvd-train}" "$@"
