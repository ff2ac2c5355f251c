"""The block-FP8 batch-invariant dense layer on a CUDA GPU (Hopper): accuracy against float64 on the
quantized operands, the same bits for a row whatever the row count, tile config, K split or TMA,
CUDA graphs, NaN rows kept apart.

Run with ``pytest -m gpu``; skipped without CUDA. Fresh random inputs each run (seed printed).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from mok_serve.kernels import invariant_linear_fp8  # noqa: E402
from mok_serve.kernels.cuda import configs  # noqa: E402
from mok_serve.kernels.cuda.linear import invariant_linear_fp8_triton, linear_plan  # noqa: E402
from mok_serve.kernels.fp8 import quantize_fp8_blocks  # noqa: E402
from moe_test_utils import DEV, fresh_seed, rel_err  # noqa: E402
from moe_test_utils import fp8_linear_float64_reference as float64_reference  # noqa: E402

# Block-FP8 dense shapes [N, K]: Qwen3-30B-A3B-FP8 qkv / o, DeepSeek-V3 q_a / kv_a / q_b / o /
# shared-expert gate_up and down, and odd ones.
SHAPES = [(5120, 2048), (2048, 4096), (1536, 7168), (576, 7168), (24576, 1536), (7168, 16384), (4096, 7168),
          (7168, 2048), (200, 1000), (300, 136)]
ROW_COUNTS = [1, 2, 3, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 255, 257, 600, 2048]


def _weights(n, k, g):
    wq, ws = quantize_fp8_blocks(torch.randn(n, k, device=DEV, generator=g) / k**0.5)
    b = torch.randn(n, device=DEV, generator=g).to(torch.bfloat16)
    return wq, ws, b


@pytest.mark.parametrize("n,k", SHAPES)
def test_accuracy_against_float64(n, k):
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    wq, ws, b = _weights(n, k, g)
    for m in (1, 16, 64, 257, 2048):
        if m * n > 64 * 2**20:
            continue
        x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
        out = invariant_linear_fp8(x, wq, ws, b)
        assert not torch.isnan(out).any()
        assert rel_err(out, float64_reference(x, wq, ws, b)) <= 1e-2, (m, n, k)


@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[0] * s[1] < 2**28])
def test_a_row_has_the_same_bits_at_every_row_count(n, k):
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    wq, ws, b = _weights(n, k, g)
    x = torch.randn(max(ROW_COUNTS), k, device=DEV, generator=g).to(torch.bfloat16)
    full = invariant_linear_fp8(x, wq, ws, b)
    for m in ROW_COUNTS:
        start = int(torch.randint(0, max(ROW_COUNTS) - m + 1, (1,), generator=torch.Generator().manual_seed(m)))
        part = invariant_linear_fp8(x[start : start + m], wq, ws, b)
        assert torch.equal(part, full[start : start + m]), (m, linear_plan(m, n, k, fp8=True))


def test_every_tile_split_and_tma_gives_the_same_bits():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    # K > 4096: 64 x 128 tiles on two warpgroups (576 x 7168), and on one where they fill the SMs
    # (3584 x 4608 at 300 rows: 5 x 28 tiles)
    for n, k in [(2048, 4096), (1000, 1100), (576, 7168), (3584, 4608)]:
        wq, ws, b = _weights(n, k, g)
        x = torch.randn(70, k, device=DEV, generator=g).to(torch.bfloat16)
        first = None
        for rows in (1, 20, 40, 100, 300):
            cfg, _, _ = linear_plan(rows, n, k, fp8=True)
            for split in (False, True):
                for tma in (False, True):
                    for tma_a in (False, True):  # weights, activations by TMA or pointer loads
                        out = invariant_linear_fp8_triton(x, wq, ws, b, config=dict(cfg, USE_TMA=tma, TMA_A=tma_a),
                                                          split=split)
                        first = out if first is None else first
                        assert torch.equal(out, first), (n, k, cfg, split, tma, tma_a)
        # The bf16 GEMM's own tiles (BLOCK_K 128 imposed) give those bits too.
        out = invariant_linear_fp8_triton(x, wq, ws, b, config=configs.pick_linear_config(300, n, k))
        assert torch.equal(out, first)


def test_cuda_graph_replay_and_nan_rows():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    wq, ws, b = _weights(2048, 4096, g)
    for m in (1, 8, 200):
        x = torch.randn(m, 4096, device=DEV, generator=g).to(torch.bfloat16)
        invariant_linear_fp8(x, wq, ws, b)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = invariant_linear_fp8(x, wq, ws, b)
        for _ in range(3):
            x.copy_(torch.randn(m, 4096, device=DEV, generator=g))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, invariant_linear_fp8(x, wq, ws, b))
    x = torch.randn(4, 4096, device=DEV, generator=g).to(torch.bfloat16)
    x[2, 100] = float("nan")
    out = invariant_linear_fp8(x, wq, ws, b)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()
