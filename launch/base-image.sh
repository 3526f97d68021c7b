#!/usr/bin/env bash
# Makes sure the Docker engine has the base image the CPU image builds on
# (debian:trixie-slim by default): present already, pulled, or, where no
# registry is reachable (air-gapped clusters, closed CI), made here from
# Debian's packages with debootstrap and `docker import`.
#
# Usage:
#   launch/base-image.sh [--image NAME] [--mirror URL] [--no-pull] [--dry-run]
#
#   --image NAME   image to provide (default debian:trixie-slim; the tag names
#                  the Debian suite: debian:bookworm-slim makes Debian 12)
#   --mirror URL   Debian mirror for debootstrap (default $DEBIAN_MIRROR or
#                  http://deb.debian.org/debian; an internal mirror works)
#   --no-pull      do not try the registry; make the image with debootstrap
#
# Needs root (debootstrap) and the debootstrap package for the local build.
# The made image is Debian minbase with apt lists and caches removed, like
# the official slim image; docker build then uses it without pulling.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=launch/_common.sh
source "$here/_common.sh"

image=debian:trixie-slim
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
pull=1
while (($#)); do
  case "$1" in
    --image) image=${2:?--image needs a name}; shift 2 ;;
    --mirror) mirror=${2:?--mirror needs a URL}; shift 2 ;;
    --no-pull) pull=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) usage "$0"; exit 0 ;;
    *) die "unknown option $1 (see --help)" ;;
  esac
done
docker=${DOCKER:-docker}

if "$docker" image inspect "$image" >/dev/null 2>&1; then
  echo "base image $image: present"
  exit 0
fi
if ((pull)) && [[ "${DRY_RUN:-0}" != 1 ]] && timeout 60 "$docker" pull -q "$image" >/dev/null 2>&1; then
  echo "base image $image: pulled"
  exit 0
fi
command -v debootstrap >/dev/null || die "cannot pull $image and debootstrap is not installed (apt-get install debootstrap)"
[[ $(id -u) == 0 ]] || die "making $image with debootstrap needs root"

suite=${image##*:}
suite=${suite%-slim}
[[ "$suite" =~ ^[a-z]+$ ]] || die "cannot tell the Debian suite from $image: name it debian:<suite>[-slim]"
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
echo "base image $image: not pullable here; making it from $mirror with debootstrap"
run() {
  if [[ "${DRY_RUN:-0}" == 1 ]]; then
    printf '+ %s\n' "$(printf '%q ' "$@")" >&2
  else
    "$@"
  fi
}
run debootstrap --variant=minbase "$suite" "$root" "$mirror" >/dev/null
if [[ "${DRY_RUN:-0}" != 1 ]]; then
  security=${mirror%/debian}/debian-security
  printf 'deb %s %s main\ndeb %s %s-updates main\ndeb %s %s-security main\n' \
    "$mirror" "$suite" "$mirror" "$suite" "$security" "$suite" >"$root/etc/apt/sources.list"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
    "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/var/log/*.log
fi
# shellcheck disable=SC2016
run bash -c 'tar --numeric-owner -C "$1" -c . | "$2" import --change "CMD [\"bash\"]" - "$3" >/dev/null' \
  _ "$root" "$docker" "$image"
echo "base image $image: made"
