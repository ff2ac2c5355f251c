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


@pytest.mark.parametrize("m,n,k", [(5, 100, 1100), (19, 256, 1536), (3, 130, 2100)])
def test_chunks_folded_in_one_k_loop_keep_the_bits(m, n, k):
    """``FOLD_CHUNKS`` (a sweep variant): every chunk's sum added to the total inside one K loop gives
    the bits of one loop per chunk, ragged K and columns included, and so do persistent programs
    (``PERSISTENT``); calls that split K ignore both."""
    x, wq, ws, b = fp8_inputs(m, n, k, seed=m * n + k)
    cfg, chunk, _ = linear_plan(600, n, k, fp8=True)
    assert chunk < k  # several chunks, so the fold has something to fold
    want = invariant_linear_fp8_triton(x, wq, ws, b, config=cfg, split=False)
    for bias in (b, None):
        got = invariant_linear_fp8_triton(x, wq, ws, bias, config=dict(cfg, FOLD_CHUNKS=True), split=False)
        assert not torch.isnan(got).any()
        assert torch.equal(got, want if bias is b else invariant_linear_fp8_triton(x, wq, ws, None, config=cfg,
                                                                                    split=False))
    assert torch.equal(invariant_linear_fp8_triton(x, wq, ws, b, config=dict(cfg, FOLD_CHUNKS=True), split=True), want)
    # Persistent programs (fewer than the tiles: 3 programs take them in turn) keep them too.
    small = dict(cfg, BLOCK_M=16, BLOCK_N=32, FOLD_CHUNKS=True, PERSISTENT=3)
    assert torch.equal(invariant_linear_fp8_triton(x, wq, ws, b, config=small, split=False), want)


def test_a_zero_row_and_a_nan_row_stay_apart():
    """An all-zero row's groups take the floor scale (output: the bias); a NaN makes only its own
    row NaN."""
    x, wq, ws, b = fp8_inputs(4, 128, 256, seed=3)
    x[1] = 0
    x[2, 7] = float("nan")
    out = invariant_linear_fp8_triton(x, wq, ws, b)
    assert torch.equal(out[1], b)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()


def test_two_consumer_tiles_refuse_calls_they_cannot_run():
    """The Gluon two-consumer tile (a sweep variant) needs compiled code and TMA: under the
    interpreter, and for a split call, the request is refused by name, never run as another kernel."""
    x, wq, ws, b = fp8_inputs(300, 256, 1024, seed=3)
    cfg = dict(linear_plan(300, 256, 1024, fp8=True)[0], BLOCK_M=128, BLOCK_N=128, TWO_CONSUMERS=True)
    for split in (False, True):
        with pytest.raises(ValueError, match="two-consumer tiles"):
            invariant_linear_fp8_triton(x, wq, ws, b, config=cfg, split=split)
    bf16_w = wq.to(torch.bfloat16)
    from mok_serve.kernels.cuda.linear import invariant_linear_triton

    with pytest.raises(ValueError, match="fp8 False"):
        invariant_linear_triton(x, bf16_w, b, config=dict(configs.pick_linear_config(300, 256, 1024), TWO_CONSUMERS=True))


def test_two_consumer_launcher_refuses_tiles_it_has_no_kernel_for():
    from mok_serve.kernels.cuda.linear_fp8_consumers import linear_fp8_two_consumers

    a = torch.zeros(256, 1024, dtype=torch.float8_e4m3fn)
    xs, w, ws, y = torch.ones(256, 8), torch.zeros(256, 1024, dtype=torch.float8_e4m3fn), torch.ones(2, 8), torch.empty(256, 256)
    for cfg, chunk in ((dict(BLOCK_M=64, BLOCK_N=128, num_stages=4), 1024), (dict(BLOCK_M=128, BLOCK_N=128, num_stages=4), 1000)):
        with pytest.raises(ValueError, match="two-consumer tiles are 128 rows tall"):
            linear_fp8_two_consumers(a, xs, w, ws, None, y, chunk, cfg)
