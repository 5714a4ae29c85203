"""The CPU paths of the kernel entry points: the C++ executor's kernels, in place.

A dense `[N, K]` weight is an expert bank with one expert, so the CPU MoE executor
(`freetoken.moe.cpu_executor`, csrc/cpu_moe) computes it with the same SIMD tiers, thread pool
and ISA switches as the experts (one copy of every kernel):

- by default its int8 dots, at every token count: they read the quantized bytes once per call
  (activations quantized per block of 32, as llama.cpp does), `y = x @ W^T` straight into the
  output. Each row's result depends on its token alone (not on the batch, the thread count or
  the split of rows), so a request's tokens are the same alone or batched with others;
- under FREETOKEN_CPU_FLOAT=1, float math at every size: rows decoded to fp32 tiles by the
  executor (bit-identical to the codecs) and multiplied by torch's GEMM (transformers' numbers;
  at 512 tokens it is also the faster of the two: 128 against 74 GFLOP/s, but choosing it by
  token count made a token's numbers depend on its batch).

`cpu_fused_moe` hands a whole MoE layer to the executor (its int8 dots, the
GLU and the weighted sum, one pool run per layer). `cpu_embedding` decodes gathered rows;
`cpu_rms_norm`, `cpu_glu` and `cpu_decode_attention` (q/k norm, rotary, KV store, paged
attention) are one call each where torch takes a dozen dispatches at one token.

Weights the executor does not read (a format without a kernel there, or no C++ extension in
this install) return None from `cpu_linear`, and the caller takes the torch reference path.
The executor is one per process, with torch's thread count at its creation (the CPU runner
creates it at start-up, after `torch.set_num_threads`).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from freetoken import env
from freetoken.formats.qweight import QuantWeight

# Rows decoded per tile for the GEMM path: about 4 MiB of fp32, so a tile is still in L2/L3
# when the GEMM reads it.
TILE_ELEMS = 1 << 20



def int8_dots() -> bool:
    """Whether CPU linears and MoE layers take the executor's int8 dots (not under
    FREETOKEN_CPU_FLOAT=1)."""
    return not env.cpu_float()


_lock = threading.Lock()
_executor = None
_banks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_UNSUPPORTED = object()


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to n inside (restored after). A CPU decode step runs its
    weights on the executor's pool and only small torch ops between them: with torch's own
    threads awake too, the two runtimes' idle spinning took each other's cores (SmolLM2 decode,
    2 cores: 2 tokens/s with two torch threads, 51 with one). The same holds for the expert-
    cache backends' executor on a GPU host (H200 host, Qwen3-30B-A3B Q4_K, cache rate 0.1,
    batch 4: cpu 19.5 -> 32.3 tokens/s, hybrid 20.5 -> 29.7 with one torch thread)."""
    before = torch.get_num_threads()
    if before == n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _extension() -> bool:
    """Whether the executor can run here (its extension is built); checked until it exists."""
    if _executor is not None:
        return True
    from freetoken.moe.cpu_executor import extension_available

    return extension_available()


def executor():
    """The process's executor for dense layers (created on first use)."""
    global _executor
    with _lock:
        if _executor is None:
            from freetoken.moe.cpu_executor import CpuMoeExecutor

            _executor = CpuMoeExecutor(max(1, torch.get_num_threads()))
        return _executor


def _bank(qw: QuantWeight):
    """The executor's description of `qw` as a one-expert bank (cached per weight), or
    _UNSUPPORTED when the executor has no kernel for its format."""
    bank = _banks.get(qw, None)
    if bank is None:
        from freetoken.moe.cpu_executor import extension_available, make_bank
        from freetoken.moe.host_banks import executor_reads

        if (qw.fmt == "fp8_block" or not executor_reads(qw) or qw.data.device.type != "cpu"
                or not extension_available()):
            bank = _UNSUPPORTED
        else:
            one = QuantWeight(qw.data.unsqueeze(0), qw.fmt, (1, *qw.shape),
                              scales=None if qw.scales is None else qw.scales.unsqueeze(0),
                              ggml_type=qw.ggml_type, source=qw.source)
            # the view keeps the storage alive as long as the weight is
            bank = (make_bank(one, qw.source or "weight"), one)
        _banks[qw] = bank
    return bank


