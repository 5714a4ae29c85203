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
#   bash benchmarks/llamacpp_gpu.sh build-here SRC CUBLAS_DIR OUT_DIR
#       the same llama-bench built on a machine without a GPU, which has CUDA's nvcc but
#       neither cuBLAS nor the driver: no device time spent on the build (2 cores: about 25
#       minutes; the toolkit in CUDA_HOME, default /usr/local/cuda). CUBLAS_DIR holds
#       cuBLAS's include/ and lib/ (the `nvidia-cublas` wheel of the toolkit's major
#       version, unpacked: nvidia/cu13). The driver symbols ggml links
#       against come from a stub libcuda.so.1 made here (the toolkit's lib64/stubs has one
#       where installed in full); the GPU machine's driver is what loads at run time. The CPU
#       code is built for the GPU host's ISA, named (LLAMA_CPU_FLAGS, default the Xeon's
#       AVX-512 with VNNI, VBMI and BF16, AVX-VNNI and AMX), not for the building machine's
#       (GGML_NATIVE): built native on an AMD Zen 5, llama-bench lacked the AMX kernels and
#       its -ncmoe prefill ran at 267 tok/s where another build ran 2,249 on the same host.
#       Its parts are about 40 MB: with a 21 MB tree
#       they fit what may travel to the GPU machine (64 MiB) when nothing else big is carried.
#   bash benchmarks/llamacpp_gpu.sh unpack PARTS_DIR DEST
#       joins the parts into DEST/llama-bench (carry PARTS_DIR into the next call). There,
#       LD_LIBRARY_PATH must reach cuBLAS and the CUDA runtime (torch's nvidia/*/lib folders).
# Then: python benchmarks/bench_vs_llamacpp.py --llama DEST/llama-bench ...
set -euo pipefail
mode=${1:?usage: llamacpp_gpu.sh build SRC OUT_DIR | build-here SRC CUBLAS_DIR OUT_DIR | unpack PARTS_DIR DEST}

# the GPU host's CPU (Emerald Rapids) for ggml's CPU code, whatever machine builds it
XEON=${LLAMA_CPU_FLAGS:--DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON \
-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=ON -DGGML_AMX_INT8=ON -DGGML_AMX_BF16=ON}

source_dir() {  # llama.cpp's top directory inside the unpacked tarball $1
  local top
  top=$(find "$1" -maxdepth 4 -name CMakeLists.txt -path '*llama.cpp/*' \
    | awk '{ print length, $0 }' | sort -n | head -1 | cut -d' ' -f2)
  [ -n "$top" ] || { echo "$src: no llama.cpp source in it" >&2; exit 2; }
  dirname "$top"
}

stub_driver() {  # $1: libcuda.so to write, exporting the symbols named in the rest
  local lib=$1 c=$1.c
  echo 'void freetoken_stub(void) {}' > "$c"
  shift
  for s in "$@"; do echo "int $s(void) { return 0; }" >> "$c"; done
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$lib" "$c"
}

pack() {  # $1: the built binary, $2: OUT_DIR
  mkdir -p "$2"
  strip -o "$1.stripped" "$1"
  xz -T0 -6 -c "$1.stripped" | split -b 15M -d - "$2/llama-bench.xz.part-"
  ls -l "$2"
}

case $mode in
build-here)
  src=${2:?SRC}; cublas=${3:?CUBLAS_DIR}; out=${4:?OUT_DIR}
  cuda=${CUDA_HOME:-/usr/local/cuda}  # the toolkit: CUDA_HOME, else its usual place
  [ -x "$cuda/bin/nvcc" ] || { echo "build-here needs CUDA's nvcc: $cuda/bin/nvcc missing " \
    "(set CUDA_HOME)" >&2; exit 2; }
  [ -f "$cublas/include/cublas_v2.h" ] || { echo "$cublas: no include/cublas_v2.h" >&2; exit 2; }
  cuda=$(readlink -f "$cuda")
  work=$(mktemp -d)
  tar xzf "$src" -C "$work"
  dir=$(source_dir "$work")
  tk=$work/cuda  # the toolkit seen through links, with cuBLAS and the driver stub added
  mkdir -p "$tk/include" "$tk/lib64/stubs"
  for f in "$cuda"/*; do
    case $(basename "$f") in include|lib|lib64) ;; *) ln -s "$f" "$tk/" ;; esac
  done
  ln -s "$cuda"/include/* "$tk/include/"
  ln -s "$(readlink -f "$cuda/lib64")"/* "$tk/lib64/"
  ln -sf "$cublas"/include/* "$tk/include/"
  for f in "$cublas"/lib/lib*.so.*; do
    ln -sf "$f" "$tk/lib64/"; ln -sf "$f" "$tk/lib64/$(basename "$f" | sed 's/\.so\..*/.so/')"
  done
  stub_driver "$tk/lib64/stubs/libcuda.so"
  PATH=$tk/bin:$PATH cmake -S "$dir" -B "$work/b" -DCUDAToolkit_ROOT="$tk" \
    -DCMAKE_CUDA_COMPILER="$tk/bin/nvcc" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF $XEON > "$work/cmake.log"
  build() { PATH=$tk/bin:$PATH cmake --build "$work/b" -j "$(nproc)" --target llama-bench \
    >> "$work/cmake.log" 2>&1; }
  if ! build; then  # the link names the driver symbols it needs: stub them, link again
    mapfile -t syms < <(grep -o "undefined reference to \`cu[A-Za-z0-9_]*'" "$work/cmake.log" \
      | sed "s/.*\`//; s/'//" | sort -u)
    [ ${#syms[@]} -gt 0 ] || { tail -30 "$work/cmake.log" >&2; exit 1; }
    stub_driver "$tk/lib64/stubs/libcuda.so" "${syms[@]}"
    build || { tail -30 "$work/cmake.log" >&2; exit 1; }
  fi
  pack "$work/b/bin/llama-bench" "$out"
  ;;
build)
  src=${2:?SRC}; out=${3:?OUT_DIR}
  work=$(mktemp -d)
  tar xzf "$src" -C "$work"
  dir=$(source_dir "$work")
  cmake -S "$dir" -B "$work/b" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > "$work/cmake.log"
  cmake --build "$work/b" -j "$(nproc)" --target llama-bench >> "$work/cmake.log"
  pack "$work/b/bin/llama-bench" "$out"
  ;;
unpack)
  parts=${2:?PARTS_DIR}; dest=${3:?DEST}
  mkdir -p "$dest"
  cat "$parts"/llama-bench.xz.part-* | xz -d > "$dest/llama-bench"
  chmod +x "$dest/llama-bench"
  ;;
*) echo "mode must be build, build-here or unpack" >&2; exit 2 ;;
esac
