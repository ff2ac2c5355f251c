"""mok-loadtest linear: the dense layers of a deterministic server, kittens' batch-invariant GEMM
(``mok_serve.kernels.invariant_linear``) against what stock vLLM runs in the same place.

Baselines, timed in the same run: ``cublas`` (``torch.nn.functional.linear``: what a default,
non-invariant vLLM server runs for a bf16 dense layer) and ``vllm-bi`` (vLLM's
``linear_batch_invariant``: what vLLM runs with ``VLLM_BATCH_INVARIANT=1``), where vLLM imports.

Each point (a model's dense layer [N, K] at a row count) is checked before it is timed: every
provider's output within 1e-2 relative error norm of an fp32 reference (NaN fails), and kittens'
rows bitwise equal alone and in the batch. Times are medians of CUDA-graph replays with the L2
flushed before each (``harness.graph_time``); the floor is max(FLOPs / 790 TFLOP/s, bytes / 4.4
TB/s), bytes = weight + input + output once. Results: ``linear_bench.{json,md}`` in ``--out``,
rows appended to ``history.csv`` (benchmark ``linear_bench``).

``--fp8`` runs the dense layers as block-FP8 checkpoints ship them (e4m3 weights, 128 x 128 scales,
activations quantized per token in 128-column groups): kittens' ``invariant_linear_fp8`` against
vLLM's block-FP8 GEMMs, ``vllm-cutlass`` (what vLLM runs on Hopper, invariant mode or not) and
``vllm-triton`` (its Triton kernel), each with vLLM's activation quantization; every provider's
row alone is checked against the same row in the batch (the batch invariance question), the floor
counts 1-byte weights at the measured dense FP8 rate (``harness.fp8_rate``). Files
``linear_bench_fp8.{json,md}``, benchmark ``linear_bench_fp8``.

``--sweep`` times kittens' tile variants (``SWEEP``: the same function, so each is checked bit for
bit against the default first) at ``--points MODEL:LAYER:ROWS``, ``--sweep-repeats`` times
interleaved, beside cuBLAS (with ``--fp8``: the block-FP8 GEMM, beside vLLM's CUTLASS one):
``linear_sweep[_fp8].{json,md}`` (benchmark ``linear_sweep[_fp8]`` in ``history.csv``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from .. import history
from .harness import (PEAK_BYTES, PEAK_FLOPS, add_ratios, bench_meta, fp8_rate, graph_time, passes, rel_err,
                      timed_history_rows)

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
ROWS = (1, 8, 32, 64, 128, 256, 512, 2048, 8192)
TOL = 1e-2

# Dense layers [N, K] of the served shapes (public configs; vLLM fuses q/k/v, gate/up and DeepSeek's
# q_a/kv_a projections into one weight each).
DENSE_LAYERS = {
    "Qwen3-30B-A3B": {"qkv_proj": (5120, 2048), "o_proj": (2048, 4096), "router": (128, 2048),
                      "lm_head": (151936, 2048)},
    "GLM-4.5-Air": {"qkv_proj": (14336, 4096), "o_proj": (4096, 12288), "shared_gate_up": (2816, 4096),
                    "shared_down": (4096, 1408), "router": (128, 4096), "lm_head": (151552, 4096)},
    "DeepSeek-V3": {"qkv_a_proj": (2112, 7168), "q_b_proj": (24576, 1536), "kv_b_proj": (32768, 512),
                    "o_proj": (7168, 16384), "shared_gate_up": (4096, 7168), "shared_down": (7168, 2048),
                    "router": (256, 7168), "lm_head": (129280, 7168)},
}


def _fp8_tile(bm: int, bn: int, stages: int, warps: int, *, tma_a: bool = True) -> dict:
    """A block-FP8 prefill tile's overrides (operands in order, grouped program order)."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, num_stages=stages, num_warps=warps, SWAP_AB=False, GROUP_M=8, TMA_A=tma_a)


def _bf16_tile(bm: int, bn: int, stages: int, warps: int, *, tma_a: bool = True, ws: bool = False) -> dict:
    """A bf16 prefill tile's overrides, activations by TMA or not (``ws``: warp-specialized K loop)."""
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, num_stages=stages, num_warps=warps, SWAP_AB=False, GROUP_M=8,
                TMA_A=tma_a, WARP_SPEC=ws)


