"""mok-loadtest without vLLM servers: metric definitions (checked against vLLM's own
``calculate_metrics``), workload determinism, SSE parsing, layer-JSON parsing, loopback rule."""

import math
import time

import numpy as np
import pytest

from mok_serve import tiny_models
from mok_serve.loadtest import client, report, server_layers, workload
from mok_serve.loadtest.metrics import RequestRecord, peak_output_tokens_per_s, ratio, stats, summarize


def make_records(seed=0, n=40, fail_every=7):
    rng = np.random.default_rng(seed)
    recs = []
    t = 1000.0
    for i in range(n):
        out = int(rng.integers(1, 40))
        itl = rng.uniform(0.001, 0.02, size=out - 1).tolist()
        ttft = float(rng.uniform(0.01, 0.2))
        r = RequestRecord(index=i, prompt_len=int(rng.integers(5, 100)), expected_output_len=out,
                          success=(i % fail_every != 3), output_tokens=out, ttft=ttft, itl=itl,
                          latency=ttft + sum(itl) + float(rng.uniform(0, 0.001)), start_time=t)
        if not r.success:
            r.error = "HTTP 500 Internal Server Error: boom"
        t += float(rng.uniform(0, 0.3))
        recs.append(r)
    return recs


def test_summary_equals_vllm_calculate_metrics():
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    recs = make_records()
    outputs = [
        RequestFuncOutput(success=r.success, latency=r.latency, output_tokens=r.output_tokens, ttft=r.ttft,
                          itl=list(r.itl), prompt_len=r.prompt_len, start_time=r.start_time, error=r.error)
        for r in recs
    ]
    dur = 12.345
    pcts = [50.0, 90.0, 99.0]
    vm, _ = calculate_metrics([None] * len(recs), outputs, dur, None, pcts, {})
    ours = summarize(recs, dur)
    assert ours["completed"] == vm.completed and ours["failed"] == vm.failed
    assert ours["total_input_tokens"] == vm.total_input and ours["total_output_tokens"] == vm.total_output
    for key, attr in [("request_throughput", "request_throughput"), ("output_throughput", "output_throughput"),
                      ("total_token_throughput", "total_token_throughput"),
                      ("peak_output_throughput", "max_output_tokens_per_s")]:
        assert ours[key] == pytest.approx(getattr(vm, attr), rel=1e-12), key
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert ours[m]["mean_ms"] == pytest.approx(getattr(vm, f"mean_{m}_ms"), rel=1e-12)
        assert ours[m]["median_ms"] == pytest.approx(getattr(vm, f"median_{m}_ms"), rel=1e-12)
        assert ours[m]["std_ms"] == pytest.approx(getattr(vm, f"std_{m}_ms"), rel=1e-12)
        for p, v in getattr(vm, f"percentiles_{m}_ms"):
            assert ours[m][f"p{int(p)}_ms"] == pytest.approx(v, rel=1e-12)
    assert ours["errors"] == {"HTTP 500 Internal Server Error: boom": vm.failed}


def test_tpot_definition_and_single_token_requests():
    r = RequestRecord(index=0, success=True, output_tokens=5, ttft=0.1, itl=[0.01] * 4, latency=0.5)
    assert r.tpot == pytest.approx((0.5 - 0.1) / 4)
    one = RequestRecord(index=1, success=True, output_tokens=1, ttft=0.2, latency=0.2)
    assert one.tpot is None
    s = summarize([r, one], 2.0)
    assert s["tpot"]["mean_ms"] == pytest.approx(100.0)  # only the multi-token request
    assert s["ttft"]["mean_ms"] == pytest.approx(150.0)
    assert s["output_throughput"] == pytest.approx(3.0)


def test_requests_in_flight_mean_and_peak():
    from mok_serve.loadtest.metrics import requests_in_flight

    # Two back to back on one slot (the second sent as the first ends), one overlapping both.
    recs = [RequestRecord(index=0, success=True, start_time=0.0, latency=1.0),
            RequestRecord(index=1, success=True, start_time=1.0, latency=1.0),
            RequestRecord(index=2, success=True, start_time=0.5, latency=1.0),
            RequestRecord(index=3, error="x", start_time=0.2, latency=5.0)]  # failed: not counted
    got = requests_in_flight(recs)
    assert got["peak"] == 2 and got["mean"] == pytest.approx(3.0 / 2.0)
    assert summarize(recs, 2.0)["in_flight"] == got
    assert requests_in_flight([recs[3]]) == {"mean": None, "peak": None}


def test_empty_and_all_failed():
    s = summarize([RequestRecord(index=0, error="x")], 1.0)
    assert s["completed"] == 0 and s["failed"] == 1 and s["output_throughput"] == 0
    assert s["ttft"]["mean_ms"] is None and stats([])["p99_ms"] is None
    assert peak_output_tokens_per_s([]) == 0.0
    assert ratio(1.0, 0) is None and ratio(None, 1.0) is None and ratio(3.0, 2.0) == 1.5


