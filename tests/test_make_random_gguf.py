"""scripts/make_random_gguf.py: a tiny qwen3moe file of each expert type loads through
FreeToken's strict loader; what the loader holds equals what gguf-py's own reader and numpy
codecs read from the file; the full-size plan has the size of the file llama.cpp was measured
on (16.75 GiB, FACTS.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from freetoken.formats.dequant import dequantize
from freetoken.models import load_model
from freetoken.models.testing import prefill_logits

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import make_random_gguf as mrg  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread: on the shared 2-core CI box a second intra-op thread that another job
    descheduled stalls every small op at its barrier (see tests/engine/test_bench_decode.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = dict(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64, experts=4,
            top_k=2, expert_ff=256, context=1024)


@pytest.fixture(scope="module", params=["q4_k", "nvfp4"])
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"tiny_{request.param}.gguf"
    mrg.write(str(path), TINY, request.param, seed=3, log=lambda *_: None)
    return request.param, path


def test_loads_and_runs(tiny):
    fmt, path = tiny
    model, src = load_model(path, show_progress=False)
    cfg = model.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
            cfg.moe_intermediate_size, cfg.vocab_size) == ("qwen3_moe", 2, 256, 4, 2, 256, 512)
    bank = model.model.layers[1].mlp.experts.bank
    assert bank.w13.fmt == ("gguf" if fmt == "q4_k" else "nvfp4")
    logits = prefill_logits(model, [[1, 300, 7, 42]])[0]
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_loader_holds_the_file_as_gguf_py_reads_it(tiny):
    fmt, path = tiny
    model, _ = load_model(path, show_progress=False)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    layer = model.model.layers[0]
    # Q8_0 attention: FreeToken's decode of the loaded rows equals gguf-py's of the file's.
    q = tensors["blk.0.attn_q.weight"]
    ref = gguf.quants.dequantize(np.asarray(q.data), q.tensor_type)
    ours = dequantize(layer.self_attn.qkv_proj.weights[0]).numpy()[:ref.shape[0]]
    np.testing.assert_array_equal(ours, ref)
    gate = tensors["blk.0.ffn_gate_exps.weight"]
    experts = gguf.quants.dequantize(np.asarray(gate.data), gate.tensor_type)  # [E, I, H]
    scaled = experts
    if fmt == "nvfp4":  # llama.cpp multiplies results by the per-expert .scale
        scaled = experts * np.asarray(tensors["blk.0.ffn_gate_exps.scale"].data)[:, None, None]
    assert np.isfinite(experts).all() and 0.005 < scaled.std() < 0.08
    bank = layer.mlp.experts.bank
    w13 = dequantize(bank.w13).numpy()  # [E, 2I, H], gate rows first
    np.testing.assert_array_equal(w13[:, :256], experts)
    if fmt == "nvfp4":  # the per-expert .scale tensors become the bank's scale columns
        for col, part in enumerate(("gate", "up", "down")):
            s = np.asarray(tensors[f"blk.0.ffn_{part}_exps.scale"].data)
            np.testing.assert_array_equal(bank.scales[:, col].numpy(), s)
    else:
        assert "blk.0.ffn_gate_exps.scale" not in tensors and not bank.has_scales()


def test_full_size_plan_matches_the_measured_file():
    for fmt in ("q4_k", "nvfp4"):
        qtype = mrg.EXPERT_TYPES[fmt]
        planned = [t for t in mrg.plan(mrg.SHAPE) if t.kind != "scale" or fmt == "nvfp4"]
        total = sum(mrg._nbytes(t, mrg._ggml_type(t, qtype))[1] for t in planned)
        assert abs(total / 2**30 - 16.75) < 0.01  # llama-bench's model size (FACTS.md)
    assert len([t for t in mrg.plan(mrg.SHAPE) if t.kind == "experts"]) == 48 * 3


def test_bad_shape_refused(tmp_path):
    with pytest.raises(ValueError, match="Q4_K blocks"):
        mrg.write(str(tmp_path / "x.gguf"), dict(TINY, expert_ff=200), "q4_k",
                  log=lambda *_: None)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


# The shape of tests/models/test_dummy_routing.py (Qwen3-30B-A3B's attention, width and 128
# experts top-8; vocabulary 4096 and experts 256 wide so that it writes and loads in seconds)
ROUTING = dict(vocab=4096, hidden=2048, layers=4, heads=32, kv_heads=4, head_dim=128,
               experts=128, top_k=8, expert_ff=256, context=1024)


@pytest.mark.parametrize("fmt", ["q4_k", "nvfp4"])
def test_prefill_routes_about_uniformly(fmt, tmp_path):
    """The expert-cache ceilings (and llama.cpp's `-ncmoe` beside them) assume uniform routing:
    a 128-token prompt of random ids must cover at least 90% of the experts in every layer,
    the busiest taking at most 3x the mean share (uniform routing: 2.1x on average, below
    2.7 in 1000 draws; test_dummy_routing.py). The file as first written gave 7.1x in layer 0
    and, with NVFP4 experts, 41% coverage in layer 1 (embedding rows of 0.02, o_proj at 0.02,
    Q4_K sub-blocks with random offsets)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from dummy_routing import Recorder, run_tokens, spread

    path = tmp_path / f"routing_{fmt}.gguf"
    mrg.write(str(path), ROUTING, fmt, seed=3, log=lambda *_: None)
    model, _ = load_model(path, show_progress=False)
    prompt = torch.randint(0, 4096, (128,), generator=torch.Generator().manual_seed(1))
    rec = Recorder(model)
    run_tokens(model, [prompt.tolist()], 0)
    assert len(rec.calls) == ROUTING["layers"]
    for layer, calls in rec.calls.items():
        cover, share, _ = spread(calls[0], 128)
        assert cover >= 0.9 and share <= 3.0, \
            f"{fmt} layer {layer}: coverage {cover:.2f}, busiest {share:.2f}x"
