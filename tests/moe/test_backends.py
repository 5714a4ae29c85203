"""The offload, cpu and hybrid MoE backends against fused, on the tiny MoE models, the CPU
standing in as the device.

Reference: the fused backend (the torch reference kernel, every expert resident; the CPU's
int8 dots, which fused would take at decode sizes, are switched off here by
FREETOKEN_CPU_FLOAT=1) on the same loaded model. The dense weights are dequantized to fp32
once before decoding (in every run alike: only the routed experts differ between backends),
which keeps 32 tokens cheap.

- offload computes with the same torch kernel from slots, in another order of experts: the
  same greedy tokens, 32 of them, batch 1 and 4.
- cpu and hybrid compute misses with the CPU executor. On float banks its fp32 dots agree
  with torch to ~1e-6: the same greedy tokens. On quantized banks (GGUF, NVFP4) it quantizes
  activations to 8 bits (as llama.cpp does), so logits move by a few 1e-3 of their range and a
  near-tie may flip: decoded teacher-forced on fused's tokens, the logits must stay within
  QUANT_TOL of the logit range and the top-1 must agree wherever fused's top-2 margin exceeds
  twice the observed difference (random tiny models have near-ties, see test_moe_llamacpp.py).
- Counters: hits + misses = the distinct experts each layer call routes to (counted here from
  the router's own ids), fetched + cpu = misses, and the quarter cache evicts.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.formats.dequant import dequantize
from freetoken.formats.qweight import QuantWeight
from freetoken.layers.embedding import Embedding
from freetoken.layers.linear import Linear
from freetoken.layers.moe import FusedExperts
from freetoken.models import load_model
from freetoken.models.testing import SimpleKV, attach_states, pages_needed
from freetoken.moe.runtime import configure_moe


@pytest.fixture(autouse=True)
def _warming_on(monkeypatch):
    """Warming (FREETOKEN_MOE_PREFETCH, off by default) on in every case here: it must change
    no result, and the counters below check that it ran."""
    monkeypatch.setenv("FREETOKEN_MOE_PREFETCH", "1")


DATA = Path(__file__).resolve().parents[1] / "data"
TOKENS = 32
# max |logit diff| / logit range with 8-bit activations on the CPU side. Observed (teacher-
# forced, 32 steps): qwen3-moe GGUF cpu / hybrid 0.018-0.023; gemma4 GGUF hybrid bs4 0.090 (one
# Q4_K layer alone: 1.4% of its output's max, amplified by gemma's softcapped logits);
# qwen3.5-moe GGUF hybrid bs1 0.012, cpu bs4 0.115 (its recurrent state carries the error on);
# NVFP4 0.005-0.006; HF BF16 0.005; the MXFP4 layers agree to 1e-7 (fp32 kernel). A wrong
# expert, scale or double-counted route moves logits by O(range); test_moe_llamacpp.py allows
# a quarter.
QUANT_TOL = 0.15


@pytest.fixture(autouse=True)
def torch_reference_kernels(monkeypatch):
    """fused and the slot paths in the same float math (see the module docstring)."""
    monkeypatch.setenv("FREETOKEN_CPU_FLOAT", "1")


PROMPTS = [[1, 450, 3000, 77, 900], [1, 12, 7000], [1, 3333, 44, 5], [1, 808, 9000, 21, 3, 64]]


def gguf_source(arch: str) -> Path:
    return DATA / f"tiny_{arch}_q4k-mxfp4.gguf"  # layer 0 experts Q4_K, layer 1 MXFP4


def hf_source(arch: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_moe

    return tiny_moe.hf_dir(arch)


def nvfp4_source(arch: str) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import tiny_moe

    return tiny_moe.nvfp4_dir(arch)


# case id -> (path builder, quantized experts: the CPU side quantizes activations)
CASES = {
    "qwen3_moe-gguf": (lambda: gguf_source("qwen3_moe"), True),
    "gemma4-gguf": (lambda: gguf_source("gemma4"), True),
    "qwen3_5_moe-gguf": (lambda: gguf_source("qwen3_5_moe"), True),
    "qwen3_moe-hf": (lambda: hf_source("qwen3_moe"), False),
    "minimax_m2-hf": (lambda: hf_source("minimax_m2"), False),
    "qwen3_moe-nvfp4": (lambda: nvfp4_source("qwen3_moe"), True),
    "qwen3_moe-hf-bf16": (lambda: hf_source("qwen3_moe"), True),  # bf16 rounding: not exact
}
Q, X2 = 0.25, 2.0  # cache: a quarter of one layer's experts (evictions), twice the count
# (case, backend, cache slots per expert, batch): the whole product (3 backends x 2 caches x
# batch 1 and 4) on qwen3-moe GGUF; each other architecture and format with evictions.
MATRIX = [("qwen3_moe-gguf", b, r, n) for b in ("offload", "cpu", "hybrid") for r in (X2, Q)
          for n in (1, 4)] + [
    ("gemma4-gguf", "hybrid", Q, 4), ("gemma4-gguf", "offload", Q, 1),
    ("qwen3_5_moe-gguf", "hybrid", Q, 1), ("qwen3_5_moe-gguf", "cpu", Q, 4),
    ("qwen3_moe-nvfp4", "hybrid", Q, 4),
    ("qwen3_moe-hf", "cpu", Q, 4), ("qwen3_moe-hf", "offload", Q, 4),
    ("minimax_m2-hf", "hybrid", Q, 1), ("qwen3_moe-nvfp4", "cpu", Q, 1),
    ("qwen3_moe-hf-bf16", "hybrid", Q, 4),
]


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on a shared 2-core machine a descheduled second intra-op thread
    stalls every small op (test_dummy.py measured 80 s -> 6 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_profile(monkeypatch):
    """hybrid here runs without an ft bench bw profile (q* = 0.3, the cap below), whatever
    the machine's cache folder holds."""
    monkeypatch.setattr("freetoken.moe.runtime.find_profile", lambda fmt: None)


