"""The invariant kernels' first-call warm-up on a CUDA GPU: after ``warm_up_linear`` and
``warm_up_attention``, calls of every size the warm-up covers compile nothing (Triton's per-kernel
cache of compiled variants stays as it was), so a deterministic server never stalls for a compile.

Run with ``pytest -m gpu``; skipped without CUDA.
"""

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from attention_test_utils import Batch  # noqa: E402
from mok_serve.kernels import (  # noqa: E402
    invariant_attention,
    invariant_linear,
    invariant_linear_fp8,
    warm_up_attention,
    warm_up_linear,
)
from mok_serve.kernels.cuda import attention as cuda_attention  # noqa: E402
from mok_serve.kernels.cuda import linear as cuda_linear  # noqa: E402
from mok_serve.kernels.fp8 import quantize_fp8_blocks  # noqa: E402
from moe_test_utils import DEV, fresh_seed  # noqa: E402


def compiled(*kernels) -> int:
    """Variants compiled so far of these Triton kernels, on every device."""
    return sum(len(cache[0]) for kernel in kernels for cache in kernel.device_caches.values())


@pytest.mark.parametrize("fp8", [False, True])
def test_no_linear_call_compiles_after_its_warm_up(fp8):
    # A weight shape no other test uses, so its variants are compiled here first.
    n, k, max_rows = 1088, 1408, 1200
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w = torch.randn((n, k), generator=g, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn((n,), generator=g, device=DEV, dtype=torch.bfloat16)
    scale = None
    if fp8:
        w, scale = quantize_fp8_blocks(w)
    kernels = (cuda_linear._linear_kernel, cuda_linear._linear_reduce_kernel, cuda_linear._quantize_kernel)
    for b in (None, bias):
        rows = warm_up_linear(bias[:1], w, b, max_rows, weight_scale=scale)
        assert rows[0] == 1 and rows == sorted(rows) and len(rows) >= 4
        before = compiled(*kernels)
        for m in sorted({*range(1, 70), *range(250, 270), *range(1, max_rows + 1, 37), max_rows}):
            x = torch.randn((m, k), generator=g, device=DEV, dtype=torch.bfloat16)
            invariant_linear(x, w, b) if scale is None else invariant_linear_fp8(x, w, scale, b)
        torch.cuda.synchronize()
        assert compiled(*kernels) == before, b is None


def vllm_table(b: Batch, width: int = 256) -> Batch:
    """``b`` with its block table as wide as vLLM's (one width for every call: its row stride is
    an argument Triton specializes)."""
    table = torch.zeros((b.block_table.shape[0], width), dtype=b.block_table.dtype, device=b.block_table.device)
    table[:, : b.block_table.shape[1]] = b.block_table
    return dataclasses.replace(b, block_table=table)


def test_no_attention_call_compiles_after_its_warm_up():
    # Heads and head size no other test uses.
    heads, kv_heads, head = 24, 2, 96
    seed = fresh_seed()
    kernels = (cuda_attention._attention_kernel, cuda_attention._attention_merge_kernel)
    first = vllm_table(Batch.random([(1, 40)], heads, kv_heads, head, seed=seed, device=DEV))
    bound = 4096
    out = torch.empty_like(first.q)
    paths = warm_up_attention(first.q, first.k, first.v, out, first.cu_q, first.seq_lens, first.block_table, bound,
                              first.scale)
    assert sorted(paths) == [(False, False), (False, True), (True, False), (True, True)]
    before = compiled(*kernels)
    # A decode step alone and of 60 sequences, a short and a long prefill, a mixed batch: every plan.
    for seqs in ([(1, 300)], [(1, 50 + i) for i in range(60)], [(17, 17)], [(1500, 1500)],
                 [(1, 900), (200, 700), (1, 5)]):
        b = vllm_table(Batch.random(seqs, heads, kv_heads, head, seed=seed, device=DEV))
        invariant_attention(b.q, b.k, b.v, torch.empty_like(b.q), b.cu_q, b.seq_lens, b.block_table, bound, b.scale)
    torch.cuda.synchronize()
    assert compiled(*kernels) == before
