"""The Triton FP8 MoE kernels' logic on the CPU, under the Triton interpreter, at tiny sizes.

The interpreter runs fp8 dots (it widens e4m3 to fp16, exactly) but rounds fp32 -> e4m3 casts
wrongly, which the kernels correct under ``RNE_FIX`` (see ``kernels/cuda/fp8_tiles.to_fp8``). Skipped on
machines with CUDA, where the GPU tests cover the compiled kernels.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
tl = triton.language

from mok_serve.kernels import fused_moe_fp8_reference  # noqa: E402
from mok_serve.kernels.cuda.configs import fp8_split_max_tokens, one_height  # noqa: E402
from mok_serve.kernels.fp8 import dequantize_fp8_groups, quantize_fp8_groups  # noqa: E402
from moe_test_utils import interpreted_cuda_modules, make_fp8_inputs, rel_err  # noqa: E402

tm, tf, _ = interpreted_cuda_modules()
from mok_serve.kernels.cuda import fp8_tiles  # noqa: E402  (reloaded with interpreted kernels above)


@triton.jit
def cast_kernel(x_ptr, y_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y_ptr + offs, fp8_tiles.to_fp8(tl.load(x_ptr + offs), True))


def make(tokens, hidden, inter, experts, top_k, dtype=torch.bfloat16, seed=0, num_global=None, block=(128, 128)):
    """(x, fp8 experts, weights, ids); the experts are quantized from float32."""
    x, _, _, weights, ids, fp8 = make_fp8_inputs(
        tokens, hidden, inter, experts, top_k, dtype, seed, num_global, block, weight_dtype=torch.float32
    )
    return x, fp8, weights, ids


def test_to_fp8_is_torchs_e4m3_cast_bit_for_bit_signed_zeros_and_subnormals_too():
    # What quantization can produce (|x| <= 448): normals, ties, carries into the exponent,
    # subnormals and values that round to zero, of both signs, and -0.0. (Triton 3.7's interpreter
    # negates 0.0 to +0.0, so the sign is set by bits.)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(2048, generator=g) * torch.logspace(-12, 2.3, 2048)).clamp(-448, 448)
    grid = torch.tensor([0.0, -0.0, 2.0**-10, -(2.0**-10), 2.0**-9 * 1.5, -(2.0**-9) * 2.5, 448.0, -448.0, 0.0087])
    x = torch.cat([x, grid, x.neg()]).float()
    y = torch.empty(x.numel(), dtype=torch.float8_e4m3fn)
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n)
    padded[: x.numel()] = x
    out = torch.empty(n, dtype=torch.float8_e4m3fn)
    cast_kernel[(1,)](padded, out, N=n)
    y = out[: x.numel()]
    assert torch.equal(y.view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.signbit(y[x.numel() - 2048 - 9 + 1].float())  # -0.0 stays -0.0


def test_quantize_pass_is_the_torch_quantization_bit_for_bit():
    tokens, hidden, experts, top_k = 37, 200, 3, 2
    g = torch.Generator().manual_seed(1)
    # Columns from 1e-9 to 1e3 (e4m3 subnormals, rounding carries, ties), a zero row, a NaN.
    x = (torch.randn(tokens, hidden, generator=g) * torch.logspace(-9, 3, hidden)).to(torch.bfloat16)
    x[4] = 0
    x[6, 150] = float("nan")
    ids = torch.randint(0, experts, (tokens, top_k), generator=g, dtype=torch.int32)
    counts = torch.full((experts,), -7, dtype=torch.int32)
    sorted_rows = torch.full((tokens * top_k,), -7, dtype=torch.int32)
    xq = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn)
    xs = torch.empty(tokens, 2)
    tickets = torch.full((37,), 7, dtype=torch.int32)  # GEMM1's split-tile tickets: zeroed here
    programs = experts + triton.cdiv(tokens, 32) * 2
    tf._fp8_schedule_quantize_kernel[(programs,)](
        ids, ids, counts, sorted_rows, torch.zeros(4, dtype=torch.int64), tokens * top_k, experts, experts,
        ids.stride(0), ids.stride(1),
        x, xq, xs, tokens, hidden, x.stride(0), x.stride(1), tickets, 37,
        TOPK=top_k, HAS_MAP=False, BLOCK=16, QROWS=32, RNE_FIX=True, PDL=False,
    )
    assert not tickets.any()
    flat = ids.reshape(-1).long()
    assert counts.tolist() == torch.bincount(flat, minlength=experts).tolist()
    assert sorted_rows.tolist() == torch.argsort(flat, stable=True).tolist()
    q_ref, s_ref = quantize_fp8_groups(x)
    assert torch.isnan(xs[6, 1]) and (xs[4] > 0).all()
    torch.testing.assert_close(xs, s_ref, rtol=0, atol=0, equal_nan=True)
    finite = ~torch.isnan(q_ref.float())
    assert torch.equal(xq.view(torch.uint8)[finite], q_ref.view(torch.uint8)[finite])
    # The NaN group dequantizes to NaN through its scale (the interpreter's cast does not keep the
    # NaN itself; the GPU's does).
    assert torch.isnan(dequantize_fp8_groups(xq, xs)[~finite]).all()


@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k,dtype",
    [
        (1, 256, 128, 4, 2, torch.bfloat16),
        (21, 128, 256, 5, 3, torch.bfloat16),
        (9, 200, 72, 3, 2, torch.bfloat16),  # H and I not multiples of 128
        (13, 256, 128, 4, 2, torch.float16),
    ],
)
def test_matches_reference(tokens, hidden, inter, experts, top_k, dtype):
    x, fp8, weights, ids = make(tokens, hidden, inter, experts, top_k, dtype, seed=tokens)
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, fused_moe_fp8_reference(x, *fp8, weights, ids)) <= 1e-3


def test_expert_map_duplicates_and_remote_tokens():
    tokens, local, top_k, num_global = 9, 3, 4, 8
    x, fp8, weights, _ = make(tokens, 128, 128, local, top_k, seed=11)
    g = torch.Generator().manual_seed(12)
    ids = torch.randint(0, num_global, (tokens, top_k), generator=g, dtype=torch.int64)  # duplicates allowed
    ids[0] = torch.tensor([0, 2, 5, 6])  # all remote
    expert_map = torch.tensor([-1, 0, -1, 2, 1, -1, -1, 0], dtype=torch.int32)
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, expert_map=expert_map)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert rel_err(out, fused_moe_fp8_reference(x, *fp8, weights, ids, expert_map=expert_map)) <= 1e-3


@pytest.mark.parametrize("block", [(64, 128), (256, 128)])
def test_weight_n_blocks_other_than_128(block):
    x, fp8, weights, ids = make(7, 128, 192, 3, 2, seed=3, block=block)
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, block_shape=block)
    assert rel_err(out, fused_moe_fp8_reference(x, *fp8, weights, ids, block_shape=block)) <= 1e-3


def test_k_block_other_than_128_raises():
    x, fp8, weights, ids = make(3, 128, 128, 2, 1, block=(128, 64))
    with pytest.raises(ValueError, match="need a K block of 128"):
        tf.fused_moe_fp8_triton(x, *fp8, weights, ids, block_shape=(128, 64))


@pytest.mark.parametrize(
    "cfg",
    [
        (dict(BLOCK_M=128), dict(BLOCK_M=64, BLOCK_N=32)),
        (dict(BLOCK_M=64, GROUP_M=3), dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=2)),
        # operands swapped (weight columns on the M side), 16- and 32-row token tiles
        (dict(BLOCK_M=16, SWAP_AB=True), dict(BLOCK_M=16, BLOCK_N=64, SWAP_AB=True)),
        (dict(BLOCK_M=32, SWAP_AB=True), dict(BLOCK_M=32, BLOCK_N=128, SWAP_AB=True)),
    ],
)
def test_tile_configs_agree_bitwise(cfg):
    x, fp8, weights, ids = make(40, 128, 256, 4, 2, seed=9)
    g1, g2 = ({**c, "num_warps": 4, "num_stages": 2} for c in cfg)
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(g1, g2))
    assert torch.equal(out, tf.fused_moe_fp8_triton(x, *fp8, weights, ids))


def test_gemm2_half_tail_gives_the_same_bits():
    # 64-row tiles; the last tile of an expert runs 32 rows when they hold what is left. Expert 0's
    # 150 rows: two full tiles and 22 rows in a half one; expert 1's 20: one half tile; experts 2
    # and 3, 65 each: a full tile and a half one for the last row.
    x, fp8, weights, ids = make(150, 128, 256, 4, 2, seed=14)
    ids[:, 0] = 0
    ids[:20, 1], ids[20:85, 1], ids[85:, 1] = 1, 2, 3
    g1 = dict(BLOCK_M=64, num_warps=4, num_stages=2)
    g2 = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
    whole = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(g1, g2))
    assert rel_err(whole, fused_moe_fp8_reference(x, *fp8, weights, ids)) <= 1e-3
    half = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(g1, dict(g2, HALF_TAIL=True)))
    assert torch.equal(half, whole)


@pytest.mark.parametrize(
    "g1,g2,heavy",
    [
        # swapped 16-row tiles, 64-row heavy ones; GEMM1 in 64-column programs (two a group)
        (dict(BLOCK_M=16, SWAP_AB=True, BLOCK_N=64), dict(BLOCK_M=16, BLOCK_N=64, SWAP_AB=True), 64),
        # 32-row heavy tiles, grouped program order, GEMM1 whole groups
        (dict(BLOCK_M=16, SWAP_AB=True, GROUP_M=4), dict(BLOCK_M=16, BLOCK_N=64, SWAP_AB=True, GROUP_M=4), 32),
        # unswapped 64-row tiles, 128-row heavy ones; GEMM2 half tails beside them
        (dict(BLOCK_M=64), dict(BLOCK_M=64, BLOCK_N=64, HALF_TAIL=True), 128),
        # unswapped 64-row tiles, 128-row heavy ones, GEMM1 in 64-column programs (the sweep's
        # "heavy128 n64": the width at which a 128-row FP8 GEMM1 tile does not spill)
        (dict(BLOCK_M=64, BLOCK_N=64), dict(BLOCK_M=64, BLOCK_N=64), 128),
    ],
)
def test_hot_experts_heavy_tiles_give_the_same_bits(g1, g2, heavy):
    # HEAVY_M: an expert with more than BLOCK_M rows runs HEAVY_M-row tiles (chosen from the counts
    # on the device), the others BLOCK_M-row ones. Expert 0 holds every token's first slot (100
    # rows: heavy tiles and a short last one), expert 1 BLOCK_M + 1 rows, expert 2 exactly BLOCK_M,
    # expert 3 the rest. The same bits as one height.
    bm = g1["BLOCK_M"]
    x, fp8, weights, ids = make(100, 128, 128, 4, 2, seed=31)
    ids[:, 0] = 0
    ids[: bm + 1, 1], ids[bm + 1 : 2 * bm + 1, 1], ids[2 * bm + 1 :, 1] = 1, 2, 3
    base = ({**g1, "num_warps": 4, "num_stages": 2}, {**g2, "num_warps": 4, "num_stages": 2})
    hot = tuple(dict(c, HEAVY_M=heavy, HEAVY_STAGES=3) for c in base)
    # (heavy first: a later call's output buffer may reuse an earlier one's memory, stale rows in it)
    heavy_out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=hot)
    assert rel_err(heavy_out, fused_moe_fp8_reference(x, *fp8, weights, ids)) <= 1e-3
    assert torch.equal(heavy_out, tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=base))
    # Heavy tiles in one GEMM only: rows keep their sorted positions, so the GEMMs need not agree.
    assert torch.equal(tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(hot[0], base[1])), heavy_out)


def test_heavy_tiles_are_refused_where_they_cannot_run():
    x, (w13, w2, s13, s2), weights, ids = make(4, 128, 128, 2, 1)
    g1, g2 = dict(BLOCK_M=16, SWAP_AB=True, num_warps=4, num_stages=2), dict(BLOCK_M=16, BLOCK_N=64, SWAP_AB=True)
    for bad in (24, 16, 8):  # not a multiple of BLOCK_M, or not above it
        with pytest.raises(ValueError, match="HEAVY_M must be a multiple of BLOCK_M above it"):
            tf.fused_moe_fp8_triton(x, w13, w2, s13, s2, weights, ids, configs=(dict(g1, HEAVY_M=bad), g2))
    with pytest.raises(ValueError, match="one height"):
        tf.fused_moe_fp8_triton(x, w13, w2, s13, s2, weights, ids, configs=(dict(g1, ONE_LAUNCH=True, HEAVY_M=64), g2))


@pytest.mark.parametrize(
    "tokens,inter,g1",
    [
        (40, 256, dict(BLOCK_M=16, SWAP_AB=True, BLOCK_N=64)),  # split GEMM1: the last of a group quantizes it
        (40, 200, dict(BLOCK_M=16, SWAP_AB=True, BLOCK_N=32)),  # four programs a group, a short last group
        (9, 192, dict(BLOCK_M=32, SWAP_AB=True)),  # one 128-column program a group
    ],
)
def test_one_launch_decode_gives_the_two_launches_bits(tokens, inter, g1):
    # Both GEMMs as one launch (ONE_LAUNCH): GEMM2 items wait for their row tile's GEMM1 items; a
    # busy expert has several row tiles. The same bits as two launches, twice (the sync words and
    # tickets start from zero each call).
    x, fp8, weights, ids = make(tokens, 128, inter, 4, 2, seed=tokens + inter + 1)
    ids[: tokens // 2, 0] = 0
    g1 = {**g1, "num_warps": 4, "num_stages": 2}
    g2 = dict(BLOCK_M=g1["BLOCK_M"], BLOCK_N=64, SWAP_AB=True, num_warps=4, num_stages=2)
    two = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(g1, g2))
    assert rel_err(two, fused_moe_fp8_reference(x, *fp8, weights, ids)) <= 1e-3
    for _ in range(2):
        one = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(dict(g1, ONE_LAUNCH=True), g2))
        assert torch.equal(one, two)


def test_one_launch_decode_wait_that_runs_out_gives_nan_rows_and_the_error_word():
    # The row tiles' GEMM1 counts start at -5: their one column tile's item brings them to -4, never
    # to 1, so every GEMM2 item's wait runs out (3 polls): NaN rows and the error word, no hang.
    x, (w13, w2, s13, s2), weights, ids = make(6, 128, 128, 2, 2, seed=5)
    rows, inter, hidden = 12, 128, 128
    xq, xs = quantize_fp8_groups(x)
    counts = torch.tensor([6, 6], dtype=torch.int32)
    sorted_rows = torch.arange(12, dtype=torch.int32)  # any valid order: the rows are not computed
    g1 = dict(BLOCK_M=16, SWAP_AB=True, num_warps=4, num_stages=2)
    g2 = dict(BLOCK_M=16, BLOCK_N=64, SWAP_AB=True, num_warps=4, num_stages=2)
    n_sync, n_tickets = tf.fp8_decode_sync_words(rows, 2, inter, g1)
    sync = torch.zeros(n_sync + n_tickets, dtype=torch.int32)
    act_q = torch.empty(rows, inter, dtype=w2.dtype)
    act_s = torch.empty(rows, 1)
    y = torch.zeros(rows, hidden, dtype=x.dtype)
    sync[2:n_sync] = -5
    tf.launch_fp8_decode_experts(xq, xs, w13, s13, w2, s2, act_q, act_s, None, y, sorted_rows, counts, sync, rows, 2,
                                 (g1, g2), in_dtype=x.dtype, scale_bn=128, interpret=True, max_polls=3)
    assert torch.isnan(y).all() and int(sync[1]) == 1


@pytest.mark.parametrize(
    "tokens,inter,g1",
    [
        (40, 256, dict(BLOCK_M=16, SWAP_AB=True)),  # two full groups
        (40, 200, dict(BLOCK_M=16, SWAP_AB=True)),  # a last group of 72 columns: two programs, one short
        (9, 192, dict(BLOCK_M=32, SWAP_AB=True)),  # a last group of 64 columns: one program quantizes alone
        (40, 256, dict(BLOCK_M=64, GROUP_M=2)),  # unswapped 64-row tiles
        (40, 200, dict(BLOCK_M=16, SWAP_AB=True, BLOCK_N=32)),  # four programs a group; the last group's 72: three
    ],
)
def test_split_gemm1_column_tiles_give_the_same_bits(tokens, inter, g1):
    # BLOCK_N 64 or 32: two or four programs per activation group, the last to arrive quantizes
    # the group from the parts all wrote (int32 tickets the schedule launch zeroes). The same bits as one
    # 128-column program per group, and run twice (the tickets start from zero each call).
    x, fp8, weights, ids = make(tokens, 128, inter, 4, 2, seed=tokens + inter)
    ids[: tokens // 2, 0] = 0  # a busy expert: several row tiles
    base = {**g1, "num_warps": 4, "num_stages": 2, "BLOCK_N": 128}
    split_n = g1.get("BLOCK_N", 64)
    g2 = dict(BLOCK_M=g1["BLOCK_M"], BLOCK_N=64, SWAP_AB=g1.get("SWAP_AB", False), num_warps=4, num_stages=2)
    whole = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(base, g2))
    assert rel_err(whole, fused_moe_fp8_reference(x, *fp8, weights, ids)) <= 1e-3
    for _ in range(2):
        split = tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(dict(base, BLOCK_N=split_n), g2))
        assert torch.equal(split, whole)


def test_split_gemm1_needs_its_buffers_and_a_half_group():
    x, fp8, weights, ids = make(4, 128, 128, 2, 1, seed=5)
    g1, g2 = tf.pick_configs_fp8(4, 1, 2, 128, 128)
    with pytest.raises(ValueError, match="BLOCK_N is 128 .* 64 or 32"):
        tf.fused_moe_fp8_triton(x, *fp8, weights, ids, configs=(dict(g1, BLOCK_N=16), g2))
    rows = ids.numel()
    xq = torch.empty(4, 128, dtype=torch.float8_e4m3fn)
    act_q = torch.empty(rows, 128, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="need act_h"):
        tf.launch_fp8_gemm1(xq, torch.empty(4, 1), fp8[0], fp8[2], act_q, torch.empty(rows, 1),
                            torch.zeros(rows, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), rows, 1,
                            dict(g1, BLOCK_N=64), in_dtype=x.dtype, scale_bn=128, interpret=True)
    act_h = torch.empty(rows, 128, dtype=x.dtype)
    with pytest.raises(ValueError, match="int32 tickets"):
        tf.launch_fp8_gemm1(xq, torch.empty(4, 1), fp8[0], fp8[2], act_q, torch.empty(rows, 1),
                            torch.zeros(rows, dtype=torch.int32), torch.zeros(2, dtype=torch.int32), rows, 1,
                            dict(g1, BLOCK_N=64), act_h=act_h, in_dtype=x.dtype, scale_bn=128, interpret=True)
    # The one-launch decode kernel (tiles of one height): its sync words and, with split GEMM1 tiles, act_h.
    g1_split = dict(one_height(g1), BLOCK_N=64, SWAP_AB=True, BLOCK_M=16, num_warps=4)
    g2_swap = dict(one_height(g2), SWAP_AB=True, BLOCK_M=16, num_warps=4)
    words = sum(tf.fp8_decode_sync_words(rows, 2, 128, g1_split))
    one = (xq, torch.empty(4, 1), fp8[0], fp8[2], fp8[1], fp8[3], act_q, torch.empty(rows, 1))
    tail = (torch.empty(rows, 128, dtype=x.dtype), torch.zeros(rows, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="sync must be"):
        tf.launch_fp8_decode_experts(*one, act_h, *tail, torch.zeros(words - 1, dtype=torch.int32), rows, 1,
                                     (g1_split, g2_swap), in_dtype=x.dtype, scale_bn=128, interpret=True)
    with pytest.raises(ValueError, match="need act_h"):
        tf.launch_fp8_decode_experts(*one, None, *tail, torch.zeros(words, dtype=torch.int32), rows, 1,
                                     (g1_split, g2_swap), in_dtype=x.dtype, scale_bn=128, interpret=True)
    with pytest.raises(ValueError, match="one height"):
        tf.launch_fp8_decode_experts(*one, act_h, *tail, torch.zeros(words, dtype=torch.int32), rows, 1,
                                     (g1_split, dict(g2_swap, BLOCK_M=32)), in_dtype=x.dtype, scale_bn=128,
                                     interpret=True)


def test_token_alone_equals_token_in_a_batch():
    x, fp8, weights, ids = make(12, 128, 128, 3, 2, seed=4)
    batch = tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
    alone = tf.fused_moe_fp8_triton(x[7:8], *fp8, weights[7:8], ids[7:8])
    assert torch.equal(alone[0], batch[7])


def test_out_of_range_ids_are_masked_and_reported_at_the_next_call():
    """As the bf16 kernels (the schedule is theirs): rows outside [-1, E) and -1 rows contribute
    nothing, the out-of-range values are raised by the next call, -1 reports nothing."""
    x, fp8, weights, ids = make(4, 128, 128, 4, 2, seed=1)
    bad = ids.clone()
    bad[1, 0] = 4
    bad[2, 1] = -3
    bad[3, 1] = -1
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, bad)
    keep = (bad == ids).float()
    assert rel_err(out, fused_moe_fp8_reference(x, *fp8, weights * keep, ids)) <= 1e-3
    with pytest.raises(ValueError, match=r"found ids in \[-3, 4\] outside the valid range \[-1, 4\)"):
        tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
    unrouted = ids.clone()
    unrouted[0, 0] = -1
    tf.fused_moe_fp8_triton(x, *fp8, weights, unrouted)
    tf.fused_moe_fp8_triton(x, *fp8, weights, ids)


def test_nan_stays_in_its_token():
    x, fp8, weights, ids = make(12, 128, 128, 3, 2, seed=2)
    x[5, 3] = float("nan")
    out = tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
    assert torch.isnan(out[5]).all()
    assert not torch.isnan(torch.cat([out[:5], out[6:]])).any()


def test_split_max_tokens_is_where_the_picker_stops_splitting():
    for hidden, inter, experts, top_k in ((7168, 2048, 256, 8), (2048, 768, 128, 8), (7168, 2048, 32, 8), (192, 96, 2, 4)):
        most = fp8_split_max_tokens(top_k, experts)
        assert most >= 1
        split = [tf.pick_configs_fp8(t, top_k, experts, hidden, inter)[0].get("BLOCK_N", tf.GROUP) < tf.GROUP
                 for t in (1, most, most + 1)]
        assert split == [True, True, False], (hidden, inter, experts, top_k, most)


def test_pick_configs_static_wgmma_sized_and_within_registers():
    for tokens in (1, 8, 32, 128, 512, 2048, 8192):
        for hidden, inter, experts, top_k in ((7168, 2048, 256, 8), (2048, 768, 128, 8), (5120, 1536, 160, 8)):
            g1, g2 = tf.pick_configs_fp8(tokens, top_k, experts, hidden, inter)
            avg = tokens * top_k / experts
            assert g1.get("SWAP_AB", False) == g2.get("SWAP_AB", False) == (avg <= 16)
            if avg <= 16:  # wgmma's M side: the weight columns (GEMM1's gate/up tile is 256 wide)
                assert g1["BLOCK_M"] == g2["BLOCK_M"] == 16 and g2["BLOCK_N"] >= 64
                assert g1["HEAVY_M"] == g2["HEAVY_M"] == 64  # experts with more than 16 rows
            else:
                assert g1["BLOCK_M"] >= 64 and g2["BLOCK_M"] >= 64
            # fp32 accumulator + one K block's dot result: at most 128 registers per thread (configs
            # above that spilled when compiled for sm_90a; see test_triton_moe_fp8_compile.py).
            bn1 = g1.get("BLOCK_N", tf.GROUP)  # 64 (two programs per activation group) at 16-row tiles
            assert bn1 == (64 if avg <= 16 else 128)
            rows1, rows2 = g1.get("HEAVY_M") or g1["BLOCK_M"], g2.get("HEAVY_M") or g2["BLOCK_M"]
            assert 2 * rows1 * 2 * bn1 // (32 * g1["num_warps"]) <= 128
            assert 2 * rows2 * g2["BLOCK_N"] // (32 * g2["num_warps"]) <= 128
            # Pipelined fp8 A and B tiles fit in shared memory (227 KB per block on Hopper).
            assert g1["num_stages"] * (g1["BLOCK_M"] + 2 * bn1) * tf.GROUP <= 216 * 1024
            assert g2["num_stages"] * (g2["BLOCK_M"] + g2["BLOCK_N"]) * tf.GROUP <= 216 * 1024
