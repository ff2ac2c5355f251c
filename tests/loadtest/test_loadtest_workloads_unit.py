"""mok-loadtest serve without servers: --workload SPEC parsing, run names, seeds and request
counts per run, the clash with the single-workload options, and the MoE share of a run."""

import argparse

import pytest

from mok_serve.loadtest import cli


def parse(*argv):
    return cli.build_parser().parse_args(["serve", *argv])


def specs(*argv):
    args = parse(*argv)
    return cli._specs(args, cli.workloads_of(args))


@pytest.mark.parametrize("text,expected", [
    ("512:256:c=1,8,32,128,256:rate=30", cli.Workload(512, 256, [1, 8, 32, 128, 256], [30.0])),
    ("4096:64:c=1,32", cli.Workload(4096, 64, [1, 32], [])),
    ("16:8:rate=2.5,10", cli.Workload(16, 8, [], [2.5, 10.0])),
    ("16:8:rate=4:c=2", cli.Workload(16, 8, [2], [4.0])),
    ("16:8", cli.Workload(16, 8, [1, 4, 16], [8.0])),  # the single-workload default runs
])
def test_workload_spec(text, expected):
    assert cli.parse_workload(text) == expected


@pytest.mark.parametrize("text,why", [
    ("512", "no IN:OUT"),
    ("512:x", "IN and OUT must be integers"),
    ("0:8", "IN and OUT must be >= 1"),
    ("16:8:c=1,a", "expected comma-separated integers"),
    ("16:8:c=0", "concurrency values must be >= 1"),
    ("16:8:rate=-1", "request rates must be > 0"),
    ("16:8:c=", "c= lists no value"),
    ("16:8:c=1:c=2", "c= given twice"),
    ("16:8:n=4", "unknown field 'n=4'"),
    ("16:8:c", "unknown field 'c'"),
])
def test_bad_workload_spec_is_an_argparse_error_naming_the_text(capsys, text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why):
        cli.parse_workload(text)
    with pytest.raises(SystemExit) as exc:
        parse("--workload", text)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"argument --workload: bad workload {text!r}: {why}" in err


def test_one_workload_keeps_the_names_and_seeds_of_the_single_workload_options():
    got = specs("--input-len", "32", "--output-len", "8", "--concurrency", "1,4", "--request-rate", "2",
                "--seed", "5")
    assert [(s.name, s.seed, s.input_len, s.output_len) for s in got] == [
        ("c=1", 1005, 32, 8), ("c=4", 2005, 32, 8), ("rate=2", 100005, 32, 8)]
    default = specs()
    assert [s.name for s in default] == ["c=1", "c=4", "c=16", "rate=8"]
    assert {(s.input_len, s.output_len) for s in default} == {(128, 64)}
    assert [s.name for s in specs("--workload", "32:8:c=1,4:rate=2")] == ["c=1", "c=4", "rate=2"]


def test_several_workloads_run_in_order_with_prefixed_names_and_distinct_seeds():
    got = specs("--workload", "512:256:c=1,8:rate=30", "--workload", "4096:64:c=1,32", "--rate-max-concurrency", "64")
    assert [s.name for s in got] == ["512/256 c=1", "512/256 c=8", "512/256 rate=30,c=64", "4096/64 c=1",
                                     "4096/64 c=32"]
    assert [(s.input_len, s.output_len) for s in got] == [(512, 256)] * 3 + [(4096, 64)] * 2
    assert [s.concurrency for s in got] == [1, 8, 64, 1, 32] and [s.warmup for s in got] == [2, 8, 4, 2, 32]
    # Measured and warm-up seeds (seed, seed + 1) and arrival seeds all differ: no prompt is reused.
    seeds = [s.seed + k for s in got for k in (0, 1, 7)]
    assert len(set(seeds)) == len(seeds)
    assert got[0].to_dict() == {"name": "512/256 c=1", "concurrency": 1, "rate": None, "num_requests": 48,
                                "warmup": 2, "seed": 1000, "input_len": 512, "output_len": 256}


