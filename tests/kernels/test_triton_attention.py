"""Triton paged attention (decode, split-K decode, varlen prefill, KV store) against the torch
reference `freetoken.kernels.attention.paged_attention` on the same cache.

Without CUDA the kernels run under Triton's interpreter (TRITON_INTERPRET=1) on small fp32
shapes (with CUDA, the same small cases run compiled on the device), and with CUDA larger bf16
shapes run too. Tolerances:
- fp32 cache (IEEE dots): |out - ref| <= 2e-5 + 1e-4 |ref| (only the summation order differs);
- bf16 cache: 2e-2 absolute on outputs of magnitude <= ~1: the kernel feeds bf16 q and the
  bf16-rounded softmax weights to the tensor cores (relative error 2^-8 per term), the
  reference multiplies in fp32.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():  # NOTE: read when the kernels are decorated (first import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from freetoken.engine.context import ForwardContext  # noqa: E402
from freetoken.kernels.attention import paged_attention, paged_attention_triton  # noqa: E402

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"  # compiled kernels need device tensors; the interpreter, CPU


def make_ctx(starts: list[int], news: list[int], page_size: int, num_pages: int,
             device: str, gen: torch.Generator) -> ForwardContext:
    """A batch where sequence i has `starts[i]` cached tokens and feeds `news[i]` new ones,
    its pages drawn at random (shuffled) from the pool."""
    perm = torch.randperm(num_pages, generator=gen).tolist()
    tables, positions, slots, cu, lens = [], [], [], [0], []
    for s, n in zip(starts, news):
        need = -(-(s + n) // page_size)
        pages, perm = perm[:need], perm[need:]
        tables.append(pages)
        positions += range(s, s + n)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(s, s + n)]
        cu.append(cu[-1] + n)
        lens.append(s + n)
    width = max(len(t) for t in tables)
    table = [t + [0] * (width - len(t)) for t in tables]

    def t(x, dt):
        return torch.tensor(x, dtype=dt, device=device)

    return ForwardContext(
        positions=t(positions, torch.long), cu_seqlens_q=t(cu, torch.int32),
        seq_lens=t(lens, torch.int32), page_table=t(table, torch.int32),
        slot_mapping=t(slots, torch.long), logits_indices=t([c - 1 for c in cu[1:]], torch.long),
        page_size=page_size, cu_seqlens_q_list=cu, seq_lens_list=lens,
        max_seqlen_q=max(news))


def run_both(starts, news, *, n_q=4, n_kv=2, d=32, page_size=4, window=None, softcap=None,
             dtype=torch.float32, device=DEV, seed=0):
    """(triton out, reference out, triton cache, reference cache) for one random batch."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-(s + n) // page_size) for s, n in zip(starts, news)) + 3
    ctx = make_ctx(starts, news, page_size, num_pages, device, gen)
    cache = torch.randn(2, num_pages, page_size, n_kv, d, generator=gen).to(device, dtype)
    tokens = sum(news)
    q, k, v = (torch.randn(tokens, h, d, generator=gen).to(device, dtype)
               for h in (n_q, n_kv, n_kv))
    scale = d ** -0.5
    ref_cache = cache.cpu().clone()  # the reference writes its own copy, on the CPU
    ref = paged_attention(q.cpu(), k.cpu(), v.cpu(), ref_cache, _cpu(ctx), scale=scale,
                          window=window, softcap=softcap)
    out = paged_attention_triton(q, k, v, cache, ctx, scale=scale, window=window,
                                 softcap=softcap)
    return out.cpu(), ref, cache.cpu(), ref_cache


def _cpu(ctx: ForwardContext) -> ForwardContext:
    fields = ("positions", "cu_seqlens_q", "seq_lens", "page_table", "slot_mapping",
              "logits_indices")
    return ForwardContext(**{f: getattr(ctx, f).cpu() for f in fields}, page_size=ctx.page_size,
                          cu_seqlens_q_list=ctx.cu_seqlens_q_list,
                          seq_lens_list=ctx.seq_lens_list)


def close_fp32(out, ref):
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 7.0), (3, 2.0)])
def test_decode_matches_reference(window, softcap):
    out, ref, cache, ref_cache = run_both([0, 6, 17], [1, 1, 1], window=window, softcap=softcap)
    close_fp32(out, ref)
    assert torch.equal(cache, ref_cache)  # the store wrote the same slots


