"""Kittens expert parallelism on the CPU: several processes pulling over shared memory.

Every rank draws the same global inputs from a shared seed, runs its share through the
expert-parallel workspace and checks the result bitwise against ``fused_moe`` on one rank with
all experts (which is itself checked against float64 in test_reference.py).
"""

import os
import time

import pytest
import torch
import torch.distributed as dist
from rank_runner import run_ranks, spawn_ranks

from mok_serve.kernels import fused_moe
from mok_serve.kernels.cpu.ep import ExpertPlacement, PeerTimeoutError, SharedMemoryEPWorkspace

HIDDEN, INTER, TOP_K = 64, 32, 4
MAX_TOKENS = 96


def _global_inputs(seed, tokens_per_rank, num_experts, routing="uniform"):
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens_per_rank)
    x = torch.randn(total, HIDDEN, generator=g).bfloat16()
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / 8).bfloat16()
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=g) / 6).bfloat16()
    ids = torch.rand(total, num_experts, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    if routing == "one_rank":  # every token's experts live on rank 0 (experts 0..TOP_K-1)
        ids = torch.rand(total, TOP_K, generator=g).argsort(dim=1).to(torch.int32)
    elif routing == "hot":  # one expert takes every token's first slot
        ids[:, 0] = num_experts - 1
        ids[:, 1:] = torch.rand(total, num_experts - 1, generator=g).argsort(dim=1)[:, : TOP_K - 1].to(torch.int32)
    weights = torch.rand(total, TOP_K, generator=g)
    return x, w13, w2, weights, ids


def _workspace(world, num_experts, replicated=False, timeout_s=60.0, node_size=None):
    placement = ExpertPlacement.linear(num_experts, world)
    ws = SharedMemoryEPWorkspace(
        dist.group.WORLD, max_tokens_per_rank=MAX_TOKENS, hidden_size=HIDDEN, top_k=TOP_K,
        dtype=torch.bfloat16, placement=placement, replicated_tokens=replicated, timeout_s=timeout_s,
        node_size=node_size,
    )
    return ws, placement


def _local_weights(w13, w2, placement, rank):
    mine = (placement.owner == rank).nonzero().flatten()
    order = mine[placement.local[mine].argsort()]
    return w13[order].contiguous(), w2[order].contiguous()


CASES = [
    # (tokens per rank for ranks 0..2, routing)
    ((37, 5, 60), "uniform"),
    ((0, 41, 9), "uniform"),  # a rank with no tokens
    ((MAX_TOKENS, 1, 17), "one_rank"),  # every row goes to rank 0
    ((23, 23, 50), "hot"),  # one hot expert
    ((1, 1, 1), "uniform"),
]


def scenario_distinct(rank, world):
    num_experts = 12
    ws, placement = _workspace(world, num_experts)
    try:
        for call, (counts, routing) in enumerate(CASES):
            counts = counts[:world]
            x, w13, w2, weights, ids = _global_inputs(100 + call, counts, num_experts, routing)
            expected = fused_moe(x, w13, w2, weights, ids)
            start = sum(counts[:rank])
            mine = slice(start, start + counts[rank])
            local13, local2 = _local_weights(w13, w2, placement, rank)
            # Back-to-back calls reuse the segments; the second gives the call's bound.
            for bound in (None, max(counts)):
                out = ws.fused_moe(x[mine], local13, local2, weights[mine], ids[mine], layer=f"case{call}",
                                   max_tokens_across_ranks=bound)
                assert torch.equal(out, expected[mine]), f"case {call}: EP={world} differs from one rank"
    finally:
        ws.close()


def scenario_bound_mismatch(rank, world):
    num_experts = 8
    ws, placement = _workspace(world, num_experts)
    try:
        x, w13, w2, weights, ids = _global_inputs(500, [8] * world, num_experts)
        local13, local2 = _local_weights(w13, w2, placement, rank)
        with pytest.raises(ValueError, match="must be at least this rank's 8 tokens"):
            ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8], max_tokens_across_ranks=7)
        peer = 1 - rank
        with pytest.raises(ValueError, match=rf"rank {rank}: rank {peer} passed max_tokens_across_ranks={8 + peer}, "
                                             rf"this rank {8 + rank} \(layer L2, call 1\)"):
            ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8], layer="L2", max_tokens_across_ranks=8 + rank)
    finally:
        ws.close()


