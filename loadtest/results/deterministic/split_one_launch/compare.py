"""The invariant kernels' split paths in one launch (each tile's or query block's last program adds
or merges the parts: the invariant GEMM and the invariant attention) against the two launches they
replace (a reducing or merging kernel after the split one, as at 909c0ee), on one GPU in one run.

    git show 909c0ee:kernels/cuda/linear.py > kernels/cuda/linear_two_launch.py          # (neither
    git show 909c0ee:kernels/cuda/attention.py > kernels/cuda/attention_two_launch.py    #  committed)
    python3 loadtest/results/deterministic/split_one_launch/compare.py OUT_DIR

It ran at a62495c (``compare.md``); 1bed926 reverted both one-launch paths, so at later commits the
package's kernels are the two-launch ones again and the script compares them with themselves.

Points: dense layers [N, K] at decode row counts, bf16 and block FP8 (``mok-loadtest linear``'s
shapes), and decode attention calls (``mok-loadtest attention``'s). Before timing: the two versions'
outputs bitwise equal (the same function), within 1e-2 (FP8: 3e-2) relative error norm of a float64
(attention: fp32) reference, NaN failing (attention outputs start NaN, so an unwritten row fails).
Time: one CUDA graph of ``CALLS`` calls back to back (GEMMs each on its own copy of the weight, more
bytes than the L2 holds, as a serving step's layers read theirs), median of 30 replays over
``CALLS``, median of 3 interleaved repeats: an op's time with its launch gaps, PDL on. Floor: the
benchmarks' (max of FLOPs and HBM bytes over their rates). Rows: ``compare.csv`` (long format: one
row per point and implementation) and ``compare.md`` in OUT_DIR.
"""

from __future__ import annotations

import csv
import os
import pathlib
import statistics
import sys

import torch

from mok_serve.kernels.cuda import attention as attention_one
from mok_serve.kernels.cuda import attention_two_launch as attention_two
from mok_serve.kernels.cuda import linear as linear_one
from mok_serve.kernels.cuda import linear_two_launch as linear_two
from mok_serve.kernels.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from mok_serve.loadtest.bench import attention as attention_bench
from mok_serve.loadtest.bench.harness import fp8_rate, rel_err
from mok_serve.loadtest.bench.linear import DENSE_LAYERS
from mok_serve.loadtest.bench.linear import floor_ms as linear_floor_ms

CALLS = 24
LINEAR_POINTS = [("Qwen3-30B-A3B", layer, rows) for layer in ("qkv_proj", "o_proj", "router") for rows in (1, 8, 64, 256)]
LINEAR_POINTS += [("DeepSeek-V3", layer, rows) for layer in ("qkv_a_proj", "o_proj", "shared_down") for rows in (1, 64, 256)]
ATTENTION_POINTS = [("Qwen3-30B-A3B", call) for call in ("decode 1 x 512", "decode 1 x 4096", "decode 32 x 2048")]
ATTENTION_POINTS += [("GLM-4.5-Air", "decode 1 x 4096")]


def replay_ms(fn, reps=30) -> float:
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(point: dict, fns: dict, args: list, ref: torch.Tensor, tol: float, check_args=None) -> list[dict]:
    """``point`` rows for each implementation ``fns[name](*args[i])``, checked on ``check_args()``
    (fresh arguments for each, default ``args[0]``) then timed."""
    outs = {name: fn(*(check_args() if check_args else args[0])) for name, fn in fns.items()}
    same = torch.equal(outs["one launch"], outs["two launches"])
    errs = {name: rel_err(out, ref) for name, out in outs.items()}
    ok = same and all(err == err and err <= tol for err in errs.values())
    times: dict[str, list[float]] = {}
    if ok:
        for _ in range(3):
            for name, fn in fns.items():
                times.setdefault(name, []).append(replay_ms(lambda fn=fn: [fn(*a) for a in args]) / len(args))
    rows = []
    for name in fns:
        us = statistics.median(times[name]) * 1e3 if ok else float("nan")
        rows.append(dict(point, impl=name, same_bits=same, rel_err=f"{errs[name]:.2e}", us=round(us, 2),
                         x_floor=round(us / point["floor_us"], 2)))
    print(point["op"], point["model"], point["what"], {r["impl"]: r["us"] for r in rows},
          "same bits" if same else "BITS DIFFER", flush=True)
    return rows


