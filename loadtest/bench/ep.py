"""Expert-parallel MoE layer benchmark on N GPUs: kittens EP (pull and push return) against NCCL
baselines and the floor. Spawns one process per GPU (NCCL group, NVLink multicast off).

Per model shape of ``configs/model_shapes.json``, tokens per rank and routing (uniform, or skewed:
expert popularity falling as a power of its rank, ``harness.make_routing``), in the same run:

- kittens-pull / kittens-push: ``SymmetricMemoryEPWorkspace.fused_moe`` (workspace sized to the
  row's tokens per rank), captured in a CUDA graph; and (bf16) rows in GEMM1: pull return with
  GEMM1's tiles pulling the token rows and starting as they arrive (``pull_in_gemm1=True``), against
  the default, which pulls every row in a kernel before GEMM1;
- kittens-pull with every kernel launched the ordinary way (``MOK_PDL=0``) instead of with
  programmatic dependent launch, its own table;
- a2a: NCCL ``all_to_all_single`` of every (token, k) row (split sizes exchanged first: a host
  sync), argsort, ``torch._grouped_mm`` x2, ``all_to_all_single`` back, fp32 weighted sum;
- agrs: all-gather tokens, local experts (grouped_mm) over the gathered rows they own,
  reduce-scatter (vLLM's ``allgather_reducescatter``).

Time = median over iterations of the max across ranks (each iteration starts after a barrier).
Floor = max over ranks of max(FLOPs / 790e12, HBM bytes / 4.4e12, NVLink bytes in / 3.3e11), with
HBM bytes = local experts touched x 3*H*I*2 + activations, NVLink bytes in = token rows pulled
(each (source, token) once) + results returned to this rank. Achieved NVLink GB/s = that over the
kittens time. Also the device time each kittens variant spends waiting for the COMPUTED
(completion) flags, measured in the wait kernel with %globaltimer.

``--fp8``: block-scaled FP8 experts (e4m3, one fp32 scale per 128 x 128 block; DeepSeek-V3 and
Kimi-K2 by default; results ``ep_bench_fp8.{json,md}``): kittens ``fused_moe_fp8`` on a
``quant="fp8"`` workspace (token rows cross NVLink as e4m3 + 1 x 128 group scales) against the same
baselines on bf16 rows with the experts dequantized to bf16 inside the timed call
(``harness.dequantizer``; ``torch._scaled_grouped_mm`` takes row-wise scales only, not 128 x
128 blocks). Floor with FP8 rates: FLOPs at the dense FP8 rate measured in the run
(``harness.fp8_rate``), 1-byte weights + block scales, pulled rows of H + 4 * H / 128 bytes.
Error limit vs a2a 8e-2 (a2a keeps bf16 activations; kittens quantizes x and the activation).

``--serving-limit N``: a served model's workspace holds the most tokens of any step (vLLM's
``max_num_batched_tokens``), and its decode steps carry far fewer. With N, each row also times
kittens (pull) on a second workspace of N tokens per rank, once sized by that limit (no
``max_tokens_across_ranks``) and once sized by the row's tokens (``max_tokens_across_ranks=T``, what
the vLLM glue passes under data parallelism); a second table compares both with the row's own
workspace.

Writes ``<out>.json``, ``<out>.md`` and ``<out>.png`` (time against tokens per rank, one panel per
shape). ``--replot RESULT.json`` redraws the Markdown and the plot of an earlier run, no GPU needed.

``python -m mok_serve.loadtest.bench.ep --shapes Qwen3-30B-A3B --tokens 1 128 --out results/ep``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import socket
import statistics
import subprocess
import sys
import time
import traceback

import torch

from .. import history
from ..gpu_clocks import ClockSampler, clock_text
from .harness import load_shapes, make_routing

PEAK_FLOPS, PEAK_HBM, PEAK_NVLINK = 790e12, 4.4e12, 3.3e11
TOKENS = (1, 32, 128, 512, 2048, 8192)
ROUTINGS = ("uniform", "skewed")
RESULTS = pathlib.Path(__file__).resolve().parent.parent / "results"

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v


# ---------------------------------------------------------------------------------- baselines


def _grouped_experts(xr, lid, w13, w2):
    """Rows ``xr`` through local experts ``lid`` (-1: skip, output zero) with torch._grouped_mm."""
    import torch.nn.functional as F

    E = w13.shape[0]
    key = torch.where(lid >= 0, lid, E)
    order = torch.argsort(key, stable=True)
    counts = torch.histc(key.int() if key.is_cuda else key.float(), bins=E + 1, min=0, max=E)
    offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
    xs = xr[order]
    gu = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    act = (F.silu(gate.float()) * up.float()).to(xr.dtype)
    ys = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    ys = torch.where((key[order] < E).unsqueeze(1), ys, torch.zeros((), dtype=ys.dtype, device=ys.device))
    y = torch.empty_like(ys)
    y[order] = ys
    return y


def a2a_moe(x, ids, tw, w13, w2, owner, local, world, group):
    import torch.distributed as dist

    T, K = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1).long()
    dest = owner[flat].long()
    order = torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sc, rc = send_counts.tolist(), recv_counts.tolist()
    send_x = x[order // K]
    send_e = local[flat[order]].to(torch.int32)
    recv_x = x.new_empty(sum(rc), H)
    recv_e = send_e.new_empty(sum(rc))
    dist.all_to_all_single(recv_x, send_x, rc, sc, group=group)
    dist.all_to_all_single(recv_e, send_e, rc, sc, group=group)
    y = _grouped_experts(recv_x, recv_e.long(), w13, w2) if sum(rc) else recv_x
    back = x.new_empty(T * K, H)
    dist.all_to_all_single(back, y, sc, rc, group=group)
    res = torch.empty_like(back)
    res[order] = back
    out = (res.view(T, K, H).float() * tw.float().unsqueeze(-1)).sum(1)
    return out.to(x.dtype)


def agrs_moe(x, ids, tw, w13, w2, emap, world, group):
    import torch.distributed as dist

    T, K = ids.shape
    H = x.shape[1]
    gx = x.new_empty(world * T, H)
    gids = ids.new_empty(world * T, K)
    gw = tw.new_empty(world * T, K)
    dist.all_gather_into_tensor(gx, x.contiguous(), group=group)
    dist.all_gather_into_tensor(gids, ids.contiguous(), group=group)
    dist.all_gather_into_tensor(gw, tw.contiguous(), group=group)
    lid = emap[gids.reshape(-1).long()].long()
    tok = torch.arange(world * T * K, device=x.device) // K
    y = _grouped_experts(gx[tok], lid, w13, w2)
    part = torch.zeros(world * T, H, device=x.device, dtype=torch.float32)
    part.index_add_(0, tok, y.float() * gw.reshape(-1, 1).float())
    out = x.new_empty(T, H)
    dist.reduce_scatter_tensor(out, part.to(x.dtype), group=group)
    return out


# ---------------------------------------------------------------------------------- timing


def timed(fn, iters, group, extra=None):
    """Per-iteration ms on this rank (each iteration after a barrier)."""
    import torch.distributed as dist

    times, extras = [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(iters):
        dist.barrier(group=group)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if extra is not None:
            extras.append(extra())
    return times, extras


def as_graph(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


FP8_WEIGHT_BYTES = 1.0 + 4.0 / (128 * 128)  # e4m3 + one fp32 scale per 128 x 128 block


def fp8_row_bytes(hidden):
    """Bytes of one token row posted and pulled as e4m3 with its fp32 1 x 128 group scales."""
    return hidden + 4 * -(-hidden // 128)


def floor_terms(all_ids, owner, world, T, H, I, K, *, peak_flops=PEAK_FLOPS, weight_bytes=2.0, row_bytes=None):
    """Per rank: flops, HBM bytes, NVLink bytes in (pull design's minimal traffic). Defaults are
    bf16; FP8 rows pass the measured FP8 rate, ``FP8_WEIGHT_BYTES`` and ``fp8_row_bytes(H)``."""
    row_bytes = 2 * H if row_bytes is None else row_bytes
    ids = all_ids.view(world, T, K).long()
    own = owner[ids].long()  # [world, T, K]
    terms = []
    for r in range(world):
        rows = int((own == r).sum())
        touched = int(torch.unique(ids[own == r]).numel()) if rows else 0
        pulled = sum(int((own[s] == r).any(dim=1).sum()) for s in range(world) if s != r)
        returned = int((own[r] != r).sum())
        flops = 6.0 * rows * H * I
        hbm = touched * 3 * H * I * weight_bytes + 2 * T * H * 2 + pulled * row_bytes + returned * H * 2
        nv = pulled * row_bytes + returned * H * 2
        terms.append(dict(rows=rows, touched=touched, flops=flops, hbm=hbm, nvlink=nv, peak_flops=peak_flops,
                          floor_ms=max(flops / peak_flops, hbm / PEAK_HBM, nv / PEAK_NVLINK) * 1e3))
    return terms


def make_experts(El, H, I, fp8, gen, chunk=16):
    """This rank's experts: bf16 ``(w13, w2)``, or for FP8 ``(w13q, w2q, w13s, w2s)`` quantized in
    chunks of experts (the fp32 intermediates stay small)."""
    if not fp8:
        w13 = torch.randn(El, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5
        w2 = torch.randn(El, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / I**0.5
        return w13, w2
    from mok_serve.kernels.fp8 import FP8_DTYPE, quantize_fp8_blocks

    w13q = torch.empty(El, 2 * I, H, device="cuda", dtype=FP8_DTYPE)
    w2q = torch.empty(El, H, I, device="cuda", dtype=FP8_DTYPE)
    w13s = torch.empty(El, -(-2 * I // 128), -(-H // 128), device="cuda")
    w2s = torch.empty(El, -(-H // 128), -(-I // 128), device="cuda")
    for e in range(0, El, chunk):
        n = min(chunk, El - e)
        w13q[e : e + n], w13s[e : e + n] = quantize_fp8_blocks(
            torch.randn(n, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5)
        w2q[e : e + n], w2s[e : e + n] = quantize_fp8_blocks(
            torch.randn(n, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / I**0.5)
    return w13q, w2q, w13s, w2s


# ---------------------------------------------------------------------------------- ranks


def rank_main(rank, world, port, work, args, queue):
    """One spawned rank: join the NCCL group, run ``work(rank, world, args)``, report to ``queue``."""
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
        queue.put((rank, None, work(rank, world, args)))
    except BaseException:
        queue.put((rank, traceback.format_exc(), None))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(work, world, args):
    """``work(rank, world, args)`` in one spawned process per GPU (one NCCL group): (results by
    rank of the ranks that finished, error texts of the others). Shared with ``ep_profile``."""
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, work, args, queue)) for r in range(world)]
    for pr in procs:
        pr.start()
    results, errors = {}, []
    for _ in range(world):
        rank, err, got = queue.get()
        if err:
            errors.append(f"rank {rank}:\n{err}")
        else:
            results[rank] = got
    for pr in procs:
        pr.join(60)
    return results, errors


def run_rank(rank, world, args):
    import torch.distributed as dist

    from mok_serve.kernels.cuda.ep import ExpertPlacement, SymmetricMemoryEPWorkspace

    group = dist.group.WORLD
    shapes = load_shapes()
    clocks = ClockSampler.for_cuda_device(rank)
    deadline = time.monotonic() + args.deadline_s
    out_rows = []
    log = (lambda s: print(s, flush=True)) if rank == 0 else (lambda s: None)
    fp8 = args.fp8
    floor_kw = {}
    if fp8:
        from .harness import dequantizer, fp8_rate

        rate = torch.tensor([fp8_rate()], device="cuda", dtype=torch.float64)
        dist.broadcast(rate, 0, group=group)  # rank 0's measured dense FP8 rate for every floor
        floor_kw = dict(peak_flops=float(rate.item()), weight_bytes=FP8_WEIGHT_BYTES)
        log(f"dense FP8 rate (torch._scaled_mm) {rate.item() / 1e12:.0f} TFLOP/s")
    for name in args.shapes:
        s = shapes[name]
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        placement = ExpertPlacement.linear(E, world)
        owner = placement.owner.cuda().long()
        local = placement.local.cuda().long()
        emap = placement.expert_map(rank).cuda().long()
        gen = torch.Generator(device="cuda").manual_seed(args.seed + rank)
        El = E // world
        experts = make_experts(El, H, I, fp8, gen)
        if fp8:
            # Baselines run on bf16 experts dequantized inside every timed call.
            w13, w2, refresh = dequantizer(experts[0], experts[2], experts[1], experts[3])
            floor_kw["row_bytes"] = fp8_row_bytes(H)
        else:
            w13, w2 = experts
            refresh = lambda: None  # noqa: E731
        for T in args.tokens:
            for routing in args.routings:
                if routing == "skewed" and args.skewed_tokens is not None and T not in args.skewed_tokens:
                    continue
                stop = torch.tensor([float(time.monotonic() > deadline)], device="cuda")
                dist.all_reduce(stop, group=group)
                if stop.item() > 0:
                    log(f"deadline reached; skipping {name} T={T} {routing} and later rows")
                    return out_rows
                g2 = torch.Generator(device="cuda").manual_seed(args.seed * 7 + T * 13 + rank + (routing == "skewed"))
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g2)
                tw, ids = make_routing(T, E, K, routing, g2)
                all_ids = ids.new_empty(world * T, K)
                dist.all_gather_into_tensor(all_ids, ids, group=group)
                terms = floor_terms(all_ids.cpu(), placement.owner, world, T, H, I, K, **floor_kw)
                row = dict(shape=name, world=world, tokens=T, routing=routing, experts=E, hidden=H, inter=I, top_k=K,
                           quant="fp8 block 128x128" if fp8 else "bf16")
                ws = ws_limit = None
                try:
                    ws = SymmetricMemoryEPWorkspace(
                        group, max_tokens_per_rank=T, hidden_size=H, top_k=K, dtype=torch.bfloat16,
                        placement=placement, timeout_s=args.timeout_s, quant="fp8" if fp8 else None,
                    )
                    ws_limit = None
                    if args.serving_limit > T:
                        ws_limit = SymmetricMemoryEPWorkspace(
                            group, max_tokens_per_rank=args.serving_limit, hidden_size=H, top_k=K,
                            dtype=torch.bfloat16, placement=placement, timeout_s=args.timeout_s,
                            quant="fp8" if fp8 else None,
                        )

                    def kittens(variant):
                        w, w.return_mode, w.pull_in_gemm1, bound, pdl = variant
                        if fp8:
                            return w.fused_moe_fp8(x, *experts, tw, ids, max_tokens_across_ranks=bound, pdl=pdl)
                        return w.fused_moe(x, w13, w2, tw, ids, max_tokens_across_ranks=bound, pdl=pdl)

                    def a2a():
                        refresh()
                        return a2a_moe(x, ids, tw, w13, w2, owner, local, world, group)

                    def agrs():
                        refresh()
                        return agrs_moe(x, ids, tw, w13, w2, emap, world, group)

                    # (workspace, return mode, rows pulled inside GEMM1, max_tokens_across_ranks,
                    # programmatic dependent launch); the workspace's default pulls every row before
                    # GEMM1 ("gather"); "gemm1pull": GEMM1 tiles pull rows and start as they arrive;
                    # "nopdl": the default with its kernels launched the ordinary way.
                    variants = {"pull": (ws, "pull", False, None, True), "push": (ws, "push", False, None, True),
                                "nopdl": (ws, "pull", False, None, False)}
                    if not fp8:
                        variants["gemm1pull"] = (ws, "pull", True, None, True)
                    if ws_limit is not None:
                        variants["limit"] = (ws_limit, "pull", False, None, True)
                        variants["limit_bounded"] = (ws_limit, "pull", False, T, True)
                    impls = {}
                    res = {}
                    for mode, variant in variants.items():
                        res[mode] = kittens(variant)
                    base_ok = True
                    try:
                        res["a2a"] = a2a()
                        res["agrs"] = agrs()
                    except Exception:  # noqa: BLE001
                        base_ok = False
                        row["baseline_error"] = traceback.format_exc()[-1500:]
                        log(row["baseline_error"])
                        res["a2a"] = res["agrs"] = res["pull"]
                    torch.cuda.synchronize()
                    for w in (ws, ws_limit):
                        if w is not None:
                            w.check_errors()
                    ref = res["a2a"].float()
                    errs = {k: ((v.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item() for k, v in res.items()}
                    errs["variants_equal"] = all(torch.equal(res["pull"], res[m]) for m in variants)
                    times, waits = {}, {}
                    for mode, variant in variants.items():
                        call = lambda variant=variant: kittens(variant)  # noqa: E731
                        try:
                            gr = as_graph(call)
                            fn, how = gr.replay, "graph"
                        except Exception as exc:  # noqa: BLE001
                            log(f"  capture failed ({type(exc).__name__}: {exc}); eager")
                            fn, how = call, "eager"
                        fn()
                        t0 = time.monotonic()
                        t, w = timed(fn, args.iters, group, extra=variant[0].wait_ns)
                        if mode == "pull":  # the default's clock, as the layer benchmark records kittens'
                            row["clock"] = clocks.summary(t0, time.monotonic())
                        times[f"kittens_{mode}"] = t
                        waits[mode] = [c for _, c in w]
                        impls[f"kittens_{mode}"] = how
                        del fn
                        gr = None
                    for w in (ws, ws_limit):
                        if w is not None:
                            w.check_errors()
                    for nm, fn in (("a2a", a2a), ("agrs", agrs)):
                        if not base_ok:
                            times[nm] = [float("nan")] * args.iters
                            continue
                        fn()
                        times[nm], _ = timed(fn, args.iters, group)
                    row.update(errs=errs, times=times, waits_ns=waits, terms=terms, timing=impls)
                except Exception:  # noqa: BLE001
                    row["error"] = traceback.format_exc()[-2000:]
                    log(f"{name} T={T} {routing}: FAILED\n{row['error']}")
                ws = ws_limit = kittens = None
                gc.collect()
                torch.cuda.empty_cache()
                # Aggregate across ranks on rank 0.
                gathered = [None] * world
                dist.all_gather_object(gathered, row, group=group)
                if rank == 0:
                    out_rows.append(summarize(gathered))
                    log(format_row(out_rows[-1]))
        del w13, w2, experts, refresh
        gc.collect()
        torch.cuda.empty_cache()
    clocks.stop()
    return out_rows


def target_ms(row) -> float:
    """The time the issue's target asks of kittens in this row: 1.25x the floor at 128 tokens per
    rank and more, half the best baseline's below."""
    return 1.25 * row["floor_ms"] if row["tokens"] >= 128 else row["best_baseline_ms"] / 2.0


def summarize(per_rank):
    r0 = per_rank[0]
    row = {k: r0[k] for k in ("shape", "world", "tokens", "routing", "experts", "hidden", "inter", "top_k")}
    row["quant"] = r0.get("quant", "bf16")
    errors = [r.get("error") for r in per_rank if r.get("error")]
    if errors:
        row["error"] = errors[0]
        return row
    names = list(r0["times"])
    iters = len(r0["times"][names[0]])
    ms = {}
    for n in names:
        per_iter = [max(r["times"][n][i] for r in per_rank) for i in range(iters)]
        ms[n] = statistics.median(per_iter)
    row["ms"] = ms
    terms = r0["terms"]
    row["floor_ms"] = max(t["floor_ms"] for t in terms)
    row["nvlink_bytes_max"] = max(t["nvlink"] for t in terms)
    row["rows_per_rank"] = [t["rows"] for t in terms]
    bound_t = max(terms, key=lambda t: t["floor_ms"])
    row["bound"] = max((("compute", bound_t["flops"] / bound_t.get("peak_flops", PEAK_FLOPS)), ("hbm", bound_t["hbm"] / PEAK_HBM),
                        ("nvlink", bound_t["nvlink"] / PEAK_NVLINK)), key=lambda p: p[1])[0]
    ranks_clock = [r["clock"] for r in per_rank if r.get("clock")]
    row["clock"] = min(ranks_clock, key=lambda c: c["sm_mhz"]) if ranks_clock else None  # the slowest rank's
    row["wait_us"] = {m: statistics.median([max(r["waits_ns"][m][i] for r in per_rank) for i in range(iters)]) / 1e3
                      for m in r0["waits_ns"]}
    row["rel_err_vs_a2a"] = {k: max(r["errs"][k] for r in per_rank) for k in r0["errs"] if k != "variants_equal"}
    row["variants_equal"] = all(r["errs"]["variants_equal"] for r in per_rank)  # bitwise: pull, push, gather
    best_k = min(ms["kittens_pull"], ms["kittens_push"])
    row["default"] = "pull" if ms["kittens_pull"] <= ms["kittens_push"] else "push"
    row["kittens_ms"] = ms["kittens_pull"]
    row["best_baseline_ms"] = min(ms["a2a"], ms["agrs"])
    row["ratio_to_floor"] = row["kittens_ms"] / row["floor_ms"]
    row["speedup_vs_best_baseline"] = row["best_baseline_ms"] / row["kittens_ms"]
    row["best_kittens_ms"] = best_k
    row["nvlink_GBps"] = row["nvlink_bytes_max"] / (row["kittens_ms"] * 1e-3) / 1e9
    # FP8: a2a keeps bf16 activations (experts dequantized), kittens quantizes x and the activation.
    row["err_limit"] = 8e-2 if row["quant"].startswith("fp8") else 2e-2
    row["peak_flops"] = terms[0].get("peak_flops", PEAK_FLOPS)
    ok = row["rel_err_vs_a2a"]["pull"] <= row["err_limit"] and row["variants_equal"]
    target = "<= 1.25x floor" if row["tokens"] >= 128 else ">= 2x best baseline"
    ok = ok and row["kittens_ms"] <= target_ms(row) and row["speedup_vs_best_baseline"] >= 1.0
    row["target"], row["target_met"] = target, ok
    return row


def format_row(r):
    tag = "FP8 " if r.get("quant", "bf16").startswith("fp8") else ""
    if "error" in r:
        return f"{tag}{r['shape']:16s} T={r['tokens']:5d} {r['routing']:7s} ERROR"
    ms = r["ms"]
    in_gemm1 = f" rows-in-GEMM1 {ms['kittens_gemm1pull']:8.3f}" if "kittens_gemm1pull" in ms else ""
    return (f"{tag}{r['shape']:16s} T={r['tokens']:5d} {r['routing']:7s} pull {ms['kittens_pull']:8.3f} push "
            f"{ms['kittens_push']:8.3f}{in_gemm1} ms floor {r['floor_ms']:7.3f} ({r['bound']:7s}) x{r['ratio_to_floor']:5.2f} "
            f"a2a {ms['a2a']:8.3f} agrs {ms['agrs']:8.3f} best/k x{r['speedup_vs_best_baseline']:5.2f} "
            f"NVL {r['nvlink_GBps']:6.1f} GB/s wait(C) pull {r['wait_us']['pull']:7.1f} push {r['wait_us']['push']:7.1f} us "
            f"err {r['rel_err_vs_a2a']['pull']:.1e} {'OK' if r['target_met'] else 'MISS ' + r['target']}")


EP_CLOCK_NOTE = ("SM clock: the slowest rank's median SM clock (NVML, every 5 ms) while kittens pull was timed, "
                 "and the share of those samples with the software power cap active; - where the timed "
                 "iterations fit between two samples.")


def markdown(rows, meta):
    if meta.get("fp8"):
        head = [f"# Expert-parallel FP8 (block-scaled) layer benchmark ({meta['world']} x {meta['gpu']}, "
                f"commit {meta['commit']})", "",
                "Experts e4m3 with one fp32 scale per 128 x 128 block; kittens posts and pulls token rows as e4m3 "
                "with 1 x 128 group scales (`fused_moe_fp8` on a `quant=\"fp8\"` workspace), results return in "
                "bf16. Baselines (a2a, agrs) move bf16 rows and dequantize every local expert to bf16 inside each "
                "timed call, then `torch._grouped_mm` (`torch._scaled_grouped_mm` takes row-wise scales only, not "
                "128 x 128 blocks). Time: median over iterations of the max across ranks, ms. Floor = max over ranks "
                f"of max(FLOPs / {meta['fp8_tflops']:.0f} TFLOP/s (dense FP8 `torch._scaled_mm`, measured in this "
                "run), HBM bytes / 4.4e12 with 1-byte weights + block scales, NVLink bytes in / 3.3e11 with pulled "
                "rows of H + 4*H/128 bytes). Error limit vs a2a 8e-2 (a2a keeps bf16 activations). wait(C): device "
                "time in the wait for the completion flags. " + EP_CLOCK_NOTE, ""]
    else:
        head = [f"# Expert-parallel layer benchmark ({meta['world']} x {meta['gpu']}, commit {meta['commit']})", "",
                "Time: median over iterations of the max across ranks, ms. Floor = max over ranks of max(FLOPs/790e12, "
                "HBM bytes/4.4e12, NVLink bytes in/3.3e11). kittens = pull return (default; token rows pulled "
                "by a kernel before GEMM1); rows in GEMM1: pull return with GEMM1's tiles pulling the rows and "
                "starting as they arrive (`pull_in_gemm1`). wait(C): device time in the wait for the "
                "completion (COMPUTED) flags, median of the max across ranks. " + EP_CLOCK_NOTE, ""]
    out = head + [
           "| shape | tokens/rank | routing | kittens pull | kittens push | rows in GEMM1 | a2a | agrs | floor (bound) | "
           "x floor | SM clock | best baseline / kittens | NVLink GB/s | wait(C) pull us | wait(C) push us | target |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | error | | | | | | | | | | | | |")
            continue
        ms = r["ms"]
        in_gemm1 = f"{ms['kittens_gemm1pull']:.3f}" if "kittens_gemm1pull" in ms else "-"
        out.append(
            f"| {r['shape']} | {r['tokens']} | {r['routing']} | {ms['kittens_pull']:.3f} | {ms['kittens_push']:.3f} | "
            f"{in_gemm1} | {ms['a2a']:.3f} | {ms['agrs']:.3f} | {r['floor_ms']:.3f} ({r['bound']}) | {r['ratio_to_floor']:.2f} | "
            f"{clock_text(r.get('clock'))} | {r['speedup_vs_best_baseline']:.2f} | {r['nvlink_GBps']:.1f} | {r['wait_us']['pull']:.1f} | "
            f"{r['wait_us']['push']:.1f} | {'met' if r['target_met'] else 'MISS ' + r['target']} |")
    ab = [r for r in rows if "error" not in r and "kittens_nopdl" in r["ms"]]
    if ab:
        out += ["", "## Programmatic dependent launch", "",
                "kittens (pull) as launched by default (every kernel with programmatic dependent launch: the next "
                "kernel's programs start as this one's last programs leave, and wait for its completion) and with "
                "every kernel launched the ordinary way (`MOK_PDL=0`). Same run; outputs bitwise equal.", "",
                "| shape | tokens/rank | routing | PDL ms | ordinary ms | PDL / ordinary |", "|---|---|---|---|---|---|"]
        for r in ab:
            ms = r["ms"]
            out.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {ms['kittens_pull']:.3f} | "
                       f"{ms['kittens_nopdl']:.3f} | {ms['kittens_pull'] / ms['kittens_nopdl']:.3f} |")
    out += _misses_markdown([r for r in rows if "error" not in r and not r["target_met"]])
    served = [r for r in rows if "error" not in r and "kittens_limit" in r["ms"]]
    if served:
        limit = meta["serving_limit"]
        out += ["", f"## On a workspace for {limit} tokens per rank (a served model's decode steps)", "",
                f"kittens (pull) on the row's own workspace, and on one made for {limit} tokens per rank: sized by "
                f"that limit (no `max_tokens_across_ranks`), and sized by the row's tokens "
                f"(`max_tokens_across_ranks` = tokens per rank). Same run; outputs bitwise equal.", "",
                "| shape | tokens/rank | routing | own workspace ms | limit, unbounded ms | limit, bounded ms | "
                "unbounded / own | bounded / own |", "|---|---|---|---|---|---|---|---|"]
        for r in served:
            ms = r["ms"]
            own, lim, bnd = ms["kittens_pull"], ms["kittens_limit"], ms["kittens_limit_bounded"]
            out.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {own:.3f} | {lim:.3f} | {bnd:.3f} | "
                       f"{lim / own:.2f} | {bnd / own:.2f} |")
    return "\n".join(out) + "\n"


