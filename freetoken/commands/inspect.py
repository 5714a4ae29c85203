"""`ft inspect [PATH] [--json]`: what a model file holds and whether FreeToken accepts it.

PATH is a GGUF file, an HF directory or a packaged model name; without it, the default model.
"""

from __future__ import annotations

import argparse
import json

from freetoken import assets
from freetoken.formats.inspect_gguf import summarize_path


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF file or HF directory and validate it")
    known = ", ".join(assets.known_models())
    p.add_argument("path", nargs="?", default=None,
                   help=f"GGUF file, HF directory or packaged model ({known}; "
                   f"default {assets.DEFAULT_MODEL})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _fmt_count(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit} ({n:,})"
    return str(n)


def _print_text(s: dict) -> None:
    rows = [
        ("path", s["path"]),
        ("format", s["format"] + (f" v{s['gguf_version']}" if "gguf_version" in s else "")),
        ("architecture", s.get("architecture")),
        ("file type", s.get("file_type") or s.get("quantization") or "-"),
        ("parameters", _fmt_count(s["parameters"])),
        ("tensors", s["tensors"]),
        ("tensor types", ", ".join(f"{k} x{v}" for k, v in
                                   (s.get("tensor_types") or s.get("dtypes") or {}).items())),
        ("quantization", s.get("quantization") or "none"),
        ("second-level scales", f"{len(s['second_level_scales'])} weights"
         if s["second_level_scales"] else "none"),
        ("context length", s.get("context_length")),
        ("vocabulary", s.get("vocab_size")),
        ("chat template", "yes" if s.get("chat_template") else "no"),
        ("validation", s["validation"]),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        if isinstance(v, list):
            v = ", ".join(map(str, v))
        print(f"{k:<{width}}  {v}")
    for name in s["second_level_scales"]:
        print(f"{'':<{width}}    scaled: {name}")


def run(args: argparse.Namespace) -> int:
    summary = summarize_path(assets.resolve_model(args.path))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_text(summary)
    return 0 if summary["validation"] == "ok" else 1
