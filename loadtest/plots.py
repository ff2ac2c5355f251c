"""The PNG plots of ``mok-loadtest serve``: throughput.png, latency.png and layers.png.

Each figure comes from a function that returns it (tests read its lines, labels and legends);
``write_plots`` saves them. Every server has its own colour and marker shape, and its points are
shifted sideways by a fraction of an octave, so that two servers' equal points (one Poisson rate
gives one point each) do not hide each other. Legends sit above the panels, off the data.
Points of a run whose per-token figures are distorted by bunched streams are ringed in red.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from . import server_layers
from .report import WARN, get, is_distorted, run_names, run_of

COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
MARKERS = ["o", "s", "^", "D", "v"]
DODGE_OCTAVES = 0.06  # sideways shift between neighbouring servers' points on the log2 x axes
PERCENTILE_STYLES = {"p50": "-", "p90": "--", "p99": ":"}
LATENCY_METRICS = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")]
X_AXES = {"concurrency": "max concurrency", "rate": "request rate (Poisson, req/s)"}
DISTORTED_LABEL = f"run distorted by bunched streams ({WARN} in report.md)"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def styles(targets: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {t["name"]: {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)]}
            for i, t in enumerate(targets)}


def x_of(run: dict[str, Any], kind: str) -> float | None:
    """The run's x on a 'concurrency' (fixed concurrency runs) or a 'rate' (Poisson runs) axis."""
    spec = run["spec"]
    if kind == "rate":
        return spec["rate"]
    return spec["concurrency"] if spec["rate"] is None else None


def workload_of(run: dict[str, Any]) -> tuple[int | None, int | None]:
    """(input_len, output_len) of the run's workload; (None, None) in results from before they were kept."""
    return run["spec"].get("input_len"), run["spec"].get("output_len")


def workloads_in(results: dict[str, Any]) -> list[tuple[int | None, int | None]]:
    """The workloads of the runs, in the order they were run."""
    keys = [workload_of(r) for t in results["targets"] for r in t.get("runs", [])]
    return list(dict.fromkeys(keys))


def workload_title(key: tuple[int | None, int | None]) -> str:
    input_len, output_len = key
    return f"{'dataset prompts' if input_len is None else f'input {input_len}'} / output {output_len}"


def runs_of(target: dict[str, Any], workload: tuple | None = None) -> list[dict[str, Any]]:
    """The target's runs, those of ``workload`` only when it is given."""
    return [r for r in target.get("runs", []) if workload is None or workload_of(r) == workload]


def series(target: dict[str, Any], path: tuple[str, ...], kind: str,
           workload: tuple | None = None) -> list[tuple[float, float, bool]]:
    """(x, value, distorted) of the target's completed runs (of ``workload``, if given) on the
    ``kind`` axis, sorted by x."""
    points = []
    for run in runs_of(target, workload):
        x, y = x_of(run, kind), get(run["summary"], path)
        if x is not None and y is not None and not run.get("skipped") and run["summary"]["completed"]:
            points.append((x, y, is_distorted(run, path)))
    return sorted(points)


def axis_values(results: dict[str, Any], kind: str, workload: tuple | None = None) -> list[float]:
    """The x values of the runs (of ``workload``, if given) on the ``kind`` axis."""
    return sorted({x for t in results["targets"] for r in runs_of(t, workload) if (x := x_of(r, kind)) is not None})


def kinds_of(results: dict[str, Any]) -> list[str]:
    """The x axes the runs need: 'concurrency' and/or 'rate'."""
    return [k for k in X_AXES if axis_values(results, k)]


def panel_grid(results: dict[str, Any]) -> tuple[list[tuple | None], list[str]]:
    """Rows and columns of panels: a row per workload (one row, workload None, when there is a
    single one), a column per x axis that any run needs."""
    workloads = workloads_in(results)
    return (workloads if len(workloads) > 1 else [None]), kinds_of(results)


def _dodge(x: float, j: int, n: int) -> float:
    return x * 2 ** (DODGE_OCTAVES * (j - (n - 1) / 2))


def _plot(ax, points, j: int, n: int, style: dict[str, str], linestyle: str = "-") -> None:
    xs = [_dodge(x, j, n) for x, _, _ in points]
    ax.plot(xs, [y for _, y, _ in points], linestyle=linestyle, markersize=6, **style)
    bad = [(x, y) for x, (_, y, d) in zip(xs, points) if d]
    if bad:
        ax.plot(*zip(*bad), linestyle="none", marker="o", markersize=13, markerfacecolor="none",
                markeredgecolor="red", markeredgewidth=1.5)


