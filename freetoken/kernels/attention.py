"""Paged attention, torch reference (CPU or GPU, no custom kernels).

The KV cache of one layer is `[2, num_pages, page_size, n_kv, d]` (K then V). New tokens'
K/V are written into their slots (`slot_mapping`), then each sequence gathers its pages in
order (`page_table`, `seq_lens`) and attends causally, optionally within a sliding window
and with tanh soft-capping of the scores. GQA: query head h reads KV head h // (n_q / n_kv).

CUDA tensors go to the Triton kernels (`freetoken.kernels.triton.attention`): one batched KV
store, then the decode kernel when every sequence feeds one token, else the varlen prefill
kernel; neither reads device values back to the host. This torch code is the CPU path and the
oracle of their tests. `qk_rope_attention` puts the q/k norm and rotary in front
(`kernels.qk_rope_store`); at decode on the GPU the decode kernel does that work itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from freetoken import env
from freetoken.engine.context import ForwardContext
from freetoken.kernels import rotary, xq
from freetoken.kernels.cpu_kernels import cpu_attend_single

# Decode steps of CPU tensors through the Triton kernels as well, in `qk_rope_attention`
# (Triton's interpreter, TRITON_INTERPRET=1, runs them there): the tests check the wiring of
# the fused and the two-launch paths into the layers without a GPU.
TRITON_ON_CPU = False


def write_kv(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Store k, v [T, n_kv, d] at flat slots [T] (page * page_size + offset)."""
    flat = cache.view(2, -1, *cache.shape[-2:])  # [2, pages * page_size, n_kv, d]
    flat.index_copy_(1, slots, torch.stack([k, v]).to(cache.dtype))  # one copy for K and V


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
    stored: bool = False,
    quantize: bool = False,
) -> torch.Tensor:
    """q [T, n_q, d], k/v [T, n_kv, d] -> out [T, n_q, d] (q's dtype).

    Writes k/v into `cache` first, so a sequence's new tokens see each other (`stored`: the
    caller wrote them already, `kernels.qk_rope_store`). `quantize`: the output feeds a
    linear; a decode step on the GPU also quantizes it once for its int8 GEMV (`kernels.xq`;
    `xq.view` keeps that through the reshape to [T, n_q d]).
    """
    _check_heads(q, k, cache)
    n_q, n_kv = q.shape[1], k.shape[1]
    if q.is_cuda:
        return paged_attention_triton(q, k, v, cache, ctx, scale=scale, window=window,
                                      softcap=softcap, stored=stored, quantize=quantize)
    if not stored:
        write_kv(cache, k, v, ctx.slot_mapping)
    if ctx.is_decode:
        return _decode(q, cache, ctx, scale, window, softcap)
    cu, lens, _ = ctx.host_lists()
    out = torch.empty_like(q)
    # one-token sequences (decodes beside prefill chunks) as a decode step computes them
    single = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if not (single and cpu_attend_single(q, cache, ctx, single, [cu[b] for b in single], out,
                                         scale, window, softcap)):
        single = []
    for b in range(len(lens)):
        lo, hi = cu[b], cu[b + 1]
        if hi == lo or (single and b in single):
            continue
        kv = gather_kv(cache, ctx.page_table[b], lens[b])
        kk = kv[0].repeat_interleave(n_q // n_kv, dim=1)
        vv = kv[1].repeat_interleave(n_q // n_kv, dim=1)
        mask = _mask(ctx.positions[lo:hi], lens[b], window)
        out[lo:hi] = _attend(q[lo:hi], kk, vv, mask, scale, softcap).to(q.dtype)
    return out


def _check_heads(q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor) -> None:
    if cache.shape[-2:] != k.shape[-2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"paged_attention: cache heads/dim {tuple(cache.shape[-2:])} vs k {tuple(k.shape[1:])}"
            f", {q.shape[1]} query heads"
        )


def qk_rope_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: torch.Tensor,
    ctx: ForwardContext,
    *,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    quantize: bool = False,
) -> torch.Tensor:
    """`kernels.qk_rope_store` (optional per-head RMSNorm weights, then rotary by rope = (cos,
    sin) fp32 [T, r]), then `paged_attention` of the rotated q and k: q [T, n_q, d], k / v
    [T, n_kv, d] as the qkv projection gives them (strided views are fine) -> [T, n_q, d].

    A decode step on the GPU is one launch: each decode program ropes its query heads in
    registers, and the one whose keys hold the step's position also ropes the key head and
    stores k' and v in the cache (`triton.attention.decode(rope=...)`), with the numbers of
    the two launches. FREETOKEN_GPU_ROPE_ATTN=0 runs those two launches instead; elsewhere
    (prefill, CPU, layouts the kernels do not take) the two calls as they are."""
    cos, sin = rope
    if not _rope_decode_on_triton(q, k, v, cos, sin, (q_weight, k_weight), cache, ctx):
        q, k, stored = rotary.qk_rope_store(q, k, v, cos, sin, q_weight, k_weight, eps, cache,
                                            ctx.slot_mapping)
        return paged_attention(q, k, v, cache, ctx, scale=scale, window=window,
                               softcap=softcap, stored=stored, quantize=quantize)
    from freetoken.kernels.triton import attention as tri  # lazy: needs triton
    from freetoken.kernels.triton.rotary import qk_rope_triton

    rotary._check(q, k, cos, sin, q_weight, k_weight)
    _check_heads(q, k, cache)
    if not env.gpu_rope_attn():  # the two launches, for comparison
        q, k = qk_rope_triton(q, k, cos, sin, q_weight, k_weight, eps,
                              (v, cache, ctx.slot_mapping))
        return paged_attention_triton(q, k, v, cache, ctx, scale=scale, window=window,
                                      softcap=softcap, stored=True, quantize=quantize)
    out, q8 = tri.decode(q, cache, ctx.page_table, ctx.seq_lens, scale=scale, window=window,
                         softcap=softcap, quantize=_decode_codes(q, quantize),
                         rope=(k, v, cos, sin, q_weight, k_weight, eps, ctx.slot_mapping))
    return xq.attach(out, q8)


def _rope_decode_on_triton(q, k, v, cos, sin, weights: tuple, cache: torch.Tensor,
                           ctx: ForwardContext) -> bool:
    """Whether `qk_rope_attention` runs a decode step through the Triton kernels: every
    tensor on CUDA (or, with TRITON_ON_CPU, on the CPU), the layouts `qk_rope_triton` takes
    with its KV store, d a power of two from 16 on (the decode kernel's tile)."""
    tensors = (q, k, v, cos, sin, cache, ctx.slot_mapping, *(w for w in weights if w is not None))
    devices = (all(t.is_cuda for t in tensors)
               or (TRITON_ON_CPU and not any(t.is_cuda for t in tensors)))
    d = q.shape[-1]
    return (ctx.is_decode and devices and d >= 16 and d & (d - 1) == 0
            and rotary.triton_layout(q, k, cos, sin, weights)
            and rotary.store_layout(k, v, cache))


def _decode_codes(q: torch.Tensor, quantize: bool) -> bool:
    """Whether decode attention also quantizes its output for the output projection's int8
    GEMV (`quantize`: a linear takes it).

    From 2 sequences on: measured on the H200 (30B shape, Q4_K), the epilogue cost the
    1-sequence kernel 1.7 us (6.8 -> 8.5) for 0.8 us saved in o_proj, while at 4 tokens
    o_proj's int8 GEMV takes 7.6 us with them against 15.9 without."""
    return quantize and q.shape[0] >= 2 and xq.wanted(q.flatten(1))


def _decode_plan(ctx: ForwardContext, page_size: int, window: int | None):
    """(flat KV slots [B * n], n, additive mask [B, 1, 1, n] or None) of a decode step: each
    sequence's last min(len, window) positions, padded to the longest (pads read slot 0 and
    are masked). Made once per step and window, shared by the layers (ctx.memo)."""
    key = ("cpu_decode", window)
    plan = ctx.memo.get(key)
    if plan is None:
        _, lens, _ = ctx.host_lists()
        seq = torch.tensor(lens)[:, None]
        first = (seq - window).clamp(min=0) if window is not None else torch.zeros_like(seq)
        n = int((seq - first).max())
        pos = first + torch.arange(n)[None, :]  # [B, n]
        valid = pos < seq
        pos = torch.where(valid, pos, 0)
        slots = ctx.page_table.long().gather(1, pos // page_size) * page_size + pos % page_size
        mask = None
        if not bool(valid.all()):
            mask = torch.zeros(valid.shape).masked_fill(~valid, float("-inf"))[:, None, None, :]
        plan = ctx.memo[key] = (slots.reshape(-1), n, mask)
    return plan


def _decode(q, cache, ctx: ForwardContext, scale: float, window: int | None,
            softcap: float | None) -> torch.Tensor:
    """One query token per sequence, all sequences at once (no loop over them): each
    sequence's KV rows gathered to the batch's longest span (_decode_plan)."""
    B, n_q, d = q.shape
    n_kv = cache.shape[-2]
    slots, n, mask = _decode_plan(ctx, cache.shape[2], window)
    kv = cache.view(2, -1, n_kv, d).index_select(1, slots)  # [2, B * n, n_kv, d]
    kv = kv.view(2, B, n, n_kv, d).transpose(2, 3)  # [2, B, n_kv, n, d]
    k, v = (kv if kv.dtype == torch.float32 else kv.float()).unbind(0)
    qb = q.reshape(B, n_q, 1, d)
    qb = qb if qb.dtype == torch.float32 else qb.float()
    if softcap is None:
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=n_q != n_kv)
    else:
        rep = n_q // n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.tanh(qb @ k.transpose(-1, -2) * (scale / softcap)) * softcap
        o = torch.softmax(s if mask is None else s + mask, dim=-1) @ v
    o = o.reshape(q.shape)
    return o if o.dtype == q.dtype else o.to(q.dtype)


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
    stored: bool = False,
    quantize: bool = False,
) -> torch.Tensor:
    """The Triton path of `paged_attention` (also runs on CPU tensors under TRITON_INTERPRET=1).

    A negative slot in `ctx.slot_mapping` (a padded row of a captured batch) writes nothing."""
    from freetoken.kernels.triton import attention as tri  # lazy: needs triton

    if not cache.is_contiguous():
        raise ValueError("paged_attention: the KV cache must be contiguous "
                         "[2, pages, page_size, n_kv, d]")
    if not stored:
        tri.store_kv(cache, k, v, ctx.slot_mapping)
    if ctx.is_decode:
        out, q8 = tri.decode(q, cache, ctx.page_table, ctx.seq_lens, scale=scale,
                             window=window, softcap=softcap,
                             quantize=_decode_codes(q, quantize))
        return xq.attach(out, q8)
    max_q = ctx.max_seqlen_q or int(q.shape[0])
    return tri.prefill(q, cache, ctx.page_table, ctx.cu_seqlens_q, ctx.seq_lens, max_q,
                       scale=scale, window=window, softcap=softcap)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor, quantize: bool = False) -> torch.Tensor:
    """o * sigmoid(gate) (qwen3.5's gated attention output): o, gate [T, H, d] -> [T, H d] in
    o's dtype, the gate rounded to it before the product. `quantize`: the result feeds a
    linear; on the GPU one launch computes it and, where an int8 GEMV will read it
    (`kernels.xq`), its codes too."""
    if o.shape != gate.shape or o.dim() != 3:
        raise ValueError(f"sigmoid_gate: o and gate must be [T, H, d] alike, got "
                         f"{list(o.shape)} and {list(gate.shape)}")
    t, h, d = o.shape
    if (o.is_cuda and gate.is_cuda and o.stride(-1) == 1 and gate.stride(-1) == 1
            and d & (d - 1) == 0 and o.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        from freetoken.kernels.triton.glu import sigmoid_gate_triton  # lazy: needs triton

        want = quantize and d % 32 == 0 and xq.wanted(o.reshape(t, h * d))
        y, q = sigmoid_gate_triton(o, gate, want)
        return xq.attach(y, q)
    return (o * torch.sigmoid(gate.float()).to(o.dtype)).reshape(t, h * d)
