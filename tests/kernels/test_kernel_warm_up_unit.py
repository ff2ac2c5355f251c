"""kernels.warm_up's choice of token counts: one call per compiled kernel variant (CPU, no kernel runs)."""

import pytest
import torch

pytest.importorskip("triton")

from mok_serve.kernels import warm_up, warm_up_token_counts  # noqa: E402
from mok_serve.kernels.cuda.configs import kernel_variants, kernel_variants_fp8  # noqa: E402

QWEN3_30B = dict(num_local=128, hidden=2048, inter=768, top_k=8)


def test_qwen3_30b_counts_and_why():
    # 1 token: its experts' last GEMM2 items half-width; 2: two tokens' experts, wide GEMM2 tiles;
    # 3: more experts busy, narrower GEMM2 tiles; 33: the schedule's block (> 256 rows); 129: weight
    # streaming (> 8 rows per expert); 257: the schedule's widest block (> 2048 rows); 769: 128-row
    # tiles (> 48 rows per expert); 2561: 3 pipeline stages (> 160 rows per expert).
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=8192) == [1, 2, 3, 33, 129, 257, 769, 2561]
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=8192, fp8=True) == [1, 3, 33, 193, 257, 769]
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=512) == [1, 2, 3, 33, 129, 257]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", [QWEN3_30B, dict(num_local=256, hidden=7168, inter=2048, top_k=8),
                                   dict(num_local=64, hidden=256, inter=128, top_k=4)])
def test_every_token_count_shares_the_variant_of_a_warmed_count(shape, fp8):
    variants = kernel_variants_fp8 if fp8 else kernel_variants
    args = (shape["top_k"], shape["num_local"], shape["hidden"], shape["inter"])
    counts = warm_up_token_counts(**shape, max_tokens=4096, fp8=fp8)
    assert counts[0] == 1 and counts == sorted(counts)
    for c in counts[1:]:  # each count starts a new variant...
        assert variants(c - 1, *args) != variants(c, *args)
    warmed = {variants(c, *args) for c in counts}
    assert len(warmed) == len(counts)  # ...and no two share one
    assert all(variants(t, *args) in warmed for t in range(1, 4097))


def test_nothing_runs_on_the_cpu():
    x, w13, w2 = torch.zeros(1, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)
    assert warm_up(x, w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), 4096) == []
