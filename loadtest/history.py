"""Every benchmark result as data: ``loadtest/results/history.csv``, one row per measured value.

Long format (as Liger-Kernel keeps its benchmark results): a run of ``mok-loadtest layer``
(``layer_bench``; with ``--sweep`` ``layer_bench_sweep``), ``ep`` (``ep_bench``), ``cpu_layer_bench``,
``serve`` or ``merge`` appends its rows at the end; past runs' rows were converted from their JSON/CSV
results. Columns (``COLUMNS``):

- ``date`` (ISO time of the run), ``commit`` (``provenance.git_commit``), ``benchmark``
  (``layer_bench``, ``layer_bench_fp8``, ``layer_bench_sweep[_fp8]``, ``ep_bench``, ``ep_bench_fp8``,
  ``cpu_layer_bench``, ``cpu_layer_bench_server``, ``serve``), ``gpu`` (the device; the CPU model for CPU benchmarks),
  ``versions`` (``torch=... triton=... vllm=...``, what the run recorded);
- ``shape`` (model shape of ``configs/model_shapes.json``, tiny family, or served model name),
  ``tokens_or_load`` (x: tokens per call; for serving runs ``c=N`` or ``rate=R``),
  ``routing`` (``uniform``/``skewed``; for serving runs the workload ``IN/OUT`` tokens),
  ``config`` (what else sets the point: ``world=2``, ``threads=4``, ``l2_flush=read``, ...);
- ``provider`` (``kittens``, ``vllm`` = vLLM's Triton ``fused_experts``, ``torch``,
  ``transformers``, ``dequant_torch``, EP variants ``kittens-pull``, ``a2a``, ``agrs``, ...,
  eager variants ``kittens-eager``, ``floor``, and for serving runs the server name, e.g.
  ``kittens``/``stock``), ``metric`` (``time_ms``, ``floor_ms``, ``x_floor``, ``sm_mhz``,
  ``output_tok_s``, ``ttft_p99_ms``, ...), ``value``, ``unit``;
- ``source``: the results file the rows came from (past runs converted from their JSON or CSV;
  the file is in git history where it left ``loadtest/results``), empty for rows appended by a run.

Filter or plot it with pandas, e.g. kittens vs vLLM at one shape::

    df = pd.read_csv("loadtest/results/history.csv")
    df.query("benchmark == 'layer_bench' and shape == 'Qwen3-30B-A3B' and metric == 'time_ms'")

``append(rows, path)`` writes rows (creating the file with its header); ``default_path()`` is the
repository's file only in a checkout (``loadtest/results`` exists beside this module) and never
under pytest, ``resolve(args)`` applies a tool's ``--history PATH`` / ``--no-history``.
"""

from __future__ import annotations

import csv
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

COLUMNS = ("date", "commit", "benchmark", "gpu", "versions", "shape", "tokens_or_load", "routing", "config",
           "provider", "metric", "value", "unit", "source")
RESULTS = Path(__file__).resolve().parent / "results"
HELP = ("append this run's rows to PATH (default: loadtest/results/history.csv when run from a checkout, which "
        "has that folder; elsewhere, and under pytest, no history is written unless PATH is given)")


def default_path() -> Path | None:
    """The repository's ``history.csv`` where this module lies in a checkout, else None; None
    under pytest (``PYTEST_CURRENT_TEST``), so tests never append to the repository's file."""
    if "PYTEST_CURRENT_TEST" in os.environ or not RESULTS.is_dir():
        return None
    return RESULTS / "history.csv"


def add_arguments(parser) -> None:
    """``--history PATH`` and ``--no-history`` on a tool's argument parser."""
    parser.add_argument("--history", default=None, metavar="PATH", help=HELP)
    parser.add_argument("--no-history", action="store_true", help="do not append to any history CSV")


def resolve(args) -> Path | None:
    """Where a tool with ``add_arguments`` appends: None for ``--no-history``."""
    if getattr(args, "no_history", False):
        return None
    return Path(args.history) if getattr(args, "history", None) else default_path()


def versions(env: dict[str, Any]) -> str:
    """``torch=... triton=... vllm=...`` from a run's metadata (those it has)."""
    return " ".join(f"{k}={env[k]}" for k in ("torch", "triton", "vllm") if env.get(k))


def append(rows: Iterable[dict[str, Any]], path: Path | str | None = None) -> int:
    """Append rows (dicts keyed by ``COLUMNS``; missing keys empty) to ``path`` (default
    ``default_path()``; nothing when that is None), writing the header where the file is new or
    empty. Returns the number of rows written."""
    path = default_path() if path is None else Path(path)
    rows = list(rows)
    if path is None or not rows:
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="raise")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in COLUMNS})
    return len(rows)


def write(rows: Iterable[dict[str, Any]], path: Path | None, what: str) -> None:
    """``append`` and say so on stdout (a tool's last step)."""
    if path is not None and (n := append(rows, path)):
        print(f"{what}: {n} rows appended to {path}")


