"""mok-loadtest merge: separate serve runs (one per server) combined into one report."""

import json

from mok_serve.loadtest import cli

WORKLOAD = ["--workload", "24:8:c=1,4", "--num-requests", "4", "--prompt-format", "ids", "--no-progress"]


def serve(url: str, name: str, out, *extra: str) -> dict:
    assert cli.main(["serve", "--url", f"{name}={url}", *WORKLOAD, "--no-plots", "--out", str(out), *extra]) == 0
    return json.loads((out / "results.json").read_text())


def test_two_runs_merge_into_one_comparison(fake_server, tmp_path):
    _, slow = fake_server("--layers", "--token-gap", "0.010")
    _, fast = fake_server("--layers", "--token-gap", "0.002")
    stock = serve(slow, "stock", tmp_path / "stock")
    kittens = serve(fast, "kittens", tmp_path / "kittens")
    out = tmp_path / "merged"
    assert cli.main(["merge", str(tmp_path / "kittens"), str(tmp_path / "stock"), "--out", str(out)]) == 0
    merged = json.loads((out / "results.json").read_text())
    assert [t["name"] for t in merged["targets"]] == ["kittens", "stock"]
    assert merged["config"]["baseline"] == "stock"  # stock divides whatever the folder order
    # Every request of both runs is kept, and each target its own environment and source folder.
    for t, src in zip(merged["targets"], (kittens, stock), strict=True):
        assert [r["records"] for r in t["runs"]] == [r["records"] for r in src["targets"][0]["runs"]]
        assert t["environment"] == src["environment"] and t["source"].endswith(t["name"])
    ratios = {r["run"]: r for r in merged["ratios"]}
    assert set(ratios) == {"c=1", "c=4"}
    for name, r in ratios.items():
        by = {t["name"]: next(x for x in t["runs"] if x["spec"]["name"] == name)["summary"] for t in merged["targets"]}
        assert r["output tok/s"] == by["kittens"]["output_throughput"] / by["stock"]["output_throughput"]
        assert r["output tok/s"] > 1.5  # tokens 5x closer together: a ratio the wrong way round would show
    report = (out / "report.md").read_text()
    assert "| metric | stock | kittens | kittens/stock |" in report
    assert "## Run `c=4`" in report and "Versions: commit " in report
    assert {p.name for p in out.glob("*.png")} == {"throughput.png", "latency.png", "layers.png", "moe_share.png"}


def test_runs_that_differ_are_refused_naming_the_difference(fake_server, tmp_path, capsys):
    _, url = fake_server("--token-gap", "0.001")
    serve(url, "stock", tmp_path / "a")
    serve(url, "kittens", tmp_path / "b", "--seed", "5")
    serve(url, "stock", tmp_path / "c")
    capsys.readouterr()
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")]) == cli.EXIT_USAGE
    assert "seed: 0 vs 5" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "c"), "--out", str(tmp_path / "m")]) == cli.EXIT_USAGE
    assert "server names must differ" in capsys.readouterr().err
    assert cli.main(["merge", str(tmp_path / "a"), str(tmp_path / "nothing"), "--out", str(tmp_path / "m")]) == cli.EXIT_USAGE
    assert "no results.json" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()
