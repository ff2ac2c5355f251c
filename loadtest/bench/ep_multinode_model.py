"""A model of kittens expert parallelism across nodes (issue 39's design note, kernels/DESIGN.md):
the bytes one DeepSeek-V3 MoE layer moves inside and between nodes, and the time they predict.

No GPU, no network: the routing is sampled (DeepSeek-V3's grouped top-k: 4 of 8 groups of 32
experts, then the top 8 experts of those groups; scores drawn at random, so every expert is as
popular as any other), the experts are placed in contiguous blocks (node n holds groups
``n * 8 / nodes ...``), and the rates are the lent hardware's or the published ones:

- HBM 4.4 TB/s (kernels/DESIGN.md#how-to-measure), dense FP8 ~1580 TFLOP/s (the issue's figure);
- NVLink 450 GB/s per GPU and direction (H200: 900 GB/s bidirectional, the issue's figure);
- RDMA 50 GB/s per GPU and direction (400 Gb/s; DeepEP V1 measured 43-58 GB/s on H800 + CX7,
  docs/legacy.md of deepseek-ai/DeepEP), taken at 45 GB/s for the prediction.

Per (token, destination) the dispatch moves an FP8 row with its scales (7168 + 56 x 4 bytes), once
per destination node over RDMA and once per destination GPU over NVLink; the combine returns a bf16
row (14336 bytes) per (token, k) whose expert is remote (what a home rank needs to sum the top-k in
k order, bit for bit the one-GPU sum), or, as DeepEP's normal kernels do, one per (token, remote
node) holding that node's partial sum (fewer bytes, a different sum order per EP layout). "As
built" is what kittens' CUDA workspace moves between nodes (kernels/cuda/ep.py): split sizes known on
the host, so fixed per call: every rank's ids (``2 + T * 8`` int32), a rank's ``T`` rows to every
other node and ``T * 8`` result rows back from every other node.

    python -m mok_serve.loadtest.bench.ep_multinode_model            # the table in Markdown
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

HIDDEN, TOP_K, EXPERTS, GROUPS, TOPK_GROUPS, INTER = 7168, 8, 256, 8, 4, 2048
GPUS_PER_NODE = 8
FP8_ROW = HIDDEN + HIDDEN // 128 * 4  # e4m3 row and its fp32 scales, one per 128 columns
BF16_ROW = HIDDEN * 2
RDMA, NVLINK, HBM, FP8_FLOPS = 45e9, 450e9, 4.4e12, 1580e12


def sample_routing(tokens: int, rng) -> np.ndarray:
    """[tokens, TOP_K] expert ids by DeepSeek-V3's grouped top-k on random scores."""
    scores = rng.random((tokens, EXPERTS))
    per_group = EXPERTS // GROUPS
    group_score = np.sort(scores.reshape(tokens, GROUPS, per_group), axis=2)[:, :, -2:].sum(2)
    groups = np.argsort(-group_score, axis=1)[:, :TOPK_GROUPS]
    mask = np.zeros((tokens, GROUPS), bool)
    np.put_along_axis(mask, groups, True, axis=1)
    masked = np.where(np.repeat(mask, per_group, axis=1), scores, -1.0)
    return np.argsort(-masked, axis=1)[:, :TOP_K]


def traffic(nodes: int, samples: int = 20000, seed: int = 0) -> dict:
    """Per token of a rank on node 0: expected remote nodes, GPUs and (token, k) rows its top-k
    touches, inside its node and on others."""
    ranks = nodes * GPUS_PER_NODE
    ids = sample_routing(samples, np.random.default_rng(seed))
    rank_of = ids // (EXPERTS // ranks)
    node_of = rank_of // GPUS_PER_NODE
    remote_nodes = np.mean([len(set(n) - {0}) for n in node_of])
    local_gpus = np.mean([len({r for r in row if r < GPUS_PER_NODE}) for row in rank_of])
    remote_gpus = np.mean([len({r for r in row if r >= GPUS_PER_NODE}) for row in rank_of])
    remote_k = float((node_of != 0).sum(1).mean())
    return dict(ranks=ranks, remote_nodes=remote_nodes, local_gpus=local_gpus, remote_gpus=remote_gpus,
                remote_k=remote_k)


