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

import importlib  # noqa: E402

from mok_serve.kernels import fused_moe_reference  # noqa: E402
from mok_serve.kernels import triton_moe as tm  # noqa: E402

if type(tm._moe_gemm1_kernel).__name__ != "InterpretedFunction":
    tm = importlib.reload(tm)
from mok_serve.kernels import ep_cuda  # noqa: E402

if type(ep_cuda._ep_sync_kernel).__name__ != "InterpretedFunction" or ep_cuda._tile_of is not tm._tile_of:
    ep_cuda = importlib.reload(ep_cuda)

HIDDEN, INTER, TOP_K, MAX_T = 32, 16, 4, 8


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


def make_ranks(world, num_experts, replicated=False, return_mode="pull", max_spins=None):
    placement = ep_cuda.ExpertPlacement.linear(num_experts, world)
    sources = 1 if replicated else world
    total = ep_cuda._Layout(world, sources, MAX_T, HIDDEN, TOP_K, 2).total
    segments = [torch.full((total,), 0xAB, dtype=torch.uint8) for _ in range(world)]  # poisoned
    ranks = [
        ep_cuda.SymmetricMemoryEPWorkspace(
            None, max_tokens_per_rank=MAX_T, hidden_size=HIDDEN, top_k=TOP_K, dtype=torch.bfloat16,
            placement=placement, replicated_tokens=replicated, timeout_s=1.0, return_mode=return_mode,
            _simulated=(r, segments), _max_spins=max_spins,
        )
        for r in range(world)
    ]
    return ranks, placement, segments


def local_weights(w13, w2, placement, rank):
    mine = (placement.owner == rank).nonzero().flatten()
    order = mine[placement.local[mine].argsort()]
    return w13[order].contiguous(), w2[order].contiguous()


def run_call(ranks, per_rank_args, layer="L"):
    stage_lists = [ws.stages(*args, layer=layer) for ws, args in zip(ranks, per_rank_args)]
    outs = [None] * len(ranks)
    for i in range(len(stage_lists[0])):
        for r, stages in enumerate(stage_lists):
            outs[r] = stages[i]()
    return outs


CASES = [
    ((5, 8, 3), "uniform"),
    ((0, 7, 3), "uniform"),  # a rank with no tokens
    ((MAX_T, 1, 4), "one_rank"),  # every row to rank 0
    ((6, 6, 2), "hot"),
]


@pytest.mark.parametrize("world,return_mode,cases", [(2, "pull", CASES), (2, "push", CASES[:2]), (3, "pull", CASES[1:3])])
def test_ep_equals_one_gpu_kernel_bitwise(world, return_mode, cases):
    num_experts = 4 * world
    ranks, placement, _ = make_ranks(world, num_experts, return_mode=return_mode)
    for call, (counts, routing) in enumerate(cases):
        counts = counts[:world]
        x, w13, w2, weights, ids = global_inputs(10 + call, counts, num_experts, routing)
        expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        ref = fused_moe_reference(x, w13, w2, weights, ids)
        starts = [sum(counts[:r]) for r in range(world)]
        args = []
        for r in range(world):
            sl = slice(starts[r], starts[r] + counts[r])
            l13, l2 = local_weights(w13, w2, placement, r)
            args.append((x[sl], l13, l2, weights[sl], ids[sl]))
        for _ in range(2 if call == 0 else 1):  # back-to-back calls on the same segments
            outs = run_call(ranks, args, layer=f"case{call}")
            got = torch.cat(outs)
            err = ((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()
            assert err < 1e-2, f"case {call}: rel err {err}"
            assert torch.equal(got, expected), f"case {call}: EP={world} differs from the one-GPU kernel"
    for ws in ranks:
        ws.check_errors()
        assert int(ws.state[ep_cuda.ST_EPOCH]) == len(cases) + 1


def test_replicated_tokens():
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts, replicated=True)
    for call, tokens in enumerate([5, 0]):
        x, w13, w2, weights, ids = global_inputs(50 + call, [tokens], num_experts)
        args = [(x, *local_weights(w13, w2, placement, r), weights, ids) for r in range(world)]
        outs = run_call(ranks, args)
        expected = tm.fused_moe_triton(x, w13, w2, weights, ids)
        for out in outs:
            assert torch.equal(out, expected)


def test_pull_is_each_token_once_per_destination():
    # Rank 1 needs source 0's tokens whose experts live on rank 1: exactly those rows arrive in xl.
    world, num_experts = 2, 8
    ranks, placement, _ = make_ranks(world, num_experts)
    counts = (7, 3)
    x, w13, w2, weights, ids = global_inputs(77, counts, num_experts)
    args = []
    for r in range(world):
        sl = slice(sum(counts[:r]), sum(counts[:r]) + counts[r])
        args.append((x[sl], *local_weights(w13, w2, placement, r), weights[sl], ids[sl]))
    run_call(ranks, args)
    ws = ranks[1]
    need = (placement.owner[ids[:7].long()] == 1).any(dim=1)
    assert torch.equal(ws.xl[: 7][need], x[:7][need])
    assert (ws.all_ids[7:MAX_T] == -1).all() and torch.equal(ws.all_ids[:7], ids[:7])


def test_silent_peer_gives_a_timeout_error_naming_the_rank():
    world, num_experts = 2, 4
    ranks, placement, _ = make_ranks(world, num_experts, max_spins=50)
    x, w13, w2, weights, ids = global_inputs(90, [3, 3], num_experts)
    l13, l2 = local_weights(w13, w2, placement, 0)
    ranks[0].fused_moe(x[:3], l13, l2, weights[:3], ids[:3], layer="L7")  # rank 1 never calls
    with pytest.raises(ep_cuda.PeerTimeoutError, match=r"rank 0: rank 1 did not post its tokens within 1 s \(layer L7, call 1\)"):
        ranks[0].check_errors()
    with pytest.raises(ep_cuda.PeerTimeoutError, match="rank 1 did not post its tokens"):
        ranks[0].fused_moe(x[:3], l13, l2, weights[:3], ids[:3], layer="L8")  # surfaces lazily too
