#!/usr/bin/env bash
# Launch hvd-train with horovodrun (as `hvd-train launch`), on this host or
# across hosts over ssh.
#
# Usage: launch/horovodrun.sh [options] [--] HVD_TRAIN_ARGS...
#
#   -n, --np N                 number of processes (default: 1)
#   -H, --hosts H1:N,H2:N      hosts and their slots (default: localhost:N)
#   --hostfile FILE            hosts, one "host slots=N" per line
#   --network-interface IF     NIC(s) for Horovod and NCCL, comma separated
#                              (never lo when there are several hosts)
#   --gloo | --mpi             controller (default: Gloo, no MPI needed)
#   --ssh-port PORT            sshd port on the other hosts
#   --dry-run                  print the command and exit
#   -h, --help                 this text
#
# Elastic training (Gloo only; give `train --elastic` to hvd-train):
#   --min-np N                 keep training while at least N workers are left
#   --max-np M                 use up to M workers when more hosts appear
#   --host-discovery-script S  prints the usable hosts, one "host:slots" a
#                              line (launch/discover-hosts.sh reads a hostfile,
#                              launch/discover-slurm.sh a SLURM allocation)
#   --elastic-timeout SECONDS  how long to wait for --min-np workers (default 600)
#   --blacklist-cooldown-range LO HI
#                              a failed host may come back after LO..HI seconds
#                              (default: never)
#
# Preemption: SIGTERM, SIGINT or SIGUSR1 to horovodrun (or to the whole
# process group) reaches every rank: the ranks stop after the same step,
# rank 0 writes a checkpoint, each rank prints one line, and this script
# exits with 75 (rerun the same command to continue). Plain horovodrun
# ends such a stop with a Python traceback of its own
# ("RuntimeError: Horovod detected that one or more processes exited with
# non-zero status ... Exit code: 75"), which `hvd-train launch` does not.
#
# horovodrun passes the whole environment (AWS_*, HOROVOD_*, NCCL_*, TF_*,
# PYTHONPATH, ...) to every worker itself; hosts other than this one must
# accept ssh without a password. HVD_TRAIN selects the program
# (default: hvd-train on PATH).
#
# Examples:
#   launch/horovodrun.sh --np 4 -- train --data /data/flowers --output runs/flowers
#   launch/horovodrun.sh --np 16 -H gpu1:8,gpu2:8 --network-interface eth0 -- \
#       train --data s3://bucket/flowers/ --output /shared/runs/flowers
#   launch/horovodrun.sh --np 16 --min-np 8 --max-np 32 --network-interface eth0 \
#       --host-discovery-script "launch/discover-hosts.sh /shared/hosts" -- \
#       train --elastic --data s3://bucket/flowers/ --output /shared/runs/flowers
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

np=1 hosts="" hostfile="" iface="" controller=--gloo ssh_port=""
elastic=()
while (($#)); do
  case "$1" in
    --min-np | --max-np | --host-discovery-script | --elastic-timeout)
      elastic+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
    --blacklist-cooldown-range)
      elastic+=("$1" "${2:?$1 needs LO HI}" "${3:?$1 needs LO HI}"); shift 3 ;;
    -n | --np) np=${2:?--np needs a number}; shift 2 ;;
    -H | --hosts) hosts=${2:?--hosts needs H1:N,H2:N}; shift 2 ;;
    --hostfile) hostfile=${2:?--hostfile needs a file}; shift 2 ;;
    --network-interface) iface=${2:?--network-interface needs a name}; shift 2 ;;
    --gloo | --mpi) controller=$1; shift ;;
    --ssh-port) ssh_port=${2:?--ssh-port needs a number}; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage "$0"; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
(($#)) || die "give the hvd-train command after the options, e.g. -- train --data DIR --output DIR (see --help)"
[[ -z "$hostfile" || -r "$hostfile" ]] || die "hostfile $hostfile cannot be read"
[[ -z "$hostfile" || -z "$hosts" ]] || die "give --hostfile or --hosts, not both"
if [[ ",$iface," == *,lo,* && ( -n "$hostfile" || "$hosts" == *,* ) ]]; then
  die "--network-interface lo: workers on other hosts cannot reach each other over loopback"
fi

if ((${#elastic[@]})); then
  [[ "$controller" == --gloo ]] || die "elastic training needs the Gloo controller; drop --mpi"
  [[ " ${elastic[*]} " == *" --host-discovery-script "* ]] || die "elastic training needs --host-discovery-script"
  [[ -z "$hosts$hostfile" ]] || die "elastic training takes its hosts from --host-discovery-script, not --hosts/--hostfile"
  [[ " $* " == *" --elastic "* ]] || die "give hvd-train --elastic too (e.g. -- train --elastic ...) when launching elastically"
fi

if [[ "$controller" == --gloo && ( -n "$hostfile" || "$hosts" == *,* ) ]]; then
  check_hostname_for_hosts
fi
# hvd-train launch is horovodrun with its arguments, ending a stop with the ranks' 75 (not a traceback).
cmd=(hvd-train launch -np "$np" "$controller" "${elastic[@]}")
[[ -n "$hosts" ]] && cmd+=(-H "$hosts")
[[ -n "$hostfile" ]] && cmd+=(--hostfile "$hostfile")
[[ -n "$iface" ]] && cmd+=(--network-interface "$iface")
[[ -n "$ssh_port" ]] && cmd+=(-p "$ssh_port")
run_or_print "${cmd[@]}" "${HVD_TRAIN:-hvd-train}" "$@"
