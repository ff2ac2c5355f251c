"""Running the workload against one server: warm-up, the measured runs, bounds and deadlines,
per-layer MoE timing, and what happened when a server failed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import aiohttp

from . import client, server_layers
from .metrics import RequestRecord, moe_step_share, summarize
from .workload import WorkItem, arrival_offsets

LAYERS_PATH = "/v1/kittens/layers"


@dataclass
class RunSpec:
    """One measured run: a fixed concurrency (rate inf) or Poisson arrivals at ``rate``, of
    prompts of ``input_len`` tokens (None: prompts from a dataset file) and ``output_len`` output
    tokens (where a dataset entry gives none)."""

    name: str
    concurrency: int | None
    rate: float
    num_requests: int
    warmup: int
    seed: int
    input_len: int | None
    output_len: int

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rate"] = None if d["rate"] == float("inf") else d["rate"]
        return d


@dataclass
class Options:
    ignore_eos: bool = True
    extra_body: dict[str, Any] | None = None
    max_duration: float = 120.0  # per run: no request is sent after this many seconds
    request_timeout: float = 120.0  # per request, whole request
    stall_timeout: float = 60.0  # per request, longest wait for the next bytes
    connect_timeout: float = 10.0
    burstiness: float = 1.0
    layers: bool = True
    # Samples the GPU's SM clock and power cap (gpu_clocks.ClockSampler) during the measured
    # requests of each run, so each tok/s stands beside the clock it ran at; None: not sampled.
    clock: Any = None

    @property
    def run_deadline(self) -> float:
        """Hard bound on a run's wall time: after it, requests still open are cancelled."""
        return self.max_duration + self.request_timeout + 10.0


@dataclass
class Target:
    name: str
    url: str
    # Returns None while the server is fine, else a sentence on what happened (process exit).
    died: Callable[[], str | None] = lambda: None
    events: list[str] = field(default_factory=list)


def _timeout(opts: Options) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(
        total=opts.request_timeout, sock_connect=opts.connect_timeout, sock_read=opts.stall_timeout
    )


async def _issue(
    session, target: Target, model: str, items: list[WorkItem], offsets: list[float], concurrency: int | None,
    opts: Options, on_done: Callable[[RequestRecord], None] | None, index_base: int = 0,
) -> tuple[list[RequestRecord], float, int, str | None]:
    """Send ``items`` at ``offsets`` with at most ``concurrency`` in flight.

    Returns (records of the requests sent, duration, requests not sent, note). Requests still open
    at the run deadline are cancelled and recorded as failed."""
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    tasks: list[asyncio.Task] = []
    timeout = _timeout(opts)
    note = None

    async def one(i: int, item: WorkItem, arrival: float) -> RequestRecord:
        try:
            rec = await client.stream_completion(
                session, target.url, model, item, index_base + i,
                ignore_eos=opts.ignore_eos, extra_body=opts.extra_body, timeout=timeout,
            )
        finally:
            if sem is not None:
                sem.release()
        rec.queue_time = rec.start_time - arrival
        if on_done:
            on_done(rec)
        return rec

    start = time.perf_counter()
    hard_deadline = start + opts.run_deadline
    not_sent = 0
    for i, (item, offset) in enumerate(zip(items, offsets)):
        arrival = start + offset
        left = start + opts.max_duration - time.perf_counter()
        if left > 0 and arrival > time.perf_counter():
            await asyncio.sleep(min(arrival - time.perf_counter(), left))
        # A concurrency slot is taken here, by the sender, so that the duration bound also stops
        # requests that would only queue (vLLM creates every task at once and each waits on the
        # semaphore; the timing is the same: a request's clock starts when it is sent).
        left = start + opts.max_duration - time.perf_counter()
        got_slot = left > 0
        if got_slot and sem is not None:
            try:
                await asyncio.wait_for(sem.acquire(), timeout=left)
            except asyncio.TimeoutError:
                got_slot = False
        if not got_slot or time.perf_counter() - start >= opts.max_duration:
            if got_slot and sem is not None:
                sem.release()
            not_sent = len(items) - i
            note = f"duration limit ({opts.max_duration:g} s) reached: {not_sent} of {len(items)} requests not sent"
            break
        tasks.append(asyncio.create_task(one(i, item, min(arrival, time.perf_counter()))))
    records: list[RequestRecord] = []
    if tasks:
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, hard_deadline - time.perf_counter()))
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.wait(pending, timeout=10)
            note = (note + "; " if note else "") + (
                f"run deadline ({opts.run_deadline:g} s) reached: {len(pending)} requests still open were cancelled"
            )
        for i, t in enumerate(tasks):
            if t in done and not t.cancelled() and t.exception() is None:
                records.append(t.result())
            else:
                rec = RequestRecord(index=index_base + i, prompt_len=items[i].prompt_len,
                                    expected_output_len=items[i].output_len)
                rec.error = "cancelled at the run deadline" if t in pending or t.cancelled() else repr(t.exception())
                records.append(rec)
                if on_done:
                    on_done(rec)
    duration = time.perf_counter() - start
    return records, duration, not_sent, note