# Tile variants of the sweep: label -> (config overrides of pick_linear_config's, split override).
SWEEP = {
    "default": ({}, None),
    "no split": ({}, False),
    "split": ({}, True),
    "64x128 s4 w4": (dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=4, SWAP_AB=False, GROUP_M=8), None),
    "128x128 s3 w8": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=3, num_warps=8, SWAP_AB=False, GROUP_M=8), None),
    "128x128 s4 w8": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_stages=4, num_warps=8, SWAP_AB=False, GROUP_M=8), None),
    "128x256 s3 w8": (dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_stages=3, num_warps=8, SWAP_AB=False, GROUP_M=8), None),
    "128x128 k128 s3 w8": (dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, num_stages=3, num_warps=8, SWAP_AB=False, GROUP_M=8), None),
    "swap 64x64 s4": (dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_stages=4, num_warps=4, SWAP_AB=True, GROUP_M=1), None),
    "swap 16x128 s4": (dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_stages=4, num_warps=4, SWAP_AB=True, GROUP_M=1), None),
    # Block-FP8 prefill tiles (BLOCK_K is 128 there whatever the label says), activations by TMA or not.
    "fp8 64x128 w8 pointer A": (_fp8_tile(64, 128, 4, 8, tma_a=False), None),
    "fp8 64x128 w8 TMA A": (_fp8_tile(64, 128, 4, 8), None),
    "fp8 128x128 s3 w8 TMA A": (_fp8_tile(128, 128, 3, 8), None),
    "fp8 128x128 s4 w8 TMA A": (_fp8_tile(128, 128, 4, 8), None),
    # Block-FP8 tiles at 65-512 rows (the default up to ef62cf1: 64 x 128 on two warpgroups, 1.2 waves for
    # a 5120-row weight at 256 rows): one warpgroup per tile (more programs per SM to hide each K block's
    # wait for its dot before scaling it), narrower tiles (more waves, fuller last one), or swapped ones.
    "fp8 64x128 s4 w4 TMA A": (_fp8_tile(64, 128, 4, 4), None),
    "fp8 64x64 s4 w4 TMA A": (_fp8_tile(64, 64, 4, 4), None),
    "fp8 64x64 s6 w4 TMA A": (_fp8_tile(64, 64, 6, 4), None),
    "fp8 128x64 s4 w8 TMA A": (_fp8_tile(128, 64, 4, 8), None),
    "fp8 swap 64x64 s4": (dict(BLOCK_M=64, BLOCK_N=64, num_stages=4, num_warps=4, SWAP_AB=True, GROUP_M=1, TMA_A=False), None),
    "fp8 swap 32x128 s4": (dict(BLOCK_M=32, BLOCK_N=128, num_stages=4, num_warps=4, SWAP_AB=True, GROUP_M=1, TMA_A=False), None),
    # Block-FP8 decode tiles (1-16 rows): a 1-byte weight tile is half a bf16 one, so the default's 4
    # stages keep half the bytes in flight; deeper or wider ones restore them.
    "fp8 swap 16x64 s8": (dict(BLOCK_M=16, BLOCK_N=64, num_stages=8, num_warps=4, SWAP_AB=True, GROUP_M=1), None),
    "fp8 swap 16x128 s4": (dict(BLOCK_M=16, BLOCK_N=128, num_stages=4, num_warps=4, SWAP_AB=True, GROUP_M=1), None),
    "fp8 swap 16x128 s6": (dict(BLOCK_M=16, BLOCK_N=128, num_stages=6, num_warps=4, SWAP_AB=True, GROUP_M=1), None),
    # bf16 prefill tiles (2048-8192 rows): the default reads the activations by TMA since 625cd43 (1-4%
    # faster there than pointer loads); Triton's warp specialization of the K loop (a producer partition)
    # gained 0-1.5% at b5eefb9 (linear_sweep_b5eefb9_h100.md, which also has 1.3-3.9x slower 128 x 256 and
    # 256 x 128 tiles: they spill).
    "128x128 s4 w8 pointer A": (_bf16_tile(128, 128, 4, 8, tma_a=False), None),
    "128x128 s4 w8 WS": (_bf16_tile(128, 128, 4, 8, ws=True), None),
    "fp8 128x128 s4 w8 TMA A WS": (dict(_fp8_tile(128, 128, 4, 8), WARP_SPEC=True), None),
}


def parse_point(text: str) -> tuple[str, str, int]:
    """``MODEL:LAYER:ROWS`` -> (model, layer, rows), checked against DENSE_LAYERS."""
    try:
        model, layer, rows = text.split(":")
        rows_n = int(rows)
    except ValueError:
        raise ValueError(f"point {text!r}: MODEL:LAYER:ROWS") from None
    if layer not in DENSE_LAYERS.get(model, {}) or rows_n < 1:
        raise ValueError(f"point {text!r}: unknown model or layer, or rows < 1 (known: "
                         + ", ".join(f"{m}:{l}" for m in DENSE_LAYERS for l in DENSE_LAYERS[m]) + ")")
    return model, layer, rows_n


