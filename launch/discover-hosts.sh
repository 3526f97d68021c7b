#!/usr/bin/env bash
# Host discovery for elastic training (horovodrun --host-discovery-script):
# prints the hosts of a hostfile as "host:slots", one a line.
#
# Usage: launch/discover-hosts.sh [HOSTFILE]    (default: $HVD_TRAIN_HOSTFILE)
#
# HOSTFILE lines are "host slots=N", "host:N" or "host" (slots: $HVD_TRAIN_SLOTS,
# default 1); blank lines and # comments are skipped. The file is read at
# every call (horovodrun calls once a second): add a line to grow the job,
# remove one to take a host out. An unreadable file prints nothing and exits
# 1, which horovodrun reports.
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
file=${1:-${HVD_TRAIN_HOSTFILE:-}}
[[ -n "$file" ]] || { echo "discover-hosts.sh: give a hostfile (or set HVD_TRAIN_HOSTFILE)" >&2; exit 2; }
[[ -r "$file" ]] || { echo "discover-hosts.sh: cannot read $file" >&2; exit 1; }
default=${HVD_TRAIN_SLOTS:-1}
while read -r host rest || [[ -n "$host" ]]; do
  if [[ -z "$host" || "$host" == \#* ]]; then
    continue
  fi
  slots=$default
  if [[ "$host" == *:* ]]; then
    slots=${host##*:}
    host=${host%:*}
  elif [[ "$rest" =~ slots=([0-9]+) ]]; then
    slots=${BASH_REMATCH[1]}
  fi
  echo "$host:$slots"
done <"$file"
exit 0
