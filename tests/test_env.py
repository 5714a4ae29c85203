"""The on/off switches of freetoken/env.py: on when unset or 1 / true / yes / on, off for 0 /
false / no / off, and any other value refused with a message naming the variable (a typo
must not leave the default on silently)."""

from __future__ import annotations

import pytest
import torch

from freetoken import env

SWITCHES = {
    "FREETOKEN_CPU_MOE_HUGEPAGES": env.cpu_moe_hugepages,
    "FREETOKEN_GPU_INT8_DOT": env.gpu_int8_dot,
    "FREETOKEN_GPU_NORM_ROUTE": env.gpu_norm_route,
    "FREETOKEN_GPU_ROPE_ATTN": env.gpu_rope_attn,
    "FREETOKEN_GPU_GDN_FUSED": env.gpu_gdn_fused,
    "FREETOKEN_GPU_DOWN_SUM": env.gpu_down_arrive_sum,
    "FREETOKEN_GPU_NORM_FOLD": env.gpu_norm_fold,
    "FREETOKEN_GPU_SIDE_STREAM": env.gpu_side_stream,
    "FREETOKEN_GPU_RECEIVE_SHARED": env.gpu_receive_shared,
    "FREETOKEN_MOE_AHEAD_WORKER": env.moe_ahead_worker,
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
def test_on_off_switch(name, monkeypatch):
    read = SWITCHES[name]
    monkeypatch.delenv(name, raising=False)
    assert read() is True
    for value, on in (("1", True), ("yes", True), (" On ", True), ("0", False),
                      ("false", False), ("OFF", False)):
        monkeypatch.setenv(name, value)
        assert read() is on, value
    monkeypatch.setenv(name, "banana")
    with pytest.raises(ValueError, match=f"{name}='banana' is not one of"):
        read()


def test_off_unless_set_switch(monkeypatch):
    """FREETOKEN_MOE_PREFETCH: off when unset, else the same values as the others."""
    name = "FREETOKEN_MOE_PREFETCH"
    monkeypatch.delenv(name, raising=False)
    assert env.moe_prefetch() is False
    for value, on in (("1", True), (" On ", True), ("0", False), ("no", False)):
        monkeypatch.setenv(name, value)
        assert env.moe_prefetch() is on, value
    monkeypatch.setenv(name, "banana")
    with pytest.raises(ValueError, match=f"{name}='banana' is not one of"):
        env.moe_prefetch()


def test_moe_route_tiles(monkeypatch):
    """FREETOKEN_GPU_MOE_ROUTE_TILES=BNxBKxWARPS: parsed and checked, and the fused MoE's
    per-route int8 tiles take it at 2-16 tokens, over the measured defaults (BK halved until it
    tiles K: Q4_K needs whole super-blocks, K 768 takes 256), while one token keeps its own."""
    from freetoken.kernels.triton.moe import _i8_tiles

    name = "FREETOKEN_GPU_MOE_ROUTE_TILES"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_moe_route_tiles() is None
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 16) == (64, 1024, 4, True)  # ROUTE_TILES
    assert _i8_tiles(1, 2048, torch.bfloat16, None, 4) == (32, 1024, 4, True)
    assert _i8_tiles(18, 2048, torch.bfloat16, None, 4) == (16, 1024, 4, True)
    monkeypatch.setenv(name, " 32x1024x8 ")
    assert env.gpu_moe_route_tiles() == (32, 1024, 8)
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 16) == (32, 1024, 8, True)
    assert _i8_tiles(13, 768, torch.bfloat16, None, 4) == (32, 256, 8, True)
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 1) == (16, 1024, 4, True)
    assert _i8_tiles(13, 2048, torch.bfloat16, (1, 4, 512, 2), 16) == (4, 512, 2, True)
    for bad, why in (("32x1024", "three integers"), ("32,1024,8", "three integers"),
                     ("24x1024x4", "power of two"), ("32x1024x3", "WARPS"),
                     ("32x16x4", "32-4096")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=why):
            env.gpu_moe_route_tiles()


