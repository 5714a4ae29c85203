"""FreeToken: serve Mixture-of-Experts LLMs that are larger than GPU memory."""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # Lazy so that `import freetoken` (and `ft inspect`) stays cheap.
    if name == "LLM":
        from freetoken.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from freetoken.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
