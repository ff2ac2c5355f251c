"""Unit tests of the per-layer MoE timer (no server): the CPU custom op under torch.compile,
the device-side Triton timer kernel under the Triton interpreter, and the stats merge."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mok_serve.server.stats import KittensCollector, merge
from mok_serve.vllm import timing


class _Layer:
    def __init__(self, name, experts=8, expert_map=None, ep_rank=0, ep_size=1):
        from types import SimpleNamespace

        self.layer_name = name
        self.global_num_experts = experts
        self.expert_map = expert_map
        self.w13_weight = torch.zeros(1)
        pcfg = SimpleNamespace(ep_rank=ep_rank, ep_size=ep_size)
        self.moe_config = SimpleNamespace(moe_parallel_config=pcfg, experts_per_token=2)


@pytest.fixture
def registry(monkeypatch):
    reg = timing._Registry()
    monkeypatch.setattr(timing, "REGISTRY", reg)
    return reg


def test_cpu_timer_survives_torch_compile(registry):
    cfg = timing.TimingConfig(sample_every=2, window=4)
    slot = timing.register_layer(_Layer("model.layers.3.mlp.experts"), cfg, "kittens", "KittensExperts")

    def moe(x, ids):
        ids = timing.mark(ids, slot, timing.BEGIN)
        ids = timing.mark(ids, slot, timing.EXPERTS_BEGIN)
        y = (x * (ids.sum(-1, keepdim=True) + 1)).relu()
        y = timing.mark(y, slot, timing.EXPERTS_END)
        return timing.mark(y + 1, slot, timing.END)

    compiled = torch.compile(moe, fullgraph=True, dynamic=True)
    x = torch.randn(5, 16)
    ids = torch.tensor([[0, 1], [1, 2], [1, 7], [3, 1], [1, 0]])
    for _ in range(6):
        torch.testing.assert_close(compiled(x, ids), moe(x, ids))
    snap = timing.snapshot({"rank": 0})
    (layer,) = snap["layers"]
    stats = layer["rank_stats"]
    assert layer["index"] == 3
    assert stats["calls"] == 12 and stats["tokens"] == 60  # 6 compiled + 6 eager calls
    assert stats["sampled_calls"] == 4  # every 2nd call, window of 4
    assert stats["expert_tokens"] == [12 * c for c in (2, 5, 1, 1, 0, 0, 0, 1)]
    assert stats["imbalance"] == pytest.approx(5 / (10 / 8))
    assert stats["latency_ms"]["p50"] > 0 and set(stats["phases_ms"]) == {"dispatch", "experts", "combine"}
    assert sum(layer["cumulative"]["histograms"]["total"]["buckets"]) == 6
    timing.reset()
    again = timing.snapshot({"rank": 0})["layers"][0]
    assert again["rank_stats"]["calls"] == 0 and again["rank_stats"]["latency_ms"] is None
    assert again["cumulative"]["calls"] == 12  # Prometheus counters keep counting
    compiled(x, ids)
    timing.restart()  # serving starts: neither the window nor the counters keep start-up calls
    fresh = timing.snapshot({"rank": 0})["layers"][0]
    assert fresh["rank_stats"]["calls"] == 0 and fresh["rank_stats"]["expert_tokens"] == [0] * 8
    cum = fresh["cumulative"]
    assert cum["calls"] == cum["tokens"] == 0 and cum["expert_tokens"] == [0] * 8
    assert all(sum(h["buckets"]) == h["sum_ns"] == 0 for h in cum["histograms"].values())
    compiled(x, ids)
    after = timing.snapshot({"rank": 0})["layers"][0]
    assert after["rank_stats"]["calls"] == after["cumulative"]["calls"] == 1


def test_merge_and_prometheus(registry):
    cfg = timing.TimingConfig(1, 8)
    snaps = []
    for rank, local in ((0, [0, 1]), (1, [2, 3])):
        reg = timing._Registry()
        timing.REGISTRY = reg
        emap = torch.tensor([0 if e in local else -1 for e in range(4)])
        slot = timing.register_layer(_Layer("model.layers.0.mlp.experts", 4, emap, rank, 2), cfg, "kittens", "K")
        ids = torch.tensor([[0, 1], [0, 2]])
        for p in range(4):
            ids = timing.mark(ids, slot, p)
        snaps.append(timing.snapshot({"rank": rank, "tp_rank": rank, "tp_size": 2}))
    doc = merge(snaps)
    assert doc["num_layers"] == 1 and [r["ep_rank"] for r in doc["ranks"]] == [0, 1]
    (layer,) = doc["layers"]
    assert [r["local_expert_tokens"] for r in layer["ranks"]] == [3, 1]
    assert layer["ep_imbalance"] == pytest.approx(1.5)
    collector = KittensCollector()
    collector.snapshots = snaps
    names = {m.name for m in collector.collect()}
    assert "kittens:moe_layer_latency_seconds" in names and "kittens:moe_expert_imbalance" in names


TRITON_SCRIPT = textwrap.dedent(
    """
    import os, torch
    os.environ["TRITON_INTERPRET"] = "1"
    from mok_serve.vllm import timing
    reg = timing._Registry(); timing.REGISTRY = reg
    cfg = timing.TimingConfig(sample_every=3, window=2)
    t = timing.TritonLayerTimer(0, "model.layers.0.mlp.experts", 0, 4, 2, [0, 1, 2, 3], 0, 1, "KittensExperts",
                                cfg, torch.device("cpu"), use_globaltimer=False)
    reg.layers.append(t)
    ids = torch.tensor([[0, 1], [3, 1], [1, 2]])
    for call in range(7):
        for p in range(4):
            t.mark(ids, p)
    s = t.snapshot()
    st = s["rank_stats"]
    assert st["calls"] == 7 and st["tokens"] == 21, st
    assert st["expert_tokens"] == [7, 21, 7, 7], st
    assert st["sampled_calls"] == 2, st  # calls 0, 3, 6 sampled; window 2
    assert st["latency_ms"]["mean"] > 0 and st["phases_ms"]["experts"]["mean"] >= 0
    h = s["cumulative"]["histograms"]
    assert sum(h["total"]["buckets"]) == 3 and sum(h["experts"]["buckets"]) == 3, h
    assert h["total"]["sum_ns"] > 0
    t.reset()
    st = t.snapshot()["rank_stats"]
    assert st["calls"] == 0 and st["sampled_calls"] == 0
    print("OK")
    """
)


def test_triton_timer_kernel_in_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter test runs on CPU-only machines")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr
