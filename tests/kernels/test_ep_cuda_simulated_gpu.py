"""Kittens expert parallelism at 4 and 8 ranks, simulated on one GPU (issue 7).

No machine with 4 or 8 GPUs has been lent, so this runs the compiled kernels with 4 and 8 ranks
simulated in one process (``ep_sim``): each rank's segment is a plain tensor on the one GPU, the
pointer tables hold their addresses, and every launch step runs on every rank before the next.
It covers what depends on the number of ranks (pointer tables, per-source schedule and pull,
GEMM1's chunk queue over 4 and 8 sources, both returns, the combine) at sizes the interpreter
cannot run, bitwise against the one-GPU kernel. Cross-GPU memory ordering and NVLink are not
covered: that is ``test_ep_cuda_gpu.py``, which runs at as many GPUs as the machine has.
"""

import pytest
import torch
from ep_sim import global_inputs, local_experts, one_gpu_ops, run_call, run_split, simulated_ranks, split_args
from moe_test_utils import rel_err

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

MAX_T = 2048
SHAPES = [(1024, 512, 8), (448, 160, 4)]  # hidden, inter, top_k; the second not a multiple of the blocks
CASES = {  # world: [(tokens per rank, routing)]
    4: [((5, 0, 300, 77), "uniform"), ((128, 128, 128, 128), "one_rank"), ((1000, 13, MAX_T, 0), "hot")],
    8: [((3, 0, MAX_T, 1, 500, 64, 7, 1024), "uniform"), ((40,) * 8, "one_rank"),
        ((MAX_T, 0, 1, 700, 33, 0, 128, 9), "hot")],
}
MODES = [  # return mode, rows pulled inside GEMM1, quant
    ("pull", False, None),
    ("pull", True, None),
    ("push", False, None),
    ("pull", False, "fp8"),
]


@pytest.mark.parametrize("return_mode,pull_in_gemm1,quant", MODES)
@pytest.mark.parametrize("world", sorted(CASES))
def test_simulated_ep_equals_one_gpu_bitwise(world, return_mode, pull_in_gemm1, quant):
    one_gpu, reference, tol = one_gpu_ops(quant)
    for si, (H, I, K) in enumerate(SHAPES):
        E = K * world  # one_rank routing needs top_k experts on rank 0
        ranks, placement, _ = simulated_ranks(
            world, E, max_tokens=MAX_T, hidden=H, top_k=K, device="cuda", quant=quant, timeout_s=30.0,
            return_mode=return_mode, pull_in_gemm1=pull_in_gemm1,
        )
        for ci, (counts, routing) in enumerate(CASES[world]):
            x, experts, weights, ids = global_inputs(100 * si + ci, counts, E, world=world, hidden=H, inter=I, top_k=K,
                                                    routing=routing, quant=quant)
            expected = one_gpu(x, *experts, weights, ids)
            ref = reference(x, *experts, weights, ids)
            for call in range(2):  # back-to-back calls on the same segments
                got = run_split(ranks, placement, x, experts, weights, ids, counts, layer=f"s{si}c{ci}")
                torch.cuda.synchronize()
                assert not got.isnan().any(), f"shape {si} case {ci}: NaN (unwritten rows?)"
                err = rel_err(got, ref)
                assert err < tol, f"shape {si} case {ci}: rel err {err}"
                assert torch.equal(got, expected), (
                    f"shape {si} case {ci} ({counts}, {routing}) call {call}: simulated EP={world} differs "
                    f"from one GPU; max diff {(got.float() - expected.float()).abs().max().item()}"
                )
        for ws in ranks:
            ws.check_errors()
            assert int(ws.state[0]) == 2 * len(CASES[world])


