"""The GPU expert-parallel kernels' algorithm on the CPU, under the Triton interpreter.

Several ranks are simulated in one process: each rank's symmetric segment is a plain CPU tensor
and the pointer tables hold those tensors' addresses, exactly as the GPU version holds the peers'
mapped addresses. A call is a list of launch steps (``SymmetricMemoryEPWorkspace.stages``); the
test runs step i on every rank before step i + 1, so every flag wait finds its flag raised, except
in the timeout test where one rank never calls.
"""

import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("interpreter tests run on CPU-only machines", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from mok_serve.kernels import fused_moe_fp8_reference, fused_moe_reference  # noqa: E402
from mok_serve.kernels.cuda.configs import fp8_split_max_tokens  # noqa: E402
from mok_serve.kernels.fp8 import quantize_fp8_blocks, quantize_fp8_groups  # noqa: E402
from ep_sim import local_experts, run_call, run_split, simulated_ranks  # noqa: E402
from moe_test_utils import interpreted_cuda_modules, rel_err  # noqa: E402

tm, tf, ep_cuda = interpreted_cuda_modules()

HIDDEN, INTER, TOP_K, MAX_T = 32, 16, 4, 8
ep_cuda.PULL_BT = 2  # several pulled chunks per source at these sizes


def global_inputs(seed, counts, num_experts, routing="uniform"):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, HIDDEN, generator=g).bfloat16()
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / 8).bfloat16()
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=g) / 6).bfloat16()
    ids = torch.rand(total, num_experts, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    if routing == "one_rank":
        ids = torch.rand(total, TOP_K, generator=g).argsort(dim=1).to(torch.int32)
    elif routing == "hot":
        ids[:, 0] = num_experts - 1
        ids[:, 1:] = torch.rand(total, num_experts - 1, generator=g).argsort(dim=1)[:, : TOP_K - 1].to(torch.int32)
    weights = torch.rand(total, TOP_K, generator=g)
    return x, w13, w2, weights, ids


def make_ranks(world, num_experts, replicated=False, return_mode="pull", max_spins=None, quant=None, hidden=HIDDEN,
               pull_in_gemm1=False, node_size=None):
    return simulated_ranks(
        world, num_experts, max_tokens=MAX_T, hidden=hidden, top_k=TOP_K, replicated=replicated, timeout_s=1.0,
        return_mode=return_mode, quant=quant, pull_in_gemm1=pull_in_gemm1, node_size=node_size,
        _max_spins=max_spins,
    )


CASES = [
    ((5, 8, 3), "uniform"),
    ((0, 7, 3), "uniform"),  # a rank with no tokens
    ((MAX_T, 1, 4), "one_rank"),  # every row to rank 0
    ((6, 6, 2), "hot"),
]


# EP = 4 and 8 (issue 7; no such GPU machine has been lent): uneven counts, an empty rank, one hot expert.
CASES_4 = [((5, 0, 8, 3), "uniform"), ((6, 2, 6, 1), "hot")]
CASES_8 = [((3, 0, 8, 1, 5, 2, 7, 4), "uniform")]


@pytest.mark.parametrize(
    "world,return_mode,pull_in_gemm1,cases",
    [(2, "pull", False, CASES), (2, "pull", True, CASES), (2, "push", True, CASES[:2]), (3, "pull", True, CASES[1:3]),
     (4, "pull", False, CASES_4), (4, "push", True, CASES_4[:1]), (8, "pull", False, CASES_8),
     (8, "pull", True, CASES_8)],
)
def test_ep_equals_one_gpu_kernel_bitwise(world, return_mode, pull_in_gemm1, cases):
    num_experts = 4 * world
    ranks, placement, _ = make_ranks(world, num_experts, return_mode=return_mode, pull_in_gemm1=pull_in_gemm1)
    for call, (counts, routing) in enumerate(cases):
        counts = counts[:world]
        x, w13, w2, weights, ids = global_inputs(10 + call, counts, num_experts, routing)
        expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        ref = fused_moe_reference(x, w13, w2, weights, ids)
        for _ in range(2 if call == 0 else 1):  # back-to-back calls on the same segments
            got = run_split(ranks, placement, x, (w13, w2), weights, ids, counts, layer=f"case{call}")
            err = rel_err(got, ref)
            assert err < 1e-2, f"case {call}: rel err {err}"
            assert torch.equal(got, expected), f"case {call}: EP={world} differs from the one-GPU kernel"
    for ws in ranks:
        ws.check_errors()
        assert int(ws.state[ep_cuda.ST_EPOCH]) == len(cases) + 1


# Across nodes (issue 39): each rank maps only its node's segments; token rows and results cross nodes
# through the collectives (SimulatedCollectives here, NCCL on GPUs). 2 nodes of 2, 3 nodes of 2 (a rank
# exchanges with two nodes, on both sides of its own), 2 nodes of 1 (everything through the collectives).
CASES_6 = [((3, 0, 8, 1, 5, 2), "uniform"), ((2, 6, 0, 4, 1, 3), "hot")]


@pytest.mark.parametrize(
    "world,node_size,quant,cases",
    [(4, 2, None, CASES_4), (6, 2, None, CASES_6), (2, 1, None, CASES[:3]), (4, 2, "fp8", CASES_4[:1]),
     (6, 2, "fp8", CASES_6[1:])],
)
def test_ep_across_simulated_nodes_equals_one_gpu_kernel_bitwise(world, node_size, quant, cases):
    num_experts = 4 * world
    fp8 = quant == "fp8"
    ranks, placement, _ = make_ranks(world, num_experts, node_size=node_size, quant=quant,
                                     hidden=HIDDEN_F8 if fp8 else HIDDEN)
    for ws in ranks:  # another node's memory is not mapped: no address of it anywhere
        far = [r for r in range(world) if r // node_size != ws.rank // node_size]
        for tab in (ws.n_tab, ws.ids_tab, ws.x_tab, ws.y_tab, ws.ret_tab, ws.inbox_tab):
            assert (tab[far] == 0).all()
        assert ws.flag_tab.numel() == node_size
    for call, (counts, routing) in enumerate(cases):
        counts = counts[:world]
        if fp8:
            x, experts, weights, ids = global_inputs_fp8(40 + call, counts, num_experts, routing)
            expected = tf.fused_moe_fp8_triton(x, *experts, weights, ids)
        else:
            x, w13, w2, weights, ids = global_inputs(40 + call, counts, num_experts, routing)
            experts = (w13, w2)
            expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        # back-to-back calls on the same segments, the second sized by the call's largest count
        for bound in (None, max(counts)) if call == 0 else (None,):
            got = run_split(ranks, placement, x, experts, weights, ids, counts, layer=f"case{call}",
                            max_tokens_across_ranks=bound)
            assert torch.equal(got, expected), f"case {call}: {world} ranks in nodes of {node_size} differ"
    for ws in ranks:
        ws.check_errors()


def test_replicated_tokens_across_simulated_nodes():
    world, num_experts = 4, 16
    ranks, placement, _ = make_ranks(world, num_experts, replicated=True, node_size=2)
    for call, tokens in enumerate([5, 0, MAX_T]):
        x, w13, w2, weights, ids = global_inputs(55 + call, [tokens], num_experts)
        outs = run_call(ranks, [(x, *local_experts((w13, w2), placement, r), weights, ids) for r in range(world)])
        expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        for out in outs:
            assert torch.equal(out, expected)


@pytest.mark.parametrize("option", [dict(pull_in_gemm1=True), dict(return_mode="push")])
def test_options_inside_one_node_only(option):
    with pytest.raises(ValueError, match="kittens EP across nodes pulls the token rows before GEMM1 and returns "
                                         "results by pull"):
        make_ranks(4, 16, node_size=2, **option)
    with pytest.raises(ValueError, match="4 ranks do not make whole nodes of 3"):
        make_ranks(4, 16, node_size=3)


@pytest.mark.parametrize("pull_in_gemm1", [False, True])
def test_call_bound_below_the_workspace_limit(pull_in_gemm1):
    # Calls sized by max_tokens_across_ranks (smaller than MAX_T, changing from call to call on one
    # workspace): the rows are laid out by the bound, the output stays bitwise the one-GPU kernel's.
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts, pull_in_gemm1=pull_in_gemm1)
    for call, (counts, bound) in enumerate([((3, 5), 5), ((1, 0), 1), ((0, 0), 0), ((MAX_T, 2), MAX_T), ((4, 4), 6)]):
        x, w13, w2, weights, ids = global_inputs(20 + call, counts, num_experts)
        got = run_split(ranks, placement, x, (w13, w2), weights, ids, counts, max_tokens_across_ranks=bound)
        assert torch.equal(got, tm.fused_moe_triton(x, w13, w2, weights, ids)), f"call {call} (bound {bound})"
        assert (ranks[0].all_ids[max(bound, 1) : max(bound, 1) + counts[1]] == ids[counts[0]:]).all()
    for ws in ranks:
        ws.check_errors()


def test_call_bound_errors():
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts)
    x, w13, w2, weights, ids = global_inputs(30, [4, 4], num_experts)
    l13, l2 = local_experts((w13, w2), placement, 0)
    for bound in (3, MAX_T + 1):
        with pytest.raises(ValueError, match=f"max_tokens_across_ranks={bound} must be at least this rank's 4 tokens "
                                             f"and at most the workspace's max_tokens_per_rank={MAX_T}"):
            ranks[0].fused_moe(x[:4], l13, l2, weights[:4], ids[:4], max_tokens_across_ranks=bound)
    # Ranks that disagree on the bound: each sees the other's and reports it, naming the peer.
    args = [(x[4 * r : 4 * r + 4], *local_experts((w13, w2), placement, r), weights[4 * r : 4 * r + 4],
             ids[4 * r : 4 * r + 4]) for r in range(world)]
    run_call(ranks, args, layer="L3", per_rank_kwargs=[dict(max_tokens_across_ranks=4), dict(max_tokens_across_ranks=5)])
    for r, ws in enumerate(ranks):
        with pytest.raises(ValueError, match=rf"rank {r}: rank {1 - r} passed another max_tokens_across_ranks than "
                                             r"this rank \(layer L3, call 1\)"):
            ws.check_errors()