def test_moe_down_tiles(monkeypatch):
    """FREETOKEN_GPU_MOE_DOWN_TILES=BNxBKxWARPS: parsed and checked as the route tiles are, and
    the down GEMV's tiles take it at every decode size unless tiles are given."""
    from freetoken.kernels.triton.moe import _down_i8_tiles

    name = "FREETOKEN_GPU_MOE_DOWN_TILES"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_moe_down_tiles() is None
    assert _down_i8_tiles(13, 768, torch.bfloat16, None, 1) == (16, 256, 4, True)  # default
    monkeypatch.setenv(name, "64x1024x4")
    assert env.gpu_moe_down_tiles() == (64, 1024, 4)
    for tokens in (1, 4, 16):  # K 768 of Q4_K: chunks of whole super-blocks that tile it
        assert _down_i8_tiles(13, 768, torch.bfloat16, None, tokens) == (64, 256, 4, True)
    assert _down_i8_tiles(13, 768, torch.bfloat16, (1, 8, 256, 2), 1) == (8, 256, 2, True)
    monkeypatch.setenv(name, "48x1024x4")
    with pytest.raises(ValueError, match=f"{name}=.*power of two"):
        env.gpu_moe_down_tiles()


def test_norm_route_tiles(monkeypatch):
    """FREETOKEN_GPU_NORM_ROUTE_TILES=BExWARPS: parsed and checked (a bad value names the
    variable and what it must be); unset, the fused norm + router keeps its default."""
    name = "FREETOKEN_GPU_NORM_ROUTE_TILES"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_norm_route_tiles() is None
    monkeypatch.setenv(name, " 4x2 ")
    assert env.gpu_norm_route_tiles() == (4, 2)
    for bad, why in (("4", "two integers"), ("4x2x1", "two integers"), ("3x2", "power of two"),
                     ("128x2", "1-64"), ("4x3", "WARPS")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}=.*{why}"):
            env.gpu_norm_route_tiles()


def test_linear_tiles(monkeypatch):
    """FREETOKEN_GPU_LINEAR_TILES=BNxBKxWARPS: the dense int8 GEMV's tiles at one token take
    it (BK halved until it tiles K), the lm_head's and several tokens' keep theirs."""
    from freetoken.kernels.triton.linear import _i8_blocks

    name = "FREETOKEN_GPU_LINEAR_TILES"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_linear_tiles() is None
    assert _i8_blocks(1, 5120, 2048, 18) == (1, 8, 2048, 8)  # the measured default
    assert _i8_blocks(1, 5120, 2048, 1) == (1, 8, 2048, 4)
    monkeypatch.setenv(name, "4x1024x2")
    assert env.gpu_linear_tiles() == (4, 1024, 2)
    assert _i8_blocks(1, 5120, 2048, 18) == (1, 4, 1024, 2)
    assert _i8_blocks(1, 2048, 768, 13) == (1, 4, 256, 2)  # Q4_K: whole super-blocks
    assert _i8_blocks(1, 151936, 2048, 18) == (1, 16, 512, 4)  # the lm_head keeps its own
    monkeypatch.setenv(name, "4x1024")
    with pytest.raises(ValueError, match=f"{name}=.*three integers"):
        env.gpu_linear_tiles()


def test_moe_one_tiles(monkeypatch):
    """FREETOKEN_GPU_MOE_ONE_TILES=BNxBKxWARPS: one token's per-route int8 tiles take it (BK
    halved until it tiles K), two tokens and more keep theirs."""
    from freetoken.kernels.triton.moe import _i8_tiles

    name = "FREETOKEN_GPU_MOE_ONE_TILES"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_moe_one_tiles() is None
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 1) == (16, 1024, 4, True)
    monkeypatch.setenv(name, "16x2048x4")
    assert env.gpu_moe_one_tiles() == (16, 2048, 4)
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 1) == (16, 2048, 4, True)
    assert _i8_tiles(13, 768, torch.bfloat16, None, 1) == (16, 256, 4, True)
    assert _i8_tiles(13, 2048, torch.bfloat16, None, 4) == (64, 1024, 4, True)  # ROUTE_TILES
    monkeypatch.setenv(name, "16x2048")
    with pytest.raises(ValueError, match=f"{name}=.*three integers"):
        env.gpu_moe_one_tiles()