_tile = torch.empty(0)


def _scratch(n: int) -> torch.Tensor:
    """A reused fp32 buffer of at least n values for the prefill path's tiles (a fresh 4 MiB
    tensor per tile would be fresh pages, faulted in on every call)."""
    global _tile
    if _tile.numel() < n:
        _tile = torch.empty(n, dtype=torch.float32)
    return _tile


def cpu_linear(x: torch.Tensor, qw: QuantWeight, gemm: bool = False) -> torch.Tensor | None:
    """x [..., K] @ W^T (fp32, before scale2) for a quantized CPU weight, or None when the
    executor has no kernel for its format. `gemm`: float math (decoded tiles, torch's GEMM)
    at any token count. (Kept lean: a decode step calls it ~100 times.)"""
    bank = _banks.get(qw) or _bank(qw)
    if bank is _UNSUPPORTED:
        return None
    K, N = qw.in_features, qw.out_features
    xf = x if x.dim() == 2 else x.reshape(-1, K)
    if xf.dtype != torch.float32 or not xf.is_contiguous():
        xf = xf.float().contiguous()
    T = xf.shape[0]
    ex = _executor or executor()
    out = torch.empty(T, N, dtype=torch.float32)
    if not gemm and int8_dots():
        ex._ex.dot(bank[0], 0, xf.data_ptr(), T, out.data_ptr(), ex.num_threads)
    else:
        step = max(64, TILE_ELEMS // K // 64 * 64)
        tile = _scratch(min(N, step) * K)
        for s in range(0, N, step):
            e = min(N, s + step)
            w = ex.dequant_rows(bank[1], 0, s, e, out=tile[:(e - s) * K].view(e - s, K))
            out[:, s:e] = xf @ w.T
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], N)


_ACT = {"silu": 0, "gelu_tanh": 1}


def cpu_glu(gu: torch.Tensor, inter: int, act: str) -> torch.Tensor | None:
    """act(gate) * up of fp32 [T, 2 * inter] gate_up rows, in place by the executor's GLU (one
    call a row where torch takes three ops; every token count alike, so a token's numbers do
    not depend on its batch), or None when it cannot (another dtype or activation, no
    extension)."""
    if gu.dtype != torch.float32 or gu.is_cuda or act not in _ACT or not gu.is_contiguous():
        return None
    if not _extension():
        return None
    glu, a, row = (_executor or executor())._ex.glu, _ACT[act], 8 * inter
    p = gu.data_ptr()
    for t in range(gu.shape[0]):
        glu(p + t * row, p + t * row + 4 * inter, inter, 1.0, 1.0, a)
    return gu[:, :inter]


