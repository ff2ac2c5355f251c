"""Cost of the CPU per-layer timer stamps (``mok_serve_cpu::moe_timer``), not a timed test.

    python -m mok_serve.server.bench_timer_cost

A layer-like function (top-k routing, a little arithmetic) compiled with ``torch.compile`` as
vLLM compiles the model, with and without the BEGIN/END stamps of one layer, at 8 tokens on one
thread; also the op alone, eagerly. Prints microseconds per call, best of 7 x 3000 calls.
"""

import time

import torch

from mok_serve.kernels.cpu import moe as cpu_moe
from mok_serve.vllm import timing

EXPERTS, HIDDEN, TOP_K, TOKENS = 8, 256, 2, 8


def best_us(fn, n=3000, repeats=7):
    for _ in range(100):
        fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1e3)
    return best


def layer(x, logits, timed):
    weights, ids = torch.topk(logits.softmax(-1), TOP_K)
    if timed:
        ids = timing.mark(ids, 0, timing.BEGIN)
    out = x * ids.sum(-1, keepdim=True).to(x.dtype) + weights.sum(-1, keepdim=True).to(x.dtype)
    if timed:
        out = timing.mark(out, 0, timing.END)
    return (out * 2).relu()


def main():
    if not cpu_moe.available():
        raise SystemExit("kittens' CPU extension did not build; the timer op needs it")
    torch.set_num_threads(1)
    timing.REGISTRY.layers.append(
        timing.CpuLayerTimer(0, "layer", 0, EXPERTS, TOP_K, list(range(EXPERTS)), 0, 1, "KittensExperts",
                             timing.TimingConfig(1, 1024), torch.device("cpu"))  # fmt: skip
    )
    x, logits = torch.randn(TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, EXPERTS)
    for timed in (False, True):
        compiled = torch.compile(lambda a, b, t=timed: layer(a, b, t), dynamic=True)
        print(f"compiled layer, {'with' if timed else 'without'} 2 stamps: {best_us(lambda: compiled(x, logits)):.1f} us")
    ids = torch.topk(logits, TOP_K)[1]
    print(f"op alone, BEGIN: {best_us(lambda: torch.ops.mok_serve_cpu.moe_timer(ids, 0, timing.BEGIN)):.1f} us")
    print(f"op alone, END: {best_us(lambda: torch.ops.mok_serve_cpu.moe_timer(x, 0, timing.END)):.1f} us")


if __name__ == "__main__":
    main()
