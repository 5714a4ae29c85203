#!/usr/bin/env bash
# The GPU fast path on one machine, in one go: `ft bench decode` (batch 1, 4, 16) with prefill
# (512 and 2048 tokens) for the Qwen3-30B-A3B shape with Q4_K and NVFP4 experts (dummy weights
# made on the device), then the CUDA tests of the kernels, the engine and the GPU-vs-CPU greedy
# parity, then the expert-cache backends' CUDA tests. Each stage has a time limit so that one
# slow stage cannot eat the others' time.
#   bash benchmarks/gpu_suite.sh OUT_DIR [STAGE_SECONDS]
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [STAGE_SECONDS]}
limit=${2:-120}
mkdir -p "$out"
for fmt in q4_k nvfp4; do
  timeout "$limit" python3 -m freetoken.cli bench decode --model qwen3-30b-a3b --dummy-weights \
    --dummy-format "$fmt" --batch 1,4,16 --tokens 64 --prefill --prompt-lens 512,2048 \
    --no-show-progress --json "$out/decode_$fmt.json" > "$out/decode_$fmt.txt" 2>&1
  echo "decode $fmt: exit $?" >> "$out/decode_$fmt.txt"
done
timeout "$limit" python3 -m pytest -q -p no:cacheprovider -k "not grouped" tests/kernels \
  tests/engine tests/gpu > "$out/tests.txt" 2>&1
echo "tests: exit $?" >> "$out/tests.txt"
# the expert-cache backends on the GPU: the hand-off kernels, offload / cpu / hybrid against
# fused in float32 (the GGUF cases: the HF ones need the packaged SmolLM2 tokenizer, which the
# GPU machine lacks) and the prefill streamer
timeout "$limit" python3 -m pytest -q -p no:cacheprovider tests/moe/test_handoff.py \
  tests/moe/test_backends.py tests/moe/test_prefill_stream.py -k "cuda or receive or handoff" \
  > "$out/tests_moe.txt" 2>&1
echo "tests_moe: exit $?" >> "$out/tests_moe.txt"
tail -n 40 "$out"/*.txt
