"""`mok-serve --deterministic` on one GPU: the probe of `mok-loadtest invariance` against real
servers, on tiny models filled with `--load-format kittens-random` (random weights at trained
scales: dummy weights leave every server, invariant or not, with one completion per prompt).

Per family (bf16 and block FP8): kittens `--deterministic` with prefix caching off and on, and
with `--enforce-eager`, must give one completion (token ids and logprobs) for a greedy probe sent
alone and beside 0-48 concurrent companions (decoding, prefilling with it, arriving during its
decode; long prompts make eager steps above the largest captured graph); stock vLLM's default
server on the same weights must give more than one, or the probe shows nothing. Every server has
`--attention-backend TRITON_ATTN` (kittens' invariant attention replaces that backend's kernel).

Run where vLLM 0.32 imports (the H200 machines: ../shared/gpu-vllm). `MOK_TEST_LOG_DIR` keeps the
servers' logs and the probe's results.
"""

import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mok_serve import tiny_models
from mok_serve.loadtest import invariance
from mok_serve.server_process import ServerError, ServerProcess

pytestmark = pytest.mark.gpu

FAMILIES = ("qwen3_moe", "qwen3_moe_fp8")
COMMON = ["--attention-backend", "TRITON_ATTN", "--load-format", "kittens-random", "--max-model-len", "4096",
          "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(1 << 30)]
SERVERS = {  # name: mok-serve options
    "deterministic": ["--deterministic", "--no-enable-prefix-caching"],
    "deterministic-prefix-cache": ["--deterministic", "--enable-prefix-caching"],
    "deterministic-eager": ["--deterministic", "--no-enable-prefix-caching", "--enforce-eager"],
    "stock-default": ["--moe-backend", "auto", "--no-enable-prefix-caching"],
}
PROBE = ["--probes", "40", "--max-batch", "48", "--max-tokens", "64", "--companion-input-len", "300",
         "--companion-output-len", "48", "--spread", "0.05", "--request-timeout", "180", "--max-duration", "600",
         "--no-progress"]


@pytest.fixture(scope="module")
def servers():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    log_dir = Path(os.environ.get("MOK_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="mok-gpu-deterministic-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started: dict = {}
    models = {f: str(tiny_models.build_tiny_model(f)) for f in FAMILIES}  # one at a time

    def start(key):
        family, name = key
        server = ServerProcess([models[family], *COMMON, *SERVERS[name]], log_path=log_dir / f"{family}-{name}.log",
                               startup_timeout=900, env={"VLLM_BATCH_INVARIANT": "0"} if "stock" in name else {})
        try:
            started[key] = server.start()
        except ServerError as e:
            started[key] = e

    keys = [(f, n) for f in FAMILIES for n in SERVERS]
    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(start, keys))
    yield started, log_dir, models, {}
    for s in started.values():
        if isinstance(s, ServerProcess):
            s.stop()


def probe(servers, family, name) -> dict:
    """The probe's summary against one server (run once per server, then remembered)."""
    started, log_dir, models, done = servers
    if (family, name) in done:
        return done[(family, name)]
    server = started[(family, name)]
    if isinstance(server, ServerError):
        raise server
    out = log_dir / f"probe-{family}-{name}"
    code = invariance.main(["--url", f"{name}={server.url}", "--tokenizer", models[family], *PROBE, "--out", str(out)])
    results = json.loads((out / "invariance.json").read_text())
    assert code == 0, results["targets"][0]["events"]
    done[(family, name)] = results["targets"][0]["summary"]
    return done[(family, name)]


@pytest.mark.parametrize("name", [n for n in SERVERS if n.startswith("deterministic")])
@pytest.mark.parametrize("family", FAMILIES)
def test_deterministic_server_gives_one_completion(servers, family, name):
    s = probe(servers, family, name)
    assert s["ok"] == s["planned"] and s["companion_failures"] == 0
    assert (s["distinct_completions"], s["distinct_with_logprobs"]) == (1, 1), s["variants"]
    assert s["equal_to_alone_with_logprobs"] == s["ok"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_tells_a_default_server_apart(servers, family):
    s = probe(servers, family, "stock-default")
    assert s["ok"] == s["planned"]
    assert s["distinct_with_logprobs"] > 1, "stock's default server gave one completion too: the probe proves nothing here"


@pytest.mark.parametrize("family", FAMILIES)
def test_kittens_kernels_are_in_place(servers, family):
    log = servers[0][(family, "deterministic")].log()
    assert "dense layers, RMSNorms and Triton paged attention run mok-serve's batch-invariant kernels" in log


@pytest.mark.parametrize("name", [n for n in SERVERS if n.startswith("deterministic")])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_invariant_kernel_compiles_while_serving(servers, family, name):
    """After the probe's traffic: vLLM's JIT monitor saw no compile of kittens' invariant kernels
    after its warm-up (CUDA-graph capture and the profile run compile every variant the shapes of a
    step select)."""
    probe(servers, family, name)
    late = [line for line in servers[0][(family, name)].log().splitlines() if "JIT compilation during inference" in line
            and any(k in line for k in ("_linear_", "_attention_", "_rms_norm_kernel", "_moe_", "_fp8_"))]
    assert not late, late
