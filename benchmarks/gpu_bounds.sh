#!/usr/bin/env bash
# What bounds the fused decode on one GPU machine, in one command (its stages' time limits add
# to 18 minutes), each stage writing OUT_DIR/NAME.txt:
# 1. probe: one kernel's read floor and a batch-1 step's 288 dependent reads as launches, with
#    PDL and as one persistent kernel (benchmarks/probe_persistent.py);
# 2. routes: the per-route MoE at 1, 4 and 16 tokens over random, 8 shared and distinct
#    experts (bench_gpu_kernels.py --moe-routes: bound by its routes or by its bytes);
# 3. ncu (where Nsight Compute is installed): the batch-1 kernels of the 30B shape (split Q8_0
#    qkv and o_proj, the Q4_K MoE's gate/up and down, the fused norm + router) and the 16-token
#    MoE: duration, DRAM throughput, registers, occupancy, issue stalls;
# 4. pdl: programmatic dependent launch on and off in the engine (benchmarks/ab_env.py), the
#    30B Q4_K fused at batch 1 and 16 and hybrid at rate 0.1, batch 1 (probe_persistent.py saw
#    0.5 us less a kernel boundary on pure reads; the engine measured nothing so far); before
#    the hybrid, gpu_moe_backends.sh builds the CPU executor and runs `ft bench bw`;
# 5. l2: the L2 read-ahead on a side stream (FREETOKEN_GPU_L2_AHEAD, kernels/triton/l2.py) off,
#    all, o+down and qkv alone (its lines marked evict_last), and all with PDL, the 30B Q4_K
#    fused at batch 1 and 16; l2_test: its CUDA test (the same greedy tokens, fused and hybrid).
#   bash benchmarks/gpu_bounds.sh OUT_DIR
# STAGES="l2 l2_test" runs only the stages it names (and the bw profile where a hybrid stage
# runs); a name no stage has makes the exit status 2.
set -uo pipefail
out=${1:?usage: gpu_bounds.sh OUT_DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
cd "$root"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$root"
# where gpu_moe_backends.sh writes the bw profile the hybrid reads
export FREETOKEN_CACHE=${FREETOKEN_CACHE:-/tmp/freetoken-cache}
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache}

wanted() { case " ${STAGES:-$1} " in *" $1 "*) return 0;; *) return 1;; esac; }  # STAGES
ran=()
stage() {  # stage NAME SECONDS COMMAND...: output in OUT/NAME.txt, exit status and time last
  local name=$1 limit=$2 t0=$SECONDS
  shift 2
  wanted "$name" || return 0
  ran+=("$name")
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$out/$name.txt"
}
stage probe 120 python3 benchmarks/probe_persistent.py
stage routes 90 python3 benchmarks/bench_gpu_kernels.py --moe-routes
ncu=$(command -v ncu || ls /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
            --section WarpStateStats --section SchedulerStats)
  stage ncu_b1 150 "$ncu" --profile-from-start off "${sections[@]}" \
    python3 benchmarks/bench_gpu_kernels.py --profile-step-kernels 1
  stage ncu_t16 150 "$ncu" --profile-from-start off "${sections[@]}" \
    python3 benchmarks/bench_gpu_kernels.py --profile-step-kernels 16
fi
ab() {  # ab NAME SECONDS BACKEND BATCHES [args, the settings among them]: alternated
  local name=$1 limit=$2 backend=$3 batches=$4
  shift 4
  stage "$name" "$limit" python3 benchmarks/ab_env.py --model qwen3-30b-a3b --dummy-weights \
    --dummy-format q4_k --moe-backend "$backend" --batch "$batches" --rounds 2 --tokens 64 \
    --warmup 4 --prompt-len 32 --cuda-graph-max-bs 16 "$@"
}
pdl=(--set FREETOKEN_GPU_PDL=0 --set FREETOKEN_GPU_PDL=1)
ab pdl_fused 200 fused 1,16 "${pdl[@]}"
# the hybrid needs the CPU executor (built by gpu_moe_backends.sh) and this host's bw profile
wanted pdl_hybrid \
  && STAGES=bw bash benchmarks/gpu_moe_backends.sh bars "$out/bw" > "$out/bw.txt" 2>&1
ab pdl_hybrid 200 hybrid 1 --moe-cache-rate 0.1 "${pdl[@]}"
ab l2 300 fused 1,16 --set FREETOKEN_GPU_L2_AHEAD=0 --set FREETOKEN_GPU_L2_AHEAD=all \
  --set FREETOKEN_GPU_L2_AHEAD=o+down --set FREETOKEN_GPU_L2_AHEAD=qkv \
  --set FREETOKEN_GPU_L2_AHEAD=all,FREETOKEN_GPU_PDL=1
stage l2_test 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graph.py \
  -k l2_ahead
unknown=0
for name in ${STAGES:-}; do
  case " ${ran[*]} " in *" $name "*) ;; *)
    echo "no stage named $name ran (ncu_*: needs ncu)" >&2; unknown=2;; esac
done
exit $unknown
