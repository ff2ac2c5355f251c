"""Output tokens/s of a mok-serve server with per-layer timing on vs off (not a timed test).

    python -m mok_serve.server.bench_timing [--prompts 64] [--concurrency 8] [--max-tokens 64] [--rounds 16]

Starts both servers on loopback (the embedded tiny model, kittens; timing on and off), then sends
the same random-prompt workload with ``ignore_eos`` (fixed output length) to one and the other in
alternation, round after round, so a slow spell of a shared machine hits both settings alike.
During a round the other server is frozen (SIGSTOP to its process group): on a 2-core machine its
processes would otherwise compete for the cores the measured one runs on. Prints tokens/s per
round, and the median and a bootstrap 95% interval of the on/off ratio over the paired rounds.
"""

import argparse
import contextlib
import random
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=16)
    ap.add_argument("--backend", default="kittens")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(64)] for _ in range(a.prompts)]
    settings = {"on": "1", "off": "0"}
    with contextlib.ExitStack() as stack:
        servers = {
            label: stack.enter_context(
                ServerProcess(["--max-model-len", "1024", "--moe-backend", a.backend, "--kittens-timing", n])
            )
            for label, n in settings.items()
        }
        clients = {label: stack.enter_context(httpx.Client(base_url=s.url, timeout=600)) for label, s in servers.items()}
        model = clients["on"].get("/v1/models").json()["data"][0]["id"]
        rates = {label: [] for label in settings}
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
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    lo, hi = median_interval(ratios)
    print(f"median on/off ratio over {a.rounds} paired rounds: {statistics.median(ratios):.3f} "
          f"(95% interval {lo:.3f}-{hi:.3f}; range {min(ratios):.3f}-{max(ratios):.3f}); "
          f"median tok/s on {statistics.median(rates['on']):.0f}, off {statistics.median(rates['off']):.0f}")


if __name__ == "__main__":
    main()
