"""The lines `ft serve` prints once the model is loaded: where to point a browser and a client,
what is served, on which MoE backend, how much memory it took, and the context length."""

from __future__ import annotations

import os
import resource
import sys


def _host_for_url(host: str) -> str:
    """A wildcard bind address is not a place to browse to: show the loopback address."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def rss_gib() -> float:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, B on macOS
        return peak / (2**30 if sys.platform == "darwin" else 2**20)


def moe_backend(engine) -> str:
    model = getattr(engine, "model", None)
    if model is None:
        return "unknown"
    from freetoken.moe.runtime import expert_modules

    if not expert_modules(model):
        return "none (a dense model)"
    runtime = getattr(engine, "moe", None)
    return runtime.backend if runtime is not None else "fused (all experts on the device)"


def memory(engine) -> str:
    text = f"{rss_gib():.2f} GiB host (resident)"
    device = getattr(engine, "device", None)
    if getattr(device, "type", None) == "cuda":
        import torch

        text += f", {torch.cuda.memory_allocated(device) / 2**30:.2f} GiB on {device}"
    return text


def banner(state, engine, host: str, port: int, api_key: bool, model_path: str) -> str:
    base = f"http://{_host_for_url(host)}:{port}"
    key = " (API key required)" if api_key else ""
    device = getattr(engine, "device", "cpu")
    dtype = str(getattr(engine, "dtype", "")).replace("torch.", "")
    return "\n".join([
        f"FreeToken is serving {state.served_model_name!r}",
        f"  chat page    {base}/",
        f"  API          {base}/v1{key}: OpenAI chat/completions, completions, responses; "
        "Anthropic messages",
        f"  model        {model_path} on {device}{' ' + dtype if dtype else ''}; parsers: "
        f"reasoning {state.reasoning_parser}, tool calls {state.tool_call_parser}",
        f"  MoE backend  {moe_backend(engine)}",
        f"  memory       {memory(engine)}",
        f"  context      {int(engine.max_model_len)} tokens per request",
    ])
