"""The `ft` command: ft inspect | generate | chat | serve | bench ...

Each subcommand lives in `freetoken/commands/<name>.py` with `add_parser(subparsers)`; its
parser sets `func`. Engine flags are generated from `EngineConfig`'s fields so the defaults
live in one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import typing

from freetoken.config import CACHE_TYPES, DTYPES, DUMMY_FORMATS, MOE_BACKENDS, EngineConfig

COMMANDS = ["inspect", "generate", "chat", "serve", "bench"]

_CHOICES = {"dtype": DTYPES, "cache_type": CACHE_TYPES, "moe_backend": MOE_BACKENDS,
            "dummy_format": DUMMY_FORMATS}
_HELP = {
    "model": "GGUF file, HF directory or packaged model name (default: SmolLM2-135M-Instruct)",
    "dtype": "activation dtype (auto: float32 on CPU, bfloat16 on GPU)",
    "cache_type": "radix: reuse KV pages of shared prompt prefixes; naive: no reuse",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "prompt tokens per step (chunked prefill)",
    "kv_cache_mb": "KV cache size in MiB when --num-pages is not given",
    "moe_backend": "where experts run: auto (fused when every expert fits on the device, else "
    "from the ft bench bw profile), fused, offload, hybrid or cpu",
    "moe_cache_size": "expert slots on the device (offload / hybrid / cpu; default: what fits)",
    "moe_cache_rate": "expert slots as a fraction of all routed experts",
    "moe_hybrid_max_fetch": "hybrid: most experts fetched per layer and step (0: every miss "
    "to the CPU; -1: as the ft bench bw profile's q* says)",
    "moe_fetch_ahead": "offload / hybrid: per layer call, up to N of the next MoE layer's "
    "predicted misses (its router on this layer's input) are copied into slots while the "
    "device runs the layers in between, when the copy engine is idle (0: off; default: 1 with "
    "hybrid, 0 with offload)",
    "decode_log_interval": "a decode log line (tokens/s, expert hit rate, fetches, CPU "
    "experts) every N decode steps; 0: none",
    "moe_cpu_threads": "CPU MoE executor threads (default: physical cores minus one)",
    "moe_prefill_hit_d2d": "prefill (calls of 64 tokens or more stream each layer's whole "
    "expert bank to the device): copy the experts the slot cache holds from their slots, "
    "device to device, instead of over PCIe",
    "disable_moe_prefill_overlap": "prefill streaming without double buffering (copy a layer's "
    "bank, wait, compute): to measure what overlapping the next layer's copy gives",
    "dummy_weights": "random weights made on the device; --model may name a built-in shape",
    "dummy_format": "weight format of --dummy-weights models",
    "dummy_layers": "shorten a --dummy-weights model to N layers",
    "cuda_graph_max_bs": "largest decode batch run as a CUDA graph (default: max running)",
    "disable_cuda_graph": "run decode eagerly, without CUDA graphs",
    "disable_overlap_schedule": "on a GPU, wait for each decode step's tokens before the next "
    "step is launched (by default the next decode step of the same requests is launched from "
    "the sampled ids on the device, and the host's bookkeeping of a step runs while the next "
    "one computes)",
}


def add_engine_args(parser: argparse.ArgumentParser, *, model_positional: bool = False) -> None:
    """Add one --flag per EngineConfig field, defaults taken from the dataclass."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" and model_positional:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        kw: dict = {"default": f.default, "help": _HELP.get(f.name)}
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
            kw["type"] = base
            if f.name in _CHOICES:
                kw["choices"] = _CHOICES[f.name]
        parser.add_argument(flag, **kw)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = EngineConfig.field_names()
    return EngineConfig(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ft", description="FreeToken: serve MoE LLMs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"freetoken.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"freetoken.commands.{name}":
                raise
            continue  # not built yet
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        # User-facing errors (FormatError is a ValueError): one clear line, no traceback.
        print(f"ft {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