def scenario_fp8(rank, world, node_size=None):
    """Block-FP8 experts: EP (distinct and replicated tokens) equals one-rank fused_moe_fp8 bitwise."""
    from mok_serve.kernels import fused_moe_fp8
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    num_experts, hidden, inter = 8, 256, 128  # whole 128 x 128 blocks and one partial group row
    g = torch.Generator().manual_seed(300)
    w13, s13 = quantize_fp8_blocks((torch.randn(num_experts, 2 * inter, hidden, generator=g) / 16).bfloat16())
    w2, s2 = quantize_fp8_blocks((torch.randn(num_experts, hidden, inter, generator=g) / 11).bfloat16())
    placement = ExpertPlacement.linear(num_experts, world)
    mine_e = (placement.owner == rank).nonzero().flatten()
    order = mine_e[placement.local[mine_e].argsort()]
    for replicated in (False, True):
        ws = SharedMemoryEPWorkspace(
            dist.group.WORLD, max_tokens_per_rank=MAX_TOKENS, hidden_size=hidden, top_k=TOP_K,
            dtype=torch.bfloat16, placement=placement, replicated_tokens=replicated, timeout_s=60.0,
            node_size=node_size,
        )  # fmt: skip
        try:
            counts = [11] * world if replicated else [7, 0, 19, 5][:world]
            total = counts[0] if replicated else sum(counts)
            x = torch.randn(total, hidden, generator=g).bfloat16()
            ids = torch.rand(total, num_experts, generator=g).argsort(dim=1)[:, :TOP_K].to(torch.int32)
            weights = torch.rand(total, TOP_K, generator=g)
            expected = fused_moe_fp8(x, w13, w2, s13, s2, weights, ids)
            start = 0 if replicated else sum(counts[:rank])
            mine = slice(start, start + counts[rank])
            out = ws.fused_moe_fp8(x[mine], w13[order], w2[order], s13[order], s2[order], weights[mine], ids[mine])
            assert torch.equal(out, expected[mine]), f"FP8 EP={world} (replicated={replicated}) differs from one rank"
        finally:
            ws.close()


def scenario_replicated(rank, world):
    num_experts = 8
    ws, placement = _workspace(world, num_experts, replicated=True)
    try:
        for call, tokens in enumerate([1, 13, MAX_TOKENS, 0]):
            x, w13, w2, weights, ids = _global_inputs(200 + call, [tokens], num_experts)
            local13, local2 = _local_weights(w13, w2, placement, rank)
            phases = []
            out = ws.fused_moe(x, local13, local2, weights, ids, on_phase=phases.append)
            assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))
            assert phases == ["experts", "combine"]
    finally:
        ws.close()


def scenario_silent_peer(rank, world):
    num_experts = 8
    ws, placement = _workspace(world, num_experts, timeout_s=1.5)
    try:
        x, w13, w2, weights, ids = _global_inputs(300, [8] * world, num_experts)
        local13, local2 = _local_weights(w13, w2, placement, rank)
        if rank == 1:
            dist.barrier()  # never calls the layer; waits until rank 0 has given up
            return
        with pytest.raises(PeerTimeoutError, match=r"rank 0: rank 1 did not post its tokens within 1.5 s \(layer L7"):
            ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8], layer="L7")
        dist.barrier()
    finally:
        ws.close()


def scenario_killed_peer(rank, world):
    num_experts = 8
    ws, placement = _workspace(world, num_experts, timeout_s=1.5)
    x, w13, w2, weights, ids = _global_inputs(400, [8] * world, num_experts)
    local13, local2 = _local_weights(w13, w2, placement, rank)
    ws.fused_moe(x[rank * 8 : rank * 8 + 8], local13, local2, weights[:8], ids[:8])
    if rank == 1:
        os._exit(0)  # dies between calls
    with pytest.raises(PeerTimeoutError, match="rank 1 did not post its tokens"):
        ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8])
    ws.close()


def scenario_nodes(rank, world, node_size):
    """``world`` ranks in nodes of ``node_size`` (shared memory only inside a node, collectives
    between): distinct and replicated tokens, bitwise one-rank fused_moe, so bitwise the one-node EP
    too. Three or more nodes put several nodes' rows in one inbox."""
    num_experts = 12 * node_size if world == 3 else 16
    ws, placement = _workspace(world, num_experts, node_size=node_size)
    assert (ws.nodes, ws.node, ws.local_index) == (world // node_size, rank // node_size, rank % node_size)
    assert [seg is not None for seg in ws.segments] == [r // node_size == rank // node_size for r in range(world)]
    try:
        cases = [((37, 5, 60, 12), "uniform"), ((0, 41, 9, 0), "uniform"), ((MAX_TOKENS, 1, 17, 3), "one_rank"),
                 ((23, 23, 50, 8), "hot"), ((1, 1, 1, 1), "uniform")]
        for call, (counts, routing) in enumerate(cases):
            counts = counts[:world]
            x, w13, w2, weights, ids = _global_inputs(700 + call, counts, num_experts, routing)
            if call == 1:
                ids[:, 1] = -1  # unrouted slots across nodes too
            expected = fused_moe(x, w13, w2, weights, ids)
            start = sum(counts[:rank])
            mine = slice(start, start + counts[rank])
            local13, local2 = _local_weights(w13, w2, placement, rank)
            out = ws.fused_moe(x[mine], local13, local2, weights[mine], ids[mine], layer=f"case{call}",
                               max_tokens_across_ranks=max(counts))
            assert torch.equal(out, expected[mine]), f"case {call}: EP in nodes of {node_size} differs from one rank"
    finally:
        ws.close()
    ws, placement = _workspace(world, num_experts, replicated=True, node_size=node_size)
    try:
        x, w13, w2, weights, ids = _global_inputs(800, [29], num_experts)
        local13, local2 = _local_weights(w13, w2, placement, rank)
        assert torch.equal(ws.fused_moe(x, local13, local2, weights, ids), fused_moe(x, w13, w2, weights, ids))
    finally:
        ws.close()


def scenario_silent_peer_on_another_node(rank, world):
    num_experts = 8
    ws, placement = _workspace(world, num_experts, timeout_s=1.5, node_size=2)
    try:
        x, w13, w2, weights, ids = _global_inputs(900, [8] * world, num_experts)
        local13, local2 = _local_weights(w13, w2, placement, rank)
        if rank >= 2:
            time.sleep(4)  # node 1 never calls the layer
            return
        with pytest.raises(PeerTimeoutError, match=rf"rank {rank}: gathering top-k ids across nodes did not "
                                                   rf"complete within 1.5 s \(layer L9"):
            ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8], layer="L9")
    finally:
        ws.close()