def _float(w: QuantWeight) -> QuantWeight:
    if w.is_float:
        return w
    return QuantWeight(dequantize(w).float().reshape(w.shape), "f32", w.shape, scale2=w.scale2,
                       source=w.source)


def float_dense(model) -> None:
    """Dense weights (everything but routed experts) dequantized to fp32 once: the same numbers
    for every backend, without re-decoding the TQ1_0 token table at every step."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.weights = [_float(w) for w in m.weights]
        elif isinstance(m, Embedding):
            m.weight = _float(m.weight)


def load(case: str, device: str = "cpu"):
    """A fresh model of the case (host banks are per model)."""
    dtype = torch.bfloat16 if case.endswith("bf16") else torch.float32
    model, _ = load_model(CASES[case][0](), dtype=dtype, device=device, show_progress=False)
    if device == "cpu":  # (a GPU keeps its own dense layouts, e.g. Q8_0 split into codes and
        float_dense(model)  # scales, which dequantize() does not read; they run fast there)
    return model


class RouteCounter:
    """Counts the distinct experts each SparseMoE call routes to (the truth for counters)."""

    def __init__(self, model):
        self.total = 0
        for m in model.modules():
            if isinstance(m, FusedExperts):
                m.register_forward_pre_hook(self._hook)

    def _hook(self, mod, args):
        self.total += int(torch.unique(args[1]).numel())


@torch.inference_mode()
def decode(model, prompts: list[list[int]], n: int, forced: list[list[int]] | None = None
           ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """n greedy steps of a batch (prefill, then one token per sequence a step); with `forced`
    the sequences continue with those tokens instead (teacher forcing). Returns the argmax
    tokens [B][n] and the logits [B, V] of every step."""
    B = len(prompts)
    dev = model.model.norm.weight.device
    kv = SimpleKV(model.kv_cache_shapes(), pages_needed([len(p) + n for p in prompts], 16),
                  dtype=model.model.embed_tokens.dtype, device=dev)
    new, toks, logits_all, states = [list(p) for p in prompts], [[] for _ in prompts], [], None
    for step in range(n):
        ctx = kv.context([(i, len(t)) for i, t in enumerate(new)])
        states = attach_states(model, ctx, B, states)
        ids = torch.tensor([t for ts in new for t in ts], device=dev)
        logits = model.compute_logits(model(ids, ctx)[ctx.logits_indices])
        logits_all.append(logits)
        for i in range(B):
            toks[i].append(int(logits[i].argmax()))
        new = [[forced[i][step] if forced else toks[i][-1]] for i in range(B)]
    return toks, logits_all


_REF: dict[tuple[str, int], tuple] = {}


def fused_reference(case: str, batch: int, device: str = "cpu"):
    key = (case, batch, device)
    if key not in _REF:
        _REF[key] = decode(load(case, device), PROMPTS[:batch], TOKENS)
    return _REF[key]


def run_backend(case: str, backend: str, slots_per_expert: float, batch: int, teacher=None,
                device: str = "cpu"):
    model = load(case, device)
    E = next(m for m in model.modules() if isinstance(m, FusedExperts)).spec.num_experts
    hybrid = backend == "hybrid"
    cfg = EngineConfig(moe_backend=backend, moe_cache_size=max(2, int(slots_per_expert * E)),
                       moe_hybrid_max_fetch=1 if hybrid else None,
                       moe_fetch_ahead=1 if hybrid else None)
    rt = configure_moe(model, cfg, torch.device(device))
    routes = RouteCounter(model)
    toks, logits = decode(model, PROMPTS[:batch], TOKENS, teacher)
    return toks, logits, rt.counters(), routes.total, rt


def check_counters(c: dict, routed: int, slots: int, total: int) -> None:
    assert c["hits"] + c["misses"] == routed, (c, routed)
    assert c["fetched"] + c["cpu"] == c["misses"], c
    if slots >= total:
        assert c["misses"] == 0, c  # the cache holds every expert from load on


@pytest.mark.parametrize("case,backend,rate,batch", MATRIX,
                         ids=[f"{c}-{b}-{'quarter' if r < 1 else '2x'}-bs{n}"
                              for c, b, r, n in MATRIX])
def test_backend_matches_fused(case, backend, rate, batch, device="cpu"):
    ref_toks, ref_logits = fused_reference(case, batch, device)
    quantized = CASES[case][1]
    exact = backend == "offload" or not quantized
    toks, logits, c, routed, rt = run_backend(case, backend, rate, batch,
                                              None if exact else ref_toks, device)
    total = rt.cache.cache.num_layers * rt.cache.cache.num_experts
    check_counters(c, routed, rt.num_slots, total)
    if rate < 1:
        assert c["misses"] > 0
        if backend != "cpu":
            assert c["fetched"] > 0  # evictions happened: the cache is smaller than the experts
    if backend == "cpu" and rate < 1:
        assert c["cpu"] == c["misses"] > 0
    if backend in ("cpu", "hybrid") and rate < 1 and any(rt.cache.ahead.predictors[1:]):
        # the next layer's predicted CPU experts were warmed between jobs (moe/handoff.py;
        # not gemma4, whose router is its own)
        st = rt.cache._handoff.prefetch_stats()
        assert st["hints"] > 0 and st["used"] <= min(st["warmed"], st["cpu"]), st
        # and hybrid fetched some of them ahead (--moe-fetch-ahead 1), which the next layer's
        # call counted as hits where it routed to them (cpu fetches nothing)
        if backend == "hybrid":
            assert 0 < c["ahead"] and c["ahead_hits"] <= min(c["ahead"], c["hits"]), c
            # copied by the hand-off's worker after its jobs (moe/handoff.py: copies ahead),
            # every expert the plans gave a slot ahead
            got = rt.cache._handoff.ahead_stats()
            assert got["lists"] > 0 and got["copied"] == c["ahead"], (got, c)
        else:
            assert c["ahead"] == c["ahead_hits"] == 0, c
    if exact:
        assert toks == ref_toks, f"{backend} parted from fused"
        return
    diff = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits))
    span = max(float(r.max() - r.min()) for r in ref_logits)
    print(f"{case} {backend}: max |logit diff| {diff:.4f} of range {span:.2f}")
    assert diff <= QUANT_TOL * span, f"max |logit diff| {diff:.4f} of range {span:.2f}"
    for step, (a, r) in enumerate(zip(logits, ref_logits)):
        top = torch.topk(r, 2, dim=-1).values
        sure = (top[:, 0] - top[:, 1]) > 2 * diff
        agree = a.argmax(-1) == r.argmax(-1)
        assert bool((agree | ~sure).all()), f"step {step}: top-1 differs with margin > 2*diff"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["offload", "cpu", "hybrid"])
@pytest.mark.parametrize("case", ["qwen3_moe-gguf", "qwen3_5_moe-gguf"])
def test_backend_matches_fused_cuda(case, backend):
    """The same equality on a GPU, float32: slots in device memory, host banks pinned. GGUF
    cases only: the HF ones need the packaged SmolLM2 tokenizer, which the GPU machine lacks."""
    test_backend_matches_fused(case, backend, Q, 4, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_expert_added_in_the_receive_changes_no_bit(monkeypatch):
    """qwen3.5-moe's gated shared expert on the hybrid backend on a GPU, float32: added inside
    the kernel that receives the CPU's answer (FREETOKEN_GPU_RECEIVE_SHARED, the default: every
    receive takes it, with the gate's row) or in a launch of its own before it (=0), the same
    logits bit for bit, prefill (18 tokens) and decode (4 a step)."""
    from freetoken.kernels.triton import handoff

    real, folds = handoff.receive_add, []

    def spy(*args, **kw):
        folds.append(args[5] if len(args) > 5 else kw.get("shared"))
        return real(*args, **kw)

    monkeypatch.setattr(handoff, "receive_add", spy)
    logits = {}
    for on in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_GPU_RECEIVE_SHARED", on)
        folds.clear()
        _, logits[on], c, _, _ = run_backend("qwen3_5_moe-gguf", "hybrid", Q, 4, device="cuda")
        assert c["cpu"] > 0 and folds
        assert all((f is not None and f[2] is not None) if on == "1" else f is None
                   for f in folds)
    assert all(torch.equal(a, b) for a, b in zip(logits["1"], logits["0"]))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_ahead_copies_by_the_worker_or_a_fill_change_no_bit(device, monkeypatch):
    """Fetching ahead on the hybrid backend: the experts given slots ahead copied by the
    hand-off's worker after its jobs (the default: the copy engine on a GPU) or by the fill
    (FREETOKEN_MOE_AHEAD_WORKER=0: a device kernel, in line with the CPU standing in), the
    same counters and the same logits bit for bit, 4 sequences."""
    logits, counters = {}, {}
    for on in ("1", "0"):
        monkeypatch.setenv("FREETOKEN_MOE_AHEAD_WORKER", on)
        _, logits[on], counters[on], _, rt = run_backend("qwen3_moe-gguf", "hybrid", Q, 4,
                                                         device=device)
        assert rt.cache._handoff.copies is (on == "1")
        assert counters[on]["ahead"] > 0
    assert counters["1"] == counters["0"]
    assert all(torch.equal(a, b) for a, b in zip(logits["1"], logits["0"]))


@pytest.mark.parametrize("backend", ["cpu", "hybrid"])
def test_prefill_fetches_every_miss(backend):
    """A step of PREFILL_TOKENS tokens or more runs every expert on the device, whatever the
    backend: no CPU experts, and the fused logits up to the order of the experts' sums."""
    from freetoken.models.testing import prefill_logits
    from freetoken.moe.expert_cache import PREFILL_TOKENS

    prompt = [1] + [(37 * i) % 40000 + 5 for i in range(PREFILL_TOKENS + 5)]
    ref = prefill_logits(load("qwen3_moe-gguf"), [prompt])[0]
    model = load("qwen3_moe-gguf")
    rt = configure_moe(model, EngineConfig(moe_backend=backend, moe_cache_size=2),
                       torch.device("cpu"))
    got = prefill_logits(model, [prompt])[0]
    c = rt.counters()
    assert c["cpu"] == 0 and c["fetched"] == c["misses"] > 0, c
    assert float((got - ref).abs().max()) <= 1e-4 * float(ref.max() - ref.min())


