"""The shared harness of the kernel benchmarks (``layer``, ``ep``): model shapes, inputs, baselines,
timing, correctness and floors.

- shapes and inputs: ``load_shapes`` (``configs/model_shapes.json``), ``random_experts``,
  ``random_fp8_weights``, ``make_routing`` (uniform, skewed or concentrated); the floor of a call, ``floor_of``
  (max of FLOPs over ``PEAK_FLOPS`` and bytes over ``PEAK_BYTES``), and the dense FP8 rate, ``fp8_rate``;
- baselines: ``torch_pipeline``, ``transformers_experts``, the FP8 ``dequantizer`` and
  ``dequantized_pipeline``, and vLLM's own Triton ``fused_experts`` (``load_vllm_moe``, where vLLM
  imports; ``vllm_experts``; the block sizes vLLM picks, ``vllm_config``);
- timing: ``graph_time`` (CUDA-graph replay, L2 flushed as ``set_l2_flush`` says) and
  ``eager_time`` (one call from Python from an idle GPU), ``time_impls`` and ``eager_times`` over a
  dict of implementations;
- correctness before timing: ``rel_err`` against the reference, ``passes`` within ``TOL_BF16`` /
  ``TOL_FP8`` (NaN never passes), ``check_vllm`` (vLLM is timed only where its output passes);
- the deterministic-serving benchmarks' rows (``linear``, ``attention``): ``bench_meta``,
  ``add_ratios``, ``timed_history_rows``.

How the layer benchmark uses them: ``layer``'s docstring.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

from ..gpu_clocks import ClockSampler

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.4e12
ROUTINGS = ("uniform", "skewed", "concentrated")
DEFAULT_ROUTINGS = ROUTINGS  # what a run without --routing measures: every routing

# Relative error norm against the reference within which an output is right: bf16 experts, and FP8
# experts (whose activation quantization adds its own rounding). NaN never passes (``passes``).
TOL_BF16 = 1e-2
TOL_FP8 = 3e-2


def load_shapes() -> dict:
    """The model shapes of ``configs/model_shapes.json`` by name (keys starting with ``_`` are notes)."""
    text = importlib.resources.files("mok_serve.configs").joinpath("model_shapes.json").read_text()
    return {k: v for k, v in json.loads(text).items() if not k.startswith("_")}


# ---------------------------------------------------------------------------------- inputs and floors


def random_experts(E, H, I, gen):
    """bf16 expert weights ``(w13 [E, 2I, H], w2 [E, H, I])``, unit-variance outputs, drawn from ``gen``."""
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16, generator=gen) / H**0.5
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16, generator=gen) / I**0.5
    return w13, w2


# Skewed routing: expert popularity falls as rank ** -SKEW_EXPONENT (Zipf) over a random order.
SKEW_EXPONENT = 1.0


def make_routing(tokens, experts, top_k, routing, gen, device="cuda"):
    """Top-k ``(weights [T, K] summing to 1, int32 ids [T, K])``, distinct experts per token as a
    router's top-k gives: ``uniform``, every expert as popular as any; ``skewed``, popularity falling
    as a power of the expert's rank (``rank ** -SKEW_EXPONENT`` over a random order of the experts,
    each token drawing its top-k without replacement by it: Gumbel top-k), the load of traffic whose
    prompts favour some experts; ``concentrated`` (hot experts), every token to the same ``top_k``
    experts in its own order (the load vLLM's dummy weights gave DeepSeek-V3: every expert busy with
    all the tokens, or idle)."""
    if routing == "concentrated":
        same = torch.randperm(experts, device=device, generator=gen)[:top_k]
        ids = same[torch.rand(tokens, top_k, device=device, generator=gen).argsort(dim=1)]
    elif routing == "skewed":
        order = torch.randperm(experts, device=device, generator=gen)
        log_p = torch.empty(experts, device=device)
        log_p[order] = -SKEW_EXPONENT * torch.log(torch.arange(1, experts + 1, device=device, dtype=torch.float32))
        u = torch.rand(tokens, experts, device=device, generator=gen).clamp_min(1e-20)
        ids = (log_p - torch.log(-torch.log(u))).argsort(dim=1, descending=True)[:, :top_k]
    elif routing == "uniform":
        ids = torch.rand(tokens, experts, device=device, generator=gen).argsort(dim=1)[:, :top_k]
    else:
        raise ValueError(f"routing {routing!r}: one of {', '.join(ROUTINGS)}")
    w = torch.rand(tokens, top_k, device=device, generator=gen)
    return (w / w.sum(-1, keepdim=True)), ids.to(torch.int32)


def floor_of(tokens, hidden, inter, top_k, ids, weight_bytes_per_elem=2.0, peak_flops=PEAK_FLOPS):
    """A call's floor: max(FLOPs / ``peak_flops``, bytes / ``PEAK_BYTES``), bytes = weights of the experts
    ``ids`` touch + activations in and out; with its FLOPs, bytes, experts touched and bound."""
    rows = tokens * top_k
    flops = 6.0 * rows * hidden * inter
    touched = int(torch.unique(ids).numel())
    weight_bytes = touched * 3 * hidden * inter * weight_bytes_per_elem
    act_bytes = 2 * tokens * hidden * 2 + ids.numel() * 8
    nbytes = weight_bytes + act_bytes
    t_flop, t_byte = flops / peak_flops, nbytes / PEAK_BYTES
    return dict(flops=flops, bytes=nbytes, touched=touched, floor_ms=max(t_flop, t_byte) * 1e3,
                bound="weights" if t_byte >= t_flop else "compute")


def random_fp8_weights(experts, n, k, gen, chunk=16):
    """Random bf16 weights (scaled by 1/sqrt(k)) quantized to 128 x 128 FP8 blocks, ``chunk`` experts
    at a time: quantizing Kimi-K2's w13 in one go needs ~90 GB of fp32 temporaries."""
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    parts = [quantize_fp8_blocks(torch.randn(min(chunk, experts - e), n, k, device="cuda", dtype=torch.bfloat16,
                                             generator=gen) / k**0.5) for e in range(0, experts, chunk)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


# ---------------------------------------------------------------------------------- baselines


def torch_pipeline(x, w13, w2, tw, ids):
    """argsort, gather, grouped_mm, SiLU-mul, grouped_mm, weighted scatter-add (no host sync)."""
    tokens, top_k = ids.shape
    num_experts = w13.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    # histc, not bincount: bincount sizes its output from the data (a host sync, not capturable).
    hist_in = flat.int() if flat.is_cuda else flat.float()
    counts = torch.histc(hist_in, bins=num_experts, min=0, max=num_experts - 1)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // top_k
    gu = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    gate, up = gu.chunk(2, dim=-1)
    act = F.silu(gate) * up
    y = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
    y = y.float() * tw.reshape(-1)[order].float().unsqueeze(1)
    out = torch.zeros(tokens, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, tok, y)
    return out.to(x.dtype)


def transformers_experts(w13, w2):
    """transformers' Qwen3-MoE experts module with the grouped_mm implementation, on our weights."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, two_i, H = w13.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=two_i // 2, num_experts=E, hidden_act="silu")
    cfg._experts_implementation = "grouped_mm"
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w13, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w2, requires_grad=False)
    return mod.eval()


def dequantizer(w13q, w13s, w2q, w2s, chunk=16):
    """bf16 buffers for FP8 experts and a function that fills them by dequantizing every expert
    (``chunk`` experts at a time, so the fp32 intermediate stays small): ``(w13, w2, refresh)``."""
    from mok_serve.kernels.fp8 import dequantize_fp8_blocks

    w13 = torch.empty(w13q.shape, dtype=torch.bfloat16, device=w13q.device)
    w2 = torch.empty(w2q.shape, dtype=torch.bfloat16, device=w2q.device)

    def refresh():
        for e in range(0, w13q.shape[0], chunk):
            w13[e : e + chunk] = dequantize_fp8_blocks(w13q[e : e + chunk], w13s[e : e + chunk]).to(torch.bfloat16)
            w2[e : e + chunk] = dequantize_fp8_blocks(w2q[e : e + chunk], w2s[e : e + chunk]).to(torch.bfloat16)

    return w13, w2, refresh


def dequantized_pipeline(w13q, w13s, w2q, w2s, chunk=16):
    """Baseline for FP8 experts: dequantize every expert's weights to bf16 (``dequantizer``), then
    ``torch_pipeline``."""
    w13, w2, refresh = dequantizer(w13q, w13s, w2q, w2s, chunk)

    def run(x, tw, ids):
        refresh()
        return torch_pipeline(x, w13, w2, tw, ids)

    return run


def fp8_rate():
    """Dense FP8 matmul rate (FLOP/s) of ``torch._scaled_mm``, 16384 x 7168 x 4096, for the floor."""
    import triton.testing

    m, k, n = 16384, 7168, 4096
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = triton.testing.do_bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                                 warmup=20, rep=200, return_mode="median")
    return 2.0 * m * n * k / (ms * 1e-3)


# ---------------------------------------------------------------------------------- timing


# How the L2 is emptied before each timed replay (``--l2-flush``): "write" zeroes a 256 MiB buffer
# (triton.testing.do_bench's way), which leaves the L2 full of dirty lines whose write-back to HBM
# falls inside the timed replay; "read" sums a 256 MiB buffer instead and leaves clean lines.
L2_FLUSHES = ("write", "read")
L2_FLUSH = "write"


def set_l2_flush(how: str) -> None:
    """Make ``graph_time`` and ``eager_time`` empty the L2 as ``how`` says, one of ``L2_FLUSHES``."""
    global L2_FLUSH
    if how not in L2_FLUSHES:
        raise ValueError(f"L2 flush {how!r}: one of {', '.join(L2_FLUSHES)}")
    L2_FLUSH = how


def _read_flushed_median_ms(run, warmup_ms, rep_ms):
    """Median ms of ``run`` with the L2 emptied by a 256 MiB read before each call (as do_bench
    times, with a different flush)."""
    cache = torch.ones(64 << 20, dtype=torch.int32, device="cuda")
    est0, est1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    est0.record()
    for _ in range(5):
        cache.sum()
        run()
    est1.record()
    torch.cuda.synchronize()
    per_call = max(est0.elapsed_time(est1) / 5, 1e-3)
    for _ in range(max(1, int(warmup_ms / per_call))):
        run()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(max(1, int(rep_ms / per_call)))]
    for start, end in events:
        cache.sum()
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def graph_time(fn, clocks: ClockSampler | None = None, warmup_ms=10, rep_ms=60):
    """Capture ``fn`` in a CUDA graph and time replays (median ms, L2 flushed as ``L2_FLUSH`` says);
    eager if capture fails. Returns (ms, "graph" or "eager", ``clocks``' summary of the timed
    replays or ``None``)."""
    import triton.testing

    fn()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        run, how = graph.replay, "graph"
    except Exception as exc:  # noqa: BLE001 - report and fall back to eager timing
        print(f"  capture failed ({type(exc).__name__}: {exc}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        run, how = fn, "eager"
    t0 = time.monotonic()
    if L2_FLUSH == "read":
        ms = _read_flushed_median_ms(run, warmup_ms, rep_ms)
    else:
        ms = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    clock = clocks.summary(t0, time.monotonic()) if clocks is not None else None
    return ms, how, clock


def time_impls(impls: dict, clocks: ClockSampler):
    """``graph_time`` of each implementation, in order: (ms, how it was timed, clock summary of its
    timed replays), each a dict by name."""
    times, modes, clock = {}, {}, {}
    for k, f in impls.items():
        times[k], modes[k], clock[k] = graph_time(f, clocks)
    return times, modes, clock


# ---------------------------------------------------------------------------------- vLLM


def load_vllm_moe():
    """vLLM's Triton MoE module (``vllm.model_executor.layers.fused_moe.fused_moe``) and vLLM's
    version, or ``(None, why not)``: the vLLM column is measured only where vLLM imports, and the
    benchmark runs without it."""
    try:
        import vllm
        from vllm.model_executor.layers.fused_moe import fused_moe as fm
    except Exception as exc:  # noqa: BLE001 - any failure to import means no vLLM column
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"
    return fm, vllm.__version__


def vllm_experts(fm, w13, w2, w13_scale=None, w2_scale=None):
    """``run(x, tw, ids)``: vLLM's ``fused_experts`` (the kernel of ``--moe-backend triton``) on our
    weights, whose layouts are vLLM's (w1 ``[E, 2I, H]`` gate rows then up rows, w2 ``[E, H, I]``,
    SiLU-mul). With scales: 128 x 128 block FP8 (``use_fp8_w8a8``, activations quantized per token
    in 1 x 128 groups). vLLM's kernel multiplies each block's partial sums by its scale (w ~= q *
    scale, the checkpoints' ``weight_scale_inv``), which is ``kernels/fp8.py``'s convention, so our
    scales go in as they are."""
    quant = None
    if w13_scale is not None:
        from vllm.model_executor.layers.fused_moe.config import fp8_w8a8_moe_quant_config

        from mok_serve.kernels.fp8 import BLOCK_SHAPE

        quant = fp8_w8a8_moe_quant_config(w1_scale=w13_scale, w2_scale=w2_scale, block_shape=list(BLOCK_SHAPE))
    return lambda x, tw, ids: fm.fused_experts(x, w13, w2, tw, ids, quant_config=quant)


def _vllm_dtype_and_block(fm, fp8):
    """The dtype string and block shape that ``fused_experts_impl`` hands its config lookup for
    bf16 activations with bf16 or block-FP8 weights."""
    from mok_serve.kernels.fp8 import BLOCK_SHAPE

    return fm._get_config_dtype_str(torch.bfloat16, use_fp8_w8a8=fp8), (list(BLOCK_SHAPE) if fp8 else None)


def vllm_config_file(fm, experts, inter, fp8=False) -> dict:
    """Which tuned block-size file vLLM's ``fused_experts`` looks up for a shape on this GPU, by
    vLLM's own functions: ``file`` (``get_config_file_name``; vLLM names it by w2's last dimension,
    the expert intermediate size, and maps every H200 variant to ``NVIDIA_H200``), ``shipped``
    (the file is in vLLM's ``fused_moe/configs``), ``source`` (what vLLM uses, by
    ``get_moe_configs``: "shipped file", "user file" from ``VLLM_TUNED_CONFIG_FOLDER``, or
    "defaults", i.e. ``get_default_config``) and ``text``, a line for the reports."""
    dtype, block = _vllm_dtype_and_block(fm, fp8)
    name = fm.get_config_file_name(experts, inter, dtype, block)
    shipped = (pathlib.Path(fm.__file__).parent / "configs" / name).is_file()
    # try_get_optimal_moe_config passes block sizes 0, 0 without a block shape (same cache key).
    found = fm.get_moe_configs(experts, inter, dtype, *(block or (0, 0))) is not None
    user = fm.envs.VLLM_TUNED_CONFIG_FOLDER
    if not found:
        source, text = "defaults", f"vLLM defaults (no {name})"
    elif user and (pathlib.Path(user) / name).is_file():  # vLLM reads the user's folder first
        source, text = "user file", f"tuned, VLLM_TUNED_CONFIG_FOLDER ({name})"
    else:
        source, text = "shipped file", f"tuned, shipped with vLLM ({name})"
    return dict(file=name, shipped=shipped, source=source, text=text)


def vllm_config(fm, experts, hidden, inter, top_k, tokens, fp8=False) -> dict:
    """``vllm_config_file`` plus ``config``: the block sizes ``fused_experts`` runs with at this
    token count (``try_get_optimal_moe_config``, called as ``fused_experts_impl`` calls it)."""
    dtype, block = _vllm_dtype_and_block(fm, fp8)
    cfg = fm.try_get_optimal_moe_config((experts, 2 * inter, hidden), (experts, hidden, inter), top_k, dtype,
                                        tokens, block_shape=block)
    return {**vllm_config_file(fm, experts, inter, fp8), "config": dict(cfg)}


def check_vllm(impls, errs, ref, tol):
    """Run vLLM's implementation once against ``ref`` and keep it in ``impls`` (to be timed) only
    if its output passes: a wrong output's time means nothing. Sets ``errs["vllm"]`` (NaN if the
    call raised); returns the exception's text or None."""
    try:
        errs["vllm"] = rel_err(impls["vllm"](), ref)
        error = None
    except Exception as exc:  # noqa: BLE001 - reported in the row, the other columns still run
        errs["vllm"], error = float("nan"), f"{type(exc).__name__}: {str(exc)[:200]}"
    if not passes(errs["vllm"], tol):
        del impls["vllm"]
    return error


