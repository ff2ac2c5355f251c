"""Output tokens/s of a mok-serve server with per-layer timing on vs off (not a timed test).

    python -m mok_serve.server.bench_timing [--prompts 64] [--concurrency 8] [--max-tokens 64] [--rounds 16]

Starts both servers on loopback (the embedded tiny model, kittens; timing on and off), then sends
the same random-prompt workload with ``ignore_eos`` (fixed output length) to one and the other in
alternation, round after round, so a slow spell of a shared machine hits both settings alike.
During a round the other server is frozen (SIGSTOP to its process group): on a 2-core machine its
processes would otherwise compete for the cores the measured one runs on. Prints tokens/s per
round, and the median and a bootstrap 95% interval of the on/off ratio over the paired rounds.

``--pinned``: both servers serve at the same time instead, each pinned to its own core (every
process, and vLLM's worker threads), so a change of the machine's speed hits both at the same
instant. The rounds are split into four blocks, one for each pairing of cores (which setting
gets cpu 0) and start order (which server starts first); the servers are restarted between
blocks, so a faster core or the first start cancels out.

``--pool LOG... --pool-control LOG...`` starts nothing: it pools the rounds that earlier timed
runs and A/A control runs printed (their logs), for timing's cost net of the method's own bias.
"""

import argparse
import contextlib
import os
import random
import re
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mok_serve.server_process import ServerProcess

SETTLE_S = 1.0  # after freezing the other server, before the round starts


def run_round(client, model, prompts, max_tokens, concurrency):
    def one(p):
        r = client.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                 "temperature": 0, "ignore_eos": True})  # fmt: skip
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def median_interval(ratios, draws=2000, seed=0):
    """Bootstrap 95% interval of the median."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


ROUND_LINE = re.compile(r"^round \d+ .*: on (\d+), off (\d+) output tok/s")


def logged_ratios(paths):
    """The paired on/off ratios of the rounds printed in earlier runs' logs."""
    ratios = []
    for path in paths:
        for line in open(path):
            m = ROUND_LINE.match(line)
            if m:
                ratios.append(int(m.group(1)) / int(m.group(2)))
    return ratios


def pooled(on_logs, control_logs, draws=4000, seed=0):
    """Pool the rounds of timed runs against those of A/A control runs: the on/off median of
    each, and their quotient (timing's cost net of the method's own bias) with a bootstrap 95%
    interval that resamples both sets of rounds."""
    on, aa = logged_ratios(on_logs), logged_ratios(control_logs)
    if not on or not aa:
        raise SystemExit("--pool needs round lines in both the timed and the control logs")
    rng = random.Random(seed)
    net = sorted(statistics.median(rng.choices(on, k=len(on))) / statistics.median(rng.choices(aa, k=len(aa)))
                 for _ in range(draws))
    print(f"timed: {len(on)} rounds, on/off median {statistics.median(on):.3f}, geometric mean "
          f"{statistics.geometric_mean(on):.3f}; A/A: {len(aa)} rounds, median {statistics.median(aa):.3f}, "
          f"geometric mean {statistics.geometric_mean(aa):.3f}; net of the A/A: median "
          f"{statistics.median(on) / statistics.median(aa):.3f} (95% interval {net[int(0.025 * draws)]:.3f}-"
          f"{net[int(0.975 * draws) - 1]:.3f})")


def start_servers(stack, backend, cores=None, control=False, order=("on", "off")):
    """Timing on and off (``control``: off on both, to measure the method's own bias), started
    in ``order``; with ``cores`` ({label: cpu}) each server pinned to its cpu."""
    servers = {}
    for label in order:
        n = "1" if label == "on" and not control else "0"
        pin = {} if cores is None else dict(env={"VLLM_CPU_OMP_THREADS_BIND": str(cores[label])}, cpus={cores[label]})
        args = ["--max-model-len", "1024", "--moe-backend", backend, "--kittens-timing", n]
        servers[label] = stack.enter_context(ServerProcess(args, **pin))
    clients = {label: stack.enter_context(httpx.Client(base_url=s.url, timeout=600)) for label, s in servers.items()}
    return servers, clients