def _misses_markdown(misses) -> list[str]:
    """Each missed row: the time its target asks for, by how much kittens misses it, that time
    against the floor (below 1: no implementation can meet it), and the share of kittens' call
    spent waiting for the completion flags."""
    if not misses:
        return []
    out = ["", "## Targets not met: by how much", "",
           "needs x floor below 1 means the target lies below the floor, where no implementation can meet it. "
           "Where the time of the others goes (per-kernel profiles of both ranks): "
           "loadtest/JOURNAL.md#where-the-time-goes-7f0d0a8-2026-11-30, "
           "and git history: `loadtest/results/ep_profile_*.md` at bb4459a.", "",
           "| shape | tokens/rank | routing | target | needs ms | kittens ms | short by | floor ms (bound) | "
           "needs x floor | wait(C) share of the call | reading |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in misses:
        need = target_ms(r)
        wait = r["wait_us"]["pull"] / 1e3 / r["kittens_ms"]
        reading = (f"below the floor ({r['bound']})" if need < r["floor_ms"]
                   else f"kittens at {r['ratio_to_floor']:.2f}x the floor ({r['bound']})")
        out.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | {r['target']} | {need:.3f} | "
                   f"{r['kittens_ms']:.3f} | {100 * (r['kittens_ms'] / need - 1):.1f}% | {r['floor_ms']:.3f} "
                   f"({r['bound']}) | {need / r['floor_ms']:.2f} | {wait:.0%} | {reading} |")
    return out


