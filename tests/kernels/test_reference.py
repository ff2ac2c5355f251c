"""The torch reference of the kittens MoE layer: numerics, determinism, errors, routing, tracing."""

import pytest
import torch

from mok_serve.kernels import fused_moe, fused_moe_reference, grouped_sigmoid_topk, softmax_topk
from moe_test_utils import check_alone_equals_in_batch, make_inputs, rel_err

BF16_TOL = 1e-2
TOL = {torch.bfloat16: BF16_TOL, torch.float16: 2e-3, torch.float32: 1e-5}


def float64_moe(x, w13, w2, weights, ids, expert_map=None):
    """Independent computation: a loop over (token, k) in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if expert_map is not None:
                e = int(expert_map[e])
                if e < 0:
                    continue
            gate_up = w13[e].double() @ x[t].double()
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double() @ act)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "tokens,hidden,inter,experts,top_k",
    [(1, 32, 16, 4, 1), (7, 96, 40, 8, 2), (33, 160, 72, 16, 4), (64, 64, 96, 5, 3), (5, 48, 24, 3, 3)],
)
def test_matches_float64(dtype, tokens, hidden, inter, experts, top_k):
    x, w13, w2, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k, dtype)
    out = fused_moe(x, w13, w2, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, float64_moe(x, w13, w2, weights, ids)) <= TOL[dtype]


def test_expert_map_drops_non_local_experts():
    num_global, local = 12, [3, 7, 8, 11]
    x, w13, w2, weights, ids = make_inputs(29, 64, 32, len(local), 4, num_global=num_global)
    ids[0] = torch.tensor([0, 1, 2, 4], dtype=torch.int32)  # one token with no local expert, whatever the draw
    expert_map = torch.full((num_global,), -1, dtype=torch.int32)
    expert_map[local] = torch.arange(len(local), dtype=torch.int32)
    out = fused_moe(x, w13, w2, weights, ids, expert_map=expert_map)
    ref = float64_moe(x, w13, w2, weights, ids, expert_map)
    assert rel_err(out, ref) <= BF16_TOL
    # Tokens none of whose experts are local get exactly zero.
    none_local = ~torch.isin(ids, torch.tensor(local)).any(dim=1)
    assert none_local.any()
    assert torch.equal(out[none_local], torch.zeros_like(out[none_local]))


def test_expert_parallel_shards_sum_to_the_whole():
    num_global, ranks = 8, 2
    x, w13, w2, weights, ids = make_inputs(40, 64, 32, num_global, 3)
    whole = fused_moe(x, w13, w2, weights, ids).float()
    parts = torch.zeros_like(whole)
    per_rank = num_global // ranks
    for r in range(ranks):
        expert_map = torch.full((num_global,), -1, dtype=torch.int32)
        expert_map[r * per_rank : (r + 1) * per_rank] = torch.arange(per_rank, dtype=torch.int32)
        sl = slice(r * per_rank, (r + 1) * per_rank)
        parts += fused_moe(x, w13[sl], w2[sl], weights, ids, expert_map=expert_map).float()
    assert rel_err(parts, whole) <= BF16_TOL


def test_bitwise_repeatable_and_batch_invariant():
    x, w13, w2, weights, ids = make_inputs(64, 128, 64, 8, 2)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids))
    check_alone_equals_in_batch(fused_moe, x, (w13, w2), weights, ids)


def test_torch_reference_is_batch_invariant_with_many_rows_per_expert():
    # ~48 rows per expert and K = 512: CPU BLAS picks kernels by row count that sum in different
    # orders (on an AVX-512 CPU 8 and 16 rows differ from K = 256), so the reference runs its CPU
    # GEMMs as GEMMs of exactly 8 rows.
    x, w13, w2, weights, ids = make_inputs(96, 512, 256, 4, 2, seed=31)
    check_alone_equals_in_batch(fused_moe_reference, x, (w13, w2), weights, ids)


def test_float32_weights_on_cpu_give_the_same_bits():
    x, w13, w2, weights, ids = make_inputs(19, 64, 32, 6, 2)
    assert torch.equal(fused_moe(x, w13.float(), w2.float(), weights, ids), fused_moe(x, w13, w2, weights, ids))


def test_zero_tokens():
    x, w13, w2, weights, ids = make_inputs(0, 32, 16, 4, 2)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 32)


def test_nan_stays_in_its_token():
    x, w13, w2, weights, ids = make_inputs(16, 64, 32, 4, 2)
    x[5, 3] = float("nan")
    out = fused_moe(x, w13, w2, weights, ids)
    assert torch.isnan(out[5]).all()
    assert not torch.isnan(out[torch.arange(16) != 5]).any()


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(ids=a["ids"] + 100), "topk_ids out of range"),
        (lambda a: a.update(ids=a["ids"] - 100), "topk_ids out of range"),
        (lambda a: a.update(ids=a["ids"].float()), "topk_ids must be int32 or int64"),
        (lambda a: a.update(w13=a["w13"].half()), "weights must have the dtype"),
        (lambda a: a.update(x=a["x"].to(torch.int32)), "hidden_states dtype"),
        (lambda a: a.update(x=a["x"][:, :-1]), "hidden size"),
        (lambda a: a.update(w2=a["w2"][:, :, :-1]), "w2 shape"),
        (lambda a: a.update(weights=a["weights"][:, :1]), "topk_weights shape"),
        (lambda a: a.update(ids=a["ids"][:-1]), "topk_ids must be [tokens="),
        (lambda a: a.update(x=a["x"][None]), "hidden_states must be 2-D"),
        (lambda a: a.update(expert_map=torch.tensor([0, 1, 2, 9], dtype=torch.int32)), "expert_map values"),
        (lambda a: a.update(activation="gelu"), "activation 'gelu'"),
    ],
)
def test_bad_input_raises_value_error(mutate, message):
    x, w13, w2, weights, ids = make_inputs(6, 32, 16, 4, 2)
    args = dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, expert_map=None, activation="silu")
    mutate(args)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(")):
        fused_moe(
            args["x"], args["w13"], args["w2"], args["weights"], args["ids"],
            expert_map=args["expert_map"], activation=args["activation"],
        )


def test_out_of_range_id_with_expert_map():
    x, w13, w2, weights, ids = make_inputs(6, 32, 16, 2, 2, num_global=4)
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    ids[2, 1] = 4
    with pytest.raises(ValueError, match=r"found ids in \[4, 4\] outside the valid range \[-1, 4\)"):
        fused_moe(x, w13, w2, weights, ids, expert_map=expert_map)


@pytest.mark.parametrize("with_map", [False, True])
def test_unrouted_slots_contribute_nothing(with_map):
    """-1 (vLLM's "no expert") drops that (token, k) slot; the token's other experts still count,
    a token with no expert at all gets zeros, and -1 never indexes the expert_map."""
    x, w13, w2, weights, ids = make_inputs(7, 32, 16, 4, 3, torch.float32)
    expert_map = torch.tensor([0, 1, 2, 3, -1], dtype=torch.int32) if with_map else None
    unrouted = ids.clone()
    unrouted[1, 0] = unrouted[4, 2] = -1
    unrouted[5] = -1
    keep = (unrouted >= 0).float()
    # A -1 slot is a slot of weight 0, in the reference and in the op alike; the op (the C++ kernel
    # here) is held to the reference within fp32 rounding: its fused multiply-adds and the BLAS the
    # reference calls need not round alike on every CPU (they differed in the last bit on an AMD EPYC
    # without AVX-512).
    out = fused_moe(x, w13, w2, weights, unrouted, expert_map=expert_map)
    ref = fused_moe_reference(x, w13, w2, weights, unrouted, expert_map=expert_map)
    assert torch.equal(ref, fused_moe_reference(x, w13, w2, weights * keep, ids, expert_map=expert_map))
    assert torch.equal(out, fused_moe(x, w13, w2, weights * keep, ids, expert_map=expert_map))
    assert rel_err(out, ref) <= 1e-6
    assert torch.equal(out[5], torch.zeros_like(out[5]))


def test_traceable_by_dynamo():
    x, w13, w2, weights, ids = make_inputs(9, 64, 32, 4, 2)
    compiled = torch.compile(lambda *a: fused_moe(*a) * 2, fullgraph=True, backend="eager")
    assert torch.equal(compiled(x, w13, w2, weights, ids), fused_moe(x, w13, w2, weights, ids) * 2)


# --- against transformers' own experts modules -------------------------------------------------


def _transformers_experts(family: str, hidden, inter, experts, top_k):
    if family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts

        config = Qwen3MoeConfig(
            hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k
        )
    else:
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts as Experts

        config = DeepseekV3Config(
            hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts, num_experts_per_tok=top_k
        )
    module = Experts(config)
    with torch.no_grad():
        module.gate_up_proj.normal_(0, hidden**-0.5)
        module.down_proj.normal_(0, inter**-0.5)
    return module.to(torch.bfloat16)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k", [(13, 96, 48, 8, 2), (40, 160, 96, 16, 6)])
def test_matches_transformers_experts(family, tokens, hidden, inter, experts, top_k):
    module = _transformers_experts(family, hidden, inter, experts, top_k)
    x, _, _, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k)
    w13, w2 = module.gate_up_proj.data, module.down_proj.data
    with torch.no_grad():
        theirs = module(x, ids.long(), weights.to(torch.bfloat16))
    ours = fused_moe(x, w13, w2, weights.to(torch.bfloat16), ids)
    exact = float64_moe(x, w13, w2, weights.to(torch.bfloat16), ids)
    assert rel_err(theirs, exact) <= BF16_TOL
    assert rel_err(ours, exact) <= BF16_TOL
    assert rel_err(ours, theirs.float()) <= BF16_TOL


# --- routing -----------------------------------------------------------------------------------


def test_softmax_topk_matches_qwen3_router():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    config = Qwen3MoeConfig(hidden_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(config)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(21, 64)
    logits, their_weights, their_ids = router(x)
    weights, ids = softmax_topk(logits, 4, renormalize=True)
    assert torch.equal(ids.long(), their_ids)
    torch.testing.assert_close(weights, their_weights.float())
    assert torch.allclose(weights.sum(-1), torch.ones(21))


@pytest.mark.parametrize("groups,topk_groups,scaling", [(8, 4, 2.5), (1, 1, 2.827), (4, 2, 1.0)])
def test_grouped_sigmoid_topk_matches_deepseek_router(groups, topk_groups, scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = DeepseekV3Config(
        hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, n_group=groups, topk_group=topk_groups,
        routed_scaling_factor=scaling, norm_topk_prob=True,
    )
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight)
    torch.nn.init.normal_(router.e_score_correction_bias, std=0.5)
    x = torch.randn(25, 64)
    logits, their_weights, their_ids = router(x)
    weights, ids = grouped_sigmoid_topk(
        logits, 6, correction_bias=router.e_score_correction_bias, num_groups=groups, topk_groups=topk_groups,
        renormalize=True, scaling_factor=scaling,
    )
    # transformers returns the top k unsorted: compare each token's (id, weight) pairs sorted by id.
    def per_token(ids, weights):
        return [sorted(zip(i.tolist(), w.tolist())) for i, w in zip(ids.long(), weights.float())]

    for ours, theirs in zip(per_token(ids, weights), per_token(their_ids, their_weights)):
        assert [i for i, _ in ours] == [i for i, _ in theirs]
        assert torch.allclose(torch.tensor([w for _, w in ours]), torch.tensor([w for _, w in theirs]))
    assert torch.allclose(weights.sum(-1), torch.full((25,), scaling))