def test_replicated_tokens():
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts, replicated=True)
    for call, tokens in enumerate([5, 0]):
        x, w13, w2, weights, ids = global_inputs(50 + call, [tokens], num_experts)
        args = [(x, *local_experts((w13, w2), placement, r), weights, ids) for r in range(world)]
        outs = run_call(ranks, args)
        expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        for out in outs:
            assert torch.equal(out, expected)


def test_phase_hook_brackets_the_expert_gemms():
    (ws,), placement, _ = make_ranks(1, 4, pull_in_gemm1=True)
    x, w13, w2, weights, ids = global_inputs(60, [5], 4)
    seen = []
    out = ws.fused_moe(x, w13, w2, weights, ids, on_phase=seen.append)
    assert seen == ["experts", "combine"]
    assert torch.equal(out, tm.fused_moe_triton(x, w13, w2, weights, ids))
    # Where the hook runs: right before and right after the GEMM step.
    log = []

    def step(name):
        def run():
            log.append(name)
            return name
        run.__name__ = name
        return run

    stages = [step(n) for n in ("post", "sync", "gather", "schedule", "gemms", "sync", "combine")]
    assert ep_cuda._run_stages(stages, log.append) == "combine"
    assert log == ["post", "sync", "gather", "schedule", "experts", "gemms", "combine", "sync", "combine"]