def alternating_rounds(a, prompts):
    """Rounds alternate between the servers; the other one is frozen meanwhile."""
    rates = {"on": [], "off": []}
    with contextlib.ExitStack() as stack:
        servers, clients = start_servers(stack, a.backend, control=a.control)
        model = clients["on"].get("/v1/models").json()["data"][0]["id"]
        for i in range(a.rounds + 1):  # round 0 warms both up and is not counted
            # Alternate which setting goes first, so neither always follows the other.
            for label in (("on", "off") if i % 2 == 0 else ("off", "on")):
                other = servers["off" if label == "on" else "on"]
                other.pause()
                try:
                    time.sleep(SETTLE_S)
                    n = len(prompts) if i else a.concurrency
                    rate = run_round(clients[label], model, prompts[:n], a.max_tokens, a.concurrency)
                finally:
                    other.resume()
                if i:
                    rates[label].append(rate)
            if i:
                print(f"round {i}: on {rates['on'][-1]:.0f}, off {rates['off'][-1]:.0f} output tok/s", flush=True)
    return rates


# --pinned blocks: every pairing of cores and start order once, so neither a faster core nor
# being started first favours one setting.
PINNED_BLOCKS = (
    ({"on": 0, "off": 1}, ("on", "off")),
    ({"on": 1, "off": 0}, ("off", "on")),
    ({"on": 1, "off": 0}, ("on", "off")),
    ({"on": 0, "off": 1}, ("off", "on")),
)


def pinned_rounds(a, prompts):
    """Both servers at once, one core each; the servers are restarted for each of the four
    blocks of ``PINNED_BLOCKS``, which get a quarter of the rounds each."""
    rates = {"on": [], "off": []}
    blocks = []
    for cores, order in PINNED_BLOCKS:
        with contextlib.ExitStack() as stack:
            servers, clients = start_servers(stack, a.backend, cores, a.control, order)
            model = clients["on"].get("/v1/models").json()["data"][0]["id"]
            block = []
            for i in range(a.rounds // len(PINNED_BLOCKS) + 1):  # round 0 warms both up and is not counted
                n = len(prompts) if i else a.concurrency
                with ThreadPoolExecutor(2) as pool:
                    futures = {label: pool.submit(run_round, clients[label], model, prompts[:n], a.max_tokens,
                                                  a.concurrency) for label in clients}  # fmt: skip
                    round_rates = {label: f.result() for label, f in futures.items()}
                if i:
                    for label, r in round_rates.items():
                        rates[label].append(r)
                    block.append(round_rates["on"] / round_rates["off"])
                    print(f"round {len(rates['on'])} (on: cpu {cores['on']}, {order[0]} started first): "
                          f"on {round_rates['on']:.0f}, off {round_rates['off']:.0f} output tok/s", flush=True)
        blocks.append(statistics.median(block))
        print(f"block (on: cpu {cores['on']}, {order[0]} first): median on/off {blocks[-1]:.3f}", flush=True)
    print(f"geometric mean of the {len(blocks)} block medians: {statistics.geometric_mean(blocks):.3f}")
    return rates


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--backend", default="kittens")
    ap.add_argument("--pinned", action="store_true", help="both servers at once, one core each (see above)")
    ap.add_argument("--control", action="store_true",
                    help="A/A control: timing off on both servers, to measure the method's own bias")
    ap.add_argument("--pool", nargs="+", metavar="LOG",
                    help="start nothing: pool the rounds printed in these logs of timed runs ...")
    ap.add_argument("--pool-control", nargs="+", metavar="LOG", help="... against these logs of --control runs")
    a = ap.parse_args()
    if a.pool or a.pool_control:
        pooled(a.pool or [], a.pool_control or [])
        return
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(64)] for _ in range(a.prompts)]
    if a.pinned and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pinned needs 2 CPUs")
    rates = (pinned_rounds if a.pinned else alternating_rounds)(a, prompts)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    lo, hi = median_interval(ratios)
    print(f"median on/off ratio over {a.rounds} paired rounds: {statistics.median(ratios):.3f} "
          f"(95% interval {lo:.3f}-{hi:.3f}; range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"median tok/s on {statistics.median(rates['on']):.0f}, off {statistics.median(rates['off']):.0f}")


if __name__ == "__main__":
    main()
