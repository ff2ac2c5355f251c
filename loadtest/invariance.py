"""mok-loadtest invariance: is one greedy request's output bitwise the same alone and in batches?

One fixed greedy probe request (POST /v1/completions, temperature 0, logprobs 1 so the chosen
token's logprob comes back, ignore_eos, token ids returned) is sent --probes times to each server.
Probe 0 goes alone. Probe i > 0 goes with b_i companion requests, b_i drawn (seeded) from
0..--max-batch: random token-id prompts of varied lengths and max_tokens, greedy or sampled,
sent in a window around the probe so that they share engine steps with it. About a third start
up to --spread seconds before the probe (they are decoding when its prefill runs), a third at the
same moment (prefilled with it), a third up to --spread after it (their prefill meets its decode).
Each round waits for all of its requests before the next round starts.

Counted per server, over the probes that succeeded: distinct completions (by token ids), distinct
(token ids, logprobs) pairs, and how many probes equal the one sent alone (probe 0 included).
A batch-invariant server gives 1, 1 and every probe.

Servers. Without --url it starts `mok-serve MODEL --moe-backend B` on free loopback ports for each
of --backends (stock: B = triton on a CUDA machine, auto elsewhere; kittens) in each of --modes:
`default` (VLLM_BATCH_INVARIANT=0: vLLM as it ships) and `deterministic` (`mok-serve
--deterministic`: vLLM's batch-invariant mode, with kittens' invariant kernels where B is kittens;
CUDA only), named BACKEND-MODE: by default the four servers stock-default, stock-deterministic,
kittens-default, kittens-deterministic. They start one after the other (each stopped before the
next starts), or all at once with --parallel-start (all stay up until the end; probing still goes
one server at a time). MODEL is --model, or the embedded tiny model (--tiny-family). A probe on a
model where the default servers give one completion too proves nothing: serve real-shape models
with --server-arg=--load-format=kittens-random (random weights at trained scales, the same in
every server). Started servers get --no-enable-prefix-caching: the probe repeats one prompt, and
with the prefix cache its prefill would be read back instead of computed inside its batch
(--prefix-caching keeps vLLM's default). Extra mok-serve / vllm serve options go through
--server-arg, repeatable, in the = form: --server-arg=--attention-backend=TRITON_ATTN.

Parallel start on one GPU: every server must fit beside the others, so give each a small share
and a fixed KV cache, e.g. --server-arg=--gpu-memory-utilization=0.3
--server-arg=--kv-cache-memory-bytes=8G (the shares must add up to less than the free memory).

With --url NAME=http://127.0.0.1:PORT (repeat per server) it targets running servers instead;
loopback only, any other host is refused (--modes does not apply: they run as they were started).

Bounds: every request has --request-timeout; no round starts after --max-duration seconds of
probing a server; at most --probes x (--max-batch + 1) requests per server; loopback only.

Output (--out DIR, default mok-loadtest-results/invariance-<date-time>): invariance.json (every
probe: token ids, logprobs, companions; servers, versions, commit, environment), invariance.md
(the table and the variants), and a summary on screen.

Exit status: 0 when it ran (the counts are the finding, whatever they are); 1 when a request
failed, a server did not start, died or could not be reached; 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mok_serve.server_process import ServerError, ServerProcess

from . import client, workload
from .cli import environment, name_value

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
MODES = ("default", "deterministic")
PROBE_PROMPT = "The mixture of experts layer routes each token to"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mok-loadtest invariance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("servers")
    g.add_argument("--url", action="append", type=name_value, default=[], metavar="NAME=URL",
                   help="probe a running server instead of starting any (repeat per server, e.g. "
                   "--url stock=http://127.0.0.1:8001 --url kittens=http://127.0.0.1:8002); loopback only")
    g.add_argument("--backends", default="stock,kittens", metavar="LIST",
                   help="servers to start (without --url): comma-separated 'stock' (triton with CUDA, else auto), "
                   "'kittens', or NAME=MOE_BACKEND (default: %(default)s)")
    g.add_argument("--model", default=None, help="model path or name for started servers (default: the embedded tiny model)")
    g.add_argument("--tiny-family", default=None, help="with no --model, the tiny model family (default qwen3_moe)")
    g.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                   help="extra mok-serve / vllm serve option(s) for every started server, repeatable; use the = form "
                   "(--server-arg=--attention-backend=TRITON_ATTN); a value with spaces is split as a shell would")
    g.add_argument("--parallel-start", action="store_true",
                   help="start all servers at once and keep them up to the end (one GPU: give each "
                   "--gpu-memory-utilization and --kv-cache-memory-bytes through --server-arg)")
    g.add_argument("--modes", default=",".join(MODES), metavar="LIST",
                   help="modes each backend is started in (without --url), comma-separated: 'default' "
                   "(VLLM_BATCH_INVARIANT=0) and/or 'deterministic' (mok-serve --deterministic; CUDA only) "
                   "(default: %(default)s)")
    g.add_argument("--prefix-caching", action="store_true",
                   help="leave vLLM's prefix cache on (default: started servers get --no-enable-prefix-caching)")
    g.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="seconds to wait for a started server's /health (default: %(default)s)")

    g = p.add_argument_group("probe and companions")
    g.add_argument("--probes", type=int, default=100, metavar="N", help="probe rounds per server (default: %(default)s)")
    g.add_argument("--max-tokens", type=int, default=32, metavar="N", help="the probe's max_tokens (default: %(default)s)")
    g.add_argument("--prompt", default=PROBE_PROMPT, help="the probe's prompt (default: %(default)r)")
    g.add_argument("--max-batch", type=int, default=64, metavar="B",
                   help="companions per round drawn uniformly from 0..B (probe 0: none) (default: %(default)s)")
    g.add_argument("--companion-input-len", type=int, default=96, metavar="N",
                   help="mean companion prompt length in tokens (default: %(default)s)")
    g.add_argument("--companion-output-len", type=int, default=32, metavar="N",
                   help="mean companion max_tokens (default: %(default)s)")
    g.add_argument("--range-ratio", type=float, default=0.9, metavar="R",
                   help="companion lengths drawn uniformly from mean*(1-R)..mean*(1+R) (default: %(default)s)")
    g.add_argument("--spread", type=float, default=0.05, metavar="S",
                   help="companions start up to S seconds before or after the probe (default: %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="seed of batch sizes, prompts and timings (default: %(default)s)")
    g.add_argument("--tokenizer", default=None,
                   help="vocabulary for random prompts (default: the model, or the 'root' the server reports)")

    g = p.add_argument_group("bounds and output")
    g.add_argument("--request-timeout", type=float, default=120.0, metavar="S",
                   help="whole-request timeout (default: %(default)s)")
    g.add_argument("--max-duration", type=float, default=1800.0, metavar="S",
                   help="per server: no round starts after S seconds of probing (default: %(default)s)")
    g.add_argument("--out", default=None, metavar="DIR",
                   help="results folder (default: mok-loadtest-results/invariance-<date-time>)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    return p


def _usage_error(args) -> str | None:
    if args.probes < 1 or args.max_tokens < 1 or args.companion_input_len < 1 or args.companion_output_len < 1:
        return "--probes, --max-tokens and the companion lengths must be >= 1"
    if not 0 <= args.max_batch <= 1024:
        return "--max-batch must be in 0..1024"
    if not 0 <= args.range_ratio < 1:
        return "--range-ratio must be in [0, 1)"
    if args.spread < 0 or args.request_timeout <= 0 or args.max_duration <= 0:
        return "--spread must be >= 0, --request-timeout and --max-duration > 0"
    return None


# ------------------------------------------------------------------------------------ plan


@dataclass
class Companion:
    item: workload.WorkItem
    offset_s: float  # send time relative to the probe's: < 0 before it, 0 with it, > 0 after it
    temperature: float


def plan_rounds(args, vocab: np.ndarray) -> list[list[Companion]]:
    """The companions of every round; a function of the seed and the vocabulary only, so every
    server gets the same traffic."""
    rng = np.random.default_rng(args.seed)
    sizes = [0] + rng.integers(0, args.max_batch + 1, size=args.probes - 1).tolist()
    items = workload.random_workload(sum(sizes), args.companion_input_len, args.companion_output_len, vocab,
                                     args.seed + 1, args.range_ratio)
    rounds, k = [], 0
    for b in sizes:
        side = rng.integers(-1, 2, size=b)  # -1 before, 0 with, +1 after the probe
        offsets = side * rng.uniform(0, args.spread, size=b)
        temps = rng.choice([0.0, 1.0], size=b)  # greedy and sampled neighbours, as in real traffic
        rounds.append([Companion(items[k + j], float(offsets[j]), float(temps[j])) for j in range(b)])
        k += b
    return rounds


def probe_payload(args, model: str) -> dict[str, Any]:
    return {"model": model, "prompt": args.prompt, "max_tokens": args.max_tokens, "temperature": 0.0,
            "logprobs": 1, "ignore_eos": True, "return_tokens_as_token_ids": True, "stream": False}


def companion_payload(c: Companion, model: str, max_model_len: int) -> dict[str, Any]:
    out = max(1, min(c.item.output_len, max_model_len // 2))
    prompt = c.item.prompt[: max(1, max_model_len - out - 1)]  # fit the server's context
    return {"model": model, "prompt": prompt, "max_tokens": out, "temperature": c.temperature,
            "ignore_eos": True, "stream": False}


# ---------------------------------------------------------------------------------- requests


async def post_completion(session, url: str, payload: dict[str, Any], timeout: float) -> tuple[Any, str | None, float]:
    """(answer JSON or None, error or None, seconds). Never raises except on cancellation."""
    import aiohttp

    t0 = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            body = await resp.read()
            if resp.status != 200:
                msg = client.error_message(body[:500].decode(errors="replace"))
                return None, f"HTTP {resp.status} {resp.reason}: {msg}", time.perf_counter() - t0
            return json.loads(body), None, time.perf_counter() - t0
    except asyncio.CancelledError:
        raise
    except asyncio.TimeoutError:
        return None, f"timeout after {timeout:g} s", time.perf_counter() - t0
    except Exception as e:  # connection refused, reset, malformed JSON
        return None, f"{type(e).__name__}: {e}", time.perf_counter() - t0


def parse_probe(doc: Any) -> dict[str, Any]:
    """Token ids (from ``token_id:N`` tokens), text tokens when the server gave no ids, logprobs."""
    choice = doc["choices"][0]
    lp = choice.get("logprobs") or {}
    tokens = list(lp.get("tokens") or [])
    ids = None
    if tokens and all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        ids = [int(t.split(":", 1)[1]) for t in tokens]
    return {"token_ids": ids, "tokens": None if ids is not None else tokens, "text": choice.get("text"),
            "logprobs": lp.get("token_logprobs"), "finish_reason": choice.get("finish_reason")}


async def run_round(session, url: str, probe: dict[str, Any], companions: list[dict[str, Any]],
                    offsets: list[float], spread: float, timeout: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    t0 = loop.time() + spread  # the earliest companion goes out now, the probe `spread` later

    async def at(offset: float, payload: dict[str, Any]):
        await asyncio.sleep(max(0.0, t0 + offset - loop.time()))
        return await post_completion(session, url, payload, timeout)

    # Sleeps are bounded by 2 * spread and requests by the timeout: the round is bounded.
    (doc, err, secs), *others = await asyncio.gather(at(0.0, probe), *(at(o, c) for o, c in zip(offsets, companions)))
    errors = collections.Counter(e for _, e, _ in others if e)
    rec: dict[str, Any] = {
        "companions": len(companions),
        "before": sum(o < 0 for o in offsets), "with": sum(o == 0 for o in offsets), "after": sum(o > 0 for o in offsets),
        "ok": err is None, "error": err, "latency_s": round(secs, 4),
        "companions_failed": sum(errors.values()), "companion_errors": dict(errors.most_common(3)),
    }
    if err is None:
        try:
            rec.update(parse_probe(doc))
        except (KeyError, IndexError, TypeError, ValueError) as e:
            rec.update(ok=False, error=f"malformed answer: {type(e).__name__}: {e}")
    return rec


async def probe_server(url: str, model: str, rounds: list[list[Companion]], args, max_model_len: int,
                       on_probe) -> list[dict[str, Any]]:
    import aiohttp

    records: list[dict[str, Any]] = []
    # limit=0: every companion of a round gets its own connection, none waits in the client.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        for i, comps in enumerate(rounds):
            if time.monotonic() - start > args.max_duration:
                break
            rec = await run_round(session, url, probe_payload(args, model),
                                  [companion_payload(c, model, max_model_len) for c in comps],
                                  [c.offset_s for c in comps], args.spread, args.request_timeout)
            records.append({"index": i, **rec})
            on_probe(records[-1])
    return records


async def server_info(url: str) -> dict[str, Any]:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        model = await client.server_model(session, url)
        _, version = await client.get_json(session, f"{url}/version")
    return {"model": model.get("id"), "root": model.get("root"), "max_model_len": model.get("max_model_len"),
            "server_version": (version or {}).get("version")}


# ---------------------------------------------------------------------------------- analysis


def completion_key(rec: dict[str, Any]) -> tuple:
    if rec.get("token_ids") is not None:
        return tuple(rec["token_ids"])
    return tuple(rec.get("tokens") or [rec.get("text")])


def _with_logprobs(rec: dict[str, Any]) -> tuple:
    return completion_key(rec), tuple(rec.get("logprobs") or ())


def _versus(rec: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """Where ``rec`` leaves the alone completion: first differing token, and the largest logprob
    difference on the tokens before it."""
    a, b = completion_key(alone), completion_key(rec)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    la, lb = alone.get("logprobs") or [], rec.get("logprobs") or []
    n = min(len(la), len(lb), len(a) if first is None else first)
    diffs = [abs(x - y) for x, y in zip(la[:n], lb[:n]) if x is not None and y is not None]
    return {"first_differing_token": first, "max_abs_logprob_diff": max(diffs, default=None)}


def analyse(records: list[dict[str, Any]], planned: int) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in ok:
        groups.setdefault(_with_logprobs(r), []).append(r)
    alone = records[0] if records and records[0]["ok"] and records[0]["companions"] == 0 else None
    s: dict[str, Any] = {
        "planned": planned, "sent": len(records), "ok": len(ok),
        "not_sent": planned - len(records),
        "probe_failures": len(records) - len(ok),
        "companion_requests": sum(r["companions"] for r in records),
        "companion_failures": sum(r["companions_failed"] for r in records),
        "distinct_completions": len({completion_key(r) for r in ok}),
        "distinct_with_logprobs": len(groups),
        "equal_to_alone": None, "equal_to_alone_with_logprobs": None,
    }
    if alone is not None:
        s["equal_to_alone"] = sum(completion_key(r) == completion_key(alone) for r in ok)
        s["equal_to_alone_with_logprobs"] = len(groups[_with_logprobs(alone)])
    variants = []
    for members in sorted(groups.values(), key=lambda m: (-len(m), m[0]["index"])):
        v = {"probes": len(members), "indices": [m["index"] for m in members],
             "companions_min": min(m["companions"] for m in members),
             "companions_max": max(m["companions"] for m in members),
             "is_alone": alone is not None and members[0] is groups[_with_logprobs(alone)][0]}
        if alone is not None:
            v.update(_versus(members[0], alone))
        variants.append(v)
    s["variants"] = variants
    return s


# -------------------------------------------------------------------------------------- run


def stock_backend() -> str:
    """vLLM's Triton MoE where CUDA is (the stock GPU kernel); ``auto`` elsewhere (CPU)."""
    try:
        import torch

        return "triton" if torch.cuda.is_available() else "auto"
    except Exception:
        return "auto"


