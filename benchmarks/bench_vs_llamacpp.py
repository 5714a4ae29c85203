"""One GGUF through FreeToken (`ft bench decode --prefill`) and llama.cpp's `llama-bench`, in one
run, and a table of the ratios.

    python benchmarks/bench_vs_llamacpp.py --gguf q4k.gguf --make q4_k \\
        --llama /path/to/llama-bench   # or an unpacked llama-cpp-python sdist, or its .tar.gz

`--make q4_k|nvfp4` writes the random Qwen3-30B-A3B-shaped file first when `--gguf` does not
exist (scripts/make_random_gguf.py). `--llama` names a llama-bench binary, or llama-cpp-python's
source (an unpacked sdist directory or the .tar.gz, unpacked into --work): llama.cpp is then
built from its `vendor/llama.cpp` with CUDA for the H200 (FACTS.md):

    cmake -B b -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
          -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
    cmake --build b -j16 --target llama-bench

The whole sdist (77 MB) is larger than what may travel to the GPU machine (64 MiB); a tarball
of its vendor/llama.cpp without `models/` (tokenizer test vocabularies) and `docs/` is 13 MB and
builds the same llama-bench (tests and examples are not configured, so nothing reads those).
Checked on the CPU-only development machine (2026-11-30): llama-bench built from that tarball
(`-DGGML_CUDA=OFF -DGGML_NATIVE=OFF`) loads and runs small files of make_random_gguf.py with
Q4_K and with NVFP4 experts, and this script parses its output. On the GPU machine the build
(62% done after 4.5 minutes there, sharing the CPU) and the runs do not fit one 10-minute
device call:
benchmarks/llamacpp_gpu.sh builds a static llama-bench in one call and packs it to be carried
into the next, or (`build-here`) builds it on a machine without a GPU from nvcc and cuBLAS's
wheel, spending no device time: how the figures of 2026-12-01 were measured (the llama.cpp of
llama-cpp-python 0.3.36, one device call of about three minutes per GGUF).

llama-bench runs `-ngl 99 -t THREADS -p PROMPT -n GEN -o json` (batch-1 decode and a prompt of
PROMPT tokens, both in tokens/s); FreeToken runs `ft bench decode` at every --batch with the
same prompt length for prefill. llama-bench has no multi-sequence decode, so FreeToken's
larger batches have no llama.cpp figure.

Experts off the GPU: `--n-cpu-moe 43,48` adds llama-bench runs with the routed experts of that
many layers on the CPU (`-ncmoe`; 43 of Qwen3-30B-A3B's 48 layers leaves about 10% of the
experts on the GPU), and `--cache-backends hybrid,cpu --cache-rate 0.1` a FreeToken sweep of its
expert-cache backends at that share of the experts on the GPU. Each such FreeToken row is set
beside every `-ncmoe` row: the first `-ncmoe` value is the like-for-like one (the same share of
experts on the GPU), the others are llama.cpp's other settings, for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CMAKE_CONFIG = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90", "-DLLAMA_CURL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]


# ---- llama.cpp --------------------------------------------------------------------------------
def _is_llama_src(d: Path) -> bool:
    return (d / "CMakeLists.txt").is_file() and (d / "ggml").is_dir()


def _source_dir(path: Path, work: Path) -> Path:
    """llama.cpp's source: `path`, its vendor/llama.cpp (an unpacked sdist), or either inside
    a .tar.gz unpacked into `work` (the sdist, or a trimmed copy of its vendor/llama.cpp)."""
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        work.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path) as tar:
            tar.extractall(work, filter="data")
        path = work
    for cand in (path, path / "vendor" / "llama.cpp", *sorted(path.glob("*")),
                 *sorted(path.glob("*/vendor/llama.cpp"))):
        if cand.is_dir() and _is_llama_src(cand):
            return cand
    raise SystemExit(f"{path}: neither a llama-bench binary nor llama.cpp source "
                     "(a directory with CMakeLists.txt and ggml/, or vendor/llama.cpp of one)")


def llama_bench_binary(path: Path, work: Path, jobs: int) -> Path:
    """The llama-bench to run: `path` itself, or built from the source at `path`."""
    if path.is_file() and os.access(path, os.X_OK) and not path.name.endswith(".gz"):
        return path
    src = _source_dir(path, work)
    build = src / "b"
    binary = build / "bin" / "llama-bench"
    if not binary.exists():
        _run(["cmake", "-B", str(build), *CMAKE_CONFIG], cwd=src)
        _run(["cmake", "--build", str(build), f"-j{jobs}", "--target", "llama-bench"], cwd=src)
    if not binary.exists():
        raise SystemExit(f"the build finished without {binary}")
    return binary


def run_llama_bench(binary: Path, gguf: Path, threads: int, prompt: int, gen: int,
                    extra: list[str], n_cpu_moe: list[int]) -> dict[int, dict[str, float]]:
    """{n_cpu_moe: {"decode_b1": tok/s, "prefill": tok/s}} from llama-bench's JSON output (0:
    every expert on the GPU)."""
    cmd = [str(binary), "-m", str(gguf), "-ngl", "99", "-t", str(threads), "-p", str(prompt),
           "-n", str(gen), "-o", "json", *extra]
    if n_cpu_moe != [0]:
        cmd += ["-ncmoe", ",".join(map(str, n_cpu_moe))]
    out = _run(cmd, capture=True)
    rows = json.loads(out[out.index("["):])
    res: dict[int, dict[str, float]] = {}
    for r in rows:
        got = res.setdefault(int(r.get("n_cpu_moe", 0)), {})
        if r.get("n_gen", 0) > 0 and r.get("n_prompt", 0) == 0:
            got["decode_b1"] = float(r["avg_ts"])
        elif r.get("n_prompt", 0) > 0 and r.get("n_gen", 0) == 0:
            got["prefill"] = float(r["avg_ts"])
    return res


# ---- FreeToken --------------------------------------------------------------------------------
def run_freetoken(gguf: Path, batches: str, prompt: int, gen: int, extra: list[str],
                  json_path: Path) -> dict:
    cmd = [sys.executable, "-m", "freetoken.cli", "bench", "decode", "--model", str(gguf),
           "--batch", batches, "--tokens", str(gen), "--prefill", "--prompt-lens", str(prompt),
           "--json", str(json_path), "--no-show-progress", *extra]
    _run(cmd, cwd=REPO)
    return json.loads(json_path.read_text())


# ---- the run ----------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path | None = None, capture: bool = False) -> str:
    print("$", " ".join(cmd), flush=True)
    res = subprocess.run(cmd, cwd=cwd, text=True, stdout=subprocess.PIPE if capture else None)
    if res.returncode != 0:
        raise SystemExit(f"command failed ({res.returncode}): {' '.join(cmd)}")
    return res.stdout or ""


def _layer_counts(text: str) -> list[int]:
    """--n-cpu-moe: comma-separated layer counts (positive integers)."""
    bad = argparse.ArgumentTypeError(f"expected comma-separated positive layer counts, "
                                     f"got {text!r}")
    try:
        out = [int(n) for n in text.split(",") if n.strip()]
    except ValueError:
        raise bad from None
    if any(n <= 0 for n in out):
        raise bad
    return out


def _setup(r: dict) -> str:
    """FreeToken's setting of a bench row: fused (every expert on the GPU) or backend@rate."""
    if r.get("moe_backend") is None:
        return "all experts on the GPU"
    return f"{r['moe_backend']}, cache rate {r['moe_cache_rate']:g}"


