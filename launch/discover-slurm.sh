#!/usr/bin/env bash
# Host discovery for elastic training inside a SLURM allocation: prints the
# allocation's nodes that SLURM considers usable, as "host:slots".
#
# Usage (inside sbatch/salloc): launch/discover-slurm.sh
#
# Nodes come from SLURM_JOB_NODELIST; a node that `sinfo` reports down,
# drained, failing or not responding is left out, so the job goes on
# without it. Slots per node: HVD_TRAIN_SLOTS, else SLURM_NTASKS_PER_NODE,
# else SLURM_GPUS_ON_NODE, else 1.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
: "${SLURM_JOB_NODELIST:?discover-slurm.sh runs inside a SLURM allocation (SLURM_JOB_NODELIST is not set)}"
slots=${HVD_TRAIN_SLOTS:-${SLURM_NTASKS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}}
slots=${slots%%(*}  # "8(x2)" -> 8
declare -A bad=()
while read -r node state; do
  case "$state" in
    down* | drain* | fail* | *'*' | unk*) bad[$node]=1 ;;
  esac
done < <(sinfo -h -N -n "$SLURM_JOB_NODELIST" -o "%N %T" 2>/dev/null || true)
while read -r node; do
  if [[ -n "$node" && -z "${bad[$node]:-}" ]]; then
    echo "$node:$slots"
  fi
done < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
exit 0
