"""Gated delta-net (GDN) linear attention, qwen3.5's recurrent layer, in torch.

Per token t and value head h (key head h // (nv / nk), or h % nk where the GGUF converter
stored V heads tiled), with q, k L2-normalised and q scaled by dk^-0.5:

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S'_{t-1} k_t))^T    S: [dk, dv]
    o_t = S_t^T q_t                                                   S' = exp(g_t) S_{t-1}

with g = -exp(A_log) * softplus(a + dt_bias) (A_log arrives as -exp(A_log) from GGUFs) and
beta = sigmoid(b). q, k, v come out of a depthwise causal conv1d (kernel K, SiLU) over the
concatenated in_proj_qkv channels; the output is RMSNorm(o) * w * silu(z), then out_proj.

State per request (one slot of a pool, `ctx.state_slots[i]`, `ctx.recurrent_states[j]` for
the j-th GDN layer): the conv input's last K-1 columns `[C, K-1]` and S `[nv, dk, dv]`, both
fp32. A sequence whose first new token is at position 0 starts from zeros, so a slot needs no
clearing between requests, and recompute after preemption starts over by itself.
Prefill runs the chunked form (UT transform per 64-token chunk); decode tokens (one new token
per sequence) run one batched recurrent step. On CUDA the `flash-linear-attention` package's
chunk kernel is used where it is installed (imported lazily, never required); decode steps on
CUDA run one Triton kernel (kernels/triton/gdn.py; three with FREETOKEN_GPU_GDN_FUSED=0), in
place on the state pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetoken.engine.context import ForwardContext
from freetoken.layers.linear import Linear
from freetoken.layers.moe import Vector
from freetoken.layers.norm import RMSNorm

CHUNK = 64
# Decode steps of CPU tensors through the Triton kernels as well (Triton's interpreter,
# TRITON_INTERPRET=1, runs them there): the tests check the kernels' wiring without a GPU.
TRITON_ON_CPU = False


@dataclass(frozen=True)
class GDNSpec:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    norm_eps: float = 1e-6
    v_tiled: bool = False  # V heads in llama.cpp's tiled order (head h reads key head h % nk)

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per slot: conv state [C, K-1] and recurrent state [nv, dk, dv]."""
        return ((self.conv_dim, self.conv_kernel - 1),
                (self.num_v_heads, self.head_k_dim, self.head_v_dim))


def alloc_states(shapes, num_slots: int, device="cpu") -> list[tuple[torch.Tensor, ...]]:
    """Zeroed fp32 state pools [num_slots, ...] for each GDN layer's (conv, ssm) shapes."""
    return [tuple(torch.zeros(num_slots, *s, dtype=torch.float32, device=device) for s in pair)
            for pair in shapes]


class _ConvWeight(Vector):
    """Depthwise conv kernel [C, K]: HF `conv1d.weight` [C, 1, K], GGUF `ssm_conv1d.weight`."""

    def __init__(self, channels: int, kernel: int):
        super().__init__(channels * kernel)
        self.value = self.value.reshape(channels, kernel)

    def gguf_name(self, src, hf_name: str) -> str | None:
        key = src.key(hf_name.removesuffix(".weight"))
        return f"{key}.weight" if key else None


class _NegA(Vector):
    """Holds -exp(A_log) [nv]: HF stores A_log, llama.cpp's converter -exp(A_log) (`ssm_a`)."""

    from_gguf = False

    def gguf_name(self, src, hf_name: str) -> str | None:
        self.from_gguf = True  # NOTE: only GGUF loads ask for this name
        return src.key(hf_name)

    def load(self, t: torch.Tensor, name: str = "") -> None:
        super().load(t.float() if self.from_gguf else -torch.exp(t.float()), name)


