"""The block-FP8 batch-invariant dense layer's reference (CPU): accuracy against float64 on the
dequantized operands, a row's bits alone and in any batch, argument checks, the op's CPU path."""

import pytest
import torch

from mok_serve.kernels import invariant_linear_fp8, invariant_linear_fp8_reference
from mok_serve.kernels.fp8 import quantize_fp8_blocks
from moe_test_utils import fp8_linear_float64_reference as float64_reference, fresh_seed, rel_err


def fp8_inputs(m, n, k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, generator=g) / k**0.5)
    b = torch.randn(n, generator=g).to(dtype)
    return x, wq, ws, b


@pytest.mark.parametrize("m,n,k", [(1, 128, 1024), (7, 200, 1100), (33, 384, 4096), (3, 130, 96)])
def test_accuracy_against_float64(m, n, k):
    x, wq, ws, b = fp8_inputs(m, n, k, fresh_seed())
    out = invariant_linear_fp8_reference(x, wq, ws, b)
    assert out.dtype == x.dtype and out.shape == (m, n)
    assert not torch.isnan(out).any()
    assert rel_err(out, float64_reference(x, wq, ws, b)) <= 1e-2


def test_a_row_has_the_same_bits_alone_and_in_batches():
    x, wq, ws, b = fp8_inputs(40, 256, 2048, fresh_seed())
    full = invariant_linear_fp8_reference(x, wq, ws, b)
    for lo, hi in ((0, 1), (5, 6), (3, 20), (39, 40)):
        assert torch.equal(invariant_linear_fp8_reference(x[lo:hi], wq, ws, b), full[lo:hi])


def test_the_op_runs_the_reference_on_the_cpu_with_leading_dimensions():
    x, wq, ws, b = fp8_inputs(6, 256, 512, fresh_seed())
    out = invariant_linear_fp8(x.view(2, 3, 512), wq, ws, b)
    assert out.shape == (2, 3, 256)
    assert torch.equal(out.view(6, 256), invariant_linear_fp8_reference(x, wq, ws, b))
    assert invariant_linear_fp8(x[:0], wq, ws, None).shape == (0, 256)


def test_bad_arguments_are_named():
    x, wq, ws, b = fp8_inputs(2, 256, 512, 0)
    with pytest.raises(ValueError, match="weight must be float8_e4m3fn"):
        invariant_linear_fp8(x, wq.float(), ws, b)
    with pytest.raises(ValueError, match="weight_scale must be float32 \\[2, 4\\]"):
        invariant_linear_fp8(x, wq, ws[:1], b)
    with pytest.raises(ValueError, match="x's last dimension"):
        invariant_linear_fp8(x[:, :256], wq, ws, b)
    with pytest.raises(ValueError, match="x must be bfloat16 or float16"):
        invariant_linear_fp8(x.float(), wq, ws, b)
    with pytest.raises(ValueError, match="bias must be"):
        invariant_linear_fp8(x, wq, ws, b[:3])