def git_commit() -> dict[str, Any]:
    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": rev.stdout.strip() or None, "dirty": bool(dirty.stdout.strip()) if rev.returncode == 0 else None}


def _targets(args) -> list[dict[str, Any]] | str:
    """The servers to probe, or an error message (bad arguments)."""
    if args.url:
        try:
            targets = [{"name": n, "url": client.check_loopback(u), "moe_backend": None} for n, u in args.url]
        except ValueError as e:
            return str(e)
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if not modes or set(modes) - set(MODES):
            return f"--modes {args.modes!r}: a comma-separated list of {', '.join(MODES)}"
        targets = []
        for item in [b.strip() for b in args.backends.split(",") if b.strip()]:
            name, _, value = item.partition("=")
            value = value or {"stock": stock_backend, "kittens": lambda: "kittens"}.get(name, lambda: None)()
            if not value:
                return f"unknown backend {name!r}: use stock, kittens or NAME=MOE_BACKEND"
            targets += [{"name": f"{name}-{mode}", "url": None, "moe_backend": value, "mode": mode} for mode in modes]
    names = [t["name"] for t in targets]
    if not targets:
        return "no server to probe"
    if len(set(names)) != len(names):
        return f"server names must differ: {names}"
    for t in targets:
        t.update(events=[], probes=[])
    return targets


