"""Output tokens/s of a mok-serve server with per-layer timing on vs off (not a timed test).

    python -m mok_serve.server.bench_timing [--prompts 32] [--concurrency 8] [--max-tokens 64] [--rounds 3]

Starts one server per setting on loopback (the embedded tiny model, kittens), sends the same
random-prompt workload with ``ignore_eos`` (fixed output length), and prints tokens/s per round
and the best round per setting.
"""

import argparse
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mok_serve.server_process import ServerProcess


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
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--backend", default="kittens")
    a = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(64)] for _ in range(a.prompts)]
    best = {}
    for label, n in (("on", "1"), ("off", "0")):
        args = ["--max-model-len", "1024", "--moe-backend", a.backend, "--kittens-timing", n]
        with ServerProcess(args) as s:
            model = httpx.get(f"{s.url}/v1/models").json()["data"][0]["id"]
            run_round(s.url, model, prompts[: a.concurrency], 16, a.concurrency)  # warm-up
            rates = [run_round(s.url, model, prompts, a.max_tokens, a.concurrency) for _ in range(a.rounds)]
        print(f"timing {label}: " + ", ".join(f"{r:.0f}" for r in rates) + " output tok/s", flush=True)
        best[label] = max(rates)
    print(f"best: on {best['on']:.0f}, off {best['off']:.0f} tok/s; on/off = {best['on'] / best['off']:.3f}")


if __name__ == "__main__":
    main()
