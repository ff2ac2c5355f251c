"""The bf16 Triton GEMMs compile for Hopper (sm_90a) without a GPU, in every regime of
``pick_configs`` (at decode sizes also as the one-launch kernel of both): bf16 wgmma (what batch
invariance rests on: the same instruction whether the token rows or, swapped at decode sizes, the
weight columns are its M side), no register spills, shared memory within an SM's 227 KB (the
one-launch kernel within half of it). Same method as tests/kernels/test_triton_moe_fp8_compile.py: compiled as a
launch would specialize them, in a subprocess (the conftest puts Triton in interpreter mode on CPU
machines), registers and spills from ``ptxas -v``.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, os, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from mok_serve.kernels.cuda import moe as tm

ptr = lambda t: "*" + t
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

def common(g):
    keys = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "USE_TMA")
    return dict({k: g[k] for k in keys}, GROUP_M=g.get("GROUP_M", 1), HALF_TAIL=g.get("HALF_TAIL", False),
                SWAP_AB=g.get("SWAP_AB", False), DOT_IEEE=False, DOT_F32=False, EVEN_K=True, EVEN_N=True, PDL=True)

# (name, hidden, inter, experts, top_k): DeepSeek-V3 and Qwen3-30B-A3B, whose column tiles differ at decode.
for shape, H, I, E, K in (("ds", 7168, 2048, 256, 8), ("qwen30", 2048, 768, 128, 8)):
    for tokens in (1, 2, 128, 512, 8192):
        g1, g2 = tm.pick_configs(tokens, K, E, H, I)
        bn1, bk1, bn2, bk2 = g1["BLOCK_N"], g1["BLOCK_K"], g2["BLOCK_N"], g2["BLOCK_K"]
        build(f"{shape}_gemm1_T{tokens}", tm._moe_gemm1_kernel,
              dict(x_ptr=ptr("bf16"), w_ptr=ptr("bf16"), w_desc=f"tensordesc<bf16[1, 2, {bn1}, {bk1}]>",
                   act_ptr=ptr("bf16"), sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_xt=H, stride_xh=1, stride_we=2 * I * H, stride_wn=H,
                   stride_wk=1),
              dict(common(g1), TOPK=K, E_PAD=E), g1["num_warps"], g1["num_stages"])
        build(f"{shape}_gemm2_T{tokens}", tm._moe_gemm2_kernel,
              dict(act_ptr=ptr("bf16"), w_ptr=ptr("bf16"), w_desc=f"tensordesc<bf16[{bn2}, {bk2}]>",
                   y_ptr=ptr("bf16"), sorted_rows_ptr=ptr("i32"), counts_ptr=ptr("i32")),
              dict(num_local=E, H=H, I=I, num_m=1000, stride_we=H * I, stride_wn=I, stride_wk=1),
              dict(common(g2), E_PAD=E), g2["num_warps"], g2["num_stages"])
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
print(json.dumps(results))
"""


@pytest.mark.timeout(900)
def test_gemms_compile_for_sm90_with_bf16_wgmma_in_every_regime(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    if proc.returncode and "get_ptxas" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no get_ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    # Two GEMMs at five token counts for two shapes, and the one-launch decode kernel at 1, 2 and 128 tokens,
    # also with its timeline records and with 16-row tiles only.
    assert len(results) == 38
    for name, r in results.items():
        print(name, r["shared"], r["ptxas"].strip().splitlines()[-2:])
        assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], (name, r["ptxas"])
        assert r["shared"] <= 227 * 1024, (name, r["shared"])
        assert r["bf16_wgmma"] and not r["mma_sync"], f"{name}: not (only) bf16 wgmma"
        if "decode_experts" in name:  # two programs per SM (pick_configs' one-launch rule)
            assert 2 * (r["shared"] + 1024) <= 228 * 1024, (name, r["shared"])
