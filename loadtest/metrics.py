"""Per-request records and per-run metrics, with the definitions of vLLM's ``vllm bench serve``.

The definitions follow ``vllm/benchmarks/serve.py`` (``calculate_metrics``) and
``vllm/benchmarks/lib/endpoint_request_func.py`` (``async_request_openai_completions``) of vLLM
0.32, so figures from ``mok-loadtest`` and ``vllm bench serve`` can be compared directly:

- per request (times from ``time.perf_counter`` on the client, the request is sent at ``start``):
  TTFT = arrival of the first streamed chunk that has ``choices`` - start;
  ITL = the gaps between successive ``choices`` chunks (one list per request);
  E2E latency = arrival of the last ``choices`` chunk - start (the closing usage chunk and
  ``[DONE]`` do not count);
  output tokens = ``usage.completion_tokens`` of the stream (``stream_options.include_usage``);
  TPOT = (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
- per run: duration = wall time from the first request sent (after warm-up) until every request
  has finished; request throughput = successful requests / duration; output tokens/s = output
  tokens of successful requests / duration; total tokens/s = (prompt + output tokens of successful
  requests) / duration; TTFT, TPOT, E2E statistics over successful requests, ITL statistics over
  the ITLs of all successful requests pooled; percentiles with ``numpy.percentile`` (linear
  interpolation); failed requests are counted, never averaged in. Where vLLM reports 0 for a
  statistic of an empty set, this module reports ``None``.
- peak output tokens/s: vLLM's one-second bucket maximum (token times rebuilt from TTFT + ITLs).

Beyond vLLM's figures: requests in flight (mean and peak, ``requests_in_flight``), and which requests were *bunched* (tokens in bursts, see ``bunching``), per
request and counted per run, since their TTFT, TPOT and ITL do not time the server's tokens.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import bunching

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestRecord:
    """One request as measured by the client. Times in seconds."""

    index: int
    prompt_len: int = 0  # from usage.prompt_tokens when the server sends it, else the workload's
    expected_output_len: int = 0
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # end-to-end, to the last chunk with choices
    start_time: float = 0.0  # perf_counter at send, after waiting for a concurrency slot
    queue_time: float = 0.0  # time spent waiting for a concurrency slot on the client
    http_status: int | None = None
    error: str = ""
    generated_chars: int = 0

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def round_times(self) -> "RequestRecord":
        """Times to the microsecond, in place: results.json then holds exactly what a run's figures
        were computed from, at half the size (a GPU run stores ~100k gaps)."""
        self.ttft, self.latency = round(self.ttft, 6), round(self.latency, 6)
        self.start_time, self.queue_time = round(self.start_time, 6), round(self.queue_time, 6)
        self.itl = [round(gap, 6) for gap in self.itl]
        return self

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["tpot"] = self.tpot
        d["arrivals"] = bunching.arrivals(self.itl) if self.success else 0
        d["bunched"] = bunching.is_bunched(self.success, self.output_tokens, self.itl)
        return d


def stats(values_s: list[float], percentiles=PERCENTILES) -> dict[str, float | None]:
    """mean, std, median and percentiles in milliseconds (numpy's definitions, as vLLM)."""
    if not values_s:
        out = {"mean_ms": None, "std_ms": None, "median_ms": None}
        out.update({f"p{_pname(p)}_ms": None for p in percentiles})
        return out
    a = np.asarray(values_s, dtype=np.float64)
    out = {
        "mean_ms": float(np.mean(a) * 1000),
        "std_ms": float(np.std(a) * 1000),
        "median_ms": float(np.median(a) * 1000),
    }
    for p in percentiles:
        out[f"p{_pname(p)}_ms"] = float(np.percentile(a, p) * 1000)
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p).replace(".", "_")