def _server_args(args, model: str, backend: str, mode: str) -> list[str]:
    extra = [a for arg in args.server_arg for a in shlex.split(arg)]
    cache = [] if args.prefix_caching else ["--no-enable-prefix-caching"]
    deterministic = ["--deterministic"] if mode == "deterministic" else []
    return [model, "--moe-backend", backend, *deterministic, *cache, *extra]


def _start(t: dict[str, Any], args, model: str, folder: Path) -> ServerProcess:
    # A default server gets the mode off explicitly, whatever this process's environment says.
    env = {} if t["mode"] == "deterministic" else {"VLLM_BATCH_INVARIANT": "0"}
    server_args = _server_args(args, model, t["moe_backend"], t["mode"])
    server = ServerProcess(server_args, env=env, startup_timeout=args.startup_timeout,
                           log_path=folder / f"server-{t['name']}.log")
    prefix = "".join(f"{k}={v} " for k, v in env.items())
    t.update(env=env, server_log=str(server.log_path), server_command=f"{prefix}mok-serve {shlex.join(server_args)}")
    try:
        server.start()
        t["url"] = server.url
    except ServerError as e:
        t["events"].append(f"server did not start: {str(e).splitlines()[0]}")
        t["server_log_tail"] = server.log()[-3000:]
    return server


