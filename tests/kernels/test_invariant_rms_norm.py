"""Batch-invariant RMSNorm on the CPU: the reference against float64, the torch op's shapes and
errors, and the Triton kernel under the interpreter (the reference's residual bits, its output
within a rounding, a row alone and in the batch with the same bits)."""

import pytest
import torch

from mok_serve.kernels import invariant_rms_norm, rms_norm_reference
from moe_test_utils import rel_err


def _inputs(rows, h, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, h, generator=g).to(dtype), torch.randn(rows, h, generator=g).to(dtype),
            (1 + 0.1 * torch.randn(h, generator=g)).to(dtype))

@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_reference_against_float64(dtype, tol):
    x, r, w = _inputs(9, 300, dtype, seed=1)
    y, z = rms_norm_reference(x, w, 1e-6, r)
    zd = x.double() + r.double()
    yd = zd * torch.rsqrt((zd * zd).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(z, zd) <= tol and rel_err(y, yd) <= tol
    y1, z1 = rms_norm_reference(x, None, 1e-6)
    assert z1 is None and rel_err(y1, x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6)) <= tol

def test_op_shapes_and_errors():
    x, r, w = _inputs(6, 64, torch.bfloat16, seed=2)
    y, z = invariant_rms_norm(x.view(2, 3, 64), w, 1e-5, r.view(2, 3, 64))
    assert y.shape == z.shape == (2, 3, 64)
    y, z = invariant_rms_norm(x, None, 1e-5)
    assert y.shape == (6, 64) and z.numel() == 0
    with pytest.raises(ValueError, match=r"weight must be \[H\]"):
        invariant_rms_norm(x, w[:-1], 1e-5)
    with pytest.raises(ValueError, match="residual must match x"):
        invariant_rms_norm(x, w, 1e-5, r.float())

@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU-only machines")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_under_the_interpreter(dtype, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from mok_serve.kernels.cuda.norm import invariant_rms_norm_triton

    x, r, w = _inputs(7, 200, dtype, seed=3)
    y, z = invariant_rms_norm_triton(x, w, 1e-6, r)
    ry, rz = rms_norm_reference(x, w, 1e-6, r)
    assert torch.equal(z, rz)
    assert rel_err(y, ry) <= (1e-6 if dtype == torch.float32 else 4e-3)
    # A row alone and in the batch: the same bits.
    y1, z1 = invariant_rms_norm_triton(x[3:4], w, 1e-6, r[3:4])
    assert torch.equal(y1, y[3:4]) and torch.equal(z1, z[3:4])
    y2, z2 = invariant_rms_norm_triton(x, None, 1e-6)
    assert z2.numel() == 0 and torch.equal(y2[5:6], invariant_rms_norm_triton(x[5:6], None, 1e-6)[0])


COMPILE = r"""
import json, os, subprocess, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from mok_serve.kernels.cuda import norm

out = {}
for h in (64, 2048, 4096, 7168, 16384):
    for residual in (False, True):
        block = triton.next_power_of_2(h)
        warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        sig = dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", z_ptr="*bf16", H="i32", eps="fp32",
                   stride_x="i32", stride_r="i32", stride_y="i32", stride_z="i32")
        consts = dict(BLOCK=block, HAS_RESIDUAL=residual, HAS_WEIGHT=True, RNE_FIX=False, PDL=True)
        sig.update({k: "constexpr" for k in consts})
        k = triton.compile(ASTSource(fn=norm._rms_norm_kernel, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
        path = f"{sys.argv[1]}/norm_{h}_{residual}.ptx"
        open(path, "w").write(k.asm["ptx"])
        out[f"{h}_{residual}"] = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", path, "-o", os.devnull],
                                                capture_output=True, text=True, check=True).stderr
print(json.dumps(out))
"""


@pytest.mark.timeout(600)
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run([sys.executable, "-c", COMPILE, str(tmp_path)], capture_output=True, text=True, env=env)
    if proc.returncode and "get_ptxas" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip("this Triton has no get_ptxas")
    assert proc.returncode == 0, proc.stderr[-4000:]
    logs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(logs) == 10
    for name, log in logs.items():
        assert "0 bytes spill stores, 0 bytes spill loads" in log, (name, log)
