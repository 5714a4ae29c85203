#!/usr/bin/env bash
# The expert-cache backends (offload, cpu, hybrid) on one GPU machine, in one command, each
# stage time-limited and writing under OUT_DIR:
#   bash benchmarks/gpu_moe_backends.sh smoke|quick|ahead|bars|full|all OUT_DIR [BASE_TREE]
# 1. the CPU MoE executor built here with cmake (skipped when freetoken/ holds a build of
#    the same csrc: build.stamp), copied into freetoken/;
# 2. `ft bench bw` for q4_k and nvfp4 (writes the profile hybrid's q* and the ceilings use);
# smoke: 3. the CUDA tests of the backends (float32 equality with fused on the tiny MoE
#    models), the slot cache and its plan kernel; 4. a 2-layer Qwen3-30B-A3B shape, every
#    backend at cache rate 0.1, batch 1 and 4, prefill 512, a profiled step; with BASE_TREE
#    the same runs with that tree's code (before / after);
# quick (about 7 minutes, the tables of a closing note): 3. the CUDA tests of the backends
#    and the GPU kernels they use (the decode kernels of qwen3.5 and the GPU parity tests
#    too); 4. cpu and hybrid at cache rate 0.1: Qwen3.6-35B-A3B NVFP4 at batch 1-4 (and at
#    rate 0.25, batch 1 and 4, in a process of its own), Qwen3-30B-A3B Q4_K and NVFP4 at
#    batch 1 and 4, the 35B's prefill of 512 and 2048 tokens, and a profiled hybrid step of
#    the 35B at batch 1 (kernels and the hand-off worker's table);
# ahead (about 7 minutes): 3. the CUDA tests of fetching ahead (the plan and fill kernels,
#    the worker's copies, a graphed hybrid engine against an eager one); 4. --moe-fetch-ahead
#    0 / 1 / 2 alternated (benchmarks/ab_env.py) on the 35B NVFP4 hybrid at batch 1 and 4 and
#    the 30B Q4_K hybrid at batch 1 (with also 1 at a fetch cap of 1, for the fill that now
#    shares the link with the ahead copy, and the worker's warming, FREETOKEN_MOE_PREFETCH=1,
#    which uses the same idle window), 0 / 1 on the 30B NVFP4 hybrid, rate 0.1; profiled 35B
#    steps at batch 1 with 0 and 1 (where the CPU waits for the device, the kernels beside
#    the copies);
# bars (about 10 minutes): issue 16's decode bars after a warm-up round, two or three rounds
#    each (benchmarks/ab_env.py, their lines with the host's steal and preemptions): the 35B
#    NVFP4 hybrid at batch 1 and 4, the 30B Q4_K and NVFP4 at batch 1 as hybrid and as cpu
#    (--moe-hybrid-max-fetch 0), all at cache rate 0.1; then the CPU's 30B Q4_K layer
#    (profile_cpu_moe_layer.py) and the hybrids with FREETOKEN_GPU_NORM_FOLD=0 / 1 (the 30B
#    Q4_K; the 35B, whose fold adds the shared expert);
# full: 3. `ft bench decode` sweeps (offload, cpu, hybrid x cache rate 0.1 and 0.25, batch
#    1-4, then prefill 512 and 2048 tokens and a profiled step at batch 1) for Qwen3-30B-A3B
#    with Q4_K and NVFP4 experts and Qwen3.6-35B-A3B with NVFP4 experts (random weights, each
#    model loaded once); all: smoke, then full.
# STAGES="bw b_30b_q4k ..." runs only the stages it names (a call to a machine that limits
# a command's time can take a mode in two parts); the build always runs, and a name no stage
# of the mode has is reported at the end and makes the exit status 2.
set -uo pipefail
mode=${1:?usage: gpu_moe_backends.sh smoke|quick|ahead|bars|full|all OUT_DIR [BASE_TREE]}
out=${2:?usage: gpu_moe_backends.sh smoke|quick|ahead|bars|full|all OUT_DIR [BASE_TREE]}
case $mode in smoke|quick|ahead|bars|full|all) ;; *)
  echo "mode must be smoke, quick, ahead, bars, full or all" >&2; exit 2;; esac
