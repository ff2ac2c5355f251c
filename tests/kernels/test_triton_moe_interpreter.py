"""The Triton MoE kernels' logic on the CPU, under the Triton interpreter, at tiny sizes.

``TRITON_INTERPRET=1`` is set before triton is imported, so ``@triton.jit`` functions become
interpreted ones. On a machine with CUDA this module is skipped (the GPU tests cover the compiled
kernels, and setting the variable there would turn later-imported kernels into interpreted ones).
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from mok_serve.kernels import fused_moe_reference  # noqa: E402
from mok_serve.kernels.cuda.configs import one_height  # noqa: E402
from moe_test_utils import (  # noqa: E402
    check_decode_one_launch_bits,
    check_decode_wait_gives_up,
    interpreted_cuda_modules,
    make_inputs,
    rel_err,
)

tm, _, _ = interpreted_cuda_modules()


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k",
    [(1, 32, 16, 4, 2), (5, 48, 24, 6, 3), (33, 64, 32, 8, 2), (70, 32, 16, 3, 3)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(tokens, hidden, inter, experts, top_k, dtype):
    x, w13, w2, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k, dtype, seed=tokens * 7 + hidden)
    out = tm.fused_moe_triton(x, w13, w2, weights, ids)
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, ref) <= TOL[dtype]


def test_schedule_positions_are_prefix_sums_in_token_order():
    tokens, top_k, experts = 37, 3, 5
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
    rows = tokens * top_k
    counts = torch.full((experts,), -7, dtype=torch.int32)
    sorted_rows = torch.full((rows,), -7, dtype=torch.int32)
    tm.moe_schedule_kernel[(experts,)](
        ids, ids, counts, sorted_rows, torch.zeros(4, dtype=torch.int64), rows, experts, experts,
        ids.stride(0), ids.stride(1),
        TOPK=top_k, HAS_MAP=False, BLOCK=16, PDL=False,
    )
    flat = ids.reshape(-1).long()
    assert counts.tolist() == torch.bincount(flat, minlength=experts).tolist()
    assert sorted_rows.tolist() == torch.argsort(flat, stable=True).tolist()


def test_expert_map_and_duplicates():
    tokens, hidden, inter, local, top_k, num_global = 9, 32, 16, 3, 4, 8
    x, w13, w2, weights, _ = make_inputs(tokens, hidden, inter, local, top_k, torch.float32, seed=11)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, num_global, (tokens, top_k), generator=g, dtype=torch.int64)  # duplicates allowed
    expert_map = torch.tensor([-1, 0, -1, 2, 1, -1, -1, 0], dtype=torch.int32)
    out = tm.fused_moe_triton(x, w13, w2, weights, ids, expert_map=expert_map)
    ref = fused_moe_reference(x, w13, w2, weights, ids, expert_map=expert_map)
    assert rel_err(out, ref) <= TOL[torch.float32]
    # A token whose experts are all remote gets exact zeros.
    ids[0] = torch.tensor([0, 2, 5, 6])
    out = tm.fused_moe_triton(x, w13, w2, weights, ids, expert_map=expert_map)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_strided_int64_ids_and_bf16_weights():
    x, w13, w2, weights, ids = make_inputs(6, 32, 16, 4, 2, torch.float32, seed=5)
    ids_t = ids.long().t().contiguous().t()  # non-contiguous view, int64
    w_t = weights.to(torch.bfloat16).t().contiguous().t()
    out = tm.fused_moe_triton(x, w13, w2, w_t, ids_t)
    ref = fused_moe_reference(x, w13, w2, w_t, ids_t)
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize(
    "cfg",
    [
        (dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=32), dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=16)),
        (dict(BLOCK_M=128, BLOCK_N=32, BLOCK_K=32), dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=16)),
        (dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64), dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)),
        # grouped program order
        (dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=32, GROUP_M=3), dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)),
        # half-height last tiles: experts get 15, 21, 25 and 19 rows, so expert 0 runs a 16-row tile
        (dict(BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, HALF_TAIL=True),
         dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=16, HALF_TAIL=True)),
        # operands swapped (weight columns on the M side): 16-row tiles, two per expert or more
        (dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, SWAP_AB=True), dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=16, SWAP_AB=True)),
    ],
)
def test_tile_configs_agree(cfg):
    x, w13, w2, weights, ids = make_inputs(40, 48, 24, 4, 2, torch.float32, seed=9)
    g1, g2 = ({**c, "num_warps": 4, "num_stages": 2} for c in cfg)
    out = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, g2))
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert rel_err(out, ref) <= TOL[torch.float32]


@pytest.mark.parametrize("with_map", [False, True])
def test_out_of_range_ids_are_masked_and_reported_at_the_next_call(with_map):
    """No value check on the host (that would be a device sync on CUDA): the schedule kernel masks
    ids outside [-1, E) (their rows contribute nothing, nothing is read out of bounds) and reports
    their range, which the next call raises; -1 is valid and reports nothing."""
    from mok_serve.kernels import bad_ids

    x, w13, w2, weights, ids = make_inputs(4, 32, 16, 4, 2, torch.float32, seed=1)
    expert_map = torch.arange(4, dtype=torch.int32) if with_map else None
    bad = ids.clone()
    bad[1, 0] = 4
    bad[2, 1] = -3
    bad[3, 0] = -1
    out = tm.fused_moe_triton(x, w13, w2, weights, bad, expert_map=expert_map)
    keep = (bad == ids).float()
    ref = fused_moe_reference(x, w13, w2, weights * keep, ids, expert_map=expert_map)
    assert rel_err(out, ref) <= TOL[torch.float32]
    with pytest.raises(ValueError, match=r"topk_ids out of range: found ids in \[-3, 4\] outside the valid range "
                       r"\[-1, 4\) \(-1: no expert\), in an earlier kittens MoE call on cpu"):
        tm.fused_moe_triton(x, w13, w2, weights, ids, expert_map=expert_map)
    bad_ids.check_ids("cpu")  # the report was cleared by the error
    unrouted = ids.clone()
    unrouted[0, 1] = -1
    tm.fused_moe_triton(x, w13, w2, weights, unrouted, expert_map=expert_map)
    bad_ids.check_ids("cpu")


def test_out_of_range_expert_map_values_are_reported():
    """expert_map values outside [-1, E_local) that an id looks up are masked and reported."""
    from mok_serve.kernels import bad_ids

    x, w13, w2, weights, _ = make_inputs(3, 32, 16, 4, 2, torch.float32, seed=2)
    ids = torch.tensor([[0, 4], [5, 1], [2, 3]], dtype=torch.int32)
    expert_map = torch.tensor([0, 1, 2, 3, 7, -2], dtype=torch.int32)
    out = tm.fused_moe_triton(x, w13, w2, weights, ids, expert_map=expert_map)
    keep = (ids < 4).float()
    ref = fused_moe_reference(x, w13, w2, weights * keep, ids.clamp(max=3))
    assert rel_err(out, ref) <= TOL[torch.float32]
    with pytest.raises(ValueError, match=r"expert_map values must be -1 or local expert ids in \[0, 4\); "
                       r"found \[-2, 7\]"):
        bad_ids.check_ids("cpu")
    bad_ids.check_ids("cpu")


def test_nan_stays_in_its_token():
    x, w13, w2, weights, ids = make_inputs(12, 32, 16, 3, 2, torch.float32, seed=2)
    x[5, 3] = float("nan")
    out = tm.fused_moe_triton(x, w13, w2, weights, ids)
    assert torch.isnan(out[5]).all()
    others = torch.cat([out[:5], out[6:]])
    assert not torch.isnan(others).any()


def test_decode_regime_swaps_operands_up_to_8_rows_per_expert():
    # (hidden, inter, experts, top_k) of DeepSeek-V3, Qwen3-30B-A3B, GLM-4.5: 16-row swapped tiles
    # while the average expert's rows fit half a tile (the sweep at 5767485 had them 18-44% slower
    # at 16-32 rows per expert), 64-row tiles to 48, then 128-row tiles.
    for shape in ((7168, 2048, 256, 8), (2048, 768, 128, 8), (5120, 1536, 160, 8)):
        hidden, inter, experts, top_k = shape
        for tokens in (1, 2, 8, 32, 128, 512, 2048):
            g1, g2 = tm.pick_configs(tokens, top_k, experts, hidden, inter)
            avg = tokens * top_k / experts
            swapped = avg <= 8
            assert g1.get("SWAP_AB", False) == g2.get("SWAP_AB", False) == swapped, (shape, tokens)
            assert g1["BLOCK_M"] == g2["BLOCK_M"] == (16 if swapped else 64 if avg <= 48 else 128)
            assert (g1["BLOCK_K"], g2["BLOCK_K"]) == ((128, 128) if swapped else (64, 64))


def test_pick_configs_wgmma_sized():
    # Hopper runs one matrix instruction (wgmma, M = 64 per warpgroup) in every regime: the M side
    # is the token rows (>= 64) or, swapped, the weight columns (GEMM1's 2 * BLOCK_N, GEMM2's
    # BLOCK_N), and every dimension of a dot is >= 16.
    for tokens in (1, 2, 8, 32, 128, 512, 2048, 8192):
        for shape in ((7168, 2048, 256, 8), (2048, 768, 128, 8), (5120, 1536, 160, 8), (64, 32, 4, 2)):
            hidden, inter, experts, top_k = shape
            g1, g2 = tm.pick_configs(tokens, top_k, experts, hidden, inter)
            if g1.get("SWAP_AB"):
                assert 2 * g1["BLOCK_N"] >= 64 and g2["BLOCK_N"] >= 64 and g1["BLOCK_M"] >= 16
            else:
                assert g1["BLOCK_M"] >= 64 and g2["BLOCK_M"] >= 64
            assert min(g1["BLOCK_K"], g2["BLOCK_K"], g1["BLOCK_N"], g2["BLOCK_N"]) >= 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_one_launch_gives_the_two_launches_bits(dtype):
    # Decode sizes (<= 8 rows per expert on average). Expert 0 gets 36 rows (three 16-row tiles),
    # so GEMM2 tiles of one expert wait on different row tiles; an expert map hides two experts.
    x, w13, w2, weights, ids = make_inputs(36, 48, 40, 16, 3, dtype, seed=21)
    ids[:, 0] = 0
    out = check_decode_one_launch_bits(tm, x, w13, w2, weights, ids)
    assert rel_err(out, fused_moe_reference(x, w13, w2, weights, ids)) <= TOL[dtype]
    expert_map = torch.tensor([0, -1, 1, 2, 3, -1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], dtype=torch.int32)
    local = 14
    ids[0] = torch.tensor([1, 5, 1])  # token 0 has remote experts only: exact zeros
    out = check_decode_one_launch_bits(tm, x, w13[:local], w2[:local], weights, ids, expert_map)
    ref = fused_moe_reference(x, w13[:local], w2[:local], weights, ids, expert_map=expert_map)
    assert rel_err(out, ref) <= TOL[dtype]
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_decode_grouped_gemm1_items_give_the_same_bits():
    # GROUP_M row tiles sweep GEMM1's column tiles together (the order of the work items, not their
    # arithmetic). Expert 0 has 36 rows (three 16-row tiles), expert 1 20 (two): groups straddle
    # experts and the unused row tiles past the last one in use.
    x, w13, w2, weights, ids = make_inputs(36, 48, 80, 16, 3, torch.float32, seed=25)
    ids[:, 0] = 0
    ids[:20, 1] = 1
    g1, g2 = tm.pick_configs(36, 3, 16, 48, 80, one_launch=True)
    assert tm.one_launch_decode(g1, g2) and g1["BLOCK_M"] == 16 and 80 // g1["BLOCK_N"] >= 2
    expect = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, g2))
    assert rel_err(expect, fused_moe_reference(x, w13, w2, weights, ids)) <= TOL[torch.float32]
    assert g1["GROUP_M"] == 4  # the default: 1 (row-tile major) is one of the orders below
    for group in (1, 2, 3, 16, 64):
        got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(dict(g1, GROUP_M=group), g2))
        assert torch.equal(got, expect), group


def test_decode_grouped_gemm2_items_give_the_same_bits():
    # GEMM2's full-width items in groups of row tiles (program_tile), alone and before a narrow
    # tail: the order changes, not the arithmetic. Expert 0 has 36 rows (three 16-row tiles),
    # expert 1 20 (two); hidden 160 in 64-column tiles: three column tiles, the last 32 wide.
    x, w13, w2, weights, ids = make_inputs(36, 160, 48, 16, 3, torch.float32, seed=27)
    ids[:, 0] = 0
    ids[:20, 1] = 1
    g1, g2 = tm.pick_configs(36, 3, 16, 160, 48, one_launch=True)
    assert tm.one_launch_decode(g1, g2) and g2["BLOCK_M"] == 16
    g2 = dict(g2, BLOCK_N=64, NARROW_TAIL=0)
    expect = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, g2))
    assert rel_err(expect, fused_moe_reference(x, w13, w2, weights, ids)) <= TOL[torch.float32]
    for group in (2, 3, 16):
        got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, dict(g2, GROUP_M=group)))
        assert torch.equal(got, expect), group
    # With a narrow tail the grouped items are the row tiles before the last two in use.
    wide = dict(g2, BLOCK_N=128)
    tail = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, dict(wide, NARROW_TAIL=2)))
    for group in (2, 3):
        got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, dict(wide, NARROW_TAIL=2, GROUP_M=group)))
        assert torch.equal(got, tail), ("narrow tail", group)


def test_decode_heavy_tiles_follow_the_counts_and_give_the_same_rows():
    # HEAVY_M: experts with more than 16 rows run 64-row tiles (chosen on the device from the
    # counts), the others 16-row ones. Expert 0 has 100 rows (heavy tiles of 64 and 36), expert 1
    # 40 (one heavy tile), expert 2 16 (one light tile, the boundary), the rest few.
    x, w13, w2, weights, ids = make_inputs(100, 160, 48, 64, 3, torch.float32, seed=29)
    ids[:, 0] = 0
    ids[:40, 1] = 1
    ids[40:56, 1] = 2
    picked = tm.pick_configs(100, 3, 64, 160, 48, one_launch=True)
    assert tm.one_launch_decode(*picked) and picked[0]["BLOCK_M"] == 16
    heavy = dict(HEAVY_M=64, HEAVY_STAGES=2)
    assert {k: picked[0][k] for k in heavy} == heavy and picked[1]["HEAVY_STAGES"] == 2  # the default
    g1 = {k: v for k, v in picked[0].items() if k not in heavy}  # 16-row tiles only
    g2 = {k: v for k, v in picked[1].items() if k != "HEAVY_STAGES"}
    expect = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, g2))
    assert rel_err(expect, fused_moe_reference(x, w13, w2, weights, ids)) <= TOL[torch.float32]
    variants = [picked, (dict(g1, **heavy, GROUP_M=2), dict(g2, GROUP_M=3)),
                (dict(g1, **heavy), dict(g2, BLOCK_N=128, NARROW_TAIL=2)), (dict(g1, HEAVY_M=32), g2)]
    for configs in variants:
        got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=configs)
        # Same rows, same arithmetic; the interpreter's tl.dot (numpy) may order its sums by the
        # tile's width (see the narrow tail's test below); the GPU test asks for the same bits.
        assert rel_err(got, expect) <= 1e-6, configs
    with pytest.raises(ValueError, match="HEAVY_M"):
        tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(dict(g1, HEAVY_M=24), g2))
    # Two launches take heavy tiles too, each GEMM its own (the one-launch kernel: GEMM1's for both).
    two = [{k: v for k, v in g.items() if k != "ONE_LAUNCH"} for g in (g1, g2)]
    got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(dict(two[0], **heavy), dict(two[1], **heavy)))
    assert rel_err(got, expect) <= 1e-6
    with pytest.raises(ValueError, match="one-launch decode kernel only"):
        tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(dict(two[0], NARROW_TAIL=2), two[1]))
    check_decode_wait_gives_up(tm, x, w13, w2, ids, configs=(dict(g1, **heavy), g2))


def test_two_launch_heavy_tiles_follow_the_counts_and_give_the_same_rows():
    # 64-row tiles (17-48 rows per expert on average) with HEAVY_M 128: expert 0 holds every
    # token's first slot (150 rows: a 128-row tile and a 22-row one), expert 1 65 rows (one heavy
    # tile), expert 2 exactly 64 (one light tile), the rest 85 rows spread; with half tails beside.
    x, w13, w2, weights, ids = make_inputs(150, 160, 48, 8, 2, torch.float32, seed=33)
    ids[:, 0] = 0
    ids[:65, 1], ids[65:129, 1] = 1, 2
    ids[129:, 1] = 3 + torch.arange(21) % 5
    h1, h2 = tm.pick_configs(150, 2, 8, 160, 48)
    assert all(g["BLOCK_M"] == 64 and g["HEAVY_M"] == 128 for g in (h1, h2))  # the default's heavy tiles
    # (heavy first: a later call's output may reuse an earlier one's memory, stale rows in it)
    got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(h1, h2))
    expect = fused_moe_reference(x, w13, w2, weights, ids)
    assert rel_err(got, expect) <= TOL[torch.float32]
    one = (one_height(h1), one_height(h2))
    assert rel_err(got, tm.fused_moe_triton(x, w13, w2, weights, ids, configs=one)) <= 1e-6
    halves = (dict(h1, HEAVY_STAGES=2, HALF_TAIL=True), dict(h2, HEAVY_STAGES=2, HALF_TAIL=True, GROUP_M=2))
    assert rel_err(tm.fused_moe_triton(x, w13, w2, weights, ids, configs=halves), got) <= 1e-6


def test_decode_narrow_gemm2_tail_gives_the_same_bits():
    # hidden 160: GEMM2 in two 128-column tiles (the second 32 wide) or, for the last row tiles
    # in use, three 64-column ones (the last 32 wide). Expert 0 has 20 rows: two row tiles.
    x, w13, w2, weights, ids = make_inputs(10, 160, 24, 6, 2, torch.float32, seed=23)
    ids[:, 0] = 0
    g1, g2 = tm.pick_configs(10, 2, 6, 160, 24, one_launch=True)
    wide = (g1, dict(g2, BLOCK_N=128))
    expect = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=wide)
    assert rel_err(expect, fused_moe_reference(x, w13, w2, weights, ids)) <= TOL[torch.float32]
    for narrow in (1, 2, 3, 50):  # 50: more than the row tiles in use, so all of them narrow
        got = tm.fused_moe_triton(x, w13, w2, weights, ids, configs=(g1, dict(wide[1], NARROW_TAIL=narrow)))
        # The interpreter's tl.dot is numpy's matmul, whose summation order depends on the tile's
        # width on some CPUs (AVX-512: the last bits differ): same tiles written, fp32 rounding apart.
        # The compiled kernels give the same bits (tests/kernels/test_triton_moe_gpu.py).
        assert rel_err(got, expect) <= 1e-6, narrow
    assert tm.decode_items(20, 6, 160, 24, (g1, dict(wide[1], NARROW_TAIL=3)))[1] == (20 // 16 + 6 + 3) * 2
    # A narrow item that waits in vain writes NaN rows of its own width.
    check_decode_wait_gives_up(tm, x[:3], w13, w2, ids[:3], configs=(g1, dict(wide[1], NARROW_TAIL=1)))


def test_operand_bytes_counts_whole_weight_columns_per_row_tile_and_rows_per_column_tile():
    # Experts of 130, 0 and 5 rows in 128-row tiles: three row tiles (128, 2 and 5 rows) each load
    # their expert's weights whole; 135 rows load once per column tile (2 in GEMM1, 2 in GEMM2).
    g1, g2 = dict(BLOCK_M=128, BLOCK_N=16), dict(BLOCK_N=32)
    got = tm.operand_bytes([130, 0, 5], 64, 32, (g1, g2))
    assert got == dict(gemm1_a=135 * 64 * 2 * 2, gemm1_b=3 * 2 * 32 * 64 * 2, gemm2_a=135 * 32 * 2 * 2,
                       gemm2_b=3 * 64 * 32 * 2)
    # A narrow GEMM2 tail: the last two row tiles (7 rows) load their rows once per 16-wide column tile.
    narrow = tm.operand_bytes([130, 0, 5], 64, 32, (g1, dict(g2, NARROW_TAIL=2)))
    assert narrow["gemm2_a"] == (128 * 2 + 7 * 4) * 32 * 2 and narrow["gemm2_b"] == got["gemm2_b"]
    assert sum(tm.operand_bytes([0, 0], 64, 32, (g1, g2)).values()) == 0
    # Heavy tiles: experts of 100 and 16 rows in 16-row tiles with HEAVY_M 64: 100 rows in two
    # tiles (64, 36), 16 in one light tile: three weight loads instead of eight.
    light = dict(BLOCK_M=16, BLOCK_N=16)
    heavy = tm.operand_bytes([100, 16], 64, 32, (dict(light, HEAVY_M=64), g2))
    assert heavy["gemm1_b"] == 3 * 2 * 32 * 64 * 2 and heavy["gemm2_b"] == 3 * 64 * 32 * 2
    assert tm.operand_bytes([100, 16], 64, 32, (light, g2))["gemm1_b"] == 8 * 2 * 32 * 64 * 2
    assert heavy["gemm1_a"] == 116 * 64 * 2 * 2


# The test takes every GEMM1 ticket beforehand, so the tickets past the last item run too: they
# must do nothing (no modulo by a zero-sized tile count, which numpy warns about).
@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_decode_wait_gives_up_with_nan_rows_and_the_error_word():
    x, w13, w2, _, ids = make_inputs(3, 32, 16, 4, 2, torch.float32, seed=4)
    check_decode_wait_gives_up(tm, x, w13, w2, ids)


def test_decode_timeline_needs_compiled_code_and_the_grid_shape():
    x, w13, w2, weights, ids = make_inputs(3, 32, 16, 4, 2, torch.float32, seed=6)
    configs = tm.pick_configs(3, 2, 4, 32, 16, one_launch=True)
    items = sum(tm.decode_items(6, 4, 32, 16, configs))
    buf = torch.zeros(items, tm.TIMELINE_WORDS, dtype=torch.int64)
    with pytest.raises(ValueError, match="compiled CUDA code only"):
        tm.fused_moe_triton(x, w13, w2, weights, ids, configs=configs, timeline=buf)
    with pytest.raises(ValueError, match="one-launch decode kernel"):
        tm.fused_moe_triton(x, w13, w2, weights, ids, configs=tm.pick_configs(3, 2, 4, 32, 16), timeline=buf)