def linear_rows(gen, rate: float) -> list[dict]:
    out = []
    for fp8 in (False, True):
        for model, layer, rows in LINEAR_POINTS:
            if fp8 and layer == "router":
                continue  # routers stay bf16 in block-FP8 checkpoints
            n, k = DENSE_LAYERS[model][layer]
            x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
            w32 = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
            if fp8:
                wq, ws = quantize_fp8_blocks(w32)
                ref = x.double() @ dequantize_fp8_blocks(wq, ws).double().t()
                args = [(wq.clone(), ws.clone()) for _ in range(CALLS)]
                fns = {"one launch": lambda w, s: linear_one.invariant_linear_fp8_triton(x, w, s),
                       "two launches": lambda w, s: linear_two.invariant_linear_fp8_triton(x, w, s)}
            else:
                w = w32.to(torch.bfloat16)
                ref = x.double() @ w.double().t()
                args = [(w.clone(),) for _ in range(CALLS)]
                fns = {"one launch": lambda w: linear_one.invariant_linear_triton(x, w),
                       "two launches": lambda w: linear_two.invariant_linear_triton(x, w),
                       "cublas": lambda w: torch.nn.functional.linear(x, w)}
            point = dict(op="linear", dtype="fp8" if fp8 else "bf16", model=model, what=f"{layer} [{n}, {k}] {rows} rows",
                         split=linear_one.linear_plan(rows, n, k, fp8=fp8)[2],
                         floor_us=round(linear_floor_ms(rows, n, k, rate if fp8 else None) * 1e3, 2))
            out += timed(point, fns, args, ref, 3e-2 if fp8 else 1e-2)
            del args
    return out


def attention_rows(gen) -> list[dict]:
    out = []
    bound = attention_bench.MAX_MODEL_LEN
    for model, call in ATTENTION_POINTS:
        heads, kv_heads, head = attention_bench.HEADS[model]
        c = attention_bench.make_call(attention_bench.CALLS[call], heads, kv_heads, head, gen)
        ref = attention_bench.reference(c)
        seqs = c["seqs"]
        plan = attention_one.attention_plan(c["q"].shape[0], len(seqs), heads, kv_heads, head, bound)

        def call_with(module):
            def run(out):
                return module.invariant_attention_triton(c["q"], c["k"], c["v"], out, c["cu"], c["lens"], c["table"],
                                                         bound, c["scale"])
            return run

        outs = [(torch.empty_like(c["q"]),) for _ in range(CALLS)]
        point = dict(op="attention", dtype="bf16", model=model, what=call, split=plan[4],
                     floor_us=round(attention_bench.floor_ms(seqs, heads, kv_heads, head) * 1e3, 2))
        out += timed(point, {"one launch": call_with(attention_one), "two launches": call_with(attention_two)},
                     outs, ref, 1e-2, check_args=lambda: (torch.full_like(c["q"], float("nan")),))  # poisoned
    return out


def markdown(rows: list[dict], gpu: str, commit: str) -> str:
    lines = [f"# Split paths in one launch against two ({gpu}, commit {commit})", "",
             f"Per call: a CUDA graph of {CALLS} calls, median of 30 replays, median of 3 interleaved repeats; "
             "`two/one`: the two-launch time over the one-launch time (above 1: one launch is faster).", "",
             "| op | dtype | model | point | split | one launch us | two launches us | cuBLAS us | floor us | "
             "one x floor | two/one | same bits |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    points: dict[tuple, dict] = {}
    for r in rows:
        points.setdefault((r["op"], r["dtype"], r["model"], r["what"]), {})[r["impl"]] = r
    for (op, dtype, model, what), d in points.items():
        one, two, cublas = d["one launch"], d["two launches"], d.get("cublas")
        lines.append(f"| {op} | {dtype} | {model} | {what} | {one['split']} | {one['us']} | {two['us']} | "
                     f"{cublas['us'] if cublas else '-'} | {one['floor_us']} | {one['x_floor']} | "
                     f"{two['us'] / one['us']:.2f}x | {'yes' if one['same_bits'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(out: pathlib.Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    commit, gpu = os.environ.get("MOK_COMMIT", "?"), torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda").manual_seed(7)
    rows = attention_rows(gen) + linear_rows(gen, fp8_rate())
    for r in rows:
        r.update(commit=commit, gpu=gpu)
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (out / "compare.md").write_text(markdown(rows, gpu, commit))
    return 0


if __name__ == "__main__":
    sys.exit(main(pathlib.Path(sys.argv[1])))
