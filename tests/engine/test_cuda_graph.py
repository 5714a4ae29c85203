"""Decode CUDA graphs: buckets, a no-op without CUDA, the gated delta-net's graph-safe decode
path (on the CPU, against the per-sequence path), and on CUDA the same greedy (and seeded)
tokens as eager decode on tiny dummy-weight models, with exactly one host sync per replayed
decode step (the sampled ids' read-back), checked under torch's sync debug mode "error"."""

from __future__ import annotations

import sys

import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine import sampler
from freetoken.engine.context import ForwardContext
from freetoken.engine.cuda_graph import buckets
from freetoken.engine.engine import Engine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.formats.qweight import QuantWeight
from freetoken.layers.gdn import GatedDeltaNet, GDNSpec, alloc_states

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def dummy_engine(model: str = "tiny-llama", device: str = "cuda", **kw) -> Engine:
    cfg = dict(model=model, dummy_weights=True, dummy_format="bf16", dtype="float32",
               device=device, max_running_requests=8, num_pages=64, page_size=16,
               show_progress=False)
    return Engine(EngineConfig(**{**cfg, **kw}))


def prompts(n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 1000, (length,), generator=g).tolist() for length in (5, 17, 33)[:n]]


def generate(eng: Engine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, (ids, p) in enumerate(zip(prompts(len(params)), params)):
        eng.add_request(str(i), ids, p)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            assert o.error is None, o.error
            if o.finished:
                out[o.request_id] = o.output_token_ids
    return out


def count_replays(eng: Engine) -> list[int]:
    """A list that grows by one per graph replay of `eng`."""
    calls: list[int] = []
    graphs = eng.runner.graphs
    real = graphs.run
    graphs.run = lambda ids, ctx: calls.append(ctx.num_seqs) or real(ids, ctx)
    return calls


def test_no_graphs_without_cuda():
    eng = dummy_engine(device="cpu", cuda_graph_max_bs=4)
    assert eng.runner.graphs is None


def random_gdn(spec: GDNSpec, g: torch.Generator) -> GatedDeltaNet:
    layer = GatedDeltaNet(spec, 0)
    for lin in (layer.in_proj, layer.out_proj):
        for part, out in lin.parts.items():
            w = 0.2 * torch.randn(out, lin.in_features, generator=g)
            lin.load(part, QuantWeight(w, "f32", tuple(w.shape), source=part))
        lin.finalize(torch.float32, "cpu")
    layer.conv1d.weight.value = 0.5 * torch.randn(spec.conv_dim, spec.conv_kernel, generator=g)
    layer.A_log.value = -torch.rand(spec.num_v_heads, generator=g)
    layer.dt_bias.value = torch.randn(spec.num_v_heads, generator=g)
    return layer


def test_gdn_decode_path_equals_per_sequence_path():
    """A pure-decode step (what a graph captures: batched, no host lists) against the
    per-sequence path on the same step: sequences at positions 5 and 9 continue their state,
    a one-token prompt at position 0 starts from zeros although its slot holds stale state."""
    g = torch.Generator().manual_seed(0)
    spec = GDNSpec(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8,
                   conv_kernel=4)
    layer = random_gdn(spec, g)
    x = torch.randn(3, 32, generator=g)
    pools = alloc_states([spec.state_shapes()], 5)
    for t in pools[0]:
        t.copy_(torch.randn(t.shape, generator=g))
    outs, states = [], []
    for host in (False, True):
        ctx_pools = [tuple(t.clone() for t in pools[0])]
        ctx = ForwardContext(
            positions=torch.tensor([5, 0, 9]), cu_seqlens_q=torch.arange(4, dtype=torch.int32),
            seq_lens=torch.tensor([6, 1, 10], dtype=torch.int32),
            page_table=torch.zeros(3, 1, dtype=torch.int32), slot_mapping=torch.arange(3),
            logits_indices=torch.arange(3), page_size=16, state_slots=torch.tensor([3, 0, 2]),
            recurrent_states=ctx_pools)
        if host:  # the per-sequence path, given host lists
            conv, ssm = ctx_pools[0]
            mixed, _, b, a = layer.in_proj(x).split(layer.sizes, dim=-1)
            beta = torch.sigmoid(b)
            decay = layer.A_log.value * torch.nn.functional.softplus(a + layer.dt_bias.value)
            outs.append(layer._mixed(mixed, decay, beta, conv, ssm, ctx))
        else:
            assert ctx.is_decode
            mixed, _, b, a = layer.in_proj(x).split(layer.sizes, dim=-1)
            beta = torch.sigmoid(b)
            decay = layer.A_log.value * torch.nn.functional.softplus(a + layer.dt_bias.value)
            conv, ssm = ctx_pools[0]
            outs.append(layer._decode(mixed, decay, beta, conv, ssm, ctx.state_slots,
                                      ctx.positions))
        states.append(ctx_pools[0])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(states[0], states[1]):  # slot 1 is nobody's; slot 4 the scratch
        torch.testing.assert_close(a[[0, 2, 3]], b[[0, 2, 3]], atol=1e-5, rtol=1e-5)


@needs_cuda
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3-moe"])
def test_graphs_give_the_eager_tokens(model):
    """Three requests decode as a padded bucket of 4; greedy and seeded rows alike. The eager
    engine waits for each step's ids (no overlap): graphs and overlap together against the
    plain loop."""
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5,
                             ignore_eos=True)]
    eager = dummy_engine(model, disable_cuda_graph=True, disable_overlap_schedule=True)
    graphed = dummy_engine(model)
    assert eager.runner.graphs is None and graphed.runner.graphs is not None
    assert graphed.overlap and not eager.overlap
    replays = count_replays(graphed)
    assert generate(graphed, params) == generate(eager, params)
    assert 4 > max(replays) and len(replays) >= 8  # decode steps replayed, 3 and 2 rows