# ---------------------------------------------------------------------------------- eager timing


# An eager timing lasts about as long as one replay timing (do_bench's rep, 60 ms of calls, host
# included), within these bounds on the number of calls: several hundred at decode sizes, ten at
# 8192 tokens (where eager - replay is within the run-to-run noise of either median anyway).
EAGER_BUDGET_MS = 60.0
EAGER_CALLS = (10, 500)
# The implementations timed eagerly as well as by replay.
EAGER_IMPLS = ("kittens", "vllm")


def eager_time(fn, budget_ms=EAGER_BUDGET_MS, calls=EAGER_CALLS):
    """Median ms of one call of ``fn`` made from Python, no CUDA graph, and the number of calls
    timed. Before each call: the L2 flush the replays' timing uses (``L2_FLUSH``), then
    ``torch.cuda.synchronize()``, so the GPU is idle when the start event is recorded and the
    host's work until the call's kernels are queued (argument checks, dispatch, launches, any
    host sync inside) lies between the start and end events; a graph replay skips it. The number
    of calls fills ``budget_ms`` of wall time, bounded by ``calls``."""
    flush_buf = torch.ones(64 << 20, dtype=torch.int32, device="cuda")  # 256 MiB, as do_bench's
    flush = flush_buf.sum if L2_FLUSH == "read" else flush_buf.zero_

    def synced_call():
        flush()
        torch.cuda.synchronize()
        fn()

    synced_call()  # warm: lazy set-up of the first eager call after the graph capture
    t0 = time.perf_counter()
    for _ in range(3):
        synced_call()
    torch.cuda.synchronize()
    n = eager_call_count((time.perf_counter() - t0) / 3 * 1e3, budget_ms, calls)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        flush()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events), n