def test_random_workload_is_seeded_and_exact():
    vocab = np.arange(10, 500)
    a = workload.random_workload(8, 32, 16, vocab, seed=3)
    b = workload.random_workload(8, 32, 16, vocab, seed=3)
    c = workload.random_workload(8, 32, 16, vocab, seed=4)
    assert [x.prompt for x in a] == [x.prompt for x in b] != [x.prompt for x in c]
    assert all(len(x.prompt) == x.prompt_len == 32 and x.output_len == 16 for x in a)
    assert all(10 <= t < 500 for x in a for t in x.prompt)
    v = workload.random_workload(50, 100, 50, vocab, seed=0, range_ratio=0.5)
    assert {len(x.prompt) for x in v} != {100} and all(50 <= len(x.prompt) <= 150 for x in v)


def test_poisson_arrivals():
    t = workload.arrival_offsets(2000, rate=20.0, burstiness=1.0, seed=1)
    assert t == workload.arrival_offsets(2000, 20.0, 1.0, 1)
    assert t[-1] == pytest.approx(2000 / 20.0)
    gaps = np.diff([0.0, *t])
    assert gaps.mean() == pytest.approx(0.05, rel=1e-6)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.1)  # exponential: CV 1
    assert workload.arrival_offsets(3, math.inf, 1.0, 0) == [0.0, 0.0, 0.0]