def _died(server: ServerProcess | None) -> str | None:
    if server is None or server.proc is None or server.proc.poll() is None:
        return None
    tail = "\n".join(server.log().splitlines()[-5:])
    return f"server process exited with code {server.proc.returncode}; log tail:\n{tail}"


class _Bar:
    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="probe", dynamic_ncols=True, file=sys.stderr)

    def start(self, name: str) -> None:
        self.keys: set[tuple] = set()
        if self.bar is not None:
            self.bar.set_description(name)

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec["ok"]:
            self.keys.add(_with_logprobs(rec))
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(distinct=len(self.keys))

    def skip(self, n: int) -> None:
        if self.bar is not None and n > 0:
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run(args, targets: list[dict[str, Any]], model: str | None, folder: Path, bar: _Bar) -> None:
    """Start (or reach) each server and probe it; fills each target's probes, summary and events."""
    servers: dict[str, ServerProcess] = {}
    rounds = None
    try:
        if args.parallel_start and not args.url:
            bar.start("starting servers")
            with ThreadPoolExecutor(len(targets)) as pool:
                started = pool.map(lambda t: _start(t, args, model, folder), targets)
                servers = {t["name"]: s for t, s in zip(targets, started)}
        for t in targets:
            bar.start(t["name"])
            if t["moe_backend"] is not None and t["name"] not in servers:
                bar.start(f"{t['name']}: starting server")
                servers[t["name"]] = _start(t, args, model, folder)
                bar.start(t["name"])
            server = servers.get(t["name"])
            try:
                if t["url"] is not None:
                    rounds = _probe_target(t, args, model, rounds, bar)
            finally:
                if t["url"] is not None and (died := _died(server)):
                    t["events"].append(died)
                if server is not None and not args.parallel_start:
                    server.stop()
            t["summary"] = analyse(t["probes"], args.probes)
            bar.skip(args.probes - len(t["probes"]))
    finally:
        for s in servers.values():
            s.stop()


