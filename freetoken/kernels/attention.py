"""Paged attention, torch reference (CPU or GPU, no custom kernels).

The KV cache of one layer is `[2, num_pages, page_size, n_kv, d]` (K then V). New tokens'
K/V are written into their slots (`slot_mapping`), then each sequence gathers its pages in
order (`page_table`, `seq_lens`) and attends causally, optionally within a sliding window
and with tanh soft-capping of the scores. GQA: query head h reads KV head h // (n_q / n_kv).

CUDA tensors go to the Triton kernels (`freetoken.kernels.triton.attention`): one batched KV
store, then the decode kernel when every sequence feeds one token, else the varlen prefill
kernel; neither reads device values back to the host. This torch code is the CPU path and the
oracle of their tests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken.engine.context import ForwardContext


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, n_kv, d] at flat slots [T] (page * page_size + offset)."""
    flat = cache.view(2, -1, *cache.shape[-2:])  # [2, pages * page_size, n_kv, d]
    flat[0].index_copy_(0, slots, k.to(cache.dtype))
    flat[1].index_copy_(0, slots, v.to(cache.dtype))


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` K/V rows of one sequence: [2, length, n_kv, d]."""
    page_size = cache.shape[2]
    n_pages = -(-length // page_size)
    kv = cache[:, pages[:n_pages].long()]  # [2, n_pages, page_size, n_kv, d]
    return kv.reshape(2, n_pages * page_size, *cache.shape[-2:])[:, :length]


def _mask(q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
    """Boolean [n_q, kv_len], True where query at q_pos may see key position j."""
    j = torch.arange(kv_len, device=q_pos.device)
    ok = j[None, :] <= q_pos[:, None]
    if window is not None:  # the window holds the last `window` positions, itself included
        ok &= q_pos[:, None] - j[None, :] < window
    return ok


def _attend(q, k, v, mask, scale: float, softcap: float | None) -> torch.Tensor:
    """q [n_q, H, d], k/v [L, H, d] (already repeated for GQA) -> [n_q, H, d], in fp32."""
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [H, n_q, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float())


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    ctx: ForwardContext,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [T, n_q, d], k/v [T, n_kv, d] -> out [T, n_q, d] (q's dtype).

    Writes k/v into `cache` first, so a sequence's new tokens see each other.
    """
    n_q, n_kv = q.shape[1], k.shape[1]
    if cache.shape[-2:] != k.shape[-2:] or n_q % n_kv:
        raise ValueError(
            f"paged_attention: cache heads/dim {tuple(cache.shape[-2:])} vs k {tuple(k.shape[1:])}"
            f", {n_q} query heads"
        )
    if q.is_cuda:
        return paged_attention_triton(q, k, v, cache, ctx, scale=scale, window=window,
                                      softcap=softcap)
    write_kv(cache, k, v, ctx.slot_mapping)
    if ctx.is_decode:
        return _decode(q, cache, ctx, scale, window, softcap)
    cu, lens, _ = ctx.host_lists()
    out = torch.empty_like(q)
    for b in range(len(lens)):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo:
            continue
        kv = gather_kv(cache, ctx.page_table[b], lens[b])
        kk = kv[0].repeat_interleave(n_q // n_kv, dim=1)
        vv = kv[1].repeat_interleave(n_q // n_kv, dim=1)
        mask = _mask(ctx.positions[lo:hi], lens[b], window)
        out[lo:hi] = _attend(q[lo:hi], kk, vv, mask, scale, softcap).to(q.dtype)
    return out


def _decode(q, cache, ctx: ForwardContext, scale: float, window: int | None,
            softcap: float | None) -> torch.Tensor:
    """One query token per sequence, all sequences at once (no loop over them): each
    sequence's pages gathered to the batch's longest length, the tail masked."""
    _, lens, _ = ctx.host_lists()
    B, ps, (n_kv, d) = len(lens), cache.shape[2], cache.shape[-2:]
    n_pages = -(-max(lens) // ps)
    kv = cache[:, ctx.page_table[:, :n_pages].long()]  # [2, B, n_pages, ps, n_kv, d]
    kv = kv.reshape(2, B, n_pages * ps, n_kv, d).transpose(2, 3)  # [2, B, n_kv, L, d]
    key = ("decode_mask", window)
    mask = ctx.memo.get(key)
    if mask is None:  # [B, 1, 1, L]: positions 0 .. len - 1, within the window
        j = torch.arange(n_pages * ps)
        seq = torch.tensor(lens)[:, None]
        ok = j[None, :] < seq
        if window is not None:
            ok &= seq - 1 - j[None, :] < window
        mask = ctx.memo[key] = ok[:, None, None, :]
    qb = q.reshape(B, q.shape[1], 1, d).float()  # [B, Hq, 1, d]
    k, v = kv[0].float(), kv[1].float()
    if softcap is None:
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=q.shape[1] != n_kv)
    else:
        rep = q.shape[1] // n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.tanh(qb @ k.transpose(-1, -2) * (scale / softcap)) * softcap
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
    return o.reshape(q.shape).to(q.dtype)


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    ctx: ForwardContext,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The Triton path of `paged_attention` (also runs on CPU tensors under TRITON_INTERPRET=1).

    A negative slot in `ctx.slot_mapping` (a padded row of a captured batch) writes nothing."""
    from freetoken.kernels.triton import attention as tri  # lazy: needs triton

    if not cache.is_contiguous():
        raise ValueError("paged_attention: the KV cache must be contiguous "
                         "[2, pages, page_size, n_kv, d]")
    tri.store_kv(cache, k, v, ctx.slot_mapping)
    if ctx.is_decode:
        return tri.decode(q, cache, ctx.page_table, ctx.seq_lens, scale=scale, window=window,
                          softcap=softcap)
    max_q = ctx.max_seqlen_q or int(q.shape[0])
    return tri.prefill(q, cache, ctx.page_table, ctx.cu_seqlens_q, ctx.seq_lens, max_q,
                       scale=scale, window=window, softcap=softcap)