def test_gguf_mxfp4_repack_is_bit_exact():
    """The CPU executor reads GGUF MXFP4 experts repacked into the MXFP4 layout: the same
    values as gguf-py's numpy dequantization of the file's blocks, bit for bit."""
    import gguf
    import numpy as np

    from freetoken.formats.gguf import GGUFFile
    from freetoken.moe.host_banks import gguf_mxfp4_to_mxfp4

    gf = GGUFFile(gguf_source("qwen3_moe"))
    name = "blk.1.ffn_up_exps.weight"
    qw = gf.weight(name)
    assert qw.ggml_type == int(gguf.GGMLQuantizationType.MXFP4)
    ref = gguf.quants.dequantize(gf.raw(name), gguf.GGMLQuantizationType.MXFP4)
    got = dequantize(gguf_mxfp4_to_mxfp4(qw)).numpy()
    assert np.array_equal(got.reshape(ref.shape).view(np.uint32), ref.view(np.uint32))


def test_auto_and_no_gpu_are_logged(caplog):
    """auto on a CPU-only machine: fused (every expert fits in host memory), said in the log;
    a cache backend without a GPU: the CPU stands in, said in the log."""
    caplog.set_level("INFO", logger="freetoken.moe.runtime")
    model = load("qwen3_moe-gguf")
    assert configure_moe(model, EngineConfig(), torch.device("cpu")) is None
    assert "MoE backend fused (auto: every expert fits" in caplog.text
    rt = configure_moe(model, EngineConfig(moe_backend="offload", moe_cache_rate=0.5),
                       torch.device("cpu"))
    assert rt.num_slots == 8
    assert "without a GPU: the CPU stands in" in caplog.text
    with pytest.raises(ValueError, match="smaller than one layer's top-k working set"):
        configure_moe(load("qwen3_moe-gguf"), EngineConfig(moe_backend="cpu", moe_cache_size=1),
                      torch.device("cpu"))


