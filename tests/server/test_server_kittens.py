"""The kittens server additions on real CPU servers: per-layer MoE timing and expert load
(`/v1/kittens/layers`, reset, `/metrics`, the `/kittens` page), `--api-key`, bad requests,
client disconnects and concurrency; kittens, stock (`--moe-backend auto`) and TP2 + EP."""

import json
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from serving_utils import PROMPTS, stream_completion

from mok_serve import tiny_models
from mok_serve.server_process import ServerError, ServerProcess, free_port

pytestmark = pytest.mark.server

KEY = "kittens-test-key"
COMMON = ["--max-model-len", "1024"]
AUTH = {"Authorization": f"Bearer {KEY}"}


class Server(ServerProcess):
    """ServerProcess that picks another port when its free port was taken before vLLM bound it
    (other servers on this machine open many loopback ports)."""

    def start(self):
        for attempt in range(3):
            try:
                return super().start()
            except ServerError as e:
                if "Address already in use" not in str(e) or attempt == 2:
                    raise
                self.port = free_port()


def moe_layer_names(model_dir: Path) -> list[str]:
    c = json.loads((Path(model_dir) / "config.json").read_text())
    return [
        f"model.layers.{i}.mlp.experts"
        for i in range(c["num_hidden_layers"])
        if i not in c.get("mlp_only_layers", []) and (i + 1) % c.get("decoder_sparse_step", 1) == 0
    ]


def http(server, headers=AUTH):
    return httpx.Client(base_url=server.url, headers=headers, timeout=300)


def model_of(server, headers=AUTH) -> str:
    with http(server, headers) as c:
        return c.get("/v1/models").json()["data"][0]["id"]


def greedy(server, prompt, max_tokens=24, headers=AUTH) -> str:
    with http(server, headers) as c:
        r = c.post(
            "/v1/completions",
            json={"model": model_of(server, headers), "prompt": prompt, "max_tokens": max_tokens,
                  "temperature": 0},
        )  # fmt: skip
        r.raise_for_status()
        return r.json()["choices"][0]["text"]


def layers(server) -> dict:
    with http(server) as c:
        r = c.get("/v1/kittens/layers")
        assert r.status_code == 200, r.text
        return r.json()


def assert_vllm_error(r: httpx.Response):
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["code"] == r.status_code


@pytest.fixture(scope="module")
def model_dir():
    return tiny_models.build_tiny_model()


@pytest.fixture(scope="module")
def server(model_dir):
    """kittens, timing on (mok-serve's default), behind an API key."""
    with Server([str(model_dir), "--api-key", KEY, *COMMON]) as s:
        yield s


def check_layers(doc, names, backend, ranks=(0,)):
    assert doc["object"] == "kittens.layers" and doc["timing"]["enabled"]
    assert doc["backend"] == backend
    assert [r["rank"] for r in doc["ranks"]] == list(ranks)
    assert [layer["name"] for layer in doc["layers"]] == names and doc["num_layers"] == len(names)
    for layer in doc["layers"]:
        assert [r["rank"] for r in layer["ranks"]] == list(ranks)
        for r in layer["ranks"]:
            assert len(r["expert_tokens"]) == layer["num_experts"]
            assert sum(r["expert_tokens"]) == r["tokens"] * layer["top_k"]


def test_timing_on_serves_the_same_greedy_output_as_off(server, model_dir):
    timed = [greedy(server, p) for p in PROMPTS]
    with Server([str(model_dir), "--kittens-timing", "0", *COMMON]) as untimed:
        assert [greedy(untimed, p, headers={}) for p in PROMPTS] == timed
        with http(untimed, {}) as c:
            doc = c.get("/v1/kittens/layers").json()
        assert doc["timing"]["enabled"] is False and doc["layers"] == []


