"""Batch-invariant RMSNorm on a CUDA GPU: accuracy, and a row's bits at every row count (across
256 rows, where vLLM's CUDA add-norm changes its block width), with and without a residual.

Run with ``pytest -m gpu``; skipped without CUDA. Fresh random inputs each run (seed printed).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from mok_serve.kernels import invariant_rms_norm  # noqa: E402
from moe_test_utils import DEV, fresh_seed, rel_err  # noqa: E402


@pytest.mark.parametrize("h", [128, 2048, 4096, 7168])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_accuracy_and_a_rows_bits_at_every_row_count(h, dtype):
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    n = 1000
    x = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    r = torch.randn(n, h, device=DEV, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).to(dtype)
    y, z = invariant_rms_norm(x, w, 1e-6, r)
    zd = x.double() + r.double()
    yd = zd * torch.rsqrt((zd * zd).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert rel_err(y, yd) <= (1e-5 if dtype == torch.float32 else 1e-2)
    for m in (1, 7, 255, 256, 257, 999):
        ym, zm = invariant_rms_norm(x[n - m :], w, 1e-6, r[n - m :])
        assert torch.equal(ym, y[n - m :]) and torch.equal(zm, z[n - m :]), m
        assert torch.equal(invariant_rms_norm(x[n - m :], None, 1e-6)[0], invariant_rms_norm(x, None, 1e-6)[0][n - m :])


def test_per_head_rows_of_a_fused_qkv_output_read_in_place():
    """Qwen3-30B-A3B's q/k norms: heads of a qkv slice (token stride 5120) give the bits of a
    contiguous copy, a token's bits alone and in the batch, and the qkv output stays unwritten."""
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    tokens, d = 3000, 128
    qkv = torch.randn(tokens, 5120, device=DEV, generator=g).to(torch.bfloat16)
    before = qkv.clone()
    w = (1 + 0.1 * torch.randn(d, device=DEV, generator=g)).to(torch.bfloat16)
    q, k, _ = qkv.split([4096, 512, 512], dim=-1)
    for part, heads in ((q, 32), (k, 4)):
        by_head = part.view(tokens, heads, d)
        y = invariant_rms_norm(by_head, w, 1e-6)[0]
        assert torch.equal(y, invariant_rms_norm(by_head.contiguous(), w, 1e-6)[0])
        for m in (1, 255, 257):
            assert torch.equal(invariant_rms_norm(by_head[tokens - m :], w, 1e-6)[0], y[tokens - m :]), m
    assert torch.equal(qkv, before)
