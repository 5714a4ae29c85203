"""Triton kernels compiled for the H200 (sm_90, PTX and cubin through Triton's own ptxas) on a
machine without a GPU, for every constexpr branch their entry points use.

Triton's interpreter, which runs the kernel tests here, does not type-check: a name bound to
int32 in one branch and int64 in another runs there and fails only when compiled (the q/k rope
kernel with STORE off did so on the H200). Compiling needs no driver, so each case below is
compiled in a child process without TRITON_INTERPRET (the test modules set it at import,
and it is read when the kernels are decorated).
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import subprocess
import sys

import pytest

# not imported here: triton imported before a later test module sets TRITON_INTERPRET leaves
# that module's kernels half interpreted
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="needs triton")

# (module, kernel, pointer dtypes, constexprs, other scalars that are float, num_warps)
_BF = "*bf16"
CASES = {
    f"rope-partial{p}-store{s}": (
        "freetoken.kernels.triton.rotary", "_qk_rope_kernel",
        {"q_ptr": _BF, "k_ptr": _BF, "v_ptr": _BF, "qw_ptr": "*fp32", "kw_ptr": "*fp32",
         "qo_ptr": _BF, "ko_ptr": _BF, "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "cache_ptr": _BF, "slot_ptr": "*i64"},
        dict(HQ=16, HKV=2, HALF=128 if p else 64, NORM=True, STORE=s, PDL=False,
             RH=32 if p else 64, PARTIAL=p), ("eps",), 1)
    for p in (False, True) for s in (False, True)
}
CASES.update({
    f"sigmoid-gate-quant{q}": (
        "freetoken.kernels.triton.glu", "_sigmoid_gate_kernel",
        {"o_ptr": _BF, "g_ptr": _BF, "y_ptr": _BF, "q_ptr": "*i32"},
        dict(H=16, D=256, QUANT=q), (), 1)
    for q in (False, True)
})
CASES.update({
    f"gdn-gated-norm-quant{q}": (
        "freetoken.kernels.triton.gdn", "_gated_norm_kernel",
        {"o_ptr": "*fp32", "p_ptr": _BF, "w_ptr": "*fp32", "y_ptr": _BF, "q_ptr": "*i32"},
        dict(NV=32, DV=128, QUANT=q), ("eps",), 1)
    for q in (False, True)
})
# the gated delta-net decode step in one launch (`gdn.gdn_decode`, Qwen3.6-35B-A3B's heads:
# 32 value heads of 128, 16 key heads of 128, conv 4), with and without positions, both v
# layouts and the codes; grid and warps as gdn_decode launches it
_GDN_PTRS = {"p_ptr": _BF, "cw_ptr": "*fp32", "conv_ptr": "*fp32", "nega_ptr": "*fp32",
             "dtb_ptr": "*fp32", "ssm_ptr": "*fp32", "slots_ptr": "*i64", "pos_ptr": "*i64",
             "o_ptr": "*fp32", "nw_ptr": "*fp32", "y_ptr": _BF, "q_ptr": "*i32",
             "qk_count_ptr": "*i32", "norm_count_ptr": "*i32"}
CASES.update({
    f"gdn-fused-pos{p}-tiled{t}-quant{q}": (
        "freetoken.kernels.triton.gdn", "_fused_kernel", _GDN_PTRS,
        dict(HAS_POS=p, TILED=t, QUANT=q, NV=32, DK=128, DV=128, BV=32, KW=4, KP=4),
        ("scale", "eps"), 4)
    for p, t, q in ((True, False, True), (False, True, False), (True, True, False))
})
# the receive of the CPU's answer with the shared expert added (`handoff.receive_add`), gated
# (qwen3.5-moe) and not, at the 35B's width (`glu.gate_block`, GATE_WARPS)
CASES.update({
    f"receive-shared-gate{g}": (
        "freetoken.kernels.triton.handoff", "_receive_shared_kernel",
        {"y_ptr": _BF, "sh_ptr": _BF, "x_ptr": _BF, "w_ptr": _BF, "out_ptr": _BF,
         "seq_ptr": "*i32", "hi32": "*i32", "hf32": "*fp32", "waits_ptr": "*i64",
         "timeout_ns": "i64"},
        dict(H=2048, BLOCK=1024, GATE=g, ASM=True), (), 4)
    for g in (False, True)
})
# the receive with the next layer's residual step folded in (`handoff.receive_add(fold=)`),
# one program a token at the 30B's width, with and without the codes
CASES.update({
    f"receive-norm-quant{q}": (
        "freetoken.kernels.triton.handoff", "_receive_norm_kernel",
        {"y_ptr": _BF, "out_ptr": _BF, "seq_ptr": "*i32", "hi32": "*i32", "hf32": "*fp32",
         "waits_ptr": "*i64", "timeout_ns": "i64", "res_ptr": _BF, "nw_ptr": "*fp32",
         "ny_ptr": _BF, "ns_ptr": _BF, "nq_ptr": "*i32"},
        dict(H=2048, QUANT=q, BLOCK=2048, ASM=True), ("eps",), 4)
    for q in (False, True)
})
# the same with the shared expert and its gate added (qwen3.5-moe, the 35B's width: the
# gate's chunks of 1024, the row of 2048, GATE_WARPS), with and without the codes
CASES.update({
    f"receive-shared-norm-gate{g}-quant{q}": (
        "freetoken.kernels.triton.handoff", "_receive_shared_norm_kernel",
        {"y_ptr": _BF, "sh_ptr": _BF, "x_ptr": _BF, "w_ptr": _BF, "out_ptr": _BF,
         "seq_ptr": "*i32", "hi32": "*i32", "hf32": "*fp32", "waits_ptr": "*i64",
         "timeout_ns": "i64", "res_ptr": _BF, "nw_ptr": "*fp32", "ny_ptr": _BF, "ns_ptr": _BF,
         "nq_ptr": "*i32"},
        dict(H=2048, GBLOCK=1024, GATE=g, QUANT=q, BLOCK=2048, ASM=True), ("eps",), 4)
    for g, q in ((True, True), (False, False))
})
# the plain receive and the wait for the worker's ahead copies: the two polls of a host word
# (`handoff._poll`, exact and in int32 order)
CASES.update({
    "receive": (
        "freetoken.kernels.triton.handoff", "_receive_kernel",
        {"y_ptr": _BF, "out_ptr": _BF, "seq_ptr": "*i32", "hi32": "*i32", "hf32": "*fp32",
         "waits_ptr": "*i64", "timeout_ns": "i64"},
        dict(BLOCK=1024, ASM=True), (), 4),
    "ahead-wait": (
        "freetoken.kernels.triton.handoff", "_ahead_wait_kernel",
        {"want_ptr": "*i32", "hi32": "*i32", "timeout_ns": "i64"},
        dict(ASM=True), (), 1),
})
# the fused backend's gated add of the shared expert with that step folded in (`glu.
# gated_add_triton(fold=)`), the 35B's width, with and without the codes
CASES.update({
    f"gated-add-norm-quant{q}": (
        "freetoken.kernels.triton.glu", "_gated_add_norm_kernel",
        {"y_ptr": _BF, "sh_ptr": _BF, "x_ptr": _BF, "w_ptr": _BF, "out_ptr": _BF,
         "res_ptr": _BF, "nw_ptr": "*fp32", "ny_ptr": _BF, "ns_ptr": _BF, "nq_ptr": "*i32"},
        dict(H=2048, GBLOCK=1024, QUANT=q, BLOCK=2048), ("eps",), 4)
    for q in (False, True)
})
# the next layer's hint for the CPU worker's warming (`handoff.post_hint`): one token of the
# 30B (128 experts), eight of the 35B (256 experts)
CASES.update({
    f"hint-R{rb}-E{eb}": (
        "freetoken.kernels.triton.handoff", "_hint_kernel",
        {"ids_ptr": "*i64", "map_ptr": "*i32", "live_ptr": "*i32", "seq_ptr": "*i32",
         "hi32": "*i32"},
        dict(RB=rb, EB=eb, HMAX=64, ASM=True), (), 4)
    for rb, eb in ((8, 128), (64, 256))
})
_PLAN_PTRS = {"ids_ptr": "*i64", "slot_of_ptr": "*i32", "owner_ptr": "*i64",
              "last_ptr": "*i64", "fresh_ptr": "*i32", "clock_ptr": "*i64", "counters_ptr": "*i64",
              "lim_ptr": "*i32", "out_ptr": "*i64", "live_ptr": "*i32", "x_ptr": _BF,
              "w_ptr": "*fp32", "seq_ptr": "*i32", "hi32": "*i32", "hf32": "*fp32", "hx": _BF}
# one chunk in registers (S <= SCAN) and several chunks; with and without SEND. SB, BLOCK and
# the warps are plan_triton's (`slot_plan.scan_shape`, JOB_BLOCK), filled in by the child: this
# process must not import the kernels (it would decorate them before TRITON_INTERPRET is set)
CASES.update({
    f"slot-plan-S{S}-send{send}": (
        "freetoken.kernels.triton.slot_plan", "_plan_kernel", _PLAN_PTRS,
        dict(S=S, E=256, LT=128, EB=256, RB=32, NB=32, HAS_LIVE=True, SEND=send, H=2048), (), None)
    for S in (1000, 2560, 9000) for send in (False, True)
})
# fetching ahead's plan (`slot_plan.ahead_triton`: one token of the 30B, eight of the 35B, one
# chunk and several) and the slot fill, one program a chunk and few striding (`handoff.fill`)
CASES.update({
    f"slot-ahead-S{S}-R{rb}": (
        "freetoken.kernels.triton.slot_plan", "_ahead_kernel", _PLAN_PTRS,
        dict(S=S, E=e, EB=e, RB=rb, NB=max(16, min(e, rb)), HAS_LIVE=True), (), None)
    for S, e, rb in ((614, 128, 16), (9000, 256, 64))
})
CASES.update({
    f"fill-rounds{rounds}": (
        "freetoken.kernels.triton.handoff", "_fill_kernel",
        {"fetched_ptr": "*i64", "pool_ptr": "*i32", "pool_addr": "i64", "table_ptr": "*i64"},
        dict(CHUNK=4096, BLOCK=4096, VEC=True, ROUNDS=rounds), (), 4)
    for rounds in (1, 9)
})

# the fused MoE's route grouping (`moe._align`) and the decoded rows of prefill's dense GEMM
# (`linear.dequant_gemm`), with and without a map / per tensor and per row scale2
_ALIGN_PTRS = {"ids_ptr": "*i64", "map_ptr": "*i32", "counts_ptr": "*i32", "start_ptr": "*i32",
               "seen_ptr": "*i32", "route_ids_ptr": "*i32", "block_slot_ptr": "*i32"}
CASES.update({
    f"align-{step}-map{m}": ("freetoken.kernels.triton.moe", f"_align_{step}_kernel",
                             _ALIGN_PTRS, dict(CH=256, MAP=m, **extra), (), 4)
    for m in (False, True) for step, extra in (("count", {}), ("place", {"BM": 64}))
})
CASES["align-start"] = ("freetoken.kernels.triton.moe", "_align_start_kernel", _ALIGN_PTRS,
                        dict(BM=64, SP=4096), (), 8)
CASES.update({
    f"dequant-fmt{f}-scale2{m}": (
        "freetoken.kernels.triton.tiles", "_dequant_kernel",
        {"w_ptr": "*u8", "s_ptr": "*u8", "out_ptr": _BF, "s2_ptr": "*fp32"},
        dict(K=2048, FMT=f, BN=16, BK=256, SCALE2=m), (), 4)
    for f in (1, 13) for m in (0, 1, 2)
})

# the dense linear's int8 GEMV taking several tokens a program (`linear._i8_tokens`): NVFP4 and
# split Q8_0 qkv (K 2048) at 4 and 8 tokens, quantizing in the kernel and reading the codes,
# with `linear.I8_MULTI_TILES`' tiles
CASES.update({
    f"qmm-i8-fmt{f}-mt{mt}-xq{xq}": (
        "freetoken.kernels.triton.linear", "_qmm_kernel",
        {"x_ptr": "*i32" if xq else _BF, "w_ptr": "*u8", "s_ptr": "*u8" if f == 1 else "*fp16",
         "scale2_ptr": "*fp32", "out_ptr": _BF},
        dict(K=2048, FMT=f, SCALE2=0, DOT=1, BM=1, BN=bn, BK=2048, FAST=False, I8=True,
             ASM=True, XQ=xq, PDL=False, MT=mt), (), warps)
    for f, bn, warps in ((1, 16, 8), (18, 8, 4)) for mt in (4, 8) for xq in (False, True)
})

# the fused MoE's grouped int8 kernels (`moe_grouped.py`; opt-in) at the 30B shape with
# moe.GROUP_I8_TILES' tiles and GROUP_BT: gate/up with and without the quantized GLU output,
# down with the codes and the in-kernel sum
_GROUP_PTRS = {"x_ptr": "*i32", "a_ptr": "*i32", "w_ptr": "*u8", "s_ptr": "*u8",
               "bank_s_ptr": "*fp32", "grp_slot_ptr": "*i32", "grp_cnt_ptr": "*i32",
               "grp_routes_ptr": "*i32", "route_w_ptr": "*fp32", "y_ptr": "*fp32",
               "out_ptr": _BF, "count_ptr": "*i32"}
CASES.update({
    f"group-gate-up-i8-fmt{f}-qa{qa}": (
        "freetoken.kernels.triton.moe_grouped", "_gate_up_i8_kernel", _GROUP_PTRS,
        dict(K=2048, INTER=768, TOPK=8, FMT=f, ACT=0, BT=2, BN=max(bn, 32) if qa else bn,
             BK=512, ASM=True, XQ=True, QA=qa), (), warps)  # qa: whole blocks of 32 rows
    for f, bn, warps in ((1, 16, 4), (13, 32, 8)) for qa in (False, True)
})
CASES.update({
    f"group-down-i8-fmt{f}": (
        "freetoken.kernels.triton.moe_grouped", "_down_i8_kernel", _GROUP_PTRS,
        dict(K=768, HIDDEN=2048, TOPK=8, FMT=f, BT=2, BN=bn, BK=256, ASM=True, XQ=True,
             SUM=True), (), warps)
    for f, bn, warps in ((1, 16, 4), (13, 32, 8))
})

# the Q4_K MoE in int8 tensor-core dots (`moe_mma.py`; opt-in) at the 30B shape with its
# default rows, both loop forms and the chunks the per-route path takes (gate/up 4
# super-blocks, down 1), and its activation quantizer (a constexpr reassigned in the
# sub-block loop ran in the interpreter and failed only when compiled)
_MMA_PTRS = {"xq_ptr": "*i32", "aq_ptr": "*i32", "w_ptr": "*u8", "bank_s_ptr": "*fp32",
             "route_ids_ptr": "*i32", "block_slot_ptr": "*i32", "route_w_ptr": "*fp32",
             "y_ptr": "*fp32", "x_ptr": _BF, "q_ptr": "*i32"}
CASES.update({
    f"mma-gate-up-q4k-unroll{u}": (
        "freetoken.kernels.triton.moe_mma", "_mma_gate_up_kernel", _MMA_PTRS,
        dict(K=2048, INTER=768, TOPK=8, ACT=0, BM=16, BN=32, CH=4, UNROLL=u, PDL=False), (), 4)
    for u in (False, True)
})
CASES.update({
    f"mma-down-q4k-unroll{u}": (
        "freetoken.kernels.triton.moe_mma", "_mma_down_kernel", _MMA_PTRS,
        dict(K=768, HIDDEN=2048, BM=16, BN=32, CH=1, UNROLL=u, PDL=False), (), 4)
    for u in (False, True)
})
CASES.update({
    "mma-quant-rows": ("freetoken.kernels.triton.moe_mma", "_quant_rows_kernel", _MMA_PTRS,
                       dict(K=2048, BLOCK=1024), (), 4),
})
# its fp16 form (the codes decoded by inline PTX, wgmma) for Q4_K and NVFP4 (fmt 13, 1),
# default tiles, and x's fp16 copy
_F16_PTRS = {**_MMA_PTRS, "x_ptr": "*fp16", "a_ptr": "*fp16", "y_ptr": "*fp32", "s_ptr": "*u8"}
CASES.update({
    f"mma-f16-gate-up-fmt{f}": (
        "freetoken.kernels.triton.moe_mma", "_f16_gate_up_kernel", _F16_PTRS,
        dict(FMT=f, K=2048, INTER=768, TOPK=8, ACT=0, BM=16, BN=128, ASM=True, PDL=False),
        (), 4)
    for f in (1, 13)
})
CASES.update({
    f"mma-f16-down-fmt{f}": (
        "freetoken.kernels.triton.moe_mma", "_f16_down_kernel", _F16_PTRS,
        dict(FMT=f, K=768, HIDDEN=2048, BM=16, BN=128, ASM=True, PDL=False), (), 4)
    for f in (1, 13)
})
CASES["mma-f16-rows"] = ("freetoken.kernels.triton.moe_mma", "_f16_rows_kernel",
                         {**_F16_PTRS, "x_ptr": _BF, "y_ptr": "*fp16"}, dict(BLOCK=1024), (), 4)

# decode attention (`attention.decode`) with the heads of Qwen3-30B-A3B (d 128, 4 KV heads)
# and Qwen3.6-35B-A3B (d 256, 2 KV heads), G = 8: one split, split-K merged by the last split to
# arrive, split-K for the merge kernel; the cases with the output's codes also with a window
# and a softcap. BLOCK_N and the warps are `attention._tiles`' for the head size. `-rope`: the
# q/k norm, rotary and KV store in the same launch (`decode(rope=...)`), with the models' own
# rotary (30B: all 128 values, 35B: the first 64 of 256).
_ATTN_PTRS = {"q_ptr": _BF, "cache_ptr": _BF, "table_ptr": "*i32", "seq_lens_ptr": "*i32",
              "out_ptr": _BF, "part_ptr": "*fp32", "q8_ptr": "*i32", "count_ptr": "*i32",
              "k_ptr": _BF, "v_ptr": _BF, "qw_ptr": "*fp32", "kw_ptr": "*fp32",
              "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}
CASES.update({
    f"attn-decode-d{d}-splits{s}-merge{m}-quant{q}" + ("-rope" if rope else ""): (
        "freetoken.kernels.triton.attention", "_decode_kernel", _ATTN_PTRS,
        dict(PAGE=16, N_KV=n_kv, D=d, D_PAD=d, G=8, G_PAD=16, BLOCK_N=block_n, NUM_SPLITS=s,
             HAS_WINDOW=q, HAS_SOFTCAP=q, IEEE=False, MAX_ITERS=0, QUANT=q, MERGE=m,
             S_PAD=max(2, s), PDL=False, ROPE=rope, NORM=rope, PARTIAL=rope and r < d,
             RH=r // 2 if rope else 0, GROUP=min(4, max(2, s))),  # decode()'s MERGE_GROUP
        ("scale", "softcap", "eps"), warps)
    for d, n_kv, block_n, warps, r in ((128, 4, 64, 4, 128), (256, 2, 32, 8, 64))
    for s, m, q in ((1, False, False), (1, False, True), (16, True, False), (16, True, True),
                    (16, False, False))
    for rope in (False, True)
})
CASES["attn-merge-quant"] = ("freetoken.kernels.triton.attention", "_merge_kernel", _ATTN_PTRS,
                             dict(H=32, D=128, D_PAD=128, NUM_SPLITS=16, S_PAD=16, QUANT=True,
                                  PDL=False), (), 4)

def _compile(name: str) -> None:
    """Compile one case for sm_90 (in a process without TRITON_INTERPRET)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, kernel, ptrs, const, floats, warps = CASES[name]
    mod = importlib.import_module(module)
    fn = getattr(mod, kernel)
    if kernel == "_plan_kernel":  # plan_triton's launch shape
        sb, warps = mod.scan_shape(const["S"])
        const = {**const, "SB": sb, "BLOCK": mod.JOB_BLOCK}
    if kernel == "_ahead_kernel":  # ahead_triton's
        sb, warps = mod.scan_shape(const["S"])
        const = {**const, "SB": sb}
    sig = {p: "constexpr" if p in const else ptrs.get(p, "fp32" if p in floats else "i32")
           for p in inspect.signature(fn.fn).parameters}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    assert k.asm["cubin"], name


def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__, *CASES], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.split().count("ok") == len(CASES), r.stdout


if __name__ == "__main__":
    failed = []
    for case in sys.argv[1:]:
        try:
            _compile(case)
            print(case, "ok")
        except Exception as exc:  # report every case, then fail
            failed.append(case)
            print(case, "FAILED:", type(exc).__name__, str(exc)[-1500:])
    sys.exit(1 if failed else 0)
