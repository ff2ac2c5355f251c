"""Streaming ``/v1/completions`` requests timed as vLLM's benchmark times them, and small HTTP
helpers for the server's other routes. Every call has a timeout."""

from __future__ import annotations

import asyncio
import codecs
import json
import time
import urllib.parse
from typing import Any

import aiohttp

from .metrics import RequestRecord
from .workload import WorkItem

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_loopback(url: str) -> str:
    """``url`` without a trailing slash; raises ValueError unless it is http(s) on loopback."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not an http URL: {url!r}")
    host = parsed.hostname
    if host not in LOOPBACK_HOSTS and not host.startswith("127."):
        raise ValueError(f"{url}: mok-loadtest only talks to loopback servers (127.0.0.0/8, localhost, ::1)")
    return url.rstrip("/")


def build_payload(model: str, item: WorkItem, ignore_eos: bool, extra: dict[str, Any] | None) -> dict[str, Any]:
    """The body vLLM's ``async_request_openai_completions`` sends (same fields and defaults)."""
    payload: dict[str, Any] = {
        "model": model,
        "prompt": item.prompt,
        "repetition_penalty": 1.0,
        "max_tokens": item.output_len,
        "logprobs": None,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra:
        payload.update(extra)
    return payload


class SSEParser:
    """Splits a byte stream into SSE ``data:`` payloads (tolerates chunks cut anywhere)."""

    def __init__(self):
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def feed(self, chunk: bytes) -> list[str]:
        self.buffer += self._decoder.decode(chunk)
        out = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            for line in message.strip().split("\n"):
                if line.startswith("data:"):
                    out.append(line[5:].strip())
        return out


async def stream_completion(
    session: aiohttp.ClientSession,
    base_url: str,
    model: str,
    item: WorkItem,
    index: int,
    *,
    ignore_eos: bool = True,
    extra_body: dict[str, Any] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> RequestRecord:
    """One streamed request. Never raises (except cancellation): failures go into the record."""
    rec = RequestRecord(index=index, prompt_len=item.prompt_len, expected_output_len=item.output_len)
    payload = build_payload(model, item, ignore_eos, extra_body)
    st = time.perf_counter()
    rec.start_time = st
    last = st
    first = False
    try:
        kwargs = {"timeout": timeout} if timeout is not None else {}
        async with session.post(f"{base_url}/v1/completions", json=payload, **kwargs) as resp:
            rec.http_status = resp.status
            if resp.status != 200:
                body = (await resp.read())[:500].decode(errors="replace")
                rec.error = f"HTTP {resp.status} {resp.reason}: {error_message(body)}"
                return rec
            parser = SSEParser()
            done = False
            async for chunk in resp.content.iter_any():
                for data in parser.feed(chunk):
                    if data == "[DONE]":
                        done = True
                        continue
                    obj = json.loads(data)
                    if obj.get("error"):
                        raise StreamError(f"error in stream: {error_message(json.dumps(obj['error']))}")
                    if choices := obj.get("choices"):
                        now = time.perf_counter()
                        if not first:
                            first = True
                            rec.ttft = now - st
                        else:
                            rec.itl.append(now - last)
                        last = now
                        rec.generated_chars += len(choices[0].get("text") or "")
                    elif usage := obj.get("usage"):
                        rec.output_tokens = int(usage.get("completion_tokens") or 0)
                        if usage.get("prompt_tokens") is not None:
                            rec.prompt_len = int(usage["prompt_tokens"])
            if not first:
                rec.error = "stream ended without any token"
                return rec
            if not done:
                rec.error = "stream ended before [DONE] (server closed the connection)"
                return rec
            if not rec.output_tokens:  # no usage chunk: one token per chunk
                rec.output_tokens = len(rec.itl) + 1
            rec.latency = last - st
            rec.success = True
    except asyncio.CancelledError:
        raise
    except StreamError as e:
        rec.error = str(e)
    except asyncio.TimeoutError:
        rec.error = f"timeout after {time.perf_counter() - st:.1f} s (no data or request too long)"
    except aiohttp.ClientError as e:
        rec.error = f"{type(e).__name__}: {e}"
    except Exception as e:  # malformed stream and the like
        rec.error = f"{type(e).__name__}: {e}"
    return rec


class StreamError(RuntimeError):
    pass


def error_message(body: str) -> str:
    """The message of an error response body (OpenAI-style JSON or text), at most 200 characters."""
    try:
        obj = json.loads(body)
    except (json.JSONDecodeError, ValueError):
        return body.strip()[:200]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message", err))[:200]
        if isinstance(obj.get("message"), str):
            return obj["message"][:200]
        return str(err)[:200]
    return str(obj)[:200]


async def get_json(session: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> tuple[int, Any]:
    """(status, parsed JSON or None). Status 0 when the server cannot be reached."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                return resp.status, None
            try:
                return 200, await resp.json(content_type=None)
            except (json.JSONDecodeError, ValueError, aiohttp.ContentTypeError):
                return 200, None
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return 0, None


async def post(session: aiohttp.ClientSession, url: str, timeout: float = 10.0) -> int:
    try:
        async with session.post(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
        return 0


async def is_healthy(session: aiohttp.ClientSession, base_url: str, timeout: float = 10.0) -> bool:
    status, _ = await get_json(session, f"{base_url}/health", timeout)
    if status == 404:  # not a vLLM server: any answer from /v1/models will do
        status, _ = await get_json(session, f"{base_url}/v1/models", timeout)
    return status == 200


async def server_model(session: aiohttp.ClientSession, base_url: str, timeout: float = 10.0) -> dict[str, Any]:
    status, data = await get_json(session, f"{base_url}/v1/models", timeout)
    if status != 200 or not data or not data.get("data"):
        raise ConnectionError(f"{base_url}/v1/models answered {status or 'nothing'}")
    return data["data"][0]
