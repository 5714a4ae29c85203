"""The CPU hand-off (freetoken/moe/handoff.py, csrc/cpu_moe/handoff.cpp) and the device fill.

Reference: `moe_reference` (float64 on the dequantized bank) of exactly the routes the CPU
owns: live rows, experts the map gives no slot. The banks are fp32, where the executor's dots
are fp32 too, so the results agree to float rounding (rtol 1e-4 of the output's largest
magnitude: sums of H * I products of unit-scale values). A route given to the wrong side (a
hit computed twice, a miss dropped, a padding row computed) moves a row by a whole route's
contribution, O(1) of that scale.

On the CPU the producer is Python (`post` / `wait`); on a GPU it is the Triton kernels, run
here eagerly and replayed from a CUDA graph with new inputs each time.

The receive kernels alone (`kernels/triton/handoff.receive_add`) run on any machine (Triton's
interpreter without CUDA) on a buffer holding a made-up answer: the shared expert added inside
the receive gives the bits of its own launch before it (`gated_add_triton`, or y + sh, then
the plain receive), with and without a gate.
"""

from __future__ import annotations

import os

import pytest
import torch
import util

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from freetoken.formats.qweight import QuantWeight
from freetoken.moe.banks import ExpertBank
from freetoken.moe.reference import moe_reference

pytest.importorskip("freetoken._cpu_moe")

from freetoken.moe.cpu_executor import CpuMoeExecutor  # noqa: E402
from freetoken.moe.handoff import Handoff  # noqa: E402

L, E, H, INTER, K = 2, 8, 64, 32, 3
MAX_T = 8


def _bank(seed: int) -> ExpertBank:
    g = torch.Generator().manual_seed(seed)
    return ExpertBank(
        QuantWeight(torch.randn(E, 2 * INTER, H, generator=g) / 8, "f32", (E, 2 * INTER, H)),
        QuantWeight(torch.randn(E, H, INTER, generator=g) / 8, "f32", (E, H, INTER)),
        torch.rand(E, 4, generator=g) + 0.5)


@pytest.fixture(scope="module")
def banks():
    return [_bank(30 + i) for i in range(L)]