@pytest.mark.parametrize("d,n_q,n_kv", [(40, 6, 2), (16, 3, 3), (256, 2, 1), (512, 2, 2)])
def test_head_dims_and_groups(d, n_q, n_kv):
    """Padded head sizes, GQA groups, and the narrower tiles of 256 / 512-wide heads."""
    out, ref, _, _ = run_both([2, 9], [1, 1], d=d, n_q=n_q, n_kv=n_kv)
    close_fp32(out, ref)
    out, ref, _, _ = run_both([0, 3], [20, 2], d=d, n_q=n_q, n_kv=n_kv)
    close_fp32(out, ref)


def test_decode_split_k_matches_unsplit():
    """Forced splits over contexts of 150 and 40 keys (uneven shares)."""
    from freetoken.kernels.triton import attention as tri

    gen = torch.Generator().manual_seed(3)
    ctx = make_ctx([149, 39], [1, 1], 16, 14, "cpu", gen)
    cache = torch.randn(2, 14, 16, 2, 32, generator=gen)
    q = torch.randn(2, 4, 32, generator=gen)
    zero = torch.zeros(2, 2, 32)
    ref = paged_attention(q, zero, zero, cache, ctx, scale=0.2)  # writes the zero rows
    cache, q, table, lens = (t.to(DEV) for t in (cache, q, ctx.page_table, ctx.seq_lens))
    for splits in (1, 3):
        out, _ = tri.decode(q, cache, table, lens, scale=0.2, window=None, softcap=None,
                            splits=splits)
        close_fp32(out.cpu(), ref)


@pytest.mark.parametrize("fused_merge", [True, False])
def test_decode_quantized_output(fused_merge):
    """With `quantize`, decode also stores its bf16 output quantized for the output
    projection's int8 GEMV: exactly the quantization of the stored output, rows of all query
    heads in order (one split: the query heads of a KV head per program, G = 2 of a 16-row
    tile; three and eight splits (five of them empty for 150 keys, seven for 40): the last
    split to arrive, the query heads of its KV head, or the merge kernel, one head per
    program); the output itself unchanged (to its rounding on the GPU)."""
    sys.path.insert(0, os.path.dirname(__file__))
    import triton_cases as cases

    from freetoken.kernels.triton import attention as tri

    gen = torch.Generator().manual_seed(4)
    ctx = make_ctx([149, 39], [1, 1], 16, 14, "cpu", gen)
    cache = torch.randn(2, 14, 16, 2, 32, generator=gen).to(torch.bfloat16)
    q = torch.randn(2, 4, 32, generator=gen).to(torch.bfloat16)
    cache, q, table, lens = (t.to(DEV) for t in (cache, q, ctx.page_table, ctx.seq_lens))
    for splits in (1, 3, 8):
        kw = dict(scale=0.2, window=None, softcap=None, splits=splits,
                  fused_merge=fused_merge)
        plain, none = tri.decode(q, cache, table, lens, **kw)
        out, q8 = tri.decode(q, cache, table, lens, quantize=True, **kw)
        assert none is None
        if CUDA:  # compiled without fused multiply-adds when quantizing (the codes' rounding)
            assert torch.allclose(out.float(), plain.float(), rtol=2.0**-7, atol=1e-6)
        else:
            assert torch.equal(out, plain)
        cases.check_codes(q8, out.reshape(2, -1))


# Decode contexts for the split merge: one key (every split but the first empty), a share
# shorter than a block, uneven shares, a block boundary and one key past it.
MERGE_LENS = [1, 40, 150, 64, 65, 257]


def _decode_ref(lens, n_q, n_kv, d, window, softcap, seed=5):
    """(q, cache, table, seq_lens on DEV, reference out [B, n_q, d]) for decode queries at
    positions lens - 1, pages of 16 keys."""
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // 16) for n in lens) + 2
    ctx = make_ctx([n - 1 for n in lens], [1] * len(lens), 16, pages, "cpu", gen)
    cache = torch.randn(2, pages, 16, n_kv, d, generator=gen)
    q = torch.randn(len(lens), n_q, d, generator=gen)
    zero = torch.zeros(len(lens), n_kv, d)
    ref = paged_attention(q, zero, zero, cache, ctx, scale=d ** -0.5, window=window,
                          softcap=softcap)  # writes the zero rows
    return (*(t.to(DEV) for t in (q, cache, ctx.page_table, ctx.seq_lens)), ref)


