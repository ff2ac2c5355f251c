"""mok-loadtest against a fake loopback server that fails requests, dies mid-run, stalls or bunches
streams: the report counts the errors and says what happened, the tool exits non-zero and does not
hang; bunched streams are counted and their distorted figures kept out of the comparison."""

import json
import subprocess
import sys
import time

import pytest

TOOL_TIMEOUT = 180  # the tool must finish well before this: "never hangs"


def run_tool(tmp_path, *args):
    out = tmp_path / "results"
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "mok_serve.loadtest.cli", "serve", "--out", str(out), "--no-progress",
         "--input-len", "16", "--output-len", "16", *args],
        capture_output=True, text=True, timeout=TOOL_TIMEOUT,
    )
    elapsed = time.monotonic() - t0
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    return proc, results, report, elapsed


def test_failed_requests_are_counted(fake_server, tmp_path):
    _, url = fake_server("--fail-every", "3")
    proc, results, report, _ = run_tool(
        tmp_path, "--url", f"flaky={url}", "--concurrency", "2", "--request-rate", "", "--num-requests", "12",
        "--warmup", "0",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    (target,) = results["targets"]
    (run,) = target["runs"]
    s = run["summary"]
    assert (s["completed"], s["failed"]) == (8, 4)
    assert sum(1 for r in run["records"] if not r["success"]) == 4
    assert all(r["http_status"] == 500 for r in run["records"] if not r["success"])
    assert s["errors"] == {f"HTTP 500 Internal Server Error: fake failure of request {n}": 1 for n in (3, 6, 9, 12)}
    # figures come from the successful requests only
    assert s["total_output_tokens"] == 8 * 16
    assert "**4 of 12 requests failed**" in report and "1 x HTTP 500 Internal Server Error: fake failure" in report
    assert "flaky: 4" in report  # the errors column of the summary table
    assert "FAILED (exit 1)" in proc.stdout


def test_server_dying_mid_run(fake_server, tmp_path):
    server, url = fake_server("--die-after", "5", "--token-gap", "0.01")
    proc, results, report, elapsed = run_tool(
        tmp_path, "--url", f"stock={url}", "--concurrency", "1,2", "--request-rate", "4", "--num-requests", "10",
        "--warmup", "0",
    )
    assert server.poll() == 3  # it did die
    assert proc.returncode == 1
    assert elapsed < 90
    first, second, third = results["targets"][0]["runs"]
    assert first["summary"]["completed"] == 5 and first["summary"]["failed"] == 5
    errors = " ".join(first["summary"]["errors"])
    assert "ServerDisconnected" in errors or "ClientConnector" in errors or "before [DONE]" in errors
    assert second["skipped"] and third["skipped"]
    assert "stopped answering during run c=1" in second["skipped"]
    assert "stopped answering during run c=1" in report and "skipped" in report


def test_stalled_server_times_out(fake_server, tmp_path):
    _, url = fake_server("--stall-after", "2")
    proc, results, report, elapsed = run_tool(
        tmp_path, "--url", f"kittens={url}", "--concurrency", "2", "--request-rate", "", "--num-requests", "6",
        "--warmup", "0", "--stall-timeout", "2", "--request-timeout", "4",
    )
    assert proc.returncode == 1
    assert elapsed < 60
    s = results["targets"][0]["runs"][0]["summary"]
    assert s["completed"] == 2 and s["failed"] == 4
    assert all(k.startswith("timeout after") for k in s["errors"])
    assert "timeout after" in report


def test_layers_endpoint_is_reported(fake_server, tmp_path):
    _, url_a = fake_server("--layers")
    _, url_b = fake_server()
    proc, results, report, _ = run_tool(
        tmp_path, "--url", f"stock={url_b}", "--url", f"kittens={url_a}", "--concurrency", "2",
        "--request-rate", "", "--num-requests", "4", "--warmup", "1",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stock, kittens = results["targets"]
    assert stock["runs"][0]["layers"] == {"available": False}
    parsed = kittens["runs"][0]["layers"]["parsed"]
    assert [p["label"] for p in parsed] == ["model.layers.0.mlp.experts (rank 0)", "model.layers.1.mlp.experts (rank 0)"]
    assert "latency_ms.mean" in report and "answered 404" in report
    # The fake server counts a step per streamed token: 4 requests of 16 tokens after the reset.
    moe = kittens["runs"][0]["moe"]
    assert moe["steps"] == 64 and moe["tokens_per_step"] == 1.0 and moe["moe_ms_per_step"] == pytest.approx(0.21)
    assert 0 < moe["moe_share"] < 1 and stock["runs"][0]["moe"] is None
    assert "| MoE ms per step | — | 0.210 | — |" in report
    assert (tmp_path / "results" / "layers.png").stat().st_size > 1000


@pytest.mark.server
def test_server_that_cannot_start(tmp_path):
    """A started server that fails at start-up: reported with its log, the other runs skipped."""
    proc, results, report, elapsed = run_tool(
        tmp_path, "--backends", "broken=no_such_backend", "--concurrency", "1", "--request-rate", "",
        "--num-requests", "2", "--startup-timeout", "120",
    )
    assert proc.returncode == 1 and elapsed < 170
    (target,) = results["targets"]
    assert target["events"][0].startswith("server did not start: server exited with code")
    assert "no_such_backend" in target["server_log_tail"]
    assert target["runs"][0]["skipped"] == "server did not start"
    assert "server did not start" in report


def test_bunched_streams_are_detected(fake_server, tmp_path):
    """A server streaming tokens 10 ms apart against one that sends every third stream's tokens in
    one write at its end, and one that sends every second stream as one merged chunk."""
    gap = ["--token-gap", "0.01"]
    _, spread = fake_server(*gap)
    _, in_one_write = fake_server(*gap, "--bunch-every", "3")
    _, merged = fake_server(*gap, "--bunch-every", "2", "--bunch-merged")
    proc, results, report, _ = run_tool(
        tmp_path, "--url", f"stock={spread}", "--url", f"kittens={in_one_write}", "--url", f"merged={merged}",
        "--concurrency", "2", "--request-rate", "", "--num-requests", "12", "--warmup", "0",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # bunching is reported, not a failure
    runs = {t["name"]: t["runs"][0] for t in results["targets"]}
    assert [runs[n]["summary"]["bunching"]["bunched"] for n in ("stock", "kittens", "merged")] == [0, 4, 6]
    assert not runs["stock"]["summary"]["bunching"]["distorted"] and runs["kittens"]["summary"]["bunching"]["distorted"]
    assert all(r["arrivals"] > 8 for r in runs["stock"]["records"])  # 16 tokens, each on its own
    for name in ("kittens", "merged"):
        bunched = [r for r in runs[name]["records"] if r["bunched"]]
        assert all(r["output_tokens"] == 16 and r["ttft"] > 0.9 * r["latency"] for r in bunched), name
        assert all(not r["bunched"] and r["arrivals"] > 8 for r in runs[name]["records"] if r not in bunched)
    assert all(r["itl"] == [] for r in runs["merged"]["records"] if r["bunched"])  # one chunk, 16 tokens
    (ratios,) = results["ratios"]
    assert ratios["TTFT mean ms"] is None and ratios["output tok/s"] is not None
    assert ratios["withheld_because"] == "kittens: 4 of 12 requests bunched"
    row = next(line for line in report.splitlines() if line.startswith("| c=2 |"))
    assert "withheld ⚠" in row and "kittens 4 of 12 ⚠, merged 6 of 12 ⚠" in row
    assert "! kittens c=2: 4 of 12 requests bunched" in proc.stdout
