"""Which MoE backend, how many slots, and how many misses to fetch (DESIGN.md, hybrid split).

q* = B_pcie / (B_pcie + B_cpu), both measured while they run at once by `ft bench bw` and
stored in a profile (JSON in the user's cache folder) keyed by expert format, GPU and CPU.
Without a profile the hybrid backend fetches a fixed small number per layer call.

F, the misses fetched out of M, is an integer: F = floor(q* (M + 1)). The fetches take
F (1 - q*) and the CPU (M - F) q* (in units of an expert's time over both links at once);
they cross at F = q* M, and of the two integers beside it the upper one finishes first
exactly when the crossing's fraction exceeds 1 - q*, that is floor(q* M + q*). Rounding to the
nearest instead fetched one expert too many whenever that fraction lay between 1/2 and 1 - q*
(30B Q4_K at q* 0.37: M = 7 gave F = 3, whose fill outlasted the CPU's four by 30%).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import torch

from freetoken import env
from freetoken.moe.banks import ExpertBank

logger = logging.getLogger(__name__)
DEFAULT_Q = 0.3  # q* measured on the GPU machine (FACTS.md: 44 / 139), used without a profile
DEFAULT_CAP = 2  # without a profile: at most this many fetches per layer call
PROFILE_FILE = "bw_profile.json"


def expert_format(bank: ExpertBank) -> str:
    """The profile key of a bank's format: nvfp4, mxfp4, bf16, or the GGUF type (q4_k)."""
    w = bank.w13
    if w.fmt == "gguf":
        return gguf.GGMLQuantizationType(w.ggml_type).name.lower()
    return w.fmt


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def gpu_model() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "none"


def profile_key(fmt: str, gpu: str | None = None, cpu: str | None = None) -> str:
    return f"{fmt}|{gpu if gpu is not None else gpu_model()}|{cpu or cpu_model()}"


def profile_path() -> Path:
    base = env.cache_dir() or os.path.join(os.path.expanduser("~"), ".cache", "freetoken")
    return Path(base) / PROFILE_FILE


def load_profiles(path: Path | None = None) -> dict:
    p = path or profile_path()
    try:
        return json.loads(p.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        logger.warning("ignoring the bandwidth profile %s: %s", p, e)
        return {}


def save_profiles(entries: dict, path: Path | None = None) -> Path:
    """Merge `entries` (key -> figures) into the profile file."""
    p = path or profile_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    data = load_profiles(p)
    data.update(entries)
    p.write_text(json.dumps(data, indent=1))
    return p


def find_profile(fmt: str) -> dict | None:
    """This machine's profile for an expert format; None without one, or when it holds no
    PCIe figures (measured without a GPU: it says nothing about the split)."""
    prof = load_profiles().get(profile_key(fmt))
    if prof is None or prof.get("pcie_both_gbps") is None:
        return None
    return prof


# (max - min) / median of `ft bench bw`'s executor rounds above which the bench says so, and a
# hybrid policy from its profile says so again when the engine starts
SPREAD_WARN = 0.15


@dataclass(frozen=True)
class FetchPolicy:
    """fetch_limit(misses) for one backend; `q` None = every miss (offload)."""

    q: float | None
    cap: int | None  # None = no cap
    why: str

    def __call__(self, misses: torch.Tensor) -> torch.Tensor:
        if self.q is None:
            f = misses
        else:
            f = torch.floor((misses.double() + 1) * self.q).long()  # the module doc's rule
        return f if self.cap is None else f.clamp(max=self.cap)


def fetch_policy(backend: str, max_fetch: int | None, profile: dict | None) -> FetchPolicy:
    """offload: all; cpu: none; hybrid: q* M from the profile, capped by max_fetch (0 = none
    fetched, -1 / None = no cap beyond the profile's), or DEFAULT_Q capped at DEFAULT_CAP."""
    if backend == "offload":
        return FetchPolicy(None, None, "offload: every miss fetched")
    if backend == "cpu":
        return FetchPolicy(0.0, 0, "cpu: every miss computed by the CPU executor")
    if max_fetch is not None and max_fetch < -1:
        raise ValueError(f"moe_hybrid_max_fetch must be -1 (from the profile), 0 (every miss "
                         f"to the CPU) or a positive cap, got {max_fetch}")
    cap = None if max_fetch in (None, -1) else max_fetch
    if profile is not None:
        q = float(profile["q_star"])
        spread = profile.get("cpu_spread") or 0.0
        busy = (f" (measured while this machine's memory bandwidth varied: its executor "
                f"rounds {spread:.0%} apart; run `ft bench bw` again on a quiet machine)"
                if spread > SPREAD_WARN else "")
        return FetchPolicy(q, cap, f"hybrid: q* = {q:.2f} from the ft bench bw profile"
                           + (f", at most {cap} per layer" if cap is not None else "") + busy)
    cap = DEFAULT_CAP if cap is None else cap
    return FetchPolicy(DEFAULT_Q, cap, f"hybrid: no ft bench bw profile for this machine and "
                       f"format: q* = {DEFAULT_Q}, at most {cap} fetches per layer")


def num_slots(total: int, top_k: int, size: int | None, rate: float | None,
              fits: int) -> tuple[int, str]:
    """Slots of the cache from --moe-cache-size / --moe-cache-rate (else `fits`, what the
    device holds), checked against one layer's top-k working set and clamped to `total`."""
    if size is not None and rate is not None:
        raise ValueError("give --moe-cache-size or --moe-cache-rate, not both")
    if rate is not None and not 0 < rate:
        raise ValueError(f"moe_cache_rate must be positive, got {rate}")
    if size is not None:
        n, why = size, f"--moe-cache-size {size}"
    elif rate is not None:
        n, why = max(1, round(rate * total)), f"--moe-cache-rate {rate} of {total} experts"
    else:
        n, why = fits, "what fits on the device"
    if n < top_k:
        raise ValueError(f"the MoE slot cache ({n} slots, {why}) is smaller than one layer's "
                         f"top-k working set ({top_k} experts): raise --moe-cache-size / "
                         "--moe-cache-rate")
    if n > total:
        logger.info("MoE slot cache: %d slots (%s) is more than all %d routed experts; "
                    "clamped to %d", n, why, total, total)
        n, why = total, why + f", clamped to all {total} experts"
    return n, why
