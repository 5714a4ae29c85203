"""--dummy-weights: random weights in each format's real storage, built through the loader.

References: gguf-py's numpy codecs decode the GGUF blocks the dummy maker writes (bit for bit
what FreeToken's codecs give, all finite); NVFP4 against a float64 decode of the E2M1 codes
and E4M3 scales; the built-in shapes against the published parameter counts.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from freetoken.config import EngineConfig
from freetoken.engine.engine import Engine
from freetoken.engine.sampling_params import SamplingParams
from freetoken.formats.dequant import dequantize
from freetoken.models.dummy import (
    BUILTIN,
    FORMATS,
    IdTokenizer,
    Rand,
    dummy_config,
    load_dummy,
    random_weight,
)
from freetoken.models.testing import prefill_logits


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on the shared 2-core CI box a second intra-op thread that another job
    descheduled stalls every small op at its barrier (see tests/engine/test_bench_decode.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


@pytest.mark.parametrize("fmt", ["q4_k", "q8_0", "mxfp4"])
def test_gguf_blocks_decode_like_gguf_py(fmt):
    qw = random_weight(Rand("cpu", 1), fmt, 64, 512)
    assert qw.fmt == "gguf" and qw.ggml_type == FORMATS[fmt][1]
    ref = gguf.quants.dequantize(qw.data.numpy(), gguf.GGMLQuantizationType(qw.ggml_type))
    ours = dequantize(qw).numpy()
    assert ref.shape == ours.shape == (64, 512)
    assert np.isfinite(ref).all()
    np.testing.assert_array_equal(ours, ref)
    assert 0.005 < ref.std() < 0.08  # about a trained matrix's spread (0.02)


def test_nvfp4_storage_against_float64_decode():
    qw = random_weight(Rand("cpu", 2), "nvfp4", 32, 256)
    assert qw.fmt == "nvfp4" and qw.data.shape == (32, 128) and qw.scales.shape == (32, 16)
    assert qw.scales.dtype == torch.float8_e4m3fn and qw.scale2 is not None
    codes = qw.data.numpy().astype(np.int64)
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(32, 256)  # low nibble first
    val = np.where(nib & 8, -1.0, 1.0) * np.array(E2M1, dtype=np.float64)[nib & 7]
    scale = qw.scales.to(torch.float64).numpy()
    assert np.isfinite(scale).all() and (scale > 0).all()
    ref = val * np.repeat(scale, 16, axis=1)
    np.testing.assert_array_equal(dequantize(qw).double().numpy(), ref)
    w = ref * float(qw.scale2)
    assert 0.005 < w.std() < 0.08


def test_bf16_and_fallback_to_q8_0():
    r = Rand("cpu", 3)
    assert random_weight(r, "bf16", 8, 64).data.dtype == torch.bfloat16
    # Gemma-4's expert down projection: 704 inputs, not whole Q4_K super-blocks.
    qw = random_weight(r, "q4_k", 16, 704)
    assert qw.ggml_type == gguf.GGMLQuantizationType.Q8_0


def _param_count(cfg) -> float:
    h, layers = cfg.hidden_size, cfg.num_layers
    attn = h * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    experts = cfg.num_experts * 3 * h * cfg.moe_intermediate_size
    return (layers * (attn + experts) + 2 * cfg.vocab_size * h) / 1e9


def test_builtin_qwen3_30b_shapes():
    cfg = dummy_config("qwen3-30b-a3b")
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.vocab_size, cfg.rope_theta) == ("qwen3_moe", 48, 2048, 128, 8, 768, 32, 4, 128,
                                                151936, 1e6)
    assert abs(_param_count(cfg) - 30.5) < 0.3  # Qwen's published 30.5B


def test_builtins_parse_and_shorten():
    q35 = dummy_config("qwen3.6-35b-a3b")
    assert (q35.arch, q35.num_layers, q35.num_experts, q35.moe_intermediate_size,
            q35.hidden_size) == ("qwen3_5_moe", 40, 256, 512, 2048)
    assert q35.layer_types[:4] == ("linear", "linear", "linear", "full")
    g4 = dummy_config("gemma-4-26b-a4b")
    assert (g4.arch, g4.num_experts, g4.num_experts_per_tok, g4.hidden_size,
            g4.moe_intermediate_size) == ("gemma4", 128, 8, 2816, 704)
    short = dummy_config("qwen3.6-35b-a3b", layers=2)
    assert short.num_layers == 2 and short.layer_types == ("linear", "full")
    with pytest.raises(ValueError, match="--dummy-layers"):
        dummy_config("tiny-llama", layers=9)
    with pytest.raises(ValueError, match="built-in"):
        dummy_config("no-such-model")
    assert set(BUILTIN) >= {"qwen3-30b-a3b", "qwen3.6-35b-a3b", "gemma-4-26b-a4b"}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tiny_moe_model_formats(fmt):
    model = load_dummy("tiny-qwen3-moe", fmt, show_progress=False)
    layer = model.model.layers[0]
    bank = layer.mlp.experts.bank
    want_fmt, want_type, _ = FORMATS[fmt]
    assert bank.w13.fmt == bank.w2.fmt == ("f32" if fmt == "bf16" else want_fmt)
    assert bank.w13.ggml_type == (None if want_type is None else int(want_type))
    # NVFP4's per-expert second-level scales land in the bank's [E, 4] columns.
    assert bank.has_scales() == (fmt == "nvfp4")
    attn = layer.self_attn.qkv_proj.weights[0]
    assert attn.ggml_type == (None if fmt == "bf16" else gguf.GGMLQuantizationType.Q8_0)
    assert layer.mlp.gate.weights[0].fmt == "f32"  # routers stay float
    logits = prefill_logits(model, [[5, 6, 7], [9]])
    assert all(torch.isfinite(lg).all() for lg in logits)


def test_seeded():
    a, b = (load_dummy("tiny-llama", "q4_k", seed=s, show_progress=False) for s in (0, 0))
    c = load_dummy("tiny-llama", "q4_k", seed=1, show_progress=False)
    la, lb, lc = (prefill_logits(m, [[5, 6, 7]])[0] for m in (a, b, c))
    torch.testing.assert_close(la, lb, rtol=0, atol=0)
    assert not torch.equal(la, lc)


def test_config_of_a_real_file():
    path = Path(__file__).resolve().parents[1] / "data" / "tiny_qwen3_moe_q4k-mxfp4.gguf"
    model = load_dummy(path, "q8_0", show_progress=False)
    assert model.config.arch == "qwen3_moe" and model.config.num_experts == 8
    assert torch.isfinite(prefill_logits(model, [[1, 2]])[0]).all()


def test_engine_runs_dummy_model_with_token_ids():
    eng = Engine(EngineConfig(model="tiny-llama", dummy_weights=True, dummy_format="q4_k",
                              dummy_layers=1, show_progress=False))
    assert isinstance(eng.tokenizer, IdTokenizer) and eng.model.config.num_layers == 1
    assert eng.tokenizer.encode("3 4 5") == [3, 4, 5]
    eng.add_request("a", [3, 4, 5], SamplingParams(max_tokens=4, temperature=0,
                                                     ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert len(outs[-1].output_token_ids) == 4 and outs[-1].finish_reason == "length"


def _greedy(backend: str, device: str = "cpu") -> list[int]:
    eng = Engine(EngineConfig(model="tiny-qwen3-moe", dummy_weights=True, dummy_format="q4_k",
                              moe_backend=backend, device=device, dtype="float32",
                              show_progress=False))
    eng.add_request("a", [3, 4, 5, 6], SamplingParams(max_tokens=5, temperature=0,
                                                        ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].error is None
    return outs[-1].output_token_ids


def test_every_moe_backend_runs_dummy_weights():
    want = _greedy("fused")
    assert len(want) == 5
    for backend in ("offload", "hybrid", "cpu"):
        assert _greedy(backend) == want, backend


@pytest.mark.parametrize("field, value, flag", [("dummy_format", "q4_k", "--dummy-format"),
                                                ("dummy_layers", 2, "--dummy-layers")])
def test_dummy_flags_without_dummy_weights_refused(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        Engine(EngineConfig(model="tiny-llama", **{field: value}))


def test_serve_start_check_takes_builtin_names():
    from freetoken.commands.serve import _check

    _check(EngineConfig(model="qwen3-30b-a3b", dummy_weights=True))  # no file: fine
    with pytest.raises(ValueError, match="built-in"):
        _check(EngineConfig(model="no-such-shape", dummy_weights=True))


def test_dummy_weights_need_a_model():
    with pytest.raises(ValueError, match="--dummy-weights needs --model"):
        Engine(EngineConfig(dummy_weights=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_weights_made_on_the_device():
    model = load_dummy("tiny-qwen3-moe", "nvfp4", dtype=torch.bfloat16, device="cuda",
                       show_progress=False)
    bank = model.model.layers[0].mlp.experts.bank
    assert bank.w13.data.is_cuda and bank.w13.scales.is_cuda and bank.scales.is_cuda
    assert torch.isfinite(prefill_logits(model, [[1, 2, 3]])[0]).all()
    # offload / hybrid / cpu: the experts are drawn straight into host banks.
    eng = Engine(EngineConfig(model="tiny-qwen3-moe", dummy_weights=True, dummy_format="q4_k",
                              moe_backend="offload", device="cuda", show_progress=False))
    assert eng.model.model.layers[0].mlp.experts.bank.w13.data.device.type == "cpu"
    assert len(_greedy("offload", "cuda")) == 5


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
