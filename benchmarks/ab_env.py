"""Decode tokens/s of settings side by side on one loaded model: an engine per setting, the
settings alternated for several rounds (on a shared host, runs minutes apart differ by more
than most changes do; the expert-cache backends' CPU side most of all).

    python benchmarks/ab_env.py --model qwen3.6-35b-a3b --dummy-weights --dummy-format nvfp4 \
        --moe-backend hybrid --moe-cache-rate 0.1 --batch 1,4 --rounds 2 \
        --set FREETOKEN_GPU_SIDE_STREAM=1 --set FREETOKEN_GPU_SIDE_STREAM=0

Each `--set` is one setting: comma-separated NAME=VALUE pairs, environment switches
(freetoken/env.py, read when an engine is built or a kernel launched) or engine fields
(`moe_hybrid_max_fetch=1`, `moe_cache_rate=0.25`: EngineConfig's names), applied on top of
the engine flags; a FREETOKEN_ name that freetoken/env.py does not read is refused. The
model is loaded once (`ft bench decode --moe-backends` reuses it the same way); each engine's
CPU threads stop before the next one starts. A warm-up round
(`--warm-rounds`, default 1) runs every setting first and is not recorded: on the H200 the
first engine's batch-1 steps ran at 88 tok/s against 141 a round later (host banks touched
for the first time, kernels compiled). Prints a line per round (on Linux with what the host
did meanwhile: CPU time stolen by other guests, this process's threads preempted a step;
engine/host_noise.py) and a table of every round's tokens/s per setting and batch, with their
median.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _restore(saved: dict[str, str | None]) -> None:
    """The environment switches back to `saved` (None: unset)."""
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _setting(text: str) -> tuple[dict[str, str], dict[str, object]]:
    """'A=1,moe_cache_rate=0.25' -> (environment switches, engine fields)."""
    from freetoken import env as switches
    from freetoken.config import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    env, cfg = {}, {}
    for pair in filter(None, text.split(",")):
        name, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"--set {text!r}: {pair!r} is not NAME=VALUE")
        if name.startswith("FREETOKEN_"):
            if not switches.known(name):
                raise SystemExit(f"--set {text!r}: {name!r} is no FreeToken switch "
                                 "(freetoken/env.py lists them)")
            env[name] = value
        elif name in fields:
            cfg[name] = None if value in ("", "none", "None") else _typed(value)
        else:
            raise SystemExit(f"--set {text!r}: {name!r} is neither a FREETOKEN_ switch nor an "
                             "engine field")
    return env, cfg


def _typed(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def main(argv: list[str] | None = None) -> dict[tuple[str, int], list[float]]:
    from freetoken.cli import add_engine_args, engine_config_from_args
    from freetoken.commands.generate import add_log_level, setup_logging
    from freetoken.engine import bench

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    add_log_level(p)  # each engine says which MoE split it took (a profile's q* or not)
    p.add_argument("--batch", default="1", help="comma-separated decode batch sizes")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--warm-rounds", type=int, default=1,
                   help="rounds run first and not recorded (default 1)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="timed decode steps per batch")
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--set", action="append", default=[], dest="settings",
                   help="one setting: NAME=VALUE[,NAME=VALUE...] (one: its rounds alone)")
    args = p.parse_args(argv)
    setup_logging(args)
    if not args.settings:
        raise SystemExit("give one --set setting or more (two or more to compare)")
    if args.rounds < 1 or args.warm_rounds < 0:
        raise SystemExit("--rounds must be at least 1 and --warm-rounds not negative")
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    base = engine_config_from_args(args)
    parsed = [(s, *_setting(s)) for s in args.settings]
    saved = {k: os.environ.get(k) for _, env, _ in parsed for k in env}
    model, res = None, {}
    try:
        for r in range(-args.warm_rounds, args.rounds):
            for label, env, fields in parsed:
                _restore(saved)  # a switch an earlier setting set is not this one's
                os.environ.update(env)
                cfg = bench.bench_config(dataclasses.replace(base, **fields), batches,
                                         args.prompt_len, args.tokens, args.warmup, [])
                runner = bench._runner(cfg, model)
                model = runner.engine.model
                for row in bench.run_decode(runner, batches, args.prompt_len, args.tokens,
                                            args.warmup, float("nan")):  # no roofline here
                    if r >= 0:
                        res.setdefault((label, row.batch), []).append(row.tokens_per_s)
                    host = ("" if row.steal_pct is None else
                            f" (steal {row.steal_pct:.1f}%, {row.preempted_per_step:.1f} "
                            "preemptions a step)")
                    print(f"round {r if r >= 0 else 'warm-up'} {label} batch {row.batch}: "
                          f"{row.tokens_per_s:.1f} tok/s {row.ms_per_step:.2f} ms/step{host}",
                          flush=True)
                if runner.engine.moe is not None:
                    runner.engine.moe.close()
                del runner
                bench._release()
    finally:
        _restore(saved)
    width = max(len(s) for s in args.settings)
    print(f"\n{'setting':<{width}} {'batch':>5}   {'median':>8}   tok/s, each round")
    for (label, b), xs in res.items():
        print(f"{label:<{width}} {b:>5}   {statistics.median(xs):8.1f}   "
              + " ".join(f"{x:8.1f}" for x in xs))
    return res


if __name__ == "__main__":
    main()
