"""CPU MoE layer benchmark: kittens' C++ kernel against stock vLLM's CPU MoE, in one process.

For each tiny model family of ``mok_serve.tiny_models`` (its routed-expert shape: hidden size,
``moe_intermediate_size``, expert count, top-k; bf16), each token count and each thread count, it
times, alternating in the same process:

- ``kittens``: ``torch.ops.mok_serve.fused_moe`` (the op ``--moe-backend kittens`` calls on the CPU),
  on the ISA the kernel picked for this CPU (``cpu_moe.isa()``), weights kept as the vLLM glue keeps
  them (transposed views of contiguous ``[E, H, 2I]`` / ``[E, I, H]`` tensors);
- ``kittens-generic``: the same op forced to the generic (AVX2-sized) path, for information;
- ``stock``: vLLM's compiled CPU fused-MoE op, ``torch.ops._C.cpu_fused_moe``, called as
  ``CPUUnquantizedExperts.apply`` calls it, on weights prepacked by ``cpu_prepack_moe_weight`` with
  the ISA vLLM's experts class would use here (``amx`` where torch reports AMX tiles, else ``vec``),
  writing into a preallocated output.

Routing: random top-k of softmaxed random router logits (int32 ids, fp32 weights, as vLLM passes
them). Before timing, kittens' output is checked against stock's (relative error <= 2e-2).

Timing: calls in batches filling about ``--batch-ms`` each, with Python's GC off; per round one
batch of each backend, in an order that rotates every round; ``--rounds`` rounds. Per backend and
point: the median and the minimum over rounds of the per-call time. Other processes on the machine
disturb the times (the 2-thread points most, as OpenMP threads wait for each other): the minimum
is the undisturbed cost, the median what a call met; the load average is recorded.

Results: ``<out>/<name>.csv`` (long format: shape, tokens, threads, backend, median_us, min_us,
commit, cpu) and ``<out>/<name>.md`` (tables, kittens/stock ratios, the <= 1.2x target at 1-64
tokens). ``main(argv)`` is the entry point: ``python -m mok_serve.loadtest.bench.cpu_layer --help``.

``--server``: the whole server instead, per family: ``mok-serve`` (kittens) and ``mok-serve
--moe-backend auto`` (stock) started one at a time with vLLM's CPU setup, a few warm-up requests,
a reset of the layer statistics, then ``--server-requests`` greedy completions of 64 tokens
(``ignore_eos``) at each concurrency of ``--server-concurrency``, the pair ``--server-repeats`` times, and ``GET /v1/kittens/layers``
after each: per MoE layer the calls, tokens and latency mean / p50 (the timer marks around the MoE
method, kittens' two more than stock's; ``server/README.md``). Written to ``<name>_server.csv`` and
``.md``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

from .. import history

RESULTS = Path(__file__).parent.parent / "results"
FAMILIES = ("qwen3_moe", "deepseek_v3", "glm4_moe")
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TARGET_TOKENS = (1, 2, 4, 8, 16, 32, 64)
TARGET = 1.2
THREADS = (1, 2)
BACKENDS = ("kittens", "stock", "kittens-generic")
TOL = 2e-2


def family_shape(name: str) -> dict:
    from mok_serve.tiny_models import FAMILIES as ALL

    c = ALL[name].config
    return dict(
        hidden=c["hidden_size"],
        inter=c["moe_intermediate_size"],
        experts=c.get("num_experts") or c["n_routed_experts"],
        top_k=c["num_experts_per_tok"],
    )


def cpu_description() -> tuple[str, str]:
    """(model name, the vector-ISA flags of /proc/cpuinfo) of this CPU."""
    model, flags = platform.processor() or platform.machine(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in (platform.processor(), platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "amx")
                    flags = " ".join(f for f in line.split(":", 1)[1].split() if f.startswith(wanted))
    except OSError:
        pass
    return model, flags


def commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "loadtest/bench/cpu_layer.py"],
                               cwd=root, capture_output=True, text=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def stock_isa() -> str:
    """The ISA vLLM's unquantized CPU experts class uses on this CPU (X86CPUUnquantizedExperts: AMX)."""
    return "amx" if torch.cpu._is_amx_tile_supported() else "vec"


