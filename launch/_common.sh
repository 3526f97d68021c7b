# Helpers shared by the launch scripts (sourced, not run).
# shellcheck shell=bash

# Names of the environment variables every worker needs: AWS_* (S3
# credentials and endpoint), HOROVOD_*, NCCL_*, TF_*, PYTHONPATH, and PATH /
# LD_LIBRARY_PATH so the workers find the same programs and libraries.
# Only names are forwarded (mpirun -x NAME): values are never printed.
forwarded_names() {
  compgen -e | grep -E '^(AWS_|HOROVOD_|NCCL_|TF_)|^(PYTHONPATH|PATH|LD_LIBRARY_PATH)$' | sort
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

# Prints the comment block at the top of the calling script (its --help).
usage() {
  sed -n '2,/^set -euo/p' "$1" | sed '$d; s/^# \{0,1\}//'
}

die() {
  printf '%s: %s\n' "$(basename "$0")" "$*" >&2
  exit 2
}