def _fold_ab(kw, params, monkeypatch):
    """FREETOKEN_GPU_NORM_FOLD 0 then 1: each setting's greedy tokens of `params` (graphed and
    overlapped) and how many times an eager 2-token generation launches the RMSNorm kernel;
    returns (tokens, launches, the last eager engine)."""
    from freetoken.kernels.triton import norm as tnorm

    runs, launches = {}, {}
    real = tnorm.rms_norm_triton
    for fold in ("0", "1"):
        monkeypatch.setenv("FREETOKEN_GPU_NORM_FOLD", fold)
        eng = dummy_engine(**kw)
        runs[fold] = generate(eng, params)
        if eng.moe is not None:
            eng.moe.close()
        eager = dummy_engine(disable_cuda_graph=True, disable_overlap_schedule=True, **kw)
        calls = []
        monkeypatch.setattr(tnorm, "rms_norm_triton",
                            lambda *a, calls=calls, **k: calls.append(1) or real(*a, **k))
        generate(eager, [SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)])
        monkeypatch.setattr(tnorm, "rms_norm_triton", real)
        launches[fold] = len(calls)
        if eager.moe is not None:
            eager.moe.close()
    return runs, launches, eager


@needs_cuda
@pytest.mark.parametrize("backend,dtype", [("fused", "float32"), ("fused", "bfloat16"),
                                           ("hybrid", "float32")])
def test_folded_residual_steps_give_the_unfolded_tokens(backend, dtype, monkeypatch):
    """The next layer's residual step computed by the MoE's last kernel (the down kernel's
    last-arriving programs, fused; the receive of the CPU's answer, hybrid:
    kernels/norm.py, folding) gives the separate RMSNorm launches' greedy tokens, graphed
    and overlapped, and does take the place of those launches: an eager forward of
    tiny-qwen3-moe launches the RMSNorm kernel once per layer fewer with it."""
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in range(3)]
    kw = dict(model="tiny-qwen3-moe", dtype=dtype, moe_backend=backend)
    if backend == "hybrid":
        kw.update(moe_cache_rate=0.25)
    runs, launches, eager = _fold_ab(kw, params, monkeypatch)
    assert runs["1"] == runs["0"]
    # every layer of tiny-qwen3-moe is sparse, the last one's fold is the final norm's; the
    # decode step folds, and the 5-token prompt's forward where its token count allows
    from freetoken.kernels.triton.moe import NORM_FOLD_TOKENS

    layers = eager.model.config.num_layers
    forwards = 2 if backend == "hybrid" or 5 <= NORM_FOLD_TOKENS else 1
    assert launches["0"] - launches["1"] == forwards * layers, launches


@needs_cuda
@pytest.mark.parametrize("backend,dtype", [("hybrid", "float32"), ("hybrid", "bfloat16"),
                                           ("fused", "bfloat16")])
def test_shared_expert_folds_give_the_unfolded_tokens(backend, dtype, monkeypatch):
    """qwen3.5-moe layers (a shared expert and its gate added last: in the receive of the
    CPU's answer, hybrid; in the gated add's kernel, fused) offer the next residual step too:
    the 35B shape (4 layers) gives the separate RMSNorm launches' greedy tokens, graphed and
    overlapped, and an eager forward launches the RMSNorm kernel once per layer fewer (the
    5-token prompt's forward and the decode step both fold)."""
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in range(3)]
    kw = dict(model="qwen3.6-35b-a3b", dummy_layers=4, dtype=dtype, moe_backend=backend,
              max_running_requests=4)
    if backend == "hybrid":
        kw.update(moe_cache_rate=0.25)
    runs, launches, _ = _fold_ab(kw, params, monkeypatch)
    assert runs["1"] == runs["0"]
    assert launches["0"] - launches["1"] == 2 * 4, launches


def test_l2_ahead_switch(monkeypatch):
    """FREETOKEN_GPU_L2_AHEAD: a list of what is read ahead, `all`, or off; a misspelt name is
    an error naming the switch; on CPU tensors nothing is launched (no token to join)."""
    from freetoken import env
    from freetoken.kernels import l2_ahead, l2_join

    for v, want in (("", set()), ("0", set()), ("all", {"o", "qkv", "down"}),
                    ("o, down", {"o", "down"}), ("qkv+down", {"qkv", "down"})):
        monkeypatch.setenv("FREETOKEN_GPU_L2_AHEAD", v)
        assert env.gpu_l2_ahead() == want
    monkeypatch.setenv("FREETOKEN_GPU_L2_AHEAD", "o,ffn")
    with pytest.raises(ValueError, match="FREETOKEN_GPU_L2_AHEAD"):
        env.gpu_l2_ahead()
    monkeypatch.setenv("FREETOKEN_GPU_L2_AHEAD", "all")
    assert l2_ahead("o", torch.zeros(1, 4), []) is None
    l2_join(None)


@needs_cuda
@pytest.mark.parametrize("backend", ["fused", "hybrid"])
def test_l2_ahead_gives_the_same_tokens(backend, monkeypatch):
    """Reading the next kernels' weights into L2 on a side stream (kernels/triton/l2.py)
    writes nothing: graphed and overlapped, tiny-qwen3-moe's greedy tokens are those without
    it, and every layer of a decode step did ask L2 for o_proj's, the next qkv's and the
    experts' down rows (fused; hybrid's device kernel takes the hits through the map)."""
    from freetoken.kernels.triton import l2

    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True) for _ in range(3)]
    kw = dict(model="tiny-qwen3-moe", moe_backend=backend)
    if backend == "hybrid":
        kw.update(moe_cache_rate=0.25)
    runs, calls = {}, []
    for v in ("0", "all"):
        monkeypatch.setenv("FREETOKEN_GPU_L2_AHEAD", v)
        for name in ("ahead", "ahead_experts"):
            real = getattr(l2, name)
            monkeypatch.setattr(l2, name, lambda *a, real=real, name=name, **k:
                                calls.append(name) or real(*a, **k))
        eng = dummy_engine(**kw)
        runs[v] = generate(eng, params)
        if eng.moe is not None:
            eng.moe.close()
        monkeypatch.undo()
    assert runs["all"] == runs["0"]
    layers = 2  # at least two layers' worth: o_proj, qkv and down each asked for
    assert calls.count("ahead") >= 2 * layers and calls.count("ahead_experts") >= layers, calls


@needs_cuda
@pytest.mark.parametrize("side_stream,receive_shared,split,warm",
                         [("1", "1", False, "0"), ("0", "1", True, "0"), ("1", "0", False, "0"),
                          ("1", "1", False, "1")])
def test_cache_backend_graphs_give_the_eager_tokens(side_stream, receive_shared, split, warm,
                                                   monkeypatch):
    """The hybrid backend on a model with a shared expert (the 35B shape, 4 layers, float32):
    graphed decode steps (the CPU hand-off, slot fills and, by default, the shared expert on a
    second stream beside them: FREETOKEN_GPU_SIDE_STREAM, added with its gate inside the
    receive kernel: FREETOKEN_GPU_RECEIVE_SHARED), overlapped, give the eager steps' tokens
    (the eager engine waits for each step's ids), and the shared
    expert's stream changes no token (the same kernels on the same inputs). split: with a bw
    profile of both job sizes (policy.SplitModel's fetch tables) and graphs up to 16 rows,
    whose 128 routes take the torch plan inside the capture. Both engines fetch ahead
    (--moe-fetch-ahead 1), in the graphs on a stream of their own. warm: with warming
    (FREETOKEN_MOE_PREFETCH=1), whose hint kernel runs on that stream after the ahead plan
    (the capture once failed on it as unjoined work, and the engine decoded eagerly)."""
    from freetoken.moe import runtime

    monkeypatch.setenv("FREETOKEN_MOE_PREFETCH", warm)
    monkeypatch.setenv("FREETOKEN_GPU_SIDE_STREAM", side_stream)
    monkeypatch.setenv("FREETOKEN_GPU_RECEIVE_SHARED", receive_shared)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in range(3)]
    kw = dict(model="qwen3.6-35b-a3b", dummy_layers=4, moe_backend="hybrid",
              moe_cache_rate=0.25, max_running_requests=16 if split else 4, moe_fetch_ahead=1)
    if split:
        prof = {"q_star": 0.28, "expert_bytes": 1.77e6, "cpu_experts_b1": 8.0,
                "cpu_experts_b4": 30.0, "cpu_fill_both_gbps": 100.9,
                "cpu_fill_both_b4_gbps": 116.7, "fill_both_gbps": 38.7,
                "fill_both_b4_gbps": 38.6}  # the H200 host's figures of 2026-12-02
        monkeypatch.setattr(runtime, "find_profile", lambda fmt: prof)
    eager = dummy_engine(disable_cuda_graph=True, disable_overlap_schedule=True, **kw)
    want = generate(eager, params)
    eager.moe.close()  # its CPU worker and pool, before the next engine starts its own
    graphed = dummy_engine(**kw)
    assert graphed.runner.graphs is not None and graphed.overlap
    assert (graphed.moe.policy.model is not None) == split
    assert (graphed.moe.cache.side_stream is not None) == (side_stream == "1")
    replays = count_replays(graphed)
    assert generate(graphed, params) == want
    assert len(replays) >= 8
    c = graphed.moe.cache.counters()
    assert c["cpu"] > 0  # the CPU's share was in the steps
    assert c["ahead"] > 0  # and the fetch-ahead (its own stream, joined a layer on)
    if warm == "1":  # and the hints, warmed after their jobs
        assert graphed.moe.cache.handoff.prefetch_stats()["hints"] > 0
    graphed.moe.close()