class _DtBias(Vector):
    """dt_bias [nv]; GGUF `ssm_dt.bias`."""

    def gguf_name(self, src, hf_name: str) -> str | None:
        key = src.key(hf_name.removesuffix("dt_bias") + "dt_proj")
        return f"{key}.bias" if key else None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (HF's and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrent_step(q, k, v, g, beta, state) -> torch.Tensor:
    """One token for B sequences: q, k [B, H, dk], v [B, H, dv], g, beta [B, H], state
    [B, H, dk, dv] updated in place. Returns o [B, H, dv]."""
    state.mul_(g.exp()[..., None, None])
    kv = (state * k[..., None]).sum(-2)  # [B, H, dv]
    delta = (v - kv) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    return (state * q[..., None]).sum(-2)


def chunk_gated_delta(q, k, v, g, beta, state) -> torch.Tensor:
    """One sequence: q, k [H, L, dk], v [H, L, dv], g, beta [H, L], state [H, dk, dv]
    (updated in place). Chunks of CHUNK tokens: within a chunk the delta-rule updates are
    condensed by the UT transform (T = I + strict_lower((beta k) k^T * decay), solved by
    triangular solve), across chunks the state carries. Returns o [H, L, dv].

    What does not depend on the carried state (decays, the two triangular solves, the
    in-chunk attention) is computed for GROUP chunks at once; only the state's recurrence
    (three small products per chunk) runs chunk by chunk. The last chunk is padded with
    k = v = 0, beta = 0, g = 0: such a token changes no state and decays nothing."""
    H, L, dk = q.shape
    dv = v.shape[-1]
    out = torch.empty(H, L, dv, dtype=v.dtype, device=v.device)
    span = CHUNK * GROUP.get(q.device.type, 1)
    for s0 in range(0, L, span):
        e0 = min(s0 + span, L)
        out[:, s0:e0] = _chunks(q[:, s0:e0], k[:, s0:e0], v[:, s0:e0], g[:, s0:e0],
                                beta[:, s0:e0], state)
    return out


# Chunks whose state-free parts are computed together, by device (memory ~ GROUP CHUNK^2 H).
# On the CPU one at a time: a chunk's [H, C, C] intermediates stay in cache, and batching
# measured 1.5x slower (H 32, 2048 tokens, dk = dv = 128); on a GPU, batching saves launches.
GROUP = {"cpu": 1, "cuda": 32}


def _chunks(q, k, v, g, beta, state) -> torch.Tensor:
    H, L, _ = q.shape
    n = -(-L // CHUNK)
    pad = n * CHUNK - L
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    q, k, v = (t.reshape(H, n, CHUNK, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(H, n, CHUNK), beta.reshape(H, n, CHUNK)
    cum = g.cumsum(-1)  # [H, n, C]: log decay from each chunk's start
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb, vb = k * beta[..., None], v * beta[..., None]
    ut = (kb @ k.transpose(-1, -2)) * decay  # [H, n, C, C]; diagonal ignored (unitriangular)
    u = torch.linalg.solve_triangular(ut, vb, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(ut, kb * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    qd = q * cum.exp()[..., None]
    last = cum[..., -1:]  # [H, n, 1]
    kd = (k * (last - cum).exp()[..., None]).transpose(-1, -2)  # [H, n, dk, C]
    keep = last.exp()[..., None]  # [H, n, 1, 1]: the state's decay over a whole chunk
    o = torch.empty_like(v)
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ state  # what the carried state does not already predict
        o[:, i] = qd[:, i] @ state + attn[:, i] @ v_new
        state.mul_(keep[:, i])
        state.add_(kd[:, i] @ v_new)
    return o.reshape(H, n * CHUNK, -1)[:, :L]


def _triton_ok(spec: GDNSpec) -> bool:
    """The decode step's kernels (kernels/triton/gdn.py) take these head sizes."""
    from freetoken.kernels.triton.gdn import supported

    return supported(spec)


def _fla_chunk():
    """flash-linear-attention's chunk kernel, or None (not installed / no CUDA)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


class GatedDeltaNet(nn.Module):
    """qwen3.5 `linear_attn`: HF module names in_proj_{qkv,z,b,a} (fused here into one
    Linear), conv1d, A_log, dt_bias, norm, out_proj. `state_id`: index of this layer's state
    in ctx.recurrent_states."""

    def __init__(self, spec: GDNSpec, state_id: int):
        super().__init__()
        self.spec, self.state_id = spec, state_id
        s = spec
        self.sizes = [s.conv_dim, s.value_dim, s.num_v_heads, s.num_v_heads]
        self.in_proj = Linear(s.hidden_size, dict(zip(
            ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), self.sizes)))
        self.conv1d = nn.Module()
        self.conv1d.weight = _ConvWeight(s.conv_dim, s.conv_kernel)
        self.A_log = _NegA(s.num_v_heads)
        self.dt_bias = _DtBias(s.num_v_heads)
        self.norm = RMSNorm(s.head_v_dim, s.norm_eps)
        self.out_proj = Linear(s.value_dim, s.hidden_size)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (all sequences flattened) -> [T, hidden]."""
        s = self.spec
        proj = self.in_proj(x)
        conv, ssm = ctx.recurrent_states[self.state_id]
        if ctx.is_decode and (proj.is_cuda or TRITON_ON_CPU) and _triton_ok(self.spec):
            from freetoken.kernels.triton.gdn import gdn_decode  # lazy: needs triton

            return self.out_proj(gdn_decode(
                proj, s, self.conv1d.weight.value, self.A_log.value, self.dt_bias.value,
                self.norm.weight, conv, ssm, ctx.state_slots, ctx.positions))
        mixed, z, b, a = proj.split(self.sizes, dim=-1)
        beta = torch.sigmoid(b.float())  # [T, nv]
        g = self.A_log.value * F.softplus(a.float() + self.dt_bias.value)  # [T, nv], <= 0
        if ctx.is_decode:  # one token per sequence: batched, no host sync (CUDA-graph safe)
            o = self._decode(mixed, g, beta, conv, ssm, ctx.state_slots, ctx.positions)
        else:
            o = self._mixed(mixed, g, beta, conv, ssm, ctx)
        y = self.norm(o.to(x.dtype)).float() * F.silu(z.float()).reshape(o.shape)
        return self.out_proj(y.reshape(x.shape[0], s.value_dim).to(x.dtype))

    def _mixed(self, mixed, g, beta, conv, ssm, ctx: ForwardContext) -> torch.Tensor:
        """Prefill chunks one sequence at a time, decode tokens batched; the loop runs over
        the context's host lists (no device read)."""
        s = self.spec
        cu, lens, slots = ctx.host_lists()
        starts = [n - (cu[i + 1] - cu[i]) for i, n in enumerate(lens)]
        o = torch.empty(mixed.shape[0], s.num_v_heads, s.head_v_dim, dtype=torch.float32,
                        device=mixed.device)
        decode = [i for i in range(len(slots)) if cu[i + 1] - cu[i] == 1 and starts[i] > 0]
        for i in sorted(set(range(len(slots))) - set(decode)):
            r = slice(cu[i], cu[i + 1])
            o[r] = self._prefill(mixed[r], g[r], beta[r], conv, ssm, slots[i], starts[i])
        if decode:
            rows = torch.tensor([cu[i] for i in decode], device=mixed.device)
            idx = torch.tensor([slots[i] for i in decode], device=mixed.device)
            o[rows] = self._decode(mixed[rows], g[rows], beta[rows], conv, ssm, idx)
        return o

    def _qkv(self, c: torch.Tensor):
        """Conv output [n, C] -> q, k [n, nv, dk] (normalised, q scaled), v [n, nv, dv]."""
        s = self.spec
        q, k, v = c.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2norm(q.reshape(-1, s.num_k_heads, s.head_k_dim)) * s.head_k_dim**-0.5
        k = l2norm(k.reshape(-1, s.num_k_heads, s.head_k_dim))
        r = s.num_v_heads // s.num_k_heads
        if r > 1:  # key head of each value head: grouped (HF) or tiled (GGUF) order
            q, k = ((t.repeat(1, r, 1) if s.v_tiled else t.repeat_interleave(r, dim=1))
                    for t in (q, k))
        return q, k, v.reshape(-1, s.num_v_heads, s.head_v_dim)

    def _prefill(self, x, g, beta, conv, ssm, slot: int, start: int) -> torch.Tensor:
        """One sequence's n new tokens: x [n, C] -> o [n, nv, dv]; its slot's state advances."""
        if start == 0:  # a new sequence (or a recompute): start from zeros
            conv[slot].zero_()
            ssm[slot].zero_()
        w = self.conv1d.weight.value  # [C, K]
        xin = torch.cat([conv[slot], x.float().t()], dim=1)  # [C, K-1+n]
        c = F.silu(F.conv1d(xin[None], w[:, None, :], groups=w.shape[0])[0].t())  # [n, C]
        conv[slot].copy_(xin[:, xin.shape[1] - conv.shape[-1]:])
        q, k, v = self._qkv(c)
        fla = _fla_chunk() if x.is_cuda else None
        if fla is not None:
            o, st = fla(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                        initial_state=ssm[slot][None], output_final_state=True)
            ssm[slot].copy_(st[0])
            return o[0].float()
        state = ssm[slot]
        o = chunk_gated_delta(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), state)
        return o.transpose(0, 1)

    def _decode(self, x, g, beta, conv, ssm, slots: torch.Tensor,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each of B sequences: x [B, C] -> o [B, nv, dv]. With `positions`
        [B], a sequence at position 0 starts from zero state (a one-token prompt), decided on
        the device."""
        prev, state = conv[slots], ssm[slots]  # [B, C, K-1], [B, nv, dk, dv] (copies)
        if positions is not None:
            keep = (positions > 0).to(state.dtype)  # [B]
            prev, state = prev * keep[:, None, None], state * keep[:, None, None, None]
        win = torch.cat([prev, x.float()[..., None]], dim=-1)  # [B, C, K]
        conv[slots] = win[..., 1:]
        c = F.silu((win * self.conv1d.weight.value).sum(-1))  # [B, C]
        q, k, v = self._qkv(c)
        o = recurrent_step(q, k, v, g, beta, state)
        ssm[slots] = state
        return o
