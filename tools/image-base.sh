#!/usr/bin/env bash
# A local base image for building bubbles' images without a registry: Debian bookworm (minbase) with Python 3.11,
# from Debian's own packages (debootstrap), committed with buildah. Prints the image's name on success.
#   tools/image-base.sh            # installs buildah and debootstrap with apt-get when missing (as root)
# The test tier that builds the operator image uses it (make test sets BUBBLES_IMAGE_BASE); without it that
# test is skipped and says why. Cached: buildah's storage keeps the image; a second call prints its name at once.
set -euo pipefail
name="localhost/bubbles-base:bookworm-python3.11"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
say() { echo "image-base: $*" >&2; }
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "buildah and debootstrap are missing and cannot be installed here (needs root and apt-get)"; exit 1
  fi
  say "installing buildah and debootstrap (Debian packages)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null
fi
if buildah inspect --type image "$name" >/dev/null 2>&1; then
  echo "$name"; exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
say "debootstrap bookworm with python3 (about a minute)"
debootstrap --variant=minbase --include=python3,python3-venv bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 \
  || { tail -5 "$work/debootstrap.log" >&2; say "debootstrap failed"; exit 1; }
c="$(buildah from scratch)"
m="$(buildah mount "$c")"
cp -a "$work/rootfs/." "$m/"
buildah umount "$c" >/dev/null
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
buildah commit -q "$c" "$name" >/dev/null
buildah rm "$c" >/dev/null
echo "$name"
