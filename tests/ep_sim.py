"""Expert-parallel ranks simulated in one process, for the EP kernels' tests.

Each rank's symmetric segment is a plain tensor (poisoned) on one device, and the workspace's
pointer tables hold those tensors' addresses, exactly where a real group holds the peers' mapped
addresses. A call is a list of launch steps (``SymmetricMemoryEPWorkspace.stages``); ``run_call``
runs step i on every rank before step i + 1, so every flag wait finds its flag raised. Used under
the Triton interpreter on the CPU and with the compiled kernels on one GPU.
"""

import torch


def global_inputs(seed, counts, num_experts, *, world, hidden, inter, top_k, routing="uniform", quant=None,
                  device="cuda"):
    """One layer's global inputs, drawn alike on every rank: ``(x, experts, weights, ids)``, the
    experts ``(w13, w2)`` in bf16 or, with ``quant="fp8"``, ``(q13, q2, s13, s2)`` block-quantized
    from the same fp32 draws. ``routing``: "uniform"; "one_rank", every token's experts on rank 0
    (which owns the first E / world); "hot", expert E - 1 in every token's first slot."""
    g = torch.Generator(device=device).manual_seed(seed)
    total = sum(counts)
    x = torch.randn(total, hidden, device=device, generator=g).bfloat16()
    w13 = torch.randn(num_experts, 2 * inter, hidden, device=device, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, device=device, generator=g) / inter**0.5
    draw = num_experts // world if routing == "one_rank" else num_experts
    ids = torch.rand(total, draw, device=device, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    if routing == "hot":
        ids[:, 0] = num_experts - 1
        ids[:, 1:] = torch.rand(total, num_experts - 1, device=device, generator=g).argsort(dim=1)[:, : top_k - 1]
    weights = torch.rand(total, top_k, device=device, generator=g)
    if quant == "fp8":
        from mok_serve.kernels.fp8 import quantize_fp8_blocks

        (q13, s13), (q2, s2) = quantize_fp8_blocks(w13), quantize_fp8_blocks(w2)
        return x, (q13, q2, s13, s2), weights, ids
    return x, (w13.bfloat16(), w2.bfloat16()), weights, ids


def one_gpu_ops(quant=None):
    """(one-GPU op, torch reference, relative error bound against it) for bf16 or FP8 experts."""
    from mok_serve import kernels

    if quant == "fp8":
        return kernels.fused_moe_fp8, kernels.fused_moe_fp8_reference, 3e-2
    return kernels.fused_moe, kernels.fused_moe_reference, 1e-2


def local_experts(experts, placement, rank):
    """This rank's experts in local-id order: every tensor of ``experts`` (``w13, w2`` and, for FP8,
    their scales) indexed by the global experts the rank owns."""
    mine = (placement.owner == rank).nonzero().flatten()
    order = mine[placement.local[mine].argsort()]
    return tuple(t[order.to(t.device)].contiguous() for t in experts)


class SimulatedCollectives:
    """The collectives between simulated ranks' nodes (``_Collectives``' interface): every rank makes
    the same calls in the same order, and a call completes when its last rank makes it (``run_call``
    runs a step on every rank before any rank's next step reads the outputs). ``endpoint(r)`` is
    rank r's side."""

    def __init__(self, world):
        self.world = world
        self.calls = [0] * world
        self.pending = {}

    def endpoint(self, rank):
        fabric = self

        class Endpoint:
            def all_gather(self, out, inp):
                fabric._join(rank, "all_gather", out, inp.clone(), None, None)

            def all_to_all(self, out, inp, out_splits, in_splits):
                fabric._join(rank, "all_to_all", out, inp.clone(), out_splits, in_splits)

        return Endpoint()

    def _join(self, rank, op, out, inp, out_splits, in_splits):
        call = self.calls[rank]
        self.calls[rank] += 1
        joined = self.pending.setdefault(call, {})
        joined[rank] = (op, out, inp, out_splits, in_splits)
        if len(joined) < self.world:
            return
        del self.pending[call]
        assert {j[0] for j in joined.values()} == {op}, f"collective {call}: ranks made different calls"
        if op == "all_gather":
            whole = torch.cat([joined[r][2] for r in range(self.world)])
            for _, out, *_ in joined.values():
                out.copy_(whole)
            return
        pieces = {r: joined[r][2].split(joined[r][4]) for r in range(self.world)}  # by destination
        for d in range(self.world):
            _, out, _, out_splits, _ = joined[d]
            got = [pieces[r][d] for r in range(self.world)]
            assert [p.numel() for p in got] == list(out_splits), f"collective {call}: rank {d}'s splits disagree"
            out.copy_(torch.cat(got))


def simulated_ranks(world, num_experts, *, max_tokens, hidden, top_k, device="cpu", replicated=False, quant=None,
                    node_size=None, **workspace_kwargs):
    """``world`` workspaces over segments of one device, linear expert placement:
    ``(ranks, placement, segments)``. ``node_size``: ranks per simulated node (each rank's tables
    hold only its node's segments; the nodes exchange through ``SimulatedCollectives``)."""
    from mok_serve.kernels.cuda import ep as ep_cuda  # at call time: the interpreter tests reload the module

    placement = ep_cuda.ExpertPlacement.linear(num_experts, world)
    sources = 1 if replicated else world
    node_size = node_size or world
    total = ep_cuda._Layout(node_size, sources, max_tokens, hidden, top_k, 2, fp8=quant == "fp8",
                            nodes=world // node_size).total
    segments = [torch.full((total,), 0xAB, dtype=torch.uint8, device=device) for _ in range(world)]
    fabric = SimulatedCollectives(world)
    ranks = [
        ep_cuda.SymmetricMemoryEPWorkspace(
            None, max_tokens_per_rank=max_tokens, hidden_size=hidden, top_k=top_k, dtype=torch.bfloat16,
            placement=placement, replicated_tokens=replicated, quant=quant, node_size=node_size,
            _simulated=(r, segments), _exchange=fabric.endpoint(r) if node_size < world else None,
            **workspace_kwargs,
        )
        for r in range(world)
    ]
    return ranks, placement, segments


def run_call(ranks, per_rank_args, layer="L", per_rank_kwargs=None):
    """One layer call on every rank, step by step; the ranks' outputs."""
    per_rank_kwargs = per_rank_kwargs or [{}] * len(ranks)
    stage_lists = [ws.stages(*args, layer=layer, **kw) for ws, args, kw in zip(ranks, per_rank_args, per_rank_kwargs)]
    outs = [None] * len(ranks)
    for i in range(len(stage_lists[0])):
        for r, stages in enumerate(stage_lists):
            outs[r] = stages[i]()
    return outs


def split_args(placement, x, experts, weights, ids, counts, **call_kwargs):
    """Global inputs split over the ranks (rank r: the next ``counts[r]`` tokens and its local
    experts), as ``run_call``'s ``(per_rank_args, per_rank_kwargs)``; ``experts`` is ``(w13, w2)``
    or, for FP8, ``(w13, w2, s13, s2)``; ``call_kwargs`` go to every rank's call."""
    args, kwargs = [], []
    for r in range(len(counts)):
        sl = slice(sum(counts[:r]), sum(counts[:r]) + counts[r])
        local = local_experts(experts, placement, r)
        args.append((x[sl], *local[:2], weights[sl], ids[sl]))
        kwargs.append(dict(call_kwargs, scales=local[2:]) if len(local) == 4 else dict(call_kwargs))
    return args, kwargs


def run_split(ranks, placement, x, experts, weights, ids, counts, layer="L", **call_kwargs):
    """``split_args``' inputs through one call; the ranks' outputs concatenated, in global token order."""
    args, kwargs = split_args(placement, x, experts, weights, ids, counts, **call_kwargs)
    return torch.cat(run_call(ranks, args, layer=layer, per_rank_kwargs=kwargs))
