"""The engine end to end on the real SmolLM2 weights: batching, paging, prefix reuse, errors.

Greedy decoding is deterministic, so "the same tokens" is exact equality. Every comparison is
between the engine and itself run alone (one request, one sequence per step), which is the
plain autoregressive loop; the model's own correctness against transformers is tested in
tests/models.
"""

from __future__ import annotations

import sys

import engine_helpers as helpers
import pytest

from freetoken import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a poem about a cat that likes to sleep in the sun all day long, please.",
    "1, 2, 3,",
    "def add(a, b):",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tok():
    return helpers.smollm2()[1]


@pytest.fixture(scope="module")
def prompts(tok):
    return {str(i): tok.encode(p) for i, p in enumerate(PROMPTS)}


@pytest.fixture(scope="module")
def alone(prompts):
    """Each prompt alone in a fresh engine: the reference token sequences."""
    out = {}
    for rid, ids in prompts.items():
        out.update(helpers.run(helpers.engine(cache_type="naive"), {rid: ids}, GREEDY))
    return {rid: o.output_token_ids for rid, o in out.items()}


def test_batched_with_chunked_prefill_matches_alone(prompts, alone):
    # A small prefill budget forces chunks of different requests into one step, mixed with
    # decodes of the others.
    eng = helpers.engine(max_prefill_tokens=7, page_size=4)
    got = helpers.run(eng, prompts, GREEDY)
    assert {rid: o.output_token_ids for rid, o in got.items()} == alone
    assert all(o.finish_reason == "length" for o in got.values())


def test_prefix_cache_hit_matches_alone(prompts, alone, tok):
    eng = helpers.engine(cache_type="radix", page_size=4)
    first = helpers.run(eng, {"warm": prompts["1"]}, GREEDY)
    again = helpers.run(eng, {"1": prompts["1"], "3": prompts["3"]}, GREEDY)
    assert first["warm"].output_token_ids == alone["1"]
    assert again["1"].output_token_ids == alone["1"]
    assert again["3"].output_token_ids == alone["3"]
    n = len(prompts["1"])
    assert again["1"].num_cached_tokens == (n - 1) // 4 * 4  # all full pages but the last token
    assert eng.stats().prefix_cache_hit_tokens == again["1"].num_cached_tokens
    # A shared system-prompt-like prefix with a different tail hits the shared pages only.
    tail = tok.encode(PROMPTS[1] + " Make it rhyme.")
    out = helpers.run(eng, {"x": tail}, SamplingParams(max_tokens=2, temperature=0))
    assert out["x"].num_cached_tokens >= (n // 4 - 1) * 4


def test_naive_cache_never_reuses(prompts):
    eng = helpers.engine(cache_type="naive")
    helpers.run(eng, {"a": prompts["1"]}, SamplingParams(max_tokens=2, temperature=0))
    out = helpers.run(eng, {"b": prompts["1"]}, SamplingParams(max_tokens=2, temperature=0))
    assert out["b"].num_cached_tokens == 0
    assert eng.stats().kv_pages_used == 0 and eng.stats().kv_pages_cached == 0


def test_preemption_when_pages_run_out(prompts, alone):
    # 4 requests of ~10-20 prompt + 24 new tokens need ~12 pages of 4 each; 20 pages force
    # the newest to be preempted and recomputed, with the same tokens in the end.
    eng = helpers.engine(num_pages=20, page_size=4, cache_type="naive")
    got = helpers.run(eng, prompts, GREEDY)
    assert {rid: o.output_token_ids for rid, o in got.items()} == alone
    assert eng.pool.num_free == 20


def test_seeded_sampling_same_alone_and_batched(prompts):
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone_out = helpers.run(helpers.engine(), {"0": prompts["0"]}, p)["0"].output_token_ids
    batched = helpers.run(helpers.engine(), prompts, p)
    assert batched["0"].output_token_ids == alone_out


def test_bad_input_is_refused_and_others_keep_running(prompts, alone, tok):
    eng = helpers.engine(max_model_len=64)
    eng.add_request("ok", prompts["3"], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("empty", [], GREEDY)
    with pytest.raises(ValueError, match="context holds 64"):
        eng.add_request("long", [1] * 64, GREEDY)
    with pytest.raises(ValueError, match="max_tokens=100 .* at most"):
        eng.add_request("big", [1] * 10, SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        eng.add_request("oov", [10**7], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("ok", prompts["3"], GREEDY)
    # Discovered late (the engine knows the vocabulary): finishes only that request.
    eng.add_request("late", prompts["0"], SamplingParams(max_tokens=8, stop_token_ids=[10**7]))
    done = helpers.run(eng, {}, GREEDY)
    assert done["late"].finish_reason == "error" and "stop_token_ids" in done["late"].error
    assert done["ok"].output_token_ids == alone["3"]


def test_abort_frees_pages_at_once(prompts):
    eng = helpers.engine(page_size=4)
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, GREEDY)
    eng.step()
    eng.step()
    assert eng.stats().kv_pages_used > 0
    for rid in prompts:
        eng.abort(rid)
        eng.abort(rid)  # idempotent
    assert eng.stats().kv_pages_used == 0 and eng.stats().num_running == 0
    outs = eng.step()
    assert sorted(o.request_id for o in outs if o.finish_reason == "abort") == sorted(prompts)
    assert not eng.has_unfinished()


def test_stop_strings_tokens_and_streaming(prompts, alone, tok):
    full = tok.decode(alone["2"])  # " 4, 5, 6, 7, ..."
    stop = full[full.index("6") : full.index("6") + 3]  # "6, " spans token boundaries
    eng = helpers.engine()
    p = SamplingParams(max_tokens=24, temperature=0, stop=[stop])
    eng.add_request("s", prompts["2"], p)
    pieces, final = [], None
    while eng.has_unfinished():
        for out in eng.step():
            pieces.append(out.new_text)
            final = out
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == full[: full.index(stop)] == "".join(pieces)
    assert all(stop not in "".join(pieces[: i + 1]) for i in range(len(pieces)))
    stop_id = alone["2"][3]
    out = helpers.run(helpers.engine(), {"t": prompts["2"]},
                      SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]))
    first = alone["2"].index(stop_id)
    assert out["t"].output_token_ids == alone["2"][: first + 1]
    assert out["t"].stop_reason == stop_id


def test_logprobs_match_log_softmax(prompts, alone):
    import torch

    eng = helpers.engine()
    out = helpers.run(eng, {"0": prompts["0"]}, SamplingParams(max_tokens=3, temperature=0,
                                                                logprobs=5, ignore_eos=True))
    # Reference: the model's logits for the same sequence in one full forward.
    from freetoken.engine.scheduler import ScheduledBatch

    ref_eng = helpers.engine()
    ids = prompts["0"] + alone["0"][:2]
    ref_eng.add_request("r", ids, SamplingParams(max_tokens=1, temperature=0))
    req = ref_eng.scheduler.waiting[0]
    ref_eng.scheduler.schedule()
    batch = ScheduledBatch([req], [len(ids)])
    ctx, input_ids = ref_eng.runner.prepare(batch)
    hidden = ref_eng.model(input_ids, ctx)
    logits = ref_eng.model.compute_logits(hidden[-3:])
    ref = torch.log_softmax(logits.double(), dim=-1)
    lps = out["0"].logprobs
    assert [lp.token_id for lp in lps] == alone["0"][:3]
    for i, lp in enumerate(lps):
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-3
        assert lp.top[0][0] == lp.token_id  # greedy: the top-1 is the sampled one
        top5 = torch.topk(ref[i], 5).indices.tolist()
        assert [t for t, _ in lp.top] == top5


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
