#!/usr/bin/env bash
# defines: the one place that installs what moetrain needs to build and test; safe to run twice.
# Versions are pinned to what Debian 12 (bookworm) ships. NVIDIA's header libraries (CUTLASS, the
# cuDNN frontend) come from PyPI into .deps/pypi; binaries built here carry them to the GPU machine.
set -euo pipefail

APT_PACKAGES=(
  cmake ninja-build g++
  nlohmann-json3-dev=3.11.2-2
  libtomlplusplus-dev=3.3.0+ds-1
  libcli11-dev=2.1.2+ds-1
  libfmt-dev=9.1.0+ds1-2
  libgtest-dev=1.12.1-0.2
  libbenchmark-dev=1.7.1-1
  # clang with its sanitizer and libFuzzer runtimes and OpenMP: the fuzz corpus replay under ASan + UBSan that
  # scripts/test.sh runs, and scripts/fuzz.sh (--no-install-recommends leaves the runtimes out unless named).
  clang=1:14.0-55.7~deb12u1
  libclang-rt-14-dev=1:14.0.6-12
  libomp-14-dev=1:14.0.6-12
)

missing=()
for spec in "${APT_PACKAGES[@]}"; do
  name="${spec%%=*}"
  want="${spec#*=}"
  have="$(dpkg-query -W -f='${Status} ${Version}' "$name" 2>/dev/null || true)"
  if [[ "$have" != "install ok installed"* ]]; then
    missing+=("$spec")
  elif [[ "$spec" == *=* && "$have" != *" $want" ]]; then
    missing+=("$spec")
  fi
done

if ((${#missing[@]})); then
  SUDO=""
  if [[ "$(id -u)" != 0 ]]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all build dependencies present"
fi

PYPI_PACKAGES=(nvidia-cutlass==4.2.0.0 nvidia-cudnn-frontend==1.32.0)
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STAMP="$ROOT/.deps/pypi/.installed"
if [[ "$(cat "$STAMP" 2>/dev/null)" != "${PYPI_PACKAGES[*]}" ]]; then
  echo "setup: installing ${PYPI_PACKAGES[*]} into .deps/pypi"
  rm -rf "$ROOT/.deps/pypi"
  python3 -m pip install -q --disable-pip-version-check --no-deps --target "$ROOT/.deps/pypi" "${PYPI_PACKAGES[@]}"
  echo "${PYPI_PACKAGES[*]}" >"$STAMP"
else
  echo "setup: header libraries present in .deps/pypi"
fi
