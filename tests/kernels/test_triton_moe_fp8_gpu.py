"""The Triton FP8 (block-scaled) MoE on a CUDA GPU (Hopper): numerics, determinism, graphs.

Run with ``pytest -m gpu tests/kernels/test_triton_moe_fp8_gpu.py``; skipped without CUDA. Every check
draws fresh random inputs (the seed is printed so a failure can be replayed) and poisons outputs
where the kernel writes them. The reference is ``fused_moe_fp8_reference`` on the GPU (fp32 GEMMs
on dequantized operands, one expert at a time).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from mok_serve.kernels import fused_moe_fp8, fused_moe_fp8_reference, warm_up, warm_up_token_counts  # noqa: E402
from mok_serve.kernels.fp8 import quantize_fp8_blocks  # noqa: E402
from mok_serve.kernels.cuda.configs import one_height  # noqa: E402
from mok_serve.kernels.cuda.moe_fp8 import fused_moe_fp8_triton, pick_configs_fp8  # noqa: E402
from moe_test_utils import (  # noqa: E402
    DEV, FAMILIES, SHAPES, cached_weights, check_bad_ids_masked_and_reported, check_batch_invariant, check_graph_replay,
    check_heavy_tiles_give_the_same_bits, check_warm_up_leaves_nothing_to_compile,
    check_nan_stays_in_its_token, fresh_seed, poisoned_call, rel_err, routing,
)


def weights_for(family):
    """(w13, w2, w13_scale, w2_scale) of a family: random bf16 experts quantized to FP8 16 experts
    at a time (one family cached at a time: up to 17 GB)."""

    def make():
        s = SHAPES[family]
        E, H, I = s["routed_experts"], s["hidden"], s["moe_intermediate"]
        g = torch.Generator(device=DEV).manual_seed(fresh_seed())
        q13 = torch.empty(E, 2 * I, H, device=DEV, dtype=torch.float8_e4m3fn)
        q2 = torch.empty(E, H, I, device=DEV, dtype=torch.float8_e4m3fn)
        s13 = torch.empty(E, -(-2 * I // 128), -(-H // 128), device=DEV)
        s2 = torch.empty(E, -(-H // 128), -(-I // 128), device=DEV)
        for e0 in range(0, E, 16):
            sl = slice(e0, e0 + 16)
            n = q13[sl].shape[0]
            w13 = torch.randn(n, 2 * I, H, device=DEV, dtype=torch.bfloat16, generator=g) / H**0.5
            w2 = torch.randn(n, H, I, device=DEV, dtype=torch.bfloat16, generator=g) / I**0.5
            (q13[sl], s13[sl]), (q2[sl], s2[sl]) = quantize_fp8_blocks(w13), quantize_fp8_blocks(w2)
        return q13, q2, s13, s2

    return cached_weights(family, make)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_against_dequantized_reference(family):
    fp8 = weights_for(family)
    E, H = fp8[0].shape[0], fp8[0].shape[2]
    top_k = SHAPES[family]["top_k"]
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for tokens in (1, 7, 128, 1024):
        for skewed in (False, True):
            x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
            tw, ids = routing(tokens, E, top_k, skewed=skewed, gen=g)
            out = poisoned_call(fused_moe_fp8, x, *fp8, tw, ids)
            assert out.shape == x.shape and out.dtype == x.dtype
            err = rel_err(out, fused_moe_fp8_reference(x, *fp8, tw, ids))
            print(f"{family} T={tokens} skewed={skewed} rel_err={err:.2e}")
            assert err <= 3e-2, (family, tokens, skewed, err)


def test_deepseek_v3_token_counts():
    fp8 = weights_for("DeepSeek-V3")
    E, H = fp8[0].shape[0], fp8[0].shape[2]
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for tokens, skewed in ((1, False), (33, False), (512, True), (2048, False), (4096, True)):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, skewed=skewed, gen=g)
        err = rel_err(poisoned_call(fused_moe_fp8, x, *fp8, tw, ids), fused_moe_fp8_reference(x, *fp8, tw, ids))
        configs = pick_configs_fp8(tokens, 8, E, H, 2048)
        print(f"DeepSeek-V3 T={tokens} skewed={skewed} configs={configs} rel_err={err:.2e}")
        assert err <= 3e-2, (tokens, skewed, err)


def test_tile_regimes_give_the_same_bits():
    """Swapped 16-row tiles (with 64-row hot-expert ones), 64- and 128-row tiles, and the sweep's
    swapped 32-row tiles and 64-row 4-warp and half-tail GEMM2 tiles: every row gets the same bits."""
    fp8 = weights_for("DeepSeek-V3")
    E, H, I = fp8[0].shape[0], fp8[0].shape[2], fp8[1].shape[2]
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    regimes = [pick_configs_fp8(t, 8, E, H, I) for t in (1, 512, 1024, 4096)]
    assert [c[0]["BLOCK_M"] for c in regimes] == [16, 16, 64, 64] and regimes[3][1]["BLOCK_M"] == 128
    g1, g2 = regimes[3]
    m32 = dict(BLOCK_M=32, BLOCK_N=128)  # GEMM1 at 128 columns: 32 x 256 swapped tiles, 4 warps
    regimes += [(g1, dict(g2, BLOCK_M=64, num_warps=4)), (g1, dict(g2, HALF_TAIL=True)),
                tuple(dict(one_height(c), **m32) for c in regimes[1])]
    for tokens in (3, 200, 2000):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, gen=g)
        outs = [poisoned_call(fused_moe_fp8_triton, x, *fp8, tw, ids, configs=c) for c in regimes]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), tokens


def test_split_gemm1_column_tiles_give_the_same_bits():
    """GEMM1 in 64- or 32-column programs, two or four per activation group (the last to finish
    quantizes the group): the same bits as 128-column ones, for both families at decode and streaming sizes,
    uniform and skewed, and replayed in a CUDA graph."""
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        fp8 = weights_for(family)
        E, H, I = fp8[0].shape[0], fp8[0].shape[2], fp8[1].shape[2]
        for tokens in (1, 8, 100, 300):
            for skewed in (False, True):
                x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
                tw, ids = routing(tokens, E, 8, skewed=skewed, gen=g)
                g1, g2 = pick_configs_fp8(tokens, 8, E, H, I)
                whole = poisoned_call(fused_moe_fp8_triton, x, *fp8, tw, ids, configs=(dict(g1, BLOCK_N=128), g2))
                for bn in (64, 32):
                    split = poisoned_call(fused_moe_fp8_triton, x, *fp8, tw, ids, configs=(dict(g1, BLOCK_N=bn), g2))
                    assert torch.equal(split, whole), (family, tokens, skewed, bn)
        x = torch.randn(8, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(8, E, 8, gen=g)
        configs = (dict(pick_configs_fp8(8, 8, E, H, I)[0], BLOCK_N=64), pick_configs_fp8(8, 8, E, H, I)[1])
        expect = fused_moe_fp8_triton(x, *fp8, tw, ids, configs=(dict(configs[0], BLOCK_N=128), configs[1]))
        graph = torch.cuda.CUDAGraph()
        static_x = x.clone()
        with torch.cuda.graph(graph):
            out = fused_moe_fp8_triton(static_x, *fp8, tw, ids, configs=configs)
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expect), family


def test_hot_expert_heavy_tiles_give_the_same_bits():
    """Hot experts' tiles beside the 16-row decode tiles (the default's: an expert with more than
    16 rows in 64-row tiles with 4 stages; the sweep's 2 stages and GROUP_M 4): the same bits as
    one tile height."""
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        fp8 = weights_for(family)
        E, H, I = fp8[0].shape[0], fp8[0].shape[2], fp8[1].shape[2]
        for t in (64, 8, 150):
            g1, g2 = pick_configs_fp8(t, 8, E, H, I)
            assert g1["BLOCK_M"] == 16 and g1["HEAVY_M"] == g2["HEAVY_M"] == 64, (family, t)
        check_heavy_tiles_give_the_same_bits(
            fused_moe_fp8_triton, fp8, (64, 8, 150), lambda t: pick_configs_fp8(t, 8, E, H, I),
            [dict(HEAVY_M=64, HEAVY_STAGES=4), dict(HEAVY_M=64, HEAVY_STAGES=2),
             dict(HEAVY_M=64, HEAVY_STAGES=4, GROUP_M=4)],
        )


def test_hot_expert_128_row_tiles_in_the_64_row_regime_give_the_same_bits():
    """The sweep's 128-row hot-expert tiles beside the 64-row regime's tiles (GEMM1 in 64-column
    programs; GEMM2 at 64 columns, or at 128 on 8 warps): the same bits as one tile height."""
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        fp8 = weights_for(family)
        E, H, I = fp8[0].shape[0], fp8[0].shape[2], fp8[1].shape[2]
        counts = tuple(t for t in (1024, 2 * E + 8) if 16 < t * 8 / E <= 48)
        assert counts, family
        for t in counts:
            g1, g2 = pick_configs_fp8(t, 8, E, H, I)
            assert g1["BLOCK_M"] == 64 and "HEAVY_M" not in g1, (family, t)
        check_heavy_tiles_give_the_same_bits(
            fused_moe_fp8_triton, fp8, counts, lambda t: pick_configs_fp8(t, 8, E, H, I),
            [dict(HEAVY_M=128, HEAVY_STAGES=3, BLOCK_N=64), dict(HEAVY_M=128, HEAVY_STAGES=2, BLOCK_N=64),
             dict(HEAVY_M=128, HEAVY_STAGES=3, num_warps=8)],
        )


def test_one_launch_decode_gives_the_two_launches_bits():
    # GEMM2 items wait inside the launch for their row tile's GEMM1 items (split and whole column
    # tiles), under CUDA-graph replay too: the same bits as two launches.
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        fp8 = weights_for(family)
        E, H, I = fp8[0].shape[0], fp8[0].shape[2], fp8[1].shape[2]
        for tokens in (1, 8, 100):
            for skewed in (False, True):
                x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
                tw, ids = routing(tokens, E, 8, skewed=skewed, gen=g)
                g1, g2 = (one_height(c) for c in pick_configs_fp8(tokens, 8, E, H, I))  # one launch: one height
                two = poisoned_call(fused_moe_fp8_triton, x, *fp8, tw, ids, configs=(g1, g2))
                for bn in (128, g1.get("BLOCK_N", 128)):
                    one = poisoned_call(fused_moe_fp8_triton, x, *fp8, tw, ids,
                                        configs=(dict(g1, BLOCK_N=bn, ONE_LAUNCH=True), g2))
                    assert torch.equal(one, two), (family, tokens, skewed, bn)
        x = torch.randn(8, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(8, E, 8, gen=g)
        g1, g2 = (one_height(c) for c in pick_configs_fp8(8, 8, E, H, I))
        expect = fused_moe_fp8_triton(x, *fp8, tw, ids, configs=(g1, g2))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_moe_fp8_triton(x, *fp8, tw, ids, configs=(dict(g1, ONE_LAUNCH=True), g2))
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, expect), family


def test_fp16_int64_ids_and_strided_weights():
    q13, q2, s13, s2 = weights_for("Qwen3-30B-A3B")
    q2_strided = q2.transpose(1, 2).contiguous().transpose(1, 2)  # same values, GEMM2 without TMA
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    x = torch.randn(37, q13.shape[2], device=DEV, dtype=torch.float16, generator=g)
    tw, ids = routing(37, q13.shape[0], 8, gen=g)
    out = fused_moe_fp8(x, q13, q2, s13, s2, tw.half(), ids.long())
    assert out.dtype == torch.float16
    assert rel_err(out, fused_moe_fp8_reference(x, q13, q2, s13, s2, tw.half(), ids)) <= 3e-2
    assert torch.equal(fused_moe_fp8(x, q13, q2_strided, s13, s2, tw.half(), ids.long()), out)


def test_bitwise_repeatable_and_batch_invariant():
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        check_batch_invariant(fused_moe_fp8, weights_for(family), pick_configs_fp8, family)


def test_cuda_graph_capture_and_replay_with_new_data():
    check_graph_replay(fused_moe_fp8, weights_for("Qwen3-30B-A3B"))


def test_expert_map_with_remote_experts():
    fp8 = weights_for("Qwen3-235B-A22B")
    local, H = fp8[0].shape[0], fp8[0].shape[2]
    num_global = 2 * local
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    perm = torch.randperm(num_global, device=DEV, generator=g)
    expert_map = torch.full((num_global,), -1, device=DEV, dtype=torch.int32)
    expert_map[perm[:local]] = torch.arange(local, device=DEV, dtype=torch.int32)
    for tokens in (1, 33, 700):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, num_global, 8, gen=g)
        out = poisoned_call(fused_moe_fp8, x, *fp8, tw, ids, expert_map=expert_map)
        assert rel_err(out, fused_moe_fp8_reference(x, *fp8, tw, ids, expert_map=expert_map)) <= 3e-2
    # A token routed only to remote experts is exactly zero.
    ids[0] = perm[local : local + 8].to(torch.int32)
    out = fused_moe_fp8(x, *fp8, tw, ids, expert_map=expert_map)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_unrouted_and_out_of_range_ids_without_a_host_sync():
    fp8 = weights_for("Qwen3-235B-A22B")
    check_bad_ids_masked_and_reported(
        fused_moe_fp8, fp8, lambda x, tw, ids: fused_moe_fp8_reference(x, *fp8, tw, ids), 3e-2
    )


def test_nan_stays_in_its_token():
    check_nan_stays_in_its_token(fused_moe_fp8, weights_for("Qwen3-235B-A22B"))


def test_odd_shapes_not_multiples_of_128():
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    E, H, I = 6, 200, 72
    w13 = torch.randn(E, 2 * I, H, device=DEV, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, generator=g) / I**0.5
    (q13, s13), (q2, s2) = quantize_fp8_blocks(w13), quantize_fp8_blocks(w2)
    fp8 = (q13, q2, s13, s2)
    for tokens in (1, 50, 300):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 3, gen=g)
        out = poisoned_call(fused_moe_fp8, x, *fp8, tw, ids)
        assert rel_err(out, fused_moe_fp8_reference(x, *fp8, tw, ids)) <= 3e-2


def test_warm_up_leaves_nothing_to_compile():
    """As the bf16 test: kernels.warm_up with FP8 scales compiles every FP8 variant in advance."""
    q13, q2, s13, s2 = weights_for("Qwen3-30B-A3B")
    E, H, I = q13.shape[0], q13.shape[2], q13.shape[1] // 2
    max_tokens = 3000
    counts = warm_up_token_counts(E, H, I, 8, max_tokens, fp8=True)

    def args(tokens):
        tw, ids = routing(tokens, E, 8)
        return torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16), q13, q2, s13, s2, tw, ids

    def warm():
        x, _, _, _, _, tw, ids = args(1)
        assert warm_up(x, q13, q2, tw, ids, max_tokens, w13_scale=s13, w2_scale=s2) == counts

    boundaries = [b for c in counts[1:] for b in (c - 1, c)]
    check_warm_up_leaves_nothing_to_compile(lambda t: fused_moe_fp8(*args(t)), warm, max_tokens, boundaries)