@pytest.mark.parametrize("world", sorted(CASES))
def test_simulated_ep_cuda_graph_replays(world):
    # One graph holds every rank's launch steps; replays with new inputs written into its buffers.
    from mok_serve import kernels

    H, I, K = SHAPES[0]
    E = K * world
    counts = CASES[world][0][0]
    ranks, placement, _ = simulated_ranks(world, E, max_tokens=MAX_T, hidden=H, top_k=K, device="cuda",
                                          timeout_s=30.0, pull_in_gemm1=True)
    x, experts, weights, ids = global_inputs(7, counts, E, world=world, hidden=H, inter=I, top_k=K)
    bounds = [sum(counts[:r]) for r in range(world + 1)]
    xs, ws_, is_ = x.clone(), weights.clone(), ids.clone()
    args = [(xs[bounds[r]:bounds[r + 1]], *local_experts(experts, placement, r), ws_[bounds[r]:bounds[r + 1]],
             is_[bounds[r]:bounds[r + 1]]) for r in range(world)]
    run_call(ranks, args)  # warm up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run_call(ranks, args)
    for seed in (11, 12, 13):
        x2, _, w2b, ids2 = global_inputs(seed, counts, E, world=world, hidden=H, inter=I, top_k=K)
        xs.copy_(x2)
        ws_.copy_(w2b)
        is_.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(torch.cat(outs), kernels.fused_moe(x2, *experts, w2b, ids2)), f"replay {seed} differs"
    for ws in ranks:
        ws.check_errors()


@pytest.mark.parametrize("quant", [None, "fp8"])
def test_simulated_ep_drops_unrouted_slots_without_a_host_sync(quant):
    """-1 ids (unrouted) drop out on every rank as on one GPU, bitwise, and no launch step of the
    call synchronises with the host (torch's sync debug mode would raise)."""
    one_gpu, _, _ = one_gpu_ops(quant)
    world, (H, I, K) = 4, SHAPES[0]
    E = K * world
    counts = CASES[world][0][0]
    ranks, placement, _ = simulated_ranks(world, E, max_tokens=MAX_T, hidden=H, top_k=K, device="cuda", quant=quant,
                                          timeout_s=30.0)
    x, experts, weights, ids = global_inputs(21, counts, E, world=world, hidden=H, inter=I, top_k=K, quant=quant)
    run_split(ranks, placement, x, experts, weights, ids, counts)  # warm up (compiles)
    ids[::7, 1] = -1
    ids[3] = -1
    args, kwargs = split_args(placement, x, experts, weights, ids, counts)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = run_call(ranks, args, per_rank_kwargs=kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = torch.cat(outs)
    assert torch.equal(got, one_gpu(x, *experts, weights, ids))
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    for ws in ranks:
        ws.check_errors()


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("world,node_size", [(4, 2), (8, 4), (8, 2)])
def test_simulated_ep_across_nodes_equals_one_gpu_bitwise(world, node_size, quant):
    """Simulated nodes (issue 39): each rank maps only its node's segments, rows and results cross
    nodes through the collectives (``SimulatedCollectives``: device copies in launch order): bitwise
    the one-GPU kernel, and no launch step or exchange of the call synchronises with the host."""
    one_gpu, reference, tol = one_gpu_ops(quant)
    H, I, K = SHAPES[1]
    E = K * world
    ranks, placement, _ = simulated_ranks(world, E, max_tokens=MAX_T, hidden=H, top_k=K, device="cuda", quant=quant,
                                          timeout_s=30.0, node_size=node_size)
    for ci, (counts, routing) in enumerate(CASES[world]):
        x, experts, weights, ids = global_inputs(300 + ci, counts, E, world=world, hidden=H, inter=I, top_k=K,
                                                routing=routing, quant=quant)
        expected = one_gpu(x, *experts, weights, ids)
        ref = reference(x, *experts, weights, ids)
        args, kwargs = split_args(placement, x, experts, weights, ids, counts)
        for call in range(2):  # back-to-back calls; the second under torch's sync debug mode
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if call else "default")
            try:
                got = torch.cat(run_call(ranks, args, layer=f"c{ci}", per_rank_kwargs=kwargs))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
            assert not got.isnan().any(), f"case {ci}: NaN (unwritten rows?)"
            assert rel_err(got, ref) < tol, f"case {ci}: rel err {rel_err(got, ref)}"
            assert torch.equal(got, expected), f"case {ci} call {call}: {world} ranks in nodes of {node_size} differ"
    for ws in ranks:
        ws.check_errors()
