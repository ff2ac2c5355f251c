"""Kittens expert parallelism over symmetric memory, one rank per GPU of the machine (up to 8;
spawned ranks, NCCL group).

On a machine with one GPU the bitwise and CUDA-graph scenarios run with one rank (every expert
local, rows pulled from the rank's own segment: the schedule, GEMM1's chunk queue and ready
flags, the combine) and the silent-peer test is skipped. Cases give token counts for 8 ranks and
use the first ``world``; shapes get ``top_k * world`` experts where they have fewer, so that the
``one_rank`` routing finds ``top_k`` distinct experts on rank 0.

Every rank draws the same global inputs, runs its share through ``SymmetricMemoryEPWorkspace`` and
checks the result bitwise against one-GPU ``fused_moe`` on the global inputs with all experts, and
against the torch reference within bf16 tolerance; each scenario runs for bf16 experts and for FP8
block-scaled ones (``quant``). Run with ``pytest -m gpu`` on a machine with
2 or more GPUs; NVLink multicast stays off (``rank_runner`` sets NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 in every NCCL rank).
"""

import functools

import pytest
import rank_runner
import torch
from ep_sim import global_inputs, local_experts, one_gpu_ops

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA GPUs", allow_module_level=True)

WORLD = min(8, torch.cuda.device_count())


def run_ranks(scenario, world=WORLD):
    rank_runner.run_ranks(scenario, world, backend="nccl", timeout=600, join_timeout=30)


SHAPES = [  # hidden, inter, experts, top_k
    (1024, 512, 16, 8),
    (448, 160, 12, 4),  # hidden / inter not multiples of the block sizes
]
CASES = [  # tokens per rank (the first `world` of them), routing
    ((1, 1, 1, 0, 1, 1, 0, 1), "uniform"),
    ((37, 5, 0, 19, 3, 64, 1, 7), "uniform"),
    ((0, 41, 17, 0, 0, 9, 33, 2), "uniform"),
    ((96, 13, 40, 0, 7, 96, 3, 50), "one_rank"),
    ((50,) * 8, "hot"),
    ((128,) * 8, "uniform"),
    ((1000, 2048, 0, 512, 2048, 7, 1500, 33), "uniform"),
    ((8192,) * 8, "uniform"),
    ((8192, 3000, 0, 8192, 1, 4096, 77, 8192), "hot"),
]
FP8_CASES = CASES[:7] + [((4096, 1500, 0, 4096, 3, 2048, 77, 4096), "hot")]  # FP8 workspaces hold 4096 tokens per rank
QUANTS = {  # quant: its ep_sim name, max tokens per rank, cases, seed offset, log tag
    "bf16": dict(quant=None, max_tokens=8192, cases=CASES, seed=0, tag=""),
    "fp8": dict(quant="fp8", max_tokens=4096, cases=FP8_CASES, seed=2000, tag="FP8 "),
}


def experts_for(num_experts, top_k, world):
    return max(num_experts, top_k * world)


def quant_ops(quant):
    """(one-GPU op, torch reference, rel err bound, name of the workspace's op) of a quant."""
    return (*one_gpu_ops(QUANTS[quant]["quant"]), "fused_moe" if quant == "bf16" else "fused_moe_fp8")


def quant_inputs(quant, seed, counts, num_experts, hidden, inter, top_k, routing="uniform", *, world):
    """(x, experts, weights, ids) of ``ep_sim.global_inputs`` for a quant of QUANTS."""
    return global_inputs(seed, counts, num_experts, world=world, hidden=hidden, inter=inter, top_k=top_k,
                         routing=routing, quant=QUANTS[quant]["quant"])


def workspace(quant, placement, max_tokens, hidden, top_k, timeout_s=30.0):
    from mok_serve.kernels.cuda.ep import SymmetricMemoryEPWorkspace

    kw = {} if quant == "bf16" else {"quant": quant}
    return SymmetricMemoryEPWorkspace(
        None, max_tokens_per_rank=max_tokens, hidden_size=hidden, top_k=top_k, dtype=torch.bfloat16,
        placement=placement, timeout_s=timeout_s, **kw,
    )


