"""The two-consumer block-FP8 prefill tile (kernels/cuda/linear_fp8_consumers.py, Gluon) compiles for
Hopper (sm_90a) without a GPU, for each tile the sweep offers: e4m3 wgmma, no register spills, shared
memory within an SM's 227 KB, and no wgmma serialization by ptxas (C7514, the reason for two consumer
warpgroups instead of one with two wgmma in flight). Same method as the other compile tests
(sm90_compile.py), with Gluon's AST source."""

import pytest
from sm90_compile import SHARED_BYTES, compile_for_sm90, no_spills

pytest.importorskip("triton")

BODY = r"""
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from mok_serve.kernels.cuda import linear_fp8_consumers as lc

# Ragged sizes and strides: no divisibility hints, the most general variant.
ints = dict(M=1000, N=1000, K=1000, K_CHUNK=1000, stride_xs=1000, stride_ws=1000, stride_ym=1000)
for bm, bn, stages in ((128, 128, 4), (128, 128, 5), (128, 64, 6)):
    a_layout = gl.NVMMASharedLayout.get_default_for([bm // 2, 128], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, 128], gl.float8e4nv)
    types = dict(a_desc=f"tensordesc<fp8e4nv[{bm // 2},128],{a_layout!r}>", w_desc=f"tensordesc<fp8e4nv[{bn},128],{w_layout!r}>",
                 xs_ptr="*fp32", ws_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16")
    build(f"{bm}x{bn}_s{stages}", lc._linear_fp8_consumers_kernel, types, ints,
          dict(BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, HAS_BIAS=True, num_warps=4), source=GluonASTSource)
"""


@pytest.mark.timeout(600)
def test_two_consumer_fp8_tiles_compile_for_sm90_without_spills_or_serialized_wgmma(tmp_path):
    results = compile_for_sm90(BODY, tmp_path)
    assert len(results) == 3
    for name, r in results.items():
        assert r["fp8_wgmma"], f"{name}: no e4m3 wgmma"
        assert "C7514" not in r["ptxas"], f"{name}: ptxas serializes the wgmma:\n{r['ptxas']}"
        assert no_spills(r["ptxas"]), f"{name} spills registers:\n{r['ptxas']}"
        assert r["shared"] <= SHARED_BYTES, f"{name}: {r['shared']} bytes of shared memory"
