#!/usr/bin/env bash
# AWS spot capacity: passes the two-minute interruption notice on as SIGUSR1.
#
# Usage: launch/aws-spot-watch.sh PID [INTERVAL]
#
# Polls the instance metadata (IMDSv2) every INTERVAL seconds (default 5)
# for spot/instance-action; when a notice appears, sends SIGUSR1 to PID (the
# launcher: launch/mpirun.sh, or horovodrun, or a single hvd-train process)
# and exits. The ranks stop after the same step, rank 0 writes a checkpoint,
# and rerunning the same command on new capacity resumes. Run one watcher on
# the host of the launcher, e.g.
#   launch/mpirun.sh --np 16 --hostfile hosts -- train ... &
#   launch/aws-spot-watch.sh $! &
#   wait
# HVD_TRAIN_IMDS overrides the metadata address (default http://169.254.169.254).
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" || -z "${1:-}" ]]; then
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  [[ -n "${1:-}" ]] && exit 0
  exit 2
fi
pid=$1 interval=${2:-5}
imds=${HVD_TRAIN_IMDS:-http://169.254.169.254}
while kill -0 "$pid" 2>/dev/null; do
  token=$(curl -fsS -m 2 -X PUT "$imds/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300" 2>/dev/null || true)
  if action=$(curl -fsS -m 2 -H "X-aws-ec2-metadata-token: $token" "$imds/latest/meta-data/spot/instance-action" 2>/dev/null); then
    echo "aws-spot-watch.sh: interruption notice ($action); sending SIGUSR1 to $pid" >&2
    kill -USR1 "$pid"
    exit 0
  fi
  sleep "$interval"
done
