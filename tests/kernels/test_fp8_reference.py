"""Block-scaled FP8 experts on the CPU: quantization helpers, the reference, the custom op."""

import math

import pytest
import torch
import torch.nn.functional as F

from mok_serve.kernels import fused_moe_fp8, fused_moe_fp8_reference, fused_moe_reference
from mok_serve.kernels.fp8 import (
    dequantize_fp8_blocks,
    dequantize_fp8_groups,
    quantize_fp8_blocks,
    quantize_fp8_groups,
)
from moe_test_utils import check_alone_equals_in_batch, make_fp8_inputs, rel_err


def float64_fp8_moe(x, q13, q2, s13, s2, weights, ids, expert_map=None, block=(128, 128)):
    """Independent float64 computation of the reference's quantize-dequantize path: a loop over
    (token, k), with the reference's rounding points (input dtype) and activation quantization."""
    dtype, group = x.dtype, block[1]
    w13 = dequantize_fp8_blocks(q13, s13, block).double()
    w2 = dequantize_fp8_blocks(q2, s2, block).double()
    xd = dequantize_fp8_groups(*quantize_fp8_groups(x, group), group).double()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            gate_up = (w13[e] @ xd[t]).to(dtype).double()
            act = (F.silu(gate_up[:inter]) * gate_up[inter:]).to(dtype)
            act = dequantize_fp8_groups(*quantize_fp8_groups(act[None], group), group)[0].double()
            out[t] += float(weights[t, k]) * (w2[e] @ act).to(dtype).double()
    return out


# --- quantization helpers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape,block", [((3, 256, 384), (128, 128)), ((2, 200, 72), (128, 128)), ((5, 96, 130), (64, 32))]
)
def test_block_quantization_round_trip(shape, block):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])  # wide dynamic range
    w[0, : block[0], : block[1]] = 0  # an all-zero block
    q, s = quantize_fp8_blocks(w, block)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert s.dtype == torch.float32
    assert s.shape == (shape[0], math.ceil(shape[1] / block[0]), math.ceil(shape[2] / block[1]))
    assert torch.isfinite(s).all() and (s > 0).all(), "scales must be positive and finite"
    # Each scale is its block's amax / 448, so the block's largest element quantizes to +-448.
    blocks = F.pad(w.abs(), (0, -shape[2] % block[1], 0, -shape[1] % block[0]))
    amax = blocks.unflatten(-1, (-1, block[1])).unflatten(-3, (-1, block[0])).amax(dim=(-3, -1))
    nonzero = amax > 0
    assert torch.equal(s[nonzero], amax[nonzero] / 448)
    assert (q[0, : block[0], : block[1]].float() == 0).all()
    # e4m3 keeps 3 mantissa bits: relative error <= 2**-4 for normals, absolute <= 2**-10 * scale
    # below the smallest normal (2**-6 * scale).
    d = dequantize_fp8_blocks(q, s, block)
    scale = s.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : shape[1], : shape[2]]
    assert ((d - w).abs() <= 2**-4 * w.abs() + 2**-10 * scale).all()


def test_group_quantization_is_the_1_by_group_block_case():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 300, generator=g).to(torch.bfloat16)
    q, s = quantize_fp8_groups(x)
    qb, sb = quantize_fp8_blocks(x, (1, 128))
    assert s.shape == (7, 3) and torch.equal(s, sb) and torch.equal(q.view(torch.uint8), qb.view(torch.uint8))
    assert torch.equal(dequantize_fp8_groups(q, s), dequantize_fp8_blocks(q, s, (1, 128)))
    # A token's quantization depends on that token alone.
    q1, s1 = quantize_fp8_groups(x[3:4])
    assert torch.equal(s1, s[3:4]) and torch.equal(q1.view(torch.uint8), q[3:4].view(torch.uint8))