@pytest.mark.parametrize("pull_in_gemm1", [False, True])
def test_pull_is_each_token_once_per_destination(pull_in_gemm1):
    # Rank 1 needs source 0's tokens whose experts live on rank 1: exactly those rows arrive in xl.
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts, pull_in_gemm1=pull_in_gemm1)
    ranks[1].xl.fill_(float("nan"))  # poison: rows nobody pulls stay NaN
    counts = (7, 3)
    x, w13, w2, weights, ids = global_inputs(77, counts, num_experts)
    args = []
    for r in range(world):
        sl = slice(sum(counts[:r]), sum(counts[:r]) + counts[r])
        args.append((x[sl], *local_experts((w13, w2), placement, r), weights[sl], ids[sl]))
    run_call(ranks, args)
    ws = ranks[1]
    need = (placement.owner[ids[:7].long()] == 1).any(dim=1)
    assert torch.equal(ws.xl[: 7][need], x[:7][need])
    assert ws.xl[: 7][~need].isnan().all() and ws.xl[7:MAX_T].isnan().all()
    assert (ws.all_ids[7:MAX_T] == -1).all() and torch.equal(ws.all_ids[:7], ids[:7])


def test_silent_peer_gives_a_timeout_error_naming_the_rank():
    world, num_experts = 2, 4
    ranks, placement, _ = make_ranks(world, num_experts, max_spins=50)
    x, w13, w2, weights, ids = global_inputs(90, [3, 3], num_experts)
    l13, l2 = local_experts((w13, w2), placement, 0)
    ranks[0].fused_moe(x[:3], l13, l2, weights[:3], ids[:3], layer="L7")  # rank 1 never calls
    with pytest.raises(ep_cuda.PeerTimeoutError, match=r"rank 0: rank 1 did not post its tokens within 1 s \(layer L7, call 1\)"):
        ranks[0].check_errors()
    with pytest.raises(ep_cuda.PeerTimeoutError, match="rank 1 did not post its tokens"):
        ranks[0].fused_moe(x[:3], l13, l2, weights[:3], ids[:3], layer="L8")  # surfaces lazily too


