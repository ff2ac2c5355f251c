"""mok-loadtest invariance without vLLM: against the fake loopback server (deterministic, or with
outputs that depend on how many requests are in flight), the counting of distinct completions,
the comparison with the probe sent alone, the loopback rule, the bounds, the output files, and
the start-up of servers (ServerProcess replaced by one that runs the fake server)."""

import json
import subprocess
import sys
import time
import urllib.request

import numpy as np
import pytest

from mok_serve import tiny_models
from mok_serve.loadtest import invariance
from mok_serve.server_process import ServerError, free_port

FAST = ["--no-progress", "--spread", "0.01", "--max-tokens", "8", "--companion-output-len", "8"]


def start_fake(port, *args):
    root = str(tiny_models.build_tiny_model())
    p = subprocess.Popen([sys.executable, "-m", "mok_serve.loadtest.fake_server", "--port", str(port), "--root", root,
                          *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return p
        except OSError:
            if p.poll() is not None:
                break
            time.sleep(0.1)
    p.kill()
    raise RuntimeError("fake server did not start")


@pytest.fixture
def fake():
    procs = []

    def start(*args):
        port = free_port()
        procs.append(start_fake(port, *args))
        return f"http://127.0.0.1:{port}"

    yield start
    for p in procs:
        p.kill()
        p.wait(10)


def run_tool(tmp_path, *args):
    out = tmp_path / "out"
    code = invariance.main(["--out", str(out), *FAST, *args])
    results = json.loads((out / "invariance.json").read_text())
    return code, results, (out / "invariance.md").read_text()


def test_deterministic_server_gives_one_completion(fake, tmp_path):
    url = fake()
    code, results, md = run_tool(tmp_path, "--url", f"fake={url}", "--probes", "10", "--max-batch", "6")
    assert code == 0
    (t,) = results["targets"]
    s = t["summary"]
    assert (s["planned"], s["sent"], s["ok"], s["probe_failures"], s["companion_failures"]) == (10, 10, 10, 0, 0)
    assert (s["distinct_completions"], s["distinct_with_logprobs"]) == (1, 1)
    assert (s["equal_to_alone"], s["equal_to_alone_with_logprobs"]) == (10, 10)
    probes = t["probes"]
    assert probes[0]["companions"] == 0 and s["companion_requests"] == sum(p["companions"] for p in probes) > 0
    assert all(p["before"] + p["with"] + p["after"] == p["companions"] <= 6 for p in probes)
    # token ids come back parsed from "token_id:N", one logprob per token
    assert all(len(p["token_ids"]) == len(p["logprobs"]) == 8 and p["tokens"] is None for p in probes)
    assert t["server_version"] == "fake" and t["model"] == "fake-model"
    assert "commit" in results["commit"] and results["environment"]["python"]
    assert "| fake | as served | 10/10 | 1 | 1 | 10/10 | 10/10 | 0 |" in md


def test_batch_variant_logprobs_are_counted_apart_from_tokens(fake, tmp_path):
    url = fake("--batch-variance", "logprobs", "--token-gap", "0.01")
    code, results, md = run_tool(tmp_path, "--url", f"fake={url}", "--probes", "12", "--max-batch", "8")
    assert code == 0  # a batch-variant server is a finding, not a failure
    s = results["targets"][0]["summary"]
    assert s["distinct_completions"] == 1 and s["equal_to_alone"] == 12
    assert s["distinct_with_logprobs"] > 1 and s["equal_to_alone_with_logprobs"] < 12
    assert sum(v["probes"] for v in s["variants"]) == 12
    (alone,) = [v for v in s["variants"] if v["is_alone"]]
    assert alone["indices"][0] == 0 and alone["max_abs_logprob_diff"] == 0
    others = [v for v in s["variants"] if not v["is_alone"]]
    assert all(v["first_differing_token"] is None and v["max_abs_logprob_diff"] > 0 for v in others)
    assert all(v["companions_min"] > 0 for v in others)  # only a probe with companions can differ


def test_batch_variant_tokens_differ_from_alone(fake, tmp_path):
    url = fake("--batch-variance", "tokens", "--token-gap", "0.01")
    code, results, _ = run_tool(tmp_path, "--url", f"fake={url}", "--probes", "12", "--max-batch", "8")
    assert code == 0
    s = results["targets"][0]["summary"]
    assert s["distinct_completions"] > 1 and s["equal_to_alone"] < 12
    assert all(v["first_differing_token"] == 7 for v in s["variants"] if not v["is_alone"])  # the fake's last token


def rec(index, ids, lps, companions=3, ok=True):
    return {"index": index, "ok": ok, "companions": companions, "companions_failed": 0, "token_ids": ids,
            "tokens": None, "text": "", "logprobs": lps}


def test_analyse_counts_and_compares_with_alone():
    records = [rec(0, [1, 2, 3], [-0.5, -0.25, -1.0], companions=0),
               rec(1, [1, 2, 3], [-0.5, -0.25, -1.0]),
               rec(2, [1, 2, 3], [-0.5, -0.2500001, -1.0]),
               rec(3, [1, 9, 3], [-0.5, -0.75, -1.0]),
               rec(4, [1, 9, 3], [-0.5, -0.75, -1.0]),
               rec(5, None, None, ok=False)]
    s = invariance.analyse(records, planned=8)
    assert (s["sent"], s["ok"], s["not_sent"], s["probe_failures"]) == (6, 5, 2, 1)
    assert (s["distinct_completions"], s["distinct_with_logprobs"]) == (2, 3)
    assert (s["equal_to_alone"], s["equal_to_alone_with_logprobs"]) == (3, 2)
    v = s["variants"]
    assert [x["probes"] for x in v] == [2, 2, 1] and [x["indices"] for x in v] == [[0, 1], [3, 4], [2]]
    assert v[0]["is_alone"] and not v[1]["is_alone"]
    assert v[1]["first_differing_token"] == 1 and v[1]["max_abs_logprob_diff"] == 0.0  # logprobs before token 1
    assert v[2]["first_differing_token"] is None and v[2]["max_abs_logprob_diff"] == pytest.approx(1e-7)
    # text tokens stand in when the server returned no ids; a shorter completion differs at its end
    a = {**rec(0, None, [-1.0, -2.0], companions=0), "tokens": ["a", "b"]}
    b = {**rec(1, None, [-1.0], companions=0), "tokens": ["a"]}
    s = invariance.analyse([a, b], planned=2)
    assert s["distinct_completions"] == 2 and s["variants"][1]["first_differing_token"] == 1


def test_no_alone_probe_means_no_comparison(tmp_path):
    s = invariance.analyse([rec(0, None, None, companions=0, ok=False), rec(1, [1], [-1.0])], planned=2)
    assert s["equal_to_alone"] is None and s["distinct_completions"] == 1
    results = {"config": {"command": "x", "model": None, "modes": "default,deterministic", "urls": {}, "probes": 2, "prompt": "p",
                          "max_tokens": 1, "max_batch": 1, "seed": 0, "spread": 0.1},
               "commit": {"commit": None, "dirty": None}, "started": "now", "targets": [
                   {"name": "a", "moe_backend": None, "events": [], "summary": s}]}
    assert "| a | as served | 1/2 | 1 | 1 | n/a | n/a | 1 |" in invariance.markdown(results)
    assert invariance.exit_code_of(results) == 1  # the failed probe


def test_plan_is_seeded_and_spans_the_window():
    args = invariance.build_parser().parse_args(["--probes", "50", "--max-batch", "10", "--spread", "0.2"])
    vocab = np.arange(10, 400)
    a, b = invariance.plan_rounds(args, vocab), invariance.plan_rounds(args, vocab)
    assert [[(c.item.prompt, c.offset_s, c.temperature) for c in r] for r in a] == \
           [[(c.item.prompt, c.offset_s, c.temperature) for c in r] for r in b]
    args.seed = 1
    assert [len(r) for r in invariance.plan_rounds(args, vocab)] != [len(r) for r in a]
    assert len(a) == 50 and len(a[0]) == 0 and all(len(r) <= 10 for r in a) and len({len(r) for r in a}) > 5
    comps = [c for r in a for c in r]
    offs = [c.offset_s for c in comps]
    assert all(-0.2 <= o <= 0.2 for o in offs) and min(offs) < 0 < max(offs) and 0.0 in offs
    assert {c.temperature for c in comps} == {0.0, 1.0}
    assert len({c.item.prompt_len for c in comps}) > 10 and len({c.item.output_len for c in comps}) > 10
    # companions are cut to the server's context
    p = invariance.companion_payload(comps[0], "m", max_model_len=16)
    assert len(p["prompt"]) + p["max_tokens"] <= 16 and p["ignore_eos"] and p["stream"] is False


@pytest.mark.parametrize("argv", [
    ["--url", "x=http://10.0.0.1:8000"],
    ["--url", "x=http://example.com:8000"],
    ["--url", "a=http://127.0.0.1:1", "--url", "a=http://127.0.0.1:2"],
    ["--probes", "0"],
    ["--max-batch", "-1"],
    ["--backends", "stock,nonsense"],
    ["--no-such-option"],
])
def test_bad_arguments_exit_2(argv, capsys, tmp_path):
    assert invariance.main([*argv, "--out", str(tmp_path / "o")]) == 2
    if "10.0.0.1" in str(argv):
        assert "loopback" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # nothing was run


def test_cli_forwards_to_invariance(capsys):
    from mok_serve.loadtest.cli import main

    assert main(["invariance", "--url", "x=http://192.168.1.1:8000"]) == 2
    assert "loopback" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "invariance" in capsys.readouterr().out


def test_max_duration_bounds_the_run(fake, tmp_path):
    url = fake("--token-gap", "0.05")  # 8 tokens: 0.4 s per round
    t0 = time.monotonic()
    code, results, md = run_tool(tmp_path, "--url", f"fake={url}", "--probes", "50", "--max-batch", "2",
                                 "--max-duration", "0.5")
    assert time.monotonic() - t0 < 20
    s = results["targets"][0]["summary"]
    assert 1 <= s["sent"] <= 4 and s["not_sent"] == 50 - s["sent"] and s["distinct_completions"] == 1
    assert code == 0 and "not sent, --max-duration" in md


def test_request_timeout_and_failures_exit_1(fake, tmp_path):
    url = fake("--stall-after", "2")  # every request after the second never answers
    t0 = time.monotonic()
    code, results, md = run_tool(tmp_path, "--url", f"fake={url}", "--probes", "3", "--max-batch", "2",
                                 "--request-timeout", "1")
    assert time.monotonic() - t0 < 20
    assert code == 1
    s = results["targets"][0]["summary"]
    assert s["probe_failures"] >= 1 and s["sent"] == 3
    assert all("timeout" in p["error"] for p in results["targets"][0]["probes"] if not p["ok"])
    assert "| fake | as served | " in md and f"{s['probe_failures']} failed" in md


def test_unreachable_server_exit_1(tmp_path):
    code, results, _ = run_tool(tmp_path, "--url", f"gone=http://127.0.0.1:{free_port()}", "--probes", "2")
    assert code == 1 and "cannot read" in results["targets"][0]["events"][0]


class FakeServerProcess:
    """Stands in for mok_serve.server_process.ServerProcess: runs the fake server; a backend named
    'broken' fails to start. Every start and stop is logged in ``calls``."""

    calls: list = []

    def __init__(self, args, *, env, startup_timeout, log_path):
        self.args, self.env, self.log_path = args, env, log_path
        self.port, self.proc = free_port(), None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    def log(self):
        return "fake log\nline two"

    def start(self):
        backend = self.args[self.args.index("--moe-backend") + 1]
        self.calls.append(("start", backend, dict(self.env), list(self.args)))
        if backend == "broken":
            raise ServerError("server exited with code 1:\nboom")
        self.proc = start_fake(self.port)
        return self

    def stop(self):
        if self.proc is not None:
            self.calls.append(("stop", self.args[self.args.index("--moe-backend") + 1]))
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


@pytest.mark.parametrize("parallel", [False, True])
def test_started_servers(monkeypatch, tmp_path, parallel):
    FakeServerProcess.calls = []
    monkeypatch.setattr(invariance, "ServerProcess", FakeServerProcess)
    monkeypatch.setattr(invariance, "stock_backend", lambda: "triton")
    root = str(tiny_models.build_tiny_model())
    code, results, md = run_tool(
        tmp_path, "--model", root, "--backends", "stock,kittens,bad=broken", "--modes", "deterministic",
        "--probes", "4", "--max-batch", "3",
        "--server-arg=--attention-backend=TRITON_ATTN", "--server-arg=--gpu-memory-utilization 0.3",
        *(["--parallel-start"] if parallel else []))
    assert code == 1  # one server did not start
    stock, kittens, bad = results["targets"]
    assert [t["name"] for t in results["targets"]] == ["stock-deterministic", "kittens-deterministic", "bad-deterministic"]
    assert stock["summary"]["distinct_completions"] == kittens["summary"]["distinct_completions"] == 1
    assert stock["summary"]["ok"] == kittens["summary"]["ok"] == 4 and not stock["events"]
    assert bad["events"] == ["server did not start: server exited with code 1:"] and bad["summary"]["sent"] == 0
    starts = [c for c in FakeServerProcess.calls if c[0] == "start"]
    assert sorted(c[1] for c in starts) == ["broken", "kittens", "triton"]
    assert all(c[2] == {} for c in starts)  # mok-serve --deterministic sets the mode itself
    assert all(c[3] == [root, "--moe-backend", c[1], "--deterministic", "--no-enable-prefix-caching",
                        "--attention-backend=TRITON_ATTN", "--gpu-memory-utilization", "0.3"] for c in starts)
    assert stock["server_command"].startswith(f"mok-serve {root} --moe-backend triton --deterministic")
    order = [c[:2] for c in FakeServerProcess.calls]
    if parallel:  # all up before the first is stopped
        assert order.index(("stop", "triton")) > max(order.index(("start", b)) for b in ("triton", "kittens", "broken"))
    else:  # each stopped before the next starts
        assert order[:4] == [("start", "triton"), ("stop", "triton"), ("start", "kittens"), ("stop", "kittens")]
    assert "| bad-deterministic | broken | 0/4 |" in md


def test_default_modes_start_four_servers_and_prefix_caching(monkeypatch, tmp_path):
    FakeServerProcess.calls = []
    monkeypatch.setattr(invariance, "ServerProcess", FakeServerProcess)
    monkeypatch.setattr(invariance, "stock_backend", lambda: "triton")
    root = str(tiny_models.build_tiny_model())
    code, results, _ = run_tool(tmp_path, "--model", root, "--probes", "2", "--prefix-caching")
    assert code == 0
    assert [t["name"] for t in results["targets"]] == [
        "stock-default", "stock-deterministic", "kittens-default", "kittens-deterministic"]
    starts = [c for c in FakeServerProcess.calls if c[0] == "start"]
    assert [(c[2], c[3]) for c in starts] == [
        ({"VLLM_BATCH_INVARIANT": "0"}, [root, "--moe-backend", "triton"]),
        ({}, [root, "--moe-backend", "triton", "--deterministic"]),
        ({"VLLM_BATCH_INVARIANT": "0"}, [root, "--moe-backend", "kittens"]),
        ({}, [root, "--moe-backend", "kittens", "--deterministic"]),
    ]
    assert results["targets"][0]["server_command"] == f"VLLM_BATCH_INVARIANT=0 mok-serve {root} --moe-backend triton"


def test_bad_modes_are_usage_errors(tmp_path, capsys):
    assert invariance.main(["--out", str(tmp_path), "--modes", "fast", "--probes", "1"]) == invariance.EXIT_USAGE
    assert "--modes 'fast'" in capsys.readouterr().err