def test_dataset_file_formats(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a b"}\n{"text": "c", "output_len": 5}\n')
    (tmp_path / "p.json").write_text('["x", {"prompt": "y", "max_tokens": 3}]')
    (tmp_path / "p.txt").write_text("one\n\ntwo\n")
    assert workload.load_dataset(tmp_path / "p.jsonl") == [{"prompt": "a b", "output_len": None},
                                                           {"prompt": "c", "output_len": 5}]
    assert [e["prompt"] for e in workload.load_dataset(tmp_path / "p.json")] == ["x", "y"]
    entries = workload.load_dataset(tmp_path / "p.txt")
    items = workload.dataset_workload(entries, 5, 7, seed=0)
    assert len(items) == 5 and {i.prompt for i in items} == {"one", "two"} and {i.output_len for i in items} == {7}


def test_sse_parser_handles_split_chunks():
    stream = b'data: {"a": 1}\n\ndata: {"b": 2}\n\n: ping\n\ndata: [DONE]\n\n'
    p = client.SSEParser()
    out = []
    for i in range(0, len(stream), 5):
        out += p.feed(stream[i:i + 5])
    assert out == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_loopback_only():
    assert client.check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert client.check_loopback("http://localhost:1") == "http://localhost:1"
    assert client.check_loopback("http://[::1]:8000") == "http://[::1]:8000"
    for bad in ("http://10.0.0.1:8000", "http://example.com", "ftp://127.0.0.1", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            client.check_loopback(bad)


def test_cli_refuses_remote_url(capsys):
    from mok_serve.loadtest.cli import main

    assert main(["serve", "--url", "x=http://192.168.1.1:8000", "--no-progress"]) == 2
    assert "loopback" in capsys.readouterr().err


def test_layers_json_parsing():
    doc = {"backend": "kittens", "ep_rank": 0, "window": 512, "layers": [
        {"layer": "model.layers.0.mlp.experts", "rank": 0, "calls": 12, "tokens": 800,
         "latency_us": {"mean": 51.5, "p50": 50.0, "p90": 60.0, "p99": 70.0},
         "phases": {"experts": {"mean_us": 40.0}}, "expert_tokens": [1, 2, 3], "imbalance": 1.4},
        {"layer": "model.layers.1.mlp.experts", "rank": 0, "calls": 12, "tokens": 800,
         "latency_us": {"mean": 55.0, "p50": 54.0, "p90": 60.0, "p99": 75.0},
         "phases": {"experts": {"mean_us": 41.0}}, "expert_tokens": [1, 2, 3], "imbalance": 1.2},
    ]}
    parsed = server_layers.parse_layers(doc)
    assert [p["label"] for p in parsed] == ["model.layers.0.mlp.experts (rank 0)", "model.layers.1.mlp.experts (rank 0)"]
    assert set(parsed[0]["time_fields"]) == {"latency_us.mean", "latency_us.p50", "latency_us.p90",
                                             "latency_us.p99", "phases.experts.mean_us"}
    assert parsed[0]["fields"]["calls"] == 12 and "calls" not in parsed[0]["time_fields"]
    assert server_layers.headline_field(parsed) == "latency_us.mean"
    assert server_layers.parse_layers({"nothing": 1}) is None
    # a dict keyed by layer name works too
    assert server_layers.parse_layers({"layers": {"l0": {"mean_ms": 1.0}}})[0]["label"] == "l0"


def test_ratios_from_summaries():
    def target(name, tps):
        return {"name": name, "runs": [{"spec": {"name": "c=1", "rate": None, "concurrency": 1},
                                        "summary": {"output_throughput": tps, "ttft": {"mean_ms": 10.0}}}]}

    results = {"config": {"baseline": "stock"}, "targets": [target("stock", 100.0), target("kittens", 150.0)]}
    (row,) = report.compute_ratios(results)
    assert row["baseline"] == "stock" and row["candidate"] == "kittens"
    assert row["output tok/s"] == pytest.approx(1.5) and row["TTFT mean ms"] == pytest.approx(1.0)
    assert "| c=1 | 100.0 | 150.0 | 1.50x |" in report.headline_table(results)


def test_layers_json_of_mok_serve_schema():
    """The schema of server/stats.py: per-layer entries with a per-rank list."""
    lat = {"mean": 0.2, "p50": 0.19, "p90": 0.25, "p99": 0.3, "max": 0.4, "samples": 100}
    doc = {"object": "kittens.layers", "backend": "kittens", "timing": {"enabled": True, "sample_every": 1},
           "num_layers": 2, "layers": [
               {"index": i, "name": f"model.layers.{i}.mlp.experts", "num_experts": 8, "top_k": 2,
                "ep_imbalance": 1.0, "ranks": [
                    {"rank": r, "ep_rank": r, "ep_size": 2, "experts_class": "KittensExperts",
                     "local_experts": [0, 1], "calls": 50, "tokens": 400, "sampled_calls": 50,
                     "latency_ms": lat, "phases_ms": {"dispatch": {"mean": 0.01}, "experts": {"mean": 0.15}},
                     "expert_tokens": [1] * 8, "local_expert_tokens": 4, "imbalance": 1.1}
                    for r in range(2)]}
               for i in range(2)]}
    parsed = server_layers.parse_layers(doc)
    assert [p["label"] for p in parsed] == [f"model.layers.{i}.mlp.experts (rank {r})" for i in range(2) for r in range(2)]
    assert set(parsed[0]["time_fields"]) == {"latency_ms.mean", "latency_ms.p50", "latency_ms.p90", "latency_ms.p99",
                                             "latency_ms.max", "phases_ms.dispatch.mean", "phases_ms.experts.mean"}
    assert parsed[0]["fields"]["calls"] == 50 and parsed[0]["fields"]["num_experts"] == 8
    assert server_layers.headline_field(parsed) == "latency_ms.mean"


@pytest.mark.parametrize("command,module", [("layer", "bench.layer"), ("ep", "bench.ep"),
                                            ("ep-scaling", "bench.ep_scaling")])
def test_benchmark_subcommands_forward(monkeypatch, command, module):
    import sys
    import types

    from mok_serve.loadtest.cli import main

    seen = []
    fake = types.ModuleType(f"mok_serve.loadtest.{module}")
    fake.main = lambda argv: seen.append(argv) or 3
    monkeypatch.setitem(sys.modules, f"mok_serve.loadtest.{module}", fake)
    assert main([command, "--tokens", "8", "--sweep"]) == 3
    assert seen == [["--tokens", "8", "--sweep"]]


def test_random_text_prompts_reencode_to_exact_length():
    tok = workload.load_tokenizer(tiny_models.build_tiny_model())
    vocab = workload.vocab_of(tok)
    assert not set(tok.all_special_ids) & set(vocab.tolist())
    for il in (16, 64, 128):
        items = workload.random_workload(24, il, 8, vocab, seed=il, tokenizer=tok)
        assert all(isinstance(x.prompt, str) for x in items)
        assert [len(tok.encode(x.prompt)) for x in items] == [il] * 24  # what the server will count
        assert items[0].prompt == workload.random_workload(1, il, 8, vocab, seed=il, tokenizer=tok)[0].prompt


def test_clock_sampler_summarises_its_window():
    from mok_serve.loadtest.gpu_clocks import SW_POWER_CAP, ClockSampler

    readings = iter([(1980.0, 150.0, 0)] * 5 + [(1410.0, 700.0, SW_POWER_CAP)] * 10_000)
    sampler = ClockSampler(lambda: next(readings), period_s=0.001)
    assert sampler.available
    time.sleep(0.03)  # the five uncapped readings come first
    t0 = time.monotonic()
    time.sleep(0.05)
    t1 = time.monotonic()
    sampler.stop()
    got = sampler.summary(t0, t1)
    assert got["sm_mhz"] == 1410.0 and got["power_w"] == 700.0 and got["power_capped"] == 1.0 and got["samples"] > 5
    assert sampler.summary(t1 + 10, t1 + 20) is None
    whole = sampler.summary(0, t1)
    assert 0 < whole["power_capped"] < 1  # both kinds of reading, in order
    idle = ClockSampler(None)
    assert not idle.available and idle.summary(0, time.monotonic()) is None
    idle.stop()


