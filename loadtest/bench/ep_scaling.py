"""How kittens expert parallelism scales with the EP degree: ep_bench results of several world
sizes side by side (issue 7's scaling curve).

Every input is an ``ep_bench`` JSON (``--world N``) of the same shapes and tokens per rank; rows
are matched by (shape, tokens per rank, routing). Tokens per rank are fixed along a row, so the
global batch grows with the world size (weak scaling): the expert weights per rank shrink as
1/N while each rank's tokens keep their size.

Writes ``<out>.md``: per row, kittens' time (pull return, the default) and the best baseline /
kittens at each world size; and ``<out>.png``: per shape, kittens' time against the EP degree
(top) and its speedup over the best baseline (bottom), one line per tokens per rank, uniform
routing solid and skewed dashed.

``python -m mok_serve.loadtest.bench.ep_scaling results/ep_bench_w2.json results/ep_bench_w4.json
results/ep_bench_w8.json --out results/ep_scaling``
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys


def load_runs(paths) -> dict[int, dict]:
    """World size -> that run's ``{"meta", "rows"}``; one run per world size."""
    runs: dict[int, dict] = {}
    for path in paths:
        data = json.loads(pathlib.Path(path).read_text())
        world = int(data["meta"]["world"])
        if world in runs:
            raise ValueError(f"two results for EP={world}: give one run per world size ({path})")
        runs[world] = data
    if not runs:
        raise ValueError("no results given")
    quants = {bool(r["meta"].get("fp8")) for r in runs.values()}
    if len(quants) > 1:
        raise ValueError("mixed bf16 and FP8 results: compare runs of one kind")
    return dict(sorted(runs.items()))


def scaling_rows(runs: dict[int, dict]) -> list[dict]:
    """One entry per (shape, tokens per rank, routing) seen in any run: ``by_world[w]`` =
    ``(kittens ms, best baseline / kittens)``, absent where that run has no such row or it failed."""
    table: dict[tuple, dict] = {}
    for world, data in runs.items():
        for r in data["rows"]:
            key = (r["shape"], r["tokens"], r["routing"])
            entry = table.setdefault(key, dict(shape=key[0], tokens=key[1], routing=key[2], by_world={}))
            if "error" not in r:
                entry["by_world"][world] = (r["kittens_ms"], r["speedup_vs_best_baseline"])
    return list(table.values())


def markdown(rows: list[dict], runs: dict[int, dict]) -> str:
    worlds = list(runs)
    commits = ", ".join(f"EP={w}: {runs[w]['meta']['commit']} ({runs[w]['meta']['gpu']})" for w in worlds)
    out = [
        "# Kittens EP scaling with the EP degree", "",
        f"Runs: {commits}. Tokens per rank fixed along a row (weak scaling). Time: median over iterations of "
        "the max across ranks (kittens pull return, the default); speedup = best baseline (a2a or agrs, same "
        "run) / kittens.", "",
        "| shape | tokens/rank | routing | " + " | ".join(f"EP={w} ms" for w in worlds) + " | "
        + " | ".join(f"EP={w} speedup" for w in worlds) + " |",
        "|---|---|---|" + "---|" * (2 * len(worlds)),
    ]
    for r in rows:
        ms = [f"{r['by_world'][w][0]:.3f}" if w in r["by_world"] else "-" for w in worlds]
        sp = [f"{r['by_world'][w][1]:.2f}x" if w in r["by_world"] else "-" for w in worlds]
        out.append(f"| {r['shape']} | {r['tokens']} | {r['routing']} | " + " | ".join(ms + sp) + " |")
    return "\n".join(out) + "\n"


def write_plot(rows: list[dict], runs: dict[int, dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    colors = {t: f"C{i % 10}" for i, t in enumerate(tokens)}
    fig, axes = plt.subplots(2, len(shapes), figsize=(4 * len(shapes) + 2, 7), squeeze=False)
    for col, shape in enumerate(shapes):
        top, bottom = axes[0][col], axes[1][col]
        for r in (r for r in rows if r["shape"] == shape):
            pts = sorted(r["by_world"].items())
            if not pts:
                continue
            style = "-" if r["routing"] == "uniform" else "--"
            label = f"{r['tokens']} tok/rank, {r['routing']}"
            top.plot([w for w, _ in pts], [v[0] for _, v in pts], style, color=colors[r["tokens"]], marker="o", ms=3,
                     label=label)
            bottom.plot([w for w, _ in pts], [v[1] for _, v in pts], style, color=colors[r["tokens"]], marker="o",
                        ms=3, label=label)
        top.set_title(shape)
        top.set_yscale("log")
        bottom.axhline(1.0, color="k", lw=0.8)
        bottom.axhline(2.0, color="k", lw=0.8, ls=":")
        for ax in (top, bottom):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(runs), [str(w) for w in runs])
            ax.grid(True, which="both", alpha=0.3)
        bottom.set_xlabel("EP degree (GPUs)")
    axes[0][0].set_ylabel("kittens ms")
    axes[1][0].set_ylabel("best baseline / kittens")
    axes[0][-1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.02, 1))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("results", nargs="+", metavar="RESULT.json", help="ep_bench JSON files, one per world size")
    p.add_argument("--out", required=True, help="path stem for <out>.md and <out>.png")
    args = p.parse_args(argv)
    try:
        runs = load_runs(args.results)
    except (OSError, ValueError, KeyError) as exc:
        print(f"ep_scaling: {exc}", file=sys.stderr)
        return 2
    rows = scaling_rows(runs)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, runs)
    out.with_suffix(".md").write_text(md)
    write_plot(rows, runs, out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
