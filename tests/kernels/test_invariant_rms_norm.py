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


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test: CPU-only machines")
def test_triton_kernel_reads_per_head_rows_in_place_under_the_interpreter(monkeypatch):
    """Qwen3's q/k norms normalize the heads of a slice of the fused qkv output ([tokens, heads, 128]
    viewed with the qkv width as token stride): the same bits as on a contiguous copy, nothing
    written outside the output, and leading dimensions that cannot merge into one still work."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from mok_serve.kernels.cuda.norm import invariant_rms_norm_triton

    g = torch.Generator().manual_seed(5)
    tokens, q_heads, kv_heads, d = 5, 4, 2, 16
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * d, generator=g).to(torch.bfloat16)
    before = qkv.clone()
    w = (1 + 0.1 * torch.randn(d, generator=g)).to(torch.bfloat16)
    q, k, _ = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    for part, heads in ((q, q_heads), (k, kv_heads)):
        by_head = part.view(tokens, heads, d)
        assert not by_head.is_contiguous()
        y, z = invariant_rms_norm_triton(by_head, w, 1e-6)
        assert y.shape == by_head.shape and z.numel() == 0
        assert torch.equal(y, invariant_rms_norm_triton(by_head.contiguous(), w, 1e-6)[0])
        assert rel_err(y, rms_norm_reference(by_head, w, 1e-6)[0]) <= 4e-3
    assert torch.equal(qkv, before)
    unmergeable = torch.randn(3, 4, 2, d, generator=g).to(torch.bfloat16).transpose(0, 1)  # [4, 3, 2, d]
    y, _ = invariant_rms_norm_triton(unmergeable, w, 1e-6)
    assert torch.equal(y, invariant_rms_norm_triton(unmergeable.contiguous(), w, 1e-6)[0])


def test_rows_reach_the_kernel_without_copies_and_with_a_fixed_head_count():
    """The kernel's ``heads`` is specialized by Triton, so it must be 1 or a layer's head count, never
    a per-call size; views the kernel can read go in uncopied."""
    pytest.importorskip("triton")
    from mok_serve.kernels.cuda.norm import _token_head_view

    qkv = torch.randn(7, 8 * 16)
    q_by_head = qkv[:, : 4 * 16].view(7, 4, 16)
    assert _token_head_view(q_by_head).shape == (7, 4, 16)
    assert _token_head_view(q_by_head).data_ptr() == qkv.data_ptr()
    for contiguous in (torch.randn(3, 5, 16), torch.randn(15, 16)):
        assert _token_head_view(contiguous).shape == (15, 1, 16)
    columns = qkv[:, 16:32]  # rows of a wider row, two-dimensional: strided rows, one head each
    assert _token_head_view(columns).shape == (7, 1, 16) and _token_head_view(columns).data_ptr() == columns.data_ptr()
    assert _token_head_view(qkv.t().contiguous().t()[:, :16]).is_contiguous()  # column-major: copied


COMPILE = r"""
from mok_serve.kernels.cuda import norm

for h in (64, 128, 2048, 4096, 7168, 16384):
    for residual in (False, True):
        block = triton.next_power_of_2(h)
        build(f"norm_{h}_{residual}", norm._rms_norm_kernel,
              dict(x_ptr="*bf16", r_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", z_ptr="*bf16", n_rows="i32", eps="fp32"),
              dict(H=h, heads=32 if h == 128 else 1, stride_x=5120 if h == 128 else h, stride_xh=h, stride_r=h,
                   stride_y=h, stride_z=h),
              dict(ROWS=norm.rows_per_program(h), BLOCK=block, HAS_RESIDUAL=residual, HAS_WEIGHT=True, RNE_FIX=False,
                   PDL=True),
              4 if block <= 1024 else 8 if block <= 4096 else 16, 1)
"""


@pytest.mark.timeout(600)
def test_kernel_compiles_for_sm90_without_spills(tmp_path):
    from sm90_compile import compile_for_sm90, no_spills

    results = compile_for_sm90(COMPILE, tmp_path)
    assert len(results) == 12
    for name, r in results.items():
        assert no_spills(r["ptxas"]), (name, r["ptxas"])