def layer(nodes: int, tokens_per_rank: int) -> dict:
    """Bytes per rank of one layer and the times they predict (ms), for T tokens on every rank."""
    t = traffic(nodes)
    T = tokens_per_rank
    rdma_dispatch = T * t["remote_nodes"] * FP8_ROW
    # Inside a node: the home node's GPUs and, on each remote node, the GPUs its forwarder feeds.
    nvl_dispatch = T * (t["local_gpus"] + t["remote_gpus"]) * FP8_ROW
    rdma_combine_k = T * t["remote_k"] * BF16_ROW
    rdma_combine_node = T * t["remote_nodes"] * BF16_ROW
    nvl_combine = T * TOP_K * BF16_ROW
    far = nodes - 1
    built_rdma = T * far * FP8_ROW + T * far * TOP_K * BF16_ROW + far * GPUS_PER_NODE * (2 + T * TOP_K) * 4
    rows = T * TOP_K  # (token, k) rows each rank computes, routing balanced
    local_experts = EXPERTS // t["ranks"]
    weight_bytes = local_experts * 3 * HIDDEN * INTER  # FP8 weights read once per layer
    experts_ms = max(weight_bytes / HBM, 6 * rows * HIDDEN * INTER / FP8_FLOPS) * 1e3
    ms = lambda b, rate: b / rate * 1e3  # noqa: E731
    return dict(
        nodes=nodes, ranks=t["ranks"], tokens=T, **{k: t[k] for k in ("remote_nodes", "remote_k")},
        rdma_dispatch_mb=rdma_dispatch / 1e6, rdma_combine_k_mb=rdma_combine_k / 1e6,
        rdma_combine_node_mb=rdma_combine_node / 1e6, nvl_mb=(nvl_dispatch + nvl_combine) / 1e6,
        experts_ms=experts_ms,
        rdma_ms_k=ms(rdma_dispatch + rdma_combine_k, RDMA), rdma_ms_node=ms(rdma_dispatch + rdma_combine_node, RDMA),
        nvl_ms=ms(nvl_dispatch + nvl_combine, NVLINK), built_rdma_mb=built_rdma / 1e6, built_rdma_ms=ms(built_rdma, RDMA),
    )


def markdown(rows: list[dict]) -> str:
    head = ("| EP | tokens / rank | remote nodes / token | remote (token, k) / token | RDMA dispatch MB | "
            "RDMA combine MB, per (token, k) | per node | NVLink MB | experts ms | layer ms, per (token, k) | "
            "per-node sums | as built: RDMA MB | layer ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        # Dispatch, experts and combine back to back (overlap would hide the smaller parts).
        serial_k = r["experts_ms"] + r["rdma_ms_k"] + r["nvl_ms"]
        serial_node = r["experts_ms"] + r["rdma_ms_node"] + r["nvl_ms"]
        serial_built = r["experts_ms"] + r["built_rdma_ms"] + r["nvl_ms"]
        lines.append(
            f"| {r['ranks']} ({r['nodes']} x 8) | {r['tokens']} | {r['remote_nodes']:.2f} | {r['remote_k']:.2f} | "
            f"{r['rdma_dispatch_mb']:.2f} | {r['rdma_combine_k_mb']:.2f} | {r['rdma_combine_node_mb']:.2f} | "
            f"{r['nvl_mb']:.1f} | {r['experts_ms']:.3f} | {serial_k:.3f} | {serial_node:.3f} | "
            f"{r['built_rdma_mb']:.2f} | {serial_built:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_serve.loadtest.bench.ep_multinode_model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="128,2048", help="tokens per rank (comma-separated)")
    p.add_argument("--nodes", default="2,4", help="nodes of 8 GPUs (comma-separated)")
    args = p.parse_args(argv)
    rows = [layer(n, t) for n in map(int, args.nodes.split(",")) for t in map(int, args.tokens.split(","))]
    print(markdown(rows), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