def _inputs(seed: int, T: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    emap = torch.where(torch.rand(E, generator=g) < 0.5, torch.arange(E), -1).to(torch.int32)
    return x.to(device), ids.to(device), w.to(device), emap.to(device)


def _expected(bank, x, ids, w, emap, live):
    """The CPU's share: routes of rows < live whose expert has no slot."""
    x, ids, w, emap = x.cpu(), ids.cpu(), w.cpu(), emap.cpu()
    mine = (emap[ids] < 0) & (torch.arange(ids.shape[0])[:, None] < live)
    return moe_reference(x, ids, torch.where(mine, w, 0.0), bank.w13, bank.w2, bank.scales)


def _close(got, want):
    tol = 1e-4 * max(1.0, float(want.abs().max()))
    assert (got.float() - want).abs().max() <= tol


def test_cpu_share_matches_the_reference(banks):
    """Also the worker's job record: one row per job, its rows and routes the CPU's share,
    the times in order (go seen <= executor start <= end <= done <= free <= the next job's
    go seen)."""
    ho = Handoff(CpuMoeExecutor(2), banks, K, torch.device("cpu"), MAX_T)
    ho.set_trace(True)
    want_rows, want_routes = [], []
    for step, (T, live, layer) in enumerate([(5, 5, 0), (8, 3, 1), (1, 1, 1), (6, 0, 0)]):
        x, ids, w, emap = _inputs(step, T)
        ho.set_live(live)
        ho.send(layer, x, ids, w, emap, "silu")
        y0 = torch.randn(T, H)
        got = ho.receive(y0)
        _close(got - y0, _expected(banks[layer], x, ids, w, emap, live))
        mine = (emap[ids] < 0)[:live]
        want_rows.append(int(mine.any(1).sum()))
        want_routes.append(int(mine.sum()))
    assert ho.jobs == 4
    tr = ho.trace()
    assert tr.shape == (4, 7)
    assert tr[:, 4].tolist() == want_rows and tr[:, 5].tolist() == want_routes
    assert (tr[:, 0] <= tr[:, 1]).all() and (tr[:, 1] <= tr[:, 2]).all()
    assert (tr[:, 2] <= tr[:, 3]).all() and (tr[:, 3] <= tr[:, 6]).all()
    assert (tr[1:, 0] >= tr[:-1, 6]).all()
    ho.set_trace(False)
    assert ho.trace().shape == (0, 7)
    ho.close()


def test_bf16_input_and_gelu(banks):
    ho = Handoff(CpuMoeExecutor(1), banks, K, torch.device("cpu"), MAX_T)
    x, ids, w, emap = _inputs(7, 4)
    xb = x.to(torch.bfloat16)
    ho.set_live(4)
    ho.send(1, xb, ids, w, emap, "gelu_tanh")
    got = ho.receive(torch.zeros(4, H, dtype=torch.bfloat16))
    assert got.dtype == torch.bfloat16
    mine = emap[ids] < 0
    want = moe_reference(xb.float(), ids, torch.where(mine, w, 0.0), banks[1].w13, banks[1].w2,
                         banks[1].scales, "gelu_tanh")
    assert (got.float() - want).abs().max() <= 2e-2 * float(want.abs().max())  # bf16 output


def test_a_bad_job_is_an_error_and_the_next_one_works(banks):
    with torch.inference_mode():  # as the engine makes it: its first forward builds it
        ho = Handoff(CpuMoeExecutor(1), banks, K, torch.device("cpu"), MAX_T)
    x, ids, w, emap = _inputs(3, 2)
    ho.set_live(2)
    bad = ids.clone()
    bad[1, 2] = E + 5
    ho.send(0, x, bad, w, emap, "silu")
    with pytest.raises(RuntimeError, match=r"expert id 13 of row 1 is outside \[0, 8\)"):
        ho.receive(torch.zeros(2, H))
    ho.send(0, x, ids, w, emap, "silu")
    _close(ho.receive(torch.zeros(2, H)), _expected(banks[0], x, ids, w, emap, 2))
    with pytest.raises(ValueError, match="at most 8"):
        ho.send(0, torch.zeros(9, H), torch.zeros(9, K, dtype=torch.long), torch.zeros(9, K),
                emap, "silu")


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cuda
def test_cuda_kernels_eager_and_in_a_graph(banks):
    ho = Handoff(CpuMoeExecutor(2), banks, K, torch.device("cuda"), MAX_T)
    T = 6
    x, ids, w, emap = _inputs(0, T, "cuda")
    y0 = torch.randn(T, H, device="cuda")
    for step, live in enumerate([6, 2]):  # eager
        x.copy_(_inputs(step, T)[0].cuda())
        ho.set_live(live)
        ho.send(1, x, ids, w, emap, "silu")
        got = ho.receive(y0)
        torch.cuda.synchronize()
        ho.check()
        _close((got - y0).cpu(), _expected(banks[1], x, ids, w, emap, live))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ho.send(0, x, ids, w, emap, "silu")
        out = ho.receive(y0)
    for step, live in enumerate([6, 4, 1, 6]):
        xs, idss, ws, emaps = _inputs(100 + step, T, "cuda")
        x.copy_(xs), ids.copy_(idss), w.copy_(ws), emap.copy_(emaps)
        ho.set_live(live)
        g.replay()
        torch.cuda.synchronize()
        ho.check()
        _close((out - y0).cpu(), _expected(banks[0], x, ids, w, emap, live))
    ho.close()


@pytest.mark.parametrize("programs", [None, 1, 3])
def test_fill_kernel_matches_host_fill(programs, monkeypatch):
    """The slot fill kernel (a GPU kernel reading the pinned host banks; here Triton's
    interpreter over host tensors, or CUDA) against the host copies: one program a chunk, or
    `programs` a part striding over their chunks (fetching ahead's grid), with 64-word chunks
    so that every part here takes several."""
    from test_slot_cache import L as LAYERS
    from test_slot_cache import _bank

    from freetoken.kernels.triton import handoff
    from freetoken.moe.slot_cache import SlotCache

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    hosts = [_bank(i, True) for i in range(LAYERS)]
    if dev == "cuda":
        from freetoken.moe.host_banks import host_bank

        hosts = [host_bank(b, True) for b in hosts]
    monkeypatch.setattr(handoff, "FILL_CHUNK", 64)
    got, ref = SlotCache(hosts, 5, dev), SlotCache(hosts, 5, dev)
    for layer, ids in ((0, [[1, 4, 6]]), (1, [[2, 3, 7]]), (0, [[0, 5], [6, 2]])):
        t = torch.tensor(ids, device=dev)
        a, b = got.plan(layer, t, 99), ref.plan(layer, t, 99)
        assert torch.equal(a, b) and int((a[0] >= 0).sum()) > 0
        table, max_words, vec = got._fill_table(layer, hosts[layer])
        assert vec and max_words > 3 * 64  # 16-byte units; several chunks a part
        handoff.fill(a, got.pool, table, max_words, vec, programs)
        ref.fill(layer, hosts[layer], b)
        if dev == "cuda":
            torch.cuda.synchronize()
        assert torch.equal(got.pool, ref.pool), f"layer {layer}"


@cuda
def test_cuda_fill_kernel_matches_host_fill(banks, monkeypatch):
    from freetoken.kernels.triton import handoff
    from freetoken.kernels.triton.handoff import fill
    from freetoken.moe.host_banks import host_bank
    from freetoken.moe.slot_cache import SlotCache

    hosts = [host_bank(b, True) for b in banks]
    dev, ref, words, few = (SlotCache(hosts, 5, "cuda") for _ in range(4))
    assert dev.device_fill
    for layer, ids in ((0, [[1, 4, 6]]), (1, [[2, 3, 7]]), (0, [[0, 5, 6]])):
        t = torch.tensor(ids, device="cuda")
        a, b, c = dev.plan(layer, t, 99), ref.plan(layer, t, 99), words.plan(layer, t, 99)
        d = few.plan(layer, t, 99)
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
        dev.fill_on_device(layer, hosts[layer], a)  # 16-byte units (every size here allows)
        assert dev._fill_table(layer, hosts[layer])[2]
        table, max_words, _ = words._fill_table(layer, hosts[layer])
        fill(c, words.pool, table, max_words, vec=False)  # 4-byte words
        # one program a part striding over its chunks (an ahead fill's grid), with chunks of
        # 64 words so that it strides at these sizes
        table, max_words, vec = few._fill_table(layer, hosts[layer])
        monkeypatch.setattr(handoff, "FILL_CHUNK", 64)
        fill(d, few.pool, table, max_words, vec, programs=1)
        monkeypatch.undo()
        ref.fill(layer, hosts[layer], b)
        torch.cuda.synchronize()
        assert torch.equal(dev.pool, ref.pool) and torch.equal(words.pool, ref.pool)
        assert torch.equal(few.pool, ref.pool)


def test_a_job_posted_as_the_worker_starts_is_answered(banks):
    """The worker takes the last job number before its thread runs: a job posted at once
    after construction (before the new thread was scheduled) was once never answered."""
    ex = CpuMoeExecutor(1)
    x, ids, w, emap = _inputs(5, 2)
    want = _expected(banks[0], x, ids, w, emap, 2)
    for _ in range(10):
        ho = Handoff(ex, banks, K, torch.device("cpu"), MAX_T)
        ho.set_live(2)
        ho.send(0, x, ids, w, emap, "silu")
        _close(ho.receive(torch.zeros(2, H)), want)
        ho.close()


DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _answered(T: int, hidden: int, seed: int, job: int = 7, done: int | None = None):
    """A hand-off buffer (pinned on a GPU) whose `done` word answers job `job` (or holds
    `done`), its `out` a made-up CPU answer [T, hidden]; the device's job counter and waits."""
    from freetoken.moe.handoff import layout

    off = layout(MAX_T, K, E, hidden)
    buf = torch.zeros(off["size"], dtype=torch.uint8, pin_memory=DEV == "cuda")
    words = buf.view(torch.int32)
    words[off["done"] // 4] = job if done is None else done
    o = off["out"] // 4
    g = torch.Generator().manual_seed(seed)
    buf.view(torch.float32)[o:o + T * hidden] = torch.randn(T * hidden, generator=g)
    seq = torch.tensor([job], dtype=torch.int32, device=DEV)
    return buf, off, seq, torch.zeros(2, dtype=torch.int64, device=DEV)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("hidden", [160, 1100])  # one block of 256, two of 1024: both masked
@pytest.mark.parametrize("gated", [True, False])
def test_receive_adds_the_shared_expert_with_the_bits_of_two_launches(gated, hidden, T, dtype):
    """y + gate * sh + the CPU's answer in one launch equals, bit for bit, the shared expert's
    launch (gated_add_triton; ungated: y + sh rounded as the kernel rounds, which on a GPU is
    torch's y + sh) followed by the plain receive; each receive counts one call and, the
    answer being there, no wait."""
    from freetoken.kernels.triton.glu import gated_add_triton
    from freetoken.kernels.triton.handoff import receive_add

    g = torch.Generator().manual_seed(hidden + T)
    y, sh, x = ((torch.randn(T, hidden, generator=g) * 2).to(dtype).to(DEV) for _ in range(3))
    w = (torch.randn(hidden, generator=g) * 0.1).to(dtype).to(DEV) if gated else None
    buf, off, seq, waits = _answered(T, hidden, 5)
    got = receive_add(y, seq, buf, off, waits, (sh, x, w))
    if gated:
        first = gated_add_triton(y, sh, x, w)
    else:  # y + sh narrowed by Triton: the plain receive of 0 + (y + sh) in fp32
        # the host rewrites the pinned buffer only after the kernels that read it have run
        # (launches are asynchronous on a GPU)
        o = off["out"] // 4
        answer = buf.view(torch.float32)[o:o + T * hidden].clone()
        _sync()
        buf.view(torch.float32)[o:o + T * hidden] = (y.float() + sh.float()).reshape(-1).cpu()
        first = receive_add(torch.zeros_like(y), seq, buf, off, waits)
        _sync()
        buf.view(torch.float32)[o:o + T * hidden] = answer
        if DEV == "cuda":
            assert torch.equal(first, y + sh)
    want = receive_add(first, seq, buf, off, waits)
    assert got.dtype == dtype and got.shape == (T, hidden)
    assert torch.equal(got, want)
    assert waits.tolist() == [0, 3 if not gated else 2]


@pytest.mark.parametrize("gated", [True, False])
def test_a_late_answer_times_out_and_sets_the_timeout_word(gated, monkeypatch):
    """`done` never reaches the job: every program gives up after TIMEOUT_S (under the
    interpreter a poll counts as a nanosecond), the timeout word is set for the host's check,
    and the waits count the one call and the time polled."""
    from freetoken.kernels.triton import handoff

    monkeypatch.setattr(handoff, "TIMEOUT_S", 20e-9 if DEV == "cpu" else 1e-3)
    T, hidden = 2, 160
    y, sh, x = (torch.randn(T, hidden).to(DEV) for _ in range(3))
    w = torch.randn(hidden).to(DEV) if gated else None
    for shared in ((sh, x, w), None):
        buf, off, seq, waits = _answered(T, hidden, 1, job=7, done=6)
        handoff.receive_add(y, seq, buf, off, waits, shared)
        if DEV == "cuda":
            torch.cuda.synchronize()
        assert int(buf.view(torch.int32)[off["timeout"] // 4]) == 1
        ns, calls = waits.tolist()
        assert calls == 1 and ns >= int(handoff.TIMEOUT_S * 1e9)


def _wait_for(cond, timeout_s: float = 20.0) -> None:
    import time

    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "the worker did not get there in time"
        time.sleep(0.001)


def test_warming_reads_the_hinted_cpu_experts_and_changes_no_result(banks):
    """The worker warms a hint's experts after the job it is tagged with, less the first F
    (the fetch table at the hint's miss count: the ones the device fetches), and counts which
    of them the next job of that layer computes; the answers stay the reference's."""
    import numpy as np

    ho = Handoff(CpuMoeExecutor(2), banks, K, torch.device("cpu"), MAX_T)
    ho.set_prefetch(True, [0, 1, 1, 1, 2, 2, 2, 2, 2])  # F(3) = 1
    x, ids, w, emap = _inputs(11, 2)
    ho.set_live(2)
    words = ho.buf.numpy().view(np.int32)
    h = ho.off["hint"] // 4
    words[h:h + 7] = [1, 1, 3, 0, 5, 2, 6]  # job 1's hint: layer 1, misses 5, 2, 6
    ho.send(0, x, ids, w, emap, "silu")  # job 1
    _close(ho.receive(torch.zeros(2, H)), _expected(banks[0], x, ids, w, emap, 2))
    _wait_for(lambda: ho.prefetch_stats()["hints"] == 1)
    assert ho.prefetch_stats() == {"hints": 1, "warmed": 2, "used": 0, "cpu": 0}  # 2 and 6
    # layer 1 then routes row 0 to 2 (a CPU expert), 6 (held in a slot) and 1 (CPU)
    x2 = torch.randn(1, H)
    ids2 = torch.tensor([[2, 6, 1]])
    w2 = torch.rand(1, K)
    emap2 = torch.full((E,), -1, dtype=torch.int32)
    emap2[6] = 0
    ho.set_live(1)
    ho.send(1, x2, ids2, w2, emap2, "silu")  # job 2: no hint tagged 2, nothing warmed after
    _close(ho.receive(torch.zeros(1, H)), _expected(banks[1], x2, ids2, w2, emap2, 1))
    assert ho.prefetch_stats() == {"hints": 1, "warmed": 2, "used": 1, "cpu": 2}
    ho.set_prefetch(False)
    words[h] = 3  # a hint for job 3, but warming is off
    ho.send(1, x2, ids2, w2, emap2, "silu")
    ho.receive(torch.zeros(1, H))
    assert ho.prefetch_stats()["hints"] == 1
    ho.close()


@pytest.mark.parametrize("ahead_counts", [True, False])
def test_warming_skips_fetches_as_the_plan_counts_slots_filled_ahead(banks, ahead_counts):
    """With the worker's copies ahead under hybrid's split (ahead_counts), a hint's layer whose
    ahead list of a experts the worker copied after the job: the device fetches F(misses +
    a) - a of the hint's misses (SlotCache.plan), so the worker skips that many and warms the
    rest; without ahead_counts (offload, int limits), F(misses)."""
    import numpy as np

    ho, got, _, _ = _copying(banks, "cpu")
    # F(3) = 1, F(5) = 4: with 2 ahead the device fetches 4 - 2 = 2 of the 3 misses left
    ho.set_prefetch(True, [0, 1, 1, 1, 2, 4, 4, 4, 4], ahead_counts)
    x, ids, w, emap = _inputs(13, 2)
    ho.set_live(2)
    words = ho.buf.numpy().view(np.int32)
    h = ho.off["hint"] // 4
    words[h:h + 7] = [1, 1, 3, 0, 5, 2, 6]  # job 1's hint: layer 1, misses 5, 2, 6
    ahead = got.plan_ahead(1, torch.tensor([[0, 3, 4]]), 2)  # slots for 2 of layer 1's experts
    assert int((ahead[0] >= 0).sum()) == 2
    ho.post_ahead(1, ahead)  # posted while job 1 runs: copied after its answer
    ho.send(0, x, ids, w, emap, "silu")  # job 1
    _close(ho.receive(torch.zeros(2, H)), _expected(banks[0], x, ids, w, emap, 2))
    ho.wait_ahead(1)
    _wait_for(lambda: ho.prefetch_stats()["hints"] == 1)
    assert ho.ahead_stats()["copied"] == 2
    # 6 warmed after skipping 5 and 2; 2 and 6 after skipping 5
    assert ho.prefetch_stats()["warmed"] == (1 if ahead_counts else 2)
    ho.close()


@pytest.mark.parametrize("T,live,E_", [(1, 1, 8), (5, 3, 40), (8, 8, 128)])
def test_hint_kernel_writes_the_plans_fetch_order(T, live, E_):
    """kernels/triton/handoff.post_hint (CUDA, else Triton's interpreter) against hint_order:
    the predicted misses of live rows, most-routed first, then the lower id; the count, layer
    and the tag (the job counter)."""
    import numpy as np

    from freetoken.kernels.triton.handoff import post_hint
    from freetoken.moe.handoff import HINT_MAX, hint_order, layout

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(T * 100 + E_)
    k = 8 if E_ >= 40 else K
    ids = torch.stack([torch.randperm(E_, generator=g)[:k] for _ in range(T)])
    ids[: T // 2, 0] = ids[0, 0]  # one expert routed by several rows: first in the order
    emap = torch.where(torch.rand(E_, generator=g) < 0.3, torch.arange(E_), -1).to(torch.int32)
    off = layout(8, k, E_, H)
    buf = torch.zeros(off["size"], dtype=torch.uint8, pin_memory=dev == "cuda")
    seq = torch.tensor([41], dtype=torch.int32, device=dev)
    post_hint(ids.to(dev), emap.to(dev), torch.tensor([live], dtype=torch.int32, device=dev),
              seq, buf, off, 3)
    if dev == "cuda":
        torch.cuda.synchronize()
    words = buf.numpy().view(np.int32)[off["hint"] // 4:]
    order, misses = hint_order(ids[:live], emap)
    assert misses > 0 and len(order) == min(misses, HINT_MAX)
    assert words[:3].tolist() == [41, 3, misses]
    assert words[4:4 + len(order)].tolist() == order


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,hidden", [(1, 160), (3, 1024)])  # a masked row, a full one
def test_receive_folds_the_next_residual_step(T, hidden, dtype, quantize, monkeypatch):
    """The receive with a fold (`kernels/norm.py`: the next layer's residual step) gives the
    plain receive's sum, bit for bit, and carries the RMSNorm kernel's (y, s, codes) of that
    sum and the residual, which `add_rms_norm` of the sum returns; another residual tensor
    gets the plain residual step. The codes are asked for on the CPU too (the interpreter)."""
    from freetoken.kernels import norm, xq
    from freetoken.kernels.triton.handoff import receive_add
    from freetoken.kernels.triton.norm import rms_norm_triton

    if quantize and DEV == "cpu":
        monkeypatch.setattr(xq, "wanted", lambda x: True)
    g = torch.Generator().manual_seed(T * hidden)
    y, res = ((torch.randn(T, hidden, generator=g) * 2).to(dtype).to(DEV) for _ in range(2))
    weight = (torch.rand(hidden, generator=g) + 0.5).to(DEV)
    fold = norm.NormFold(res, weight, 1e-6, quantize)
    buf, off, seq, waits = _answered(T, hidden, 3)
    got = receive_add(y, seq, buf, off, waits, None, fold)
    want = receive_add(y, seq, buf, off, waits)
    assert torch.equal(got, want)
    # codes where an int8 GEMV would read them (a 16-bit activation on CUDA; forced on the CPU)
    ny, ns, nq = rms_norm_triton(want, weight, 1e-6, res, quantize=quantize and xq.wanted(want))
    fy, fs = norm.add_rms_norm(got, res, weight, 1e-6, quantize)
    assert torch.equal(fy, ny) and torch.equal(fs, ns)
    if nq is not None:
        assert torch.equal(xq.attached(fy), nq)
    other = res.clone()
    py, ps = norm.add_rms_norm(got, other, weight, 1e-6, quantize)
    assert py is not fy and torch.equal(ps, got + other)  # not the fold's: computed again
    assert waits.tolist() == [0, 2]


@pytest.mark.parametrize("quantize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gated", [True, False])
# rows of 320 and 1120 (padded to 512 and 2048: the RMSNorm kernel's 4 warps, the gate's)
# fold; a row of 160 (one warp's) does not, and the plain shared receive runs
@pytest.mark.parametrize("T,hidden", [(1, 1120), (3, 320), (2, 160)])
def test_shared_receive_folds_the_next_residual_step(T, hidden, gated, dtype, quantize,
                                                      monkeypatch):
    """The receive that adds the shared expert, given a fold (the qwen3.5-moe layers' next
    residual step), gives the unfolded receive's sum bit for bit (its gate's FMAs and
    roundings) and carries the RMSNorm kernel's (y, s, codes) of that sum and the residual,
    which `add_rms_norm` returns without a launch; where the row's norm takes other warps
    than the gate's, the fold is ignored and `add_rms_norm` computes the step itself."""
    from freetoken.kernels import norm, xq
    from freetoken.kernels.triton.glu import gate_folds
    from freetoken.kernels.triton.handoff import receive_add

    if quantize and DEV == "cpu":
        monkeypatch.setattr(xq, "wanted", lambda x: True)
    g = torch.Generator().manual_seed(T * hidden + gated)
    y, sh, x, res = ((torch.randn(T, hidden, generator=g) * 2).to(dtype).to(DEV)
                     for _ in range(4))
    w = (torch.randn(hidden, generator=g) * 0.1).to(dtype).to(DEV) if gated else None
    weight = (torch.rand(hidden, generator=g) + 0.5).to(DEV)
    fold = norm.NormFold(res, weight, 1e-6, quantize)
    buf, off, seq, waits = _answered(T, hidden, 9)
    got = receive_add(y, seq, buf, off, waits, (sh, x, w), fold)
    want = receive_add(y, seq, buf, off, waits, (sh, x, w))
    assert util.check_folded_step(got, want, res, weight, quantize) == gate_folds(hidden)
    assert gate_folds(hidden) == (hidden > 256)
    assert waits.tolist() == [0, 2]


def _copying(banks, dev: str, slots: int = 5):
    """(a Handoff whose worker copies ahead lists into `got`'s pool, got, ref: two slot
    caches over the same host banks, the host banks: pinned and registered on a GPU)."""
    from freetoken.moe.slot_cache import SlotCache

    hosts = banks
    if dev == "cuda":
        from freetoken.moe.host_banks import host_bank

        hosts = [host_bank(b, True) for b in banks]
    got, ref = SlotCache(hosts, slots, dev), SlotCache(hosts, slots, dev)
    ho = Handoff(CpuMoeExecutor(1), banks, K, torch.device(dev), MAX_T)
    parts = [got.copy_parts(i, h) for i, h in enumerate(hosts)]
    assert ho.start_copies(got.pool, got.slot_bytes, parts) is None and ho.copies
    return ho, got, ref, hosts


# (layer, predicted routes) of successive calls: the ahead plans take up to 2 of 5 slots
# each; the calls between them (a plan fetching nothing) move the clock, so that later lists
# evict slots that earlier lists filled; the last list is empty (its experts have slots)
_AHEAD_STEPS = ((0, [[1, 4, 6]]), (1, [[2, 3, 7]]), (0, [[0, 5], [6, 2]]), (1, [[5, 1]]),
                (0, [[3, 7, 2]]), (0, [[3, 7, 2]]), (0, [[3, 7, 2]]))


def test_the_worker_copies_ahead_lists_into_their_slots(banks):
    """moe/handoff.py copies ahead: each list the plan gives slots ahead is copied by the
    worker into exactly those slots (the pool equals a cache filled by `SlotCache.fill`),
    the wait returns once they are there; on a GPU by the copy engine, eagerly, then as
    a CUDA graph replayed with new routes."""
    ho, got, ref, hosts = _copying(banks, DEV)
    # on a GPU start_copies served one empty list already (its kernels loaded while idle)
    lists, sizes = (1 if DEV == "cuda" else 0), []
    assert ho.ahead_stats() == {"lists": lists, "copied": 0}
    for i, (layer, ids) in enumerate(_AHEAD_STEPS):
        t = torch.tensor(ids, device=DEV)
        if i % 2:
            got.plan(layer, t, 0), ref.plan(layer, t, 0)
        a, b = got.plan_ahead(layer, t, 2), ref.plan_ahead(layer, t, 2)
        assert torch.equal(a, b)
        sizes.append(int((a[0] >= 0).sum()))
        ho.post_ahead(layer, a)
        ho.wait_ahead(layer)
        ref.fill(layer, hosts[layer], b)
        _sync()
        ho.check()
        lists += 1
        assert torch.equal(got.pool, ref.pool), f"step {i}"
    assert ho.ahead_stats() == {"lists": lists, "copied": sum(sizes)}
    assert 0 in sizes and sum(sizes) > 5, sizes  # an empty list; slots filled again
    if DEV == "cuda":
        t = torch.tensor([[0, 1, 2]], device="cuda")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            got.plan(1, t, 0)
            a = got.plan_ahead(1, t, 2)
            ho.post_ahead(1, a)
            ho.wait_ahead(1)
        for ids in ([[3, 4, 7]], [[0, 6, 5]], [[1, 2, 3]]):
            t.copy_(torch.tensor(ids))
            g.replay()
            ref.plan(1, t, 0)
            ref.fill(1, hosts[1], ref.plan_ahead(1, t, 2))
            torch.cuda.synchronize()
            ho.check()
            assert torch.equal(got.pool, ref.pool), ids
    ho.close()


@pytest.mark.parametrize("delay_us", ["", "1000"])
def test_an_ahead_list_beside_jobs_and_a_bad_list(banks, delay_us, monkeypatch):
    """With the CPU standing in: a list posted while a job is pending is copied and the job
    answered as the reference says; a list for a layer without parts is an error that names
    it, and the next list is served. Also with the copies held back after each answer
    (FREETOKEN_MOE_AHEAD_DELAY_US): every list is still served."""
    monkeypatch.setenv("FREETOKEN_MOE_AHEAD_DELAY_US", delay_us)
    ho, got, ref, hosts = _copying(banks, "cpu")
    x, ids, w, emap = _inputs(21, 2)
    ho.set_live(2)
    t = torch.tensor([[1, 4, 6]])
    a, b = got.plan_ahead(1, t, 2), ref.plan_ahead(1, t, 2)
    ho.send(0, x, ids, w, emap, "silu")
    ho.post_ahead(1, a)
    _close(ho.receive(torch.zeros(2, H)), _expected(banks[0], x, ids, w, emap, 2))
    ho.wait_ahead(1)
    ref.fill(1, hosts[1], b)
    assert torch.equal(got.pool, ref.pool)
    ho.post_ahead(7, a)  # no layer 7: served, with an error
    with pytest.raises(RuntimeError, match="ahead list 2 for MoE layer 7"):
        ho.wait_ahead(7)
    ho.post_ahead(0, got.plan_ahead(0, t, 1))
    ho.wait_ahead(0)
    assert ho.ahead_stats()["lists"] == 3
    ho.close()


def test_drain_returns_once_the_last_job_and_ahead_list_are_done(banks):
    """After a failed step the cache waits for the worker (`Handoff.drain`) before it reuses
    slots: a job posted with two ahead lists behind it (the worker serves them after the
    job) is answered and both lists copied when drain returns; with nothing posted it
    returns at once, and it gives up (False) on a job that is never answered."""
    import numpy as np

    ho, got, ref, hosts = _copying(banks, "cpu")
    assert ho.drain(0.0)
    x, ids, w, emap = _inputs(22, 4)
    ho.set_live(4)
    ho.send(0, x, ids, w, emap, "silu")
    for layer, t in ((1, [[1, 4, 6]]), (0, [[2, 3]])):
        t = torch.tensor(t)
        a, b = got.plan_ahead(layer, t, 2), ref.plan_ahead(layer, t, 2)
        ho.post_ahead(layer, a)
        ref.fill(layer, hosts[layer], b)
    assert ho.drain()
    words = ho.buf.numpy().view(np.uint32)
    assert words[ho.off["done"] // 4] == words[ho.off["go"] // 4] == 1
    assert ho.ahead_stats()["lists"] == 2 and words[ho.off["ahead_done"] // 4] == 2
    assert torch.equal(got.pool, ref.pool)
    words[ho.off["done"] // 4] = 5  # an answer that does not match the job posted
    assert not ho.drain(0.01)
    ho.close()


def test_a_list_overwritten_before_it_was_served_is_skipped(banks):
    """After a device wait that timed out, the device goes on posting ahead lists, and one
    may overwrite an area before the worker served it: the worker serves the older of the
    lists it has not served (here 3, then 4; list 2 is gone) instead of waiting for list 2
    for ever, and `ahead_done` passes 2 (its wait returns)."""
    import numpy as np

    ho, got, ref, hosts = _copying(banks, "cpu")
    words = ho.buf.numpy().view(np.int32)
    area = (16 + 8 * ho.off["ahead_max"]) // 4

    def post(a: int, layer: int, pairs: list[tuple[int, int]]) -> None:
        h = ho.off["ahead"] // 4 + (a & 1) * area
        words[h + 4:h + 4 + 2 * len(pairs)] = [v for p in pairs for v in p]
        words[h + 1], words[h + 2] = layer, len(pairs)
        words[h] = a  # the tag last

    post(1, 0, [(5, 0)])
    _wait_for(lambda: ho.ahead_stats()["lists"] == 1)
    post(3, 1, [(2, 1), (7, 3)])  # area 1; list 2 (area 0) was overwritten by 4
    post(4, 0, [(6, 4)])
    _wait_for(lambda: ho.ahead_stats()["lists"] == 3)
    assert ho.ahead_stats() == {"lists": 3, "copied": 4}
    assert words[ho.off["ahead_done"] // 4] == 4
    assert ho._worker.wait_ahead(2, 1.0) and ho.drain(1.0)
    for layer, pairs in ((0, [(5, 0), (6, 4)]), (1, [(2, 1), (7, 3)])):
        ref.fill(layer, hosts[layer], torch.tensor(pairs).t())
    assert torch.equal(got.pool, ref.pool)
    ho.check()
    ho.close()


@pytest.mark.parametrize("n,valid", [(3, [0, 2]), (8, [1, 2, 3, 4, 5, 6, 7]), (2, [])])
def test_ahead_kernels_write_the_list_and_wait_for_its_copies(n, valid, monkeypatch):
    """kernels/triton/handoff.post_ahead (CUDA, else Triton's interpreter): the valid pairs
    packed in order, their count, the layer and the tag (the list counter + 1) in area
    tag & 1, the layer's entry of the device table; wait_ahead returns where ahead_done has
    reached that number and sets the timeout word where it never does."""
    import numpy as np

    from freetoken.kernels.triton import handoff
    from freetoken.moe.handoff import layout

    off = layout(MAX_T, K, E, H)
    buf = torch.zeros(off["size"], dtype=torch.uint8, pin_memory=DEV == "cuda")
    e = torch.full((n,), -1, dtype=torch.int64)
    s = torch.full((n,), -1, dtype=torch.int64)
    for j, i in enumerate(valid):
        e[i], s[i] = 10 + i, 20 + j
    seq = torch.tensor([6], dtype=torch.int32, device=DEV)
    want = torch.zeros(3, dtype=torch.int32, device=DEV)
    handoff.post_ahead(torch.stack([e, s]).to(DEV), seq, want, buf, off, 2)
    _sync()
    words = buf.numpy().view(np.int32)
    area = (off["ahead"] + (7 & 1) * (16 + 8 * off["ahead_max"])) // 4
    assert words[area:area + 3].tolist() == [7, 2, len(valid)]
    pairs = words[area + 4:area + 4 + 2 * len(valid)].reshape(-1, 2).tolist()
    assert pairs == [[10 + i, 20 + j] for j, i in enumerate(valid)]
    assert seq.tolist() == [7] and want.tolist() == [0, 0, 7]
    monkeypatch.setattr(handoff, "TIMEOUT_S", 20e-9 if DEV == "cpu" else 1e-3)
    done = off["ahead_done"] // 4
    for value, late in ((7, 0), (9, 0), (6, 1)):
        words[done] = value
        words[off["timeout"] // 4] = 0
        handoff.wait_ahead(want, 2, buf, off)
        _sync()
        assert int(words[off["timeout"] // 4]) == late, value
