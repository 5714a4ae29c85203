"""`ft bench decode` / `ft bench prefill` on the CPU with a small dummy model: the JSON has a
row per batch size and prompt length, and the weight bytes per step equal the count made here
by hand from the shapes and gguf's block sizes.

The issue's command (`--model qwen3-30b-a3b --dummy-weights --dummy-format q4_k --dummy-layers 2
--batch 1,4 --tokens 8 --json FILE`) runs on this 2-core box (2026-11-30): 20 min as given while
other jobs loaded it (24.5 s per batch-1 step), 66 s with `--torch-threads 1` (0.92 s per step,
1.1 tokens/s at batch 1, 2.6 at batch 4). Why: torch's two intra-op threads stall each other at
every op's barrier when another job holds a core (a tiny model's step: 700 ms, 7 ms with one
thread); and with one thread a step is the Q8_0 151,936 x 2048 lm_head 0.41 s (the CPU reference
kernel dequantizes its 311 M values to fp32 on every call), each MoE layer 0.11 s, the rest
small; the 128-token prefills dequantize every expert. So these tests pass `--torch-threads 1`
and use the tiny configuration; the full command runs with FREETOKEN_TEST_FULL_BENCH=1 (about a
minute).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from freetoken.cli import main

T = GGMLQuantizationType


def _row_bytes(qtype: GGMLQuantizationType, cols: int) -> int:
    block, size = GGML_QUANT_SIZES[qtype]
    return cols // block * size


def _expected_bytes(batch: int) -> int:
    """tiny-qwen3-moe (dummy q4_k): 2 layers, hidden 256, 4 q / 2 kv heads of 64, 8 experts
    top-2 of width 256, vocab 1024; attention and lm_head Q8_0, routers f32, experts Q4_K."""
    q8 = _row_bytes(T.Q8_0, 256)
    attn = (256 + 128 + 128 + 256) * q8  # qkv rows + o_proj rows, all 256 wide
    router = 8 * 256 * 4
    expert = (2 * 256 + 256) * _row_bytes(T.Q4_K, 256)  # gate + up rows, down rows
    touched = 8 * (1 - (1 - 2 / 8) ** batch)  # distinct experts of uniform top-2 routing
    return 2 * (attn + router + int(expert * touched)) + 1024 * q8 + batch * q8


def _run(tmp_path, *args: str) -> dict:
    out = tmp_path / "bench.json"
    rc = main(["bench", *args, "--model", "tiny-qwen3-moe", "--dummy-weights",
               "--dummy-format", "q4_k", "--no-show-progress", "--torch-threads", "1",
               "--device", "cpu",  # the expected bytes assume the CPU's f32 routers
               "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_decode_json(tmp_path, capsys):
    threads = torch.get_num_threads()
    rep = _run(tmp_path, "decode", "--batch", "1,3", "--tokens", "3", "--prompt-len", "8",
               "--warmup", "1")
    assert [r["batch"] for r in rep["decode"]] == [1, 3]
    for r in rep["decode"]:
        assert r["steps"] == 3 and r["tokens_per_s"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"])
        assert r["weight_bytes_per_step"] == pytest.approx(_expected_bytes(r["batch"]), abs=2)
        assert r["roofline_pct"] == pytest.approx(
            100 * r["weight_bytes_per_step"] / (r["ms_per_step"] / 1e3) / 1e9
            / rep["bandwidth_gbps"])
    assert rep["bandwidth_gbps"] > 0 and rep["device"] == "cpu" and rep["layers"] == 2
    out = capsys.readouterr().out
    assert "% roofline" in out
    if sys.platform.startswith("linux"):  # what the host did meanwhile (engine/host_noise.py)
        for r in rep["decode"]:
            assert 0.0 <= r["steal_pct"] <= 100.0 and r["preempted_per_step"] >= 0.0
        assert "preempt" in out and "steal:" in out
    assert rep["torch_threads"] == 1 and torch.get_num_threads() == threads  # restored


def test_bench_prefill_json(tmp_path):
    rep = _run(tmp_path, "prefill", "--prompt-lens", "16,48", "--warmup", "0")
    assert [r["prompt_len"] for r in rep["prefill"]] == [16, 48]
    assert all(r["tokens_per_s"] == pytest.approx(r["prompt_len"] / r["seconds"])
               for r in rep["prefill"])
    assert "decode" not in rep


def test_bench_refuses_bad_sizes(tmp_path):
    assert main(["bench", "decode", "--model", "tiny-llama", "--dummy-weights", "--batch", "0",
                 "--no-show-progress"]) == 1


TINY_GGUF = ["--layers", "2", "--vocab", "512", "--hidden", "256", "--heads", "4", "--kv-heads",
             "2", "--head-dim", "64", "--experts", "4", "--top-k", "2", "--expert-ff", "256"]
# llama-bench's JSON rows: with -ncmoe, one pair of rows per value (here always 0 and 2)
FAKE_LLAMA_BENCH = """#!/bin/sh
echo "llama-bench log line"
case "$*" in
*-ncmoe*) echo '[{"n_cpu_moe": 0, "n_prompt": 16, "n_gen": 0, "avg_ts": 400.0},
 {"n_cpu_moe": 0, "n_prompt": 0, "n_gen": 2, "avg_ts": 8.0},
 {"n_cpu_moe": 2, "n_prompt": 16, "n_gen": 0, "avg_ts": 40.0},
 {"n_cpu_moe": 2, "n_prompt": 0, "n_gen": 2, "avg_ts": 2.0}]' ;;
