"""The ``vllm.endpoint_plugins`` entry point ``kittens``: our routes on vLLM's own FastAPI app.

vLLM loads endpoint plugins in the API server process only, and only when they are named in
``VLLM_PLUGINS`` (``mok-serve`` sets that). Routes:

- ``GET /v1/kittens/layers``: per-layer MoE timing and expert load from every rank (schema in
  ``stats.py``), read from the workers with ``collective_rpc`` through the worker extension
  ``mok_serve.vllm.timing.KittensWorkerExtension``.
- ``POST /v1/kittens/layers/reset``: clears the window (Prometheus counters keep counting).

Both count from the moment the server starts serving: the calls vLLM makes while it starts
(memory profiling, warm-up, CUDA-graph capture) are forgotten by ``init_state``.
- ``GET /kittens``: a live page (static HTML + canvas, no external assets).
- ``/metrics`` (vLLM's): our ``kittens:*`` histograms, counters and gauges, refreshed from the
  workers just before each scrape.

``/v1/...`` routes sit behind vLLM's ``--api-key`` middleware like vLLM's own; ``/kittens`` is a
static shell (like ``/health`` and ``/metrics``, outside ``/v1``) that asks for the key when
its data request gets 401.
"""

from __future__ import annotations

import asyncio
from argparse import Namespace
from http import HTTPStatus
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse

from .stats import KittensCollector, merge

NAME = "kittens"
STATS_RPC = "kittens_layer_stats"
RESET_RPC = "kittens_layer_reset"
RESTART_RPC = "kittens_layer_restart"
RPC_TIMEOUT_S = 30.0

_collector: KittensCollector | None = None


def _error(message: str, status: HTTPStatus) -> JSONResponse:
    """vLLM's error shape (``ErrorResponse``)."""
    return JSONResponse(
        {"error": {"message": message, "type": status.phrase, "param": None, "code": status.value}},
        status_code=status.value,
    )


def _page() -> str:
    return resources.files(__package__).joinpath("static/kittens.html").read_text()


class KittensEndpointPlugin:
    name = NAME
    required_tasks = ("generate",)

    def __init__(self):
        self.engine_client = None
        self._lock: asyncio.Lock | None = None

    async def fetch(self) -> list[dict]:
        if self.engine_client is None:
            raise RuntimeError("no engine")
        snapshots = await self.engine_client.collective_rpc(STATS_RPC, timeout=RPC_TIMEOUT_S)
        if _collector is not None:
            _collector.snapshots = snapshots
        return snapshots

    def attach_router(self, app: FastAPI) -> None:
        router = APIRouter()
        plugin = self

        @router.get("/v1/kittens/layers")
        async def kittens_layers(request: Request):
            try:
                snapshots = await plugin.fetch()
            except Exception as e:  # the worker extension is missing, or the engine is down
                return _error(f"per-layer MoE stats are unavailable: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
            return JSONResponse(merge(snapshots))

        @router.post("/v1/kittens/layers/reset")
        async def kittens_layers_reset(request: Request):
            try:
                cleared = await plugin.engine_client.collective_rpc(RESET_RPC, timeout=RPC_TIMEOUT_S)
            except Exception as e:
                return _error(f"per-layer MoE stats are unavailable: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
            return JSONResponse({"object": "kittens.layers.reset", "layers_cleared": cleared})

        @router.get("/kittens", response_class=HTMLResponse)
        async def kittens_page():
            return HTMLResponse(_page(), headers={"Cache-Control": "no-store"})

        app.include_router(router)
        app.add_middleware(_RefreshBeforeScrape, plugin=self)

    async def init_state(self, engine_client, state, args: Namespace) -> None:
        global _collector
        self.engine_client = engine_client
        if engine_client is None:
            return
        try:  # count from here, for both routes: not vLLM's start-up profiling and warm-up calls
            await engine_client.collective_rpc(RESTART_RPC, timeout=RPC_TIMEOUT_S)
        except Exception:
            pass  # no worker extension: the routes answer 503
        if _collector is not None:
            return
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        _collector = KittensCollector()
        get_prometheus_registry().register(_collector)


class _RefreshBeforeScrape:
    """ASGI middleware: read the workers' stats before vLLM's ``/metrics`` renders."""

    def __init__(self, app, plugin: KittensEndpointPlugin):
        self.app, self.plugin = app, plugin

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].rstrip("/").endswith("/metrics") and _collector is not None:
            try:
                await self.plugin.fetch()
            except Exception:
                pass  # serve vLLM's metrics with the last snapshot
        await self.app(scope, receive, send)


def plugin() -> KittensEndpointPlugin:
    return KittensEndpointPlugin()
