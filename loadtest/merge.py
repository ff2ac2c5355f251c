"""One report from the results of several ``mok-loadtest serve`` runs of the same workload.

Where each server has to be measured in its own session (a device call that cannot hold two
server starts, say), run ``mok-loadtest serve --backends stock --out DIR/stock`` and
``... --backends kittens --out DIR/kittens`` with the same workload options, then
``mok-loadtest merge DIR/stock DIR/kittens --out DIR``: the targets side by side, the ratios, the
report and the plots, as if one run had measured both. Runs that differ in anything but the
servers (workload, seeds, request counts, model, client options) are refused, naming what differs.
Each target keeps the environment (commit, versions, machine) of the run that measured it.
The merged runs' rows go to ``loadtest/results/history.csv`` (``history``; ``--history PATH``,
``--no-history``): give the separate serve runs ``--no-history`` so that each is counted once.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from . import history, report
from .cli import EXIT_USAGE, exit_code_of
from .plots import write_plots

# Settings that must be equal for the targets of separate runs to be compared; the server
# choice (--backends, --url, --baseline) and output options may differ.
SAME = ("workloads", "model", "seed", "ignore_eos", "workload_description")
SAME_ARGS = ("range_ratio", "dataset", "tokenizer", "prompt_format", "temperature", "burstiness",
             "rate_max_concurrency", "max_duration", "request_timeout", "stall_timeout", "warmup", "server_args")


def load(folder: Path) -> dict[str, Any]:
    path = folder / "results.json"
    if not path.is_file():
        raise ValueError(f"{folder}: no results.json (not a mok-loadtest serve results folder)")
    return json.loads(path.read_text())


def differences(first: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """What makes two runs' results incomparable, as sentences; empty when they compare."""
    diffs = []
    a, b = first["config"], other["config"]
    for key in SAME:
        if a.get(key) != b.get(key):
            diffs.append(f"{key}: {a.get(key)!r} vs {b.get(key)!r}")
    for key in SAME_ARGS:
        if a["args"].get(key) != b["args"].get(key):
            diffs.append(f"--{key.replace('_', '-')}: {a['args'].get(key)!r} vs {b['args'].get(key)!r}")
    specs_a = [r["spec"] for r in first["targets"][0]["runs"]] if first["targets"] else []
    specs_b = [r["spec"] for r in other["targets"][0]["runs"]] if other["targets"] else []
    if specs_a != specs_b:
        diffs.append("runs (names, request counts, seeds) differ")
    return diffs


def merge(results: list[dict[str, Any]], folders: list[Path], baseline: str | None) -> dict[str, Any]:
    """The merged results document; ValueError naming the problem when the runs do not compare."""
    if len(results) < 2:
        raise ValueError("give at least two results folders")
    for r, f in zip(results[1:], folders[1:], strict=True):
        if diffs := differences(results[0], r):
            raise ValueError(f"{f} did not run what {folders[0]} ran: " + "; ".join(diffs))
    targets = []
    for r, f in zip(results, folders, strict=True):
        for t in r["targets"]:
            targets.append({**t, "environment": r.get("environment", {}), "source": str(f), "started": r.get("started")})
    names = [t["name"] for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must differ across the folders: {names}")
    baseline = baseline or ("stock" if "stock" in names else names[0])
    if baseline not in names:
        raise ValueError(f"--baseline {baseline!r} is not one of {names}")
    config = dict(results[0]["config"])
    config.update(baseline=baseline, command="; ".join(r["config"].get("command", "") for r in results))
    merged = {
        "tool": "mok-loadtest merge",
        "merged_from": [str(f) for f in folders],
        "started": min(r.get("started", "") for r in results),
        "finished": max(r.get("finished", "") for r in results),
        "environment": results[0].get("environment", {}),
        "config": config,
        "targets": targets,
    }
    if any(r.get("interrupted") for r in results):
        merged["interrupted"] = True
    merged["ratios"] = report.compute_ratios(merged)
    return merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mok-loadtest merge", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folders", nargs="+", type=Path, metavar="FOLDER",
                        help="results folders of mok-loadtest serve runs (each with its results.json)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR",
                        help="folder for the merged results.json, report.md and plots")
    parser.add_argument("--baseline", default=None, metavar="NAME",
                        help="the server the ratios divide by (default: 'stock' if present, else the first server)")
    parser.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    history.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        merged = merge([load(f) for f in args.folders], [f.resolve() for f in args.folders], args.baseline)
    except ValueError as e:
        print(f"mok-loadtest merge: {e}", file=sys.stderr)
        return EXIT_USAGE
    args.out.mkdir(parents=True, exist_ok=True)
    merged["folder"] = str(args.out.resolve())
    merged["merged"] = datetime.datetime.now().isoformat(timespec="seconds")
    code = exit_code_of(merged)
    merged["exit_code"] = code
    plots: list[Path] = []
    if args.plots:
        try:
            plots = write_plots(merged, args.out)
        except Exception as e:  # a plot must not hide the measurements
            merged["plot_error"] = f"{type(e).__name__}: {e}"
            print(f"mok-loadtest merge: plots not written: {merged['plot_error']}", file=sys.stderr)
    report.write_json(merged, args.out)
    report.write_markdown(merged, args.out, plots)
    history.write(history.serve_rows(merged), history.resolve(args), "mok-loadtest merge")
    print(report.console_summary(merged, args.out, code))
    return code


if __name__ == "__main__":
    sys.exit(main())
