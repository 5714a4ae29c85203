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

That rule takes each side's bandwidth as one figure, measured on jobs of one token (8 experts
for the CPU). The executor reads faster on larger jobs (its start, its barrier and its last
expert's tail are paid once a job: on the H200 host 109 GB/s on 8-expert jobs, more on the
27-expert ones of a batch of 4), so q* of one-token jobs fetched one expert too many a layer
at batch 4 (235.8 against 219.3 tokens/s with the fetches capped at 6, Qwen3.6-35B-A3B NVFP4
hybrid at cache rate 0.1). Where `ft bench bw` also measured jobs of four tokens, `SplitModel`
fits the executor's time of a job of n experts as t0 + n * t_e from the two job sizes (and the
fill's time per expert between them), and F(M) is the integer that finishes first under it:
the later of F * t_fill and t0 + (M - F) * t_e smallest, the larger F among equals (with
t0 = 0 and one fill figure this is floor(q* (M + 1)) again). The bench's layer has its own
expert size; for a model's experts of another size the per-expert times scale by the ratio and
t0 stays (Qwen3-30B-A3B's 2048x768 experts are 1.5 times the bench's 2048x512).
"""

from __future__ import annotations

import functools
import json
import logging
import math
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
# hybrid policy from its profile says so again when the engine starts; the same for the CPU
# time other guests took during the bench (steal, percent)
SPREAD_WARN = 0.15
STEAL_WARN = 2.0


@dataclass(frozen=True)
class SplitModel:
    """The two sides of a layer call's misses in microseconds (module doc), fitted to `ft bench
    bw`'s jobs of one and four tokens: the executor's job of n experts takes t0 + n * t_e; a
    fetched expert takes t_fill(n) while the executor runs a job of n experts (linear between
    the two measured job sizes n1 < n4, constant outside)."""

    t0: float
    t_e: float
    n1: float
    n4: float
    fill1: float
    fill4: float

    @classmethod
    def from_profile(cls, prof: dict, expert_bytes: float | None = None) -> SplitModel | None:
        """The model of a profile with both job sizes' figures (while the fill runs), else
        None (an older profile, or figures that give no positive per-expert time). The bench
        measures its own layer's experts; for a model whose experts are `expert_bytes` each,
        the per-expert times (the executor's and the fill's) scale by the ratio of the sizes
        and a job's fixed cost t0 stays."""
        try:
            b = float(prof["expert_bytes"])
            n1, n4 = float(prof["cpu_experts_b1"]), float(prof["cpu_experts_b4"])
            c1, c4 = float(prof["cpu_fill_both_gbps"]), float(prof["cpu_fill_both_b4_gbps"])
            f1, f4 = float(prof["fill_both_gbps"]), float(prof["fill_both_b4_gbps"])
        except (KeyError, TypeError, ValueError):
            return None
        if not (0 < n1 < n4) or min(c1, c4, f1, f4) <= 0:
            return None
        us = b / 1e3  # bytes / (GB/s) in microseconds
        t1, t4 = n1 * us / c1, n4 * us / c4  # a job's time at each size
        t_e = (t4 - t1) / (n4 - n1)
        t0 = t1 - n1 * t_e
        # noise, a larger job reading slower, or a fixed cost above half the one-token job
        # (the executor's start, barrier and tail: 20-30 us of some 150 on the H200 host;
        # 163 us came from a one-token figure measured during a transient, bw_bench's
        # both_rounds): one figure (q*)
        if t_e <= 0 or t0 < 0 or t0 > t1 / 2:
            t0, t_e = 0.0, us / c1
        r = 1.0 if expert_bytes is None else float(expert_bytes) / b
        return cls(t0, t_e * r, n1, n4, us / f1 * r, us / f4 * r)

    def fill_time(self, n_cpu: int) -> float:
        a = min(1.0, max(0.0, (n_cpu - self.n1) / (self.n4 - self.n1)))
        return self.fill1 + a * (self.fill4 - self.fill1)

    def cpu_time(self, n: int) -> float:
        return 0.0 if n <= 0 else self.t0 + n * self.t_e

    def fetches(self, m: int) -> int:
        """F of m misses: the later side's time smallest, the larger F among equals. The
        fill's side grows with F and the CPU's shrinks, so the best F is one of the two
        beside their crossing."""
        f = 0
        while f < m and f * self.fill_time(m - f) < self.cpu_time(m - f):
            f += 1
        if f == 0:
            return 0
        later = [max(g * self.fill_time(m - g), self.cpu_time(m - g)) for g in (f - 1, f)]
        return f if later[1] <= later[0] * (1 + 1e-12) else f - 1


@dataclass(frozen=True)
class FetchPolicy:
    """fetch_limit(misses) for one backend; `q` None = every miss (offload); `model`: the
    split of a profile with both job sizes (else floor(q (M + 1)))."""

    q: float | None
    cap: int | None  # None = no cap
    why: str
    model: SplitModel | None = None

    def limits(self, n: int) -> tuple[int, ...]:
        """F for M = 0 .. n misses, before the cap (the plan kernel's table)."""
        return _limits(self.q, self.model, n)

    def __call__(self, misses: torch.Tensor) -> torch.Tensor:
        if self.q is None:
            f = misses
        elif self.model is None:
            f = torch.floor((misses.double() + 1) * self.q).long()  # the module doc's rule
        else:
            table = limit_table(self, TORCH_LIMIT_TABLE, misses.device)
            # take, not table[m]: indexing with a 0-dim tensor reads it on the host (a sync,
            # refused inside a CUDA graph's capture)
            f = torch.take(table, torch.as_tensor(misses).long().clamp(0, TORCH_LIMIT_TABLE - 1))
            f = f.long()
        return f if self.cap is None else f.clamp(max=self.cap)


def ahead_counts(fetch_limit) -> bool:
    """Whether a plan under `fetch_limit` counts a call's hits on slots filled ahead as its
    fetches, F = min(F(misses + a), cap) - a (`SlotCache.plan`, the plan kernel, the
    worker's warming): a FetchPolicy's split does; an int limit (every miss, capped) does
    not."""
    return isinstance(fetch_limit, FetchPolicy)


# The plan kernel's table: F for up to this many - 1 misses (a call it plans has at most
# slot_plan.MAX_ROUTES routes); the torch plan's covers any expert count of a layer.
LIMIT_TABLE = 128
TORCH_LIMIT_TABLE = 1024
_TABLES: dict = {}


def limit_table(policy: FetchPolicy | None, size: int, device) -> torch.Tensor:
    """int32 [size] on `device`: F for M = 0 .. size - 1 misses before the cap (None: every
    miss), made once per (policy rule, size, device) and kept, so that CUDA graphs that read it
    (captured after an eager step made it) never see it freed."""
    q = None if policy is None else policy.q
    model = None if policy is None else policy.model
    key = (q, model, size, str(torch.device(device)))
    if key not in _TABLES:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"limit_table: the fetch table of {policy!r} ({size} entries) "
                               "was not made before CUDA graph capture "
                               "(prepare_limit_tables at set-up)")
        _TABLES[key] = torch.tensor(_limits(q, model, size - 1), dtype=torch.int32,
                                    device=device)
    return _TABLES[key]


def prepare_limit_tables(policy, device) -> None:
    """Make the tables a slot cache on `device` reads with `policy` (a FetchPolicy, or an int
    limit: every miss), before any CUDA graph is captured: the plan kernel's, every miss's
    (offload's later rounds) and the torch plan's (calls of more routes, such as a decode
    graph of 16 tokens)."""
    rule = policy if isinstance(policy, FetchPolicy) else None
    for p, size in ((None, LIMIT_TABLE), (rule, LIMIT_TABLE), (rule, TORCH_LIMIT_TABLE)):
        limit_table(p, size, device)


@functools.lru_cache(maxsize=64)
def _limits(q: float | None, model: SplitModel | None, n: int) -> tuple[int, ...]:
    if q is None:
        return tuple(range(n + 1))
    if model is None:  # floor((M + 1) q) in float64, as the torch op and the kernel had it
        return tuple(int(math.floor((m + 1) * q)) for m in range(n + 1))
    return tuple(model.fetches(m) for m in range(n + 1))


def fetch_policy(backend: str, max_fetch: int | None, profile: dict | None,
                 expert_bytes: float | None = None) -> FetchPolicy:
    """offload: all; cpu: none; hybrid: q* M from the profile, capped by max_fetch (0 = none
    fetched, -1 / None = no cap beyond the profile's), or DEFAULT_Q capped at DEFAULT_CAP.
    `expert_bytes`: the model's bytes an expert, to which the split model scales the bench's
    per-expert times (None: the bench's own experts)."""
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
        spread = max(profile.get("cpu_spread") or 0.0, profile.get("both_spread") or 0.0)
        steal = profile.get("steal_pct") or 0.0
        busy = (f" (measured while this machine's memory bandwidth varied: its executor "
                f"rounds {spread:.0%} apart; run `ft bench bw` again on a quiet machine)"
                if spread > SPREAD_WARN else "")
        if steal > STEAL_WARN:
            busy += (f" (measured while other guests of this host took {steal:.1f}% of its "
                     "CPUs' time; run `ft bench bw` again on a quiet machine)")
        model = SplitModel.from_profile(profile, expert_bytes)
        split = ""
        if model is not None:
            f = _limits(q, model, 32)
            size = ("" if expert_bytes is None else
                    f" of {expert_bytes / 1e6:.2f} MB experts (the bench's: "
                    f"{float(profile['expert_bytes']) / 1e6:.2f} MB)")
            split = (f"; fetches by job size{size} (executor {model.t0:.0f} us + "
                     f"{model.t_e:.1f} us an expert): F(7) = {f[7]}, F(27) = {f[27]}")
        return FetchPolicy(q, cap, f"hybrid: q* = {q:.2f} from the ft bench bw profile" + split
                           + (f", at most {cap} per layer" if cap is not None else "") + busy,
                           model)
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