def test_layers_list_every_moe_layer_with_growing_counts(server, model_dir):
    names = moe_layer_names(model_dir)
    before = layers(server)
    check_layers(before, names, "kittens")
    greedy(server, PROMPTS[0], max_tokens=16)
    after = layers(server)
    check_layers(after, names, "kittens")
    for b, a in zip(before["layers"], after["layers"]):
        (rb,), (ra,) = b["ranks"], a["ranks"]
        assert ra["calls"] >= rb["calls"] + 16 and ra["tokens"] > rb["tokens"]
        assert sum(ra["expert_tokens"]) > sum(rb["expert_tokens"])
        assert ra["latency_ms"]["samples"] > 0
        for k in ("mean", "p50", "p90", "p99"):
            assert ra["latency_ms"][k] > 0
        assert ra["latency_ms"]["p50"] <= ra["latency_ms"]["p90"] <= ra["latency_ms"]["p99"]
        assert ra["phases_ms"] is None  # one fused op on one rank: no phases to separate
        assert ra["imbalance"] >= 1.0 and ra["experts_class"] == "KittensExperts"


def metric_values(metrics: str, name: str) -> dict[str, float]:
    """``{layer: value}`` of one rank-0 ``kittens:*`` series in a Prometheus text page."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{") and 'rank="0"' in line:
            out[line.split('layer="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_layers_and_metrics_count_the_same_calls(server):
    # Runs before any reset (the test below): until then both count every call since serving
    # started, and neither the start-up profiling call nor the warm-up.
    greedy(server, PROMPTS[2], max_tokens=4)
    with http(server) as c:
        metrics = c.get("/metrics").text
        doc = c.get("/v1/kittens/layers").json()
    calls = metric_values(metrics, "kittens:moe_layer_calls_total")
    tokens = metric_values(metrics, "kittens:moe_layer_tokens_total")
    assert calls and len(calls) == len(doc["layers"])
    for layer in doc["layers"]:
        (r,) = layer["ranks"]
        assert (calls[str(layer["index"])], tokens[str(layer["index"])]) == (r["calls"], r["tokens"])


def test_reset_clears_the_window_and_metrics_keep_counting(server):
    greedy(server, PROMPTS[1], max_tokens=4)
    with http(server) as c:
        r = c.post("/v1/kittens/layers/reset")
        assert r.status_code == 200 and r.json()["object"] == "kittens.layers.reset"
        doc = c.get("/v1/kittens/layers").json()
        for layer in doc["layers"]:
            assert layer["ranks"][0]["calls"] == 0 and layer["ranks"][0]["latency_ms"] is None
        metrics = c.get("/metrics").text
    assert "vllm:" in metrics  # vLLM's own metrics are still there
    for name in (
        "kittens:moe_layer_latency_seconds_bucket",
        "kittens:moe_layer_latency_seconds_count",
        "kittens:moe_layer_calls_total",
        "kittens:moe_expert_tokens_total",
        "kittens:moe_expert_imbalance",
    ):
        assert name in metrics, name
    count = [
        line for line in metrics.splitlines()
        if line.startswith("kittens:moe_layer_latency_seconds_count") and 'phase="total"' in line
    ]  # fmt: skip
    assert count and all(float(line.rsplit(" ", 1)[1]) > 0 for line in count)


def test_api_key_guards_our_routes_like_vllms(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with http(server, headers) as c:
            ours = [c.get("/v1/kittens/layers"), c.post("/v1/kittens/layers/reset")]
            theirs = c.get("/v1/models")
        assert theirs.status_code == 401
        for r in ours:
            assert r.status_code == 401 and r.json() == theirs.json()
    with http(server) as c:
        assert c.get("/v1/kittens/layers").status_code == 200
    with http(server, {}) as c:  # the page is a static shell (like /health); its data needs the key
        page = c.get("/kittens")
        assert page.status_code == 200 and "v1/kittens/layers" in page.text


def test_bad_requests_get_vllm_errors(server):
    model = model_of(server)
    with http(server) as c:
        assert_vllm_error(
            c.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers={"Content-Type": "application/json"})
        )
        assert_vllm_error(c.post("/v1/completions", json={"model": "no-such-model", "prompt": "hi", "max_tokens": 4}))
        assert_vllm_error(c.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": -1}))
        assert_vllm_error(c.post("/v1/completions", json={"model": model, "prompt": [5] * 2000, "max_tokens": 4}))
        assert_vllm_error(
            c.post(
                "/v1/chat/completions",
                json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3},
            )
        )
        assert c.get("/health").status_code == 200
    assert greedy(server, PROMPTS[0], max_tokens=4)


def _stream(server, model, prompt, max_tokens, stop_after=None):
    return stream_completion(server, model, prompt, max_tokens, headers=AUTH, stop_after=stop_after)


def test_client_disconnect_mid_stream_does_not_disturb_others(server):
    model = model_of(server)
    expected = greedy(server, PROMPTS[2], max_tokens=48)
    with ThreadPoolExecutor(8) as pool:
        drops = [pool.submit(_stream, server, model, PROMPTS[i % 6], 400, stop_after=3) for i in range(4)]
        keeps = [pool.submit(_stream, server, model, PROMPTS[2], 48) for _ in range(4)]
        for f in drops:
            assert f.result().finish == "dropped"
        for f in keeps:
            streamed = f.result()
            assert streamed.finish == "length" and streamed.tokens == 48 and "".join(streamed.pieces) == expected
    # The dropped requests are aborted: the server drains and keeps serving.
    assert greedy(server, PROMPTS[2], max_tokens=48) == expected


def test_64_concurrent_streams_complete(server):
    model = model_of(server)
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(lambda i: _stream(server, model, f"{PROMPTS[i % 6]} ({i})", 24), range(64)))
    for r in results:
        assert r.finish == "length" and r.tokens == 24 and len(r.pieces) >= 1
    assert layers(server)["layers"][0]["ranks"][0]["calls"] > 0


def test_kittens_page_renders_in_headless_chromium(server, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    greedy(server, PROMPTS[3], max_tokens=16)
    url = f"{server.url}/kittens#key={KEY}"
    base = [
        chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={tempfile.mkdtemp(dir=tmp_path)}", "--window-size=1280,1100", "--virtual-time-budget=8000",
    ]  # fmt: skip
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180).stdout
    assert "model.layers.0.mlp.experts" in dom and "backend <b>kittens</b>" in dom, dom[-2000:]
    shot = Path("/tmp/kittens-page.png")  # kept for a person to look at
    shot.unlink(missing_ok=True)
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=180)
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    (tmp_path / "kittens-page.png").write_bytes(png)


def test_stock_backend_layers(model_dir):
    with Server([str(model_dir), "--moe-backend", "auto", *COMMON]) as stock:
        names = moe_layer_names(model_dir)
        greedy(stock, PROMPTS[0], max_tokens=8, headers={})
        with http(stock, {}) as c:
            doc = c.get("/v1/kittens/layers").json()
        check_layers(doc, names, "stock (CPU)")
        for layer in doc["layers"]:
            (r,) = layer["ranks"]
            assert r["calls"] >= 8 and r["latency_ms"]["p99"] > 0 and r["phases_ms"] is None
            assert r["experts_class"] != "KittensExperts"


def test_tensor_parallel_2_expert_parallel_reports_both_ranks(model_dir):
    with Server([str(model_dir), "--tensor-parallel-size", "2", "--enable-expert-parallel", *COMMON]) as tp2:
        greedy(tp2, PROMPTS[0], max_tokens=8, headers={})
        with http(tp2, {}) as c:
            doc = c.get("/v1/kittens/layers").json()
        check_layers(doc, moe_layer_names(model_dir), "kittens", ranks=(0, 1))
        assert [(r["tp_rank"], r["ep_rank"], r["ep_size"]) for r in doc["ranks"]] == [(0, 0, 2), (1, 1, 2)]
        for layer in doc["layers"]:
            r0, r1 = layer["ranks"]
            assert r0["calls"] >= 8 and r1["calls"] >= 8
            for r in (r0, r1):  # stamped inside the EP op: dispatch, experts, combine
                assert r["phases_ms"]["experts"]["samples"] == r["latency_ms"]["samples"]
                phases_ms = sum(r["phases_ms"][p]["mean"] for p in ("dispatch", "experts", "combine"))
                assert phases_ms == pytest.approx(r["latency_ms"]["mean"], rel=1e-6)
            assert set(r0["local_experts"]).isdisjoint(r1["local_experts"])
            assert sorted(r0["local_experts"] + r1["local_experts"]) == list(range(layer["num_experts"]))
            assert r0["expert_tokens"] == r1["expert_tokens"]  # DP=1: both ranks see every token
            assert layer["ep_imbalance"] >= 1.0
