"""Output tokens/s of a mok-serve server with per-layer timing on vs off (not a timed test).

    python -m mok_serve.server.bench_timing [--prompts 64] [--concurrency 8] [--max-tokens 64] [--rounds 8]

Starts both servers on loopback at once (the embedded tiny model, kittens; timing on and off),
then sends the same random-prompt workload with ``ignore_eos`` (fixed output length) to one and
the other in alternation, round after round: a slow spell of a shared machine then hits both
settings alike (each round starts after the other server's workers have stopped polling). Prints tokens/s per round, and
the median over rounds of the on/off ratio of each pair of consecutive rounds.
"""

import argparse
import contextlib
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mok_serve.server_process import ServerProcess


# vLLM's workers keep polling for a second after their last request (shm_broadcast's busy loop);
# both servers' workers are pinned to the same cores, so each round waits that out first.
IDLE_S = 2.0


def run_round(url, model, prompts, max_tokens, concurrency):
    def one(p):
        with httpx.Client(base_url=url, timeout=600) as c:
            r = c.post("/v1/completions", json={"model": model, "prompt": p, "max_tokens": max_tokens,
                                                "temperature": 0, "ignore_eos": True})  # fmt: skip
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        tokens = sum(pool.map(one, prompts))
    return tokens / (time.perf_counter() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
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
        model = httpx.get(f"{servers['on'].url}/v1/models").json()["data"][0]["id"]
        for s in servers.values():
            run_round(s.url, model, prompts[: a.concurrency], 16, a.concurrency)  # warm-up
        rates = {label: [] for label in settings}
        for i in range(a.rounds):
            # Alternate which setting goes first, so neither always follows the other.
            for label in (("on", "off") if i % 2 == 0 else ("off", "on")):
                time.sleep(IDLE_S)
                rates[label].append(run_round(servers[label].url, model, prompts, a.max_tokens, a.concurrency))
            print(f"round {i}: on {rates['on'][-1]:.0f}, off {rates['off'][-1]:.0f} output tok/s", flush=True)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"])]
    print(f"median on/off ratio over {a.rounds} paired rounds: {statistics.median(ratios):.3f} "
          f"(range {min(ratios):.3f}-{max(ratios):.3f}); median tok/s on {statistics.median(rates['on']):.0f}, "
          f"off {statistics.median(rates['off']):.0f}")


if __name__ == "__main__":
    main()
