"""qwen3.5 / qwen3.5-moe: FreeToken float32 logits vs HF transformers on small random models,
and the gated delta-net recurrence vs a float64 reference.

Sources: transformers' in-memory state dict, the saved HF directory, and the GGUFs llama.cpp's
converter makes of it (f32, bf16, q8_0). What the converter writes for the GDN tensors, and
what the loader undoes: `ssm_a` = -exp(A_log) (no `.weight`), `ssm_dt.bias` = dt_bias,
`ssm_conv1d.weight` squeezed to [C, K], every RMSNorm but the GDN's gated `ssm_norm` stored as
1 + w, in_proj_qkv / z / b / a as attn_qkv / attn_gate / ssm_beta / ssm_alpha, V heads in tiled
order (2 key heads, 4 value heads here), and only `full_attention_interval` for the layer
pattern. Each GGUF is compared with transformers holding that file's weights as gguf-py's
numpy `gguf.quants` dequantizes them, the converter's transforms undone by hand
(tiny_qwen3_5.gguf_reference; test_gguf_reference_is_the_original checks that inversion).

Tolerance: max |diff| <= 1e-4 * max |logit|, as for the other models: both sides run float32
math in different orders (seen: 2e-6 to 5e-6); a wrong convention (A sign, norm offset, head
order, conv layout, gate placement, lost state) moves logits by O(1) relative.
"""

from __future__ import annotations

import sys

import pytest
import tiny_qwen3_5 as tq
import torch

from freetoken.layers.gdn import chunk_gated_delta, recurrent_step
from freetoken.models import load_model
from freetoken.models.config import from_hf
from freetoken.models.loader import load_weights
from freetoken.models.registry import build_model
from freetoken.models.sources import StateDictSource
from freetoken.models.testing import prefill_logits

TOL = 1e-4


def _naive64(q, k, v, g, beta, state):
    """The gated delta rule token by token in float64 (the definition, no chunking)."""
    q, k, v, g, beta, s = (t.double() for t in (q, k, v, g, beta, state))
    out = []
    for t in range(q.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        delta = (v[:, t] - (s * k[:, t, :, None]).sum(1)) * beta[:, t, None]
        s = s + k[:, t, :, None] * delta[:, None, :]
        out.append((s * q[:, t, :, None]).sum(1))
    return torch.stack(out, 1), s


@pytest.mark.parametrize("group", [1, 2, 32])
def test_gdn_chunked_and_step_match_float64(group, monkeypatch):
    """150 tokens (two full chunks and a partial one) from a non-zero state: the chunked
    prefill and the one-step decode both agree with float64 to 1e-5 of the output scale;
    group 2: the chunks' state-free parts in two batches (the state carried across); 32:
    all at once (the GPU's setting)."""
    from freetoken.layers import gdn

    monkeypatch.setitem(gdn.GROUP, "cpu", group)
    g_ = torch.Generator().manual_seed(0)
    H, L, dk, dv = 3, 150, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(H, L, dk, generator=g_), dim=-1)
            for _ in range(2))
    v = torch.randn(H, L, dv, generator=g_)
    g = -0.2 * torch.rand(H, L, generator=g_)
    beta = torch.rand(H, L, generator=g_)
    s0 = torch.randn(H, dk, dv, generator=g_)
    ref, ref_s = _naive64(q, k, v, g, beta, s0)
    st = s0.clone()
    o = chunk_gated_delta(q, k, v, g, beta, st)
    scale = float(ref.abs().max())
    assert float((o - ref).abs().max()) <= 1e-5 * scale
    assert float((st - ref_s).abs().max()) <= 1e-5 * float(ref_s.abs().max())
    st = s0.clone()[None]
    steps = [recurrent_step(q[None, :, t], k[None, :, t], v[None, :, t], g[None, :, t],
                            beta[None, :, t], st)[0] for t in range(L)]
    assert float((torch.stack(steps, 1) - ref).abs().max()) <= 1e-5 * scale


@pytest.mark.parametrize("arch", tq.ARCHS)
def test_state_dict_and_hf_dir(arch):
    hf = tq.make_hf_model(arch)
    seqs = tq.prompts()
    ref = tq.hf_logits(hf, seqs)
    model = build_model(from_hf(hf.config.to_dict()))
    load_weights(model, StateDictSource(hf.state_dict()), show_progress=False)
    err = tq.rel_err(prefill_logits(model, seqs), ref)
    model, src = load_model(tq.hf_dir(arch), show_progress=False)
    assert src.kind == "hf" and model.config.arch == arch
    assert model.config.layer_types == ("linear", "full") * 2
    err_dir = tq.rel_err(prefill_logits(model, seqs), ref)
    print(f"{arch} state dict {err:.2e}, hf dir {err_dir:.2e}")
    assert err <= TOL and err_dir <= TOL


def test_gguf_reference_is_the_original():
    """The hand inversion of the converter's transforms gives back the original weights: the
    f32 GGUF's reference has the original model's logits (bit for bit up to rounding)."""
    seqs = tq.prompts(1)
    for arch in tq.ARCHS:
        ref = tq.gguf_reference(arch, tq.gguf_path(arch, "f32"))
        err = tq.rel_err(tq.hf_logits(ref, seqs), tq.hf_logits(tq.make_hf_model(arch), seqs))
        assert err <= 1e-6, (arch, err)


@pytest.mark.parametrize("outtype", ["f32", "bf16", "q8_0"])
@pytest.mark.parametrize("arch", tq.ARCHS)
def test_gguf(arch, outtype):
    path = tq.gguf_path(arch, outtype)
    model, src = load_model(path, show_progress=False)
    cfg = model.config
    assert src.kind == "gguf" and cfg.arch == arch and cfg.layer_types == ("linear", "full") * 2
    assert cfg.linear.v_tiled and cfg.rotary_dim == 8
    seqs = tq.prompts()
    err = tq.rel_err(prefill_logits(model, seqs),
                     tq.hf_logits(tq.gguf_reference(arch, path), seqs))
    print(f"{arch} gguf {outtype}: {err:.2e}")
    assert err <= TOL


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s"]))
