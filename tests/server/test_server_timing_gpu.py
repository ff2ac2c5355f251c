"""The device-side MoE timer on a real GPU: %globaltimer, no host sync, inside a CUDA graph."""

import pytest
import torch

from mok_serve.vllm import timing

pytestmark = pytest.mark.gpu


def _timer(sample_every=1, window=16):
    reg = timing._Registry()
    timing.REGISTRY = reg
    t = timing.TritonLayerTimer(
        0, "model.layers.0.mlp.experts", 0, 8, 2, list(range(8)), 0, 1, "KittensExperts",
        timing.TimingConfig(sample_every, window), torch.device("cuda"),
    )  # fmt: skip
    reg.layers.append(t)
    return t


def _layer(t, x, ids):
    ids = timing.mark(ids, 0, timing.BEGIN)
    ids = timing.mark(ids, 0, timing.EXPERTS_BEGIN)
    y = x @ x.T
    y = timing.mark(y, 0, timing.EXPERTS_END)
    return timing.mark(y + 1, 0, timing.END)


def test_globaltimer_stamps_and_counts():
    t = _timer(sample_every=2)
    x = torch.randn(64, 64, device="cuda")
    ids = torch.randint(0, 8, (64, 2), device="cuda")
    for _ in range(10):
        _layer(t, x, ids)
    st = t.snapshot()["rank_stats"]
    assert st["calls"] == 10 and st["tokens"] == 640 and st["sampled_calls"] == 5
    assert st["expert_tokens"] == torch.bincount(ids.flatten().cpu(), minlength=8).mul(10).tolist()
    assert 0 < st["latency_ms"]["p50"] < 100
    assert st["phases_ms"]["experts"]["mean"] > 0


def test_cuda_graph_replays_record():
    t = _timer(sample_every=1)
    x = torch.randn(32, 32, device="cuda")
    ids = torch.randint(0, 8, (32, 2), device="cuda")
    _layer(t, x, ids)  # warm up (compiles the kernel)
    torch.cuda.synchronize()
    t.reset()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _layer(t, x, ids)
    t.reset()  # capture does not run the kernels, but be explicit
    for _ in range(7):
        g.replay()
    torch.cuda.synchronize()
    st = t.snapshot()["rank_stats"]
    assert st["calls"] == 7 and st["sampled_calls"] == 7 and st["tokens"] == 7 * 32


@pytest.mark.parametrize("tokens", [0, 1, 2, 16])
def test_marks_compile_and_count_at_every_token_count(tokens):
    """Triton passes an integer argument equal to 1 as a constant: the timer kernel still compiles
    (a real server's first request died of it). Unrouted slots (-1) and ids out of range count for
    no expert, and the eager marks do not synchronise."""
    t = _timer(sample_every=1)
    x = torch.randn(max(tokens, 1), 8, device="cuda")[:tokens]
    ids = torch.randint(0, 8, (tokens, 2), device="cuda", dtype=torch.int32)
    if tokens:
        ids[0, 1] = -1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            _layer(t, x, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    st = t.snapshot()["rank_stats"]
    assert st["calls"] == 3 and st["tokens"] == 3 * tokens and st["sampled_calls"] == 3
    valid = ids.flatten()[ids.flatten() >= 0].long().cpu()
    assert st["expert_tokens"] == torch.bincount(valid, minlength=8).mul(3).tolist()
