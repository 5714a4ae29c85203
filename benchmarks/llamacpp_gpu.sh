#!/usr/bin/env bash
# llama.cpp's llama-bench, built with CUDA on the GPU machine, made to travel between device
# calls: a build (62% done after 4.5 minutes on the H200 machine's 16 cores, sharing them with
# other work) and the runs that need it (two GGUFs written,
# FreeToken and llama-bench on each) do not fit one 10-minute call, and a machine left idle is
# handed back with everything it built.
#   bash benchmarks/llamacpp_gpu.sh build SRC OUT_DIR
#       SRC: llama-cpp-python's sdist (.tar.gz) or a tarball of its vendor/llama.cpp
#       (bench_vs_llamacpp.py's docstring says how to make the 12 MB one). Builds a static
#       llama-bench (sm_90, no shared libraries to carry) and writes it xz-compressed to
#       OUT_DIR as parts of at most 15 MB (what one file back from the device may weigh).
#   bash benchmarks/llamacpp_gpu.sh unpack PARTS_DIR DEST
#       joins the parts into DEST/llama-bench (carry PARTS_DIR into the next call).
# Then: python benchmarks/bench_vs_llamacpp.py --llama DEST/llama-bench ...
set -euo pipefail
mode=${1:?usage: llamacpp_gpu.sh build SRC OUT_DIR | unpack PARTS_DIR DEST}
case $mode in
build)
  src=${2:?SRC}; out=${3:?OUT_DIR}
  work=$(mktemp -d)
  tar xzf "$src" -C "$work"
  top=$(find "$work" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp/*' \
    | awk '{ print length, $0 }' | sort -n | head -1 | cut -d' ' -f2)
  [ -n "$top" ] || { echo "$src: no llama.cpp source in it" >&2; exit 2; }
  dir=$(dirname "$top")
  cmake -S "$dir" -B "$work/b" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > "$work/cmake.log"
  cmake --build "$work/b" -j "$(nproc)" --target llama-bench >> "$work/cmake.log"
  mkdir -p "$out"
  xz -T0 -6 -c "$work/b/bin/llama-bench" | split -b 15M -d - "$out/llama-bench.xz.part-"
  ls -l "$out"
  ;;
unpack)
  parts=${2:?PARTS_DIR}; dest=${3:?DEST}
  mkdir -p "$dest"
  cat "$parts"/llama-bench.xz.part-* | xz -d > "$dest/llama-bench"
  chmod +x "$dest/llama-bench"
  ;;
*) echo "mode must be build or unpack" >&2; exit 2 ;;
esac
