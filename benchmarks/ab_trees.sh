#!/usr/bin/env bash
# Same-machine A/B of this tree against BASE_TREE (a checkout of another commit, its CPU
# extension built or copied in): each `ft bench decode` configuration runs in both trees,
# alternating, ROUNDS times, so that the machine's drift shows as the spread of each side
# rather than as a difference between them. Prints tokens/s per batch size, round by round.
#   bash benchmarks/ab_trees.sh BASE_TREE OUT_DIR ROUNDS "BENCH ARGS" ["BENCH ARGS" ...]
# e.g. "--model qwen3.6-35b-a3b --dummy-format nvfp4 --moe-backends hybrid
#       --moe-cache-rates 0.1 --batch 1,4"
set -uo pipefail
base=${1:?usage: ab_trees.sh BASE_TREE OUT_DIR ROUNDS "BENCH ARGS" ...}
out=${2:?usage: ab_trees.sh BASE_TREE OUT_DIR ROUNDS "BENCH ARGS" ...}
rounds=${3:?usage: ab_trees.sh BASE_TREE OUT_DIR ROUNDS "BENCH ARGS" ...}
shift 3
root=$(cd "$(dirname "$0")/.." && pwd)
base=$(cd "$base" && pwd)
mkdir -p "$out"
common="--dummy-weights --tokens 16 --prompt-len 32 --warmup 3 --no-show-progress"
n=0
for cfg in "$@"; do
  n=$((n + 1))
  for r in $(seq 1 "$rounds"); do
    for side in new base; do
      tree=$root
      [ "$side" = base ] && tree=$base
      # shellcheck disable=SC2086  # the configuration is a list of words
      (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" \
        timeout "${AB_STAGE_SECONDS:-200}" python3 -m freetoken.cli bench decode $cfg $common) \
        > "$out/c${n}_${side}_r$r.txt" 2>&1
    done
  done
done
python3 - "$out" "$@" <<'PY'
import re, sys
from pathlib import Path
out, cfgs = Path(sys.argv[1]), sys.argv[2:]
row = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+[\d.]+\s")
for n, cfg in enumerate(cfgs, 1):
    print(f"== {cfg}")
    for f in sorted(out.glob(f"c{n}_*_r*.txt")):
        _, side, rnd = f.stem.split("_")
        backend, cells = "", []
        for line in f.read_text().splitlines():
            if line.startswith("== MoE backend"):
                backend = line.split()[3].rstrip(",")
            m = row.match(line)
            if m:
                cells.append(f"{backend or 'b'}{m.group(1)}={m.group(2)}")
        print(f"  {side:4s} {rnd}: " + (" ".join(cells) or "no table (see the log)"))
PY