def _x_axis(ax, values: list[float], kind: str) -> None:
    """log2 x axis with a tick at each run's value and room either side for the shifted points."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(values)
    ax.set_xticklabels([f"{v:g}" for v in values])
    ax.minorticks_off()
    ax.set_xlim(values[0] / 1.5, values[-1] * 1.5)
    ax.set_xlabel(X_AXES[kind])


def _no_runs(ax, kind: str) -> None:
    """A panel of a workload without runs of this kind: blank, and saying so."""
    ax.axis("off")
    ax.text(0.5, 0.5, f"no {'Poisson' if kind == 'rate' else 'fixed-concurrency'} runs in this workload",
            ha="center", va="center", transform=ax.transAxes, color="gray")


def _title(ax, text: str, workload: tuple | None) -> None:
    ax.set_title(text if workload is None else f"{workload_title(workload)}\n{text}")


def _y_from_zero(axes) -> None:
    """y from 0 to a tenth above the highest point of ``axes`` (a row sharing its y scale), so
    that no point sits on the frame."""
    tops = [max(line.get_ydata()) for ax in axes for line in ax.lines if len(line.get_ydata())]
    if tops:
        for ax in axes:
            ax.set_ylim(0, max(tops) * 1.1 or 1.0)


def _legend(fig, results: dict[str, Any], percentiles: bool = False, distorted: bool = False) -> float:
    """One legend for the figure, above its panels: servers, and the line styles and rings used.
    Returns the top fraction of the figure it takes, for tight_layout to leave free."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], label=name, **style) for name, style in styles(results["targets"]).items()]
    if percentiles:
        handles += [Line2D([], [], color="gray", linestyle=ls, label=p) for p, ls in PERCENTILE_STYLES.items()]
    if distorted:
        handles.append(Line2D([], [], linestyle="none", marker="o", markersize=11, markerfacecolor="none",
                              markeredgecolor="red", label=DISTORTED_LABEL))
    # As many rows as the entries need at ~0.09 inch per character and 0.8 inch for the symbol.
    inches = sum(0.8 + 0.09 * len(h.get_label()) for h in handles)
    rows = math.ceil(inches / fig.get_figwidth())
    fig.legend(handles=handles, loc="upper center", ncol=math.ceil(len(handles) / rows), bbox_to_anchor=(0.5, 1.0),
               frameon=False)
    return (0.3 * rows + 0.1) / fig.get_figheight()


def _per_run_figure(results: dict[str, Any], points_of, ylabel: str, title: str):
    """One value per run against concurrency and against the Poisson request rate, a line per
    server; with several workloads, a row of panels per workload. ``points_of(target, kind,
    workload)`` gives a server's (x, value, distorted) points."""
    workloads, kinds = panel_grid(results)
    if not kinds:
        return None
    plt = _pyplot()
    targets = results["targets"]
    fig, axes = plt.subplots(len(workloads), len(kinds), figsize=(6 * len(kinds), 4.6 * len(workloads)),
                             squeeze=False)
    for row, workload in zip(axes, workloads):
        for ax, kind in zip(row, kinds):
            values = axis_values(results, kind, workload)
            if not values:
                _no_runs(ax, kind)
                continue
            for j, t in enumerate(targets):
                _plot(ax, points_of(t, kind, workload), j, len(targets), styles(targets)[t["name"]])
            _x_axis(ax, values, kind)
            ax.set_ylabel(ylabel)
            _title(ax, f"{title} vs {X_AXES[kind].split(' (')[0]}", workload)
            _y_from_zero([ax])
            ax.grid(alpha=0.3)
    fig.tight_layout(rect=(0, 0, 1, 1 - _legend(fig, results)))
    return fig


def throughput_figure(results: dict[str, Any]):
    """Output tokens/s against concurrency and against the Poisson request rate."""
    return _per_run_figure(results, lambda t, kind, w: series(t, ("output_throughput",), kind, w),
                           "output tokens/s", "Output tokens/s")


def moe_share_points(target: dict[str, Any], kind: str, workload: tuple | None = None) -> list[tuple[float, float, bool]]:
    """(x, MoE share in %, False) of the target's runs with a MoE share (``metrics.moe_step_share``)."""
    points = []
    for run in runs_of(target, workload):
        x, share = x_of(run, kind), (run.get("moe") or {}).get("moe_share")
        if x is not None and share is not None:
            points.append((x, 100.0 * share, False))
    return sorted(points)


def moe_share_figure(results: dict[str, Any]):
    """The MoE layers' share of the step time per run: the most that a faster MoE layer can move
    the end-to-end figures. None when no server reported per-layer timing."""
    if not any(r.get("moe") for t in results["targets"] for r in t.get("runs", [])):
        return None
    return _per_run_figure(results, moe_share_points, "MoE share of the step time (%)", "MoE share")


