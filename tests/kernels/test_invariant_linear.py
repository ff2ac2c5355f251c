"""The batch-invariant dense layer's semantics on the CPU: the torch reference against float64, its
row independence, the K chunks, argument errors and the torch op."""

import pytest
import torch

from mok_serve.kernels import invariant_linear, invariant_linear_reference
from mok_serve.kernels.linear import K_CHUNK_ALIGN, k_chunk
from moe_test_utils import rel_err

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _inputs(m, n, k, dtype, seed, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 64, 1024), (9, 130, 2100), (40, 7, 96), (3, 300, 4096)])
def test_reference_matches_float64(dtype, m, n, k):
    x, w, b = _inputs(m, n, k, dtype, seed=m * 31 + n)
    out = invariant_linear_reference(x, w, b)
    ref = x.double() @ w.double().t() + b.double()
    assert out.dtype == dtype and out.shape == (m, n)
    assert rel_err(out, ref) <= TOL[dtype]


def test_reference_rows_do_not_depend_on_the_batch():
    x, w, b = _inputs(70, 96, 2048, torch.bfloat16, seed=5)
    full = invariant_linear_reference(x, w, b)
    for m in (1, 2, 7, 8, 9, 33, 69):
        assert torch.equal(invariant_linear_reference(x[:m], w, b), full[:m])
    for i in (0, 13, 69):
        assert torch.equal(invariant_linear_reference(x[i : i + 1], w, b), full[i : i + 1])


def test_k_chunks_depend_on_the_weight_shape_only():
    # A narrow weight with a long K is read in chunks, a wide one (or a short K) in one.
    assert k_chunk(2048, 4096) == 512       # Qwen3-30B-A3B o_proj: 32 column tiles x 8 chunks
    assert k_chunk(4096, 12288) == 3072     # GLM-4.5-Air o_proj: 64 x 4
    assert k_chunk(5120, 2048) == 1024      # Qwen3-30B-A3B qkv_proj: 80 x 2
    assert k_chunk(151936, 2048) == 2048    # LM head: one chunk
    assert k_chunk(64, 300) == 300
    for n in (1, 7, 64, 100, 1000, 4096, 20000):
        for k in (1, 127, 128, 513, 1024, 1100, 4096, 7168, 18432):
            c = k_chunk(n, k)
            assert 1 <= c <= k
            assert c == k or (c % K_CHUNK_ALIGN == 0 and c >= 512)
    with pytest.raises(ValueError, match="non-empty"):
        k_chunk(0, 10)


def test_the_op_on_cpu_and_its_shapes():
    x, w, b = _inputs(6, 40, 700, torch.bfloat16, seed=2)
    x3 = x.view(2, 3, 700)
    out = invariant_linear(x3, w, b)
    assert out.shape == (2, 3, 40)
    assert torch.equal(out.view(6, 40), invariant_linear_reference(x, w, b))
    assert invariant_linear(x[:0], w).shape == (0, 40)
    empty_k = invariant_linear(torch.zeros(4, 0), torch.zeros(5, 0), torch.arange(5.0))
    assert torch.equal(empty_k, torch.arange(5.0).expand(4, 5))
    # Under torch.compile's fake tensors the op has the right output shape.
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x3)
        fw = mode.from_tensor(w)
        assert torch.ops.mok_serve.invariant_linear(fx, fw, None).shape == (2, 3, 40)


@pytest.mark.parametrize("bad,match", [
    (lambda x, w, b: (x, w.t(), b), "last dimension"),
    (lambda x, w, b: (x, w[None], b), r"weight must be \[N, K\]"),
    (lambda x, w, b: (x, w.float(), b), "weight dtype"),
    (lambda x, w, b: (x.int(), w, b), "bfloat16, float16 or float32"),
    (lambda x, w, b: (x, w, b[:-1]), r"bias must be \[N\]"),
])
def test_bad_arguments_are_named(bad, match):
    x, w, b = _inputs(3, 16, 32, torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match=match):
        invariant_linear(*bad(x, w, b))