def eager_call_count(per_call_ms, budget_ms=EAGER_BUDGET_MS, calls=EAGER_CALLS) -> int:
    """How many calls ``eager_time`` times: as many as fill ``budget_ms`` at ``per_call_ms`` of
    wall time each (flush and synchronize included), within ``calls``."""
    return min(calls[1], max(calls[0], int(budget_ms / max(per_call_ms, 1e-6))))


def eager_times(impls):
    """``eager_time`` of those of ``EAGER_IMPLS`` in ``impls``: (ms, calls), each a dict by name."""
    got = {k: eager_time(impls[k]) for k in EAGER_IMPLS if k in impls}
    return {k: ms for k, (ms, _) in got.items()}, {k: n for k, (_, n) in got.items()}


# ---------------------------------------------------------------------------------- correctness


def rel_err(out, ref):
    """Relative error norm of ``out`` against ``ref`` (in fp32); NaN where ``out`` has a NaN."""
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def passes(err, tol) -> bool:
    """An output within ``tol`` of the reference (relative error norm); NaN never passes."""
    return math.isfinite(err) and err <= tol


# ---------------------------------------------------------------------------------- HBM rate


def read_bandwidth():
    """HBM read rate of a plain reduction over 4 GiB (TB/s), for the record."""
    import triton.testing

    buf = torch.ones(2**31, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: buf.sum(dtype=torch.float32), warmup=10, rep=100, return_mode="median")
    del buf
    torch.cuda.empty_cache()
    return buf_bytes(2**31, 2) / (ms * 1e-3) / 1e12


