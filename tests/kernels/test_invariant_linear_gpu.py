"""The batch-invariant dense layer on a CUDA GPU (Hopper): accuracy against float64, the same bits
for a row whatever the row count, tile config or K split, CUDA graphs, poisoned outputs.

Run with ``pytest -m gpu``; skipped without CUDA. Fresh random inputs each run (seed printed).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from mok_serve.kernels import invariant_linear  # noqa: E402
from mok_serve.kernels.cuda import configs  # noqa: E402
from mok_serve.kernels.cuda.linear import invariant_linear_triton, linear_plan  # noqa: E402
from moe_test_utils import DEV, fresh_seed, rel_err  # noqa: E402

# Dense shapes [N, K] of the served models: Qwen3-30B-A3B qkv / o / router / LM head, GLM-4.5-Air
# o_proj and shared-expert down, DeepSeek-V3 q_a / kv_a, and odd ones.
SHAPES = [(5120, 2048), (2048, 4096), (128, 2048), (151936, 2048), (4096, 12288), (4096, 1408), (1536, 7168),
          (576, 7168), (100, 1000), (300, 72)]
ROW_COUNTS = [1, 2, 3, 8, 15, 16, 17, 31, 33, 63, 64, 65, 100, 255, 257, 600, 2048]


def _weights(n, k, dtype, g):
    w = (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEV, generator=g).to(dtype)
    return w, b


@pytest.mark.parametrize("n,k", SHAPES)
def test_accuracy_against_float64(n, k):
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w, b = _weights(n, k, torch.bfloat16, g)
    for m in (1, 16, 64, 257, 2048):
        if m * n > 64 * 2**20:
            continue
        x = torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16)
        torch.full((m, n), float("nan"), device=DEV, dtype=torch.bfloat16)  # poison the next block
        out = invariant_linear(x, w, b)
        ref = x.double() @ w.double().t() + b.double()
        assert rel_err(out, ref) <= 1e-2, (m, n, k)


def test_float32_and_float16():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        w, b = _weights(700, 1500, dtype, g)
        for m in (1, 40, 300):
            x = torch.randn(m, 1500, device=DEV, generator=g).to(dtype)
            assert rel_err(invariant_linear(x, w, b), x.double() @ w.double().t() + b.double()) <= tol


@pytest.mark.parametrize("n,k", [s for s in SHAPES if s[0] * s[1] < 2**28])
def test_a_row_has_the_same_bits_at_every_row_count(n, k):
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w, b = _weights(n, k, torch.bfloat16, g)
    x = torch.randn(max(ROW_COUNTS), k, device=DEV, generator=g).to(torch.bfloat16)
    full = invariant_linear(x, w, b)
    for m in ROW_COUNTS:
        start = int(torch.randint(0, max(ROW_COUNTS) - m + 1, (1,), generator=torch.Generator().manual_seed(m)))
        part = invariant_linear(x[start : start + m], w, b)
        assert torch.equal(part, full[start : start + m]), (m, linear_plan(m, n, k))


def test_every_tile_and_split_gives_the_same_bits():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for n, k in [(2048, 4096), (1000, 1100), (4096, 12288)]:
        w, b = _weights(n, k, torch.bfloat16, g)
        x = torch.randn(70, k, device=DEV, generator=g).to(torch.bfloat16)
        x[5] = 0.0  # rows whose products are all zeros keep their sign of zero on every path
        x[6] = -0.0
        first = None
        for rows in (1, 20, 40, 100, 300):
            cfg = configs.pick_linear_config(rows, n, k)
            for split in (False, True):
                # Weights by pointer loads or TMA; activations by TMA too (where K's rows are 16-byte
                # aligned, else the launcher falls back), and with the K loop warp-specialized.
                for tma in (dict(USE_TMA=False, TMA_A=False), dict(USE_TMA=True, TMA_A=False),
                            dict(USE_TMA=True, TMA_A=True), dict(USE_TMA=True, TMA_A=True, WARP_SPEC=True)):
                    out = invariant_linear_triton(x, w, b, config={**cfg, **tma}, split=split)
                    first = out if first is None else first
                    assert torch.equal(out, first), (n, k, cfg, split, tma)


def test_cuda_graph_replay_with_new_inputs():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w, b = _weights(2048, 4096, torch.bfloat16, g)
    for m in (1, 8, 200):
        x = torch.randn(m, 4096, device=DEV, generator=g).to(torch.bfloat16)
        invariant_linear(x, w, b)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = invariant_linear(x, w, b)
        for _ in range(3):
            x.copy_(torch.randn(m, 4096, device=DEV, generator=g))
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, invariant_linear(x, w, b))


def test_strided_input_and_broadcast_bias():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w, _ = _weights(512, 1024, torch.bfloat16, g)
    x = torch.randn(9, 2048, device=DEV, generator=g).to(torch.bfloat16)[:, ::2]
    bias = torch.randn(1, device=DEV, generator=g).to(torch.bfloat16).expand(512)
    out = invariant_linear(x, w, bias)
    assert rel_err(out, x.double() @ w.double().t() + bias.double()) <= 1e-2
    assert torch.equal(out, invariant_linear(x.contiguous(), w, bias.contiguous()))