def make_point(shape: dict, tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, i, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    x = torch.randn(tokens, h, generator=g).bfloat16()
    w13 = (torch.randn(e, 2 * i, h, generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, generator=g) / i**0.5).bfloat16()
    weights, ids = torch.topk(torch.randn(tokens, e, generator=g).softmax(-1), k)
    return x, w13, w2, weights.float().contiguous(), ids.to(torch.int32).contiguous()


def backends(x, w13, w2, weights, ids):
    """{name: zero-argument call} for the three backends on one point, checked against each other."""
    from vllm import _custom_ops as ops

    from mok_serve.kernels.cpu import moe as cpu_moe

    isa = stock_isa()
    p13, p2 = ops.cpu_prepack_moe_weight(w13, isa), ops.cpu_prepack_moe_weight(w2, isa)
    out = torch.empty_like(x)
    k13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    k2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
    kittens_op = torch.ops.mok_serve.fused_moe.default
    stock_op = torch.ops._C.cpu_fused_moe
    best, set_isa = cpu_moe.isa(), torch.ops.mok_serve_cpu.set_isa

    def stock():
        stock_op(out, x, p13, p2, None, None, weights, ids, False, "silu", isa)
        return out

    def kittens():
        return kittens_op(x, k13, k2, weights, ids, None, "silu")

    def kittens_generic():
        set_isa("generic")
        try:
            return kittens_op(x, k13, k2, weights, ids, None, "silu")
        finally:
            set_isa(best)

    want = stock().double()
    for name, fn in (("kittens", kittens), ("kittens-generic", kittens_generic)):
        got = fn().double()
        err = ((got - want).norm() / want.norm()).item()
        if not err <= TOL:
            raise AssertionError(f"{name} differs from stock: relative error {err:.3g} > {TOL}")
    return {"kittens": kittens, "stock": stock, "kittens-generic": kittens_generic}


def time_point(fns: dict, rounds: int, batch_ms: float) -> dict[str, tuple[float, float]]:
    """{name: (median_us, min_us)} per call, alternating the backends round by round."""
    names = list(fns)
    calls = {}
    for name in names:  # warm up, and size each backend's batch to about batch_ms
        fn = fns[name]
        for _ in range(5):
            fn()
        t0 = time.perf_counter()
        n = 0
        while time.perf_counter() - t0 < batch_ms / 1e3 / 2:
            fn()
            n += 1
        calls[name] = max(3, int(n * 2))
    per_call = {name: [] for name in names}
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                fn, n = fns[name], calls[name]
                t0 = time.perf_counter_ns()
                for _ in range(n):
                    fn()
                per_call[name].append((time.perf_counter_ns() - t0) / n / 1e3)
    finally:
        if gc_was:
            gc.enable()
    return {name: (statistics.median(v), min(v)) for name, v in per_call.items()}


def write_md(path: Path, rows: list[dict], meta: dict) -> None:
    def get(shape, tokens, threads, backend):
        return next(r for r in rows if (r["shape"], r["tokens"], r["threads"], r["backend"]) ==
                    (shape, tokens, threads, backend))

    lines = [
        "# CPU MoE layer: kittens vs stock vLLM, per call",
        "",
        f"CPU: {meta['cpu']} ({meta['cores']} cores; flags: {meta['flags']}). Commit {meta['commit']}, "
        f"torch {meta['torch']}, vLLM {meta['vllm']}. kittens ISA: {meta['kittens_isa']}; stock: "
        f"`cpu_fused_moe` ISA `{meta['stock_isa']}` on prepacked weights. bf16, random routing. "
        f"{meta['rounds']} alternating rounds of ~{meta['batch_ms']:g} ms batches per backend and point. "
        f"Load average before / after: {meta['load_before']} / {meta['load_after']}.",
        "",
        "Times in microseconds per call, median (min) over rounds; ratio = kittens / stock, of the medians "
        f"and of the minima. Target: <= {TARGET}x at {TARGET_TOKENS[0]}-{TARGET_TOKENS[-1]} tokens.",
        "",
    ]
    misses, in_target = [], []
    for shape in meta["shapes"]:
        s = meta["shape_dims"][shape]
        lines += [f"## {shape} (hidden {s['hidden']}, moe_intermediate {s['inter']}, {s['experts']} experts, "
                  f"top-{s['top_k']})", "",
                  "| tokens | threads | kittens | stock | kittens / stock (median) | (min) | kittens generic |",
                  "|---|---|---|---|---|---|---|"]
        for threads in meta["threads"]:
            for tokens in meta["tokens"]:
                k, st, gen = (get(shape, tokens, threads, b) for b in BACKENDS)
                ratio, ratio_min = k["median_us"] / st["median_us"], k["min_us"] / st["min_us"]
                lines.append(f"| {tokens} | {threads} | {k['median_us']:.1f} ({k['min_us']:.1f}) | "
                             f"{st['median_us']:.1f} ({st['min_us']:.1f}) | {ratio:.2f} | {ratio_min:.2f} | "
                             f"{gen['median_us']:.1f} ({gen['min_us']:.1f}) |")
                if tokens in TARGET_TOKENS:
                    in_target.append((ratio, ratio_min, shape, tokens, threads))
                if tokens in TARGET_TOKENS and min(ratio, ratio_min) > TARGET:
                    misses.append(f"{shape}, {tokens} tokens, {threads} thread(s): {ratio:.2f}x median, "
                                  f"{ratio_min:.2f}x min")
        lines.append("")
    lines += ["## Target", ""]
    if in_target:
        worst, worst_min = max(in_target), max(in_target, key=lambda t: t[1])
        lines += [f"Highest kittens / stock at {TARGET_TOKENS[0]}-{TARGET_TOKENS[-1]} tokens: {worst[0]:.2f} of the "
                  f"medians ({worst[2]}, {worst[3]} tokens, {worst[4]} thread(s)), {worst_min[1]:.2f} of the minima "
                  f"({worst_min[2]}, {worst_min[3]} tokens, {worst_min[4]} thread(s)).", ""]
    if misses:
        lines += ["Missed (both the median and the min ratio above the target):", ""] + [f"- {m}" for m in misses]
    else:
        lines.append(f"Met at every point of {TARGET_TOKENS[0]}-{TARGET_TOKENS[-1]} tokens (median or min ratio "
                     f"<= {TARGET}).")
    path.write_text("\n".join(lines) + "\n")


PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


def http_json(url: str, body: dict | None = None, timeout: float = 600) -> dict:
    import json
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def server_runs(family: str, backend: str, concurrencies: list[int], requests: int, run: int) -> list[dict]:
    """Per concurrency: the MoE layers' calls, tokens and latency from /v1/kittens/layers."""
    from concurrent.futures import ThreadPoolExecutor

    from mok_serve.server_process import ServerProcess
    from mok_serve.tiny_models import served_name

    model = served_name(family)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    rows = []
    with ServerProcess(["--tiny-family", family, "--moe-backend", backend, "--max-model-len", "1024"]) as server:
        for _ in range(3):
            http_json(f"{server.url}/v1/completions", body)
        for c in concurrencies:
            http_json(f"{server.url}/v1/kittens/layers/reset", {})
            t0 = time.perf_counter()
            with ThreadPoolExecutor(c) as pool:
                list(pool.map(lambda _: http_json(f"{server.url}/v1/completions", body), range(requests)))
            wall = time.perf_counter() - t0
            doc = http_json(f"{server.url}/v1/kittens/layers")
            for layer in doc["layers"]:
                for rank in layer["ranks"]:
                    lat = rank["latency_ms"] or {}
                    rows.append(dict(shape=family, run=run, backend=doc["backend"], concurrency=c,
                                     layer=layer["index"],
                                     calls=rank["calls"], tokens=rank["tokens"],
                                     mean_ms=round(lat.get("mean", float("nan")), 4),
                                     p50_ms=round(lat.get("p50", float("nan")), 4),
                                     experts_class=rank["experts_class"], wall_s=round(wall, 2)))
            print(f"{family} run {run} {doc['backend']:16s} c={c}: " + ", ".join(
                f"layer {r['layer']} {r['mean_ms']:.3f} ms mean / {r['p50_ms']:.3f} p50 over {r['calls']} calls"
                for r in rows if r["concurrency"] == c), flush=True)
    return rows


def server_main(args, shapes: list[str], rev: str, model: str, flags: str) -> int:
    concurrencies = [int(c) for c in args.server_concurrency.split(",")]
    load_before = " ".join(f"{v:.2f}" for v in os.getloadavg())
    rows = []
    for family in shapes:
        for run in range(args.server_repeats):  # kittens, stock, kittens, stock, ...
            for backend in ("kittens", "auto"):
                rows += server_runs(family, backend, concurrencies, args.server_requests, run)
    load_after = " ".join(f"{v:.2f}" for v in os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = (args.name or f"cpu_layer_bench_{rev}") + "_server"
    fields = ["shape", "run", "backend", "concurrency", "layer", "calls", "tokens", "mean_ms", "p50_ms", "experts_class",
              "wall_s"]
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields + ["commit", "cpu"])
        w.writeheader()
        w.writerows({**r, "commit": rev, "cpu": model} for r in rows)
    lines = ["# CPU MoE layer inside the server: kittens vs stock", "",
             f"CPU: {model} ({os.cpu_count()} cores; flags: {flags}). Commit {rev}. Tiny models, `mok-serve` with "
             f"vLLM's CPU setup, servers one at a time, kittens then stock, {args.server_repeats} time(s) per "
             f"family; {args.server_requests} greedy completions of 64 tokens "
             f"per concurrency after 3 warm-up requests and a reset. Per MoE layer from `GET /v1/kittens/layers` "
             f"(timer marks around the MoE method: kittens has two more per layer than stock). Load average "
             f"before / after: {load_before} / {load_after}.", "",
             "Summary: per family, concurrency and run, the MoE layer's mean latency averaged over the layers, "
             "and the tokens per call. A ratio is given only where both servers' calls carried about the same "
             "tokens (within 10%): with several requests in flight the two servers may batch them differently "
             "(the scheduler sees them arrive at different moments), and a call of 12 tokens costs more than one "
             "of 2.", "",
             "| family | concurrency | run | kittens mean ms (tokens / call) | stock mean ms (tokens / call) | "
             "kittens / stock |",
             "|---|---|---|---|---|---|"]
    for family in shapes:
        for c in concurrencies:
            for run in range(args.server_repeats):
                sel = {kind: [r for r in rows if r["shape"] == family and r["concurrency"] == c and r["run"] == run
                              and r["backend"].startswith(kind)] for kind in ("kittens", "stock")}
                mean = {k: sum(r["mean_ms"] for r in v) / len(v) for k, v in sel.items()}
                tpc = {k: sum(r["tokens"] for r in v) / max(1, sum(r["calls"] for r in v)) for k, v in sel.items()}
                same = abs(tpc["kittens"] - tpc["stock"]) <= 0.1 * max(tpc.values())
                ratio = f"{mean['kittens'] / mean['stock']:.2f}" if same else "not comparable"
                lines.append(f"| {family} | {c} | {run} | {mean['kittens']:.3f} ({tpc['kittens']:.2f}) | "
                             f"{mean['stock']:.3f} ({tpc['stock']:.2f}) | {ratio} |")
    lines += ["", "Every run and layer:", "",
             "| family | run | concurrency | backend | layer | calls | tokens / call | mean ms | p50 ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (shapes.index(r["shape"]), r["concurrency"], r["run"])):
        lines.append(f"| {r['shape']} | {r['run']} | {r['concurrency']} | {r['backend']} | {r['layer']} | {r['calls']} | "
                     f"{r['tokens'] / max(1, r['calls']):.2f} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / name}.csv and .md")
    history.write(history.cpu_server_rows(_history_meta(rev, model), rows), history.resolve(args), "cpu_layer_bench")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_serve.loadtest.bench.cpu_layer", description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(FAMILIES), help="tiny model families (mok_serve.tiny_models)")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--threads", default=",".join(map(str, THREADS)))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--batch-ms", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--name", default=None, help="file name stem (default cpu_layer_bench_<commit>)")
    p.add_argument("--server", action="store_true", help="time the MoE layers inside real servers instead")
    p.add_argument("--server-concurrency", default="1,8")
    p.add_argument("--server-requests", type=int, default=16)
    p.add_argument("--server-repeats", type=int, default=2, help="kittens/stock server pairs per family")
    history.add_arguments(p)
    args = p.parse_args(argv)
    if args.server:
        shapes = args.shapes.split(",")
        model, flags = cpu_description()
        return server_main(args, shapes, commit(), model, flags)

    from mok_serve.kernels.cpu import moe as cpu_moe

    if not cpu_moe.available():
        raise SystemExit("the kittens CPU kernel cannot be built here")
    import vllm

    shapes = args.shapes.split(",")
    tokens_list = [int(t) for t in args.tokens.split(",")]
    threads_list = [int(t) for t in args.threads.split(",")]
    model, flags = cpu_description()
    rev = commit()
    meta = dict(cpu=model, flags=flags, cores=os.cpu_count(), commit=rev, torch=torch.__version__,
                vllm=vllm.__version__, kittens_isa=cpu_moe.isa(), stock_isa=stock_isa(), rounds=args.rounds,
                batch_ms=args.batch_ms, shapes=shapes, tokens=tokens_list, threads=threads_list,
                shape_dims={s: family_shape(s) for s in shapes},
                load_before=" ".join(f"{v:.2f}" for v in os.getloadavg()))
    rows = []
    before = torch.get_num_threads()
    try:
        for shape in shapes:
            for tokens in tokens_list:
                fns = backends(*make_point(meta["shape_dims"][shape], tokens, args.seed))
                for threads in threads_list:
                    torch.set_num_threads(threads)
                    for backend, (med, mn) in time_point(fns, args.rounds, args.batch_ms).items():
                        rows.append(dict(shape=shape, tokens=tokens, threads=threads, backend=backend,
                                         median_us=round(med, 2), min_us=round(mn, 2), commit=rev, cpu=model))
                    k, st = rows[-3], rows[-2]
                    print(f"{shape:12s} T={tokens:4d} threads={threads}  kittens {k['median_us']:8.1f} "
                          f"({k['min_us']:8.1f})  stock {st['median_us']:8.1f} ({st['min_us']:8.1f})  "
                          f"ratio {k['median_us'] / st['median_us']:.2f} ({k['min_us'] / st['min_us']:.2f})",
                          flush=True)
    finally:
        torch.set_num_threads(before)
    meta["load_after"] = " ".join(f"{v:.2f}" for v in os.getloadavg())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"cpu_layer_bench_{rev}"
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["shape", "tokens", "threads", "backend", "median_us", "min_us", "commit",
                                          "cpu"])
        w.writeheader()
        w.writerows(rows)
    write_md(out / f"{name}.md", rows, meta)
    print(f"wrote {out / name}.csv and .md")
    history.write(history.cpu_layer_bench_rows({**_history_meta(rev, model), **meta}, rows), history.resolve(args),
                  "cpu_layer_bench")
    return 0


def _history_meta(rev: str, model: str) -> dict:
    """The run's date, commit, CPU and versions for ``history`` rows."""
    try:
        import vllm

        vllm_version = vllm.__version__
    except ImportError:
        vllm_version = None
    return dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), commit=rev, cpu=model,
                torch=torch.__version__, vllm=vllm_version)


if __name__ == "__main__":
    raise SystemExit(main())