base=${3:-}
full_limit=${FULL_STAGE_SECONDS:-400}  # per model of the full sweeps
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
rm -f "$out/.stages"
export FREETOKEN_CACHE=${FREETOKEN_CACHE:-/tmp/freetoken-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}
cd "$root"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root"

stamp=$(cat CMakeLists.txt csrc/cpu_moe/* | sha1sum | cut -c1-16)
if [ "$(cat freetoken/build.stamp 2>/dev/null)" != "$stamp" ]; then
  t0=$SECONDS
  timeout 400 bash -c "cmake -S . -B /tmp/ft-build -DCMAKE_BUILD_TYPE=Release \
      -DPython_EXECUTABLE=$(command -v python3) -Dnanobind_DIR=$(python3 -m nanobind --cmake_dir) \
    && cmake --build /tmp/ft-build -j $(nproc)" > "$out/build.txt" 2>&1
  echo "build: exit $? in $((SECONDS - t0)) s" >> "$out/build.txt"
  cp /tmp/ft-build/csrc/cpu_moe/_cpu_moe*.so freetoken/ && echo "$stamp" > freetoken/build.stamp
  mkdir -p "$out/ext" && cp freetoken/_cpu_moe*.so freetoken/build.stamp "$out/ext/"
fi

stage() {  # stage NAME SECONDS COMMAND...: output in OUT/NAME.txt, exit status and time last
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  case " ${STAGES:-$name} " in *" $name "*) ;; *) return 0;; esac  # STAGES: only those named
  echo "$name" >> "$out/.stages"  # the stages run (also from subshells), checked at the end
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/$name.txt"
}
stage bw 150 python3 -m freetoken.cli bench bw --formats q4_k,nvfp4 --seconds 1 --json "$out/bw.json"
cp "$FREETOKEN_CACHE/bw_profile.json" "$out/" 2>/dev/null

sweep() {  # sweep NAME SECONDS MODEL FORMAT BACKENDS RATES BATCHES TOKENS [extra args]
  local name=$1 limit=$2 model=$3 fmt=$4 backends=$5 rates=$6 batches=$7 tokens=$8
  shift 8
  stage "$name" "$limit" python3 -m freetoken.cli bench decode --model "$model" --dummy-weights --dummy-format "$fmt" \
    --moe-backends "$backends" --moe-cache-rates "$rates" --batch "$batches" \
    --tokens "$tokens" --prompt-len 32 --warmup 2 --prefill --no-show-progress \
    --json "$out/$name.json" --profile "$out/$name-trace.json" "$@"
}

if [ "$mode" = quick ]; then
  stage tests 240 python3 -m pytest -q -p no:cacheprovider tests/moe/test_handoff.py \
    tests/moe/test_slot_cache.py tests/moe/test_slot_plan.py tests/moe/test_backends.py \
    tests/moe/test_prefill_stream.py tests/kernels/test_triton_gdn.py \
    tests/kernels/test_triton_glu.py tests/kernels/test_triton_moe.py \
    tests/kernels/test_triton_gemv_i8.py tests/kernels/test_triton_rotary.py \
    tests/kernels/test_triton_route.py tests/gpu \
    -k "cuda or slot or handoff or plan or gdn or glu or i8 or rope or rotary or route or gpu \
or greedy or gate"
  decode() {  # decode NAME MODEL FORMAT BATCHES [RATE]: a process of its own per call
    stage "$1" 200 python3 -m freetoken.cli bench decode --model "$2" --dummy-weights \
      --dummy-format "$3" --moe-backends cpu,hybrid --moe-cache-rates "${5:-0.1}" --batch "$4" \
      --tokens 16 --prompt-len 32 --warmup 3 --no-show-progress --json "$out/$1.json"
  }
  decode q_35b qwen3.6-35b-a3b nvfp4 1,2,3,4
  # rate 0.25 alone: in one process after 0.1 it measured slower than 0.1 (b4 144 against 199)
  decode q_35b_r25 qwen3.6-35b-a3b nvfp4 1,4 0.25
  decode q_30b_q4k qwen3-30b-a3b q4_k 1,4
  decode q_30b_nvfp4 qwen3-30b-a3b nvfp4 1,4
  stage q_35b_prefill 150 python3 -m freetoken.cli bench prefill --model qwen3.6-35b-a3b \
    --dummy-weights --dummy-format nvfp4 --moe-backend hybrid --moe-cache-rate 0.1 \
    --prompt-lens 512,2048 --warmup 1 --no-show-progress
  stage q_35b_profile 150 python3 benchmarks/profile_decode_step.py --model qwen3.6-35b-a3b \
    --dummy-weights --dummy-format nvfp4 --moe-backend hybrid --moe-cache-rate 0.1 --batch 1 \
    --steps 10 --warmup 3 --rows 30 --prompt-len 32
fi
if [ "$mode" = ahead ]; then
  # one case of the graph test (93 s on the H200; its three cases outran the stage's limit)
  stage tests 200 python3 -m pytest -q -p no:cacheprovider tests/moe/test_slot_plan.py \
    tests/moe/test_handoff.py \
    "tests/moe/test_backends.py::test_ahead_copies_by_the_worker_or_a_fill_change_no_bit" \
    "tests/engine/test_cuda_graph.py::test_cache_backend_graphs_give_the_eager_tokens[1-1-False]" \
    -k "plan or fill or ahead or cache_backend"
  ab() {  # ab NAME SECONDS MODEL FORMAT BATCHES AHEADS... (N: moe_fetch_ahead=N, or settings)
    local name=$1 limit=$2 model=$3 fmt=$4 batches=$5 sets=()
    shift 5
    for n in "$@"; do
      case $n in *=*) sets+=(--set "$n");; *) sets+=(--set "moe_fetch_ahead=$n");; esac
    done
    stage "$name" "$limit" python3 benchmarks/ab_env.py --model "$model" --dummy-weights \
      --dummy-format "$fmt" --moe-backend hybrid --moe-cache-rate 0.1 --batch "$batches" \
      --rounds 2 --tokens 32 --warmup 4 --prompt-len 32 --cuda-graph-max-bs 4 \
      --decode-log-interval 16 "${sets[@]}"
  }
  ab a_35b 200 qwen3.6-35b-a3b nvfp4 1,4 0 1 2
  ab a_30b_nvfp4 120 qwen3-30b-a3b nvfp4 1 0 1
  ab a_30b_q4k 280 qwen3-30b-a3b q4_k 1 0 1 2 moe_fetch_ahead=1,moe_hybrid_max_fetch=1 \
    moe_fetch_ahead=0,FREETOKEN_MOE_PREFETCH=1
  for n in 0 1; do
    stage "a_35b_profile$n" 90 python3 benchmarks/profile_decode_step.py \
      --model qwen3.6-35b-a3b --dummy-weights --dummy-format nvfp4 --moe-backend hybrid \
      --moe-cache-rate 0.1 --batch 1 --steps 4 --rows 16 --prompt-len 32 \
      --cuda-graph-max-bs 4 --moe-fetch-ahead "$n"
  done
fi
if [ "$mode" = bars ]; then
  bar() {  # bar NAME SECONDS MODEL FORMAT BATCHES ROUNDS SETTINGS...
    local name=$1 limit=$2 model=$3 fmt=$4 batches=$5 rounds=$6 sets=()
    shift 6
    for s in "$@"; do sets+=(--set "$s"); done
    stage "$name" "$limit" python3 benchmarks/ab_env.py --model "$model" --dummy-weights \
      --dummy-format "$fmt" --moe-backend hybrid --moe-cache-rate 0.1 --batch "$batches" \
      --rounds "$rounds" --tokens 32 --warmup 4 --prompt-len 32 --cuda-graph-max-bs 4 \
      --decode-log-interval 16 "${sets[@]}"
  }
  bar b_35b 130 qwen3.6-35b-a3b nvfp4 1,4 3 moe_hybrid_max_fetch=-1
  bar b_30b_q4k 120 qwen3-30b-a3b q4_k 1 2 moe_hybrid_max_fetch=-1 moe_hybrid_max_fetch=0
  bar b_30b_nvfp4 120 qwen3-30b-a3b nvfp4 1 2 moe_hybrid_max_fetch=-1 moe_hybrid_max_fetch=0
  # the CPU's 30B Q4_K layer on this host (where its time goes, its GB/s), and the next
  # residual step folded into the receive or not
  stage layer_30b_q4k 60 python3 benchmarks/profile_cpu_moe_layer.py --shape 2048x768-Q4_K \
    --batch 1 --calls 3000
  bar b_30b_q4k_fold 120 qwen3-30b-a3b q4_k 1,4 2 FREETOKEN_GPU_NORM_FOLD=0 \
    FREETOKEN_GPU_NORM_FOLD=1
  bar b_35b_fold 130 qwen3.6-35b-a3b nvfp4 1,4 2 FREETOKEN_GPU_NORM_FOLD=0 \
    FREETOKEN_GPU_NORM_FOLD=1
fi
if [ "$mode" = smoke ] || [ "$mode" = all ]; then
  stage tests 240 python3 -m pytest -q -p no:cacheprovider tests/moe/test_handoff.py \
    tests/moe/test_slot_cache.py tests/moe/test_slot_plan.py tests/moe/test_backends.py \
    tests/moe/test_prefill_stream.py -k "cuda or slot or handoff"
  sweep smoke 240 qwen3-30b-a3b q4_k offload,cpu,hybrid 0.1 1,4 8 --dummy-layers 2 \
    --prompt-lens 512
  if [ -n "$base" ]; then  # the same runs with the code before this change (no sweep flag)
    cp freetoken/_cpu_moe*.so "$base/freetoken/"
    for b in offload cpu hybrid; do
      (cd "$base" && PYTHONPATH="${PYTHONPATH/$root/$base}" stage "smoke_base_$b" 120 \
        python3 -m freetoken.cli bench decode --model qwen3-30b-a3b --dummy-weights \
        --dummy-format q4_k --moe-backend "$b" --moe-cache-rate 0.1 --batch 1,4 --tokens 8 \
        --prompt-len 32 --warmup 2 --no-show-progress --dummy-layers 2)
    done
  fi
fi
if [ "$mode" = full ] || [ "$mode" = all ]; then
  sweep q4k_30b "$full_limit" qwen3-30b-a3b q4_k offload,cpu,hybrid 0.1,0.25 1,2,3,4 12 \
    --prompt-lens 512,2048
  sweep nvfp4_35b "$full_limit" qwen3.6-35b-a3b nvfp4 offload,cpu,hybrid 0.1,0.25 1,2,3,4 12 \
    --prompt-lens 512,2048
  sweep nvfp4_30b "$full_limit" qwen3-30b-a3b nvfp4 offload,cpu,hybrid 0.1,0.25 1,2,3,4 12 \
    --prompt-lens 512,2048
fi
unknown=0  # a name in STAGES that no stage of this mode has: an error, not silence
for s in ${STAGES:-}; do
  grep -qx "$s" "$out/.stages" 2>/dev/null || {
    echo "STAGES: mode $mode has no stage named $s" >&2; unknown=2; }
done
rm -f "$out/.stages"
rm -f "$out"/*-trace*.json  # the tables are in the .txt files; traces are large
grep -h "FAILED\|Error\|passed\|failed" "$out/tests.txt" 2>/dev/null | head -20
grep -h -A12 "^batch\|^ prompt\|^step\|exit\|hand-off worker\|^setting\|preemptions a step" "$out"/*.txt | cut -c1-160 | tail -n 150
# one archive: the device tool brings back only a few files
tar -czf /tmp/gpu_moe_results.tgz -C "$out" . && rm -rf "${out:?}"/* && \
  mv /tmp/gpu_moe_results.tgz "$out/results.tgz"
archived=$?
exit $((unknown ? unknown : archived))