def test_requests_per_stream_scales_fixed_concurrency_runs_only():
    got = specs("--workload", "16:8:c=1,8,30,256:rate=5", "--num-requests", "1", "--requests-per-stream", "0.1")
    assert [s.num_requests for s in got] == [1, 1, 3, 26, 1]  # 0.1 x 30 = 3, not 4
    got = specs("--concurrency", "1,8,256", "--request-rate", "5", "--num-requests", "20",
                "--requests-per-stream", "2.5")
    assert [s.num_requests for s in got] == [20, 20, 640, 20]
    assert [s.num_requests for s in specs("--concurrency", "256", "--num-requests", "20",
                                                 "--request-rate", "")] == [20]  # off by default
    with pytest.raises(SystemExit):
        parse("--requests-per-stream", "-1")


def test_rate_seconds_scales_poisson_runs_only():
    got = specs("--workload", "16:8:c=4:rate=2.5,30", "--num-requests", "10", "--rate-seconds", "20")
    assert [(s.name, s.num_requests) for s in got] == [("c=4", 10), ("rate=2.5", 50), ("rate=30", 600)]
    got = specs("--workload", "16:8:rate=0.1", "--num-requests", "10", "--rate-seconds", "20")
    assert [s.num_requests for s in got] == [10]  # never below --num-requests
    args = parse("--workload", "16:8:c=4:rate=3", "--rate-seconds", "20", "--num-requests", "10")
    workloads = cli.workloads_of(args)
    assert cli._workload_description(args, workloads, cli._specs(args, workloads)).endswith(
        "measured requests per run: 10 at fixed concurrency, max(10, ceil(rate x 20 s)) in Poisson runs")
    with pytest.raises(SystemExit):
        parse("--rate-seconds", "-1")


@pytest.mark.parametrize("clash", [["--input-len", "128"], ["--output-len", "9"], ["--concurrency", "2"],
                                   ["--request-rate", ""]])
def test_workload_with_a_single_workload_option_is_a_usage_error(capsys, clash):
    code = cli.main(["serve", "--url", "x=http://127.0.0.1:9", "--workload", "16:8:c=1", *clash, "--no-progress"])
    assert code == cli.EXIT_USAGE
    assert f"--workload cannot be combined with {clash[0]}" in capsys.readouterr().err


def test_runs_with_the_same_name_are_a_usage_error(capsys):
    code = cli.main(["serve", "--url", "x=http://127.0.0.1:9", "--workload", "16:8:c=1", "--workload", "16:8:c=1,2",
                     "--no-progress"])
    assert code == cli.EXIT_USAGE and "['16/8 c=1']" in capsys.readouterr().err


def test_a_point_listed_again_is_another_run_with_its_own_name_and_prompts():
    got = specs("--workload", "512:256:c=8,256,256,256:rate=3,3", "--workload", "4096:64:c=32")
    assert [s.name for s in got] == ["512/256 c=8", "512/256 c=256", "512/256 c=256 #2", "512/256 c=256 #3",
                                     "512/256 rate=3", "512/256 rate=3 #2", "4096/64 c=32"]
    assert [s.concurrency for s in got[1:4]] == [256] * 3 and [s.rate for s in got[4:6]] == [3.0, 3.0]
    assert len({s.seed for s in got}) == len(got)  # fresh prompts: no prefix-cache hit from an earlier run