def _decode(*args, **kw):
    from freetoken.kernels.triton.attention import decode

    return decode(*args, **kw)


def _merged_both(q, cache, table, lens, ref, splits, **kw):
    """The splits merged in the decode kernel and by the merge kernel, both against the
    reference, and against each other within fp32 rounding of the merge: the same terms,
    whose sums may associate differently (compiled: the order of the splits' sum; under the
    interpreter, numpy's reductions, whose SIMD association depends on the host's ISA: on an
    AVX-512 machine 74 of 720 values of the 257-key case differ by one ulp). Each of the
    `splits` partials enters the sum once, rounded with a relative error of at most 2^-24,
    so the two differ by at most splits * 2^-23 of the largest output."""
    fused, _ = _decode(q, cache, table, lens, splits=splits, fused_merge=True, **kw)
    apart, _ = _decode(q, cache, table, lens, splits=splits, fused_merge=False, **kw)
    close_fp32(fused.cpu(), ref)
    close_fp32(apart.cpu(), ref)
    bound = (splits or 16) * 2.0 ** -23 * float(apart.abs().max())  # num_splits: <= 16
    torch.testing.assert_close(fused, apart, rtol=0.0, atol=bound)
    return fused


class _Spy:
    """A kernel whose launches' grids are recorded."""

    def __init__(self, kernel, grids: list) -> None:
        self.kernel, self.grids = kernel, grids

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (30, 2.0)])
def test_decode_merge_in_kernel(window, softcap):
    """Split-K merged by the last split of each (sequence, kv head) to arrive: the automatic
    split count (4 for this table of 272 keys: one key block a split) and a forced odd one,
    over contexts with empty splits and uneven shares."""
    from freetoken.kernels.triton.attention import num_splits

    q, cache, table, lens, ref = _decode_ref(MERGE_LENS, 4, 2, 32, window, softcap)
    assert num_splits(len(MERGE_LENS), 2, table.shape[1] * 16, 64) == 4
    for splits in (None, 3):
        _merged_both(q, cache, table, lens, ref, splits, scale=32 ** -0.5, window=window,
                     softcap=softcap)


@pytest.mark.parametrize("group", [1, 4, 16])
def test_decode_merge_most_splits_twice(group, monkeypatch):
    """16 splits (most of them empty: 1, 150 and 257 keys in shares of one block), a padded
    head size (40 of 64) and a 3-head group, the merging program reading 1, 4 or all 16
    splits a round (MERGE_GROUP); a second call gives the same output without a merge launch
    and leaves the arrival counters at zero (each was reset by its last arriver: graph
    replays work)."""
    from freetoken.kernels.triton import attention as tri
    from freetoken.kernels.triton.arrive import counters

    monkeypatch.setattr(tri, "MERGE_GROUP", group)
    lens = [1, 150, 257]
    q, cache, table, seq_lens, ref = _decode_ref(lens, 6, 2, 40, 200, None)
    kw = dict(scale=40 ** -0.5, window=200, softcap=None)
    first = _merged_both(q, cache, table, seq_lens, ref, 16, **kw)
    launched = []
    monkeypatch.setattr(tri, "_merge_kernel", _Spy(tri._merge_kernel, launched))
    again, _ = _decode(q, cache, table, seq_lens, splits=16, fused_merge=True, **kw)
    assert torch.equal(again, first) and launched == []
    assert not counters("attn_merge", tri.MERGE_COUNTERS, q.device).any()


def test_decode_merge_beyond_counters(monkeypatch):
    """More (sequence, kv head) pairs than MERGE_COUNTERS: the merge kernel takes over."""
    from freetoken.kernels.triton import attention as tri

    q, cache, table, lens, ref = _decode_ref(MERGE_LENS, 4, 2, 32, None, None)
    monkeypatch.setattr(tri, "MERGE_COUNTERS", len(MERGE_LENS) * 2 - 1)
    launched = []
    monkeypatch.setattr(tri, "_merge_kernel", _Spy(tri._merge_kernel, launched))
    out, _ = tri.decode(q, cache, table, lens, scale=32 ** -0.5, window=None, softcap=None,
                        splits=4, fused_merge=True)
    close_fp32(out.cpu(), ref)
    assert launched == [(len(MERGE_LENS), 4)]