def table(ft: list[dict], lc: dict[int, dict[str, float]], prompt: int) -> list[dict]:
    """Rows (FreeToken setting, llama.cpp setting, measure, both figures, ratio). FreeToken's
    fused rows face `-ncmoe 0`; its cache-backend rows face each `-ncmoe` value above 0."""
    rows = []
    for rep in ft:
        for kind in ("decode", "prefill"):
            for r in rep.get(kind, []):
                fused = r.get("moe_backend") is None
                peers = [0] if fused else [n for n in lc if n > 0] or [None]
                for n in peers:
                    lcr = lc.get(n, {})
                    if kind == "decode":
                        measure = f"decode batch {r['batch']} (tokens/s, aggregate)"
                        theirs = lcr.get("decode_b1") if r["batch"] == 1 else None
                    else:
                        measure = f"prefill {r['prompt_len']} (prompt tokens/s)"
                        theirs = lcr.get("prefill") if r["prompt_len"] == prompt else None
                    rows.append({"freetoken_setup": _setup(r), "measure": measure,
                                 "llama_setup": "-" if n is None else
                                 ("all on the GPU" if n == 0 else f"-ncmoe {n}"),
                                 "freetoken": r["tokens_per_s"], "llama.cpp": theirs,
                                 "ratio": r["tokens_per_s"] / theirs if theirs else None})
    return rows