*) echo '[{"n_prompt": 16, "n_gen": 0, "avg_ts": 400.0},
 {"n_prompt": 0, "n_gen": 2, "avg_ts": 8.0}]' ;;
esac
"""


def test_bench_vs_llamacpp_with_a_stand_in_llama_bench(tmp_path):
    """The comparison script end to end on a tiny random GGUF (FreeToken for real, llama-bench
    replaced by a script printing its JSON format): the table's ratios are ours over theirs."""
    import subprocess
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    gguf_path, fake, out = tmp_path / "t.gguf", tmp_path / "llama-bench", tmp_path / "vs.json"
    subprocess.run([sys.executable, str(repo / "scripts" / "make_random_gguf.py"),
                    str(gguf_path), *TINY_GGUF], check=True, capture_output=True)
    fake.write_text(FAKE_LLAMA_BENCH)
    fake.chmod(0o755)
    subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_vs_llamacpp.py"), "--gguf",
                    str(gguf_path), "--llama", str(fake), "--batch", "1,2", "--prompt", "16",
                    "--gen", "2", "--ft-args", "--prompt-len 4 --warmup 0 --torch-threads 1",
                    "--json", str(out)], check=True, capture_output=True)
    rep = json.loads(out.read_text())
    rows = {r["measure"]: r for r in rep["table"]}
    b1 = rows["decode batch 1 (tokens/s, aggregate)"]
    assert b1["llama.cpp"] == 8.0 and b1["ratio"] == pytest.approx(b1["freetoken"] / 8.0)
    assert rows["decode batch 2 (tokens/s, aggregate)"]["llama.cpp"] is None
    pre = rows["prefill 16 (prompt tokens/s)"]
    assert pre["llama.cpp"] == 400.0 and pre["freetoken"] > 0
    ft = rep["freetoken"][0]
    assert ft["arch"] == "qwen3_moe" and not ft["dummy_weights"]

    # experts off the GPU: FreeToken's cpu backend faces llama-bench -ncmoe 2
    subprocess.run([sys.executable, str(repo / "benchmarks" / "bench_vs_llamacpp.py"), "--gguf",
                    str(gguf_path), "--llama", str(fake), "--batch", "1", "--prompt", "16",
                    "--gen", "2", "--ft-args", "--prompt-len 4 --warmup 0 --torch-threads 1",
                    "--n-cpu-moe", "2", "--cache-backends", "cpu", "--cache-rate", "0.5",
                    "--json", str(out)], check=True, capture_output=True)
    rep = json.loads(out.read_text())
    assert set(rep["llama.cpp"]) == {"0", "2"}
    cpu = [r for r in rep["table"] if r["freetoken_setup"] == "cpu, cache rate 0.5"]
    b1 = next(r for r in cpu if r["measure"].startswith("decode batch 1"))
    assert b1["llama_setup"] == "-ncmoe 2" and b1["llama.cpp"] == 2.0
    assert b1["ratio"] == pytest.approx(b1["freetoken"] / 2.0)
    fused = [r for r in rep["table"] if r["freetoken_setup"] == "all experts on the GPU"]
    assert {r["llama_setup"] for r in fused} == {"all on the GPU"}


