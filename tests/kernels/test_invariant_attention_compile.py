"""Batch-invariant paged attention's kernels compile for Hopper (sm_90a) without a GPU, on both
paths and for the head groups of the served shapes, without register spills; and with every
per-call integer at 1 (Triton passes those as constants). Same method as
tests/kernels/test_triton_moe_compile.py."""

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
from mok_serve.kernels.cuda import attention as att
from mok_serve.kernels.attention import SEGMENT, TILE

results = {}

def build(name, fn, types, ints, consts):
    sig, consts = {}, dict(consts)
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
        elif ints[a] == 1:
            consts[a], sig[a] = 1, "constexpr"
        else:
            sig[a] = "i32"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4, num_stages=2))
    path = f"{sys.argv[1]}/{name}.ptx"
    with open(path, "w") as f:
        f.write(k.asm["ptx"])
    log = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.devnull],
                         capture_output=True, text=True, check=True).stderr
    results[name] = dict(shared=k.metadata.shared, ptxas=log)

ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", out_ptr="*bf16", cu_q_ptr="*i32", seq_lens_ptr="*i32",
            bt_ptr="*i32", part_ptr="*fp32", ml_ptr="*fp32", scale="fp32")
for group, head in ((8, 128), (12, 128), (1, 64)):
    for window in (False, True):
        for split in (False, True):
            for ones in (False, True):
                n = 1 if ones else 7
                ints = dict(num_seqs=n, window=n, max_segs=n, stride_qt=n, stride_qh=n, stride_ot=n, stride_oh=n,
                            stride_bt=n, stride_kb=n, stride_ks=n, stride_kh=n, stride_vb=n, stride_vs=n, stride_vh=n)
                consts = dict(GROUP=group, BLOCK_Q=att.BLOCK_M // triton.next_power_of_2(group), BLOCK_M=att.BLOCK_M,
                              HEAD=head, HEAD_PAD=head, SEG=SEGMENT, HAS_WINDOW=window)
                build(f"attn_g{group}_w{int(window)}_s{int(split)}_o{int(ones)}", att._attention_kernel, ptrs, ints,
                      dict(consts, PAGE=16, TILE_K=TILE, SPLIT=split, DOT_F32=False, PDL=True))
                if split:
                    build(f"merge_g{group}_w{int(window)}_o{int(ones)}", att._attention_merge_kernel, ptrs,
                          {k: ints[k] for k in ("num_seqs", "window", "max_segs", "stride_ot", "stride_oh")},
                          dict(consts, PDL=True))
print(json.dumps(results))
"""


@pytest.mark.timeout(900)
def test_attention_kernels_compile_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env)
    if proc.returncode and "get_ptxas" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no get_ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 3 * 2 * 2 * 2 + 3 * 2 * 2
    for name, r in results.items():
        assert "0 bytes spill stores, 0 bytes spill loads" in r["ptxas"], (name, r["ptxas"])