def test_nan_makes_its_group_nan_and_zero_groups_stay_finite():
    x = torch.zeros(3, 256)
    x[1, 5] = float("nan")
    x[2] = 1.0
    q, s = quantize_fp8_groups(x)
    assert torch.isnan(s[1, 0]) and torch.isnan(dequantize_fp8_groups(q, s)[1, :128]).all()
    assert torch.isfinite(s[[0, 1, 2], [0, 1, 1]]).all() and (s[0] > 0).all()
    assert torch.equal(dequantize_fp8_groups(q, s)[[0, 2]], x[[0, 2]])


# --- the reference -----------------------------------------------------------------------------


SHAPES = [(1, 256, 128, 4, 1), (7, 384, 256, 8, 2), (33, 256, 384, 16, 4), (64, 128, 128, 5, 3)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", SHAPES)
def test_matches_float64_of_the_quantized_path(dtype, tokens, hidden, inter, experts, top_k):
    x, _, _, weights, ids, fp8 = make_fp8_inputs(tokens, hidden, inter, experts, top_k, dtype, seed=tokens + hidden)
    out = fused_moe_fp8(x, *fp8, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, float64_fp8_moe(x, *fp8, weights, ids)) <= 1e-2


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", SHAPES[1:])
def test_close_to_unquantized_math(tokens, hidden, inter, experts, top_k):
    # e4m3 rounds each of the four quantized operands (x, w13, activation, w2) with ~2.6% RMS
    # relative error (3 mantissa bits), so on random Gaussian data the layer output is ~6.3% off
    # unquantized math (30 seeds per shape here: 5.6-6.7%; a single token, fewer elements, spreads
    # to 5.5-8.1%, so it is left out). 5e-2 is below what the format allows; 8e-2 is the bound.
    x, w13, w2, weights, ids, fp8 = make_fp8_inputs(tokens, hidden, inter, experts, top_k, seed=tokens)
    unquantized = fused_moe_reference(x, w13.float(), w2.float(), weights, ids)
    assert rel_err(fused_moe_fp8(x, *fp8, weights, ids), unquantized) <= 8e-2


def test_hidden_and_intermediate_not_multiples_of_128():
    x, _, _, weights, ids, fp8 = make_fp8_inputs(21, 200, 72, 6, 3, seed=4)
    out = fused_moe_fp8(x, *fp8, weights, ids)
    assert rel_err(out, float64_fp8_moe(x, *fp8, weights, ids)) <= 1e-2


@pytest.mark.parametrize("block", [(64, 128), (128, 64), (32, 32)])
def test_other_block_shapes(block):
    x, _, _, weights, ids, fp8 = make_fp8_inputs(9, 192, 96, 4, 2, seed=5, block=block)
    out = fused_moe_fp8(x, *fp8, weights, ids, block_shape=block)
    assert rel_err(out, float64_fp8_moe(x, *fp8, weights, ids, block=block)) <= 1e-2


def test_bitwise_repeatable_and_batch_invariant():
    x, _, _, weights, ids, fp8 = make_fp8_inputs(64, 256, 128, 8, 2, seed=6)
    ids[10] = ids[20] = torch.tensor([3, 3], dtype=torch.int32)  # duplicates and a hot expert
    assert torch.equal(fused_moe_fp8(x, *fp8, weights, ids), fused_moe_fp8(x, *fp8, weights, ids))
    check_alone_equals_in_batch(fused_moe_fp8, x, fp8, weights, ids, every=10)  # tokens 10 and 20 among them


def test_batch_invariant_with_many_rows_per_expert():
    # As the bf16 reference's test: ~48 rows per expert, K = 512 and 256 (8-row CPU GEMMs).
    x, _, _, weights, ids, fp8 = make_fp8_inputs(96, 512, 256, 4, 2, seed=32)
    check_alone_equals_in_batch(fused_moe_fp8, x, fp8, weights, ids)


def test_expert_map_drops_non_local_experts_and_shards_sum_to_the_whole():
    num_global, per_rank = 8, 4
    x, _, _, weights, ids, (q13, q2, s13, s2) = make_fp8_inputs(40, 128, 128, num_global, 3, seed=7)
    whole = fused_moe_fp8(x, q13, q2, s13, s2, weights, ids).float()
    parts = torch.zeros_like(whole)
    for r in range(num_global // per_rank):
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[r * per_rank : (r + 1) * per_rank] = torch.arange(per_rank, dtype=torch.int32)
        sl = slice(r * per_rank, (r + 1) * per_rank)
        part = fused_moe_fp8(x, q13[sl], q2[sl], s13[sl], s2[sl], weights, ids, expert_map=expert_map)
        assert rel_err(part, float64_fp8_moe(x, q13[sl], q2[sl], s13[sl], s2[sl], weights, ids, expert_map)) <= 1e-2
        none_local = ~((ids >= r * per_rank) & (ids < (r + 1) * per_rank)).any(dim=1)
        assert torch.equal(part[none_local], torch.zeros_like(part[none_local]))
        parts += part.float()
    assert rel_err(parts, whole) <= 1e-2


def test_nan_stays_in_its_token_and_zero_tokens():
    x, _, _, weights, ids, fp8 = make_fp8_inputs(16, 256, 128, 4, 2, seed=8)
    x[5, 3] = float("nan")
    out = fused_moe_fp8(x, *fp8, weights, ids)
    assert torch.isnan(out[5]).all()
    assert not torch.isnan(out[torch.arange(16) != 5]).any()
    assert fused_moe_fp8(x[:0], *fp8, weights[:0], ids[:0]).shape == (0, 256)


def test_custom_op_is_the_reference_on_cpu_and_traceable():
    x, _, _, weights, ids, fp8 = make_fp8_inputs(9, 128, 128, 4, 2, seed=9)
    ref = fused_moe_fp8_reference(x, *fp8, weights, ids)
    assert torch.equal(torch.ops.mok_serve.fused_moe_fp8(x, *fp8, weights, ids, None, "silu", [128, 128]), ref)
    compiled = torch.compile(lambda *a: fused_moe_fp8(*a) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, *fp8, weights, ids), ref * 2)


def _drop_last_scale_column(a):
    a["s13"] = a["s13"][..., :-1]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(q13=a["q13"].float()), "FP8 experts need w13 and w2 in torch.float8_e4m3fn"),
        (lambda a: a.update(q2=a["q2"].to(torch.float8_e5m2)), "FP8 experts need w13 and w2"),
        (lambda a: a.update(s13=a["s13"].double()), "w13_scale must be float32"),
        (_drop_last_scale_column, "w13_scale shape (2, 2, 1) does not match w13 (2, 256, 256) with 128x128 blocks"),
        (lambda a: a.update(s2=a["s2"][:1]), "w2_scale shape"),
        (lambda a: a.update(block=(128, 0)), "block_shape must be two positive ints"),
        (lambda a: a.update(block=128), "block_shape must be two positive ints"),
        (lambda a: a.update(block=(64, 128)), "w13_scale shape"),
        (lambda a: a.update(ids=a["ids"] + 100), "topk_ids out of range"),
        (lambda a: a.update(x=a["x"][:, :-1]), "hidden size"),
        (lambda a: a.update(q2=a["q2"][:, :, :-1]), "w2 shape"),
        (lambda a: a.update(x=a["x"].to(torch.int32)), "hidden_states dtype"),
        (lambda a: a.update(expert_map=torch.tensor([0, 5], dtype=torch.int32)), "expert_map values"),
        (lambda a: a.update(activation="gelu"), "activation 'gelu'"),
    ],
)
def test_bad_input_raises_value_error(mutate, message):
    x, _, _, weights, ids, (q13, q2, s13, s2) = make_fp8_inputs(6, 256, 128, 2, 2, seed=10)
    args = dict(x=x, q13=q13, q2=q2, s13=s13, s2=s2, ids=ids, expert_map=None, activation="silu", block=(128, 128))
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        fused_moe_fp8(
            args["x"], args["q13"], args["q2"], args["s13"], args["s2"], weights, args["ids"],
            expert_map=args["expert_map"], activation=args["activation"], block_shape=args["block"],
        )
