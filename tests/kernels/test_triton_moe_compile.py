"""The bf16 Triton GEMMs compile for Hopper (sm_90a) without a GPU, in every regime of
``pick_configs`` (at decode sizes also as the one-launch kernel of both): bf16 wgmma (what batch
invariance rests on: the same instruction whether the token rows or, swapped at decode sizes, the
weight columns are its M side), no register spills, shared memory within an SM's 227 KB (the
one-launch kernel within half of it). Same method as tests/kernels/test_triton_moe_fp8_compile.py: compiled as a
launch would specialize them, in a subprocess (the conftest puts Triton in interpreter mode on CPU
machines), registers and spills from ``ptxas -v``.
"""

import pytest
from sm90_compile import SHARED_BYTES, compile_for_sm90, no_spills

pytest.importorskip("triton")

BODY = r"""
from mok_serve.kernels.cuda import moe as tm

def common(g):
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_TMA")
    return dict({k: g[k] for k in keys}, GROUP_M=g.get("GROUP_M", 1), HALF_TAIL=g.get("HALF_TAIL", False),
                SWAP_AB=g.get("SWAP_AB", False), DOT_IEEE=False, DOT_F32=False, EVEN_K=True, EVEN_N=True, PDL=True,
                HEAVY_M=g.get("HEAVY_M", 0), HEAVY_STAGES=g.get("HEAVY_STAGES"))

# (name, hidden, inter, experts, top_k): DeepSeek-V3 and Qwen3-30B-A3B, whose column tiles differ at decode.
for shape, H, I, E, K in (("ds", 7168, 2048, 256, 8), ("qwen30", 2048, 768, 128, 8)):
    for tokens, hot in ((1, ""), (2, ""), (128, ""), (512, ""), (512, "_heavy128"), (8192, "")):
        g1, g2 = tm.pick_configs(tokens, K, E, H, I)
        if hot:  # the sweep's hot-expert tiles beside the 64-row ones
            g1, g2 = (dict(g, HEAVY_M=128, HEAVY_STAGES=3) for g in (g1, g2))
        bn1, bk1, bn2, bk2 = g1["BLOCK_N"], g1["BLOCK_K"], g2["BLOCK_N"], g2["BLOCK_K"]
        build(f"{shape}_gemm1{hot}_T{tokens}", tm._moe_gemm1_kernel,
              dict(x_ptr=ptr("bf16"), w_ptr=ptr("bf16"), w_desc=f"tensordesc<bf16[1, 2, {bn1}, {bk1}]>",
                   act_ptr=ptr("bf16"), sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_xt=H, stride_xh=1, stride_we=2 * I * H, stride_wn=H,
                   stride_wk=1),
              dict(common(g1), TOPK=K, E_PAD=E), g1["num_warps"], g1["num_stages"])
        build(f"{shape}_gemm2{hot}_T{tokens}", tm._moe_gemm2_kernel,
              dict(act_ptr=ptr("bf16"), w_ptr=ptr("bf16"), w_desc=f"tensordesc<bf16[{bn2}, {bk2}]>",
                   y_ptr=ptr("bf16"), sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_we=H * I, stride_wn=I, stride_wk=1),
              dict(common(g2), E_PAD=E), g2["num_warps"], g2["num_stages"])
        if hot:
            continue
        g1, g2 = tm.pick_configs(tokens, K, E, H, I, one_launch=True)
        bn1, bk1, bn2, bk2 = g1["BLOCK_N"], g1["BLOCK_K"], g2["BLOCK_N"], g2["BLOCK_K"]
        narrow_n2 = bn2 // 2 if g2.get("NARROW_TAIL") else 0
        # As picked (64-row tiles for the experts with more than 16 rows: HEAVY_M, 2-deep pipelines),
        # with its timeline records, and with 16-row tiles only.
        heavy = g1.get("HEAVY_M", 0)
        variants = (("", False, heavy), ("_timeline", True, heavy), ("_light", False, 0))
        for suffix, timeline, heavy in variants if tm.one_launch_decode(g1, g2) else ():
            build(f"{shape}_decode_experts{suffix}_T{tokens}", tm._moe_decode_experts_kernel,
                  dict(x_ptr=ptr("bf16"), w13_ptr=ptr("bf16"), w13_desc=f"tensordesc<bf16[1, 2, {bn1}, {bk1}]>",
                       w2_ptr=ptr("bf16"), w2_desc=f"tensordesc<bf16[{bn2}, {bk2}]>",
                       w2_narrow_desc=f"tensordesc<bf16[{narrow_n2 or bn2}, {bk2}]>", act_ptr=ptr("bf16"),
                       y_ptr=ptr("bf16"), sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32"), sync_ptr=ptr("i32"),
                       timeline_ptr=ptr("i64")),
                  dict(num_local=E, H=H, I=I, num_m=1000, narrow_m=g2.get("NARROW_TAIL", 0), max_polls=1000, stride_xt=H, stride_xh=1,
                       stride_w13e=2 * I * H, stride_w13n=H, stride_w13k=1, stride_w2e=H * I, stride_w2n=I, stride_w2k=1),
                  dict(TOPK=K, E_PAD=E, BLOCK_M=g1["BLOCK_M"], SWAP_AB=True, DOT_IEEE=False, DOT_F32=False, PDL=True,
                       TIMELINE=timeline, BLOCK_N1=bn1, BLOCK_K1=bk1, STAGES1=g1["num_stages"], EVEN_K1=True, EVEN_N1=True, USE_TMA1=True,
                       BLOCK_N2=bn2, BLOCK_K2=bk2, STAGES2=g2["num_stages"], EVEN_K2=True, EVEN_N2=True, USE_TMA2=True,
                       NARROW_N2=narrow_n2, GROUP_M1=g1.get("GROUP_M", 1), GROUP_M2=g2.get("GROUP_M", 1),
                       HEAVY_M=heavy, HEAVY_STAGES1=g1.get("HEAVY_STAGES", 2), HEAVY_STAGES2=g2.get("HEAVY_STAGES", 2)),
                  g1["num_warps"], g1["num_stages"])
"""


@pytest.mark.timeout(900)
def test_gemms_compile_for_sm90_with_bf16_wgmma_in_every_regime(tmp_path):
    results = compile_for_sm90(BODY, tmp_path)
    # Two GEMMs at five token counts for two shapes (and at 512 with 128-row hot-expert tiles beside
    # the 64-row ones), and the one-launch decode kernel at 1, 2 and 128 tokens, also with its
    # timeline records and with 16-row tiles only.
    assert len(results) == 42
    for name, r in results.items():
        print(name, r["shared"], r["ptxas"].strip().splitlines()[-2:])
        assert no_spills(r["ptxas"]), (name, r["ptxas"])
        assert r["shared"] <= SHARED_BYTES, (name, r["shared"])
        assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
        if "decode_experts" in name:  # two programs per SM (pick_configs' one-launch rule)
            assert 2 * (r["shared"] + 1024) <= 228 * 1024, (name, r["shared"])