PLOT_SERIES = (  # (key of row["ms"] or of the row, label, color); kittens in blues, baselines warm, floor black
    ("kittens_pull", "kittens pull", "C0"),
    ("kittens_push", "kittens push", "C9"),
    ("kittens_gemm1pull", "kittens rows in GEMM1", "C2"),
    ("a2a", "a2a (NCCL all_to_all)", "C1"),
    ("agrs", "agrs (all-gather + reduce-scatter)", "C3"),
    ("floor_ms", "floor", "k"),
)


def write_plot(rows, meta, path):
    """Time against tokens per rank, one panel per shape (``report.plot_time_by_shape``)."""
    from .report import plot_time_by_shape

    series = [(label, color, lambda r, key=key: r["ms"].get(key, r.get(key))) for key, label, color in PLOT_SERIES]
    plot_time_by_shape([r for r in rows if "error" not in r], series, path, xlabel="tokens per rank",
                       ylabel="ms (median of the max across ranks)",
                       title=f"EP={meta['world']} x {meta['gpu']}, commit {meta['commit']}")


def write_results(rows, meta, out: pathlib.Path):
    """Writes ``out``.json, .md and .png; returns the Markdown."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    md = markdown(rows, meta)
    out.with_suffix(".md").write_text(md)
    write_plot(rows, meta, out.with_suffix(".png"))
    return md


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--shapes", nargs="*", default=None)
    p.add_argument("--tokens", nargs="*", type=int, default=list(TOKENS))
    p.add_argument("--routings", nargs="*", default=list(ROUTINGS))
    p.add_argument("--skewed-tokens", nargs="*", type=int, default=None,
                   help="token counts that also run skewed routing (default: all)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=30.0)
    p.add_argument("--deadline-s", type=float, default=1e9, help="stop starting new rows after this")
    p.add_argument("--out", default=None, help="results path stem (default results/ep_bench, --fp8: ep_bench_fp8)")
    p.add_argument("--fp8", action="store_true",
                   help="block-FP8 experts (default shapes DeepSeek-V3 Kimi-K2; results ep_bench_fp8.{json,md})")
    p.add_argument("--serving-limit", type=int, default=0, metavar="N",
                   help="also time kittens on a workspace of N tokens per rank, sized by N and by the row's tokens")
    p.add_argument("--replot", metavar="RESULT.json", default=None,
                   help="redraw RESULT.md and RESULT.png from an earlier run's JSON (no GPU) and exit")
    history.add_arguments(p)
    args = p.parse_args(argv)
    if args.replot:
        src = pathlib.Path(args.replot)
        data = json.loads(src.read_text())
        write_results(data["rows"], data["meta"], src.with_suffix(""))
        print(f"wrote {src.with_suffix('.md')} and {src.with_suffix('.png')}")
        return 0
    if args.out is None:
        args.out = str(RESULTS / ("ep_bench_fp8" if args.fp8 else "ep_bench"))
    args.shapes = args.shapes or (["DeepSeek-V3", "Kimi-K2"] if args.fp8 else list(load_shapes()))
    if args.world < 1:
        print("the EP benchmark needs CUDA GPUs (--world >= 1)", file=sys.stderr)
        return 2
    results, errors = run_on_ranks(run_rank, args.world, args)
    rows = results.get(0)
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=pathlib.Path(__file__).parent).stdout.strip() or "?"
    except Exception:  # noqa: BLE001
        commit = "?"
    meta = dict(world=args.world, gpu=torch.cuda.get_device_name(0), commit=os.environ.get("MOK_COMMIT", commit),
                torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"), fp8=args.fp8,
                serving_limit=args.serving_limit)
    if args.fp8:
        rates = [r["peak_flops"] for r in rows or [] if "peak_flops" in r]
        meta["fp8_tflops"] = rates[0] / 1e12 if rates else float("nan")
    if rows is not None:
        print(write_results(rows, meta, pathlib.Path(args.out)))
        history.write(history.ep_bench_rows(meta, rows, "ep_bench_fp8" if args.fp8 else "ep_bench"),
                      history.resolve(args), "ep_bench")
    for e in errors:
        print(e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