def scenario_killed_peer_on_another_node(rank, world):
    """Rank 3 dies between calls: every other rank's next call fails within the bound (its node's
    peer on the flag, the other node on the collective), naming the rank or the step."""
    num_experts = 8
    ws, placement = _workspace(world, num_experts, timeout_s=1.5, node_size=2)
    x, w13, w2, weights, ids = _global_inputs(950, [8] * world, num_experts)
    local13, local2 = _local_weights(w13, w2, placement, rank)
    ws.fused_moe(x[rank * 8 : rank * 8 + 8], local13, local2, weights[:8], ids[:8])
    if rank == 3:
        os._exit(0)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError, match="rank 3 did not post its tokens" if rank == 2 else "across nodes"):
        ws.fused_moe(x[:8], local13, local2, weights[:8], ids[:8])
    assert time.monotonic() - start < 30
    ws.close()


def test_killed_peer_on_another_node_fails_every_rank_in_bounded_time():
    procs, queue = spawn_ranks(scenario_killed_peer_on_another_node, 4)
    results = [queue.get(timeout=120) for _ in range(3)]
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    assert sorted(r for r, _, _ in results) == [0, 1, 2]
    assert all(error is None for _, error, _ in results), [e for _, e, _ in results if e]


def scenario_fp8_two_nodes(rank, world):
    scenario_fp8(rank, world, node_size=2)


def scenario_two_nodes(rank, world):
    scenario_nodes(rank, world, 2)


def scenario_three_nodes(rank, world):
    scenario_nodes(rank, world, 1)


def test_two_nodes_of_two_ranks_equal_one_rank_bitwise():
    run_ranks(scenario_two_nodes, 4)


def test_three_nodes_of_one_rank_equal_one_rank_bitwise():
    run_ranks(scenario_three_nodes, 3)


def test_fp8_two_nodes_of_two_ranks_equal_one_rank_bitwise():
    run_ranks(scenario_fp8_two_nodes, 4)


def test_silent_node_times_out_with_a_clear_error():
    run_ranks(scenario_silent_peer_on_another_node, 4)


@pytest.mark.parametrize("world", [2, 3])
def test_expert_parallel_equals_one_rank_bitwise(world):
    run_ranks(scenario_distinct, world)


def test_fp8_expert_parallel_equals_one_rank_bitwise():
    run_ranks(scenario_fp8, 2)


def test_ranks_passing_different_bounds_get_a_clear_error():
    run_ranks(scenario_bound_mismatch, 2)


def test_replicated_tokens_tensor_parallel_mode():
    run_ranks(scenario_replicated, 2)


def test_silent_peer_times_out_with_a_clear_error():
    run_ranks(scenario_silent_peer, 2)


def test_killed_peer_times_out_with_a_clear_error():
    procs, queue = spawn_ranks(scenario_killed_peer, 2)
    rank, error, _ = queue.get(timeout=120)
    for p in procs:
        p.join(30)
    assert rank == 0 and error is None, error
    assert procs[1].exitcode == 0


def test_placement_from_expert_maps():
    maps = [torch.tensor([-1, 0, -1, 1]), torch.tensor([0, -1, 1, -1])]
    p = ExpertPlacement.from_expert_maps(maps)
    assert p.owner.tolist() == [1, 0, 1, 0] and p.local.tolist() == [0, 0, 1, 1]
    assert torch.equal(p.expert_map(1), maps[1].to(torch.int32))
    with pytest.raises(ValueError, match="exactly one rank"):
        ExpertPlacement.from_expert_maps([torch.tensor([0, -1]), torch.tensor([0, -1])])
