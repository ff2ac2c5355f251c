"""The block-FP8 batch-invariant dense layer's Triton kernels on the CPU, under the Triton
interpreter: the reference's values whatever the tile config or the split of K chunks over programs
(the same bits for both paths), a row's bits alone and in a batch, the activations' quantization."""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from mok_serve.kernels.cuda import configs  # noqa: E402
from mok_serve.kernels.cuda.linear import invariant_linear_fp8_triton, linear_plan  # noqa: E402
from mok_serve.kernels.linear import invariant_linear_fp8_reference  # noqa: E402
from moe_test_utils import rel_err  # noqa: E402
from moe_test_utils import fp8_linear_float64_reference as float64_reference  # noqa: E402
from test_invariant_linear_fp8 import fp8_inputs  # noqa: E402

ROW_COUNTS = (1, 20, 40, 100, 300, 600)  # one of each config pick_linear_config gives (bf16 or FP8)


@pytest.mark.parametrize("m,n,k", [(1, 128, 1024), (5, 100, 1100), (19, 256, 1536), (3, 130, 96)])
def test_every_tile_matches_the_reference_and_splitting_keeps_its_bits(m, n, k):
    x, wq, ws, b = fp8_inputs(m, n, k, seed=m + n + k)
    ref = invariant_linear_fp8_reference(x, wq, ws, b)
    assert rel_err(ref, float64_reference(x, wq, ws, b)) <= 1e-2
    distinct = {tuple(sorted(configs.pick_linear_config(rows, n, k, fp8=fp8).items()))
                for rows in ROW_COUNTS for fp8 in (False, True)}
    for cfg in map(dict, sorted(distinct)):
        whole = invariant_linear_fp8_triton(x, wq, ws, b, config=cfg, split=False)
        assert not torch.isnan(whole).any()
        assert torch.equal(invariant_linear_fp8_triton(x, wq, ws, b, config=cfg, split=True), whole), cfg
        assert rel_err(whole, ref) <= 4e-3, cfg


def test_rows_alone_equal_rows_in_a_batch_and_plans_take_128_column_blocks():
    x, wq, ws, b = fp8_inputs(40, 128, 1024, seed=9)
    full = invariant_linear_fp8_triton(x, wq, ws, b)
    for m in (1, 16, 17, 33):
        assert torch.equal(invariant_linear_fp8_triton(x[:m], wq, ws, b), full[:m])
    assert linear_plan(8192, 2048, 4096, fp8=True)[0]["BLOCK_K"] == 128
    assert linear_plan(8192, 2048, 4096)[0]["BLOCK_K"] == 64


def test_a_zero_row_and_a_nan_row_stay_apart():
    """An all-zero row's groups take the floor scale (output: the bias); a NaN makes only its own
    row NaN."""
    x, wq, ws, b = fp8_inputs(4, 128, 256, seed=3)
    x[1] = 0
    x[2, 7] = float("nan")
    out = invariant_linear_fp8_triton(x, wq, ws, b)
    assert torch.equal(out[1], b)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()
