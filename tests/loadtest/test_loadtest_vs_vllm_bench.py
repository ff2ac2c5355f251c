"""mok-loadtest's figures agree with vLLM's own `vllm bench serve` on the same workload.

Both tools run against mok-loadtest's fake server, whose pace is fixed (first token after TTFT_S,
then one token every TOKEN_GAP_S), so a difference between them is the tools', not the server's.
Against a real CPU server the comparison was not repeatable on a 2-core VM: the server's own
throughput moved 2x between back-to-back rounds of either tool (1600-3300 output tok/s at
concurrency 8), and the fastest rounds of the two tools differed by 0.65-1.17x over 11 runs at
6e9dee6, with the CPU kernel of e27c570 as with the new one.
"""

import json

import pytest

from mok_serve import tiny_models
from mok_serve.loadtest import cli as loadtest_cli

pytest.importorskip("vllm")

N, CONCURRENCY, IN_LEN, OUT_LEN = 32, 8, 64, 64
TTFT_S, TOKEN_GAP_S = 0.020, 0.005


def vllm_bench(url: str, seed: int) -> tuple[float, float, float]:
    """(output tok/s, mean TTFT ms, mean TPOT ms) of vLLM's serve benchmark (`vllm bench serve`),
    called in-process for its result dict (the command itself runs in tests/server/test_cli_serving.py)."""
    from vllm.benchmarks import serve as vllm_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    vllm_serve.add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", url, "--model", "fake-model", "--tokenizer", str(tiny_models.build_tiny_model()),
        "--dataset-name", "random", "--random-input-len", str(IN_LEN), "--random-output-len", str(OUT_LEN),
        "--num-prompts", str(N), "--max-concurrency", str(CONCURRENCY), "--ignore-eos", "--seed", str(seed),
        "--num-warmups", str(CONCURRENCY), "--disable-tqdm",
    ])  # fmt: skip
    r = vllm_serve.main(args)
    assert r["completed"] == N
    return float(r["output_throughput"]), float(r["mean_ttft_ms"]), float(r["mean_tpot_ms"])


def ours(url: str, seed: int, out) -> tuple[float, float, float]:
    code = loadtest_cli.main([
        "serve", "--url", f"server={url}", "--concurrency", str(CONCURRENCY), "--request-rate", "",
        "--num-requests", str(N), "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN),
        "--warmup", str(CONCURRENCY), "--seed", str(seed), "--out", str(out), "--no-progress", "--no-plots",
    ])  # fmt: skip
    assert code == 0
    s = json.loads((out / "results.json").read_text())["targets"][0]["runs"][0]["summary"]
    return s["output_throughput"], s["ttft"]["mean_ms"], s["tpot"]["mean_ms"]


def test_agrees_with_vllm_bench_serve(fake_server, tmp_path):
    _, url = fake_server("--ttft", str(TTFT_S), "--token-gap", str(TOKEN_GAP_S))
    theirs, mine = [], []
    for i in range(3):  # interleaved: a slow moment of the machine hits both tools alike
        theirs.append(vllm_bench(url, i))
        mine.append(ours(url, i, tmp_path / f"r{i}"))
    summary = f"(output tok/s, mean TTFT ms, mean TPOT ms) per round: vllm bench serve {theirs}, mok-loadtest {mine}"
    print(summary)
    median = lambda rounds, k: sorted(r[k] for r in rounds)[1]  # noqa: E731
    assert abs(median(mine, 0) / median(theirs, 0) - 1) <= 0.10, summary
    assert abs(median(mine, 2) / median(theirs, 2) - 1) <= 0.10, summary
    # Neither client is the bottleneck: both see the server's own pace.
    for rounds in (theirs, mine):
        assert TOKEN_GAP_S * 1e3 <= median(rounds, 2) <= 1.5 * TOKEN_GAP_S * 1e3, summary
    # TTFT: vLLM's client adds a constant on top of the server's 20 ms (5-7 ms on an idle 2-core VM,
    # 12 ms on a loaded one: CI at a20a0df), ours 1-2 ms. Ours is bounded against the server's own
    # pace; vLLM's must see at least that pace and never less than ours (ours adds the least).
    assert TTFT_S * 1e3 <= median(mine, 1) <= TTFT_S * 1e3 + 5, summary
    assert TTFT_S * 1e3 <= median(theirs, 1), summary
    assert median(mine, 1) <= median(theirs, 1) + 1, summary
