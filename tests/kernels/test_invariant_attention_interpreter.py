"""Batch-invariant paged attention's Triton kernels on the CPU, under the Triton interpreter: the
reference function, the same bits on either path, alone or in a batch, decoded or inside a
prefill chunk of any size; the swapped (decode) layout's function. In fp32 too: a bf16 output hides most fp32 ordering differences in its
rounding (a reversed merge order changed no bf16 output of these sizes, 45 fp32 ones)."""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from attention_test_utils import Batch, rel_err  # noqa: E402
from mok_serve.kernels.attention import attention_reference  # noqa: E402
from mok_serve.kernels.cuda.attention import attention_plan, invariant_attention_triton  # noqa: E402

HEADS, KV_HEADS, HEAD = 4, 2, 32


def run(batch: Batch, split: bool | None = None, window=None, swap: bool | None = None):
    out = torch.full_like(batch.q, float("nan"))
    return invariant_attention_triton(batch.q, batch.k, batch.v, out, batch.cu_q, batch.seq_lens, batch.block_table,
                                      batch.max_seq_len, batch.scale, window, split=split, swap=swap)


DTYPES = [torch.bfloat16, torch.float32]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 40])
def test_matches_the_reference_and_both_paths_agree(window, dtype):
    batch = Batch.random([(1, 150), (7, 70), (33, 33), (1, 1)], HEADS, KV_HEADS, HEAD, seed=3, dtype=dtype)
    ref = attention_reference(batch.q, batch.k, batch.v, batch.cu_q, batch.seq_lens, batch.block_table, batch.scale,
                              window)
    whole = run(batch, split=False, window=window)
    assert rel_err(whole, ref) <= TOL[dtype]
    assert torch.equal(run(batch, split=True, window=window), whole)


def test_a_head_runs_as_one_padded_tile_or_two_tiles_of_at_least_64_columns():
    from mok_serve.kernels.cuda.attention import head_parts

    assert [head_parts(h) for h in (48, 64, 96, 128, 160, 192, 256, 320)] == [
        (64, 0), (64, 0), (128, 0), (128, 0), (128, 64), (128, 64), (256, 0), (256, 64)]


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("head", [48, 192])
def test_a_head_size_that_is_not_a_power_of_two(head, swap):
    """Head size 48, padded to 64 inside the kernel, and 192 (DeepSeek-V3 with MLA off), two tiles
    of 128 and 64 columns: the padded columns change no score and are never written, the second
    tile's columns are written from its own accumulator."""
    batch = Batch.random([(1, 150), (1, 70), (1, 3)], 2, 2, head, seed=8)
    ref = attention_reference(batch.q, batch.k, batch.v, batch.cu_q, batch.seq_lens, batch.block_table, batch.scale)
    whole = run(batch, split=False, swap=swap)
    assert rel_err(whole, ref) <= TOL[torch.bfloat16]
    assert torch.equal(run(batch, split=True, swap=swap), whole)


def test_a_token_has_the_same_bits_alone_in_a_batch_and_in_any_prefill_chunk(dtype=torch.bfloat16):
    """One sequence of 140 tokens: its last token decoded alone, decoded beside others, and computed
    inside prefill chunks of several sizes (the cache holds the same keys and values). bf16 only
    here: the interpreter's numpy fp32 dots round a row differently by its place in the tile
    (BLAS blocking), which the GPU's MMA does not; the GPU tests check this in fp32 too."""
    batch = Batch.random([(140, 140)], HEADS, KV_HEADS, HEAD, seed=5, dtype=dtype)
    full = run(batch)
    last = full[-1]
    alone = batch.subset_queries(0, 139, 140)
    assert torch.equal(run(alone)[0], last)
    assert torch.equal(run(alone, split=True)[0], last)
    for chunk in (1, 5, 64, 100):
        part = batch.subset_queries(0, 140 - chunk, 140)
        assert torch.equal(run(part)[-1], last), chunk
    other = Batch.random([(3, 90), (1, 12)], HEADS, KV_HEADS, HEAD, seed=6, dtype=dtype)
    mixed = Batch.concat(other, alone)
    assert torch.equal(run(mixed)[-1], last)


def test_rows_of_an_unfinished_bound_are_poisoned_on_the_split_path():
    batch = Batch.random([(1, 200)], HEADS, KV_HEADS, HEAD, seed=8)
    batch.max_seq_len = 100  # below the real length: the workspace cannot hold every segment
    assert torch.isnan(run(batch, split=True)).all()


@pytest.mark.parametrize("window", [None, 40])
def test_the_swapped_layout_computes_the_same_function(window):
    """Decode calls with a head size of 64 or more run the operands swapped (keys on the tensor
    cores' M side). Here the interpreter's numpy dots may round the two layouts' fp32 sums apart (by
    the arrays' shapes), so they agree within a rounding; the GPU tests check their bits."""
    decode = Batch.random([(1, 150), (1, 70), (1, 1), (1, 64)], 8, 2, 64, seed=11)
    prefill = Batch.random([(1, 150), (7, 70), (33, 33)], 8, 2, 64, seed=12)
    assert attention_plan(4, 4, 8, 2, 64, 150)[3] and not attention_plan(41, 3, 8, 2, 64, 150)[3]
    assert not attention_plan(4, 4, 8, 2, 32, 150)[3]  # a 32-wide head would leave wgmma swapped
    for batch in (decode, prefill):
        ref = attention_reference(batch.q, batch.k, batch.v, batch.cu_q, batch.seq_lens, batch.block_table,
                                  batch.scale, window)
        for swap in (False, True):
            for split in (False, True):
                assert rel_err(run(batch, split=split, window=window, swap=swap), ref) <= 1e-2, (swap, split)
        assert torch.equal(run(batch, split=True, window=window, swap=True), run(batch, split=False, window=window,
                                                                                 swap=True))
    out = torch.empty_like(decode.q)
    for programs in (1, 3, 64):  # programs sharing a block's segments: any number, the same bits
        got = invariant_attention_triton(decode.q, decode.k, decode.v, out.clone(), decode.cu_q, decode.seq_lens,
                                         decode.block_table, decode.max_seq_len, decode.scale, window, split=True,
                                         segment_programs=programs)
        assert torch.equal(got, run(decode, split=True, window=window)), programs
    with pytest.raises(ValueError, match="segment_programs"):
        invariant_attention_triton(decode.q, decode.k, decode.v, out, decode.cu_q, decode.seq_lens,
                                   decode.block_table, decode.max_seq_len, decode.scale, segment_programs=0)


def test_swapped_calls_take_one_pipeline_stage_past_48_kb_of_k_and_v():
    """Swapped (decode) calls keep a second stage up to 48 KB of K and V per segment (measured: two
    stages 1.35x faster at head 192 as two tiles, 48 KB; one stage 1.25x faster with the head padded
    to 256, 64 KB), prefill calls up to 64 KB (shared memory)."""
    from mok_serve.kernels.cuda.attention import num_stages

    assert num_stages(192, 2, swap=True) == 2 and num_stages(256, 2, swap=True) == 1
    assert num_stages(192, 2, swap=False) == 2 and num_stages(192, 4, swap=False) == 1
