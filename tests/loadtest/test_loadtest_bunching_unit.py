"""mok-loadtest without servers: the bunched-stream rule, how the report flags distorted figures
and withholds their ratios, the progress bar's ETA, and what the plots draw."""

import pytest

from mok_serve.loadtest import bunching, cli, plots, report, server_layers
from mok_serve.loadtest.metrics import RequestRecord, summarize

SPREAD_GAP = 0.005  # a server step
READ_GAP = 0.00002  # chunks parsed from one network read


def record(i, itl, output_tokens=16, ttft=0.02, success=True):
    return RequestRecord(index=i, prompt_len=16, expected_output_len=16, success=success, output_tokens=output_tokens,
                         ttft=ttft, itl=list(itl), latency=ttft + sum(itl), start_time=100.0 + i)


def test_a_request_is_bunched_at_two_or_more_tokens_per_arrival():
    def bunched(itl, tokens=16, **kw):
        return bunching.is_bunched(kw.get("success", True), tokens, itl)

    assert bunching.arrivals([SPREAD_GAP] * 15) == 16 and not bunched([SPREAD_GAP] * 15)
    assert bunching.arrivals([]) == 1 and bunched([])  # 16 tokens in one chunk (merged by the server)
    assert bunching.arrivals([READ_GAP] * 15) == 1 and bunched([READ_GAP] * 15)  # 16 chunks in one read
    assert bunched([SPREAD_GAP] * 3)  # 16 tokens in 4 chunks
    # The gap threshold: 0.5 ms apart is a new arrival, anything closer the same one.
    assert bunching.arrivals([0.00049, 0.0005, 0.0006]) == 3
    # 8 arrivals of 16 tokens is bunched, 9 is not: a final burst of 9 tokens after 7 spread ones
    # (more than half of them at the end) is, 8 after 8 is not.
    assert bunched([SPREAD_GAP] * 7 + [READ_GAP] * 8)
    assert not bunched([SPREAD_GAP] * 8 + [READ_GAP] * 7)
    assert bunched([READ_GAP, SPREAD_GAP] * 7 + [READ_GAP])  # pairs all along: ITL p50 ~0
    # One-token requests have nothing to bunch; failed requests are not judged.
    assert not bunched([], tokens=1) and not bunched([], tokens=16, success=False)
    assert bunched([], tokens=2)


def test_a_run_is_distorted_from_one_percent_of_bunched_requests():
    spread = [SPREAD_GAP] * 15
    one_of_48 = summarize([record(0, [])] + [record(i, spread) for i in range(1, 48)], 10.0)["bunching"]
    assert one_of_48 == {"bunched": 1, "checked": 48, "share": 1 / 48, "distorted": True}
    one_of_150 = summarize([record(0, [])] + [record(i, spread) for i in range(1, 150)], 10.0)["bunching"]
    assert one_of_150["bunched"] == 1 and not one_of_150["distorted"]  # 0.67%
    failed = record(1, [], success=False)
    failed.error = "boom"
    clean = summarize([record(0, spread), failed, record(2, [], output_tokens=1)], 1.0)["bunching"]
    assert clean == {"bunched": 0, "checked": 1, "share": 0.0, "distorted": False}
    d = record(3, []).to_dict()
    assert d["bunched"] is True and d["arrivals"] == 1


def run(name, records, rate=None, concurrency=1):
    return {"spec": {"name": name, "rate": rate, "concurrency": concurrency}, "notes": [],
            "records": [r.to_dict() for r in records], "summary": summarize(records, 5.0)}


def two_servers(kittens_bunched=2, n=48):
    spread = [SPREAD_GAP] * 15
    stock = [record(i, spread) for i in range(n)]
    # A bunched request: TTFT = the whole request, all 16 tokens in one read at its end.
    kittens = [record(i, [READ_GAP] * 15, ttft=0.1) for i in range(kittens_bunched)]
    kittens += [record(i, spread) for i in range(kittens_bunched, n)]
    targets = [{"name": name, "events": [], "runs": [run("c=1", recs), run("rate=8", stock, rate=8.0, concurrency=None)]}
               for name, recs in (("stock", stock), ("kittens", kittens))]
    results = {"config": {"baseline": "stock", "workload_description": "w"}, "targets": targets}
    results["ratios"] = report.compute_ratios(results)
    return results


