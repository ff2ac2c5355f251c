"""`mok-serve --deterministic` on one GPU: the probe of `mok-loadtest invariance` against real
servers, on tiny models filled with `--load-format kittens-random` (random weights at trained
scales: dummy weights leave every server, invariant or not, with one completion per prompt).

Per family (bf16, and block FP8 in every linear layer but the routers: experts and dense layers
alike, as the real checkpoints ship), 100 probes each, all servers probed at once: kittens
`--deterministic` with prefix caching off and on, with `--enforce-eager`, and (FP8) with
`MOK_DETERMINISTIC_FP8_GEMM=cutlass`, must give one
completion (token ids and logprobs) for a greedy probe sent alone and beside 0-48 concurrent
companions (decoding, prefilling with it, arriving during its decode; long prompts make eager
steps above the largest captured graph); stock vLLM's default server on the same weights must
give more than one, or the probe shows nothing. Stock with `VLLM_BATCH_INVARIANT=1` and kittens'
default server are probed too and reported (`summary.md` in the log folder), not judged.
Every server has
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

FAMILIES = ("qwen3_moe", "qwen3_moe_fp8_dense")
COMMON = ["--attention-backend", "TRITON_ATTN", "--load-format", "kittens-random", "--max-model-len", "4096",
          "--gpu-memory-utilization", "0.05", "--kv-cache-memory-bytes", str(1 << 30)]
SERVERS = {  # name: (mok-serve options, environment variables of the server)
    "deterministic": (["--deterministic", "--no-enable-prefix-caching", "--jit-monitor-verbose"], {}),
    "deterministic-prefix-cache": (["--deterministic", "--enable-prefix-caching", "--jit-monitor-verbose"], {}),
    "deterministic-eager": (["--deterministic", "--no-enable-prefix-caching", "--enforce-eager",
                             "--jit-monitor-verbose"], {}),
    # The FP8 family only: its dense layers through vLLM's CUTLASS GEMM where that is invariant.
    "deterministic-cutlass": (["--deterministic", "--no-enable-prefix-caching", "--jit-monitor-verbose"],
                              {"MOK_DETERMINISTIC_FP8_GEMM": "cutlass"}),
    "stock-default": (["--moe-backend", "auto", "--no-enable-prefix-caching"], {"VLLM_BATCH_INVARIANT": "0"}),
    "stock-batch-invariant": (["--moe-backend", "auto", "--deterministic", "--no-enable-prefix-caching"], {}),
    "kittens-default": (["--no-enable-prefix-caching"], {"VLLM_BATCH_INVARIANT": "0"}),
}
FP8_ONLY = ("deterministic-cutlass",)
SERVED = [(f, n) for f in FAMILIES for n in SERVERS if "fp8" in f or n not in FP8_ONLY]
DETERMINISTIC = [(f, n) for f, n in SERVED if n.startswith("deterministic")]
PROBES = 100
PROBE = ["--probes", str(PROBES), "--max-batch", "48", "--max-tokens", "64", "--companion-input-len", "300",
         "--companion-output-len", "48", "--spread", "0.05", "--request-timeout", "180", "--max-duration", "300",
         "--no-progress"]


@pytest.fixture(scope="module")
def servers():
    """Every (family, server) started at once, then probed at once (the probes' traffic from other
    servers only varies each server's batches more). Yields (started, summaries, log folder)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    log_dir = Path(os.environ.get("MOK_TEST_LOG_DIR") or tempfile.mkdtemp(prefix="mok-gpu-deterministic-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started: dict = {}
    summaries: dict = {}
    models = {f: str(tiny_models.build_tiny_model(f)) for f in FAMILIES}  # one at a time
    keys = SERVED

    def start(key):
        family, name = key
        options, env = SERVERS[name]
        server = ServerProcess([models[family], *COMMON, *options], log_path=log_dir / f"{family}-{name}.log",
                               startup_timeout=900, env=env)
        try:
            started[key] = server.start()
        except ServerError as e:
            started[key] = e

    def probe(key):
        family, name = key
        if isinstance(started[key], ServerError):
            summaries[key] = started[key]
            return
        out = log_dir / f"probe-{family}-{name}"
        code = invariance.main(["--url", f"{name}={started[key].url}", "--tokenizer", models[family], *PROBE,
                                "--out", str(out)])
        target = json.loads((out / "invariance.json").read_text())["targets"][0]
        summaries[key] = target["summary"] if code == 0 else AssertionError(f"{family} {name}: {target['events']}")

    with ThreadPoolExecutor(len(keys)) as pool:
        list(pool.map(start, keys))
        list(pool.map(probe, keys))
    (log_dir / "summary.md").write_text(summary_table(summaries))
    yield started, summaries
    for s in started.values():
        if isinstance(s, ServerProcess):
            s.stop()


def summary_table(summaries: dict) -> str:
    lines = [f"# Distinct completions of one greedy probe, {PROBES} probes per server", "",
             "| family | server | probes ok | distinct (token ids) | distinct (with logprobs) | equal to alone |",
             "|---|---|---|---|---|---|"]
    for (family, name), s in summaries.items():
        if isinstance(s, Exception):
            lines.append(f"| {family} | {name} | failed: {str(s)[:120]} | | | |")
        else:
            lines.append(f"| {family} | {name} | {s['ok']} of {s['planned']} | {s['distinct_completions']} | "
                         f"{s['distinct_with_logprobs']} | {s['equal_to_alone_with_logprobs']} |")
    return "\n".join(lines) + "\n"


def probe(servers, family, name) -> dict:
    s = servers[1][(family, name)]
    if isinstance(s, Exception):
        raise s
    return s


@pytest.mark.parametrize("family,name", DETERMINISTIC)
def test_deterministic_server_gives_one_completion(servers, family, name):
    s = probe(servers, family, name)
    assert s["ok"] == s["planned"] == PROBES and s["companion_failures"] == 0
    assert (s["distinct_completions"], s["distinct_with_logprobs"]) == (1, 1), s["variants"]
    assert s["equal_to_alone_with_logprobs"] == s["ok"]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_probe_tells_a_default_server_apart(servers, family):
    s = probe(servers, family, "stock-default")
    assert s["ok"] == s["planned"]
    assert s["distinct_with_logprobs"] > 1, "stock's default server gave one completion too: the probe proves nothing here"


@pytest.mark.parametrize("name", ["stock-batch-invariant", "kittens-default"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_other_servers_were_probed(servers, family, name):
    """Stock batch-invariant and kittens' default server: every probe answered (their counts are
    findings for summary.md, not judged here)."""
    s = probe(servers, family, name)
    assert s["ok"] == s["planned"] == PROBES


@pytest.mark.parametrize("family", FAMILIES)
def test_kittens_kernels_are_in_place(servers, family):
    from mok_serve.vllm.deterministic import INSTALLED

    log = servers[0][(family, "deterministic")].log()
    assert INSTALLED in log


def test_the_cutlass_choice_is_in_place(servers):
    log = servers[0][("qwen3_moe_fp8_dense", "deterministic-cutlass")].log()
    assert "block-FP8 dense layers run vLLM's CUTLASS GEMM where it is batch invariant" in log


@pytest.mark.parametrize("family,name", DETERMINISTIC)
def test_no_invariant_kernel_compiles_while_serving(servers, family, name):
    """After the probe's traffic: vLLM's JIT monitor saw no compile of kittens' invariant kernels
    after its warm-up (CUDA-graph capture and the profile run compile every variant the shapes of a
    step select)."""
    probe(servers, family, name)
    late = [line for line in servers[0][(family, name)].log().splitlines() if "JIT compilation during inference" in line
            and any(k in line for k in ("_linear_", "_attention_", "_rms_norm_kernel", "_moe_", "_fp8_"))]
    assert not late, late
