#!/usr/bin/env bash
# defines: the binaries a GPU machine runs, packed small enough to carry: stripped copies of build/src/moetrain and
# build/tests/*_tests in .gpu/bin.tar.xz (~11 MB against ~140 MB as built), which unpacks to build/ in the checkout
# there (`tar -xJf .gpu/bin.tar.xz`). .gpu/ is ignored by git, so it travels only when a run carries it.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ -x build/src/moetrain ]] || { echo "stage_gpu: expected build/src/moetrain; build first (scripts/build.sh)" >&2; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/build/src" "$stage/build/tests" .gpu
strip -o "$stage/build/src/moetrain" build/src/moetrain
for binary in build/tests/*_tests; do strip -o "$stage/$binary" "$binary"; done
XZ_OPT="-T1 --lzma2=preset=9,dict=256MiB" tar -C "$stage" -cJf .gpu/bin.tar.xz build
ls -la .gpu/bin.tar.xz
