"""check_scales: which second-level scale tensors a GGUF may carry (seed 000's rules)."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_fixtures import random_nvfp4

from freetoken.formats.errors import FormatError
from freetoken.formats.gguf import GGUFFile
from freetoken.formats.nvfp4 import modelopt_to_gguf_nvfp4
from freetoken.formats.scales import check_scales, scaled_weights

T = gguf.GGMLQuantizationType


def nvfp4_raw(shape):
    return modelopt_to_gguf_nvfp4(*random_nvfp4(shape, seed=0)).numpy()


def write(path: Path, tensors: dict) -> Path:
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    for name, (arr, qt) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


F32_1 = (np.array([2e-4], np.float32), None)
F32_4 = (np.full(4, 2e-4, np.float32), None)
Q8 = (gguf.quants.quantize(np.ones((4, 64), np.float32), T.Q8_0), T.Q8_0)
DENSE = (nvfp4_raw((4, 64)), T.NVFP4)
EXPS = (nvfp4_raw((4, 8, 64)), T.NVFP4)

ACCEPTED = {
    "dense": {"blk.0.attn_q.weight": DENSE, "blk.0.attn_q.scale": F32_1,
              "blk.0.attn_q.input_scale": F32_1},
    "experts": {"blk.0.ffn_down_exps.weight": EXPS, "blk.0.ffn_down_exps.scale": F32_4,
                "blk.0.ffn_down_exps.input_scale": F32_4},
    "gate_up_scalar": {"blk.0.ffn_gate_up_exps.weight": EXPS,
                       "blk.0.ffn_gate_up_exps.scale": F32_1},
    "no_scales_and_scale_named_weights": {"blk.0.layer_output_scale.weight": F32_1,
                                          "blk.0.attn_q.weight": Q8},
}
REFUSED = {
    "scale_next_to_q8": ({"blk.0.attn_q.weight": Q8, "blk.0.attn_q.scale": F32_1},
                         "blk.0.attn_q.scale", "only next to an NVFP4 weight"),
    "orphan_input_scale": ({"blk.0.attn_q.input_scale": F32_1}, "blk.0.attn_q.input_scale",
                           "no weight"),
    "other_scale_kind": ({"blk.0.attn_q.weight": DENSE, "blk.0.attn_q.weight_scale": F32_1},
                         "blk.0.attn_q.weight_scale", "not supported"),
    "k_scale": ({"blk.0.attn_k.weight": DENSE, "blk.0.attn_k.k_scale": F32_1},
                "blk.0.attn_k.k_scale", "not supported"),
    "merged_gate_up_per_expert": ({"blk.0.ffn_gate_up_exps.weight": EXPS,
                                   "blk.0.ffn_gate_up_exps.scale": F32_4},
                                  "blk.0.ffn_gate_up_exps.scale", "merged gate"),
    "wrong_count": ({"blk.0.ffn_up_exps.weight": EXPS, "blk.0.ffn_up_exps.scale":
                     (np.ones(3, np.float32), None)}, "blk.0.ffn_up_exps.scale", "expected 1 or 4"),
    "not_f32": ({"blk.0.attn_q.weight": DENSE, "blk.0.attn_q.scale":
                 (np.ones(1, np.float16), None)}, "blk.0.attn_q.scale", "must be F32"),
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_accepted(tmp_path: Path, case: str):
    with GGUFFile(write(tmp_path / "a.gguf", ACCEPTED[case])) as g:
        check_scales(g)
        for name in scaled_weights(g):
            assert g.weight(name).scale2 is not None


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused(tmp_path: Path, case: str):
    tensors, culprit, msg = REFUSED[case]
    with GGUFFile(write(tmp_path / "r.gguf", tensors)) as g:
        with pytest.raises(FormatError, match=msg) as e:
            check_scales(g)
    assert f"tensor {culprit!r}" in str(e.value)


def test_expert_scale2_is_per_expert(tmp_path: Path):
    with GGUFFile(write(tmp_path / "e.gguf", ACCEPTED["experts"])) as g:
        s2 = g.weight("blk.0.ffn_down_exps.weight").scale2
        assert s2 is not None and tuple(s2.shape) == (4,)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
