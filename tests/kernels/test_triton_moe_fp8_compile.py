"""The FP8 Triton kernels compile for Hopper (sm_90a) without a GPU: fp8 wgmma, no register spills.

Compiled as a launch would specialize them (16-byte aligned pointers, ints divisible by 16 marked,
unit strides constant) with the block sizes ``pick_configs_fp8`` chooses for DeepSeek-V3 in each
regime (swapped 16-row tiles with 64-row hot-expert ones at 1 and 512 tokens, 64-row tiles at 1024,
128-row ones at 4096; and the sweep's 64-row and half-tail GEMM2 tiles there, its 128-row hot-expert
tiles at 1024; at 1 token GEMM1 at
other widths and both GEMMs as one launch), then
``ptxas -v`` reports registers and spills. Runs in a subprocess because the tests' conftest puts
Triton into interpreter mode on CPU-only machines. The GPU machine's Triton (3.6) may compile
differently from the one here; this catches type errors, spills and lost wgmma early.
"""

import pytest
from sm90_compile import SHARED_BYTES, compile_for_sm90, no_spills

pytest.importorskip("triton")

BODY = r"""
from mok_serve.kernels.cuda import moe_fp8 as tf

H, I, E, K = 7168, 2048, 256, 8
HEAVY = dict(HEAVY_M=64, HEAVY_STAGES=4)
HEAVY128 = dict(HEAVY_M=128, HEAVY_STAGES=3)  # the sweep's 128-row hot-expert tiles in the 64-row regime
for tokens in (1, 512, 1024, 4096):
    g1, g2 = tf.pick_configs_fp8(tokens, K, E, H, I)
    # As picked (at 1 token 64-column programs, two per activation group), there also with 128 and 32,
    # and with the sweep's hot-expert tiles (64 rows, 4 stages, beside the 16-row ones).
    bn = g1.get("BLOCK_N", 128)
    picked = {k: g1[k] for k in ("HEAVY_M", "HEAVY_STAGES") if k in g1}
    more1 = {1: (("_n128", 128, {}), ("_n32", 32, {}), ("_heavy64", bn, HEAVY)),
             1024: (("_heavy128_n64", 64, HEAVY128),)}
    for suffix, bn, heavy in (("", bn, picked),) + more1.get(tokens, ()):
        build(f"gemm1{suffix}_T{tokens}", tf._fp8_gemm1_kernel,
              dict(xq_ptr=ptr("fp8e4nv"), xs_ptr=ptr("fp32"), w_ptr=ptr("fp8e4nv"), ws_ptr=ptr("fp32"),
                   actq_ptr=ptr("fp8e4nv"), acts_ptr=ptr("fp32"), acth_ptr=ptr("bf16"), ticket_ptr=ptr("i32"),
                   sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_we=2 * I * H, stride_wn=H, stride_wk=1,
                   stride_se=32 * 56, stride_sn=56, stride_sk=1),
              dict(IN_DTYPE=tl.bfloat16, TOPK=K, E_PAD=E, SCALE_BN=128, BLOCK_M=g1["BLOCK_M"], BLOCK_N=bn,
                   EVEN_K=True, EVEN_N=True, GROUP_M=g1["GROUP_M"], SWAP_AB=g1.get("SWAP_AB", False), RNE_FIX=False,
                   PDL=True, **{"HEAVY_M": 0, "HEAVY_STAGES": None, **heavy}),
              g1["num_warps"], g1["num_stages"])
    # As picked; at 4096 tokens also the sweep's 64-row, 4-warp GEMM2 tile (vLLM's block-FP8 tile)
    # and half-height last tiles; at 1024 the sweep's 128-row hot-expert tiles (64 columns, or 128 on 8 warps).
    more = {4096: (("_m64", dict(g2, BLOCK_M=64, num_warps=4, num_stages=4)), ("_half", dict(g2, HALF_TAIL=True))),
            1: (("_heavy64", dict(g2, **HEAVY)),),
            1024: (("_heavy128_n64", dict(g2, BLOCK_N=64, **HEAVY128)), ("_heavy128_w8", dict(g2, num_warps=8, **HEAVY128)))}
    for suffix, c2 in (("", g2),) + more.get(tokens, ()):
        build(f"gemm2{suffix}_T{tokens}", tf._fp8_gemm2_kernel,
              dict(actq_ptr=ptr("fp8e4nv"), acts_ptr=ptr("fp32"), w_ptr=ptr("fp8e4nv"), ws_ptr=ptr("fp32"),
                   w_desc=f"tensordesc<fp8e4nv[{c2['BLOCK_N']}, 128]>", y_ptr=ptr("bf16"),
                   sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_we=H * I, stride_wn=I, stride_wk=1,
                   stride_se=56 * 16, stride_sn=16, stride_sk=1),
              dict(E_PAD=E, SCALE_BN=128, BLOCK_M=c2["BLOCK_M"], BLOCK_N=c2["BLOCK_N"], EVEN_K=True, EVEN_N=True,
                   USE_TMA=True, GROUP_M=c2["GROUP_M"], SWAP_AB=c2.get("SWAP_AB", False), RNE_FIX=False, PDL=True,
                   HALF_TAIL=c2.get("HALF_TAIL", False), HEAVY_M=c2.get("HEAVY_M", 0),
                   HEAVY_STAGES=c2.get("HEAVY_STAGES")),
              c2["num_warps"], c2["num_stages"])
# Both GEMMs in one launch (the sweep's "one launch" at 1 token: GEMM1 in 64-column programs).
g1, g2 = tf.pick_configs_fp8(1, K, E, H, I)
build("decode_one_launch_T1", tf._fp8_decode_experts_kernel,
      dict(xq_ptr=ptr("fp8e4nv"), xs_ptr=ptr("fp32"), w13_ptr=ptr("fp8e4nv"), w13s_ptr=ptr("fp32"),
           actq_ptr=ptr("fp8e4nv"), acts_ptr=ptr("fp32"), acth_ptr=ptr("bf16"), ticket_ptr=ptr("i32"),
           sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32"), w2_ptr=ptr("fp8e4nv"),
           w2_desc=f"tensordesc<fp8e4nv[{g2['BLOCK_N']}, 128]>", w2s_ptr=ptr("fp32"), y_ptr=ptr("bf16"),
           sync_ptr=ptr("i32")),
      dict(num_local=E, H=H, I=I, num_m=1000, max_polls=1 << 22,
           stride_w13e=2 * I * H, stride_w13n=H, stride_w13k=1, stride_s13e=32 * 56, stride_s13n=56, stride_s13k=1,
           stride_w2e=H * I, stride_w2n=I, stride_w2k=1, stride_s2e=56 * 16, stride_s2n=16, stride_s2k=1),
      dict(IN_DTYPE=tl.bfloat16, TOPK=K, E_PAD=E, SCALE_BN=128, BLOCK_M=g1["BLOCK_M"], BLOCK_N1=g1["BLOCK_N"],
           EVEN_K1=True, EVEN_N1=True, GROUP_M1=1, BLOCK_N2=g2["BLOCK_N"], EVEN_K2=True, EVEN_N2=True, GROUP_M2=1,
           USE_TMA2=True, SWAP_AB=True, RNE_FIX=False, PDL=True),
      g1["num_warps"], g1["num_stages"])
build("schedule_quantize", tf._fp8_schedule_quantize_kernel,
      dict(topk_ids_ptr=ptr("i32"), expert_map_ptr=ptr("i32"), counts_ptr=ptr("i32"), sorted_rows_ptr=ptr("i32"),
           report_ptr=ptr("i64"), x_ptr=ptr("bf16"), xq_ptr=ptr("fp8e4nv"), xs_ptr=ptr("fp32"), ticket_ptr=ptr("i32")),
      dict(num_rows=8 * 4096, num_global=E, num_local=E, stride_it=K, stride_ik=1, tokens=4096, H=H,
           stride_xt=H, stride_xh=1, num_tickets=1000),
      dict(TOPK=K, HAS_MAP=True, BLOCK=4096, QROWS=32, RNE_FIX=False, PDL=True), 8, 1)
"""


@pytest.mark.timeout(600)
def test_kernels_compile_for_sm90_with_fp8_wgmma_and_no_spills(tmp_path):
    results = compile_for_sm90(BODY, tmp_path)
    for name, r in results.items():
        print(name, r["shared"], r["ptxas"].strip().splitlines()[-2:])
        assert no_spills(r["ptxas"]), (name, r["ptxas"])
        assert r["shared"] <= SHARED_BYTES, (name, r["shared"])
        assert r["grid_dependency"], f"{name}: no programmatic dependent launch instructions"
        if name.startswith(("gemm", "decode")):
            assert r["fp8_wgmma"], f"{name} does not use fp8 wgmma"