def test_unused_expert_cache_flags_are_refused_or_logged(caplog):
    """A flag the backend does not use is never silently accepted: refused with the backend
    asked for (fused with cache flags, cpu or offload with --moe-hybrid-max-fetch, cpu or
    fused with --moe-fetch-ahead), logged when auto chose fused; a negative fetch-ahead is
    refused by the config."""
    caplog.set_level("INFO", logger="freetoken.moe.runtime")
    cpu = torch.device("cpu")
    for cfg, flags in ((EngineConfig(moe_backend="fused", moe_cache_rate=0.5),
                        "--moe-cache-rate"),
                       (EngineConfig(moe_backend="fused", moe_prefill_hit_d2d=True,
                                     disable_moe_prefill_overlap=True),
                        "--moe-prefill-hit-d2d, --disable-moe-prefill-overlap"),
                       (EngineConfig(moe_backend="cpu", moe_hybrid_max_fetch=2),
                        "--moe-hybrid-max-fetch"),
                       (EngineConfig(moe_backend="offload", moe_hybrid_max_fetch=0),
                        "--moe-hybrid-max-fetch"),
                       (EngineConfig(moe_backend="cpu", moe_fetch_ahead=2),
                        "--moe-fetch-ahead"),
                       (EngineConfig(moe_backend="fused", moe_fetch_ahead=0),
                        "--moe-fetch-ahead")):
        with pytest.raises(ValueError, match=f"^{flags}: not used by --moe-backend"):
            configure_moe(load("qwen3_moe-gguf"), cfg, cpu)
    assert configure_moe(load("qwen3_moe-gguf"), EngineConfig(moe_cache_size=4), cpu) is None
    assert "--moe-cache-size: unused, auto chose the fused MoE backend" in caplog.text
    with pytest.raises(ValueError, match="^moe_fetch_ahead must be 0 .off. or a positive"):
        EngineConfig(moe_backend="hybrid", moe_fetch_ahead=-1)