def test_report_gives_a_repeated_point_its_median_range_and_ratio_of_medians(tmp_path):
    from mok_serve.loadtest import report

    def target(name, tok_s):
        runs = [{"spec": {"name": n, "concurrency": 256, "rate": None}, "notes": [], "records": [],
                 "summary": {"output_throughput": v, "failed": 0}} for n, v in tok_s.items()]
        return {"name": name, "events": [], "runs": runs}

    points = ["c=1", "c=256", "c=256 #2", "c=256 #3"]
    results = {"config": {"baseline": "stock", "workload_description": "w"}, "targets": [
        target("stock", dict(zip(points, [100.0, 8000.0, 7300.0, 7900.0]))),
        target("kittens", dict(zip(points, [99.0, 6700.0, 7200.0, 6200.0])))]}
    assert report.repeated_points(results) == {"c=256": ["c=256", "c=256 #2", "c=256 #3"]}
    table = report.repeats_table(results)
    assert "| point | runs | stock median (range) | kittens median (range) | kittens/stock of medians | run by run |" in table
    # medians 7900 and 6700: 0.85x; run by run 6700/8000 = 0.84, 7200/7300 = 0.99, 6200/7900 = 0.78
    assert "| c=256 | 3 | 7900.0 (7300.0-8000.0) | 6700.0 (6200.0-7200.0) | 0.85x | 0.78-0.99x |" in table
    md = report.write_markdown(results, tmp_path, []).read_text()
    assert "## Repeated points" in md and "| c=256 | 3 |" in md
    # a name that merely ends in '#2' without its first run is its own point; no repeats, no section
    results["targets"] = [target("stock", {"c=1": 1.0, "rate=3 #2": 2.0}), target("kittens", {"c=1": 1.0, "rate=3 #2": 2.0})]
    assert report.repeats_table(results) is None
    assert "## Repeated points" not in report.write_markdown(results, tmp_path, []).read_text()


def test_workload_description_names_each_workload_and_the_request_counts():
    args = parse("--workload", "512:256:c=1:rate=3", "--workload", "4096:64:c=32", "--requests-per-stream", "2")
    workloads = cli.workloads_of(args)
    assert cli._workload_description(args, workloads, cli._specs(args, workloads)) == (
        "random 512 in / 256 out tokens (text prompts); runs 512/256 c=1, 512/256 rate=3; "
        "random 4096 in / 64 out tokens (text prompts); runs 4096/64 c=32; "
        "measured requests per run: max(48, ceil(2 x concurrency)) at fixed concurrency, 48 in Poisson runs")
    args = parse()
    workloads = cli.workloads_of(args)
    assert cli._workload_description(args, workloads, cli._specs(args, workloads)) == (
        "random 128 in / 64 out tokens (text prompts); runs c=1, c=4, c=16, rate=8; 48 requests per run")


def test_serve_help_lists_the_new_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--workload SPEC" in text and "IN:OUT[:c=LIST][:rate=LIST]" in text
    assert "--requests-per-stream K" in text and "max(--num-requests, ceil(K x concurrency))" in text


def layers_doc(means_by_layer, seconds=2.0, calls=400, tokens=3200, enabled=True):
    """A GET /v1/kittens/layers document (server/stats.py): ``means_by_layer[i][r]`` is layer i's
    mean latency in ms on rank r (None: no latency)."""
    def rank(r, mean):
        lat = None if mean is None else {"mean": mean, "p50": mean, "p90": mean, "p99": mean, "max": mean, "samples": 9}
        return {"rank": r, "ep_rank": r, "ep_size": 2, "calls": calls, "tokens": tokens, "sampled_calls": 9,
                "latency_ms": lat, "phases_ms": None, "expert_tokens": [1, 2], "local_expert_tokens": 1,
                "imbalance": 1.0}

    return {"object": "kittens.layers", "timing": {"enabled": enabled, "sample_every": 1, "window_calls": 9},
            "window": {"started_at": 1.0, "seconds": seconds}, "num_layers": len(means_by_layer),
            "layers": [{"index": i, "name": f"model.layers.{i}.mlp.experts", "num_experts": 2, "top_k": 1,
                        "ranks": [rank(r, m) for r, m in enumerate(means)]} for i, means in enumerate(means_by_layer)]}


