"""DeepSeek-V3's 192-wide attention heads (MLA off) as two column tiles (128 + 64, ``head_parts``)
against one tile padded to 256 (the kernel as at 8df4de8), and the two-tile kernel with two
pipeline stages in decode calls against its one, beside vLLM's kernels, in one run:

    git show 8df4de8:kernels/cuda/attention.py > kernels/cuda/attention_padded.py   # (not committed)
    python3 loadtest/results/deterministic/attention_head192/compare.py OUT_DIR

``mok-loadtest attention``'s calls, checks and timing (each output within 1e-2 relative error norm
of an fp32 reference, NaN failing, before it is timed; median of CUDA-graph replays, L2 flushed),
with three providers added: ``kittens-padded``, ``kittens-2stages`` and, as a check that the two
kernels compute the same function, their outputs compared bitwise (``same_bits`` per call).
Writes ``attention_bench.{json,md}`` to OUT_DIR.
"""

from __future__ import annotations

import sys

import torch

from mok_serve.kernels.cuda import attention as two_tiles
from mok_serve.kernels.cuda import attention_padded as padded
from mok_serve.loadtest.bench import attention as bench


def call(module):
    return lambda c, out: module.invariant_attention_triton(c["q"], c["k"], c["v"], out, c["cu"], c["lens"],
                                                            c["table"], bench.MAX_MODEL_LEN, c["scale"])


def two_stages(c, out):
    one_stage = two_tiles.num_stages
    two_tiles.num_stages = lambda width, itemsize, swap: one_stage(width, itemsize, False)  # prefill's rule
    try:
        call(two_tiles)(c, out)
    finally:
        two_tiles.num_stages = one_stage


def providers(layouts, segment_programs):
    impls = stock_providers(layouts, segment_programs)
    impls["kittens-padded"] = call(padded)
    impls["kittens-2stages"] = two_stages
    return impls


def measure(model, name, impls, gen):
    row = stock_measure(model, name, impls, gen)
    c = bench.make_call(bench.CALLS[name], *bench.HEADS[model], torch.Generator(device="cuda").manual_seed(7))
    outs = [torch.full_like(c["q"], float("nan")) for _ in range(2)]
    call(two_tiles)(c, outs[0])
    call(padded)(c, outs[1])
    row["same_bits"] = bool(torch.equal(outs[0], outs[1]))
    return row


stock_providers, stock_measure = bench.providers, bench.measure
bench.providers, bench.measure = providers, measure

if __name__ == "__main__":
    sys.exit(bench.main(["--models", "DeepSeek-V3-MHA,Qwen3-30B-A3B", "--out", sys.argv[1], "--no-history"]))
