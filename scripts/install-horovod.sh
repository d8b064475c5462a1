#!/usr/bin/env bash
# Build and install Horovod 0.28.1 (PyTorch + gloo, CPU; no MPI, TensorFlow or MXNet) into the
# environment of PYTHON (default .venv/bin/python), for `--dp.strategy horovod` and the Horovod
# anchor of `foldtrain bench dp`.
#
# Usage: bash scripts/install-horovod.sh [PYTHON]
#
# Horovod 0.28.1 is the last release and ships only as a source distribution; it does not build
# against torch 2.x and CMake 4 as published, so this script edits the unpacked sources first:
#   * CMAKE_CXX_STANDARD 14 -> 17 in CMakeLists.txt and horovod/torch/CMakeLists.txt
#     (torch 2.x headers refuse C++14);
#   * cmake_minimum_required(VERSION 2.8.12 ...) -> 3.5 in third_party/gloo/CMakeLists.txt
#     (CMake 4 refuses a minimum below 3.5).
# It then builds with pip (--no-build-isolation: Horovod's setup.py must see the installed torch;
# CMAKE_POLICY_VERSION_MINIMUM=3.5 also lets CMake 4 accept any other old minimum).
# About 2-3 minutes on 2 cores (MAKEFLAGS=-j2; set MAKEFLAGS to change). Idempotent: does nothing
# when `import horovod.torch` already works.
#
# Prerequisites: a C++ compiler and make, the Python headers (Python.h), CMake >= 3.13.
#   * CMake: when none (or an older one) is on PATH, cmake is installed from PyPI into PYTHON's
#     environment.
#   * compiler, make, Python headers: when missing and this runs as root with apt-get (Debian,
#     Ubuntu; CI), they are installed with apt-get (g++, make, python3-dev); otherwise the script
#     stops with one line saying what to install.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.28.1
PY="${1:-.venv/bin/python}"
die() { echo "install-horovod: error: $*" >&2; exit 1; }

command -v "$PY" >/dev/null 2>&1 || die "no Python at '$PY'; run scripts/install.sh first or pass the interpreter: bash scripts/install-horovod.sh /path/to/python"
PY="$(command -v "$PY")"
if "$PY" -c "import horovod.torch" >/dev/null 2>&1; then
  echo "install-horovod: Horovod $("$PY" -c 'import horovod; print(horovod.__version__)') is already installed for $PY; nothing to do"
  exit 0
fi
"$PY" -c "import torch" >/dev/null 2>&1 || die "torch is not importable by $PY; install foldtrain first (scripts/install.sh)"

can_apt() { [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then apt-get update -qq >/dev/null; apt_updated=1; fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# --- C++ compiler and make
if ! command -v c++ >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
  if can_apt; then
    echo "install-horovod: installing g++ and make with apt-get"
    apt_install g++ make
  fi
  command -v c++ >/dev/null 2>&1 || die "no C++ compiler (c++) on PATH; install one, e.g. apt-get install g++"
  command -v make >/dev/null 2>&1 || die "no make on PATH; install it, e.g. apt-get install make"
fi

# --- Python headers
has_headers() { "$PY" -c "import os, sysconfig; raise SystemExit(not os.path.isfile(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; }
if ! has_headers; then
  inc="$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")"
  if can_apt && [ "${inc#/usr/include/}" != "$inc" ]; then  # Debian's own Python: its headers are a package
    echo "install-horovod: installing the Python headers with apt-get (python3-dev)"
    apt_install python3-dev
  fi
  has_headers || die "no Python headers ($inc/Python.h) for $PY; install them, e.g. apt-get install python3-dev"
fi

# --- CMake >= 3.13 (PyPI's cmake when the system has none)
bindir="$(dirname "$PY")"
export PATH="$bindir:$PATH"  # a venv's cmake (and later horovodrun) live next to its python
cmake_ok() {
  command -v cmake >/dev/null 2>&1 || return 1
  local v; v="$(cmake --version 2>/dev/null | head -n1 | grep -oE '[0-9]+\.[0-9]+' | head -n1)"
  [ -n "$v" ] || return 1
  local major="${v%%.*}" minor="${v#*.}"
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 13 ]; }
}
if ! cmake_ok; then
  echo "install-horovod: installing cmake from PyPI into $PY's environment"
  "$PY" -m pip install -q cmake || die "could not install cmake from PyPI; install CMake >= 3.13 (apt-get install cmake)"
  cmake_ok || die "no CMake >= 3.13 on PATH after installing it from PyPI; install CMake >= 3.13 (apt-get install cmake)"
fi
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip; create the environment with pip (python -m venv)"
"$PY" -c "import setuptools" >/dev/null 2>&1 || "$PY" -m pip install -q setuptools

# --- fetch, edit, build
work="$(mktemp -d "${TMPDIR:-/tmp}/horovod-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
echo "install-horovod: downloading the Horovod $VERSION source distribution from PyPI"
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation "horovod==$VERSION" -d "$work" \
  || die "could not download horovod==$VERSION from PyPI"
tar -xzf "$work/horovod-$VERSION.tar.gz" -C "$work"
src="$work/horovod-$VERSION"

edit() {  # edit FILE SED-EXPRESSION EXPECTED-LINE: apply, then check the expected line is there
  sed -i -E "$2" "$src/$1"
  grep -qF "$3" "$src/$1" || die "could not patch $1 (expected '$3' after the edit); are these Horovod $VERSION's sources?"
}
edit CMakeLists.txt 's/^set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 17)/' 'set(CMAKE_CXX_STANDARD 17)'
edit horovod/torch/CMakeLists.txt 's/set\(CMAKE_CXX_STANDARD 14\)/set(CMAKE_CXX_STANDARD 17)/' 'set(CMAKE_CXX_STANDARD 17)'
edit third_party/gloo/CMakeLists.txt 's/^cmake_minimum_required\(VERSION 2\.8\.12/cmake_minimum_required(VERSION 3.5/' 'cmake_minimum_required(VERSION 3.5'

echo "install-horovod: building Horovod $VERSION (PyTorch + gloo, CPU) with $(cmake --version | head -n1); this takes a few minutes"
start=$(date +%s)
HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="${MAKEFLAGS:--j2}" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
  "$PY" -m pip install --no-build-isolation --no-cache-dir "$src" >"$work/build.log" 2>&1 || {
    grep -E "error|Error" "$work/build.log" | tail -n 5 >&2 || true
    cp "$work/build.log" "${TMPDIR:-/tmp}/horovod-build.log"
    die "building Horovod failed; the full log is in ${TMPDIR:-/tmp}/horovod-build.log"
  }
"$PY" -c "import horovod.torch as hvd; assert hvd.gloo_built(), 'built without gloo'" \
  || die "Horovod installed but 'import horovod.torch' fails (see above)"
echo "install-horovod: Horovod $VERSION installed for $PY in $(( $(date +%s) - start )) s (horovodrun: $bindir/horovodrun)"
