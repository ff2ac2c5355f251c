"""Batch-invariant paged attention on a CUDA GPU: accuracy, a token's bits alone, in any batch and
in any prefill chunk, both paths and both layouts (a token decoded alone runs swapped operands,
inside a prefill not), CUDA-graph replay with longer sequences, poisoned outputs.

Run with ``pytest -m gpu``; skipped without CUDA. Fresh random inputs each run (seed printed).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from attention_test_utils import Batch  # noqa: E402
from mok_serve.kernels import attention_reference, invariant_attention  # noqa: E402
from mok_serve.kernels.cuda.attention import invariant_attention_triton  # noqa: E402
from moe_test_utils import DEV, fresh_seed, rel_err  # noqa: E402

# (query heads, KV heads, head size): Qwen3-30B-A3B, GLM-4.5-Air (12 per KV head), MHA, and MHA of
# head size 192 (DeepSeek-V3 with VLLM_MLA_DISABLE=1: two column tiles of 128 and 64 inside the kernel).
HEADS = [(32, 4, 128), (96, 8, 128), (8, 8, 64), (16, 16, 192)]


def run(b: Batch, split=None, bound=None, swap=None):
    out = torch.full_like(b.q, float("nan"))
    return invariant_attention_triton(b.q, b.k, b.v, out, b.cu_q, b.seq_lens, b.block_table, bound or b.max_seq_len,
                                      b.scale, split=split, swap=swap)


@pytest.mark.parametrize("heads,kv_heads,head", HEADS)
def test_accuracy_against_the_reference(heads, kv_heads, head):
    b = Batch.random([(1, 700), (5, 300), (70, 70), (1, 1)], heads, kv_heads, head, seed=fresh_seed(), device=DEV)
    ref = attention_reference(b.q.cpu(), b.k.cpu(), b.v.cpu(), b.cu_q.cpu(), b.seq_lens.cpu(), b.block_table.cpu(),
                              b.scale)
    for split in (False, True):
        for swap in (False, True):
            out = run(b, split=split, swap=swap)
            assert rel_err(out.cpu(), ref) <= 1e-2, (split, swap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head", HEADS)
def test_both_layouts_and_paths_give_the_same_bits(heads, kv_heads, head, dtype):
    """Operands swapped (the decode plan) or not, segments split or not: one set of bits, for
    decode and prefill rows alike."""
    b = Batch.random([(1, 700), (5, 300), (70, 70), (1, 1), (1, 64), (130, 2000)], heads, kv_heads, head,
                     seed=fresh_seed(), device=DEV, dtype=dtype)
    first = run(b, split=False, swap=False)
    assert not torch.isnan(first).any()
    for split in (False, True):
        for swap in (False, True):
            assert torch.equal(run(b, split=split, swap=swap), first), (split, swap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,kv_heads,head", HEADS)
def test_a_token_has_the_same_bits_alone_in_batches_and_in_prefill_chunks(heads, kv_heads, head, dtype):
    n = 1500
    b = Batch.random([(n, n)], heads, kv_heads, head, seed=fresh_seed(), device=DEV, dtype=dtype)
    full = run(b)
    assert not torch.isnan(full).any()
    tail = 40  # the last 40 tokens, computed every way
    for first in (n - 1, n - tail, n - 513, 0):
        part = b.subset_queries(0, first, n)
        for split in (False, True):
            got = run(part, split=split)
            assert torch.equal(got[-tail:] if got.shape[0] >= tail else got, full[-min(tail, got.shape[0]):]), (first, split)
    alone = b.subset_queries(0, n - 1, n)
    others = Batch.random([(1, 20 + 37 * i) for i in range(60)] + [(300, 900)], heads, kv_heads, head,
                          seed=fresh_seed(), device=DEV, dtype=dtype)
    mixed = Batch.concat(others, alone)
    assert torch.equal(run(mixed)[-1], full[-1])
    assert torch.equal(run(mixed, split=True)[-1], full[-1])


def test_graph_replay_with_longer_sequences_and_the_public_function():
    g = fresh_seed()
    b = Batch.random([(1, 2000), (1, 1500), (1, 20)], 32, 4, 128, seed=g, device=DEV)
    lens = b.seq_lens.clone()
    b.seq_lens.fill_(1)
    bound = 4096
    out = torch.empty_like(b.q)
    invariant_attention(b.q, b.k, b.v, out, b.cu_q, b.seq_lens, b.block_table, bound, b.scale)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        invariant_attention(b.q, b.k, b.v, out, b.cu_q, b.seq_lens, b.block_table, bound, b.scale)
    b.seq_lens.copy_(lens)
    out.fill_(float("nan"))
    graph.replay()
    assert torch.equal(out, run(b, bound=bound))