def test_engine_counters_and_decode_log(caplog):
    """Through the engine: --moe-backend reaches the model, EngineStats carries the counters
    (hits + misses = routed), and a decode log line comes every --decode-log-interval steps."""
    from freetoken.engine.engine import Engine
    from freetoken.engine.sampling_params import SamplingParams

    caplog.set_level("INFO", logger="freetoken.moe.runtime")
    cfg = EngineConfig(model=str(hf_source("qwen3_moe")), moe_backend="hybrid",
                       moe_cache_size=4, moe_fetch_ahead=1, decode_log_interval=4,
                       show_progress=False)
    engine = Engine(cfg)
    routes = RouteCounter(engine.model)
    # 1 prefill + 9 decode steps: the first decode step starts the clock, 8 are logged
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=10, temperature=0))
    while engine.has_unfinished():
        engine.step()
    c = engine.stats().moe_experts
    assert c["hits"] + c["misses"] == routes.total > 0
    assert c["fetched"] + c["cpu"] == c["misses"]
    lines = [r.message for r in caplog.records if r.message.startswith("decode:")]
    assert len(lines) == 2 and "hit rate" in lines[0] and "tokens/s" in lines[0], lines
    assert all("ahead of the CPU" in line for line in lines), lines  # warming's share
    # the fetch-ahead ran, and the lines say so where an interval had some
    assert c["ahead"] > 0 and any("fetched ahead" in line for line in lines), (c, lines)
    assert "fetch ahead: up to 1 of the next layer's predicted misses" in caplog.text
    assert "its hits on them count as fetches of the split" in caplog.text  # hybrid's rule


