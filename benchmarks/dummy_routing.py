"""How uniformly a `--dummy-weights` model routes its tokens, per format and per MoE layer.

The expert-cache benchmarks compute their ceilings assuming uniform routing: each token's top-k
spread evenly over the experts, independently across tokens and steps. A random-weight model
only stands in for a real one if it routes like that. For each format this prefills `--batch`
sequences of `--prompt-len` random token ids, decodes `--decode` greedy steps, records the
expert ids every MoE layer gets, and prints per layer:

- `pre_cov`:   distinct experts the prefill tokens used / E;
- `pre_max`:   the busiest expert's share of the prefill's picks, times E (1 = even);
- `pre_H`:     entropy of the prefill's expert counts / log E (1 = even);
- `dec_cov`, `dec_max`: the same over the decode tokens (all sequences);
- `reuse`:     share of a decode token's k experts that its sequence's previous token also used
               (uniform: k / E);
- `lru`:       hit rate of an LRU cache of `--cache-rate` x E experts for this layer alone, fed
               the decode steps (the batch's union per step; uniform: about the cache rate at
               batch 1).

The `uniform` rows are the same statistics of ids drawn uniformly (top-k without replacement),
the same counts, for comparison.

    python benchmarks/dummy_routing.py [--model qwen3-30b-a3b] [--formats nvfp4,q4_k,bf16]
        [--layers 2] [--prompt-len 256] [--decode 48] [--batch 1] [--cache-rate 0.1]
    python benchmarks/dummy_routing.py --gguf FILE ...   # a random GGUF's routing
"""

from __future__ import annotations

import argparse
import math
from collections import OrderedDict

import torch

from freetoken.layers.moe import FusedExperts
from freetoken.models.dummy import load_dummy
from freetoken.models.testing import SimpleKV, attach_states, pages_needed


# ---- recording ---------------------------------------------------------------------------------
class Recorder:
    """Expert ids [T, k] of every forward of every MoE layer, in call order."""

    def __init__(self, model):
        self.calls: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        layers = [m for m in model.modules() if isinstance(m, FusedExperts)]
        for i, mod in enumerate(layers):
            self.calls[i] = []
            self.handles.append(mod.register_forward_pre_hook(self._hook(i)))

    def _hook(self, i: int):
        def hook(_mod, args):
            self.calls[i].append(args[1].detach().to("cpu", torch.int64).clone())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def run_tokens(model, prompts: list[list[int]], steps: int) -> None:
    """Prefill `prompts` in one forward, then `steps` greedy decode steps of every sequence."""
    dev = model.model.norm.weight.device
    lens = [len(p) + steps for p in prompts]
    kv = SimpleKV(model.kv_cache_shapes(), pages_needed(lens, 16), 16,
                  dtype=model.model.embed_tokens.dtype, device=dev)
    feed, states = prompts, None
    for _ in range(steps + 1):
        ctx = kv.context([(i, len(f)) for i, f in enumerate(feed)])
        states = attach_states(model, ctx, len(feed), states)
        ids = torch.tensor([t for f in feed for t in f], dtype=torch.int64, device=dev)
        logits = model.compute_logits(model(ids, ctx)[ctx.logits_indices])
        feed = [[int(t)] for t in logits.argmax(-1).cpu()]


# ---- statistics --------------------------------------------------------------------------------
def spread(ids: torch.Tensor, num_experts: int) -> tuple[float, float, float]:
    """(coverage, max share x E, entropy / log E) of the expert ids [T, k]."""
    counts = torch.bincount(ids.flatten(), minlength=num_experts).double()
    p = counts / counts.sum()
    h = -(p[p > 0] * p[p > 0].log()).sum().item()
    return ((counts > 0).double().mean().item(), p.max().item() * num_experts,
            h / math.log(num_experts))


def reuse(steps: list[torch.Tensor]) -> float:
    """Mean share of a token's experts that its sequence's previous decode token used."""
    shared, total = 0, 0
    for prev, cur in zip(steps, steps[1:]):  # [B, k] each
        for a, b in zip(prev.tolist(), cur.tolist()):
            shared += len(set(a) & set(b))
            total += len(b)
    return shared / max(total, 1)


def lru_hit_rate(steps: list[torch.Tensor], capacity: int) -> float:
    """Hits / lookups of an LRU of `capacity` experts fed each step's distinct experts."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0
    for ids in steps:
        for e in sorted(set(ids.flatten().tolist())):
            lookups += 1
            if e in cache:
                hits += 1
                cache.move_to_end(e)
            else:
                cache[e] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / max(lookups, 1)


def row(prefill: torch.Tensor, decode: list[torch.Tensor], num_experts: int,
        cache_rate: float) -> dict[str, float]:
    pc, pm, ph = spread(prefill, num_experts)
    dc, dm, _ = spread(torch.cat(decode), num_experts)
    cap = max(1, round(cache_rate * num_experts))
    return dict(pre_cov=pc, pre_max=pm, pre_H=ph, dec_cov=dc, dec_max=dm, reuse=reuse(decode),
                lru=lru_hit_rate(decode, cap))


def uniform_ids(tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(tokens, num_experts, generator=gen).topk(top_k, dim=-1).indices


# ---- the table ---------------------------------------------------------------------------------
COLUMNS = ["pre_cov", "pre_max", "pre_H", "dec_cov", "dec_max", "reuse", "lru"]


def measure(model_name: str, fmt: str, layers: int, prompt_len: int, decode: int, batch: int,
            cache_rate: float, seed: int, dtype: torch.dtype, device: str,
            gguf: str | None = None) -> tuple[list[dict], object]:
    if gguf:  # a file (scripts/make_random_gguf.py's) instead of a dummy model
        from freetoken.models import load_model

        model, _ = load_model(gguf, dtype=dtype, device=device, show_progress=False)
    else:
        model = load_dummy(model_name, fmt, layers, dtype=dtype, device=device, seed=seed,
                           show_progress=False)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed + 100)
    prompts = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen).tolist()
    rec = Recorder(model)
    run_tokens(model, prompts, decode)
    rec.remove()
    rows = []
    for layer, calls in rec.calls.items():
        rows.append(dict(fmt=fmt, layer=layer, **row(calls[0], calls[1:], cfg.num_experts,
                                                     cache_rate)))
    del model
    return rows, cfg


def uniform_row(num_experts: int, top_k: int, prompt_len: int, decode: int, batch: int,
                cache_rate: float, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    pre = uniform_ids(batch * prompt_len, num_experts, top_k, gen)
    dec = [uniform_ids(batch, num_experts, top_k, gen) for _ in range(decode)]
    return dict(fmt="uniform", layer="-", **row(pre, dec, num_experts, cache_rate))


def print_table(rows: list[dict]) -> None:
    print(f"{'format':>8} {'layer':>5} " + " ".join(f"{c:>7}" for c in COLUMNS))
    for r in rows:
        print(f"{r['fmt']:>8} {r['layer']!s:>5} " + " ".join(f"{r[c]:7.3f}" for c in COLUMNS))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--formats", default="nvfp4,q4_k,bf16")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--cache-rate", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gguf", default=None, metavar="FILE",
                    help="measure this GGUF's routing instead (scripts/make_random_gguf.py's "
                    "files; --model / --formats / --layers unused)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for fmt in ["file"] if a.gguf else a.formats.split(","):
        got, cfg = measure(a.model, fmt, a.layers, a.prompt_len, a.decode, a.batch,
                           a.cache_rate, a.seed, getattr(torch, a.dtype), a.device, a.gguf)
        rows += got
    if a.gguf:
        a.model, a.layers = a.gguf, cfg.num_layers
    rows.append(uniform_row(cfg.num_experts, cfg.num_experts_per_tok, a.prompt_len, a.decode,
                            a.batch, a.cache_rate, a.seed))
    print(f"{a.model}, {a.layers} layers, batch {a.batch}, prefill {a.prompt_len} random ids, "
          f"{a.decode} greedy decode steps, LRU of {a.cache_rate:g} x E per layer")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
