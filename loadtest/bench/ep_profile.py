"""Where the time of one kittens expert-parallel call goes: device time per kernel, per rank.

Spawns one process per GPU with ``ep.run_on_ranks`` (same shapes, inputs and workspace), runs the
kittens EP call eagerly under ``torch.profiler`` (CUDA activity) and prints, for each rank,
each kernel's mean device time per call next to the call's time as a CUDA-graph replay (median
of CUDA-event timings). The graph time minus the kernels' sum is what launches, flag round trips
and waiting cost. This is the profile evidence behind the EP notes
(``loadtest/JOURNAL.md#where-the-time-goes-7f0d0a8-2026-11-30``).

``python -m mok_serve.loadtest.bench.ep_profile --shape Qwen3-30B-A3B --tokens 128 512``
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict

import torch

from .ep import as_graph, make_experts, run_on_ranks
from .harness import load_shapes


def profile_rank(rank, world, args):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from mok_serve.kernels.cuda.ep import ExpertPlacement, SymmetricMemoryEPWorkspace

    s = load_shapes()[args.shape]
    E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
    placement = ExpertPlacement.linear(E, world)
    gen = torch.Generator(device="cuda").manual_seed(args.seed + rank)
    w13, w2 = make_experts(E // world, H, I, False, gen)
    out = []
    for T in args.tokens:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=gen)
        ids = torch.rand(T, E, device="cuda", generator=gen).argsort(dim=1)[:, :K].to(torch.int32)
        tw = torch.rand(T, K, device="cuda", generator=gen)
        tw = tw / tw.sum(-1, keepdim=True)
        ws = SymmetricMemoryEPWorkspace(
            dist.group.WORLD, max_tokens_per_rank=T, hidden_size=H, top_k=K, dtype=torch.bfloat16,
            placement=placement, timeout_s=args.timeout_s,
        )
        try:
            call = lambda: ws.fused_moe(x, w13, w2, tw, ids)  # noqa: E731
            graph = as_graph(call)
            times = []
            for _ in range(args.iters):
                dist.barrier()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            dist.barrier()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    call()
                torch.cuda.synchronize()
            ws.check_errors()
            kernels = defaultdict(float)
            for ev in prof.events():
                if ev.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[ev.name] += ev.time_range.elapsed_us() / args.iters
            out.append(dict(tokens=T, graph_us=statistics.median(times), kernels=dict(kernels)))
        finally:
            ws.close()
    return out


def report(shape, world, results) -> str:
    lines = [f"# kittens EP call profile: {shape}, world {world}", ""]
    for i, T in enumerate(r["tokens"] for r in results[0]):
        lines += [f"## {T} tokens per rank", "", "| kernel | " + " | ".join(f"rank {r} us" for r in results) + " |",
                  "|---|" + "---|" * len(results)]
        names = sorted({n for r in results.values() for n in r[i]["kernels"]},
                       key=lambda n: -results[0][i]["kernels"].get(n, 0.0))
        for n in names:
            lines.append(f"| {n[:70]} | " + " | ".join(f"{r[i]['kernels'].get(n, 0.0):.1f}" for r in results.values()) + " |")
        sums = [sum(r[i]["kernels"].values()) for r in results.values()]
        lines.append("| **sum of kernels** | " + " | ".join(f"{v:.1f}" for v in sums) + " |")
        lines.append("| **graph replay (median)** | " + " | ".join(f"{r[i]['graph_us']:.1f}" for r in results.values()) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--shape", default="Qwen3-30B-A3B", help="a model of configs/model_shapes.json")
    p.add_argument("--tokens", nargs="*", type=int, default=[128, 512])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--out", default=None, help="also write the Markdown report here")
    args = p.parse_args(argv)
    if args.world < 1:
        print("the EP profile needs CUDA GPUs (--world >= 1)", file=sys.stderr)
        return 2
    results, errors = run_on_ranks(profile_rank, args.world, args)
    for e in errors:
        print(e, file=sys.stderr)
    if errors:
        return 1
    md = report(args.shape, args.world, dict(sorted(results.items())))
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