def _date(text: str | None) -> str | None:
    """ISO date-time to the second (``2026-11-30 22:02:13`` and ``...T22:02:13.95+00:00`` alike)."""
    if not text:
        return text
    text = str(text).replace(" ", "T", 1)
    return re.sub(r"\.\d+", "", text, count=1)


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def _row(base: dict[str, Any], provider: str, metric: str, value: Any, unit: str) -> dict[str, Any] | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:  # NaN
        return None
    return {**base, "provider": provider, "metric": metric, "value": value, "unit": unit}


# ------------------------------------------------------------------------------ layer_bench


def layer_bench_rows(meta: dict[str, Any], rows: list[dict[str, Any]], benchmark: str = "layer_bench") -> list[dict]:
    """Rows of a ``layer_bench`` JSON result (``{"meta", "rows"}``, bf16 or ``--fp8``): per row
    each implementation's ``time_ms`` (``kittens``, ``torch``, ``transformers``, ``vllm``,
    ``dequant_torch``; eager calls as ``kittens-eager``/``vllm-eager``), the ``floor``'s
    ``floor_ms``, kittens' ``x_floor``, and the SM clock while kittens was timed (``sm_mhz``)."""
    cfg = f"l2_flush={meta['l2_flush']}" if meta.get("l2_flush") not in (None, "write") else ""
    common = dict(date=_date(meta.get("date") or meta.get("time")), commit=meta.get("commit"), benchmark=benchmark,
                  gpu=meta.get("gpu"), versions=versions(meta), config=cfg)
    out: list[dict | None] = []
    for r in rows:
        base = {**common, "shape": r["shape"], "tokens_or_load": r["tokens"], "routing": r["routing"]}
        for key, value in r.items():
            if not key.endswith("_ms") or key in ("floor_ms", "eager_extra_ms"):
                continue
            name = key[:-3]
            provider = name[:-6] + "-eager" if name.endswith("_eager") else name
            out.append(_row(base, provider, "time_ms", value, "ms"))
        out.append(_row(base, "floor", "floor_ms", r.get("floor_ms"), "ms"))
        out.append(_row(base, "kittens", "x_floor", r.get("ratio_to_floor"), "x"))
        out.append(_row(base, "kittens", "sm_mhz", ((r.get("clock") or {}).get("kittens") or {}).get("sm_mhz"), "MHz"))
    return [r for r in out if r]


def sweep_rows(meta: dict[str, Any], results: list[dict[str, Any]], benchmark: str = "layer_bench_sweep") -> list[dict]:
    """Rows of a ``layer_bench --sweep`` JSON result (``{"meta", "results"}``): each variant's
    ``time_ms`` per repeat (config ``variant=LABEL repeat=N``, provider ``kittens``), the SM clock
    while it ran (``sm_mhz``), and each point's ``floor_ms`` once. A variant whose output differed
    from the default's bits is kept out: its time is no result (the sweep logs it)."""
    common = dict(date=_date(meta.get("date")), commit=meta.get("commit"), benchmark=benchmark, gpu=meta.get("gpu"),
                  versions=versions(meta))
    out: list[dict | None] = []
    floors = set()
    for r in results:
        base = {**common, "shape": r["shape"], "tokens_or_load": r["tokens"], "routing": r["routing"]}
        point = (r["shape"], r["tokens"], r["routing"])
        if point not in floors:
            floors.add(point)
            out.append(_row({**base, "config": ""}, "floor", "floor_ms", r.get("floor_ms"), "ms"))
        if not r.get("bitwise_vs_default", True):
            continue
        variant = {**base, "config": f"variant={r['label']} repeat={r.get('repeat', 0)}"}
        out.append(_row(variant, "kittens", "time_ms", r.get("ms"), "ms"))
        out.append(_row(variant, "kittens", "sm_mhz", (r.get("clock") or {}).get("sm_mhz"), "MHz"))
    return [r for r in out if r]


# ------------------------------------------------------------------------------ ep_bench


def ep_bench_rows(meta: dict[str, Any], rows: list[dict[str, Any]], benchmark: str = "ep_bench") -> list[dict]:
    """Rows of an ``ep_bench`` result: per row each variant's ``time_ms`` (``kittens-pull``,
    ``kittens-push``, ..., ``a2a``, ``agrs``), the ``floor``, kittens' (default variant) ``x_floor``;
    ``config`` holds the world size."""
    common = dict(date=_date(meta.get("date") or meta.get("time")), commit=meta.get("commit"), benchmark=benchmark,
                  gpu=meta.get("gpu"), versions=versions(meta))
    out: list[dict | None] = []
    for r in rows:
        cfg = f"world={r.get('world', meta.get('world'))}"
        if meta.get("serving_limit"):
            cfg += f" serving_limit={meta['serving_limit']}"
        base = {**common, "shape": r.get("shape"), "tokens_or_load": r.get("tokens"), "routing": r.get("routing"),
                "config": cfg}
        for name, value in (r.get("ms") or {}).items():
            out.append(_row(base, name.replace("kittens_", "kittens-"), "time_ms", value, "ms"))
        out.append(_row(base, "floor", "floor_ms", r.get("floor_ms"), "ms"))
        out.append(_row(base, "kittens", "x_floor", r.get("ratio_to_floor"), "x"))
    return [r for r in out if r]


