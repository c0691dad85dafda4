#!/usr/bin/env bash
# Build deploy/Dockerfile without Docker Hub or a Docker engine, and check the image runs:
#
#   1. a Debian 12 base made with debootstrap (from the Debian mirror) and imported into buildah;
#   2. `buildah bud --isolation chroot` of deploy/Dockerfile on that base, torch and the rest from
#      PIP_INDEX, plus a local wheel directory mounted into the build when there is one;
#   3. `folio --help`, `folio serve --help`, an import of the engine and a greedy generation on a
#      tiny random checkpoint, run inside the image as its own user.
#
# Usage (as root, from anywhere): deploy/build_image.sh
# Settings (environment): FOLIO_IMAGE_WORK (default /var/tmp/folio-image: the base's root
# filesystem, outside the checkout), DEBIAN_MIRROR, PIP_INDEX, TORCH_INDEX (empty: torch from
# PIP_INDEX), FOLIO_WHEELS (a directory of wheels, default /opt/wheels where it exists),
# FOLIO_IMAGE (the tag, default localhost/folio:0.1.0-cpu), PIP_CERT (a CA bundle for pip,
# mounted into the build: pip's own setting, so a host configured for a proxy passes it on). It installs buildah and debootstrap
# with apt-get when they are missing. It writes nothing in the checkout.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${FOLIO_IMAGE_WORK:-/var/tmp/folio-image}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PIP_INDEX=${PIP_INDEX:-https://pypi.org/simple}
TORCH_INDEX=${TORCH_INDEX-}
WHEELS=${FOLIO_WHEELS:-/opt/wheels}
IMAGE=${FOLIO_IMAGE:-localhost/folio:0.1.0-cpu}
BASE=localhost/folio-base:bookworm
export STORAGE_DRIVER=${STORAGE_DRIVER:-vfs}   # no overlay mounts needed

step() { printf '\n== %s (%s)\n' "$*" "$(date -u +%H:%M:%S)"; }

if [ "$(id -u)" != 0 ]; then echo "build_image.sh: run it as root (debootstrap, buildah)" >&2; exit 2; fi
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    step "installing buildah and debootstrap"
    apt-get update -q && apt-get install -y -q buildah debootstrap
fi
buildah --version
mkdir -p "$WORK"

if [ ! -x "$WORK/rootfs/usr/bin/apt-get" ]; then
    step "debootstrap bookworm (minbase) into $WORK/rootfs"
    rm -rf "$WORK/rootfs"
    debootstrap --variant=minbase bookworm "$WORK/rootfs" "$MIRROR"
fi
if ! buildah inspect --type image "$BASE" >/dev/null 2>&1; then
    step "importing the base as $BASE"
    ctr=$(buildah from scratch)
    mnt=$(buildah mount "$ctr")
    tar -C "$WORK/rootfs" --exclude=./proc/* --exclude=./sys/* --exclude=./dev/* -cf - . | tar -C "$mnt" -xf -
    buildah umount "$ctr"
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd /bin/bash "$ctr"
    buildah commit --rm "$ctr" "$BASE"
fi

args=(--isolation chroot -f "$ROOT/deploy/Dockerfile" -t "$IMAGE"
      --build-arg "BASE=$BASE" --build-arg "PIP_INDEX=$PIP_INDEX" --build-arg "TORCH_INDEX=$TORCH_INDEX")
if [ -d "$WHEELS" ]; then
    args+=(-v "$WHEELS:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
fi
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then   # a TLS-intercepting proxy's CA bundle
    args+=(-v "$PIP_CERT:/etc/folio-build-ca.crt:ro" --build-arg PIP_CERT=/etc/folio-build-ca.crt)
fi
step "buildah bud ${args[*]} $ROOT"
start=$(date +%s)
buildah bud "${args[@]}" "$ROOT"
echo "build took $(( $(date +%s) - start )) s"

step "running the image"
ctr=$(buildah from "$IMAGE")
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
buildah run --isolation chroot "$ctr" -- id
buildah run --isolation chroot "$ctr" -- folio --help
buildah run --isolation chroot "$ctr" -- folio serve --help | head -5
buildah run --isolation chroot "$ctr" -- python -c \
    "import sys, torch, folio.worker.engine, folio.v1.generate_pb2; print('python', sys.version.split()[0], 'torch', torch.__version__)"
# the engine itself, as the image's user: a tiny random checkpoint made and run greedy
buildah run --isolation chroot "$ctr" -- sh -c \
    'folio make-tiny-model /tmp/tiny > /dev/null 2>&1 && folio generate --model /tmp/tiny --max-tokens 8 --ignore-eos --json "def hello(world):" 2>/dev/null'
buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' "$IMAGE"
echo "build_image.sh: OK"
