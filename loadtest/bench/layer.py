"""One-GPU MoE layer benchmark: kittens (Triton fused MoE) against its baselines and the floor.

For every model shape of ``configs/model_shapes.json``, token count and routing (uniform; skewed:
expert popularity falling as a power of its rank; with ``--routing concentrated``, hot experts: every
token to the same top-k experts; ``harness.make_routing``), it
checks each implementation against ``fused_moe_reference`` and then times, in the same run:

- kittens: ``mok_serve.kernels.fused_moe`` (4 Triton launches, no host sync);
- torch: argsort, gather, ``torch._grouped_mm``, SiLU-mul, ``torch._grouped_mm``, weighted
  scatter-add (``index_add_`` in fp32);
- transformers: the experts module of transformers' Qwen3-MoE with its ``grouped_mm`` experts
  implementation selected, holding the same weight tensors;
- vllm: vLLM's own Triton ``fused_experts`` (the kernel of ``--moe-backend triton``) on the same
  weights, with the block sizes vLLM picks itself: its tuned JSON file for this GPU and shape
  where vLLM ships one, its defaults otherwise (``vllm_config_file``: the file name and which of
  the two, per shape in the meta and per row with the tile sizes used). Only where vLLM imports;
  otherwise the results say the column is absent. Timed only if its output passes the check
  kittens' does (relative error within ``TOL_BF16``; NaN never passes).

Timing: each implementation is captured in a CUDA graph and the graph's replay is timed with
``triton.testing.do_bench`` (median; do_bench clears the L2 cache before every replay, so weights
are read from HBM as in a real model whose layers do not fit in L2). Kittens and vLLM also get
an eager time (``eager_time``): one call made directly from Python, each after the same L2 flush
and ``torch.cuda.synchronize()``, between two CUDA events, median of 10-500 calls filling about
as long as one replay timing. The GPU is idle when the start event is recorded, so the host's
work before the kernels are queued lies inside: ``eager - replay`` is that host-side cost, and
the eager target asks kittens' to be no larger than vLLM's at every row (``eager_target``).
Floor = max(FLOPs / 790e12, bytes / 4.4e12) with bytes = weights of the experts actually touched +
activations in and out. The best baseline of a row (its ratio) is the fastest of torch,
transformers and vLLM; the targets are ``report.target_ms``'s (issue 28's). Beside each kittens
time: the SM clock, power and power-cap share while it was timed (``gpu_clocks.ClockSampler``), because compute-bound rows
run at the GPU's power limit.

``--fp8``: block-scaled FP8 experts (128 x 128 e4m3 weight blocks, 1 x 128 activation groups, as
DeepSeek-V3, Kimi-K2 and the Qwen3 FP8 checkpoints ship) for every shape of configs/ unless
``--shapes`` says otherwise: kittens' ``fused_moe_fp8`` against dequantize (in expert
chunks, to bf16) + the torch pipeline above, and against vLLM's ``fused_experts`` with
``use_fp8_w8a8`` and ``block_shape=[128, 128]`` on the same e4m3 weights and scales (vLLM's kernel
multiplies by the block scale, the checkpoints' ``weight_scale_inv``: the convention of
``kernels/fp8.py``, so the scales go in unchanged); correctness against
``fused_moe_fp8_reference`` (``TOL_FP8``); eager times as above.
The floor counts FP8 weight bytes (1 per element plus the fp32 block scales) and FP8 FLOPs at the
dense FP8 rate measured in the same run (``torch._scaled_mm``, 16384 x 7168 x 4096).

``main(argv)`` is the entry point (``mok-loadtest layer``; ``--shapes``, ``--tokens`` and
``--routing`` pick a subset); ``--sweep`` times block-size variants
of kittens at a few points instead, ``--profile`` splits a call's device time by kernel, ``--host-profile`` an eager call's host time by function,
``--timeline`` records the one-launch decode kernel's work items in time, and ``--replot
RESULT.json`` rewrites an earlier run's Markdown and plot from its JSON (no GPU; JSONs of runs
before the vLLM and eager columns replot without them). ``--l2-flush read`` empties the L2
before each timed replay and eager call by a read instead of do_bench's write, whose dirty
lines are written back inside the replay (``L2_FLUSHES``).

This module holds the runs (``bench_rows``, ``bench_rows_fp8``), the sweeps, profiles, timelines
and the command line; shapes, inputs, baselines, timing and the correctness check are in
``harness``, the judging, Markdown and plots in ``report``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import pathlib
import platform
import statistics
import sys
import time

import torch

from .. import history, provenance
from ..gpu_clocks import ClockSampler, clock_text
from .harness import (
    DEFAULT_ROUTINGS, EAGER_BUDGET_MS, EAGER_CALLS, EAGER_IMPLS, L2_FLUSHES, PEAK_BYTES, PEAK_FLOPS, ROUTINGS, TOL_BF16, TOL_FP8,
    check_vllm, dequantized_pipeline, eager_times, floor_of, fp8_rate, graph_time, load_shapes, load_vllm_moe,
    make_routing, passes, random_experts, random_fp8_weights, read_bandwidth, rel_err, set_l2_flush, time_impls,
    torch_pipeline, transformers_experts, vllm_config, vllm_config_file, vllm_experts,
)
from .l2_rates import l2_read_bandwidth
from .report import judge, vllm_and_eager_fields, write_markdown, write_markdown_fp8, write_plot

TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"


def parse_points(points):
    """``["SHAPE:TOKENS[:ROUTING]", ...]`` -> ``[(shape, tokens, routing), ...]``; routing
    ``uniform`` unless named (shape names may contain ':')."""
    out = []
    for pt in points:
        parts = pt.rsplit(":", 2)
        routing = parts.pop() if len(parts) == 3 and parts[-1] in ROUTINGS else "uniform"
        rest = ":".join(parts[:-1])
        if not rest or not parts[-1].isdigit():
            raise ValueError(f"point {pt!r}: expected SHAPE:TOKENS or SHAPE:TOKENS:ROUTING, ROUTING one of "
                             f"{', '.join(ROUTINGS)}")
        out.append((rest, int(parts[-1]), routing))
    return out


# ---------------------------------------------------------------------------------- runs


def _vllm_log(row) -> str:
    """The vLLM and eager part of a row's log line."""
    if "vllm_ms" in row:
        vllm = f"  vllm {row['vllm_ms']:8.3f} ({row['vllm_config']['source']}) vllm/k x{row['speedup_vs_vllm']:5.2f}"
    elif "vllm_config" in row:
        vllm = f"  vllm WRONG (err {row['rel_err']['vllm']:.1e}{', ' + row['vllm_error'] if 'vllm_error' in row else ''})"
    else:
        vllm = ""
    met = row["eager_target_met"]
    return (vllm + "  eager-replay us " + " ".join(f"{k}={v * 1e3:.1f}" for k, v in row["eager_extra_ms"].items())
            + ("" if met is None else "  eager OK" if met else "  eager MISS"))