# ------------------------------------------------------------------------------ cpu_layer_bench


def cpu_layer_bench_rows(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict]:
    """Rows of a ``cpu_layer_bench`` run (its CSV rows): per backend the per-call time's median
    (``time_us``) and minimum over rounds (``min_time_us``); ``config`` holds the thread count."""
    out: list[dict | None] = []
    for r in rows:
        base = dict(date=_date(meta.get("date")), commit=r.get("commit") or meta.get("commit"), benchmark="cpu_layer_bench",
                    gpu=r.get("cpu") or meta.get("cpu"), versions=versions(meta), shape=r["shape"],
                    tokens_or_load=r["tokens"], routing="random", config=f"threads={r['threads']}")
        out.append(_row(base, r["backend"], "time_us", _num(r["median_us"]), "us"))
        out.append(_row(base, r["backend"], "min_time_us", _num(r["min_us"]), "us"))
    return [r for r in out if r]


def cpu_server_rows(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict]:
    """Rows of a ``cpu_layer_bench --server`` run: per family, concurrency, run, server and MoE
    layer the layer's mean and p50 latency and tokens per call (``config``: ``run=R layer=L``)."""
    out: list[dict | None] = []
    for r in rows:
        base = dict(date=_date(meta.get("date")), commit=r.get("commit") or meta.get("commit"),
                    benchmark="cpu_layer_bench_server", gpu=r.get("cpu") or meta.get("cpu"), versions=versions(meta),
                    shape=r["shape"], tokens_or_load=f"c={r['concurrency']}", routing="64 out",
                    config=f"run={r['run']} layer={r['layer']}")
        provider = "stock" if not str(r["backend"]).startswith("kittens") else "kittens"
        out.append(_row(base, provider, "layer_mean_ms", _num(r["mean_ms"]), "ms"))
        out.append(_row(base, provider, "layer_p50_ms", _num(r["p50_ms"]), "ms"))
        calls = _num(r["calls"])
        if calls:
            out.append(_row(base, provider, "tokens_per_call", _num(r["tokens"]) / calls, "tokens"))
    return [r for r in out if r]


def _num(v: Any) -> float | None:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


# ------------------------------------------------------------------------------ serve / merge

SERVE_METRICS = (("output_tok_s", ("output_throughput",), "tok/s"),
                 ("total_tok_s", ("total_token_throughput",), "tok/s"),
                 ("request_s", ("request_throughput",), "req/s"),
                 *((f"{m}_{s}_ms", (m, f"{s}_ms"), "ms") for m in ("ttft", "tpot", "itl", "e2el")
                   for s in ("mean", "p50", "p99")),
                 ("completed", ("completed",), "requests"),
                 ("failed", ("failed",), "requests"))


def serve_rows(results: dict[str, Any]) -> list[dict]:
    """Rows of a ``mok-loadtest serve`` or ``merge`` results document: per server (target) and
    run, output and total tok/s, requests/s, TTFT/TPOT/ITL/E2EL mean/p50/p99, completed and failed
    requests, and the MoE layers' share of the step time (``moe_share``) where measured. ``shape``
    is the served model's folder name; each target keeps its own run's environment."""
    model = str((results.get("config") or {}).get("model") or "")
    shape = model.rstrip("/").rsplit("/", 1)[-1]
    out: list[dict | None] = []
    for t in results.get("targets", []):
        env = t.get("environment") or results.get("environment") or {}
        common = dict(date=_date(t.get("started") or results.get("started")), commit=env.get("commit"), benchmark="serve",
                      gpu=env.get("gpu") or env.get("machine"), versions=versions(env), shape=shape)
        for run in t.get("runs", []):
            spec, summary = run.get("spec") or {}, run.get("summary") or {}
            load = f"c={spec['concurrency']}" if spec.get("concurrency") else f"rate={spec.get('rate')}"
            base = {**common, "tokens_or_load": load, "routing": f"{spec.get('input_len')}/{spec.get('output_len')}"}
            for metric, path, unit in SERVE_METRICS:
                v: Any = summary
                for p in path:
                    v = v.get(p) if isinstance(v, dict) else None
                out.append(_row(base, t["name"], metric, v, unit))
            out.append(_row(base, t["name"], "moe_share", (run.get("moe") or {}).get("moe_share"), "fraction"))
    return [r for r in out if r]