def test_moe_share_of_one_layer():
    from mok_serve.loadtest.metrics import moe_step_share

    got = moe_step_share(layers_doc([[0.5]]))
    assert got == {"steps": 400, "tokens_per_step": 8.0, "step_ms": 5.0, "moe_ms_per_step": 0.5,
                   "moe_share": pytest.approx(0.1)}


def test_moe_share_sums_layers_and_takes_the_slowest_rank():
    from mok_serve.loadtest.metrics import moe_step_share

    got = moe_step_share(layers_doc([[0.5, 0.75], [1.0, 0.25]], seconds=4.0))
    assert got["steps"] == 400 and got["step_ms"] == 10.0
    assert got["moe_ms_per_step"] == 1.75 and got["moe_share"] == pytest.approx(0.175)
    doc = layers_doc([[0.5, 0.75], [1.0, 0.25]])
    doc["layers"][0]["ranks"].reverse()  # steps and tokens come from rank 0 wherever it is listed
    doc["layers"][0]["ranks"][0]["calls"] = 800
    assert moe_step_share(doc)["steps"] == 400


@pytest.mark.parametrize("doc", [
    layers_doc([[0.5], [None]]),  # a layer without latency: no partial sum
    layers_doc([[0.5, None]]),
    layers_doc([[0.5]], enabled=False),
])
def test_moe_share_without_latency_keeps_the_step_figures(doc):
    from mok_serve.loadtest.metrics import moe_step_share

    got = moe_step_share(doc)
    assert got["moe_ms_per_step"] is None and got["moe_share"] is None
    assert got["steps"] == 400 and got["tokens_per_step"] == 8.0 and got["step_ms"] == 5.0


@pytest.mark.parametrize("doc", [None, {}, {"layers": []}, {"layers": [{"layer": "x", "mean_us": 3.0}]},
                                 layers_doc([[0.5]], calls=0), layers_doc([[0.5]], seconds=None)])
def test_moe_share_of_missing_data_is_none_not_an_error(doc):
    from mok_serve.loadtest.metrics import MOE_KEYS, moe_step_share

    got = moe_step_share(doc)
    assert set(got) == set(MOE_KEYS) and got["moe_share"] is None and got["step_ms"] is None


def test_report_shows_the_moe_share_per_run_and_the_ratio_of_moe_ms(tmp_path):
    from mok_serve.loadtest import report
    from mok_serve.loadtest.metrics import moe_step_share, summarize

    def target(name, doc):
        run = {"spec": {"name": "c=1", "rate": None, "concurrency": 1}, "notes": [], "records": [],
               "summary": summarize([], 1.0), "moe": None if doc is None else moe_step_share(doc)}
        return {"name": name, "events": [], "runs": [run]}

    results = {"config": {"baseline": "stock", "workload_description": "w"},
               "targets": [target("stock", layers_doc([[1.0], [1.0]])), target("kittens", layers_doc([[0.5], [None]])),
                           target("other", None)]}
    results["ratios"] = report.compute_ratios(results)
    detail = report.detail_table(results, "c=1")
    assert "| steps | 400 | 400 | — |  |" in detail and "| tokens per step | 8.0 | 8.0 | — |  |" in detail
    assert "| step ms | 5.00 | 5.00 | — |  |" in detail
    assert "| MoE ms per step | 2.000 | — | — | — |" in detail  # kittens' second layer has no latency
    assert "| MoE share | 40.0% | — | — |  |" in detail
    results["targets"][1] = target("kittens", layers_doc([[0.5], [0.5]]))
    results["ratios"] = report.compute_ratios(results)
    assert "| MoE ms per step | 2.000 | 1.000 | — | 0.50x |" in report.detail_table(results, "c=1")
    assert results["ratios"][0]["MoE ms per step"] == 0.5
    headline = report.headline_table(results)
    assert "stock MoE share | kittens MoE share | other MoE share |" in headline
    assert "| 40.0% | 20.0% | — |" in headline
    md = report.write_markdown(results, tmp_path, []).read_text()
    assert "MoE share = MoE ms per step" in md and "an estimate" in md
    assert "| 40.0% | 20.0% | — |" in report.console_summary(results, tmp_path, 0)