def bench_rows(shapes, tokens_list, routings, seed, log, clocks, on_row=None, vllm_fm=None):
    """The benchmark's bf16 rows; ``vllm_fm`` (``load_vllm_moe``) adds vLLM's ``fused_experts``."""
    from mok_serve.kernels import fused_moe, fused_moe_reference
    from mok_serve.kernels.cuda.configs import pick_configs
    from mok_serve.kernels.cuda.moe import operand_bytes
    from mok_serve.kernels.env import knob

    rows = []
    for name, s in shapes.items():
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w13, w2 = random_experts(E, H, I, gen)
        hf = transformers_experts(w13, w2)
        vllm_run = vllm_experts(vllm_fm, w13, w2) if vllm_fm is not None else None
        for tokens in tokens_list:
            for routing in routings:
                x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
                tw, ids = make_routing(tokens, E, K, routing, gen)
                fl = floor_of(tokens, H, I, K, ids)
                fl["operand_bytes"] = sum(operand_bytes(
                    torch.bincount(ids.flatten(), minlength=E).tolist(), H, I,
                    pick_configs(tokens, K, E, H, I, one_launch=knob("one_launch"))).values())
                impls = {
                    "kittens": lambda: fused_moe(x, w13, w2, tw, ids),
                    "torch": lambda: torch_pipeline(x, w13, w2, tw, ids),
                    "transformers": lambda: hf(x, ids, tw),
                }
                with torch.no_grad():
                    ref = fused_moe_reference(x, w13, w2, tw, ids)
                    errs = {k: rel_err(f(), ref) for k, f in impls.items()}
                    vllm_error = None
                    if vllm_run is not None:
                        impls["vllm"] = lambda: vllm_run(x, tw, ids)
                        vllm_error = check_vllm(impls, errs, ref, TOL_BF16)
                    times, modes, clock = time_impls(impls, clocks)
                    eager, calls = eager_times(impls)
                torch.cuda.empty_cache()
                best_base = min(v for k, v in times.items() if k != "kittens")
                row = dict(
                    shape=name, tokens=tokens, routing=routing, experts=E, hidden=H, inter=I, top_k=K,
                    kittens_ms=times["kittens"], torch_ms=times["torch"], transformers_ms=times["transformers"],
                    timing=modes, clock=clock, rel_err=errs, **fl,
                )
                vllm_cfg = vllm_config(vllm_fm, E, H, I, K, tokens) if vllm_fm is not None else None
                row.update(vllm_and_eager_fields(times, errs, eager, calls, TOL_BF16, vllm_cfg, vllm_error))
                row["ratio_to_floor"] = row["kittens_ms"] / fl["floor_ms"]
                row["speedup_vs_torch"] = times["torch"] / times["kittens"]
                row["speedup_vs_transformers"] = times["transformers"] / times["kittens"]
                row["speedup_vs_best_baseline"] = best_base / times["kittens"]
                row.update(judge(row))
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                log(f"{name:16s} T={tokens:5d} {routing:7s} kittens {times['kittens']:8.3f} ms  floor "
                    f"{fl['floor_ms']:7.3f} ({fl['bound']:7s}) x{row['ratio_to_floor']:5.2f}  torch "
                    f"{times['torch']:8.3f}  hf {times['transformers']:8.3f}  best/k x{row['speedup_vs_best_baseline']:5.2f}"
                    f"  err k={errs['kittens']:.1e} t={errs['torch']:.1e} hf={errs['transformers']:.1e}"
                    f"  {clock_text(clock['kittens'])}  {'OK' if row['target_met'] else 'MISS: ' + row['target']}"
                    + _vllm_log(row))
        del w13, w2, hf, vllm_run
        torch.cuda.empty_cache()
    return rows


def bench_rows_fp8(shapes, tokens_list, routings, seed, log, peak_fp8, clocks, on_row=None, vllm_fm=None):
    """The benchmark's block-FP8 rows; ``vllm_fm`` adds vLLM's ``fused_experts`` on the same
    e4m3 weights and scales."""
    from mok_serve.kernels import fused_moe_fp8, fused_moe_fp8_reference

    # Scales add 4 bytes per 128 x 128 block of weights.
    weight_bytes = 1.0 + 4.0 / (128 * 128)
    rows = []
    for name, s in shapes.items():
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        w13q, w13s = random_fp8_weights(E, 2 * I, H, gen)
        w2q, w2s = random_fp8_weights(E, H, I, gen)
        baseline = dequantized_pipeline(w13q, w13s, w2q, w2s)
        vllm_run = vllm_experts(vllm_fm, w13q, w2q, w13s, w2s) if vllm_fm is not None else None
        for tokens in tokens_list:
            for routing in routings:
                x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
                tw, ids = make_routing(tokens, E, K, routing, gen)
                fl = floor_of(tokens, H, I, K, ids, weight_bytes_per_elem=weight_bytes, peak_flops=peak_fp8)
                impls = {
                    "kittens": lambda: fused_moe_fp8(x, w13q, w2q, w13s, w2s, tw, ids),
                    "dequant_torch": lambda: baseline(x, tw, ids),
                }
                with torch.no_grad():
                    ref = fused_moe_fp8_reference(x, w13q, w2q, w13s, w2s, tw, ids)
                    errs = {k: rel_err(f(), ref) for k, f in impls.items()}
                    vllm_error = None
                    if vllm_run is not None:
                        impls["vllm"] = lambda: vllm_run(x, tw, ids)
                        vllm_error = check_vllm(impls, errs, ref, TOL_FP8)
                    times, modes, clock = time_impls(impls, clocks)
                    eager, calls = eager_times(impls)
                torch.cuda.empty_cache()
                row = dict(
                    shape=name, quant="fp8 block 128x128", tokens=tokens, routing=routing, experts=E, hidden=H,
                    inter=I, top_k=K, kittens_ms=times["kittens"], dequant_torch_ms=times["dequant_torch"],
                    timing=modes, clock=clock, rel_err=errs, **fl,
                )
                row["ratio_to_floor"] = row["kittens_ms"] / fl["floor_ms"]
                # The best baseline is vLLM's where it was measured, as for the bf16 rows.
                row["speedup_vs_best_baseline"] = min(v for k, v in times.items() if k != "kittens") / times["kittens"]
                row["correct"] = passes(errs["kittens"], TOL_FP8)
                vllm_cfg = vllm_config(vllm_fm, E, H, I, K, tokens, fp8=True) if vllm_fm is not None else None
                row.update(vllm_and_eager_fields(times, errs, eager, calls, TOL_FP8, vllm_cfg, vllm_error))
                row.update(judge(row))
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                log(f"FP8 {name:12s} T={tokens:5d} {routing:7s} kittens {times['kittens']:8.3f} ms  floor "
                    f"{fl['floor_ms']:7.3f} ({fl['bound']:7s}) x{row['ratio_to_floor']:5.2f}  dequant+torch "
                    f"{times['dequant_torch']:8.3f}  speedup x{row['speedup_vs_best_baseline']:6.1f}"
                    f"  err k={errs['kittens']:.1e} base={errs['dequant_torch']:.1e}  {clock_text(clock['kittens'])}"
                    f"  {'OK' if row['target_met'] else 'MISS: ' + row['target']}" + _vllm_log(row))
        del w13q, w13s, w2q, w2s, baseline, impls, vllm_run
        gc.collect()
        torch.cuda.empty_cache()
        log(f"  after {name}: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated")
    return rows


SWEEP_POINTS = [
    ("DeepSeek-V3", 2048, "uniform"), ("DeepSeek-V3", 8192, "uniform"), ("Kimi-K2", 8192, "uniform"),
    ("Qwen3-30B-A3B", 2048, "uniform"), ("Qwen3-30B-A3B", 8192, "uniform"),
]