class _LateOnce:
    """The hand-off worker, whose next answer is reported late once (as a wait that timed
    out would be) though it comes: the step fails while the worker may still copy."""

    def __init__(self, worker):
        self.worker, self.late = worker, True

    def wait(self, n, timeout_s):
        if self.late:
            self.late = False
            self.worker.wait(n, timeout_s)
            return False
        return self.worker.wait(n, timeout_s)

    def __getattr__(self, name):
        return getattr(self.worker, name)


def test_a_failed_hand_off_fails_its_requests_and_the_cache_recovers(caplog):
    """A step whose CPU answer comes late: its request ends with the hand-off's error, the
    worker is drained and every slot filled again as at load (late copies ahead may have
    written slots given to other experts since), and the next request gets the tokens of a
    run that never failed. With the CPU standing in (its receive is the host's wait)."""
    from freetoken.engine.engine import Engine
    from freetoken.engine.sampling_params import SamplingParams
    from freetoken.moe.slot_cache import SlotCache

    cfg = EngineConfig(model=str(hf_source("qwen3_moe")), moe_backend="hybrid",
                       moe_cache_size=4, moe_fetch_ahead=1, show_progress=False, device="cpu")
    engine = Engine(cfg)

    def run(rid: str):
        engine.add_request(rid, PROMPTS[0], SamplingParams(max_tokens=8, temperature=0))
        outs = []
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
        return outs[-1]

    ref = run("ref")
    cache = engine.moe.cache
    ho = cache.handoff
    ho._worker = _LateOnce(ho._worker)
    warm = SlotCache(cache.hosts, cache.cache.num_slots, "cpu")
    warm.warm(cache.hosts)
    assert not torch.equal(cache.cache.slot_of, warm.slot_of)  # the run moved the slots
    caplog.set_level("WARNING", logger="freetoken.moe.expert_cache")
    failed = run("late")
    assert failed.finish_reason == "error" and "hand-off failed" in failed.error, failed
    assert "expert cache was filled again" in caplog.text
    assert torch.equal(cache.cache.slot_of, warm.slot_of)
    assert torch.equal(cache.cache.pool, warm.pool)
    assert not ho.failed and ho.drain(0.0)
    assert engine.stats().moe_handoff_failures == 1
    again = run("again")
    assert again.finish_reason == ref.finish_reason
    assert again.output_token_ids == ref.output_token_ids


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
