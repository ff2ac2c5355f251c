"""The batch-invariant dense GEMM compiles for Hopper (sm_90a) without a GPU, for every tile config
``pick_linear_config`` gives, with its K chunks in one program and split over programs: bf16 wgmma
only (what its bit-for-bit invariance across tiles rests on), no register spills, shared memory
within an SM's 227 KB; and with the per-call integers at 1 (Triton passes them as constants). Same
method as tests/kernels/test_triton_moe_compile.py."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, os, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from mok_serve.kernels.cuda import linear as lin
from mok_serve.kernels.cuda.configs import pick_linear_config

results = {}

def build(name, fn, types, ints, consts, num_warps, num_stages):
    sig, attrs, consts = {}, {}, dict(consts)
    for i, a in enumerate(fn.arg_names):
        if a in consts:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
            attrs[(i,)] = [["tt.divisibility", 16]] if types[a].startswith("*") else []
        elif ints[a] == 1:
            consts[a], sig[a] = 1, "constexpr"
        else:
            sig[a] = "i32"
            if ints[a] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))
    path = f"{sys.argv[1]}/{name}.ptx"
    with open(path, "w") as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    ptx = k.asm["ptx"]
    results[name] = dict(shared=k.metadata.shared, ptxas=log, bf16_wgmma="f32.bf16.bf16" in ptx,
                         mma_sync="mma.sync" in ptx)

for rows in (1, 20, 40, 100, 300):
    n, k = 2048, 4096
    g = pick_linear_config(rows, n, k)
    for split in (False, True):
        for m in ((rows, 1) if rows == 1 else (rows,)):
            build(f"linear_rows{rows}_split{int(split)}", lin._linear_kernel,
                  dict(x_ptr="*bf16", w_ptr="*bf16", w_desc=f"tensordesc<bf16[{g['BLOCK_N']}, {g['BLOCK_K']}]>",
                       bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32"),
                  dict(M=m, N=n, K=k, K_CHUNK=512, stride_xm=k, stride_xk=1, stride_wn=k, stride_wk=1, stride_ym=n,
                       stride_part=m * n),
                  dict(BLOCK_M=g["BLOCK_M"], BLOCK_N=g["BLOCK_N"], BLOCK_K=g["BLOCK_K"], GROUP_M=g["GROUP_M"],
                       STAGES=g["num_stages"], SPLIT=split, MULTI_CHUNK=True, HAS_BIAS=True, EVEN_K=True, EVEN_N=True,
                       USE_TMA=True, SWAP_AB=g.get("SWAP_AB", False), DOT_IEEE=False, DOT_F32=False, PDL=True),
                  g["num_warps"], g["num_stages"])
# One row, one column, one chunk: every integer the constant 1.
g = pick_linear_config(1, 1, 1)
build("linear_all_ones", lin._linear_kernel,
      dict(x_ptr="*bf16", w_ptr="*bf16", w_desc="*bf16", bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32"),
      dict(M=1, N=1, K=1, K_CHUNK=1, stride_xm=1, stride_xk=1, stride_wn=1, stride_wk=1, stride_ym=1, stride_part=1),
      dict(BLOCK_M=g["BLOCK_M"], BLOCK_N=g["BLOCK_N"], BLOCK_K=g["BLOCK_K"], GROUP_M=1, STAGES=g["num_stages"],
           SPLIT=False, MULTI_CHUNK=False, HAS_BIAS=False, EVEN_K=False, EVEN_N=False, USE_TMA=False,
           SWAP_AB=True, DOT_IEEE=False, DOT_F32=False, PDL=True), g["num_warps"], g["num_stages"])
for m, n, chunks in ((1, 1, 1), (7, 4096, 8)):
    build(f"reduce_{m}x{n}", lin._linear_reduce_kernel,
          dict(part_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16"),
          dict(M=m, N=n, NUM_CHUNKS=chunks, stride_ym=n, stride_part=m * n),
          dict(BLOCK_M=16, BLOCK_N=128, HAS_BIAS=True, RNE_FIX=False, PDL=True), 4, 1)
print(json.dumps(results))
"""


@pytest.mark.timeout(900)
def test_linear_kernels_compile_for_sm90_with_bf16_wgmma_and_no_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    if proc.returncode and "get_ptxas" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no get_ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 10 + 1 + 2
    for name, r in results.items():
        print(name, r["shared"], r["ptxas"].strip().splitlines()[-2:])
        assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], (name, r["ptxas"])
        assert r["shared"] <= 227 * 1024, (name, r["shared"])
        if name.startswith("linear_rows"):
            assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
