"""A tiny fake OpenAI-style completions server on loopback, for testing mok-loadtest's handling of
failures without vLLM: it streams ``max_tokens`` chunks with a fixed gap, and can fail requests,
die mid-stream, stall or bunch a stream (all its tokens at once at its end).

A request with ``"stream": false`` gets one JSON answer instead, after the same delays, with
``logprobs`` (tokens as ``token_id:N`` under ``return_tokens_as_token_ids``) that are a function
of the prompt alone, as a batch-invariant server's greedy output is; ``--batch-variance`` makes
them depend on how many requests are in flight, as a batch-variant server's may.

    python -m mok_serve.loadtest.fake_server --port 8123 [--fail-every 3] [--die-after 10]
        [--stall-after 5] [--bunch-every 4 [--bunch-merged]] [--token-gap 0.002] [--root PATH] [--layers]
        [--batch-variance none|logprobs|tokens]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import zlib

from aiohttp import web


def make_app(args) -> web.Application:
    state = {"n": 0, "inflight": 0, "tokens": 0, "window_started": time.time()}

    async def health(request):
        return web.Response(text="")

    async def models(request):
        return web.json_response(
            {"object": "list", "data": [{"id": "fake-model", "object": "model", "root": args.root, "max_model_len": 4096}]}
        )

    async def layers(request):
        if not args.layers:
            raise web.HTTPNotFound()
        return web.json_response(fake_layers_document(state["tokens"], time.time() - state["window_started"]))

    async def layers_reset(request):
        if not args.layers:
            raise web.HTTPNotFound()
        state["tokens"], state["window_started"] = 0, time.time()
        return web.json_response({"ok": True})

    async def completions(request):
        state["inflight"] += 1
        try:
            return await completion(request, state["inflight"])
        finally:
            state["inflight"] -= 1

    async def completion(request, inflight):
        body = await request.json()
        state["n"] += 1
        n = state["n"]
        if args.fail_every and n % args.fail_every == 0:
            return web.json_response(
                {"error": {"message": f"fake failure of request {n}", "type": "InternalServerError", "code": 500}},
                status=500,
            )
        prompt = body.get("prompt")
        prompt_len = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        max_tokens = int(body.get("max_tokens") or 16)
        if body.get("stream") is False:
            return await whole_completion(body, n, prompt, prompt_len, max_tokens, inflight)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(args.ttft)
        if args.bunch_every and n % args.bunch_every == 0:
            await bunched_tokens(resp, n, max_tokens)
        else:
            await spread_tokens(resp, n, max_tokens)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens, "total_tokens": prompt_len + max_tokens}
        await resp.write(f"data: {json.dumps({'id': f'cmpl-{n}', 'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def spread_tokens(resp, n, max_tokens):
        for i in range(max_tokens):
            if args.die_after and n > args.die_after and i == max_tokens // 2:
                sys.stdout.flush()
                os._exit(3)  # the server dies mid-stream
            if args.stall_after and n > args.stall_after and i == max_tokens // 2:
                await asyncio.sleep(3600)
            await resp.write(sse_chunk(n, f" t{i}"))
            state["tokens"] += 1
            await asyncio.sleep(args.token_gap)

    async def bunched_tokens(resp, n, max_tokens):
        # All tokens held back for as long as streaming them would take, then sent in one write:
        # what a client sees of a server whose HTTP front end fell behind (vLLM's on busy cores).
        await asyncio.sleep(args.token_gap * max_tokens)
        texts = [f" t{i}" for i in range(max_tokens)]
        await resp.write(b"".join(sse_chunk(n, t) for t in (["".join(texts)] if args.bunch_merged else texts)))
        state["tokens"] += max_tokens

    async def whole_completion(body, n, prompt, prompt_len, max_tokens, inflight):
        await asyncio.sleep(args.ttft + args.token_gap * max_tokens / 2)
        if args.die_after and n > args.die_after:
            sys.stdout.flush()
            os._exit(3)
        if args.stall_after and n > args.stall_after:
            await asyncio.sleep(3600)
        await asyncio.sleep(args.token_gap * max_tokens / 2)
        # Outputs are a function of the prompt; "in flight" (counted when the request came in,
        # itself included) stands for the batch a real server would have put it in.
        h = zlib.crc32(json.dumps(prompt).encode())
        ids = [(h + 7919 * i) % 1000 for i in range(max_tokens)]
        lps = [-1.0 - (t % 13) / 16 for t in ids]  # exact binary fractions
        if args.batch_variance == "logprobs":
            lps = [lp - 2.0**-20 * (inflight - 1) for lp in lps]
        elif args.batch_variance == "tokens" and inflight > 1:
            ids[-1] = (ids[-1] + inflight) % 1000
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        tokens = [f"token_id:{t}" if as_ids else f" t{t}" for t in ids]
        choice = {"index": 0, "text": "".join(f" t{t}" for t in ids), "finish_reason": "length", "logprobs": None}
        if body.get("logprobs") is not None:
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": lps,
                                  "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)],
                                  "text_offset": [3 * i for i in range(max_tokens)]}
        usage = {"prompt_tokens": prompt_len, "completion_tokens": max_tokens, "total_tokens": prompt_len + max_tokens}
        return web.json_response({"id": f"cmpl-{n}", "object": "text_completion", "created": int(time.time()),
                                  "model": "fake-model", "choices": [choice], "usage": usage})

    async def version(request):
        return web.json_response({"version": "fake"})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/version", version)
    app.router.add_get("/v1/kittens/layers", layers)
    app.router.add_post("/v1/kittens/layers/reset", layers_reset)
    app.router.add_post("/v1/completions", completions)
    return app


def fake_layers_document(tokens: int, seconds: float, num_layers: int = 2) -> dict:
    """GET /v1/kittens/layers as mok-serve answers it (server/stats.py), for a server whose every
    streamed token is a forward step of one token through each MoE layer, taking 0.1 ms + 0.01 ms
    per layer index."""
    def latency(i):
        mean = 0.1 + 0.01 * i
        return {"mean": mean, "p50": mean, "p90": mean, "p99": mean, "max": mean, "samples": tokens} if tokens else None

    spread = [tokens // 4 + (e < tokens % 4) for e in range(4)]  # top-1 slots over 4 experts, as even as can be
    rank = {"rank": 0, "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "ep_rank": 0, "ep_size": 1, "pid": os.getpid()}
    return {
        "object": "kittens.layers", "backend": "fake",
        "timing": {"enabled": True, "sample_every": 1, "window_calls": 1024},
        "window": {"started_at": time.time() - seconds, "seconds": seconds,
                   "latency": "last window_calls sampled calls since started_at",
                   "counts": "every call since started_at"},
        "clock": "host steady_clock", "max_cudagraph_capture_size": None, "ranks": [rank], "num_layers": num_layers,
        "layers": [{"index": i, "name": f"model.layers.{i}.mlp.experts", "num_experts": 4, "top_k": 1,
                    "ep_imbalance": 1.0 if tokens else None,
                    "ranks": [{"rank": 0, "ep_rank": 0, "ep_size": 1, "experts_class": "FakeExperts",
                               "local_experts": [0, 1, 2, 3], "calls": tokens, "tokens": tokens,
                               "sampled_calls": tokens, "latency_ms": latency(i), "phases_ms": None,
                               "expert_tokens": spread, "local_expert_tokens": tokens,
                               "imbalance": max(spread) / (tokens / 4) if tokens else None}]}
                   for i in range(num_layers)],
    }


def sse_chunk(n: int, text: str) -> bytes:
    chunk = {"id": f"cmpl-{n}", "object": "text_completion", "created": int(time.time()),
             "model": "fake-model", "choices": [{"index": 0, "text": text, "finish_reason": None}]}
    return f"data: {json.dumps(chunk)}\n\n".encode()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_serve.loadtest.fake_server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fail-every", type=int, default=0, help="answer HTTP 500 to every N-th request")
    p.add_argument("--die-after", type=int, default=0, help="exit mid-stream in the first request after N")
    p.add_argument("--stall-after", type=int, default=0, help="stop sending mid-stream in requests after N")
    p.add_argument("--bunch-every", type=int, default=0,
                   help="stream every N-th request bunched: all its tokens in one write at its end")
    p.add_argument("--bunch-merged", action="store_true",
                   help="with --bunch-every: those tokens as one chunk (as vLLM merges outputs it could not send)")
    p.add_argument("--token-gap", type=float, default=0.002, help="seconds between streamed tokens")
    p.add_argument("--ttft", type=float, default=0.005, help="seconds before the first token")
    p.add_argument("--root", default="", help="the 'root' reported by /v1/models (a tokenizer path)")
    p.add_argument("--layers", action="store_true",
                   help="serve a fake GET /v1/kittens/layers (mok-serve's schema; a step per streamed token)")
    p.add_argument("--batch-variance", choices=("none", "logprobs", "tokens"), default="none",
                   help="non-streamed answers: with more than one request in flight, shift the logprobs or "
                   "change the last token (default: none, a function of the prompt only)")
    args = p.parse_args(argv)
    web.run_app(make_app(args), host="127.0.0.1", port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