def latency_figure(results: dict[str, Any]):
    """TTFT, TPOT, ITL and E2E latency percentiles: a row per metric (a block of such rows per
    workload when there are several), a column per x axis (concurrency sweep, Poisson runs), rows
    sharing their y scale."""
    workloads, kinds = panel_grid(results)
    if not kinds:
        return None
    plt = _pyplot()
    targets = results["targets"]
    rows = len(LATENCY_METRICS) * len(workloads)
    fig, axes = plt.subplots(rows, len(kinds), figsize=(5.5 * len(kinds) + 1, 13 * len(workloads)), squeeze=False,
                             sharey="row", width_ratios=[3, 2] if len(kinds) == 2 else None)
    any_distorted = False
    for i, row in enumerate(axes):
        workload = workloads[i // len(LATENCY_METRICS)]
        metric, title = LATENCY_METRICS[i % len(LATENCY_METRICS)]
        labelled = False
        for ax, kind in zip(row, kinds):
            values = axis_values(results, kind, workload)
            if not values:
                _no_runs(ax, kind)
                continue
            for j, t in enumerate(targets):
                for pct, ls in PERCENTILE_STYLES.items():
                    points = series(t, (metric, f"{pct}_ms"), kind, workload)
                    any_distorted |= any(d for _, _, d in points)
                    _plot(ax, points, j, len(targets), styles(targets)[t["name"]], ls)
            _x_axis(ax, values, kind)
            if not labelled:  # the row shares its y scale: labelled once, left of its first drawn panel
                ax.set_ylabel(f"{title} ms")
                ax.tick_params(labelleft=True)
                labelled = True
            _title(ax, f"{title} vs {X_AXES[kind].split(' (')[0]}", workload)
            ax.grid(alpha=0.3)
        _y_from_zero(row)
    fig.tight_layout(rect=(0, 0, 1, 1 - _legend(fig, results, percentiles=True, distorted=any_distorted)))
    return fig


LAYERS_FIGURE_WIDTH = 30.0  # inches: layers.png wraps its panels into rows no wider
UNITS = {"ns": "ns", "us": "µs", "ms": "ms", "s": "s"}
STATS = {"mean": "mean", "avg": "mean", "median": "median", "p50": "median", "p90": "p90", "p99": "p99",
         "max": "max", "min": "min"}


def layer_time_label(field: str) -> str:
    """A y-axis label for a per-layer time field: 'latency_us.mean' -> 'mean time per MoE layer
    call (µs)'; the raw name only for the parts it cannot read."""
    words = re.split(r"[._]", field.lower())
    unit = next((UNITS[w] for w in reversed(words) if w in UNITS), None)
    stat = next((STATS[w] for w in reversed(words) if w in STATS), None)
    label = f"{stat + ' ' if stat else ''}time per MoE layer call"
    return f"{label} ({unit})" if unit else f"{label} ({field})"


def layers_figure(results: dict[str, Any]):
    """Per-layer MoE time from GET /v1/kittens/layers: a panel per run, a bar per layer (and rank)
    and server."""
    panels = []
    for name in run_names(results):
        per_target = {}
        for t in results["targets"]:
            parsed = ((run_of(t, name) or {}).get("layers") or {}).get("parsed")
            if parsed and server_layers.headline_field(parsed):
                per_target[t["name"]] = parsed
        if per_target:
            panels.append((name, per_target))
    if not panels:
        return None
    plt = _pyplot()
    look = styles(results["targets"])
    nl = max(len(p) for _, pt in panels for p in pt.values())
    panel_width = max(4.0, 0.9 * nl + 2)
    # Panels wrap into rows of at most LAYERS_FIGURE_WIDTH inches: many runs (several workloads)
    # of a model with many layers would otherwise make a strip tens of thousands of pixels wide.
    cols = max(1, min(len(panels), int(LAYERS_FIGURE_WIDTH // panel_width)))
    rows = math.ceil(len(panels) / cols)
    height = 5.0 * rows + 0.6  # 0.6 inch on top for the title and the legend
    fig, axes = plt.subplots(rows, cols, figsize=(panel_width * cols, height), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    fields = set()
    for ax, (name, per_target) in zip(axes.flat, panels):
        width = 0.8 / len(per_target)
        for j, (tname, parsed) in enumerate(per_target.items()):
            key = server_layers.headline_field(parsed)
            fields.add(key)
            ax.bar([i + j * width for i in range(len(parsed))], [l["fields"][key] for l in parsed], width=width,
                   label=tname, color=look[tname]["color"])
            ax.set_ylabel(layer_time_label(key))
        labels = [l["label"].replace(".mlp.experts", "").replace("model.layers.", "L") for l in parsed]
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(parsed))])
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"run {name}")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"Per-layer MoE time (GET /v1/kittens/layers, field {', '.join(sorted(fields))})",
                 y=1 - 0.05 / height)
    bars = {}  # one legend entry per server, whichever panels it has bars in
    for ax in axes.flat:
        bars.update({n: h for h, n in zip(*ax.get_legend_handles_labels())})
    fig.legend(bars.values(), bars.keys(), loc="upper center", ncol=len(bars), bbox_to_anchor=(0.5, 1 - 0.3 / height),
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.55 / height))
    return fig


def write_plots(results: dict[str, Any], folder: Path) -> list[Path]:
    plt = _pyplot()
    paths = []
    for name, make in (("throughput", throughput_figure), ("latency", latency_figure), ("layers", layers_figure),
                       ("moe_share", moe_share_figure)):
        fig = make(results)
        if fig is None:
            continue
        paths.append(folder / f"{name}.png")
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths
