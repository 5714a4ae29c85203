"""Overlapped decode steps (engine.py's module docstring): the next decode step is launched
from the device's sampled ids before the host reads them. Run on the CPU here (the engine's
`overlap` switch, on by default only on CUDA), against the same engine without it: greedy
tokens are exactly the plain loop's (the tests of test_engine.py show batching changes no
greedy token), and every held step's tokens land in place of their placeholders, with stops,
aborts, arrivals and page pressure in the mix. Seeded draws use the device sampler in both
arms: launching ahead against landing first."""

from __future__ import annotations

import sys

import engine_helpers as helpers
import pytest

from freetoken import SamplingParams
from freetoken.engine.engine import PENDING, Engine

PROMPTS = ["The capital of France is", "1, 2, 3,", "def add(a, b):",
           "Write a poem about a cat that likes to sleep in the sun all day long, please."]


@pytest.fixture(scope="module")
def prompts():
    tok = helpers.smollm2()[1]
    return {str(i): tok.encode(p) for i, p in enumerate(PROMPTS)}


def overlapped(**config) -> tuple[Engine, list[int]]:
    """An engine with overlap on, and a list that grows by the batch size of each step
    launched ahead of the held one's read (so a test sees that overlap happened)."""
    eng = helpers.engine(**config)
    eng.overlap = True
    launched: list[int] = []
    real = eng._launch_after

    def spy(held):
        nxt = real(held)
        if nxt is not None:
            launched.append(len(nxt[0]))
        return nxt

    eng._launch_after = spy
    return eng, launched


def plain(**config) -> Engine:
    eng = helpers.engine(**config)
    eng.overlap = False
    return eng


def tokens(done: dict) -> dict:
    return {rid: (o.output_token_ids, o.finish_reason, o.stop_reason, o.text)
            for rid, o in done.items()}


def test_greedy_tokens_and_lengths_are_the_plain_loops(prompts):
    """Four requests that stop by length at different steps: the same tokens, texts and
    finish reasons; steps ran ahead at full and at shrinking batch sizes."""
    lengths = {"0": 5, "1": 17, "2": 9, "3": 24}
    eng, launched = overlapped()
    for rid, ids in prompts.items():
        eng.add_request(rid, ids, SamplingParams(max_tokens=lengths[rid], temperature=0,
                                                 ignore_eos=True))
    got = helpers.run(eng, {}, None)
    ref = plain()
    for rid, ids in prompts.items():
        ref.add_request(rid, ids, SamplingParams(max_tokens=lengths[rid], temperature=0,
                                                 ignore_eos=True))
    want = helpers.run(ref, {}, None)
    assert tokens(got) == tokens(want)
    assert all(len(got[r].output_token_ids) == n for r, n in lengths.items())
    assert 4 in launched and 1 in launched and len(launched) >= 15
    assert eng._inflight is None and not eng.has_unfinished()


def test_stops_drop_the_row_computed_in_vain(prompts):
    """A stop token and a stop string end requests at a step nobody can foresee: the step
    launched after it computed their row, which is dropped (no placeholder left, pages
    back); the streamed pieces add up to the final text."""
    ref = helpers.run(plain(), {"1": prompts["1"]}, SamplingParams(max_tokens=24, temperature=0))
    seq = ref["1"].output_token_ids
    tok = helpers.smollm2()[1]
    text = tok.decode(seq)
    stop = text[text.index("6"):text.index("6") + 3]
    params = {"t": SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[seq[5]]),
              "s": SamplingParams(max_tokens=24, temperature=0, stop=[stop]),
              "g": SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)}
    results = []
    for eng in (plain(), overlapped()[0]):
        pieces: dict[str, list[str]] = {}
        for rid, p in params.items():
            eng.add_request(rid, prompts["1"] if rid != "g" else prompts["3"], p)
        done = {}
        while eng.has_unfinished():
            for out in eng.step():
                assert PENDING not in out.output_token_ids and PENDING not in out.new_token_ids
                pieces.setdefault(out.request_id, []).append(out.new_text)
                if out.finished:
                    done[out.request_id] = out
        assert all("".join(pieces[r]) == done[r].text for r in done)
        assert eng.stats().kv_pages_used == 0
        results.append(tokens(done))
    assert results[0] == results[1]
    assert results[1]["t"][0] == seq[:seq.index(seq[5]) + 1]
    assert results[1]["s"][1:3] == ("stop", stop)


def test_abort_while_a_step_is_in_flight(prompts):
    """An abort between steps, with a step held: its output has no placeholder, its pages
    are back at once, and the request left decodes on with the plain loop's tokens."""
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    want = helpers.run(plain(), {"0": prompts["0"]}, p)["0"].output_token_ids
    eng, launched = overlapped()
    eng.add_request("0", prompts["0"], p)
    eng.add_request("x", prompts["2"], p)
    for _ in range(5):
        eng.step()
    assert eng._inflight is not None and launched
    eng.abort("x")
    outs = {o.request_id: o for o in eng.step()}
    assert outs["x"].finish_reason == "abort"
    assert PENDING not in outs["x"].output_token_ids and len(outs["x"].output_token_ids) >= 3
    done = helpers.run(eng, {}, p)
    assert done["0"].output_token_ids == want


def test_arrivals_and_page_pressure(prompts):
    """A request arriving while others decode (the held step lands, the prefill runs as
    before) and a pool so small that requests are preempted and recomputed: the same tokens
    as the plain loop under the same arrivals."""
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    results = []
    for eng in (plain(num_pages=20, page_size=4, cache_type="naive"),
                overlapped(num_pages=20, page_size=4, cache_type="naive")[0]):
        for rid in ("0", "1", "2"):
            eng.add_request(rid, prompts[rid], p)
        done = {}
        for i in range(200):
            if i == 6:
                eng.add_request("3", prompts["3"], p)
            if not eng.has_unfinished():
                break
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        assert eng.pool.num_free == 20
        results.append(tokens(done))
    assert results[0] == results[1] and len(results[1]) == 4


def test_seeded_draws_launching_ahead_as_landing_first(prompts):
    """Seeded sampling on the device sampler: each held step launched from the device's ids
    draws what it draws when the held step lands first (no step launched ahead)."""
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    ahead, launched = overlapped()
    got = helpers.run(ahead, prompts, p)
    first = helpers.engine()
    first.overlap = True
    first._launch_after = lambda held: None  # held steps land before the next one
    want = helpers.run(first, prompts, p)
    assert tokens(got) == tokens(want) and launched


def test_penalties_and_logprobs_are_not_held(prompts):
    """Rows the device sampler does not take (penalties, logprobs) sample as before."""
    eng, launched = overlapped()
    p = SamplingParams(max_tokens=4, temperature=0, repetition_penalty=1.3, logprobs=2)
    done = helpers.run(eng, {"0": prompts["0"]}, p)
    assert not launched and len(done["0"].logprobs) == 4
    want = helpers.run(plain(), {"0": prompts["0"]}, p)
    assert done["0"].output_token_ids == want["0"].output_token_ids


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