@needs_cuda
def test_nvfp4_engine_fetching_ahead_after_one_that_does_not():
    """NVFP4 experts, hybrid: an engine fetching ahead built after one that does not, in one
    process (as benchmarks/ab_env.py builds them), graphed and overlapped, gives the first
    engine's greedy tokens (float32) and its copies ahead are hits. On an H100 host a 30B
    NVFP4 engine built this way stalled for minutes at start-up (2026-12-06, 48 layers): a
    kernel module loaded by an eager step while the device waited for the worker's copies.
    So the worker copies ahead lists only in graph replays: here the eager prefill steps
    and an engine without graphs fill their slots ahead with the fill kernel, and the
    worker serves no list but the empty one its copies start with."""
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in range(3)]
    kw = dict(model="qwen3-30b-a3b", dummy_layers=2, dummy_format="nvfp4",
              moe_backend="hybrid", moe_cache_rate=0.25, max_running_requests=4)
    first = dummy_engine(moe_fetch_ahead=0, **kw)
    want = generate(first, params)
    first.moe.close()
    second = dummy_engine(moe_fetch_ahead=1, **kw)
    assert second.runner.graphs is not None and second.overlap
    assert generate(second, params) == want
    c = second.moe.counters()
    assert c["ahead"] > 0 and c["ahead_hits"] > 0, c
    assert second.moe.cache.handoff.ahead_stats()["lists"] > 1  # the graphs' lists
    second.moe.close()
    eager = dummy_engine(moe_fetch_ahead=1, disable_cuda_graph=True, **kw)
    assert eager.runner.graphs is None
    assert generate(eager, params) == want
    c = eager.moe.counters()
    assert c["ahead"] > 0 and c["ahead_hits"] > 0, c
    assert eager.moe.cache.handoff.ahead_stats() == {"lists": 1, "copied": 0}
    eager.moe.close()


@needs_cuda
@pytest.mark.parametrize("overlap", [True, False])
def test_decode_step_syncs_once(monkeypatch, overlap):
    """One host sync per replayed decode step: the sampled ids' read. With overlap (the
    default) a step() launches the next decode step before it reads the held one's ids."""
    from freetoken.engine import engine as engine_mod

    eng = dummy_engine(cuda_graph_max_bs=4, disable_overlap_schedule=not overlap)
    for i, ids in enumerate(prompts(2)):
        eng.add_request(str(i), ids, SamplingParams(max_tokens=8, temperature=0,
                                                    ignore_eos=True))
    eng.step()  # prefill (eager)
    if overlap:
        assert eng.step() == [] and eng._inflight is not None  # the first decode step, held
    reads: list[int] = []
    real, real_held = sampler.read_ids, engine_mod._InFlight.read
    monkeypatch.setattr(sampler, "read_ids", lambda ids: reads.append(1) or real(ids))
    monkeypatch.setattr(engine_mod._InFlight, "read",
                        lambda self: reads.append(1) or real_held(self))
    replays = count_replays(eng)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any other sync raises (and fails the batch)
    try:
        outs = eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [o.error for o in outs] == [None, None]
    assert [len(o.new_token_ids) for o in outs] == [1, 1]
    assert replays == [2] and reads == [1]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
