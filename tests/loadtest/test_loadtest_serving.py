"""mok-loadtest against real `mok-serve` CPU servers (the tiny model).

1. the full comparison as a user runs it (the tool starts the stock and the kittens server);
2. the server is killed mid-run: errors counted, what happened reported, non-zero exit, no hang.

(Its figures against `vllm bench serve`'s: tests/loadtest/test_loadtest_vs_vllm_bench.py, on a fake server
whose pace is fixed.)
"""

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import pytest

from mok_serve import tiny_models
from mok_serve.server_process import ServerProcess

pytestmark = pytest.mark.server


def _tool(args, timeout):
    return subprocess.run([sys.executable, "-m", "mok_serve.loadtest.cli", "serve", "--no-progress", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_full_comparison_on_tiny_model(tmp_path):
    out = tmp_path / "cmp"
    proc = _tool(["--concurrency", "1,4", "--request-rate", "8", "--num-requests", "16", "--input-len", "64",
                  "--output-len", "32", "--out", str(out)], timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    names = [t["name"] for t in results["targets"]]
    assert names == ["stock", "kittens"]
    stock, kittens = results["targets"]
    assert stock["server_command"].split("--moe-backend ")[1].startswith("auto")
    assert kittens["server_command"].split("--moe-backend ")[1].startswith("kittens")
    assert stock["model"] == kittens["model"] == str(tiny_models.build_tiny_model())

    recomputed, distorted = {}, {}
    for t in results["targets"]:
        assert [r["spec"]["name"] for r in t["runs"]] == ["c=1", "c=4", "rate=8"]
        for run in t["runs"]:
            recs = run["records"]
            assert len(recs) == 16 and all(r["success"] for r in recs)
            assert all(r["output_tokens"] == 32 and r["prompt_len"] == 64 for r in recs)  # ignore_eos: exact
            dur = run["summary"]["duration_s"]
            tps = sum(r["output_tokens"] for r in recs) / dur
            ttft = sum(r["ttft"] for r in recs) / len(recs) * 1000
            tpot = statistics.mean((r["latency"] - r["ttft"]) / (r["output_tokens"] - 1) for r in recs) * 1000
            assert run["summary"]["output_throughput"] == pytest.approx(tps, rel=1e-9)
            assert run["summary"]["ttft"]["mean_ms"] == pytest.approx(ttft, rel=1e-9)
            assert run["summary"]["tpot"]["mean_ms"] == pytest.approx(tpot, rel=1e-9)
            recomputed[(t["name"], run["spec"]["name"])] = (tps, ttft, tpot)
            bunching = run["summary"]["bunching"]  # on a busy 2-core machine some streams may bunch
            assert bunching["bunched"] == sum(r["bunched"] for r in recs) and bunching["checked"] == 16
            distorted[(t["name"], run["spec"]["name"])] = " ⚠" if bunching["distorted"] else ""

    report = (out / "report.md").read_text()
    ratios = {r["run"]: r for r in results["ratios"]}
    for run in ("c=1", "c=4", "rate=8"):
        (s_tps, s_ttft, s_tpot), (k_tps, k_ttft, k_tpot) = recomputed[("stock", run)], recomputed[("kittens", run)]
        assert ratios[run]["baseline"] == "stock" and ratios[run]["candidate"] == "kittens"
        s_mark, k_mark = distorted[("stock", run)], distorted[("kittens", run)]
        withheld = bool(s_mark or k_mark)  # ratios of figures distorted by bunched streams are not given
        assert ratios[run]["output tok/s"] == pytest.approx(k_tps / s_tps, rel=1e-9)
        assert ratios[run]["TTFT mean ms"] == (None if withheld else pytest.approx(k_ttft / s_ttft, rel=1e-9))
        # the summary table row: run | stock tok/s | kittens tok/s | ratio | ... (rounded as printed)
        row = next(line for line in report.splitlines() if line.startswith(f"| {run} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == f"{s_tps:.1f}" and cells[2] == f"{k_tps:.1f}" and cells[3] == f"{k_tps / s_tps:.2f}x"
        assert cells[4] == f"{s_ttft:.2f}{s_mark}" and cells[5] == f"{k_ttft:.2f}{k_mark}"
        assert cells[7] == f"{s_tpot:.3f}{s_mark}" and cells[8] == f"{k_tpot:.3f}{k_mark}"
        for ratio_cell, ratio in ((cells[6], k_ttft / s_ttft), (cells[9], k_tpot / s_tpot)):
            assert ratio_cell == ("withheld ⚠" if withheld else f"{ratio:.2f}x")
    assert "| run | stock output tok/s | kittens output tok/s | kittens/stock |" in report
    for png in ("throughput.png", "latency.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, png
    assert "status: OK" in proc.stdout


# ------------------------------------------------------------------------ one shared server


@pytest.fixture(scope="module")
def server():
    with ServerProcess([str(tiny_models.build_tiny_model()), "--max-model-len", "1024"]) as s:
        yield s


def test_server_killed_mid_run(server, tmp_path):
    out = tmp_path / "killed"
    before = _successes(server.url)
    proc = subprocess.Popen(
        [sys.executable, "-m", "mok_serve.loadtest.cli", "serve", "--no-progress", "--url", f"kittens={server.url}",
         "--concurrency", "4,8", "--request-rate", "", "--num-requests", "400", "--input-len", "32",
         "--output-len", "64", "--warmup", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    # Wait until the measured run is under way (requests are completing), then kill the server.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if _successes(server.url) >= before + 2 + 12:  # 2 warm-up requests, then 12 measured ones
            break
        time.sleep(0.5)
    assert proc.poll() is None, "the run ended before the server could be killed"
    os.killpg(server.proc.pid, signal.SIGKILL)
    t0 = time.monotonic()
    stdout, _ = proc.communicate(timeout=300)
    assert time.monotonic() - t0 < 120
    assert proc.returncode == 1, stdout[-3000:]
    results = json.loads((out / "results.json").read_text())
    first, second = results["targets"][0]["runs"]
    assert first["summary"]["completed"] > 0 and first["summary"]["failed"] > 0
    assert first["summary"]["completed"] + first["summary"]["failed"] + first["summary"]["not_sent"] == 400
    assert second["skipped"].startswith(f"server at {server.url} stopped answering during run c=4")
    report = (out / "report.md").read_text()
    assert "requests failed**" in report and "stopped answering during run c=4" in report
    assert "FAILED (exit 1)" in stdout


def _successes(url: str) -> int:
    """vLLM's Prometheus counter of finished requests (summed over its labels)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0
    return int(sum(float(m) for m in re.findall(r"^vllm:request_success_total(?:\{[^}]*\})? (\S+)$", text, re.M)))