def print_table(rows: list[dict]) -> None:
    def f(x, spec):
        return "—" if x is None else format(x, spec)

    print("| FreeToken | llama.cpp | measure | FreeToken | llama.cpp | FreeToken / llama.cpp |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['freetoken_setup']} | {r['llama_setup']} | {r['measure']} | "
              f"{f(r['freetoken'], '.1f')} | {f(r['llama.cpp'], '.1f')} | "
              f"{f(r['ratio'], '.2f')} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", required=True, type=Path, help="the GGUF both engines run")
    p.add_argument("--make", choices=["q4_k", "nvfp4"], default=None,
                   help="write a random Qwen3-30B-A3B-shaped GGUF with these experts first "
                   "(when --gguf does not exist)")
    p.add_argument("--layers", type=int, default=48, help="layers of a --make file")
    p.add_argument("--llama", required=True, type=Path,
                   help="llama-bench binary, or llama-cpp-python's sdist (dir or .tar.gz)")
    p.add_argument("--work", type=Path, default=None,
                   help="where a .tar.gz sdist is unpacked and built (default: a temp dir)")
    p.add_argument("--jobs", type=int, default=16, help="build jobs")
    p.add_argument("--threads", type=int, default=15, help="llama-bench -t")
    p.add_argument("--batch", default="1,16", help="FreeToken decode batch sizes")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    p.add_argument("--gen", type=int, default=128, help="decode tokens (llama-bench -n)")
    p.add_argument("--llama-args", default="", help="extra llama-bench arguments")
    p.add_argument("--ft-args", default="", help="extra ft bench decode arguments")
    p.add_argument("--n-cpu-moe", type=_layer_counts, default=[],
                   help="also llama-bench with the experts of this many layers on the CPU "
                   "(comma-separated, e.g. 43,48: llama-bench -ncmoe)")
    p.add_argument("--cache-backends", default="",
                   help="also FreeToken's expert-cache backends (comma-separated: offload, "
                   "cpu, hybrid) at --cache-rate")
    p.add_argument("--cache-rate", default="0.1", help="their expert cache rate")
    p.add_argument("--cache-batch", default="1", help="their decode batch sizes")
    p.add_argument("--json", type=Path, default=None, help="also write everything as JSON")
    args = p.parse_args(argv)

    if not args.gguf.exists():
        if args.make is None:
            raise SystemExit(f"{args.gguf} does not exist (pass --make q4_k|nvfp4 to write it)")
        _run([sys.executable, str(REPO / "scripts" / "make_random_gguf.py"), str(args.gguf),
              "--expert-type", args.make, "--layers", str(args.layers)])
    work = args.work or Path(tempfile.mkdtemp(prefix="llamacpp-"))
    binary = llama_bench_binary(args.llama, work, args.jobs)
    ft = []
    with tempfile.TemporaryDirectory() as tmp:
        ft.append(run_freetoken(args.gguf, args.batch, args.prompt, args.gen,
                                args.ft_args.split(), Path(tmp) / "ft.json"))
        if args.cache_backends:
            ft.append(run_freetoken(
                args.gguf, args.cache_batch, args.prompt, args.gen,
                ["--moe-backends", args.cache_backends, "--moe-cache-rates", args.cache_rate,
                 *args.ft_args.split()], Path(tmp) / "ft_cache.json"))
    ncmoe = [0] + args.n_cpu_moe
    lc = run_llama_bench(binary, args.gguf, args.threads, args.prompt, args.gen,
                         args.llama_args.split(), ncmoe)
    rows = table(ft, lc, args.prompt)
    print(f"\n{args.gguf.name}, {ft[0].get('device_name')}; llama.cpp: {binary}")
    print_table(rows)
    if args.json:
        args.json.write_text(json.dumps({"freetoken": ft, "llama.cpp": lc, "table": rows},
                                        indent=2))
    if args.work is None and binary.is_relative_to(work):
        print(f"(llama.cpp unpacked and built in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
