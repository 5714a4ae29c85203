"""`ft bench BENCH ...`: benchmarks, one sub-command each (cpu-moe, bw, decode, prefill).

Each entry of BENCHES adds its own arguments and runs lazily imported code, so `ft --help`
stays cheap.
"""

from __future__ import annotations

import argparse


def _cpu_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None,
                   help="executor threads (default: physical cores minus one)")
    p.add_argument("--isa", default=None,
                   help="comma-separated tiers or caps to run (avx512_vnni, avx2_vnni, "
                   "avx512_fp32, avx2_fp32, scalar, or avx512 / avx2); default: all this CPU has")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def _cpu_moe_run(args: argparse.Namespace) -> int:
    from freetoken.moe.cpu_bench import main

    return main(args.threads, args.isa, args.json)


def _bw_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--formats", default="nvfp4,q4_k",
                   help="comma-separated expert formats: nvfp4, q4_k, q4_k_m, q8_0 "
                   "(default nvfp4,q4_k)")
    p.add_argument("--threads", type=int, default=None,
                   help="executor threads (default: physical cores minus one)")
    p.add_argument("--budget-mb", type=int, default=2048,
                   help="host expert pool per format, MiB (default 2048: several times the LLC)")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="seconds per measurement (default 1)")
    p.add_argument("--no-save", action="store_true",
                   help="do not write the profile to the cache folder")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")


def _bw_run(args: argparse.Namespace) -> int:
    from freetoken.moe.bw_bench import run

    run(args.formats, args.threads, args.budget_mb, args.seconds, args.json, not args.no_save)
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}") from None


def _moe_runs(args: argparse.Namespace) -> list[tuple[str, float]] | None:
    """The (backend, rate) sweep; it replaces --moe-backend / --moe-cache-rate / -size, so
    giving those too is refused rather than ignored."""
    if args.moe_backends is None and args.moe_cache_rates is None:
        return None
    if args.moe_backends is None or not args.moe_cache_rates:
        raise ValueError("--moe-backends and --moe-cache-rates go together")
    if args.moe_backend != "auto" or args.moe_cache_rate is not None or \
            args.moe_cache_size is not None:
        raise ValueError("--moe-backends / --moe-cache-rates sweep the MoE backend and cache "
                         "rate: drop --moe-backend, --moe-cache-rate and --moe-cache-size")
    backends = [b.strip() for b in args.moe_backends.split(",") if b.strip()]
    return [(b, r) for b in backends for r in args.moe_cache_rates]


def _engine_bench_args(p: argparse.ArgumentParser, prefill: bool) -> None:
    from freetoken.cli import add_engine_args
    from freetoken.commands.generate import add_log_level

    add_engine_args(p)
    add_log_level(p)  # the engine's log lines: which MoE backend and split, and why
    if not prefill:
        p.add_argument("--batch", type=_ints, default=[1, 4, 16],
                       help="comma-separated decode batch sizes (default 1,4,16)")
        p.add_argument("--prompt-len", type=int, default=128,
                       help="prompt tokens of each decoding request (default 128)")
        p.add_argument("--tokens", type=int, default=64,
                       help="timed decode steps per batch size (default 64)")
        p.add_argument("--prefill", action="store_true",
                       help="also measure prefill (--prompt-lens)")
    p.add_argument("--prompt-lens", type=_ints, default=[512, 2048],
                   help="prompt lengths of the prefill measurement (default 512,2048)")
    p.add_argument("--warmup", type=int, default=2,
                   help="untimed decode steps before timing (graph capture, autotuning); "
                   "prefill runs each length once untimed when > 0")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's; 1 on a busy shared CPU)")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="torch.profiler chrome trace of one decode step at the first batch size")
    p.add_argument("--moe-backends", default=None,
                   help="sweep: comma-separated MoE cache backends (offload, cpu, hybrid), each "
                   "measured at every --moe-cache-rates value on one loaded model")
    p.add_argument("--moe-cache-rates", type=_floats, default=None,
                   help="sweep: comma-separated expert cache rates (with --moe-backends)")


def _engine_bench_run(args: argparse.Namespace, prefill_only: bool) -> int:
    from freetoken.cli import engine_config_from_args
    from freetoken.commands.generate import setup_logging
    from freetoken.engine.bench import main

    setup_logging(args)
    main(engine_config_from_args(args), batches=getattr(args, "batch", [1]),
         prompt_len=getattr(args, "prompt_len", 128), tokens=getattr(args, "tokens", 8),
         warmup=args.warmup, prompt_lens=args.prompt_lens, decode=not prefill_only,
         prefill=prefill_only or args.prefill, json_path=args.json, profile_path=args.profile,
         torch_threads=args.torch_threads, moe_runs=_moe_runs(args))
    return 0


# name -> (help, add arguments, run)
BENCHES = {
    "cpu-moe": ("CPU MoE executor GB/s per ISA tier vs the memory read ceiling",
                _cpu_moe_args, _cpu_moe_run),
    "bw": ("CPU executor and PCIe expert GB/s, alone and at once: the hybrid split q* and "
           "the recommended MoE backend (a profile in the cache folder)", _bw_args, _bw_run),
    "decode": ("engine decode tokens/s per batch size, weight bytes per step and the share of "
               "the memory bandwidth measured in the same run",
               lambda p: _engine_bench_args(p, prefill=False),
               lambda a: _engine_bench_run(a, prefill_only=False)),
    "prefill": ("engine prompt tokens/s for each --prompt-lens length",
                lambda p: _engine_bench_args(p, prefill=True),
                lambda a: _engine_bench_run(a, prefill_only=True)),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (help_, add_args, run) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_, description=help_)
        add_args(bp)
        bp.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)
