#!/usr/bin/env bash
# Local base images for building bubbles' images without a registry, from Debian's own packages (debootstrap) and
# the project's pinned wheels, committed with buildah. Prints the image's name on success.
#   tools/image-base.sh            # Debian bookworm (minbase) with Python 3.11: the operator's and agent's base
#   tools/image-base.sh --torch    # that, plus a virtual environment on PATH with torch (CPU) and DeepSpeed at the
#                                  # versions in constraints.txt: the stand-in for "your framework's image" that
#                                  # the fill-job image and a training image start from (the `cluster` test tier)
# Installs buildah and debootstrap with apt-get when missing (as root). The image tier (make test sets
# BUBBLES_IMAGE_BASE) and the cluster tier use these; without them those tests are skipped and say why.
# Cached: buildah's storage keeps the images; a second call prints the name at once.
set -euo pipefail
cd "$(dirname "$0")/.."
# -r2: with libgomp1, the OpenMP runtime DeepSpeed's prebuilt CPU ops link against.
name="localhost/bubbles-base:bookworm-python3.11-r2"
export STORAGE_DRIVER="${STORAGE_DRIVER:-vfs}"
say() { echo "image-base: $*" >&2; }
torch=0
case ${1:-} in
  --torch) torch=1 ;;
  "") ;;
  *) echo "usage: $0 [--torch]" >&2; exit 2 ;;
esac
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    say "buildah and debootstrap are missing and cannot be installed here (needs root and apt-get)"; exit 1
  fi
  say "installing buildah and debootstrap (Debian packages)"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah debootstrap >/dev/null
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
if ! buildah inspect --type image "$name" >/dev/null 2>&1; then
  say "debootstrap bookworm with python3 (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,libgomp1 bookworm "$work/rootfs" >"$work/debootstrap.log" 2>&1 \
    || { tail -5 "$work/debootstrap.log" >&2; say "debootstrap failed"; exit 1; }
  c="$(buildah from scratch)"
  m="$(buildah mount "$c")"
  cp -a "$work/rootfs/." "$m/"
  buildah umount "$c" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
  buildah commit -q "$c" "$name" >/dev/null
  buildah rm "$c" >/dev/null
  rm -rf "$work/rootfs"
fi
if ((torch == 0)); then
  echo "$name"; exit 0
fi

pin() { sed -n "s/^$1==//p" constraints.txt; }
torch_v=$(pin torch) ds_v=$(pin deepspeed)
[[ -n $torch_v && -n $ds_v ]] || { say "constraints.txt pins no torch or deepspeed"; exit 1; }
framework="${name}-torch${torch_v}-deepspeed${ds_v}"
if buildah inspect --type image "$framework" >/dev/null 2>&1; then
  echo "$framework"; exit 0
fi
# The wheels, made here (the image cannot verify the package index's TLS; air-gapped builds do the same). DeepSpeed
# ships only a source archive whose build imports torch: it is built here against the pinned torch, with its
# shared-memory CPU communication op compiled in (DeepSpeed's "pre-install ops"): on CPU, DeepSpeed otherwise
# compiles that op with a C++ compiler when the training starts, and a framework image has none.
python=${PYTHON:-.venv/bin/python}
[[ -x $python ]] || python=python3
say "wheels for torch ${torch_v} (CPU) and DeepSpeed ${ds_v} (builds DeepSpeed's CPU op: about 2 minutes)"
mkdir -p "$work/wheels"
"$python" -m pip download --quiet --no-deps -d "$work/src" "deepspeed==${ds_v}" 2>>"$work/pip.log"
DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=1 DS_ACCELERATOR=cpu "$python" -m pip wheel --quiet --no-cache-dir --no-deps \
  --no-build-isolation -w "$work/wheels" "$work"/src/deepspeed-* >>"$work/pip.log" 2>&1 \
  || { tail -20 "$work/pip.log" >&2; say "building DeepSpeed's wheel failed"; exit 1; }
"$python" -m pip download --quiet -c constraints.txt -d "$work/wheels" "torch==${torch_v}" "$work"/wheels/deepspeed-*.whl 2>>"$work/pip.log"
cp constraints.txt "$work/wheels/"
say "installing them into /opt/venv of a new image (a few minutes)"
c="$(buildah from "$name")"
buildah copy -q "$c" "$work/wheels" /wheels >/dev/null
buildah run --isolation chroot "$c" -- sh -c \
  "python3 -m venv /opt/venv && /opt/venv/bin/pip install --quiet --no-index --find-links /wheels \
   -c /wheels/constraints.txt torch==${torch_v} deepspeed==${ds_v} && rm -rf /wheels /root/.cache \
   && /opt/venv/bin/python -c 'from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder as B; B().load()' \
      >/dev/null 2>&1" || { say "the image's DeepSpeed cannot load its prebuilt CPU op"; buildah rm "$c" >/dev/null; exit 1; }
buildah config --env PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env OMP_NUM_THREADS=1 "$c"
buildah commit -q "$c" "$framework" >/dev/null
buildah rm "$c" >/dev/null
echo "$framework"
