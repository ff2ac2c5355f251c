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
from mok_serve.kernels import triton_moe as tm  # noqa: E402
from moe_test_utils import make_inputs, rel_err  # noqa: E402

if not hasattr(tm._moe_gemm1_kernel, "fn") or type(tm._moe_gemm1_kernel).__name__ != "InterpretedFunction":
    import importlib

    tm = importlib.reload(tm)


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
    tm._moe_schedule_kernel[(experts,)](
        ids, ids, counts, sorted_rows, rows, experts, experts, ids.stride(0), ids.stride(1),
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
    out = tm.fused_moe_triton(x, w13, w2, weights, ids, _configs=(g1, g2))
    ref = fused_moe_reference(x, w13, w2, weights, ids)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_out_of_range_ids_raise_eagerly_and_are_masked_in_kernels(monkeypatch):
    x, w13, w2, weights, ids = make_inputs(4, 32, 16, 4, 2, torch.float32, seed=1)
    bad = ids.clone()
    bad[1, 0] = 4
    bad[2, 1] = -3
    with pytest.raises(ValueError, match="out of range"):
        tm.fused_moe_triton(x, w13, w2, weights, bad)
    # As under graph capture (no value check): invalid rows contribute nothing, nothing crashes.
    real_check = tm.check_fused_moe_args
    monkeypatch.setattr(tm, "check_fused_moe_args", lambda *a, **k: real_check(*a, **{**k, "check_values": False}))
    out = tm.fused_moe_triton(x, w13, w2, weights, bad)
    keep = torch.ones_like(weights)
    keep[1, 0] = 0
    keep[2, 1] = 0
    ref = fused_moe_reference(x, w13, w2, weights * keep, ids)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_nan_stays_in_its_token():
    x, w13, w2, weights, ids = make_inputs(12, 32, 16, 3, 2, torch.float32, seed=2)
    x[5, 3] = float("nan")
    out = tm.fused_moe_triton(x, w13, w2, weights, ids)
    assert torch.isnan(out[5]).all()
    others = torch.cat([out[:5], out[6:]])
    assert not torch.isnan(others).any()


def test_decode_pipeline_depth_fills_the_last_wave():
    # 384 programs of 80 KB (5 stages of 16 KB) fit 2 per SM: 264 slots, a last wave 45% full, so 73%
    # of the two waves; at 4 stages 3 per SM hold all 384 in one wave (97%).
    assert tm._last_wave_fill(384, 5 * 16384) == 384 / 528
    assert tm._last_wave_fill(384, 4 * 16384) == 384 / 396
    # The depths the sweep at 616d9e0 measured fastest (1-2 tokens; hidden, inter, experts, top-k).
    for tokens, shape, stages in [
        (1, (7168, 2048, 256, 8), 5), (2, (7168, 2048, 256, 8), 5), (1, (5120, 1536, 160, 8), 4),
        (2, (5120, 1536, 160, 8), 5), (1, (4096, 1536, 128, 8), 4), (1, (2048, 768, 128, 8), 5),
        (2, (2048, 768, 128, 8), 4),
    ]:
        hidden, inter, experts, top_k = shape
        g1, g2 = tm.pick_configs(tokens, top_k, experts, hidden, inter)
        assert g1["num_stages"] == g2["num_stages"] == stages, (tokens, shape)


def test_pick_configs_static_and_wgmma_sized():
    for tokens in (1, 8, 32, 128, 512, 2048, 8192):
        for shape in ((7168, 2048, 256, 8), (2048, 768, 128, 8), (5120, 1536, 160, 8)):
            hidden, inter, experts, top_k = shape
            g1, g2 = tm.pick_configs(tokens, top_k, experts, hidden, inter)
            assert g1["BLOCK_M"] >= 64 and g2["BLOCK_M"] >= 64
            # K blocking depends on the shape only, never on the token count.
            assert g1["BLOCK_K"] == tm.pick_configs(1, top_k, experts, hidden, inter)[0]["BLOCK_K"]
            assert g2["BLOCK_K"] == tm.pick_configs(1, top_k, experts, hidden, inter)[1]["BLOCK_K"]
