#!/usr/bin/env bash
# FreeToken on a GPU machine without network that already has torch and Triton (a CUDA image):
#   on a machine with network:  bash scripts/offline_gpu_setup.sh download WHEEL_DIR
#   on the GPU machine:         source scripts/offline_gpu_setup.sh install WHEEL_DIR
# `download` fetches the wheels of the runtime dependencies such images lack (gguf, FastAPI and
# its stack, prometheus-client) and nanobind, for CPython 3.12 on x86-64 Linux. `install` puts
# them in a folder of their own (FT_SITE, default /tmp/freetoken-site) without touching the
# image's packages, builds the CPU MoE extension with cmake into freetoken/ (skipped when the
# build there is of the same csrc: freetoken/build.stamp), and, sourced, exports PYTHONPATH so
# that `python3 -m freetoken.cli ...` and the benchmarks run from this checkout.
set -uo pipefail
mode=${1:?usage: offline_gpu_setup.sh download|install WHEEL_DIR}
wheels=${2:?usage: offline_gpu_setup.sh download|install WHEEL_DIR}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PKGS="gguf nanobind prometheus-client fastapi starlette uvicorn pydantic pydantic-core
annotated-types typing-inspection h11 anyio sniffio click"
case $mode in
download)
  mkdir -p "$wheels"
  # shellcheck disable=SC2086
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$wheels" $PKGS ;;
install)
  site=${FT_SITE:-/tmp/freetoken-site}
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl || return 1 2>/dev/null || exit 1
  export PYTHONPATH="$site:$root${PYTHONPATH:+:$PYTHONPATH}"
  stamp=$(cat "$root/CMakeLists.txt" "$root"/csrc/cpu_moe/* | sha1sum | cut -c1-16)
  if [ "$(cat "$root/freetoken/build.stamp" 2>/dev/null)" != "$stamp" ]; then
    build=${FT_BUILD:-/tmp/freetoken-build}
    cmake -S "$root" -B "$build" -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE="$(command -v python3)" \
      -Dnanobind_DIR="$(PYTHONPATH=$site python3 -m nanobind --cmake_dir)" > /dev/null \
      && cmake --build "$build" -j "$(nproc)" > /dev/null \
      && cp "$build"/csrc/cpu_moe/_cpu_moe*.so "$root/freetoken/" \
      && echo "$stamp" > "$root/freetoken/build.stamp" \
      || { echo "offline_gpu_setup: the CPU MoE extension did not build" >&2; return 1 2>/dev/null || exit 1; }
  fi
  echo "offline_gpu_setup: packages in $site, extension in freetoken/ (PYTHONPATH set)" ;;
*)
  echo "mode must be download or install" >&2; exit 2 ;;
esac