@pytest.mark.parametrize("splits,merge_launches", [(2, 0), (4, 1)])
def test_decode_merge_default_by_split_count(splits, merge_launches, monkeypatch):
    """By default the last split merges up to MERGE_MAX_SPLITS splits (measured faster there),
    a launch of its own merges more; both agree with the reference."""
    from freetoken.kernels.triton import attention as tri

    assert tri.MERGE_MAX_SPLITS == 2
    q, cache, table, lens, ref = _decode_ref(MERGE_LENS, 4, 2, 32, None, None)
    launched = []
    monkeypatch.setattr(tri, "_merge_kernel", _Spy(tri._merge_kernel, launched))
    monkeypatch.delenv("FREETOKEN_GPU_ATTN_MERGE_SPLITS", raising=False)
    out, _ = tri.decode(q, cache, table, lens, scale=32 ** -0.5, window=None, softcap=None,
                        splits=splits)
    close_fp32(out.cpu(), ref)
    assert len(launched) == merge_launches
    # FREETOKEN_GPU_ATTN_MERGE_SPLITS moves the bound: 4 splits merged in the kernel, and 1
    # gives even 2 splits the merge launch
    for bound, want in (("4", 0), ("1", 1)):
        monkeypatch.setenv("FREETOKEN_GPU_ATTN_MERGE_SPLITS", bound)
        launched.clear()
        again, _ = tri.decode(q, cache, table, lens, scale=32 ** -0.5, window=None,
                              softcap=None, splits=splits)
        close_fp32(again.cpu(), ref)
        assert len(launched) == want, bound


def test_num_splits_few_variants():
    """Split counts are powers of two up to 16 (few compiled variants), 1 for full batches;
    each split has at least one key block (64 keys here) of the table's capacity, so one
    sequence splits from a table of two blocks on."""
    from freetoken.kernels.triton.attention import num_splits

    cases = {(b, h, c): num_splits(b, h, c, 64) for b in (1, 2, 3, 16, 64) for h in (1, 4, 8)
             for c in range(16, 50000, 997)}
    assert set(cases.values()) <= {1, 2, 4, 8, 16} and num_splits(64, 4, 40960, 64) == 1
    assert all(s == 1 or s * 64 <= c for (_, _, c), s in cases.items())
    assert num_splits(1, 4, 256, 64) == 4 and num_splits(1, 2, 512, 32) == 16


@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
def test_prefill_mixed_batch(window, softcap):
    """A fresh prompt, a chunk after a cached prefix, and a decode token in one batch."""
    out, ref, cache, ref_cache = run_both([0, 9, 12], [7, 5, 1], window=window,
                                          softcap=softcap)
    close_fp32(out, ref)
    assert torch.equal(cache, ref_cache)


def test_prefill_longer_than_a_block():
    out, ref, _, _ = run_both([3], [70], n_q=2, n_kv=1, d=16, page_size=8)
    close_fp32(out, ref)


def test_store_skips_negative_slots():
    from freetoken.kernels.triton import attention as tri

    cache = torch.zeros(2, 2, 4, 1, 16, device=DEV)
    k, v = torch.ones(2, 1, 16, device=DEV), torch.full((2, 1, 16), 2.0, device=DEV)
    tri.store_kv(cache, k, v, torch.tensor([5, -1], device=DEV))
    flat = cache.view(2, -1, 1, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 5], v[0])
    assert int((cache != 0).sum()) == 2 * 16  # the padded row wrote nothing


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("window,softcap", [(None, None), (100, 30.0)])
def test_cuda_bf16_larger(window, softcap):
    starts, news = [0, 500, 1000, 37], [300, 1, 1, 64]
    out, ref, _, _ = run_both(starts, news, n_q=32, n_kv=4, d=128, page_size=16,
                              window=window, softcap=softcap, dtype=torch.bfloat16,
                              device="cuda")
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=0)
    dec, dref, _, _ = run_both([2000, 5, 700], [1, 1, 1], n_q=32, n_kv=4, d=128,
                               page_size=16, window=window, softcap=softcap,
                               dtype=torch.bfloat16, device="cuda")
    torch.testing.assert_close(dec.float(), dref.float(), atol=2e-2, rtol=0)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