# ---------------------------------------------------------------------------------- FP8 experts

# H and I not multiples of 128: partial activation groups and weight blocks on both GEMMs.
HIDDEN_F8, INTER_F8 = 192, 96


def global_inputs_fp8(seed, counts, num_experts, routing="uniform"):
    g = torch.Generator().manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, HIDDEN_F8, generator=g).bfloat16()
    x[::3] *= 50  # token rows of very different magnitudes: per-token scales matter
    w13, s13 = quantize_fp8_blocks(torch.randn(num_experts, 2 * INTER_F8, HIDDEN_F8, generator=g) / HIDDEN_F8**0.5)
    w2, s2 = quantize_fp8_blocks(torch.randn(num_experts, HIDDEN_F8, INTER_F8, generator=g) / INTER_F8**0.5)
    _, _, _, weights, ids = global_inputs(seed, counts, num_experts, routing)
    return x, (w13, w2, s13, s2), weights, ids


@pytest.mark.parametrize(
    "world,return_mode,cases",
    [(2, "pull", CASES), (2, "push", CASES[1:2]), (3, "pull", CASES[1:2]), (4, "pull", CASES_4[:1])],
)
def test_ep_fp8_equals_one_gpu_fp8_kernel_bitwise(world, return_mode, cases):
    num_experts = 4 * world
    ranks, placement, _ = make_ranks(world, num_experts, return_mode=return_mode, quant="fp8", hidden=HIDDEN_F8)
    for call, (counts, routing) in enumerate(cases):
        counts = counts[:world]
        x, fp8, weights, ids = global_inputs_fp8(20 + call, counts, num_experts, routing)
        expected = tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
        ref = fused_moe_fp8_reference(x, *fp8, weights, ids)
        for _ in range(2 if call == 0 else 1):  # back-to-back calls on the same segments
            got = run_split(ranks, placement, x, fp8, weights, ids, counts, layer=f"case{call}")
            err = rel_err(got, ref)
            assert err < 1e-2, f"case {call}: rel err {err}"
            assert torch.equal(got, expected), f"case {call}: FP8 EP={world} differs from the one-GPU FP8 kernel"
    for ws in ranks:
        ws.check_errors()
        assert int(ws.state[ep_cuda.ST_EPOCH]) == len(cases) + 1


