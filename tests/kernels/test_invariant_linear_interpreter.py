"""The batch-invariant dense layer's Triton kernels on the CPU, under the Triton interpreter: the
reference's bits, whatever the tile config or the split of K chunks over programs."""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from mok_serve.kernels.cuda import configs  # noqa: E402
from mok_serve.kernels.cuda.linear import invariant_linear_triton, linear_plan  # noqa: E402
from mok_serve.kernels.linear import invariant_linear_reference  # noqa: E402
from moe_test_utils import rel_err  # noqa: E402


def _inputs(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


ROW_COUNTS = (1, 20, 40, 100, 300)  # one of each config pick_linear_config gives


@pytest.mark.parametrize("m,n,k", [(1, 64, 1024), (5, 100, 1100), (19, 70, 1536), (3, 130, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_tile_matches_the_reference_and_splitting_keeps_its_bits(m, n, k, dtype):
    """Each tile config, with the K chunks in one program or split over programs (same bits). The
    interpreter's numpy dots order a K block's fp32 sums by the block's shape (wgmma on the GPU
    does not), so across configs and against the torch reference the bits may differ here by a
    rounding: the GPU tests check those bits."""
    x, w, b = _inputs(m, n, k, dtype, seed=m + n + k)
    ref = invariant_linear_reference(x, w, b)
    assert rel_err(ref, x.double() @ w.double().t() + b.double()) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)
    for rows in ROW_COUNTS:
        cfg = configs.pick_linear_config(rows, n, k)
        whole = invariant_linear_triton(x, w, b, config=cfg, split=False)
        assert torch.equal(invariant_linear_triton(x, w, b, config=cfg, split=True), whole), cfg
        assert rel_err(whole, ref) <= (4e-3 if dtype == torch.bfloat16 else 1e-6), cfg


def test_rows_alone_equal_rows_in_a_batch_and_plans_follow_the_shape():
    x, w, b = _inputs(40, 64, 1024, torch.bfloat16, seed=9)
    full = invariant_linear_triton(x, w, b)
    for m in (1, 16, 17, 33):
        assert torch.equal(invariant_linear_triton(x[:m], w, b), full[:m])
    # Decode-sized calls on a narrow weight split the chunks over programs; larger ones do not.
    assert linear_plan(1, 2048, 4096)[1:] == (512, True)
    assert linear_plan(8192, 2048, 4096)[1:] == (512, False)
    assert linear_plan(1, 151936, 2048)[1:] == (2048, False)


def test_strided_rows_no_bias_and_unwritten_rows_show():
    x, w, _ = _inputs(12, 48, 640, torch.bfloat16, seed=4)
    wide = torch.full((12, 1280), float("nan"), dtype=torch.bfloat16)
    wide[:, ::2] = x
    strided = wide[:, ::2]
    out = invariant_linear_triton(strided, w, None, split=True)
    assert not torch.isnan(out).any()
    assert torch.equal(out, invariant_linear_reference(x, w))


def test_an_offset_view_reads_as_its_aligned_copy(monkeypatch):
    """A view that starts off a 16-byte boundary (or skips rows) gives the bits of the same rows
    passed contiguous: the launcher hands the kernels an aligned copy, so no alignment variant
    exists for a warm-up to miss."""
    from mok_serve.kernels.cuda import linear as lin

    launched = []

    class Spy:  # records the activation pointer each _linear_kernel launch gets
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(args[0])
                return real[grid](*args, **kwargs)
            return launch

    real = lin._linear_kernel
    monkeypatch.setattr(lin, "_linear_kernel", Spy())
    x, w, b = _inputs(9, 64, 1024, torch.bfloat16, seed=5)
    flat = torch.full((9 * 1024 + 3,), float("nan"), dtype=torch.bfloat16)
    flat[3:] = x.reshape(-1)
    offset = flat[3:].view(9, 1024)  # 6 bytes past an aligned start
    assert offset.data_ptr() % 16 != 0
    every_other = torch.stack([x, torch.full_like(x, float("nan"))], 1).reshape(18, 1024)[::2]
    want = invariant_linear_triton(x, w, b)
    assert torch.equal(invariant_linear_triton(offset, w, b), want)
    assert torch.equal(invariant_linear_triton(every_other, w, b), want)
    assert len(launched) == 3 and all(a.is_contiguous() and a.data_ptr() % 16 == 0 for a in launched)