def test_forward_failure_stops_the_bench(monkeypatch):
    from freetoken.config import EngineConfig
    from freetoken.engine.bench import Runner
    from freetoken.engine.engine import Engine

    eng = Engine(EngineConfig(model="tiny-llama", dummy_weights=True, show_progress=False))

    def broken(batch, input_ids=None):
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(eng.runner, "forward", broken)
    with pytest.raises(RuntimeError, match="kernel exploded"):
        Runner(eng).decode(batch=2, prompt_len=4, tokens=2, warmup=0)


def test_bench_logs_the_moe_backend_and_its_split(tmp_path, capsys):
    """The engine's log lines reach stderr (--log-level, default info): which MoE backend and
    fetch split a run took, and why (a bandwidth profile's q* or the default without one)."""
    import logging

    log = logging.getLogger("freetoken")
    level, handlers = log.level, list(log.handlers)
    args = ["decode", "--batch", "1", "--tokens", "2", "--prompt-len", "8", "--warmup", "0",
            "--moe-backend", "hybrid", "--moe-cache-rate", "0.5"]
    try:
        _run(tmp_path, *args)
        err = capsys.readouterr().err
        assert "MoE backend hybrid" in err and "q* =" in err
        _run(tmp_path, *args, "--log-level", "warning")
        assert "MoE backend hybrid" not in capsys.readouterr().err
    finally:  # --log-level sets the package logger's level and handler
        log.setLevel(level)
        log.handlers[:] = handlers


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("FREETOKEN_TEST_FULL_BENCH") != "1",
                    reason="minutes on 2 cores; FREETOKEN_TEST_FULL_BENCH=1 runs it")
def test_issue_command(tmp_path):
    out = tmp_path / "full.json"
    assert main(["bench", "decode", "--model", "qwen3-30b-a3b", "--dummy-weights",
                 "--dummy-format", "q4_k", "--dummy-layers", "2", "--batch", "1,4", "--tokens",
                 "8", "--json", str(out), "--no-show-progress", "--torch-threads", "1"]) == 0
    rep = json.loads(out.read_text())
    assert [r["batch"] for r in rep["decode"]] == [1, 4]
    assert all(r["tokens_per_s"] > 0 for r in rep["decode"])


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_profile_decode_step_with_a_cache_backend(capsys, monkeypatch):
    """benchmarks/profile_decode_step.py on the CPU with the hybrid backend: the op table and
    the hand-off worker's table (one job per MoE layer per step, routes the CPU computed) are
    printed; the requests outlive the warm-up, record and profiled steps. With the threshold
    at 0 every profiled step counts as slowed by the profiler, and the note says so."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_decode_step as pds

    monkeypatch.setattr(pds, "PROFILED_SLOWER", 0.0)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # see the module docstring
    try:
        assert pds.main(["--model", "tiny-qwen3-moe", "--dummy-weights", "--dummy-format",
                         "q4_k", "--device", "cpu", "--moe-backend", "hybrid",
                         "--moe-cache-rate", "0.5", "--batch", "1,2", "--steps", "3",
                         "--warmup", "1", "--rows", "5", "--no-show-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert out.count("== hand-off worker, 3 steps without the profiler") == 2
    assert out.count("2.0 jobs per step") == 2  # two MoE layers
    assert "executor (CPU experts' compute)" in out and "counters per step: hits" in out
    assert out.count("copies ahead queued, warming (done -> free)") == 2
    assert out.count("without the profiler; the kernel table's receive and fill times") == 2
    if sys.platform.startswith("linux"):
        assert out.count("host (engine/host_noise.py): steal ") == 2


def test_profile_decode_step_ahead_delays(capsys):
    """profile_decode_step.py --ahead-delays on the CPU (fetching ahead, the worker's memcpy
    copies): the worker's delay is set per round on the running engine, a row per delay
    with its rounds' tokens/s."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_decode_step as pds

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert pds.main(["--model", "tiny-qwen3-moe", "--dummy-weights", "--dummy-format",
                         "q4_k", "--device", "cpu", "--moe-backend", "hybrid",
                         "--moe-cache-rate", "0.5", "--moe-fetch-ahead", "1", "--batch", "1",
                         "--steps", "2", "--warmup", "1", "--rows", "3", "--ahead-delays",
                         "0,50", "--delay-rounds", "2", "--delay-steps", "3",
                         "--no-show-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "copies ahead held back after each answer: 2 rounds of 3 steps" in out
    rows = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["0"], ["50"])]
    assert [r[0] for r in rows] == ["0", "50"]
    assert all(len(r) == 9 and float(r[1]) > 0 for r in rows), rows  # 7 columns, 2 rounds


