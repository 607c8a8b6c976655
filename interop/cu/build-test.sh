#!/usr/bin/env bash
# Builds the test binary of github.com/dropless/dropless/interop/cu, stripped, for a
# machine with a GPU, without running it: gorgonia.org/cu ends the process where no GPU
# works, so the binary only runs there, from this directory:
#
#	DROPLESS_REQUIRE_GPU=1 OUT -test.v
#
# Usage: build-test.sh [-vet] OUT
#	-vet   also go vet the module with the same cgo flags
#	OUT    where to write the binary (/dev/null: compile only)
#
# cgo needs cuda.h and libcuda.so of CUDA 12 or older. They are taken from $CUDA_HOME,
# /usr/local/cuda or /usr where cuda.h there is such; else both files are extracted,
# nothing installed, from Debian's nvidia-cuda-dev (apt-get download: apt must know the
# non-free section; as root an out-of-date package list is updated) into
# $DROPLESS_CUDA_STUBS if set (and reused from there next time), else a temporary
# directory. Exit status 3: neither was possible, or there is no C compiler, and nothing
# was built.
set -euo pipefail

vet=0
if [ "${1:-}" = -vet ]; then
  vet=1
  shift
fi
if [ $# -ne 1 ]; then
  echo "usage: $0 [-vet] OUT" >&2
  exit 2
fi
out=$1
case $out in /*) ;; *) out=$PWD/$out ;; esac
cd "$(dirname "$0")"

# cuda_version prints the CUDA_VERSION that the cuda.h $1 defines.
cuda_version() { sed -n 's/^#define CUDA_VERSION \([0-9][0-9]*\).*/\1/p' "$1" | head -n 1; }

# find_toolkit sets inc and lib from the first toolkit of CUDA ≤ 12 with a libcuda.so.
find_toolkit() {
  local dir v l
  for dir in "${CUDA_HOME:-}" /usr/local/cuda /usr; do
    [ -n "$dir" ] && [ -f "$dir/include/cuda.h" ] || continue
    v=$(cuda_version "$dir/include/cuda.h")
    [ -n "$v" ] && [ "$v" -lt 13000 ] || continue
    for l in "$dir"/lib64/stubs "$dir"/lib/stubs "$dir"/lib/*-linux-gnu/stubs "$dir"/lib/*-linux-gnu "$dir"/lib64; do
      if [ -e "$l/libcuda.so" ]; then
        inc=$dir/include lib=$l
        return 0
      fi
    done
  done
  return 1
}

# fetch_debian extracts cuda.h and the link stub libcuda.so of nvidia-cuda-dev into $1.
fetch_debian() {
  local dest=$1 tmp
  if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
    echo "build-test.sh: no apt-get or dpkg-deb: cannot take cuda.h from Debian's nvidia-cuda-dev" >&2
    return 1
  fi
  tmp=$(mktemp -d)
  echo "build-test.sh: extracting cuda.h and libcuda.so from Debian's nvidia-cuda-dev (not installed)" >&2
  if ! (cd "$tmp" && timeout 600 apt-get download nvidia-cuda-dev) >"$tmp/log" 2>&1; then
    if [ "$(id -u)" = 0 ]; then
      (timeout 300 apt-get update -qq && cd "$tmp" && timeout 600 apt-get download nvidia-cuda-dev) >"$tmp/log" 2>&1 || true
    fi
  fi
  if ! ls "$tmp"/nvidia-cuda-dev_*.deb >/dev/null 2>&1; then
    echo "build-test.sh: apt-get download nvidia-cuda-dev failed (is Debian's non-free section in apt's sources?):" >&2
    tail -n 5 "$tmp/log" >&2
    rm -rf "$tmp"
    return 1
  fi
  mkdir -p "$dest"
  if ! dpkg-deb --fsys-tarfile "$tmp"/nvidia-cuda-dev_*.deb |
    tar -x -C "$dest" --wildcards ./usr/include/cuda.h './usr/lib/*/stubs/libcuda.so'; then
    echo "build-test.sh: nvidia-cuda-dev holds no usr/include/cuda.h and stubs/libcuda.so" >&2
    rm -rf "$tmp"
    return 1
  fi
  rm -rf "$tmp"
}

cc=$(go env CC)
if ! command -v "${cc%% *}" >/dev/null; then
  echo "build-test.sh: no C compiler ($cc) for cgo" >&2
  exit 3
fi
inc='' lib=''
if ! find_toolkit; then
  stubs=${DROPLESS_CUDA_STUBS:-}
  if [ -z "$stubs" ]; then
    stubs=$(mktemp -d)
    trap 'rm -rf "$stubs"' EXIT
  fi
  if ! ls "$stubs"/usr/lib/*/stubs/libcuda.so >/dev/null 2>&1 || [ ! -f "$stubs/usr/include/cuda.h" ]; then
    fetch_debian "$stubs" || exit 3
  fi
  inc=$stubs/usr/include
  lib=$(dirname "$(ls "$stubs"/usr/lib/*/stubs/libcuda.so | head -n 1)")
fi
echo "build-test.sh: cuda.h of CUDA $(cuda_version "$inc/cuda.h") from $inc, libcuda.so from $lib" >&2

export CGO_ENABLED=1 CGO_CFLAGS="-I$inc ${CGO_CFLAGS:--O2 -g}" CGO_LDFLAGS="-L$lib ${CGO_LDFLAGS:--O2 -g}"
if [ "$vet" = 1 ]; then
  go vet .
fi
# Lazy binding: a driver entry point that gorgonia.org/cu binds but a newer driver no
# longer exports fails only if it is called, not when the binary starts.
go test -c -trimpath -ldflags='-s -w -extldflags=-Wl,-z,lazy' -o "$out" .
if [ "$out" != /dev/null ]; then
  echo "build-test.sh: wrote $out ($(wc -c <"$out") bytes)" >&2
fi
