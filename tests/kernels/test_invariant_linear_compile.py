"""The batch-invariant dense GEMM compiles for Hopper (sm_90a) without a GPU, for every tile config
``linear_plan`` gives (FP8 tiles past 64 rows and bf16 ones past 256 with their activations by TMA), with its K chunks in one program and split over programs, bf16 and
block FP8: bf16 (or FP8) wgmma only (what its bit-for-bit invariance across tiles rests on), no
register spills, shared memory within an SM's 227 KB; and with the per-call integers at 1 (Triton
passes them as constants). Same method as tests/kernels/test_triton_moe_compile.py."""

import pytest
from sm90_compile import SHARED_BYTES, compile_for_sm90, no_spills

pytest.importorskip("triton")

# (rows, N, K): every tile linear_plan gives, bf16 and FP8 (FP8 up to 512 rows: 64 x 64 where K <= 4096,
# else 64 x 128 on one or two warpgroups; 128 x 128 beyond).
POINTS = ((1, 2048, 4096), (20, 2048, 4096), (40, 2048, 4096), (100, 2048, 4096), (300, 2048, 4096),
          (300, 2048, 7168), (256, 7168, 16384), (600, 2048, 4096))

BODY = f"POINTS = {POINTS!r}\n" + r"""
from mok_serve.kernels.cuda import linear as lin
from mok_serve.kernels.cuda.configs import pick_linear_config

for fp8 in (False, True):
    a = "fp8e4nv" if fp8 else "bf16"
    for rows, n, k in POINTS:
        g, _, _ = lin.linear_plan(rows, n, k, fp8=fp8)
        for split in (False, True):
            for m in ((rows, 1) if rows == 1 else (rows,)):
                build(f"linear_{a}_rows{rows}_n{n}_k{k}_split{int(split)}", lin._linear_kernel,
                      dict(x_ptr=f"*{a}", w_ptr=f"*{a}", w_desc=f"tensordesc<{a}[{g['BLOCK_N']}, {g['BLOCK_K']}]>",
                           x_desc=f"tensordesc<{a}[{g['BLOCK_M']}, {g['BLOCK_K']}]>" if g.get("TMA_A") else f"*{a}",
                           xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32"),
                      dict(M=m, N=n, K=k, K_CHUNK=512, stride_xm=k, stride_xk=1, stride_wn=k, stride_wk=1,
                           stride_xs=k // 128, stride_ws=k // 128, stride_ym=n, stride_part=m * n),
                      dict(BLOCK_M=g["BLOCK_M"], BLOCK_N=g["BLOCK_N"], BLOCK_K=g["BLOCK_K"], GROUP_M=g["GROUP_M"],
                           STAGES=g["num_stages"], SPLIT=split, MULTI_CHUNK=True, HAS_BIAS=True, EVEN_K=True,
                           EVEN_N=True, USE_TMA=True, TMA_A=g.get("TMA_A", False), SWAP_AB=g.get("SWAP_AB", False),
                           DOT_IEEE=False, DOT_F32=False,
                           FP8=fp8, WARP_SPEC=g.get("WARP_SPEC", False), PDL=True),
                      g["num_warps"], g["num_stages"])
build("quantize_rows", lin._quantize_kernel, dict(x_ptr="*bf16", xq_ptr="*fp8e4nv", xs_ptr="*fp32"),
      dict(M=7, K=4096, stride_xm=4096, stride_xk=1), dict(QROWS=lin._QUANTIZE_ROWS, RNE_FIX=False, PDL=True), 4, 1)
# One row, one column, one chunk: every integer the constant 1.
g = pick_linear_config(1, 1, 1)
build("linear_all_ones", lin._linear_kernel,
      dict(x_ptr="*bf16", x_desc="*bf16", w_ptr="*bf16", w_desc="*bf16", xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16",
           y_ptr="*bf16", part_ptr="*fp32"),
      dict(M=1, N=1, K=1, K_CHUNK=1, stride_xm=1, stride_xk=1, stride_wn=1, stride_wk=1, stride_xs=1, stride_ws=1,
           stride_ym=1, stride_part=1),
      dict(BLOCK_M=g["BLOCK_M"], BLOCK_N=g["BLOCK_N"], BLOCK_K=g["BLOCK_K"], GROUP_M=1, STAGES=g["num_stages"],
           SPLIT=False, MULTI_CHUNK=False, HAS_BIAS=False, EVEN_K=False, EVEN_N=False, USE_TMA=False, TMA_A=False,
           SWAP_AB=True, DOT_IEEE=False, DOT_F32=False, FP8=False, WARP_SPEC=False, PDL=True), g["num_warps"], g["num_stages"])
for m, n, chunks in ((1, 1, 1), (7, 4096, 8)):
    build(f"reduce_{m}x{n}", lin._linear_reduce_kernel,
          dict(part_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16"),
          dict(M=m, N=n, NUM_CHUNKS=chunks, stride_ym=n, stride_part=m * n),
          dict(BLOCK_M=16, BLOCK_N=128, HAS_BIAS=True, RNE_FIX=False, PDL=True), 4, 1)
"""


@pytest.mark.timeout(900)
def test_linear_kernels_compile_for_sm90_with_bf16_wgmma_and_no_spills(tmp_path):
    results = compile_for_sm90(BODY, tmp_path)
    assert len(results) == 2 * 2 * len(POINTS) + 1 + 1 + 2
    for name, r in results.items():
        print(name, r["shared"], r["ptxas"].strip().splitlines()[-2:])
        assert no_spills(r["ptxas"]), (name, r["ptxas"])
        assert r["shared"] <= SHARED_BYTES, (name, r["shared"])
        if name.startswith("linear_bf16_rows"):
            assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
        if name.startswith("linear_fp8e4nv_rows"):
            assert r["fp8_wgmma"] and not r["mma_sync"], f"{name}: not (only) FP8 wgmma"