def test_ab_env_alternates_settings(capsys, monkeypatch):
    """benchmarks/ab_env.py on the CPU: one model, an engine per --set (a switch and an engine
    field), rounds alternated after a warm-up round that is printed and not recorded; a line
    per round and a table row per setting and batch, and the switches restored afterwards. A
    bad --set, no --set or a bad round count is refused."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import ab_env

    monkeypatch.delenv("FREETOKEN_GPU_SIDE_STREAM", raising=False)
    common = ["--model", "tiny-qwen3-moe", "--dummy-weights", "--dummy-format", "q4_k",
              "--device", "cpu", "--moe-backend", "hybrid", "--moe-cache-rate", "0.5",
              "--batch", "1,2", "--tokens", "3", "--warmup", "1", "--no-show-progress"]
    res = ab_env.main(common + ["--set", "FREETOKEN_GPU_SIDE_STREAM=0",
                                "--set", "moe_hybrid_max_fetch=1"])
    assert sorted(res) == [("FREETOKEN_GPU_SIDE_STREAM=0", 1), ("FREETOKEN_GPU_SIDE_STREAM=0", 2),
                           ("moe_hybrid_max_fetch=1", 1), ("moe_hybrid_max_fetch=1", 2)]
    assert all(len(v) == 2 and all(x > 0 for x in v) for v in res.values())
    out = capsys.readouterr().out
    assert out.count("round 1 ") == 4 and out.count("round warm-up ") == 4
    if sys.platform.startswith("linux"):
        assert out.count("preemptions a step)") == 12
    assert "median" in out and "tok/s, each round" in out
    assert "FREETOKEN_GPU_SIDE_STREAM" not in os.environ
    with pytest.raises(SystemExit, match="neither a FREETOKEN_ switch nor an engine field"):
        ab_env.main(common + ["--set", "bogus=1", "--set", "moe_cache_rate=0.25"])
    with pytest.raises(SystemExit, match="'FREETOKEN_GPU_SIDE_STREEM' is no FreeToken switch"):
        ab_env.main(common + ["--set", "FREETOKEN_GPU_SIDE_STREEM=0", "--set", "a=1"])
    with pytest.raises(SystemExit, match="give one --set setting or more"):
        ab_env.main(common)
    with pytest.raises(SystemExit, match="--rounds must be at least 1"):
        ab_env.main(common + ["--rounds", "0", "--set", "a=1", "--set", "b=2"])


def test_profile_decode_step_prefill(capsys):
    """benchmarks/profile_decode_step.py --prefill: one table per prompt length, of that one
    prefill step, and no decode tables with an empty --batch."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_decode_step as pds

    assert pds.main(["--model", "tiny-qwen3-moe", "--dummy-weights", "--dummy-format", "q4_k",
                     "--device", "cpu", "--prefill", "16,40", "--batch", "", "--rows", "3",
                     "--no-show-progress"]) == 0
    out = capsys.readouterr().out
    assert "== prefill 16: 1 steps" in out and "== prefill 40: 1 steps" in out
    assert "== batch" not in out


def test_profile_timeline_idle_gaps():
    """profile_decode_step's timeline: steps cut at the longest idle gaps, the idle time before
    each kernel (nothing of any stream running) summed per name, overlap on a second stream
    not counted as idle, and the middle step's kernels listed in order."""
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import profile_decode_step as pds

    us = 1000
    step = [(0, 10, "a", 7), (12, 20, "b", 7), (15, 30, "side", 9), (31, 40, "a", 7)]
    events = [(s + t0, e + t0, n, st) for t0 in (0, 500 * us, 1000 * us)
              for s, e, n, st in [(s * us, e * us, n, st) for s, e, n, st in step]]
    out = pds._timeline(sorted(events), 3, 3, 10)
    # per step: b waits 2 us, side starts inside b (0), the second a waits 1 us after side;
    # a step's first kernel follows the host's gap, which is not the step's
    assert "timeline: 3 steps, device busy 37.0 us and idle between its activities 3.0 us" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[2:5]}
    assert rows["b"] == ["1.0", "2.0", "2.00"] and rows["a"] == ["1.0", "1.0", "1.00"]
    assert rows["side"] == ["1.0", "0.0", "0.00"]
    assert "step 2: kernels 0 to 3 of 4" in out
    listed = out.splitlines()[-3:]
    assert [line.split()[-1] for line in listed] == ["a", "b", "side"]
    assert listed[1].split()[:4] == ["12.0", "8.0", "2.0", "7"]
