"""`ft bench BENCH ...`: benchmarks, one sub-command each (cpu-moe; bw joins later).

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


# name -> (help, add arguments, run)
BENCHES = {
    "cpu-moe": ("CPU MoE executor GB/s per ISA tier vs the memory read ceiling",
                _cpu_moe_args, _cpu_moe_run),
}


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, (help_, add_args, run) in BENCHES.items():
        bp = bsub.add_parser(name, help=help_, description=help_)
        add_args(bp)
        bp.set_defaults(func=run)
    p.set_defaults(func=lambda args: p.print_help() or 2)