def scenario_bitwise(rank, world, quant="bf16"):
    from mok_serve.kernels.cuda.ep import ExpertPlacement

    q = QUANTS[quant]
    one_gpu, reference, tol, op = quant_ops(quant)
    tag = q["tag"]
    lines = []
    for si, (H, I, E, K) in enumerate(SHAPES):
        E = experts_for(E, K, world)
        placement = ExpertPlacement.linear(E, world)
        ws = workspace(quant, placement, q["max_tokens"], H, K)
        cases = q["cases"] if si == 0 else q["cases"][:6]
        for ci, (counts, routing) in enumerate(cases):
            counts = counts[:world]
            x, experts, weights, ids = quant_inputs(quant, q["seed"] + 1000 * si + ci, counts, E, H, I, K, routing,
                                                    world=world)
            expected = one_gpu(x, *experts, weights, ids)
            ref = reference(x, *experts, weights, ids)
            start = sum(counts[:rank])
            sl = slice(start, start + counts[rank])
            local = local_experts(experts, placement, rank)
            first = None
            # Back-to-back calls: both return modes, rows pulled inside GEMM1 or before it, calls laid
            # out by the workspace limit or by the call's largest count (max_tokens_across_ranks).
            bound = max(counts)
            for mode, ws.pull_in_gemm1, call_bound in (("pull", True, bound), ("push", True, None),
                                                       ("pull", False, bound), ("pull", True, None)):
                ws.return_mode = mode
                out = getattr(ws, op)(x[sl], *local, weights[sl], ids[sl], layer=f"{tag.lower()}s{si}c{ci}",
                                      max_tokens_across_ranks=call_bound)
                torch.cuda.synchronize()
                ws._raise_if_error(ws.state.cpu())
                if counts[rank]:
                    err = ((out.float() - ref[sl].float()).norm() / ref[sl].float().norm()).item()
                    assert err < tol, f"{tag}shape {si} case {ci} {mode}: rel err {err}"
                assert torch.equal(out, expected[sl]), (
                    f"{tag}shape {si} case {ci} ({counts}, {routing}) {mode}: EP={world} differs from one GPU; "
                    f"max diff {(out.float() - expected[sl].float()).abs().max().item()}"
                )
                if first is None:
                    first = out.clone()
                assert torch.equal(out, first), "repeat call differs"
            post_ns, comp_ns = ws.wait_ns()
            lines.append(f"{tag}shape {(H, I, E, K)} tokens {counts} {routing}: bitwise OK (bound {bound} and "
                         f"{q['max_tokens']}); waits "
                         f"{post_ns/1e3:.1f} / {comp_ns/1e3:.1f} us")
        ws.check_errors()
        ws.close()
    return "\n".join(lines)


def scenario_graph(rank, world, quant="bf16"):
    from mok_serve.kernels.cuda.ep import ExpertPlacement

    one_gpu, _, _, op = quant_ops(quant)
    tag = QUANTS[quant]["tag"]
    H, I, K = 1024, 512, 8
    E = experts_for(16, K, world)
    placement = ExpertPlacement.linear(E, world)
    ws = workspace(quant, placement, 256, H, K)
    counts = (200, 77, 0, 256, 5, 130, 64, 1)[:world]
    x, experts, weights, ids = quant_inputs(quant, 7, counts, E, H, I, K, world=world)
    sl = slice(sum(counts[:rank]), sum(counts[:rank]) + counts[rank])
    local = local_experts(experts, placement, rank)
    xs, ws_, is_ = x[sl].clone(), weights[sl].clone(), ids[sl].clone()
    getattr(ws, op)(xs, *local, ws_, is_)  # warm up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = getattr(ws, op)(xs, *local, ws_, is_)
    for seed in (11, 12, 13):  # new inputs each replay, layer after layer
        x2, _, w2b, ids2 = quant_inputs(quant, seed, counts, E, H, I, K, world=world)
        xs.copy_(x2[sl])
        ws_.copy_(w2b[sl])
        is_.copy_(ids2[sl])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, one_gpu(x2, *experts, w2b, ids2)[sl]), f"{tag}graph replay {seed} differs"
    ws.check_errors()
    return f"{tag}graph: 3 replays bitwise OK; epoch {int(ws.state[0])}"


def scenario_silent_peer(rank, world):
    import torch.distributed as dist

    from mok_serve.kernels.cuda.ep import ExpertPlacement, PeerTimeoutError, SymmetricMemoryEPWorkspace

    H, I, E, K = 256, 128, 8, 4
    placement = ExpertPlacement.linear(E, world)
    ws = SymmetricMemoryEPWorkspace(
        None, max_tokens_per_rank=16, hidden_size=H, top_k=K, dtype=torch.bfloat16, placement=placement,
        timeout_s=1.0,
    )
    x, experts, weights, ids = global_inputs(5, [8, 8], E, world=world, hidden=H, inter=I, top_k=K)
    l13, l2 = local_experts(experts, placement, rank)
    if rank != 0:
        dist.barrier()  # never calls the layer; waits until rank 0 has given up
        return "silent"
    ws.fused_moe(x[:8], l13, l2, weights[:8], ids[:8], layer="L7")
    with pytest.raises(PeerTimeoutError, match=r"rank 0: rank 1 did not post its tokens within 1 s \(layer L7, call 1\)"):
        ws.check_errors()
    with pytest.raises(PeerTimeoutError, match="rank 1 did not post its tokens"):
        ws.fused_moe(x[:8], l13, l2, weights[:8], ids[:8], layer="L8")
    dist.barrier()
    return "timeout error raised"


@pytest.mark.parametrize("quant", QUANTS)
def test_ep_bitwise_equal_to_one_gpu(quant):
    run_ranks(functools.partial(scenario_bitwise, quant=quant))


@pytest.mark.parametrize("quant", QUANTS)
def test_ep_cuda_graph_replays(quant):
    run_ranks(functools.partial(scenario_graph, quant=quant))


@pytest.mark.skipif(WORLD < 2, reason="needs 2 CUDA GPUs")
def test_ep2_silent_peer_times_out():
    run_ranks(scenario_silent_peer)
