"""Kittens expert parallelism on 2 GPUs over symmetric memory (spawned ranks, NCCL group).

Every rank draws the same global inputs, runs its share through ``SymmetricMemoryEPWorkspace`` and
checks the result bitwise against one-GPU ``fused_moe`` on the global inputs with all experts, and
against the torch reference within bf16 tolerance. Run with ``pytest -m gpu`` on a machine with
2 GPUs; NVLink multicast stays off (NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
NVSHMEM_DISABLE_NVLS=1).
"""

import os

import pytest
import rank_runner
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs 2 CUDA GPUs", allow_module_level=True)

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")

WORLD = 2


def run_ranks(scenario, world=WORLD):
    rank_runner.run_ranks(scenario, world, backend="nccl", timeout=600, join_timeout=30)


def global_inputs(seed, counts, num_experts, hidden, inter, top_k, routing="uniform"):
    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, hidden, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=g) / inter**0.5).bfloat16()
    ids = torch.rand(total, num_experts, device="cuda", generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    if routing == "one_rank":  # every token's experts live on rank 0
        ids = torch.rand(total, num_experts // 2, device="cuda", generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    elif routing == "hot":  # one expert in every token's first slot
        ids[:, 0] = num_experts - 1
        ids[:, 1:] = torch.rand(total, num_experts - 1, device="cuda", generator=g).argsort(dim=1)[:, : top_k - 1].to(torch.int32)
    weights = torch.rand(total, top_k, device="cuda", generator=g)
    return x, w13, w2, weights, ids


def local_weights(w13, w2, placement, rank):
    mine = (placement.owner == rank).nonzero().flatten().to(w13.device)
    order = mine[placement.local[mine.cpu()].argsort().to(w13.device)]
    return w13[order].contiguous(), w2[order].contiguous()


SHAPES = [  # hidden, inter, experts, top_k
    (1024, 512, 16, 8),
    (448, 160, 12, 4),  # hidden / inter not multiples of the block sizes
]
CASES = [  # tokens per rank, routing
    ((1, 1), "uniform"),
    ((37, 5), "uniform"),
    ((0, 41), "uniform"),
    ((96, 13), "one_rank"),
    ((50, 50), "hot"),
    ((128, 128), "uniform"),
    ((1000, 2048), "uniform"),
    ((8192, 8192), "uniform"),
    ((8192, 3000), "hot"),
]


def scenario_bitwise(rank, world):
    from mok_serve.kernels import fused_moe, fused_moe_reference
    from mok_serve.kernels.ep_cuda import ExpertPlacement, SymmetricMemoryEPWorkspace

    lines = []
    for si, (H, I, E, K) in enumerate(SHAPES):
        placement = ExpertPlacement.linear(E, world)
        ws = SymmetricMemoryEPWorkspace(
            None, max_tokens_per_rank=8192, hidden_size=H, top_k=K, dtype=torch.bfloat16,
            placement=placement, timeout_s=30.0,
        )
        cases = CASES if si == 0 else CASES[:6]
        for ci, (counts, routing) in enumerate(cases):
            x, w13, w2, weights, ids = global_inputs(1000 * si + ci, counts, E, H, I, K, routing)
            expected = fused_moe(x, w13, w2, weights, ids)
            ref = fused_moe_reference(x, w13, w2, weights, ids)
            start = sum(counts[:rank])
            sl = slice(start, start + counts[rank])
            l13, l2 = local_weights(w13, w2, placement, rank)
            for mode in ("pull", "push", "pull"):  # back-to-back calls, both return modes
                ws.return_mode = mode
                out = ws.fused_moe(x[sl], l13, l2, weights[sl], ids[sl], layer=f"s{si}c{ci}")
                torch.cuda.synchronize()
                ws._raise_if_error(ws.state.cpu())
                if counts[rank]:
                    err = ((out.float() - ref[sl].float()).norm() / ref[sl].float().norm()).item()
                    assert err < 1e-2, f"shape {si} case {ci} {mode}: rel err {err}"
                assert torch.equal(out, expected[sl]), (
                    f"shape {si} case {ci} ({counts}, {routing}) {mode}: EP=2 differs from one GPU; "
                    f"max diff {(out.float() - expected[sl].float()).abs().max().item()}"
                )
            post_ns, comp_ns = ws.wait_ns()
            lines.append(f"shape {(H, I, E, K)} tokens {counts} {routing}: bitwise OK; waits {post_ns/1e3:.1f} / {comp_ns/1e3:.1f} us")
        ws.check_errors()
        ws.close()
    return "\n".join(lines)


def scenario_graph(rank, world):
    from mok_serve.kernels import fused_moe
    from mok_serve.kernels.ep_cuda import ExpertPlacement, SymmetricMemoryEPWorkspace

    H, I, E, K = 1024, 512, 16, 8
    placement = ExpertPlacement.linear(E, world)
    ws = SymmetricMemoryEPWorkspace(
        None, max_tokens_per_rank=256, hidden_size=H, top_k=K, dtype=torch.bfloat16, placement=placement,
        timeout_s=30.0,
    )
    counts = (200, 77)
    x, w13, w2, weights, ids = global_inputs(7, counts, E, H, I, K)
    sl = slice(sum(counts[:rank]), sum(counts[:rank]) + counts[rank])
    l13, l2 = local_weights(w13, w2, placement, rank)
    xs, ws_, is_ = x[sl].clone(), weights[sl].clone(), ids[sl].clone()
    out = ws.fused_moe(xs, l13, l2, ws_, is_)  # warm up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ws.fused_moe(xs, l13, l2, ws_, is_)
    outs = []
    for seed in (11, 12, 13):  # new inputs each replay, layer after layer
        x2, _, _, w2b, ids2 = global_inputs(seed, counts, E, H, I, K)
        xs.copy_(x2[sl])
        ws_.copy_(w2b[sl])
        is_.copy_(ids2[sl])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, fused_moe(x2, w13, w2, w2b, ids2)[sl]), f"graph replay {seed} differs"
        outs.append(gout.clone())
    ws.check_errors()
    return f"graph: 3 replays bitwise OK; epoch {int(ws.state[0])}"


def scenario_silent_peer(rank, world):
    import torch.distributed as dist

    from mok_serve.kernels.ep_cuda import ExpertPlacement, PeerTimeoutError, SymmetricMemoryEPWorkspace

    H, I, E, K = 256, 128, 8, 4
    placement = ExpertPlacement.linear(E, world)
    ws = SymmetricMemoryEPWorkspace(
        None, max_tokens_per_rank=16, hidden_size=H, top_k=K, dtype=torch.bfloat16, placement=placement,
        timeout_s=1.0,
    )
    x, w13, w2, weights, ids = global_inputs(5, [8, 8], E, H, I, K)
    l13, l2 = local_weights(w13, w2, placement, rank)
    if rank == 1:
        dist.barrier()  # never calls the layer; waits until rank 0 has given up
        return "silent"
    ws.fused_moe(x[:8], l13, l2, weights[:8], ids[:8], layer="L7")
    with pytest.raises(PeerTimeoutError, match=r"rank 0: rank 1 did not post its tokens within 1 s \(layer L7, call 1\)"):
        ws.check_errors()
    with pytest.raises(PeerTimeoutError, match="rank 1 did not post its tokens"):
        ws.fused_moe(x[:8], l13, l2, weights[:8], ids[:8], layer="L8")
    dist.barrier()
    return "timeout error raised"


# ---------------------------------------------------------------------------------- FP8 experts


def fp8_inputs(seed, counts, num_experts, hidden, inter, top_k, routing="uniform"):
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    x, w13, w2, weights, ids = global_inputs(seed, counts, num_experts, hidden, inter, top_k, routing)
    (q13, s13), (q2, s2) = quantize_fp8_blocks(w13), quantize_fp8_blocks(w2)
    return x, (q13, q2, s13, s2), weights, ids


def local_fp8(fp8, placement, rank):
    q13, q2, s13, s2 = fp8
    l13, l2 = local_weights(q13, q2, placement, rank)
    ls13, ls2 = local_weights(s13, s2, placement, rank)
    return l13, l2, ls13, ls2


FP8_CASES = [  # tokens per rank, routing (uneven, a rank with 0 tokens, skewed)
    ((1, 1), "uniform"),
    ((37, 5), "uniform"),
    ((0, 41), "uniform"),
    ((96, 13), "one_rank"),
    ((50, 50), "hot"),
    ((128, 128), "uniform"),
    ((1000, 2048), "uniform"),
    ((4096, 1500), "hot"),
]


def scenario_fp8_bitwise(rank, world):
    from mok_serve.kernels import fused_moe_fp8, fused_moe_fp8_reference
    from mok_serve.kernels.ep_cuda import ExpertPlacement, SymmetricMemoryEPWorkspace

    lines = []
    for si, (H, I, E, K) in enumerate(SHAPES):
        placement = ExpertPlacement.linear(E, world)
        ws = SymmetricMemoryEPWorkspace(
            None, max_tokens_per_rank=4096, hidden_size=H, top_k=K, dtype=torch.bfloat16,
            placement=placement, timeout_s=30.0, quant="fp8",
        )
        cases = FP8_CASES if si == 0 else FP8_CASES[:6]
        for ci, (counts, routing) in enumerate(cases):
            x, fp8, weights, ids = fp8_inputs(2000 + 1000 * si + ci, counts, E, H, I, K, routing)
            expected = fused_moe_fp8(x, *fp8, weights, ids)
            ref = fused_moe_fp8_reference(x, *fp8, weights, ids)
            start = sum(counts[:rank])
            sl = slice(start, start + counts[rank])
            local = local_fp8(fp8, placement, rank)
            first = None
            for mode in ("pull", "push", "pull"):  # back-to-back calls, both return modes
                ws.return_mode = mode
                out = ws.fused_moe_fp8(x[sl], *local, weights[sl], ids[sl], layer=f"fp8 s{si}c{ci}")
                torch.cuda.synchronize()
                ws._raise_if_error(ws.state.cpu())
                if counts[rank]:
                    err = ((out.float() - ref[sl].float()).norm() / ref[sl].float().norm()).item()
                    assert err < 3e-2, f"FP8 shape {si} case {ci} {mode}: rel err {err}"
                assert torch.equal(out, expected[sl]), (
                    f"FP8 shape {si} case {ci} ({counts}, {routing}) {mode}: EP=2 differs from one GPU; "
                    f"max diff {(out.float() - expected[sl].float()).abs().max().item()}"
                )
                if first is None:
                    first = out.clone()
                assert torch.equal(out, first), "repeat call differs"
            post_ns, comp_ns = ws.wait_ns()
            lines.append(f"FP8 shape {(H, I, E, K)} tokens {counts} {routing}: bitwise OK; waits "
                         f"{post_ns/1e3:.1f} / {comp_ns/1e3:.1f} us")
        ws.check_errors()
        ws.close()
    return "\n".join(lines)


def scenario_fp8_graph(rank, world):
    from mok_serve.kernels import fused_moe_fp8
    from mok_serve.kernels.ep_cuda import ExpertPlacement, SymmetricMemoryEPWorkspace

    H, I, E, K = 1024, 512, 16, 8
    placement = ExpertPlacement.linear(E, world)
    ws = SymmetricMemoryEPWorkspace(
        None, max_tokens_per_rank=256, hidden_size=H, top_k=K, dtype=torch.bfloat16, placement=placement,
        timeout_s=30.0, quant="fp8",
    )
    counts = (200, 77)
    x, fp8, weights, ids = fp8_inputs(7, counts, E, H, I, K)
    sl = slice(sum(counts[:rank]), sum(counts[:rank]) + counts[rank])
    local = local_fp8(fp8, placement, rank)
    xs, ws_, is_ = x[sl].clone(), weights[sl].clone(), ids[sl].clone()
    ws.fused_moe_fp8(xs, *local, ws_, is_)  # warm up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = ws.fused_moe_fp8(xs, *local, ws_, is_)
    for seed in (11, 12, 13):  # new inputs each replay
        x2, _, w2b, ids2 = fp8_inputs(seed, counts, E, H, I, K)
        xs.copy_(x2[sl])
        ws_.copy_(w2b[sl])
        is_.copy_(ids2[sl])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, fused_moe_fp8(x2, *fp8, w2b, ids2)[sl]), f"FP8 graph replay {seed} differs"
    ws.check_errors()
    return f"FP8 graph: 3 replays bitwise OK; epoch {int(ws.state[0])}"


def test_ep2_bitwise_equal_to_one_gpu():
    run_ranks(scenario_bitwise)


def test_ep2_cuda_graph_replays():
    run_ranks(scenario_graph)


def test_ep2_silent_peer_times_out():
    run_ranks(scenario_silent_peer)


def test_ep2_fp8_bitwise_equal_to_one_gpu():
    run_ranks(scenario_fp8_bitwise)


def test_ep2_fp8_cuda_graph_replays():
    run_ranks(scenario_fp8_graph)