def cpu_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(rms_norm(x [+ residual]), x + residual or None) of fp32 CPU rows in one executor call,
    or None where it does not apply (the caller takes torch)."""
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.is_cuda
            or not x.is_contiguous() or (residual is not None and not residual.is_contiguous())):
        return None
    if not _extension():
        return None
    n = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.float32)
    s = None if residual is None else torch.empty(x.shape, dtype=torch.float32)
    (_executor or executor())._ex.rms_norm(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
        x.numel() // n, n, eps, y.data_ptr(), 0 if s is None else s.data_ptr())
    return y, s


def cpu_decode_attention(qkv: torch.Tensor, spec, cache: torch.Tensor, ctx,
                         rope: tuple[torch.Tensor, torch.Tensor],
                         q_norm: torch.Tensor | None, k_norm: torch.Tensor | None
                         ) -> torch.Tensor | None:
    """A decode step's attention block for fp32 CPU tensors in one executor call: q/k per-head
    RMSNorm, rotary, the KV store and attention over the paged cache (freetoken.layers.
    attention's math). qkv [B, (Hq + 2 Hkv) d] is overwritten; returns [B, Hq d], or None
    where this path does not apply (prefill, another dtype, no extension)."""
    cos, sin = rope
    tensors = (qkv, cache, cos, sin, ctx.page_table, ctx.seq_lens, ctx.slot_mapping)
    if (qkv.is_cuda or not ctx.is_decode or qkv.dtype != torch.float32
            or cache.dtype != torch.float32 or cos.dtype != torch.float32
            or ctx.page_table.dtype != torch.int32 or ctx.seq_lens.dtype != torch.int32
            or ctx.slot_mapping.dtype != torch.int64
            or not all(t.is_contiguous() for t in tensors)):
        return None
    if not _extension():
        return None
    B, hq, hkv, d = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
    out = torch.empty(B, hq * d, dtype=torch.float32)
    (_executor or executor())._ex.decode_attention(
        B, hq, hkv, d, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        0 if q_norm is None else q_norm.data_ptr(), 0 if k_norm is None else k_norm.data_ptr(),
        spec.norm_eps, cache.data_ptr(), cache.shape[1] * cache.shape[2], cache.shape[2],
        ctx.slot_mapping.data_ptr(), ctx.page_table.data_ptr(), ctx.page_table.shape[1],
        ctx.seq_lens.data_ptr(), spec.scale, spec.softcap or 0.0, spec.window or 0,
        out.data_ptr())
    return out


def cpu_attend_single(q: torch.Tensor, cache: torch.Tensor, ctx, seqs: list[int],
                      rows: list[int], out: torch.Tensor, scale: float, window: int | None,
                      softcap: float | None) -> bool:
    """Attention of the one-token sequences `seqs` (their query rows `rows` of q [T, Hq, d],
    already normed and rotated, their keys already stored) by the executor's decode attention,
    written into out's rows; False (nothing written) where it does not apply. A step that mixes
    them with prefill chunks thus computes a generated token as a decode step does."""
    if (q.dtype != torch.float32 or cache.dtype != torch.float32 or q.is_cuda
            or not cache.is_contiguous() or ctx.page_table.dtype != torch.int32):
        return False
    if not _extension():
        return False
    idx = torch.tensor(rows)
    qs = q.index_select(0, idx).contiguous()  # [S, Hq, d]
    S, hq, d = qs.shape
    pt = ctx.page_table.index_select(0, torch.tensor(seqs)).contiguous()
    lens = ctx.seq_lens.index_select(0, torch.tensor(seqs)).contiguous()
    o = torch.empty(S, hq * d, dtype=torch.float32)
    (_executor or executor())._ex.decode_attention(
        S, hq, cache.shape[-2], d, qs.data_ptr(), 0, 0, 0, 0, 0.0, cache.data_ptr(),
        cache.shape[1] * cache.shape[2], cache.shape[2], 0, pt.data_ptr(), pt.shape[1],
        lens.data_ptr(), scale, softcap or 0.0, window or 0, o.data_ptr(),
        attend_only_row=hq * d)
    out.index_copy_(0, idx, o.view(S, hq, d))
    return True


def cpu_embedding(flat: torch.Tensor, qw: QuantWeight) -> torch.Tensor | None:
    """Rows `flat` of a quantized CPU table as fp32 [n, K] (before scale2), decoded by the
    executor (bit for bit the codecs), or None when it has no kernel for the format."""
    if _bank(qw) is _UNSUPPORTED:
        return None
    scales = None if qw.scales is None else qw.scales.index_select(0, flat).unsqueeze(0)
    rows = QuantWeight(qw.data.index_select(0, flat).unsqueeze(0), qw.fmt,
                       (1, flat.numel(), qw.in_features), scales=scales,
                       ggml_type=qw.ggml_type, source=qw.source)
    return executor().dequant_rows(rows, 0, 0, flat.numel())


def cpu_fused_moe(x: torch.Tensor, bank, ids: torch.Tensor, weights: torch.Tensor,
                  activation: str) -> torch.Tensor | None:
    """`fused_moe` of CPU tensors by the executor, or None when it has no kernel for the
    bank's formats or the bank is not in its layout (contiguous [E, N, K] parts)."""
    from freetoken.moe.cpu_executor import extension_available
    from freetoken.moe.host_banks import executor_reads

    parts = (bank.w13, bank.w2)
    if not (all(executor_reads(w) and w.data.is_contiguous() for w in parts)
            and extension_available()):
        return None
    y = executor().forward(x.float().contiguous(), ids, weights.float().contiguous(),
                           bank.w13, bank.w2, bank.scales, activation)
    return y.to(x.dtype)
