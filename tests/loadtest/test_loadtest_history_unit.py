"""loadtest/history.py: the long-format history CSV every benchmark run appends to (CPU, no GPU)."""

import csv

from mok_serve.loadtest import cli, history

from test_loadtest_merge import serve

LAYER_META = {"gpu": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-02T04:26:49+00:00", "torch": "2.11.0",
              "triton": "3.6.0", "vllm": "0.32.0", "l2_flush": "write"}
LAYER_ROW = {"shape": "Qwen3-30B-A3B", "tokens": 128, "routing": "uniform", "kittens_ms": 0.1, "torch_ms": 0.3,
             "transformers_ms": 0.4, "vllm_ms": 0.12, "kittens_eager_ms": 0.15, "vllm_eager_ms": 0.14,
             "eager_extra_ms": {"kittens": 0.05, "vllm": 0.02}, "floor_ms": 0.08, "ratio_to_floor": 1.25,
             "clock": {"kittens": {"sm_mhz": 1980.0, "power_w": 300.0}, "torch": None}}


def read(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_schema_and_default_path_under_pytest():
    for col in ("date", "commit", "benchmark", "gpu", "versions", "shape", "tokens_or_load", "routing", "provider",
                "metric", "value", "unit"):
        assert col in history.COLUMNS
    assert history.default_path() is None  # tests never append to the repository's history.csv


def test_append_writes_the_header_once(tmp_path):
    path = tmp_path / "sub" / "history.csv"
    assert history.append([{"benchmark": "b", "metric": "m", "value": 1.0}], path) == 1
    assert history.append([{"benchmark": "b", "metric": "m", "value": 2.5}], path) == 1
    assert history.append([], path) == 0
    lines = path.read_text().splitlines()
    assert lines[0] == ",".join(history.COLUMNS) and len(lines) == 3
    assert [r["value"] for r in read(path)] == ["1", "2.5"]


def test_layer_bench_rows():
    rows = history.layer_bench_rows(LAYER_META, [LAYER_ROW])
    got = {(r["provider"], r["metric"]): r["value"] for r in rows}
    assert got[("kittens", "time_ms")] == 0.1 and got[("vllm", "time_ms")] == 0.12
    assert got[("torch", "time_ms")] == 0.3 and got[("transformers", "time_ms")] == 0.4
    assert got[("kittens-eager", "time_ms")] == 0.15 and got[("vllm-eager", "time_ms")] == 0.14
    assert got[("floor", "floor_ms")] == 0.08 and got[("kittens", "x_floor")] == 1.25
    assert got[("kittens", "sm_mhz")] == 1980.0
    assert not any(r["provider"].startswith("eager_extra") for r in rows)
    r = rows[0]
    assert (r["benchmark"], r["commit"], r["gpu"], r["shape"], r["tokens_or_load"], r["routing"]) == (
        "layer_bench", "abc1234", "NVIDIA H200", "Qwen3-30B-A3B", 128, "uniform")
    assert r["versions"] == "torch=2.11.0 triton=3.6.0 vllm=0.32.0"


def test_ep_and_cpu_rows():
    ep = history.ep_bench_rows({"world": 2, "commit": "c", "time": "2026-11-30 22:02:13", "gpu": "g"},
                               [{"shape": "DeepSeek-V3", "tokens": 1, "routing": "uniform", "world": 2,
                                 "ms": {"kittens_pull": 0.25, "a2a": 0.98}, "floor_ms": 0.18, "ratio_to_floor": 1.4}])
    assert {(r["provider"], r["metric"], r["config"]) for r in ep} >= {
        ("kittens-pull", "time_ms", "world=2"), ("a2a", "time_ms", "world=2"), ("floor", "floor_ms", "world=2")}
    cpu = history.cpu_layer_bench_rows({"date": "d"}, [{"shape": "qwen3_moe", "tokens": "1", "threads": "2",
                                                        "backend": "kittens", "median_us": "8.4", "min_us": "7.3",
                                                        "commit": "eaddf1d", "cpu": "AMD EPYC"}])
    assert [(r["metric"], r["value"], r["config"], r["gpu"]) for r in cpu] == [
        ("time_us", 8.4, "threads=2", "AMD EPYC"), ("min_time_us", 7.3, "threads=2", "AMD EPYC")]


def serve_like(name, commit="c1"):
    summary = {"output_throughput": 205.0, "total_token_throughput": 615.0, "request_throughput": 0.8,
               "completed": 8, "failed": 0, "ttft": {"mean_ms": 34.0, "p50_ms": 33.0, "p99_ms": 40.0},
               "tpot": {"mean_ms": 4.7, "p50_ms": 4.7, "p99_ms": 4.8}, "itl": {"mean_ms": 4.7, "p50_ms": 4.7,
                                                                                  "p99_ms": 5.4}}
    runs = [{"spec": {"name": "512/256 c=1", "concurrency": 1, "rate": None, "input_len": 512, "output_len": 256},
             "summary": summary, "moe": {"moe_share": 0.33}},
            {"spec": {"name": "512/256 rate=24", "concurrency": None, "rate": 24.0, "input_len": 512,
                      "output_len": 256}, "summary": summary}]
    return {"started": "2026-12-02T10:00:00", "environment": {"commit": commit, "gpu": "NVIDIA H200", "torch": "2.11"},
            "config": {"model": "/tmp/models/qwen3-30b-a3b"}, "targets": [{"name": name, "runs": runs}]}


def test_serve_rows():
    rows = history.serve_rows(serve_like("kittens"))
    got = {(r["tokens_or_load"], r["metric"]): r["value"] for r in rows}
    assert got[("c=1", "output_tok_s")] == 205.0 and got[("c=1", "ttft_p99_ms")] == 40.0
    assert got[("c=1", "moe_share")] == 0.33 and ("rate=24.0", "moe_share") not in got
    assert got[("rate=24.0", "total_tok_s")] == 615.0 and got[("c=1", "failed")] == 0
    assert {(r["benchmark"], r["shape"], r["provider"], r["routing"], r["commit"]) for r in rows} == {
        ("serve", "qwen3-30b-a3b", "kittens", "512/256", "c1")}


def test_serve_and_merge_append_rows_for_both_servers(fake_server, tmp_path):
    hist = tmp_path / "history.csv"
    _, url = fake_server("--layers")
    for name in ("kittens", "stock"):
        serve(url, name, tmp_path / name, "--no-history")
    assert not hist.exists()
    assert cli.main(["merge", str(tmp_path / "kittens"), str(tmp_path / "stock"), "--out", str(tmp_path / "m"),
                     "--no-plots", "--history", str(hist)]) == 0
    rows = read(hist)
    assert {r["provider"] for r in rows} == {"kittens", "stock"}
    assert {r["benchmark"] for r in rows} == {"serve"}
    assert {"output_tok_s", "ttft_p99_ms", "tpot_mean_ms", "itl_p50_ms", "failed"} <= {r["metric"] for r in rows}
    n = len(rows)
    serve(url, "third", tmp_path / "third", "--history", str(hist))  # a serve run appends its own server's rows
    rows = read(hist)
    assert len(rows) > n and {r["provider"] for r in rows[n:]} == {"third"}


def test_sweep_rows_keep_one_floor_per_point_and_drop_variants_with_other_bits():
    meta = {**LAYER_META, "vllm": None}
    point = {"shape": "DeepSeek-V3", "tokens": 256, "routing": "concentrated", "floor_ms": 0.16,
             "clock": {"sm_mhz": 1980.0}}
    results = [{**point, "label": "default", "repeat": 0, "ms": 1.5, "bitwise_vs_default": True},
               {**point, "label": "m64", "repeat": 0, "ms": 0.75, "bitwise_vs_default": True},
               {**point, "label": "m64", "repeat": 1, "ms": 0.76, "bitwise_vs_default": True},
               {**point, "label": "broken", "repeat": 0, "ms": 0.1, "bitwise_vs_default": False}]
    rows = history.sweep_rows(meta, results)
    times = {r["config"]: r["value"] for r in rows if r["metric"] == "time_ms"}
    assert times == {"variant=default repeat=0": 1.5, "variant=m64 repeat=0": 0.75, "variant=m64 repeat=1": 0.76}
    floors = [r for r in rows if r["metric"] == "floor_ms"]
    assert [(f["provider"], f["value"], f["config"]) for f in floors] == [("floor", 0.16, "")]
    assert {r["benchmark"] for r in rows} == {"layer_bench_sweep"}
    assert {r["versions"] for r in rows} == {"torch=2.11.0 triton=3.6.0"}
    assert sum(r["metric"] == "sm_mhz" for r in rows) == 3
