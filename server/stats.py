"""Merge the per-rank snapshots from ``collective_rpc("kittens_layer_stats")`` into the
``GET /v1/kittens/layers`` document, and expose them as Prometheus metrics.

Schema of ``GET /v1/kittens/layers`` (``object: "kittens.layers"``)::

    {
      "object": "kittens.layers",
      "backend": "kittens" | "stock (CPU)" | "stock (TRITON)" | ...,   # the MoE experts in use
      "timing": {"enabled": bool, "sample_every": int, "window_calls": int},
      "window": {"started_at": unix seconds of the last reset (or start), "seconds": float,
                 "latency": "last window_calls sampled calls since started_at",
                 "counts": "every call since started_at"},
      "clock": "host steady_clock" | "cuda %globaltimer",
      "max_cudagraph_capture_size": int | null,  # larger steps run outside CUDA graphs; null: no graphs
      "ranks": [{"rank", "tp_rank", "tp_size", "dp_rank", "ep_rank", "ep_size", "pid"}],
      "num_layers": int,
      "layers": [{
          "index": int, "name": str, "num_experts": int, "top_k": int,
          "ep_imbalance": float | null,       # max / mean over ranks of tokens to local experts
          "ranks": [{
              "rank": int, "ep_rank": int, "ep_size": int, "experts_class": str,
              "local_experts": [int],          # global ids of the experts on this rank
              "calls": int, "tokens": int, "sampled_calls": int,
              "latency_ms": {"mean", "p50", "p90", "p99", "max": float, "samples": int} | null,
              "phases_ms": {"dispatch": {...}, "experts": {...}, "combine": {...}} | null,  # kittens EP
              "expert_tokens": [int] * num_experts,   # top-k slots routed to each global expert
              "local_expert_tokens": int,
              "imbalance": float | null        # max / mean of expert_tokens
          }]
      }]
    }

``calls``/``tokens``/``expert_tokens`` count every MoE call since the window started (a reset,
or the start of serving: vLLM's start-up calls, memory profiling, warm-up and CUDA-graph capture,
are counted by neither this document nor ``/metrics``, whose counters run from the start of
serving and are not cleared by a reset); latency statistics cover the sampled calls among them (every ``sample_every``-th
call, at most the last ``window_calls``). The span timed is the MoE method after routing:
prepare/dispatch, experts, finalize/combine (``phases_ms`` splits it under kittens EP). Each rank
counts the top-k ids it sees; with expert parallelism and one DP rank every rank sees every
token, so ``expert_tokens`` agree across ranks and ``local_expert_tokens`` is the rank's load.
"""

from __future__ import annotations

from mok_serve.vllm.timing import BUCKETS_S, PHASES

RANK_KEYS = ("rank", "tp_rank", "tp_size", "dp_rank", "pid")


def merge(snapshots: list[dict]) -> dict:
    snapshots = sorted(snapshots, key=lambda s: s.get("rank", 0))
    first = snapshots[0] if snapshots else {}
    layers: dict[str, dict] = {}
    ranks = []
    for snap in snapshots:
        ep_rank = ep_size = None
        for layer in snap["layers"]:
            entry = layers.setdefault(
                layer["name"],
                {k: layer[k] for k in ("index", "name", "num_experts", "top_k")} | {"ranks": []},
            )
            entry["ranks"].append({"rank": snap["rank"], **layer["rank_stats"]})
            ep_rank, ep_size = layer["rank_stats"]["ep_rank"], layer["rank_stats"]["ep_size"]
        ranks.append({**{k: snap.get(k) for k in RANK_KEYS}, "ep_rank": ep_rank, "ep_size": ep_size})
    for entry in layers.values():
        loads = [r["local_expert_tokens"] for r in entry["ranks"]]
        mean = sum(loads) / len(loads) if loads else 0
        entry["ep_imbalance"] = max(loads) / mean if mean > 0 else None
    started = min((s["window_started"] for s in snapshots), default=None)
    now = max((s["now"] for s in snapshots), default=None)
    return {
        "object": "kittens.layers",
        "backend": first.get("backend"),
        "timing": first.get("timing", {"enabled": False, "sample_every": 0, "window_calls": 0}),
        "window": {
            "started_at": started,
            "seconds": (now - started) if started is not None and now is not None else None,
            "latency": "last window_calls sampled calls since started_at",
            "counts": "every call since started_at",
        },
        "clock": first.get("clock"),
        "max_cudagraph_capture_size": first.get("max_cudagraph_capture_size"),
        "ranks": ranks,
        "num_layers": len(layers),
        "layers": sorted(layers.values(), key=lambda e: (e["index"], e["name"])),
    }


class KittensCollector:
    """A prometheus_client collector over the last snapshots read from the workers (refreshed
    before each ``/metrics`` scrape by the endpoint plugin's middleware)."""

    def __init__(self):
        self.snapshots: list[dict] = []

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        hist = HistogramMetricFamily(
            "kittens:moe_layer_latency_seconds",
            "MoE layer latency per layer and rank (sampled calls; phase total, or dispatch/experts/combine "
            "for kittens)",
            labels=["layer", "rank", "backend", "phase"],
        )
        calls = CounterMetricFamily("kittens:moe_layer_calls", "MoE layer calls", labels=["layer", "rank", "backend"])
        tokens = CounterMetricFamily(
            "kittens:moe_layer_tokens", "Tokens through the MoE layer", labels=["layer", "rank", "backend"]
        )
        experts = CounterMetricFamily(
            "kittens:moe_expert_tokens", "Top-k slots routed to each expert", labels=["layer", "rank", "expert"]
        )
        imbalance = GaugeMetricFamily(
            "kittens:moe_expert_imbalance",
            "Expert load imbalance (max / mean of tokens per expert) over the current window",
            labels=["layer", "rank"],
        )
        for snap in self.snapshots:
            rank, backend = str(snap["rank"]), str(snap.get("backend"))
            for layer in snap["layers"]:
                name = str(layer["index"])
                cum = layer["cumulative"]
                for phase in PHASES:
                    h = cum["histograms"][phase]
                    counts = h["buckets"]
                    if phase != "total" and not sum(counts):
                        continue
                    acc, buckets = 0, []
                    for bound, n in zip([*map(str, BUCKETS_S), "+Inf"], counts):
                        acc += n
                        buckets.append((bound, acc))
                    hist.add_metric([name, rank, backend, phase], buckets, h["sum_ns"] / 1e9)
                calls.add_metric([name, rank, backend], cum["calls"])
                tokens.add_metric([name, rank, backend], cum["tokens"])
                for e, n in enumerate(cum["expert_tokens"]):
                    experts.add_metric([name, rank, str(e)], n)
                imb = layer["rank_stats"]["imbalance"]
                if imb is not None:
                    imbalance.add_metric([name, rank], imb)
        yield from (hist, calls, tokens, experts, imbalance)