def _probe_target(t: dict[str, Any], args, model: str | None, rounds, bar: _Bar):
    try:
        t.update(asyncio.run(server_info(t["url"])))
    except Exception as e:
        t["events"].append(f"cannot read {t['url']}/v1/models: {e}")
        return rounds
    if rounds is None:  # one plan for every server: the first reachable one's vocabulary
        tok = args.tokenizer or model or t.get("root") or t.get("model")
        try:
            rounds = plan_rounds(args, workload.vocab_of(workload.load_tokenizer(tok)))
        except Exception as e:
            t["events"].append(f"cannot load the tokenizer {tok!r} for companion prompts "
                               f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); pass --tokenizer")
            return None
    try:
        asyncio.run(probe_server(t["url"], t["model"], rounds, args, int(t.get("max_model_len") or 2048),
                                 lambda rec: (t["probes"].append(rec), bar(rec))))
    except Exception as e:  # keep what was measured; say what broke
        t["events"].append(f"probing aborted: {type(e).__name__}: {e}")
    return rounds


def exit_code_of(results: dict[str, Any]) -> int:
    for t in results["targets"]:
        s = t.get("summary") or {}
        if t["events"] or not s.get("ok") or s.get("probe_failures") or s.get("companion_failures"):
            return EXIT_FAILED
    return EXIT_OK


