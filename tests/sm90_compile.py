"""Compiling Triton kernels for Hopper (sm_90a) without a GPU, as the compile tests do.

``compile_for_sm90(body, tmp_path)`` runs ``body`` after ``PRELUDE`` in a subprocess (the conftest
puts Triton in interpreter mode on CPU machines, and a compile needs compiled mode): ``body`` calls
``build(name, fn, types, ints, consts, num_warps, num_stages)`` per kernel variant, which compiles
``fn`` as a launch would specialize it (an integer equal to 1 becomes a constant, pointers and
integers divisible by 16 get that hint) and records its shared memory, ``ptxas -v`` log and what
the PTX holds. Returns those records by name; skips where Triton has no ``get_ptxas``.
"""

import json
import os
import subprocess
import sys

import pytest

SHARED_BYTES = 227 * 1024  # an H100's or H200's opt-in shared memory per block (sm_90)

PRELUDE = r"""
import json, os, re, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

ptr = lambda t: "*" + t
results = {}

def build(name, fn, types, ints, consts, num_warps=4, num_stages=3):
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
                         fp8_wgmma="f32.e4m3.e4m3" in ptx, mma_sync="mma.sync" in ptx,
                         grid_dependency="griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx,
                         scalar_16bit_loads=len(re.findall(r"ld\.global[.a-z]*\.b16 ", ptx)))
"""


def compile_for_sm90(body: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    script = PRELUDE + body + "\nprint(json.dumps(results))\n"
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, env=env)
    if proc.returncode and "get_ptxas" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no get_ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def no_spills(log: str) -> bool:
    return "0 bytes spill stores, 0 bytes spill loads" in log