def test_ep_fp8_split_tiles_only_below_their_token_bound():
    # 1 local expert, top-4: GEMM1's split tiles (and their act_h rows) for calls of <= 4 tokens,
    # fewer than the workspace's 8. Calls on both sides of that bound, and one whose own rank has 2
    # tokens but whose bound is 8 (the configs follow the bound the rows are laid out for).
    world, num_experts = 4, 4
    split_max = fp8_split_max_tokens(TOP_K, num_experts // world)
    assert split_max == 4 < MAX_T
    ranks, placement, _ = make_ranks(world, num_experts, quant="fp8", hidden=HIDDEN_F8)
    for call, counts in enumerate([(6, 2, 5, 0), (MAX_T, 3, 7, 1), (2, 2, 2, 2), (2, 0, 1, MAX_T)]):
        x, fp8, weights, ids = global_inputs_fp8(60 + call, counts, num_experts)
        got = run_split(ranks, placement, x, fp8, weights, ids, counts, layer=f"case{call}")
        assert torch.equal(got, tf.fused_moe_fp8_triton(x, *fp8, weights, ids)), f"call {call} ({counts})"
    for ws in ranks:
        ws.check_errors()
        assert ws.act_h.shape == (world * split_max * TOP_K, INTER_F8) and ws.act.shape[0] == world * MAX_T * TOP_K


def test_ep_fp8_posts_quantized_rows_and_pulls_each_once():
    # Each rank posts its tokens as torch's per-token 1 x 128 quantization (bit for bit), and rank 1
    # pulls exactly source 0's rows with an expert on rank 1, e4m3 bytes and scales.
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts, quant="fp8", hidden=HIDDEN_F8)
    counts = (7, 3)
    x, fp8, weights, ids = global_inputs_fp8(78, counts, num_experts)
    ids[:3] = torch.tensor([3, 0, 2, 1], dtype=ids.dtype)  # tokens whose experts all live on rank 0
    run_split(ranks, placement, x, fp8, weights, ids, counts)
    q, s = quantize_fp8_groups(x)
    ws0, ws1 = ranks
    assert torch.equal(ws0.seg_x.view(MAX_T, HIDDEN_F8)[:7].view(torch.uint8), q[:7].view(torch.uint8))
    assert torch.equal(ws0.seg_xs.view(MAX_T, -1)[:7], s[:7])
    assert torch.equal(ws1.seg_xs.view(MAX_T, -1)[:3], s[7:])
    need = (placement.owner[ids[:7].long()] == 1).any(dim=1)
    assert 0 < int(need.sum()) < 7
    assert torch.equal(ws1.xl[:7][need].view(torch.uint8), q[:7][need].view(torch.uint8))
    assert torch.equal(ws1.xsl[:7][need], s[:7][need])
    assert ws0.seg_x.numel() * ws0.seg_x.element_size() == MAX_T * HIDDEN_F8  # one byte per element


def test_ep_fp8_replicated_tokens_and_wrong_entry_point():
    world, num_experts = 2, 4
    ranks, placement, _ = make_ranks(world, num_experts, replicated=True, quant="fp8", hidden=HIDDEN_F8)
    x, fp8, weights, ids = global_inputs_fp8(51, [5], num_experts)
    local = [local_experts(fp8, placement, r) for r in range(world)]
    args = [(x, *local[r][:2], weights, ids) for r in range(world)]
    outs = run_call(ranks, args, per_rank_kwargs=[dict(scales=local[r][2:]) for r in range(world)])
    expected = tf.fused_moe_fp8_triton(x, *fp8, weights, ids)
    for out in outs:
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="quant='fp8': call fused_moe_fp8"):
        ranks[0].fused_moe(x, *local[0][:2], weights, ids)
    bf16_ranks, _, _ = make_ranks(world, num_experts)
    with pytest.raises(ValueError, match="quant=None: call fused_moe "):
        bf16_ranks[0].fused_moe_fp8(x[:, :HIDDEN], *local[0], weights, ids)
