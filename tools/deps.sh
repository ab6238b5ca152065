#!/usr/bin/env bash
# Called by `make`: report every dependency and where it was found. A missing Debian package is installed
# with apt-get when running as root; otherwise this prints the one command to run and fails the build.
set -u
NVCC=${NVCC:-nvcc}
utf8proc_lib() {  # the static libutf8proc.a (linked statically so the binary carries it)
  if [ -n "${UTF8PROC_LIB:-}" ]; then echo "$UTF8PROC_LIB"; return; fi
  for f in /usr/lib/x86_64-linux-gnu/libutf8proc.a /usr/lib/aarch64-linux-gnu/libutf8proc.a \
           /usr/local/lib/libutf8proc.a /usr/lib/libutf8proc.a; do [ -e "$f" ] && { echo "$f"; return; }; done
}
if [ "${1:-}" = --utf8proc-lib ]; then utf8proc_lib; exit 0; fi
nvcc_path=$(command -v "$NVCC" || true)
if [ -z "$nvcc_path" ]; then
  echo "deps: nvcc not found. Install the CUDA toolkit (https://developer.nvidia.com/cuda-downloads)" \
       "and put its bin/ on PATH, or run: make NVCC=/path/to/nvcc" >&2
  exit 1
fi
nvcc_version=$("$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
# Where nvcc itself looks for headers and libraries: its dry run prints them. This holds when `nvcc` on PATH
# is a wrapper script or a symlink rather than the toolkit's own bin/nvcc.
dryrun=$("$NVCC" -dryrun -x cu -c /dev/null -o /dev/null 2>&1)
nvcc_dirs() {  # nvcc_dirs INCLUDES|LIBRARIES -> the folders of that dry-run line's -I/-L options
  echo "$dryrun" | sed -n "s/^#\$ $1=//p" | grep -o -- "-[IL]\"\?[^\" ]*" | sed 's/^-[IL]"\?//' |
    xargs -r readlink -f
}
cuda_home=$(dirname "$(dirname "$(readlink -f "$nvcc_path")")")
dirs=($(nvcc_dirs INCLUDES) "$cuda_home/include" /usr/include /usr/local/include)
for inc in ${EXTRA_INCLUDES:-}; do dirs+=("${inc#-I}"); done
libdirs=($(nvcc_dirs LIBRARIES) "$cuda_home/lib64" "$cuda_home/lib" /usr/lib/x86_64-linux-gnu
         /usr/lib/aarch64-linux-gnu /usr/local/lib /usr/lib)

find_in() {  # find_in FILE DIR... -> first DIR/FILE that exists
  local f=$1; shift
  for d in "$@"; do [ -e "$d/$f" ] && { echo "$d/$f"; return; }; done
}
missing_pkgs=()
report() {  # report NAME FOUND_PATH DEBIAN_PACKAGE HINT
  if [ -n "$2" ]; then printf '  %-14s %s\n' "$1" "$2"
  else
    printf '  %-14s MISSING (%s)\n' "$1" "$4"
    [ -n "$3" ] && missing_pkgs+=("$3")
  fi
}
echo "nanovllm build: nvcc $nvcc_version ($nvcc_path), GPU architecture: ${CUDA_ARCH_NAME:-?}"
report cuBLASLt "$(find_in libcublasLt.so "${libdirs[@]}")" "" "part of the CUDA toolkit"
report NCCL "$(find_in nccl.h "${dirs[@]}")" "" "libnccl-dev from NVIDIA's CUDA apt repository"
report xxhash.h "$(find_in xxhash.h "${dirs[@]}")" libxxhash-dev "apt-get install libxxhash-dev"
report nlohmann/json "$(find_in nlohmann/json.hpp "${dirs[@]}")" nlohmann-json3-dev "apt-get install nlohmann-json3-dev"
lib=$(utf8proc_lib)
report utf8proc "$( [ -n "$lib" ] && find_in utf8proc.h "${dirs[@]}" >/dev/null && echo "$lib (static)")" \
       libutf8proc-dev "apt-get install libutf8proc-dev"
[ -n "$(find_in nccl.h "${dirs[@]}")" ] || { echo "deps: NCCL headers are required (libnccl-dev)." >&2; exit 1; }
if [ ${#missing_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "deps: installing ${missing_pkgs[*]} with apt-get"
    (apt-get install -y -q "${missing_pkgs[@]}" || { apt-get update -q && apt-get install -y -q "${missing_pkgs[@]}"; }) \
      >/dev/null || { echo "deps: apt-get install ${missing_pkgs[*]} failed" >&2; exit 1; }
    echo "deps: installed ${missing_pkgs[*]}"
    exit 0
  fi
  echo "deps: missing packages. Run:  sudo apt-get install ${missing_pkgs[*]}" >&2
  exit 1
fi