def two_workload_results():
    """Two servers; workload 512/256 with c=1,8 and rate=4, workload 4096/64 with rate=2 only."""
    from mok_serve.loadtest.metrics import RequestRecord, summarize

    def run(name, in_out, concurrency, rate, tok_s):
        recs = [RequestRecord(index=i, prompt_len=in_out[0], expected_output_len=4, success=True, output_tokens=4,
                              ttft=0.01, itl=[0.005] * 3, latency=0.025, start_time=float(i)) for i in range(4)]
        summary = summarize(recs, 16 / tok_s)
        return {"spec": {"name": name, "concurrency": concurrency, "rate": rate, "input_len": in_out[0],
                         "output_len": in_out[1]}, "notes": [], "records": [], "summary": summary}

    def target(name, scale):
        return {"name": name, "events": [], "runs": [
            run("512/256 c=1", (512, 256), 1, None, 100 * scale), run("512/256 c=8", (512, 256), 8, None, 500 * scale),
            run("512/256 rate=4", (512, 256), None, 4.0, 300 * scale),
            run("4096/64 rate=2", (4096, 64), None, 2.0, 50 * scale)]}

    return {"config": {"baseline": "stock"}, "targets": [target("stock", 1.0), target("kittens", 1.5)]}


def test_throughput_plot_has_a_row_per_workload():
    from mok_serve.loadtest import plots

    results = two_workload_results()
    fig = plots.throughput_figure(results)
    assert [ax.get_title() for ax in fig.axes] == [
        "input 512 / output 256\nOutput tokens/s vs max concurrency",
        "input 512 / output 256\nOutput tokens/s vs request rate",
        "", "input 4096 / output 64\nOutput tokens/s vs request rate"]
    blank = fig.axes[2]
    assert not blank.axison and [t.get_text() for t in blank.texts] == ["no fixed-concurrency runs in this workload"]
    c_panel, rate_panel, _, prefill_rate = fig.axes
    assert [list(line.get_ydata()) for line in c_panel.lines] == [pytest.approx([100, 500]), pytest.approx([150, 750])]
    assert [line.get_marker() for line in c_panel.lines] == ["o", "s"]  # the servers' markers and colours as before
    assert [line.get_color() for line in prefill_rate.lines] == ["tab:blue", "tab:orange"]
    assert [list(line.get_ydata()) for line in prefill_rate.lines] == [pytest.approx([50]), pytest.approx([75])]
    assert list(c_panel.get_xticks()) == [1, 8] and list(prefill_rate.get_xticks()) == [2]  # each row its own runs


def test_latency_plot_has_a_block_of_rows_per_workload():
    from mok_serve.loadtest import plots

    fig = plots.latency_figure(two_workload_results())
    titles = [ax.get_title() for ax in fig.axes]
    assert len(titles) == 16
    assert titles[:2] == ["input 512 / output 256\nTTFT vs max concurrency",
                          "input 512 / output 256\nTTFT vs request rate"]
    assert titles[8:10] == ["", "input 4096 / output 64\nTTFT vs request rate"]
    # The prefill workload has no concurrency panel: its rate panel carries the row's y label and ticks.
    assert fig.axes[9].get_ylabel() == "TTFT ms" and fig.axes[9].yaxis.get_tick_params()["labelleft"]
    assert fig.axes[0].get_ylabel() == "TTFT ms" and fig.axes[1].get_ylabel() == ""


def test_plots_of_one_workload_have_no_workload_titles():
    from mok_serve.loadtest import plots

    results = two_workload_results()
    for t in results["targets"]:
        t["runs"] = t["runs"][:3]
    assert [ax.get_title() for ax in plots.throughput_figure(results).axes] == [
        "Output tokens/s vs max concurrency", "Output tokens/s vs request rate"]
    assert len(plots.latency_figure(results).axes) == 8