def test_norm_route_split(monkeypatch):
    """FREETOKEN_GPU_NORM_ROUTE_SPLIT=BHxWARPS or 0: parsed and checked."""
    name = "FREETOKEN_GPU_NORM_ROUTE_SPLIT"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_norm_route_split() is None
    monkeypatch.setenv(name, "128x4")
    assert env.gpu_norm_route_split() == (128, 4)
    monkeypatch.setenv(name, "0")
    assert env.gpu_norm_route_split() == (0, 1)
    for bad, why in (("128", "two integers"), ("96x4", "power of two"), ("16x4", "32-4096"),
                     ("128x3", "WARPS")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}=.*{why}"):
            env.gpu_norm_route_split()


@pytest.mark.parametrize("name,read,unset,good,bad", [
    ("FREETOKEN_GPU_LINEAR_MT", env.gpu_linear_mt, None, ((" 8 ", 8), ("0", 0), ("16", 16)),
     (("17", "0 \\(off\\) to 16"), ("-1", "0 \\(off\\) to 16"), ("all", "not an integer"))),
    ("FREETOKEN_GPU_ATTN_MERGE_SPLITS", env.gpu_attn_merge_splits, None, ((" 16 ", 16),),
     (("0", "1 or more"), ("-2", "1 or more"), ("four", "not an integer"))),
    ("FREETOKEN_MOE_AHEAD_DELAY_US", env.moe_ahead_delay_us, 0, (("12", 12),),
     (("-1", "0 to 1000"), ("1001", "0 to 1000"), ("soon", "not an integer"))),
    ("FREETOKEN_GPU_MOE_MAXNREG", env.gpu_moe_maxnreg, None, (("0", None), (" 96 ", 96),
                                                             ("32", 32), ("248", 248)),
     (("100", "multiple of 8"), ("24", "32-255"), ("256", "32-255"), ("many", "not an integer"))),
])
def test_integer_switch(name, read, unset, good, bad, monkeypatch):
    """FREETOKEN_GPU_LINEAR_MT (0-16), FREETOKEN_GPU_ATTN_MERGE_SPLITS (from 1 on),
    FREETOKEN_MOE_AHEAD_DELAY_US (0-1000, 0 when unset) and FREETOKEN_GPU_MOE_MAXNREG
    (multiples of 8 in 32-255; 0 or unset: None): the unset value, integers in range as
    given, anything else an error naming the switch."""
    monkeypatch.delenv(name, raising=False)
    assert read() == unset
    for v, n in good:
        monkeypatch.setenv(name, v)
        assert read() == n
    for v, why in bad:
        monkeypatch.setenv(name, v)
        with pytest.raises(ValueError, match=why):
            read()


def test_moe_grouped(monkeypatch):
    """FREETOKEN_GPU_MOE_GROUPED=LO-HI: a span of token counts; 0 the empty span (0, 0);
    unset None (the module default); anything else an error naming it (which tokens it
    selects: tests/kernels/test_triton_moe_grouped.py)."""
    name = "FREETOKEN_GPU_MOE_GROUPED"
    monkeypatch.delenv(name, raising=False)
    assert env.gpu_moe_grouped() is None
    for value, span in ((" 5-16 ", (5, 16)), ("4-4", (4, 4)), ("0", (0, 0)), ("", None)):
        monkeypatch.setenv(name, value)
        assert env.gpu_moe_grouped() == span, value
    for bad, why in (("16-5", "HI at least LO"), ("0-4", "LO must be 1"), ("5", "not LO-HI"),
                     ("a-b", "not LO-HI"), ("5-8-9", "not LO-HI")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=why):
            env.gpu_moe_grouped()


def test_known_switches():
    """env.known: the switches this module reads (and the executor's native ones) by name; a
    misspelt or foreign name, or a name without the prefix, is not one."""
    for name in ("FREETOKEN_GPU_MOE_MAXNREG", "FREETOKEN_GPU_PDL", "FREETOKEN_CACHE",
                 "FREETOKEN_CPU_MOE_PREFETCH_L2"):
        assert env.known(name), name
    for name in ("FREETOKEN_GPU_MOE_MAXNRG", "FREETOKEN_", "GPU_PDL", "PATH"):
        assert not env.known(name), name