async def fetch_layers(session, target: Target) -> tuple[str, Any]:
    """("ok", json) | ("absent", None) on 404 | ("error", message)."""
    status, data = await client.get_json(session, target.url + LAYERS_PATH)
    if status == 200 and data is not None:
        return "ok", data
    if status in (404, 405):
        return "absent", None
    return "error", f"GET {LAYERS_PATH} answered {status or 'nothing'}"


async def run_target(
    target: Target, model: str, specs: list[RunSpec], workloads: dict[str, tuple[list[WorkItem], list[WorkItem]]],
    opts: Options, progress: Callable[[str, RequestRecord | None], None] | None = None,
) -> list[dict[str, Any]]:
    """All runs of ``specs`` against one server. ``workloads[spec.name]`` = (warm-up, measured).
    ``progress(run name, record)`` after each measured request, ``progress(run name, None)`` when a
    run's measured requests start or the run is skipped."""
    results: list[dict[str, Any]] = []
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=3)
    async with aiohttp.ClientSession(connector=connector, trust_env=False) as session:
        layers_available = opts.layers
        skip_reason: str | None = None
        for spec in specs:
            warm_items, items = workloads[spec.name]
            result: dict[str, Any] = {"spec": spec.to_dict(), "notes": [], "layers": None, "moe": None}
            if skip_reason is None and not await client.is_healthy(session, target.url):
                skip_reason = target.died() or f"server at {target.url} not healthy before run {spec.name}"
                target.events.append(skip_reason)
            if skip_reason is not None:
                result["skipped"] = skip_reason
                result["records"] = []
                result["summary"] = summarize([], 0.0)
                result["summary"]["not_sent"] = len(items)
                results.append(result)
                if progress:
                    progress(spec.name, None)
                continue

            def cb(rec: RequestRecord, _name=spec.name) -> None:
                if progress:
                    progress(_name, rec)

            # Warm-up: excluded from every figure; failures only noted.
            if warm_items:
                wrecs, _, _, _ = await _issue(
                    session, target, model, warm_items, [0.0] * len(warm_items),
                    spec.concurrency or len(warm_items), opts, None, index_base=-len(warm_items),
                )
                wfail = [r for r in wrecs if not r.success]
                result["warmup"] = {"requests": len(wrecs), "failed": len(wfail)}
                if wfail:
                    result["notes"].append(f"{len(wfail)} of {len(wrecs)} warm-up requests failed: {wfail[0].error[:160]}")

            if layers_available:
                state, _ = await fetch_layers(session, target)
                if state == "absent":
                    layers_available = False
                    result["layers"] = {"available": False}
                else:
                    await client.post(session, target.url + LAYERS_PATH + "/reset")

            if progress:
                progress(spec.name, None)  # the measured requests start: the progress bar's clock runs
            offsets = arrival_offsets(len(items), spec.rate, opts.burstiness, spec.seed + 7)
            t0 = time.monotonic()
            records, duration, not_sent, note = await _issue(
                session, target, model, items, offsets, spec.concurrency, opts, cb
            )
            result["gpu_clock"] = opts.clock.summary(t0, time.monotonic()) if opts.clock else None
            if note:
                result["notes"].append(note)
            records = [r.round_times() for r in records]
            summary = summarize(records, duration)
            summary["not_sent"] = not_sent
            result["records"] = [r.to_dict() for r in records]
            result["summary"] = summary

            if layers_available:
                state, data = await fetch_layers(session, target)
                if state == "ok":
                    result["layers"] = {"available": True, "raw": data, "parsed": server_layers.parse_layers(data)}
                    result["moe"] = moe_step_share(data)
                else:
                    result["layers"] = {"available": state != "absent", "error": data}

            if summary["failed"]:
                died = target.died()
                healthy = await client.is_healthy(session, target.url)
                if died or not healthy:
                    skip_reason = died or f"server at {target.url} stopped answering during run {spec.name}"
                    target.events.append(skip_reason)
                    result["notes"].append(skip_reason)
            results.append(result)
    return results