def peak_output_tokens_per_s(records: list[RequestRecord]) -> float:
    """vLLM's 'Peak output token throughput': the busiest one-second bucket of token arrivals."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    t1 = max(r.start_time + r.latency for r in ok)
    n = int(math.ceil(t1 - t0)) + 1
    buckets = np.zeros(n)
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for tt in times:
            b = int(tt - t0)
            if 0 <= b < n:
                buckets[b] += 1
    return float(buckets.max())


def requests_in_flight(records: list[RequestRecord]) -> dict[str, float | None]:
    """Successful requests sent and not yet finished: the time-weighted mean over the span from the
    first send to the last finish (Little's law: sum of latencies / span) and the peak. At a fixed
    concurrency both sit near it; in a Poisson run a peak far above rate x latency says the server
    fell behind and a backlog formed."""
    ok = [r for r in records if r.success]
    if not ok:
        return {"mean": None, "peak": None}
    t0 = min(r.start_time for r in ok)
    span = max(r.start_time + r.latency for r in ok) - t0
    # Ends sort before starts at the same time: a slot handed on is not two requests at once.
    events = sorted([(r.start_time + r.latency, -1) for r in ok] + [(r.start_time, 1) for r in ok])
    now = peak = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return {"mean": sum(r.latency for r in ok) / span if span > 0 else None, "peak": peak}


def summarize(records: list[RequestRecord], duration_s: float, percentiles=PERCENTILES) -> dict[str, Any]:
    """The per-run summary: counts, throughputs and latency statistics (see the module doc)."""
    ok = [r for r in records if r.success]
    failed = [r for r in records if not r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    itls = [gap for r in ok for gap in r.itl]
    e2els = [r.latency for r in ok]
    dur = duration_s if duration_s > 0 else float("nan")
    summary: dict[str, Any] = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(failed),
        "duration_s": duration_s,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
        "peak_output_throughput": peak_output_tokens_per_s(records),
        "in_flight": requests_in_flight(records),
        "output_len_mismatches": sum(
            1 for r in ok if r.expected_output_len and r.output_tokens != r.expected_output_len
        ),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        summary[name] = stats(values, percentiles)
    errors: dict[str, int] = {}
    for r in failed:
        key = first_line(r.error) or "unknown error"
        errors[key] = errors.get(key, 0) + 1
    summary["errors"] = errors
    summary["bunching"] = bunching.summarize(ok)
    return summary


def first_line(text: str, limit: int = 160) -> str:
    line = next((ln.strip() for ln in (text or "").splitlines() if ln.strip()), "")
    return line[:limit]


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is 0."""
    if a is None or b is None or b == 0 or (isinstance(b, float) and math.isnan(b)):
        return None
    return a / b


MOE_KEYS = ("steps", "tokens_per_step", "step_ms", "moe_ms_per_step", "moe_share")


def moe_step_share(doc: Any) -> dict[str, float | None]:
    """The MoE layers' share of a forward step over a run, from its ``GET /v1/kittens/layers``
    document (schema in server/stats.py; any other document gives only None):

    - steps: calls of the first MoE layer on rank 0 (every forward step calls each MoE layer once);
    - tokens_per_step: that layer's tokens on rank 0 / steps;
    - step_ms: the window's wall seconds x 1000 / steps (host gaps and idle time included);
    - moe_ms_per_step: the sum over layers of the mean sampled latency, the slowest rank's (ranks
      wait for each other at every layer);
    - moe_share: moe_ms_per_step / step_ms.

    An estimate: the latency means cover the last sampled calls, the steps all of the window."""
    out: dict[str, float | None] = dict.fromkeys(MOE_KEYS)
    layers = doc.get("layers") if isinstance(doc, dict) else None
    if not isinstance(layers, list) or not layers or not all(isinstance(l, dict) and l.get("ranks") for l in layers):
        return out
    first = min(layers, key=lambda l: l.get("index", 0))
    rank0 = min(first["ranks"], key=lambda r: r.get("rank", 0))
    steps = rank0.get("calls")
    if not steps:
        return out
    out["steps"] = steps
    if rank0.get("tokens") is not None:
        out["tokens_per_step"] = rank0["tokens"] / steps
    seconds = (doc.get("window") or {}).get("seconds")
    if seconds:
        out["step_ms"] = seconds * 1000 / steps
    timing_on = (doc.get("timing") or {}).get("enabled", True)
    per_layer = [[(r.get("latency_ms") or {}).get("mean") for r in l["ranks"]] for l in layers]
    if timing_on and all(m is not None for means in per_layer for m in means):
        out["moe_ms_per_step"] = sum(max(means) for means in per_layer)
        out["moe_share"] = ratio(out["moe_ms_per_step"], out["step_ms"])
    return out