def test_two_workloads_against_one_server_end_to_end(fake_server, tmp_path):
    import json

    _, url = fake_server("--layers", "--token-gap", "0.001")
    out = tmp_path / "results"
    code = cli.main(["serve", "--url", f"fake={url}", "--workload", "24:6:c=1,4:rate=50", "--workload", "48:3:c=2",
                     "--num-requests", "4", "--requests-per-stream", "2", "--prompt-format", "ids", "--out", str(out),
                     "--no-progress"])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    (target,) = results["targets"]
    runs = {r["spec"]["name"]: r for r in target["runs"]}
    assert list(runs) == ["24/6 c=1", "24/6 c=4", "24/6 rate=50", "48/3 c=2"]
    assert [len(r["records"]) for r in runs.values()] == [4, 8, 4, 4]  # c=4: 2 x 4 = 8
    for run in runs.values():
        spec = run["spec"]
        lengths = {(r["prompt_len"], r["output_tokens"]) for r in run["records"]}
        assert lengths == {(spec["input_len"], spec["output_len"])}
        assert run["moe"]["steps"] == spec["num_requests"] * spec["output_len"]  # a fake step per token
    assert results["config"]["workloads"] == [
        {"input_len": 24, "output_len": 6, "concurrency": [1, 4], "request_rate": [50.0]},
        {"input_len": 48, "output_len": 3, "concurrency": [2], "request_rate": []}]
    report = (out / "report.md").read_text()
    assert "random 24 in / 6 out tokens" in report and "random 48 in / 3 out tokens" in report
    assert "## Run `24/6 rate=50`" in report and "## Run `48/3 c=2`" in report and "| MoE share |" in report
    assert {p.name for p in out.glob("*.png")} == {"throughput.png", "latency.png", "layers.png", "moe_share.png"}


def test_layers_plot_wraps_many_runs_into_rows():
    from mok_serve.loadtest import plots, server_layers
    from mok_serve.loadtest.fake_server import fake_layers_document

    parsed = {"available": True, "parsed": server_layers.parse_layers(fake_layers_document(100, 1.0, num_layers=12))}
    runs = [{"spec": {"name": f"512/256 c={2 ** i}", "rate": None, "concurrency": 2 ** i}, "layers": parsed}
            for i in range(5)]
    fig = plots.layers_figure({"targets": [{"name": "stock", "runs": runs}, {"name": "kittens", "runs": runs}]})
    width, height = fig.get_size_inches()
    assert width <= plots.LAYERS_FIGURE_WIDTH and height > 15  # 2 panels a row, 3 rows
    drawn = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == [f"run 512/256 c={2 ** i}" for i in range(5)]
    assert len(fig.axes) == 6 and not fig.axes[5].axison
    fig.canvas.draw()
    legend = fig.legends[0].get_window_extent()
    assert all(legend.y0 > ax.get_window_extent().y1 for ax in drawn)


def test_moe_share_plot_points_and_absence():
    from mok_serve.loadtest import plots

    def run(c, share):
        return {"spec": {"name": f"c={c}", "concurrency": c, "rate": None, "input_len": 8, "output_len": 4},
                "summary": {"completed": 1}, "moe": None if share is None else {"moe_share": share}}

    target = {"name": "kittens", "runs": [run(8, 0.61), run(1, 0.32), run(32, None)]}
    assert plots.moe_share_points(target, "concurrency") == [(1, 32.0, False), (8, 61.0, False)]
    assert plots.moe_share_points(target, "rate") == []
    assert plots.moe_share_figure({"targets": [{"name": "stock", "runs": [run(1, None)]}]}) is None
    fig = plots.moe_share_figure({"targets": [target]})
    assert fig.axes[0].get_ylabel() == "MoE share of the step time (%)"
