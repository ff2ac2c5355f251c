"""Helpers for tests that talk to real servers."""

import importlib.util
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import pytest
import torch

# Real servers need vLLM and the official client. Where they are missing (the GPU machines, where
# `pytest -m gpu tests` collects every module) the server test modules are skipped at import.
if importlib.util.find_spec("vllm") is None:
    pytest.skip("real servers need vLLM", allow_module_level=True)
openai = pytest.importorskip("openai")

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a kingdom by the sea,",
    "def fibonacci(n):",
    "Kittens are small cats that",
    "The mixture of experts layer routes each token",
    "In 1969 the first person walked on",
]


def client(server, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=300)


def model_id(server) -> str:
    return client(server).models.list().data[0].id


def greedy(server, prompt: str, max_tokens: int = 24) -> str:
    c = client(server)
    out = c.completions.create(model=model_id(server), prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out.choices[0].text


def greedy_all(server, prompts=PROMPTS, max_tokens: int = 24, concurrent: bool = False) -> list[str]:
    if not concurrent:
        return [greedy(server, p, max_tokens) for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: greedy(server, p, max_tokens), prompts))


def greedy_logprobs(server, prompts=PROMPTS, max_tokens: int = 24) -> list[tuple[list[str], list[list[float]]]]:
    """Per prompt: the greedy tokens and, at each of them, the two highest logprobs (descending)."""
    c, model = client(server), model_id(server)
    out = []
    for p in prompts:
        lp = c.completions.create(model=model, prompt=p, max_tokens=max_tokens, temperature=0, logprobs=2)
        lp = lp.choices[0].logprobs
        out.append((lp.tokens, [sorted(top.values(), reverse=True) for top in lp.top_logprobs]))
    return out


def greedy_drift(got, expected) -> list[dict]:
    """Per prompt of two ``greedy_logprobs`` results: ``same`` (greedy tokens in common before the
    first that differs), ``worst`` (largest difference of the greedy token's logprob over them, nats)
    and ``margin`` (the expected top two's gap where a token differs, else None)."""
    out = []
    for (tokens, top), (tokens1, top1) in zip(got, expected, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(tokens, tokens1)) if a != b), len(tokens1))
        worst = max((abs(a[0] - b[0]) for a, b in zip(top[:same], top1[:same])), default=0.0)
        margin = top1[same][0] - top1[same][1] if same < len(tokens1) else None
        out.append(dict(same=same, tokens=len(tokens1), worst=worst, margin=margin))
    return out


# A last-bit difference in a MoE layer's input (another summation order, TP's split dense sums, FP8's
# per-group activation scales) can flip one token's expert choice where the router's top-k is near a
# tie. That moves the logprobs at that position by far more than rounding, while its neighbours stay
# close. Measured: bf16 kittens vs stock on the H200 up to 0.53 nats (deepseek_v3), FP8 0.60; CPU
# deepseek_v3_fp8 TP2 + EP vs TP1 on an AVX-512 EPYC: 142 of 144 greedy tokens within 0.12 nats,
# two isolated positions at 0.52 and 0.61, every token equal.
ROUTING_FLIP_DRIFT = 1.0


def assert_greedy_agrees(got, expected, near: float, drift: float = ROUTING_FLIP_DRIFT) -> None:
    """``greedy_logprobs`` results that agree within rounding: the greedy tokens' logprobs within
    ``drift`` nats up to the first token that differs, which must be one where the expected top two
    were within ``near`` of each other."""
    for p, d in enumerate(greedy_drift(got, expected)):
        assert d["worst"] <= drift, f"prompt {p}: a greedy token's logprob moved by {d['worst']:.3f} nats"
        if d["margin"] is not None:
            assert d["margin"] <= near, (
                f"prompt {p}: token {d['same']} differs where the expected top two were {d['margin']:.3f} apart"
            )


def dequantized_copy(fp8_dir, out):
    """The FP8 tiny model with its experts dequantized to bf16: the same weights, unquantized."""
    from safetensors.torch import load_file, save_file

    from mok_serve.kernels.fp8 import dequantize_fp8_blocks

    shutil.copytree(fp8_dir, out)
    weights = load_file(str(fp8_dir / "model.safetensors"))
    scales = {k.removesuffix("_scale_inv"): weights.pop(k) for k in list(weights) if k.endswith("_scale_inv")}
    for name, scale in scales.items():
        weights[name] = dequantize_fp8_blocks(weights[name], scale).to(torch.bfloat16)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


class Streamed(NamedTuple):
    pieces: list[str]  # the text of each chunk
    finish: str | None  # the last finish reason sent, "dropped" where the client hung up
    tokens: int | None  # completion tokens in the final usage chunk (None: none came)


class _StreamReader:
    """Folds a completion stream's lines into a Streamed. A chunk without choices other than the
    usage chunk (an error event) raises KeyError, as the error ends the stream."""

    def __init__(self):
        self.pieces, self.finish, self.tokens = [], None, None

    def feed(self, line: str) -> None:
        if not line.startswith("data: ") or line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if chunk.get("usage") and not chunk.get("choices"):
            self.tokens = chunk["usage"]["completion_tokens"]
            return
        choice = chunk["choices"][0]
        self.pieces.append(choice["text"])
        self.finish = choice.get("finish_reason") or self.finish

    def result(self) -> Streamed:
        return Streamed(self.pieces, self.finish, self.tokens)


def _stream_body(model, prompt, max_tokens) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip


def stream_completion(server, model, prompt, max_tokens, *, headers=None, stop_after=None) -> Streamed:
    """A streamed greedy completion with ``ignore_eos`` and a final usage chunk; with ``stop_after``,
    the connection is dropped after that many chunks."""
    import httpx

    reader = _StreamReader()
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as c, \
            c.stream("POST", "/v1/completions", json=_stream_body(model, prompt, max_tokens)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            reader.feed(line)
            if stop_after is not None and len(reader.pieces) >= stop_after:
                return Streamed(reader.pieces, "dropped", None)
    return reader.result()


def stream_all(server, model, prompts, max_tokens, *, during=None, timeout=300) -> list:
    """Streams every prompt at once (as stream_completion) and, once they are sent, awaits the
    coroutine function ``during`` beside them; returns each stream's Streamed, or the exception that
    ended it, after at most ``timeout`` seconds more. One thread runs every stream (asyncio): on two
    busy cores a thread per stream lags behind the server, and in CI a pool once hung starting one."""
    import asyncio

    import httpx

    async def one(c, prompt):
        reader = _StreamReader()
        try:
            async with c.stream("POST", "/v1/completions", json=_stream_body(model, prompt, max_tokens)) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    reader.feed(line)
        except Exception as exc:  # noqa: BLE001 - what ended the stream is the caller's to judge
            return exc
        return reader.result()

    async def run():
        limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=timeout, limits=limits) as c:
            streams = [asyncio.create_task(one(c, p)) for p in prompts]
            if during is not None:
                await during()
            return await asyncio.wait_for(asyncio.gather(*streams), timeout)

    return asyncio.run(run())