def sweep_points(given, selected_shapes) -> list:
    """The sweep's points: those given on the command line, every one of them (any shape of
    configs/), else the default points of the shapes ``--shapes`` (or ``--fp8``) selects."""
    return list(given) if given else [pt for pt in SWEEP_POINTS if pt[0] in selected_shapes]


def sweep_variants(tokens, top_k, E, H, I):
    """Named (GEMM1, GEMM2) config pairs around the default: gate/up fused into one dot, TMA weights.
    The sweep also times the default with the kernels launched the ordinary way ("no PDL")."""
    from mok_serve.kernels.cuda.configs import one_height, pick_configs
    from mok_serve.kernels.env import knob

    d1, d2 = pick_configs(tokens, top_k, E, H, I, one_launch=knob("one_launch"))

    def v(d, **kw):
        return {**d, **kw}

    out = [("default", d1, d2)]
    avg = tokens * top_k / E
    out += [("g1 pointer", v(d1, USE_TMA=False), d2)]  # GEMM1 weight tiles by pointer loads
    if avg > 48:
        out += [
            ("group1", v(d1, GROUP_M=1), v(d2, GROUP_M=1)),
            ("group8", v(d1, GROUP_M=8), v(d2, GROUP_M=8)),
            ("s4", v(d1, num_stages=4), v(d2, num_stages=4)),
            ("g1 s4", v(d1, num_stages=4), d2),
            ("g2 n128 s4", d1, v(d2, BLOCK_N=128, num_stages=4)),
            ("no half tail", v(d1, HALF_TAIL=False), v(d2, HALF_TAIL=False)),
            # 128x128 output tiles with 3 stages (~96 KB of shared memory, ~100 registers): two
            # programs per SM, so one's prologue and epilogue overlap the other's main loop.
            ("2/SM", v(d1, BLOCK_N=64, num_stages=3), v(d2, BLOCK_N=128, num_stages=3)),
            ("g1 2/SM", v(d1, BLOCK_N=64, num_stages=3), d2),
            ("g2 2/SM", d1, v(d2, BLOCK_N=128, num_stages=3)),
        ]
    elif d1.get("SWAP_AB"):
        # Decode: both GEMMs in one launch by default. One program's shared memory is the larger
        # GEMM's: the default keeps both within half an SM (two programs per SM); GEMM1 at 64
        # columns with 6 stages or GEMM2 at 256 columns or 4 stages take one SM each.
        bn1, bn2 = d1["BLOCK_N"], d2["BLOCK_N"]
        out += [
            ("two launches", *pick_configs(tokens, top_k, E, H, I)),
            ("g1 s3", v(d1, num_stages=3), d2),
            ("g1 s6", v(d1, num_stages=6), d2),
            # Column width sets the programs per weight matrix (2 * BLOCK_N >= 64: wgmma's M side).
            ("g1 n/2", v(d1, BLOCK_N=max(32, bn1 // 2), num_stages=6), d2),
            ("g2 s4", d1, v(d2, num_stages=4)),
            ("g2 n/2", d1, v(d2, BLOCK_N=max(64, bn2 // 2))),
            ("g2 n*2", d1, v(d2, BLOCK_N=min(256, bn2 * 2))),
            # Token tiles of 32 and 64 rows: an expert with more than 16 rows (every token on the
            # same experts, --routing concentrated) re-reads its weights per 16-row tile; wider
            # tiles cost padding and shared memory where loads are even.
            ("m32", v(d1, BLOCK_M=32, num_stages=4), v(d2, BLOCK_M=32)),
            ("m64", v(d1, BLOCK_M=64, num_stages=3), v(d2, BLOCK_M=64)),
            # GEMM1 items in groups of row tiles (program_tile; default 4): an expert's row tiles
            # read each weight tile together, from HBM once, where it has many.
            ("g1 group1", v(d1, GROUP_M=1), d2),
            ("g1 group16", v(d1, GROUP_M=16), d2),
            ("g2 group4", d1, v(d2, GROUP_M=4)),
            ("g2 group16", d1, v(d2, GROUP_M=16)),
            # Experts with more than 16 rows in 32-row tiles instead of the default's 64 (HEAVY_M,
            # chosen on the device from the counts), or every expert in 16-row ones.
            ("heavy32", v(d1, HEAVY_M=32, HEAVY_STAGES=3), v(d2, HEAVY_STAGES=3)),
            ("no heavy", v(d1, HEAVY_M=0), {k: x for k, x in d2.items() if k != "HEAVY_STAGES"}),
        ]
        if bn2 >= 128:
            # The last R row tiles in use run GEMM2 at half width, so the last items drawn are short.
            out += [(f"g2 narrow tail {r}", d1, v(d2, NARROW_TAIL=r)) for r in (0, 1, 2, 4)
                    if r != d2.get("NARROW_TAIL", 0)]
    else:
        bn1, bn2 = d1["BLOCK_N"], d2["BLOCK_N"]
        out += [
            ("s3", v(d1, num_stages=3), v(d2, num_stages=3)),
            ("s5", v(d1, num_stages=5), v(d2, num_stages=5)),
            # Column width sets the programs per weight matrix and so the last wave's fill.
            ("g1 n/2", v(d1, BLOCK_N=max(16, bn1 // 2)), d2),
            ("g1 n*2", v(d1, BLOCK_N=min(128, bn1 * 2)), d2),
            ("g2 n/2", d1, v(d2, BLOCK_N=max(16, bn2 // 2))),
            ("g2 n*2", d1, v(d2, BLOCK_N=min(256, bn2 * 2))),
            ("group4", v(d1, GROUP_M=4), v(d2, GROUP_M=4)),
            # The next regime's 128-row tiles (pick_configs' at 96 rows per expert) for every expert.
            ("m128 tiles", *pick_configs(-(-96 * E // top_k), top_k, E, H, I)),
            # Hot experts' 128-row tiles (the default's HEAVY_M): without them, or 2-deep.
            ("no heavy", one_height(d1), one_height(d2)),
            ("heavy128 s2", v(d1, HEAVY_STAGES=2), v(d2, HEAVY_STAGES=2)),
        ]
        o1, o2 = one_height(d1), one_height(d2)
        out += [
            # Operands swapped with 16-row token tiles, as at decode (18-44% slower at 16-32 rows
            # per expert in the sweep at 5767485).
            ("swapped", v(o1, BLOCK_M=16, SWAP_AB=True, BLOCK_K=128, num_stages=6, BLOCK_N=max(32, bn1)),
             v(o2, BLOCK_M=16, SWAP_AB=True, BLOCK_K=128, num_stages=3, BLOCK_N=max(64, bn2))),
            # Both GEMMs in one launch (the decode kernel): as the default, or with swapped tiles
            # of 64, 32 or 16 token rows, each within half an SM's shared memory.
            ("one launch", v(o1, ONE_LAUNCH=True), o2),
            ("one launch m64 swap", v(o1, SWAP_AB=True, ONE_LAUNCH=True), v(o2, SWAP_AB=True)),
            ("one launch m32 swap", v(o1, BLOCK_M=32, SWAP_AB=True, BLOCK_K=128, num_stages=4, BLOCK_N=32, ONE_LAUNCH=True),
             v(o2, BLOCK_M=32, SWAP_AB=True, BLOCK_K=128, num_stages=3, BLOCK_N=64)),
            ("one launch m16 swap", v(o1, BLOCK_M=16, SWAP_AB=True, BLOCK_K=128, num_stages=4, BLOCK_N=max(32, bn1),
                                      ONE_LAUNCH=True),
             v(o2, BLOCK_M=16, SWAP_AB=True, BLOCK_K=128, num_stages=3, BLOCK_N=min(128, max(64, bn2)))),
        ]
    return out



def sweep_variants_fp8(tokens, top_k, E, H, I):
    """Named (GEMM1, GEMM2) config pairs of the FP8 kernels around ``pick_configs_fp8``'s."""
    from mok_serve.kernels.cuda.configs import one_height, pick_configs_fp8

    d1, d2 = pick_configs_fp8(tokens, top_k, E, H, I)
    o1, o2 = one_height(d1), one_height(d2)  # the one-launch kernel and other tile heights: one height

    def v(d, **kw):
        return {**d, **kw}

    out = [("default", d1, d2)]
    avg = tokens * top_k / E
    if 8 < avg <= 32:
        # Swapped 32-row token tiles (s6/5: the default at 12-16 rows per expert before 9a331f9): one
        # tile holds an expert's rows up to ~2x the average.
        m32 = dict(BLOCK_M=32, num_warps=4, SWAP_AB=True, GROUP_M=1)
        out += [(f"swap m32 s{s1}/{s2}", v(o1, **m32, BLOCK_N=128, num_stages=s1),
                 v(o2, **m32, num_stages=s2, BLOCK_N=max(64, d2["BLOCK_N"])))
                for s1, s2 in ((4, 5), (5, 5), (6, 5))]
        m16 = dict(m32, BLOCK_M=16)
        out += [("swap m16 s6/5", v(o1, **m16, num_stages=6), v(o2, **m16, num_stages=5, BLOCK_N=max(64, d2["BLOCK_N"])))]
    if 12 < avg <= 32:
        # The neighbouring regime's tiles (vLLM's tuned Qwen3-30B-A3B config has 64-row tiles from 256
        # tokens): 16-row tiles with 64-row heavy ones (pick_configs_fp8's up to 16 rows per expert)
        # or 64-row tiles (its 16-48); and 32-row tiles whose experts past 32 rows take 64-row heavy
        # tiles (GEMM1 at 64 columns: a 128-column heavy tile would need 256 registers a thread).
        heavy = dict(HEAVY_M=64, HEAVY_STAGES=4)
        out += [(label, *cfg) for label, cfg in (
            ("m16 heavy64", pick_configs_fp8(16 * E // top_k, top_k, E, H, I)),
            ("m64", pick_configs_fp8(-(-24 * E // top_k), top_k, E, H, I)),
            ("m32 heavy64 n64", (v(o1, BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=6, GROUP_M=1, SWAP_AB=True, **heavy),
                                 v(o2, BLOCK_M=32, BLOCK_N=max(64, d2["BLOCK_N"]), num_warps=4, num_stages=5,
                                   SWAP_AB=True, GROUP_M=1, **heavy))),
        ) if (cfg[0], cfg[1]) != (d1, d2)]
    if avg <= 8:
        # Operands swapped, 16-row token tiles (as the bf16 decode regime): weight tiles fill the
        # shared memory, so deeper pipelines fit (GEMM1 stage 34 KB, GEMM2 2 KB + 128 B per column).
        sw1 = v(d1, BLOCK_M=16, num_warps=4, SWAP_AB=True, GROUP_M=1)
        sw2 = v(d2, BLOCK_M=16, SWAP_AB=True, GROUP_M=1)
        out += [
            ("swap", v(sw1, num_stages=4), sw2),
            ("swap g1", v(sw1, num_stages=4), d2),
            ("swap g2", d1, sw2),
            ("swap g1 s6", v(sw1, num_stages=6), sw2),
            ("swap g1 w8", v(sw1, num_stages=4, num_warps=8), sw2),
            ("swap g2 s8", v(sw1, num_stages=4), v(sw2, num_stages=8)),
            ("swap deep", v(sw1, num_stages=6), v(sw2, num_stages=8)),
        ]
    if avg <= 16:
        # GEMM1 in 64-column programs, two per activation group (the last quantizes it; the default
        # with 16-row tiles), or in 128-column ones: twice the programs reading weights where one
        # token's experts give few (Qwen3-30B-A3B at 1 token: 48 of 128 columns for 132 SMs).
        other = 128 if d1.get("BLOCK_N", 128) == 64 else 64
        out += [(f"g1 n{other}", v(d1, BLOCK_N=other), d2), ("g1 n64 s4", v(d1, BLOCK_N=64, num_stages=4), d2),
                ("g1 n64 s8", v(d1, BLOCK_N=64, num_stages=8), d2),
                # Four programs per group (wgmma's smallest M side, 2 x 32 weight columns swapped).
                ("g1 n32", v(d1, BLOCK_N=32), d2), ("g1 n32 s8", v(d1, BLOCK_N=32, num_stages=8), d2),
                # Both GEMMs as one launch (as bf16's decode kernel, 0-8% there): no launch boundary,
                # and GEMM2 items fill the SMs GEMM1's last wave leaves idle.
                ("one launch", v(o1, ONE_LAUNCH=True), o2), ("one launch n32", v(o1, ONE_LAUNCH=True, BLOCK_N=32), o2)]
    if d1.get("HEAVY_M"):
        # Hot experts' 64-row tiles (the default's HEAVY_M): without them, 2-deep, or in grouped
        # order (an expert's heavy tiles side by side on a weight tile).
        out += [("no heavy", o1, o2), ("heavy64 s2", v(d1, HEAVY_STAGES=2), v(d2, HEAVY_STAGES=2)),
                ("heavy64 group4", v(d1, GROUP_M=4), v(d2, GROUP_M=4))]
    if 16 < avg <= 48:
        # 64-row tiles in column-fastest order: a hot expert's row tiles read the same weight tile
        # far apart in time (DeepSeek-V3's 29 MB of w13 per expert do not stay in L2). Grouped order
        # runs 4 or 8 of its row tiles side by side on each weight tile.
        out += [(f"group{g}", v(d1, GROUP_M=g), v(d2, GROUP_M=g)) for g in (4, 8)]
        # Hot experts' 128-row tiles beside the 64-row ones (this regime has none by default: a hot
        # expert's weights are read once per 64 rows). At GEMM1's 128 columns and GEMM2's 128 at 4 warps
        # a 128-row tile spills (255 registers); GEMM1 in 64-column programs (two a group) and GEMM2 at
        # 64 columns, or at 128 on 8 warps, compile for sm_90a without spills (234-238 registers). Same
        # bits, but 1.6-1.8x slower than the default at DeepSeek-V3 520-1024 tokens, hot or uniform (H100,
        # a6f81c8: loadtest/results/hot_sweeps_a6f81c8_h100/).
        heavy, heavy_s2 = dict(HEAVY_M=128, HEAVY_STAGES=3), dict(HEAVY_M=128, HEAVY_STAGES=2)
        out += [("heavy128 n64", v(d1, BLOCK_N=64, **heavy), v(d2, BLOCK_N=64, **heavy)),
                ("heavy128 n64 s2", v(d1, BLOCK_N=64, **heavy_s2), v(d2, BLOCK_N=64, **heavy_s2)),
                ("heavy128 g2 w8", v(d1, BLOCK_N=64, **heavy), v(d2, BLOCK_N=128, num_warps=8, **heavy))]
    if avg > 48:
        # vLLM's block-FP8 tile at these sizes (64 x 128, 4 warps, 3 stages, GROUP_SIZE_M 32) ran
        # 5-9% faster than kittens at 2048-8192 tokens (a8ceab5), where kittens' GEMM2 takes 128-row
        # tiles: DeepSeek-V3's ~64 rows per expert at 2048 tokens fill half of one.
        m64 = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4)
        out += [("g2 m64 s3", d1, v(d2, **m64, num_stages=3)), ("g2 m64 s4", d1, v(d2, **m64, num_stages=4)),
                ("g2 m64 group32", d1, v(d2, **m64, num_stages=3, GROUP_M=32)),
                ("group32", v(d1, GROUP_M=32), v(d2, GROUP_M=32)),
                # An expert's last GEMM2 tile at 64 rows when they hold what is left (bf16's HALF_TAIL).
                ("g2 half tail", d1, v(d2, HALF_TAIL=True))]
    return out

def sweep(shapes, points, seed, log, clocks, labels=None, repeats=1, fp8=False):
    """Time the ``sweep_variants`` (``sweep_variants_fp8`` with ``fp8``; those named in ``labels``,
    default all) at each (shape, tokens, routing) point, the variants interleaved ``repeats`` times
    so that slow drift hits all of them alike."""
    from mok_serve.kernels import fused_moe_fp8_reference
    from mok_serve.kernels.reference import fused_moe_reference
    from mok_serve.kernels.cuda.moe import fused_moe_triton
    from mok_serve.kernels.cuda.moe_fp8 import fused_moe_fp8_triton

    results = []
    by_shape: dict[str, list[tuple[int, str]]] = {}
    for name, t, routing in points:
        by_shape.setdefault(name, []).append((t, routing))
    for name, toks in by_shape.items():
        s = shapes[name]
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        gen = torch.Generator(device="cuda").manual_seed(seed)
        if fp8:
            w13q, w13s = random_fp8_weights(E, 2 * I, H, gen)
            w2q, w2s = random_fp8_weights(E, H, I, gen)
            weights, op, ref_op = (w13q, w2q, w13s, w2s), fused_moe_fp8_triton, fused_moe_fp8_reference
        else:
            weights, op, ref_op = random_experts(E, H, I, gen), fused_moe_triton, fused_moe_reference
        for tokens, routing in toks:
            x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
            tw, ids = make_routing(tokens, E, K, routing, gen)
            fl = floor_of(tokens, H, I, K, ids, weight_bytes_per_elem=1.0 if fp8 else 2.0)
            ref = ref_op(x, *weights, tw, ids)
            # Every variant must give the default's output bit for bit (batch invariance holds
            # only if block shapes do not change the arithmetic).
            default_out = op(x, *weights, tw, ids)
            variants = [(*v, True) for v in (sweep_variants_fp8 if fp8 else sweep_variants)(tokens, K, E, H, I)]
            variants.append(("no PDL", *variants[0][1:3], False))
            variants = [v for v in variants if labels is None or v[0] in labels]
            for rep, (label, g1, g2, pdl) in ((r, v) for r in range(repeats) for v in variants):
                try:
                    fn = lambda: op(x, *weights, tw, ids, pdl=pdl, configs=(g1, g2))  # noqa: E731
                    got = fn()
                    err = rel_err(got, ref)
                    bitwise = bool(torch.equal(got, default_out))
                    ms, how, clock = graph_time(fn, clocks, rep_ms=40)
                except Exception as exc:  # noqa: BLE001
                    log(f"  {name} T={tokens} {routing} {label}: failed {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                if how != "graph":
                    log(f"  {name} T={tokens} {routing} {label}: timed eagerly")
                results.append(dict(shape=name, tokens=tokens, routing=routing, label=label, g1=g1, g2=g2, ms=ms,
                                    floor_ms=fl["floor_ms"], err=err, bitwise_vs_default=bitwise, repeat=rep,
                                    clock=clock))
                log(f"SWEEP {name:14s} T={tokens:5d} {routing:7s} {label:28s} {ms:8.3f} ms x{ms / fl['floor_ms']:5.2f} err {err:.1e}"
                    f" {clock_text(clock)}{'' if bitwise else ' NOT BITWISE EQUAL TO DEFAULT'}")
        del weights
        torch.cuda.empty_cache()
    if repeats > 1:
        groups: dict[tuple, list[float]] = {}
        for r in results:
            groups.setdefault((r["shape"], r["tokens"], r["routing"], r["label"]), []).append(r["ms"])
        for (name, tokens, routing, label), times in groups.items():
            log(f"MEDIAN {name:14s} T={tokens:5d} {routing:7s} {label:28s} {statistics.median(times):8.3f} ms "
                f"(min {min(times):.3f}, max {max(times):.3f}, n {len(times)})")
    return results


def point_inputs(shape: dict, tokens: int, routing: str, seed: int):
    """``(w13, w2, x, tw, ids)`` of one (shape, tokens, routing) point of the profiles and the
    timeline: bf16 experts, activations and top-k routing, all drawn from one generator seeded
    with ``seed``."""
    E, H, I, K = shape["routed_experts"], shape["hidden"], shape["moe_intermediate"], shape["top_k"]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13, w2 = random_experts(E, H, I, gen)
    x = torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=gen)
    return (w13, w2, x, *make_routing(tokens, E, K, routing, gen))


def profile(shapes, points, seed, log, calls=10):
    """Where one kittens call's time goes, at each (shape, tokens, routing) point: each
    kernel's mean device time per call under ``torch.profiler`` (eager calls, L2 flushed before
    each), beside the call's CUDA-graph replay time. The profiled calls launch the ordinary way:
    with programmatic dependent launch a kernel starts early and waits for the previous one, and
    its time would include that wait. Returns one dict per point."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from mok_serve.kernels.cuda.moe import fused_moe_triton

    results = []
    for name, tokens, routing in points:
        s = shapes[name]
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        w13, w2, x, tw, ids = point_inputs(s, tokens, routing, seed)
        fn = lambda: fused_moe_triton(x, w13, w2, tw, ids)  # noqa: E731
        graph_ms, _, _ = graph_time(fn, rep_ms=40)
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        fn_no_pdl = lambda: fused_moe_triton(x, w13, w2, tw, ids, pdl=False)  # noqa: E731
        fn_no_pdl()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                flush.zero_()
                fn_no_pdl()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            if ev.key.startswith("_moe_"):
                kernels[ev.key] = ev.device_time_total / calls / 1e3  # ms per call
        fl = floor_of(tokens, H, I, K, ids)
        results.append(dict(shape=name, tokens=tokens, routing=routing, graph_ms=graph_ms, kernels_ms=kernels,
                            floor_ms=fl["floor_ms"], flops=fl["flops"]))
        parts = ", ".join(f"{k.removeprefix('_moe_').removesuffix('_kernel')} {v:.3f}" for k, v in kernels.items())
        log(f"PROFILE {name:16s} T={tokens:5d} {routing:7s} graph {graph_ms:.3f} ms = {graph_ms / fl['floor_ms']:.2f}x floor; "
            f"kernels (ms/call): {parts}; sum {sum(kernels.values()):.3f}")
        del w13, w2, flush
        torch.cuda.empty_cache()
    return results


def host_profile_rows(stats: dict, calls: int, top: int = 25) -> dict:
    """The ``top`` functions of a ``pstats.Stats(...).stats`` table by own time and by cumulative
    time, per call of the profiled op (``calls`` calls profiled): ``{"own": [...], "cumulative":
    [...]}``, each entry ``dict(function="file.py:LINE(name)", calls_per_call, own_us, cum_us)``."""
    rows = []
    for (path, line, func), (_, ncalls, own, cum, _) in stats.items():
        where = f"{pathlib.Path(path).name}:{line}({func})" if line else func
        rows.append(dict(function=where, calls_per_call=ncalls / calls, own_us=own / calls * 1e6, cum_us=cum / calls * 1e6))
    return {"own": sorted(rows, key=lambda r: -r["own_us"])[:top],
            "cumulative": sorted(rows, key=lambda r: -r["cum_us"])[:top]}


def host_profile(shapes, points, seed, log, calls=100, repeats=7):
    """Where an eager call's host time goes, at each (shape, tokens, routing) point: kittens'
    ``fused_moe_triton`` (and vLLM's Triton ``fused_experts`` where vLLM imports) called ``calls``
    times back to back from Python with no synchronisation in between, timed plainly ``repeats``
    times, the implementations interleaved (host microseconds per call: median, min and max of the
    repeats; the same code varied by up to 2x between runs on the H200 machine's host), then once
    under cProfile (``host_profile_rows``). The GPU drains the queue behind the host, so this is
    the host's cost as long as the GPU's time per call is the smaller (decode sizes); where it is
    not, the host waits for queue slots, and the time with the GPU drained says so.
    Returns one dict per point."""
    import cProfile
    import pstats

    from mok_serve.kernels.cuda.moe import fused_moe_triton

    vllm_fm, _ = load_vllm_moe()
    results = []
    for name, tokens, routing in points:
        s = shapes[name]
        w13, w2, x, tw, ids = point_inputs(s, tokens, routing, seed)
        impls = {"kittens": lambda: fused_moe_triton(x, w13, w2, tw, ids)}
        if vllm_fm is not None:
            run_vllm = vllm_experts(vllm_fm, w13, w2)
            impls["vllm"] = lambda: run_vllm(x, tw, ids)
        point = dict(shape=name, tokens=tokens, routing=routing, calls=calls, repeats=repeats, impls={})
        for fn in impls.values():
            for _ in range(3):  # compile and warm every lazy set-up
                fn()
        torch.cuda.synchronize()
        host, drained = {impl: [] for impl in impls}, {impl: [] for impl in impls}
        for _ in range(repeats):
            for impl, fn in impls.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                host[impl].append((time.perf_counter() - t0) / calls * 1e6)
                torch.cuda.synchronize()
                drained[impl].append((time.perf_counter() - t0) / calls * 1e6)
        for impl, fn in impls.items():
            host_us, drained_us = statistics.median(host[impl]), statistics.median(drained[impl])
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            table = host_profile_rows(pstats.Stats(prof).stats, calls)
            point["impls"][impl] = dict(host_us=host_us, host_us_repeats=host[impl], host_and_drain_us=drained_us, **table)
            top = "; ".join(f"{r['function']} {r['own_us']:.1f}" for r in table["own"][:8])
            log(f"HOST {name:16s} T={tokens:5d} {routing:7s} {impl:8s} {host_us:6.1f} us/call on the host "
                f"(repeats {min(host[impl]):.1f}-{max(host[impl]):.1f}; {drained_us:6.1f} with the GPU drained); "
                f"own time under cProfile, us/call: {top}")
        results.append(point)
        del w13, w2
        torch.cuda.empty_cache()
    return results


def decode_item_bytes(records: torch.Tensor, gemm1_items: int, hidden: int, inter: int, elem_bytes=2) -> torch.Tensor:
    """Weight bytes each work item of a recorded one-launch decode call read, from its record's
    columns (GEMM1 items, the first ``gemm1_items``: gate and up rows of ``hidden``; GEMM2's:
    rows of ``inter``), for ``timeline_summary``."""
    cols = records[:, 4].to(torch.float64)
    depth = torch.full_like(cols, float(inter))
    depth[:gemm1_items] = 2.0 * hidden
    return cols * depth * elem_bytes


def timeline_summary(records: torch.Tensor, item_bytes: torch.Tensor, gemm1_items: int, bin_us: float = 0.5) -> dict:
    """What one decode call's timeline says (``records``: ``TIMELINE_WORDS`` int64 per item, ns).
    Each item's bytes are spread evenly over its [ready, done] span to give the read rate over
    time; ``steady`` is its median over the middle 60% of the call. ``ramp_us``: until the rate
    first reaches 90% of steady; ``tail_us``: after it last does; ``lost_us``: the call's span
    beyond its bytes at the steady rate."""
    rec = records.to(torch.float64)
    used = records[:, 4] > 0
    idx = torch.nonzero(used).flatten()
    t0 = rec[used, 0].min()
    start, ready, done = ((rec[idx, j] - t0) / 1e3 for j in range(3))  # us
    nbytes = item_bytes[idx]
    span = float(done.max())
    nbins = max(1, int(span / bin_us) + 1)
    rate = torch.zeros(nbins, dtype=torch.float64)
    for b0, b1, n in zip(ready.tolist(), done.tolist(), nbytes.tolist()):
        lo, hi = int(b0 / bin_us), max(int(b0 / bin_us), int(b1 / bin_us))
        rate[lo:hi + 1] += n / (hi - lo + 1)
    rate_tb_s = rate / (bin_us * 1e-6) / 1e12
    mid = rate_tb_s[int(0.2 * nbins):max(int(0.2 * nbins) + 1, int(0.8 * nbins))]
    steady = float(mid.median())
    hot = torch.nonzero(rate_tb_s >= 0.9 * steady).flatten()
    ramp = float(hot[0]) * bin_us if len(hot) else span
    tail = span - float(hot[-1] + 1) * bin_us if len(hot) else span
    # The first wave: the items drawn in the call's first microsecond (one per program that started).
    first = start < 1.0
    first_end = float(done[first].max())
    rest_bytes = float(nbytes[~first].sum())
    g2 = idx >= gemm1_items
    wait = (ready - start)[g2]
    busy = float((done - start).sum())
    return dict(span_us=span, bytes=float(nbytes.sum()), steady_tb_s=steady,
                lost_us=span - float(nbytes.sum()) / (steady * 1e12) * 1e6, ramp_us=ramp, tail_us=max(0.0, tail),
                last_draw_us=float(start.max()), items=len(idx), first_wave_us=first_end,
                first_wave_tb_s=float(nbytes[first].sum()) / (first_end * 1e-6) / 1e12,
                rest_tb_s=rest_bytes / ((span - first_end) * 1e-6) / 1e12 if span > first_end else 0.0,
                sms=int(records[used, 3].unique().numel()),
                gemm2_wait_mean_us=float(wait.mean()) if len(wait) else 0.0,
                gemm2_wait_max_us=float(wait.max()) if len(wait) else 0.0,
                gemm2_wait_share=float(wait.sum()) / busy if busy else 0.0)


# How a timeline call starts (``--timeline-start``): after an L2 flush by a 256 MiB write, as the
# benchmark's timed replays by default; after a flush by a 256 MiB read (clean lines); after the
# write flush and one read per 2 MiB of every expert weight, so that the GPU's address translations
# of the weights are warm; or right after the previous call (no flush).
TIMELINE_STARTS = ("cold", "clean", "translations", "warm")


def timeline(shapes, points, seed, log, calls=5, start="cold"):
    """The one-launch decode kernel's own timeline at each (shape, tokens, routing) point: every
    work item's draw, ready and done times from ``%globaltimer`` (``fused_moe_triton(...,
    timeline=...)``), summarized by ``timeline_summary`` per call (each call begun as ``start``
    says, see ``TIMELINE_STARTS``; the median over ``calls`` calls, and each call's). Returns one
    dict per point, with the records of its fastest and its slowest call."""
    from mok_serve.kernels.cuda import moe as tm
    from mok_serve.kernels.cuda.moe import fused_moe_triton

    results = []
    for name, tokens, routing in points:
        s = shapes[name]
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        configs = tm.pick_configs(tokens, K, E, H, I, one_launch=True)
        if not tm.one_launch_decode(*configs):
            log(f"TIMELINE {name} T={tokens}: not a one-launch decode size, skipped")
            continue
        w13, w2, x, tw, ids = point_inputs(s, tokens, routing, seed)
        gemm1_items, gemm2_items = tm.decode_items(tokens * K, E, H, I, configs)
        buf = torch.zeros(gemm1_items + gemm2_items, tm.TIMELINE_WORDS, dtype=torch.int64, device="cuda")
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        expect = fused_moe_triton(x, w13, w2, tw, ids, configs=configs)
        summaries, records_of = [], []
        pages = [w.view(-1)[:: (2 << 20) // w.element_size()] for w in (w13, w2)]
        for _ in range(calls + 1):  # the first call compiles the timeline kernel
            if start == "clean":
                flush.sum()
            elif start != "warm":
                flush.zero_()
            if start == "translations":
                touched = [p.clone() for p in pages]  # noqa: F841 (a gather: one 2-byte read per 2 MiB page)
            buf.zero_()
            out = fused_moe_triton(x, w13, w2, tw, ids, configs=configs, timeline=buf)
            torch.cuda.synchronize()
            records = buf.cpu()
            summaries.append(timeline_summary(records, decode_item_bytes(records, gemm1_items, H, I), gemm1_items))
            records_of.append(records)
        if not torch.equal(out, expect):
            raise AssertionError(f"{name} T={tokens}: the timeline changed the output")
        summaries, records_of = summaries[1:], records_of[1:]
        med = {k: statistics.median(sm[k] for sm in summaries) for k in summaries[0]}
        spans = [sm["span_us"] for sm in summaries]
        fastest, slowest = spans.index(min(spans)), spans.index(max(spans))
        results.append(dict(shape=name, tokens=tokens, routing=routing, start=start, configs=configs, summary=med,
                            calls=summaries, records_fastest=records_of[fastest].tolist(),
                            records_slowest=records_of[slowest].tolist()))
        log(f"TIMELINE {name:16s} T={tokens:5d} {routing:7s} {start:12s} first wave {med['first_wave_us']:5.1f} us at "
            f"{med['first_wave_tb_s']:.2f} TB/s, the rest at {med['rest_tb_s']:.2f}; span {med['span_us']:6.1f} us, "
            f"{med['bytes'] / 1e6:.0f} MB at "
            f"steady {med['steady_tb_s']:.2f} TB/s: lost {med['lost_us']:5.1f} us (ramp {med['ramp_us']:4.1f}, tail "
            f"{med['tail_us']:4.1f}); last draw at {med['last_draw_us']:6.1f} us; {med['items']:.0f} items on "
            f"{med['sms']:.0f} SMs; GEMM2 wait mean {med['gemm2_wait_mean_us']:.1f} max {med['gemm2_wait_max_us']:.1f} "
            f"us, {med['gemm2_wait_share']:.1%} of busy time; span over {len(spans)} calls "
            f"{min(spans):.1f}-{max(spans):.1f} us")
        del w13, w2, flush
        torch.cuda.empty_cache()
    return results


def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:  # noqa: BLE001 - not installed as a distribution (or absent)
        try:
            import vllm

            return vllm.__version__
        except Exception:  # noqa: BLE001
            return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mok-loadtest layer", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="all", help="comma-separated shape names from configs/model_shapes.json")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--routing", default=",".join(DEFAULT_ROUTINGS),
                   help=f"comma-separated, of {', '.join(ROUTINGS)} (default: %(default)s)")
    p.add_argument("--out", default=str(RESULTS), help="folder for layer_bench.{json,md,png}")
    p.add_argument("--name", default="layer_bench", help="file name stem of the results")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--sweep", action="store_true", help="time block-size variants of kittens instead")
    p.add_argument("--sweep-labels", nargs="*", metavar="LABEL", default=None,
                   help="only these variants of the sweep (default: all, e.g. 'default' 'no PDL' 's4')")
    p.add_argument("--sweep-repeats", type=int, default=1, help="time the sweep's variants this many times, interleaved")
    p.add_argument("--sweep-points", nargs="*", metavar="SHAPE:TOKENS[:ROUTING]", default=None,
                   help="the sweep's points, routing uniform unless ':skewed' or ':concentrated' follows (default: "
                   + " ".join(f"{s}:{t}" for s, t, _ in SWEEP_POINTS) + ")")
    p.add_argument("--profile", nargs="*", metavar="SHAPE:TOKENS[:ROUTING]", default=None,
                   help="instead: each kittens kernel's device time per call (torch.profiler) at these points "
                   "(routing as for --sweep-points)")
    p.add_argument("--timeline", nargs="*", metavar="SHAPE:TOKENS[:ROUTING]", default=None,
                   help="instead: the one-launch decode kernel's per-item timeline (%%globaltimer) at these decode "
                   "points: steady read rate, time lost to its ramp and tail, GEMM2 waits")
    p.add_argument("--host-profile", nargs="*", metavar="SHAPE:TOKENS[:ROUTING]", default=None,
                   help="instead: where an eager call's host time goes (cProfile of back-to-back calls), kittens and "
                   "vLLM's fused_experts where vLLM imports, at these points (routing as for --sweep-points)")
    p.add_argument("--host-calls", type=int, default=100, help="calls per timed block of --host-profile (7 blocks per implementation and point)")
    p.add_argument("--l2-flush", choices=L2_FLUSHES, default="write",
                   help="how the L2 is emptied before each timed replay: zero a 256 MiB buffer (write, as "
                   "triton.testing.do_bench; its dirty lines are written back during the replay) or read one (read)")
    p.add_argument("--timeline-start", choices=TIMELINE_STARTS, default="cold",
                   help="how each timeline call starts: after an L2 flush by a write (cold, as the benchmark's "
                   "replays by default) or by a read (clean), after the write flush and one read per 2 MiB page of "
                   "the weights (translations), or right after the previous call (warm)")
    p.add_argument("--timeline-calls", type=int, default=5, help="timeline calls per point (after one that compiles)")
    p.add_argument("--no-clocks", action="store_true",
                   help="do not sample the SM clock (NVML) while timing; the clock column shows '-'")
    p.add_argument("--fp8", action="store_true",
                   help="block-FP8 experts, every shape as for bf16 (results layer_bench_fp8.*); "
                   "with --sweep, the FP8 kernels' variants")
    p.add_argument("--replot", metavar="RESULT.json", default=None,
                   help="rewrite RESULT.md and RESULT.png from an earlier run's JSON (no GPU) and exit")
    history.add_arguments(p)
    args = p.parse_args(argv)
    if args.replot:
        src = pathlib.Path(args.replot)
        data = json.loads(src.read_text())
        for row in data["rows"]:  # judged by today's targets (report.target_ms), whenever it was measured
            row.update(judge(row))
        fp8 = "fp8_tflops" in data["meta"]
        (write_markdown_fp8 if fp8 else write_markdown)(data["meta"], data["rows"], src.with_suffix(".md"))
        write_plot(data["rows"], src.with_suffix(".png"))
        print(f"wrote {src.with_suffix('.md')} and {src.with_suffix('.png')}")
        return 0
    try:  # bad points fail here, before any GPU work
        for key in ("profile", "host_profile", "sweep_points", "timeline"):
            if getattr(args, key):
                setattr(args, key, parse_points(getattr(args, key)))
    except ValueError as exc:
        p.error(str(exc))
    named = (args.profile or []) + (args.host_profile or []) + (args.sweep_points or []) + (args.timeline or [])
    unknown = {pt[0] for pt in named} - set(load_shapes())
    if unknown:
        p.error(f"unknown shape(s) {', '.join(sorted(unknown))}; known: {', '.join(load_shapes())}")
    if not torch.cuda.is_available():
        print("layer benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton
    import transformers

    shapes = load_shapes()
    if args.fp8 and args.name == "layer_bench":
        args.name = "layer_bench_fp8"
    if args.shapes != "all":
        shapes = {k: shapes[k] for k in args.shapes.split(",")}
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_file = open(out / f"{args.name}.log", "a")

    def log(msg):
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    set_l2_flush(args.l2_flush)
    meta = dict(
        l2_flush=args.l2_flush, gpu=torch.cuda.get_device_name(), commit=provenance.git_commit(), date=datetime.datetime.now(datetime.UTC).isoformat(),
        torch=torch.__version__, triton=triton.__version__, transformers=transformers.__version__,
        python=platform.python_version(), sms=torch.cuda.get_device_properties(0).multi_processor_count,
        timing="CUDA graph of each implementation, replay timed by triton.testing.do_bench (median, L2 flushed "
        "before each replay)" if args.l2_flush == "write" else "CUDA graph of each implementation, median replay time, "
        "L2 flushed before each replay by reading 256 MiB (clean lines: no write-back inside the timed replay)",
        peak_flops=PEAK_FLOPS, peak_bytes=PEAK_BYTES, vllm=_vllm_version(),
    )
    # The host profile runs without the sampler: its thread would take the GIL from the timed calls.
    sampled = not (args.no_clocks or args.host_profile)
    clocks = ClockSampler.for_cuda_device(torch.cuda.current_device()) if sampled else ClockSampler(None)
    meta["clock_sampling"] = "NVML every 5 ms" if clocks.available else "off" if not sampled else "unavailable"
    try:
        return run(args, shapes, meta, out, log, clocks)
    finally:
        clocks.stop()


def run(args, shapes, meta, out, log, clocks) -> int:
    t0 = time.time()
    every_shape = load_shapes()  # points named on the command line may be any shape, whatever --shapes or --fp8 select
    if args.profile:
        res = profile(every_shape, args.profile, args.seed, log)
        (out / f"{args.name}_profile.json").write_text(json.dumps(dict(meta=meta, results=res), indent=1))
        return 0
    if args.host_profile:
        res = host_profile(every_shape, args.host_profile, args.seed, log, calls=args.host_calls)
        (out / f"{args.name}_host_profile.json").write_text(json.dumps(dict(meta=meta, results=res), indent=1))
        return 0
    if args.timeline:
        res = timeline(every_shape, args.timeline, args.seed, log, calls=args.timeline_calls, start=args.timeline_start)
        (out / f"{args.name}_timeline.json").write_text(json.dumps(dict(meta=meta, results=res)))
        return 0
    if args.sweep:
        res = sweep(every_shape, sweep_points(args.sweep_points, shapes), args.seed, log, clocks,
                    labels=args.sweep_labels, repeats=args.sweep_repeats, fp8=args.fp8)
        (out / f"{args.name}_sweep.json").write_text(json.dumps(dict(meta=meta, results=res), indent=1))
        history.write(history.sweep_rows(meta, res, "layer_bench_sweep_fp8" if args.fp8 else "layer_bench_sweep"),
                      history.resolve(args), "layer_bench sweep")
        log(f"sweep done in {time.time() - t0:.0f} s")
        return 0
    meta["read_tb_s"] = read_bandwidth()
    if not args.fp8:
        meta["l2_tb_s"] = l2_read_bandwidth()
    log(f"GPU {meta['gpu']}, commit {meta['commit']}, HBM read {meta['read_tb_s']:.2f} TB/s"
        + (f", L2 tile read {meta['l2_tb_s']:.2f} TB/s" if "l2_tb_s" in meta else ""))
    vllm_fm, vllm_version = load_vllm_moe()
    meta["eager_timing"] = (f"one call from Python per timing: L2 flush ({args.l2_flush}), torch.cuda.synchronize(), "
                            f"start event, call, end event; median of {EAGER_CALLS[0]}-{EAGER_CALLS[1]} calls filling "
                            f"~{EAGER_BUDGET_MS:.0f} ms; implementations {', '.join(EAGER_IMPLS)}")
    if vllm_fm is None:
        meta["vllm_absent"] = vllm_version
        log(f"vLLM's fused_experts not importable ({vllm_version}): no vLLM column, eager target not judged")
    else:
        meta["vllm"] = vllm_version
        meta["vllm_config_files"] = {name: vllm_config_file(vllm_fm, s["routed_experts"], s["moe_intermediate"], args.fp8)
                                     for name, s in shapes.items()}
        for name, info in meta["vllm_config_files"].items():
            log(f"vLLM fused_experts config for {name}: {info['text']}")

    def partial(rows):  # keep what was measured if the run is cut short
        (out / f"{args.name}.json").write_text(json.dumps(dict(meta={**meta, "partial": True}, rows=rows), indent=1))

    tokens = [int(t) for t in args.tokens.split(",")]
    if args.fp8:
        meta["fp8_tflops"] = fp8_rate() / 1e12
        log(f"dense FP8 rate {meta['fp8_tflops']:.0f} TFLOP/s")
        rows = bench_rows_fp8(shapes, tokens, args.routing.split(","), args.seed, log, meta["fp8_tflops"] * 1e12, clocks,
                              partial, vllm_fm=vllm_fm)
    else:
        rows = bench_rows(shapes, tokens, args.routing.split(","), args.seed, log, clocks, partial, vllm_fm=vllm_fm)
    meta["seconds"] = time.time() - t0
    judged = [r["eager_target_met"] for r in rows if r.get("eager_target_met") is not None]
    meta["eager_target"] = dict(met=sum(judged), judged=len(judged), rows=len(rows))
    (out / f"{args.name}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    (write_markdown_fp8 if args.fp8 else write_markdown)(meta, rows, out / f"{args.name}.md")
    history.write(history.layer_bench_rows(meta, rows, "layer_bench_fp8" if args.fp8 else "layer_bench"),
                  history.resolve(args), "layer_bench")
    try:
        write_plot(rows, out / f"{args.name}.png")
    except Exception as exc:  # noqa: BLE001
        log(f"plot failed: {exc}")
    correct = f"correct {sum(r['correct'] for r in rows)}/{len(rows)}; " if args.fp8 else ""
    log(f"done in {meta['seconds']:.0f} s; {correct}targets met {sum(r['target_met'] for r in rows)}/{len(rows)}; "
        f"eager target met {sum(judged)}/{len(judged)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
