"""Kernels that take per-call integers compile for Hopper (sm_90a) without a GPU whatever values
those integers have, 0 and 1 included: Triton passes an integer argument equal to 1 as a constant
(a Python int, which has no ``.to``), and a launch in a real server met exactly that (the timer
kernel at one token). Compiled in a subprocess, as tests/kernels/test_triton_moe_compile.py does (the
conftest puts Triton in interpreter mode on CPU machines)."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mok_serve.kernels.cuda import moe as tm
from mok_serve.kernels.cuda import timer
from mok_serve.vllm import timing

def build(fn, types, ints, consts):
    # Every integer in `ints` as a launch may pass it: 1 as a constant (even where the kernel asks
    # Triton not to specialize it), anything else as an i32 or i64.
    sig, consts = {}, dict(consts)
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in types:
            sig[a] = types[a]
        elif ints[a] == 1:
            consts[a], sig[a] = 1, "constexpr"
        else:
            sig[a] = "i64" if abs(ints[a]) >= 2**31 else "i32"
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32))

built = []
for tokens in (0, 1, 7, 2**40):
    for point in range(4):
        build(timer._moe_timer_kernel, dict(buf_ptr="*i64", bounds_ptr="*i64"),
              dict(point=point, tokens=tokens, sample_every=1, window=1, host_ts=2**40 if tokens else 1),
              dict(RING=8, HIST=16, SUMS=80, NB=timing.NB, NBP=timing.NBP, USE_GLOBALTIMER=True))
        built.append(f"timer point={point} tokens={tokens}")
for ids in ("i32", "i64"):
    for has_map in (False, True):
        for n in (1, 3):  # one row, one expert: every count argument arrives as the constant 1
            build(tm.moe_schedule_kernel,
                  dict(topk_ids_ptr="*" + ids, expert_map_ptr="*i32", counts_ptr="*i32", sorted_rows_ptr="*i32",
                       report_ptr="*i64"),
                  dict(num_rows=n, num_global=n, num_local=n, stride_it=n, stride_ik=1),
                  dict(TOPK=1, HAS_MAP=has_map, BLOCK=256, PDL=True))
            built.append(f"schedule ids={ids} map={has_map} n={n}")
print(json.dumps(built))
"""


@pytest.mark.timeout(600)
def test_timer_and_schedule_kernels_compile_for_any_integer_values(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert len(json.loads(proc.stdout.strip().splitlines()[-1])) == 16 + 8