def cells(table, run_name):
    row = next(line for line in table.splitlines() if line.startswith(f"| {run_name} |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_headline_withholds_ratios_of_distorted_figures():
    results = two_servers()
    table = report.headline_table(results)
    header = cells(table, "run")
    c1, rate = cells(table, "c=1"), cells(table, "rate=8")
    col = {h: i for i, h in enumerate(header) if h != "kittens/stock"}
    ratio_after = {h: i + 1 for h, i in col.items()}
    assert c1[ratio_after["kittens output tok/s"]].endswith("x")  # throughput is not distorted
    for metric in ("mean TTFT ms", "mean TPOT ms"):
        assert c1[ratio_after[f"kittens {metric}"]] == "withheld ⚠"
        assert c1[col[f"kittens {metric}"]].endswith(" ⚠") and "⚠" not in c1[col[f"stock {metric}"]]
        assert rate[ratio_after[f"kittens {metric}"]] == "1.00x"  # the clean run keeps its ratio
    assert c1[col["bunched"]] == "kittens 2 of 48 ⚠" and rate[col["bunched"]] == "0"
    ratios = {r["run"]: r for r in results["ratios"]}
    assert ratios["c=1"]["TTFT mean ms"] is None and ratios["c=1"]["ITL p99 ms"] is None
    assert "TPOT p50 ms" in ratios["c=1"]["withheld"] and "E2EL mean ms" not in ratios["c=1"]["withheld"]
    assert ratios["c=1"]["withheld_because"] == "kittens: 2 of 48 requests bunched"
    assert ratios["c=1"]["output tok/s"] == pytest.approx(1.0, rel=0.05)
    assert ratios["rate=8"]["withheld"] == [] and ratios["rate=8"]["TTFT mean ms"] == pytest.approx(1.0)


def test_report_and_summary_count_bunched_requests(tmp_path):
    results = two_servers()
    detail = report.detail_table(results, "c=1")
    assert "| bunched requests | 0 of 48 | 2 of 48 |  |" in detail
    assert cells(detail, "TTFT p50 ms")[2:] == [cells(detail, "TTFT p50 ms")[2].split()[0] + " ⚠", "withheld ⚠"]
    assert cells(detail, "E2EL mean ms")[3].endswith("x") and cells(detail, "output tok/s")[3].endswith("x")
    md = report.write_markdown(results, tmp_path, []).read_text()
    assert "- kittens `c=1`: **2 of 48 requests bunched** (tokens in bursts): TTFT, TPOT, ITL distorted ⚠" in md
    assert "⚠ distorted by bunched streams" in md
    rule = md.split("## Bunched streams")[1]
    assert "2 or more tokens per arrival" in rule and "less than 0.5 ms apart" in rule and "at least 1%" in rule
    assert "| c=1 | 0 of 48 | 2 of 48 ⚠ |" in rule and "| rate=8 | 0 of 48 | 0 of 48 |" in rule
    text = report.console_summary(results, tmp_path, 0)
    assert "! kittens c=1: 2 of 48 requests bunched (tokens in bursts): TTFT, TPOT, ITL distorted" in text
    assert "stock c=1" not in text and "rate=8: " not in text


def test_a_clean_comparison_has_no_warning(tmp_path):
    results = two_servers(kittens_bunched=0)
    assert "⚠" not in report.headline_table(results) and "⚠" not in report.console_summary(results, tmp_path, 0)
    assert "What happened\n\nEvery request succeeded" in report.write_markdown(results, tmp_path, []).read_text()


def test_serve_help_states_the_bunching_rule(capsys):
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("(2 or more tokens per arrival on average; chunks less than 0.5 ms apart are one arrival) is counted as "
            "bunched") in text
    assert "In a run where bunched requests are 1% or more, those figures (and peak tok/s) are marked ⚠" in text


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_eta_leaves_out_server_starts_and_counts_them_once():
    """Two servers of 4 runs of 48 requests; a server start takes 280 s, a request 0.2 s."""
    clock = Clock()
    p = cli._Progress(2 * 4 * 48, enabled=True, servers=2, clock=clock)
    assert p.bar.total == 384 and p.bar.unit == "req"

    def server(name):
        p.starting(name)
        clock.t += 280
        p.started()
        for r in ("c=1", "c=4", "c=16", "rate=8"):
            clock.t += 5  # warm-up and the per-layer reads: not timed
            p(r, None)
            for _ in range(48):
                clock.t += 0.2
                p(r, record(0, [SPREAD_GAP] * 15))
                if name == "kittens":
                    return

    server("stock")
    assert p.eta_s() == pytest.approx(192 * 0.2 + 280)  # the other server's requests and its start
    server("kittens")
    assert p.eta_s() == pytest.approx(191 * 0.2)  # tqdm's own ETA said hours here
    assert p.bar.postfix == "ETA 00:38"  # what the bar shows
    p.drop(48)  # a skipped run leaves the total
    assert p.bar.total == p.total == 336 and p.eta_s() == pytest.approx(143 * 0.2)
    p.close()


def fake_layers(mean_us):
    doc = {"layers": [{"layer": f"model.layers.{i}.mlp.experts", "rank": 0, "calls": 10,
                       "latency_us": {"mean": mean_us + 10 * i, "p50": mean_us}} for i in range(2)]}
    return {"available": True, "parsed": server_layers.parse_layers(doc)}


def test_latency_plot_has_tpot_and_the_poisson_run():
    results = two_servers()
    fig = plots.latency_figure(results)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == [f"{m} vs {x}" for m in ("TTFT", "TPOT", "ITL", "E2E latency")
                      for x in ("max concurrency", "request rate")]
    tpot_rate = fig.axes[3]
    assert fig.axes[2].get_ylabel() == "TPOT ms" and tpot_rate.get_xlabel() == "request rate (Poisson, req/s)"
    lines = [line for line in tpot_rate.lines if line.get_linestyle() == "-"]  # p50 of each server
    stock_p50 = results["targets"][0]["runs"][1]["summary"]["tpot"]["p50_ms"]
    assert [list(line.get_ydata()) for line in lines] == [[stock_p50], [stock_p50]]
    assert {line.get_marker() for line in lines} == {"o", "s"}
    # The distorted kittens c=1 run is ringed in red in the TTFT/TPOT/ITL panels, not for E2E.
    rings = [[line for line in ax.lines if line.get_markeredgecolor() == "red"] for ax in fig.axes]
    assert [len(r) for r in rings] == [3, 0, 3, 0, 3, 0, 0, 0]
    assert "run distorted by bunched streams (⚠ in report.md)" in [t.get_text() for t in fig.legends[0].get_texts()]
    for t in results["targets"]:  # the narrow figure of one kind of run wraps its legend
        t["runs"] = t["runs"][:1]
    for figure in (fig, plots.latency_figure(results)):
        figure.canvas.draw()
        box = figure.legends[0].get_window_extent()
        assert figure.bbox.x0 <= box.x0 and box.x1 <= figure.bbox.x1 and box.y1 <= figure.bbox.y1
        assert all(box.y0 > ax.get_window_extent().y1 for ax in figure.axes)  # above the panels, off the data


def test_one_rate_point_per_server_does_not_hide_the_other():
    fig = plots.throughput_figure(two_servers())
    rate_panel = fig.axes[1]
    assert rate_panel.get_xlabel() == "request rate (Poisson, req/s)" and rate_panel.get_legend() is None
    (stock,), (kittens,) = [line.get_xydata() for line in rate_panel.lines]
    fig.canvas.draw()
    a, b = rate_panel.transData.transform([stock, kittens])
    marker_px = rate_panel.lines[0].get_markersize() * fig.dpi / 72
    assert abs(a[0] - b[0]) > marker_px  # side by side (same throughput, same rate)
    assert rate_panel.lines[0].get_marker() != rate_panel.lines[1].get_marker()


@pytest.mark.parametrize("field,label", [
    ("latency_us.mean", "mean time per MoE layer call (µs)"),
    ("latency_ms.p99", "p99 time per MoE layer call (ms)"),
    ("mean_us", "mean time per MoE layer call (µs)"),
    ("phases_ms.experts.median", "median time per MoE layer call (ms)"),
    ("elapsed", "time per MoE layer call (elapsed)"),
])
def test_layer_time_label(field, label):
    assert plots.layer_time_label(field) == label


def test_layers_plot_label_and_legend_off_the_bars():
    results = two_servers()
    for t, mean in zip(results["targets"], (100.0, 140.0)):
        for r in t["runs"]:
            r["layers"] = fake_layers(mean)
    fig = plots.layers_figure(results)
    assert [ax.get_ylabel() for ax in fig.axes] == ["mean time per MoE layer call (µs)"] * 2
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["stock", "kittens"]
    fig.canvas.draw()
    box = legend.get_window_extent()
    bars = [p.get_window_extent() for ax in fig.axes for p in ax.patches]
    assert len(bars) == 8 and not any(box.overlaps(b) for b in bars)


def test_a_collapsed_routing_is_named_in_the_report():
    # The DeepSeek-V3 shape with dummy weights sent every token to the same 8 of 256 experts
    # (imbalance 32): the report says so, since its MoE times measure that load.
    from mok_serve.loadtest import server_layers
    from mok_serve.loadtest.fake_server import fake_layers_document

    even = fake_layers_document(tokens=40, seconds=1.0)
    collapsed = fake_layers_document(tokens=40, seconds=1.0)
    for layer in collapsed["layers"][:1]:
        layer["ranks"][0].update(expert_tokens=[40, 0, 0, 0], imbalance=4.0)
    run = lambda doc: {"layers": {"available": True, "raw": doc, "parsed": server_layers.parse_layers(doc)}}  # noqa: E731
    assert report.collapsed_routing_line(run(even)) is None
    line = report.collapsed_routing_line(run(collapsed))
    assert line.startswith("**routing collapsed** in 1 of 2 MoE layers: every token went to the same 1 of 4 experts")
    few = fake_layers_document(tokens=3, seconds=1.0)  # fewer tokens than experts: nothing to tell
    few["layers"][0]["ranks"][0].update(expert_tokens=[3, 0, 0, 0], imbalance=4.0)
    assert report.collapsed_routing_line(run(few)) is None
    assert report.collapsed_routing_line({}) is None