def buf_bytes(n, size):
    return n * size


# --------------------------------------------------- the deterministic-serving benchmarks' rows


def bench_meta(timing: str) -> dict:
    """Where and with what a benchmark ran: GPU, commit, date, torch / Triton / vLLM versions (vLLM
    None where it does not import), the floor's peak rates and ``timing`` (how times were taken)."""
    import datetime

    import triton

    from .. import provenance

    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    return dict(gpu=torch.cuda.get_device_name(), commit=provenance.git_commit(),
                date=datetime.datetime.now(datetime.UTC).isoformat(), torch=torch.__version__,
                triton=triton.__version__, vllm=vllm_version, peak_flops=PEAK_FLOPS, peak_bytes=PEAK_BYTES,
                timing=timing)


def add_ratios(row: dict, names) -> None:
    """``kittens_x_floor`` and ``speedup_vs_<name>`` (the provider's time over kittens') of a row of
    ``<name>_ms`` times, where kittens' and the provider's were timed."""
    if row.get("kittens_ms") is None:
        return
    row["kittens_x_floor"] = row["kittens_ms"] / row["floor_ms"]
    for name in names:
        if name != "kittens" and row.get(f"{name}_ms") is not None:
            row[f"speedup_vs_{name}"] = row[f"{name}_ms"] / row["kittens_ms"]


def timed_history_rows(meta: dict, rows: list[dict], names, benchmark: str, shape_of, load_of) -> list[dict]:
    """``history.csv`` rows of such a benchmark: each timed provider's time and the floor, per row
    (``shape_of(row)``, ``load_of(row)``: its shape and token/row count columns)."""
    common = dict(date=meta["date"][:19], commit=meta["commit"], benchmark=benchmark, gpu=meta["gpu"],
                  versions=f"torch={meta['torch']} triton={meta['triton']} vllm={meta['vllm']}", routing="", config="",
                  source="")
    out = []
    for r in rows:
        base = dict(common, shape=shape_of(r), tokens_or_load=load_of(r))
        out += [dict(base, provider=n, metric="time_ms", value=r[f"{n}_ms"], unit="ms")
                for n in names if r.get(f"{n}_ms") is not None]
        out.append(dict(base, provider="floor", metric="floor_ms", value=r["floor_ms"], unit="ms"))
    return out