def sweep(points, labels, repeats: int, gen, fp8_flops: float | None = None) -> list[dict]:
    """Each label's median replay time per point and repeat, variants interleaved, with the GEMM a
    default server runs as the baseline (cuBLAS, label ``cublas``; with ``fp8_flops``, the measured
    dense FP8 rate, block-FP8 weights and vLLM's CUTLASS block-FP8 GEMM, ``vllm-cutlass``, where vLLM
    imports); a variant whose output differs from the default's bits is recorded as such and not timed."""
    from mok_serve.kernels.cuda.linear import invariant_linear_fp8_triton, invariant_linear_triton, linear_plan
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    fp8 = fp8_flops is not None
    if fp8:
        kittens, baseline = invariant_linear_fp8_triton, ("vllm-cutlass", fp8_providers().get("vllm-cutlass"))
    else:  # cuBLAS: the non-invariant GEMM a default server runs
        kittens, baseline = invariant_linear_triton, ("cublas", torch.nn.functional.linear)
    out = []
    for model, layer, rows in points:
        n, k = DENSE_LAYERS[model][layer]
        w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
        x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        args = quantize_fp8_blocks(w) if fp8 else (w.to(torch.bfloat16),)
        default = kittens(x, *args)
        calls = {}
        point = dict(model=model, layer=layer, n=n, k=k, rows=rows, floor_ms=floor_ms(rows, n, k, fp8_flops))
        for label in labels:
            overrides, split = SWEEP[label]
            cfg = dict(linear_plan(rows, n, k, fp8=fp8)[0], **overrides) if overrides else None
            fn = lambda cfg=cfg, split=split: kittens(x, *args, config=cfg, split=split)  # noqa: E731
            try:
                same = bool(torch.equal(fn(), default))
            except Exception as e:  # a variant that raises (most often: does not compile) is recorded, the others still run
                out.append(dict(point, label=label, same_bits=None, error=f"{type(e).__name__}: {e}"[:300], times_ms=[]))
                continue
            out.append(dict(point, label=label, same_bits=same, times_ms=[]))
            if same:
                calls[label] = (fn, out[-1])
        if baseline[1] is not None:
            out.append(dict(point, label=baseline[0], same_bits=None, times_ms=[]))
            calls[baseline[0]] = (lambda fn=baseline[1]: fn(x, *args), out[-1])
        for _ in range(repeats):
            for label, (fn, rec) in calls.items():
                rec["times_ms"].append(graph_time(fn)[0])
        for _, rec in calls.values():
            rec["median_ms"] = sorted(rec["times_ms"])[len(rec["times_ms"]) // 2]
    return out


def sweep_markdown(meta: dict, results: list[dict]) -> str:
    """The sweep's table: each variant's median, its floor ratio and the baseline's time over its own
    (``vs base``: cuBLAS, or vLLM's CUTLASS GEMM with ``--fp8``, timed in the same run); variants that
    raised (most often: did not compile) are listed under it with the error."""
    base = {(r["model"], r["layer"], r["rows"]): r.get("median_ms") for r in results
            if r["label"] in ("cublas", "vllm-cutlass")}
    lines = [f"# Invariant GEMM tile sweep ({meta['gpu']}, commit {meta['commit']})", "", meta["timing"], "",
             "| model | layer | rows | variant | median us | x floor | vs base | same bits |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        t = r.get("median_ms")
        b = base.get((r["model"], r["layer"], r["rows"]))
        time_us = "-" if t is None else f"{t * 1e3:.1f}"
        x_floor = "-" if t is None else f"{t / r['floor_ms']:.2f}"
        vs_base = "-" if t is None or b is None else f"{b / t:.2f}"
        same = "error" if r.get("error") else "n/a" if r["same_bits"] is None else "yes" if r["same_bits"] else "**NO**"
        lines.append(f"| {r['model']} | {r['layer']} | {r['rows']} | {r['label']} | {time_us} | {x_floor} | {vs_base} | {same} |")
    errors = [f"- {r['model']} {r['layer']} {r['rows']} rows, {r['label']}: {r['error']}" for r in results if r.get("error")]
    return "\n".join(lines + (["", "Not run (the variant raised):", *errors] if errors else [])) + "\n"


def floor_ms(rows: int, n: int, k: int, fp8_flops: float | None = None) -> float:
    """max(FLOPs / rate, bytes / HBM rate): bf16 weights at ``PEAK_FLOPS``, or with ``fp8_flops`` the
    1-byte weights of block FP8 (their scales ignored) at that rate; bf16 inputs and outputs."""
    flops = 2.0 * rows * n * k
    moved = n * k * (1 if fp8_flops else 2) + (rows * k + rows * n) * 2
    return max(flops / (fp8_flops or PEAK_FLOPS), moved / PEAK_BYTES) * 1e3


def providers() -> dict:
    from mok_serve.kernels import invariant_linear

    impls = {"kittens": invariant_linear, "cublas": torch.nn.functional.linear}
    try:
        from vllm.model_executor.determinism import batch_invariant as vllm_bi

        impls["vllm-bi"] = vllm_bi.linear_batch_invariant
    except ImportError:
        pass
    return impls


def fp8_providers() -> dict:
    """``fn(x, weight, weight_scale)`` of each block-FP8 provider (``--fp8``)."""
    from mok_serve.kernels import invariant_linear_fp8

    impls = {"kittens": invariant_linear_fp8}
    try:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (per_token_group_quant_fp8,
                                                                              w8a8_triton_block_scaled_mm)

        from mok_serve.vllm.deterministic import vllm_cutlass_linear_fp8
    except ImportError:
        return impls

    def cutlass(x, w, ws):  # as vLLM's CutlassFp8BlockScaledMMKernel (and --deterministic's cutlass choice)
        return vllm_cutlass_linear_fp8(x, w, ws, None)

    def triton_block(x, w, ws):  # as vLLM's TritonFp8BlockScaledMMKernel
        xq, xs = per_token_group_quant_fp8(x, 128)
        return w8a8_triton_block_scaled_mm(xq, w, xs, ws, [128, 128], x.dtype)

    impls["vllm-cutlass"] = cutlass
    impls["vllm-triton"] = triton_block
    return impls


def measure(model: str, layer: str, n: int, k: int, rows: int, impls: dict, gen, fp8_flops: float | None = None) -> dict:
    """One point: each provider's error against an fp32 reference, whether its last row alone has
    the bits of the same row in the batch, and (where its output passes) its time."""
    from mok_serve.kernels.fp8 import dequantize_fp8_blocks, dequantize_fp8_groups, quantize_fp8_blocks, quantize_fp8_groups

    w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
    x = torch.randn(rows, k, device="cuda", generator=gen).to(torch.bfloat16)
    if fp8_flops:
        args = quantize_fp8_blocks(w)
        ref = dequantize_fp8_groups(*quantize_fp8_groups(x.float())) @ dequantize_fp8_blocks(*args).t()
    else:
        args = (w.to(torch.bfloat16),)
        ref = x.float() @ args[0].float().t()
    row = {"model": model, "layer": layer, "n": n, "k": k, "rows": rows, "floor_ms": floor_ms(rows, n, k, fp8_flops)}
    for name, fn in impls.items():
        try:
            out = fn(x, *args)
            alone = fn(x[-1:], *args)
        except (RuntimeError, ValueError, AssertionError) as exc:  # a shape the provider does not take
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            row[f"{name}_ms"] = None
            continue
        row[f"{name}_row_alone_equal"] = bool(torch.equal(alone, out[-1:]))
        err = rel_err(out, ref)
        row[f"{name}_err"] = err
        if not passes(err, TOL):
            row[f"{name}_ms"] = None
            continue
        row[f"{name}_ms"], _, _ = graph_time(lambda fn=fn: fn(x, *args))
    add_ratios(row, impls)
    return row


def markdown(meta: dict, rows: list[dict], names: list[str]) -> str:
    head = ["model", "layer", "N x K", "rows", "floor us", *[f"{n} us" for n in names], "kittens x floor",
            *[f"vs {n}" for n in names if n != "kittens"], *[f"{n}: row alone = in batch" for n in names]]
    lines = [f"# Dense layers: kittens' batch-invariant GEMM vs stock ({meta['gpu']}, commit {meta['commit']})", "",
             meta["timing"], "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def same(v):
        return "-" if v is None else "yes" if v else "**NO**"

    def us(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    for r in rows:
        cells = [r["model"], r["layer"], f"{r['n']} x {r['k']}", str(r["rows"]), us(r["floor_ms"]),
                 *[us(r.get(f"{n}_ms")) for n in names], f"{r.get('kittens_x_floor', float('nan')):.2f}",
                 *[f"{r[f'speedup_vs_{n}']:.2f}x" if r.get(f"speedup_vs_{n}") else "-" for n in names if n != "kittens"],
                 *[same(r.get(f"{n}_row_alone_equal")) for n in names]]
        lines.append("| " + " | ".join(cells) + " |")
    errors = [f"- {r['model']} {r['layer']} {r['rows']} rows, {n}: {r[f'{n}_error']}" for r in rows for n in names
              if r.get(f"{n}_error")]
    return "\n".join(lines + (["", "Not run (the provider refused the call):", *errors] if errors else [])) + "\n"


def history_rows(meta: dict, rows: list[dict], names: list[str], benchmark: str = "linear_bench") -> list[dict]:
    return timed_history_rows(meta, rows, names, benchmark, lambda r: f"{r['model']}:{r['layer']}",
                              lambda r: r["rows"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mok-loadtest linear", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DENSE_LAYERS), help="comma-separated, of: " + ", ".join(DENSE_LAYERS))
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts (tokens per step)")
    p.add_argument("--out", default=str(RESULTS), help="folder for linear_bench[_fp8].{json,md}")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--fp8", action="store_true",
                   help="block-FP8 weights: kittens' invariant_linear_fp8 against vLLM's block-FP8 GEMMs")
    p.add_argument("--sweep", action="store_true", help="time kittens' tile variants (SWEEP) at --points instead")
    p.add_argument("--points", nargs="*", default=None, metavar="MODEL:LAYER:ROWS", help="the sweep's points")
    p.add_argument("--sweep-labels", nargs="*", default=None, metavar="LABEL",
                   help="variants to time (default: all): " + ", ".join(SWEEP))
    p.add_argument("--sweep-repeats", type=int, default=3, help="interleaved repeats of the sweep")
    history.add_arguments(p)
    args = p.parse_args(argv)
    if args.sweep:
        try:
            points = [parse_point(t) for t in args.points or []]
        except ValueError as exc:
            p.error(str(exc))
        labels = args.sweep_labels or list(SWEEP)
        if not points or set(labels) - set(SWEEP) or args.sweep_repeats < 1:
            p.error("--sweep needs --points, known --sweep-labels and --sweep-repeats >= 1")
    models = [m for m in args.models.split(",") if m]
    unknown = set(models) - set(DENSE_LAYERS)
    if unknown:
        p.error(f"unknown model(s) {', '.join(sorted(unknown))}")
    row_counts = [int(r) for r in args.rows.split(",") if r]
    if not torch.cuda.is_available():
        print("the dense-layer benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from tqdm import tqdm

    impls = fp8_providers() if args.fp8 else providers()
    names = list(impls)
    rate = fp8_rate() if args.fp8 else None
    weights = (f"block-FP8 weights (128 x 128 scales), bf16 inputs quantized per 1 x 128 group by each provider, floor "
               f"at the measured dense FP8 rate {rate / 1e12:.0f} TFLOP/s" if rate else "bf16 weights and inputs")
    meta = bench_meta("Median of CUDA-graph replays, L2 flushed before each (triton.testing.do_bench); "
                      f"{weights}, no bias; `vs X`: X's time / kittens' time.")
    name = "linear_bench_fp8" if args.fp8 else "linear_bench"
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.sweep:
        results = sweep(points, labels, args.sweep_repeats, gen, rate)
        name = "linear_sweep_fp8" if args.fp8 else "linear_sweep"
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
        text = sweep_markdown(meta, results)
        (out / f"{name}.md").write_text(text)
        history.write([dict(date=meta["date"][:19], commit=meta["commit"], benchmark=name, gpu=meta["gpu"],
                            versions=f"torch={meta['torch']} triton={meta['triton']}", shape=f"{r['model']}:{r['layer']}",
                            tokens_or_load=r["rows"], routing="", config=f"variant={r['label']} repeat={i}",
                            provider=r["label"] if r["same_bits"] is None else "kittens", metric="time_ms", value=t,
                            unit="ms", source="")
                       for r in results for i, t in enumerate(r["times_ms"])], history.resolve(args), "mok-loadtest linear")
        print(text)
        return 0 if all(r["same_bits"] is not False for r in results) else 1
    # FP8 checkpoints keep their routers and LM heads in bf16.
    points = [(m, layer, n, k, r) for m in models for layer, (n, k) in DENSE_LAYERS[m].items() for r in row_counts
              if not (args.fp8 and layer in ("router", "lm_head"))]
    rows = []
    for m, layer, n, k, r in tqdm(points, desc="dense layers", unit="point"):
        rows.append(measure(m, layer, n, k, r, impls, gen, rate))
        torch.cuda.empty_cache()
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = markdown(meta, rows, names)
    (out / f"{name}.md").write_text(text)
    history.write(history_rows(meta, rows, names, name), history.resolve(args), "mok-loadtest linear")
    print(text)
    return 0 if all(r.get("kittens_row_alone_equal") and r.get("kittens_ms") is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