# ---------------------------------------------------------------------------------- output


def _of(n: int | None, total: int) -> str:
    return "n/a" if n is None else f"{n}/{total}"


def markdown(results: dict[str, Any]) -> str:
    c = results["config"]
    commit = results["commit"]
    lines = [
        "# Batch invariance at the server (mok-loadtest invariance)", "",
        f"- command: `{c['command']}`",
        f"- commit: {commit['commit'] or 'unknown'}{' (with uncommitted changes)' if commit['dirty'] else ''}",
        f"- model: {c['model'] or 'as served'}; started servers' modes: {c['modes'] if not c['urls'] else 'as served'}",
        f"- probe: {c['probes']} x {c['prompt']!r}, greedy, max_tokens {c['max_tokens']}, logprobs 1; probe 0 alone, "
        f"probe i with 0..{c['max_batch']} companions (seed {c['seed']}) sent up to {c['spread']:g} s before, "
        f"with or after it",
        f"- started {results['started']}, finished {results.get('finished')}", "",
        "| server | MoE backend | probes | distinct completions | distinct with logprobs | equal to alone | "
        "equal to alone with logprobs | failed requests |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for t in results["targets"]:
        s = t["summary"]
        failed = s["probe_failures"] + s["companion_failures"]
        lines.append(f"| {t['name']} | {t.get('moe_backend') or 'as served'} | {s['ok']}/{s['planned']} | "
                     f"{s['distinct_completions']} | {s['distinct_with_logprobs']} | {_of(s['equal_to_alone'], s['ok'])} | "
                     f"{_of(s['equal_to_alone_with_logprobs'], s['ok'])} | {failed} |")
    lines += ["", "\"equal to alone\" counts probe 0 itself. Probes compared by token ids; \"with logprobs\" also "
              "by the chosen tokens' logprobs, bitwise (JSON floats round-trip exactly)."]
    for t in results["targets"]:
        s = t["summary"]
        lines += ["", f"## {t['name']}", "",
                  f"- url: {t.get('url')}; server: {t.get('server_command', 'running (--url)')}; "
                  f"vLLM {t.get('server_version') or 'unknown'}",
                  f"- {s['sent']} probes sent ({s['not_sent']} not sent, --max-duration), {s['probe_failures']} failed; "
                  f"{s['companion_requests']} companions, {s['companion_failures']} failed"]
        lines += [f"- **{e}**" for e in t["events"]]
        if s["variants"]:
            lines += ["", "| variant | probes | companions | first token differing from alone | "
                      "max abs logprob diff before it | first probes |", "|---|---|---|---|---|---|"]
            for k, v in enumerate(s["variants"][:10]):
                label = "alone" if v["is_alone"] else str(k + 1)
                first = "-" if v.get("first_differing_token") is None else v["first_differing_token"]
                diff = "-" if v.get("max_abs_logprob_diff") is None else f"{v['max_abs_logprob_diff']:.3g}"
                lines.append(f"| {label} | {v['probes']} | {v['companions_min']}-{v['companions_max']} | {first} | "
                             f"{diff} | {', '.join(map(str, v['indices'][:8]))} |")
            if len(s["variants"]) > 10:
                lines.append(f"\n{len(s['variants']) - 10} more variants in invariance.json.")
    return "\n".join(lines) + "\n"


def summary_text(results: dict[str, Any], folder: Path, code: int) -> str:
    lines = ["", "mok-loadtest invariance: distinct completions of one greedy probe, alone and in batches"]
    for t in results["targets"]:
        s = t["summary"]
        lines.append(f"  {t['name']:<10} {s['ok']:>4}/{s['planned']} probes: {s['distinct_completions']} distinct, "
                     f"{s['distinct_with_logprobs']} with logprobs; equal to alone {_of(s['equal_to_alone'], s['ok'])} "
                     f"({_of(s['equal_to_alone_with_logprobs'], s['ok'])} with logprobs); "
                     f"failed requests {s['probe_failures'] + s['companion_failures']}")
        lines += [f"  {'':<10} {e.splitlines()[0]}" for e in t["events"]]
    lines += [f"  results: {folder / 'invariance.json'}", f"  report:  {folder / 'invariance.md'}",
              f"  exit status {code}" + (" (requests failed or a server was not usable)" if code else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a bad argument (argparse says which)
        return int(e.code or 0)
    targets = _targets(args)
    error = _usage_error(args) or (targets if isinstance(targets, str) else None)
    if error:
        print(f"mok-loadtest invariance: {error}", file=sys.stderr)
        return EXIT_USAGE
    model = args.model
    if model is None and not args.url:
        from mok_serve import tiny_models

        model = str(tiny_models.build_tiny_model(args.tiny_family or tiny_models.DEFAULT_FAMILY))
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = Path(args.out or f"mok-loadtest-results/invariance-{stamp}").resolve()
    folder.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "tool": "mok-loadtest invariance",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": git_commit(),
        "environment": {**environment(), "VLLM_BATCH_INVARIANT (this process)": os.environ.get("VLLM_BATCH_INVARIANT")},
        "config": {**{k: v for k, v in vars(args).items() if k != "url"}, "urls": dict(args.url), "model": model,
                   "command": "mok-loadtest invariance " + shlex.join(argv)},
        "targets": targets,
    }
    bar = _Bar(args.probes * len(targets), args.progress)
    try:
        run(args, targets, model, folder, bar)
    except KeyboardInterrupt:
        results["interrupted"] = True
        for t in targets:
            t["events"].append("interrupted by the user")
    finally:
        bar.close()
    for t in targets:
        t.setdefault("summary", analyse(t["probes"], args.probes))
    results["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    code = results["exit_code"] = exit_code_of(results)
    (folder / "invariance.json").write_text(json.dumps(results, indent=1, default=str))
    (folder / "invariance.md").write_text(markdown(results))
    print(summary_text(results, folder, code))
    return code


if __name__ == "__main__":
    sys.exit(main())
