"""The kernel benchmarks (loadtest/bench) without a GPU: the layer benchmark's floors, points, sweep
variants, reports and decode timeline summary; the EP benchmark's reports and its scaling table;
l2_rates refusing to run without a GPU."""

import pytest


def test_layer_floor_counts_fp8_weight_bytes_and_rate():
    import torch

    from mok_serve.loadtest.bench.harness import PEAK_BYTES, floor_of

    ids = torch.tensor([[0, 1], [1, 2]])  # 3 experts touched
    bf16 = floor_of(2, 7168, 2048, 2, ids)
    fp8 = floor_of(2, 7168, 2048, 2, ids, weight_bytes_per_elem=1.0 + 4.0 / 128**2, peak_flops=1.6e15)
    weights = 3 * 3 * 7168 * 2048
    assert bf16["touched"] == fp8["touched"] == 3
    assert bf16["bytes"] - fp8["bytes"] == weights * (1.0 - 4.0 / 128**2)
    assert fp8["bound"] == "weights" and fp8["floor_ms"] == fp8["bytes"] / PEAK_BYTES * 1e3
    many = torch.arange(8192 * 8).remainder(256).view(8192, 8)
    assert floor_of(8192, 7168, 2048, 8, many, 1.0, peak_flops=1.6e15)["floor_ms"] == 6.0 * 8192 * 8 * 7168 * 2048 / 1.6e15 * 1e3


def test_layer_points_take_an_optional_routing():
    from mok_serve.loadtest.bench.layer import parse_points

    assert parse_points(["DeepSeek-V3:8192", "Qwen3-30B-A3B:2048:skewed", "odd:name:32:uniform", "odd:name:1"]) == [
        ("DeepSeek-V3", 8192, "uniform"), ("Qwen3-30B-A3B", 2048, "skewed"),
        ("odd:name", 32, "uniform"), ("odd:name", 1, "uniform"),
    ]
    with pytest.raises(ValueError):
        parse_points(["DeepSeek-V3:8192:hot"])


def test_sweep_keeps_every_given_point_whatever_shapes_are_selected():
    # --shapes may select fewer shapes than the sweep's default points; a point named on the command line
    # (a Qwen3 one, once) must not be dropped silently.
    from mok_serve.loadtest.bench.layer import SWEEP_POINTS, sweep_points

    selected = {"DeepSeek-V3": {}, "Kimi-K2": {}}  # --shapes DeepSeek-V3,Kimi-K2
    given = [("Qwen3-30B-A3B", 1, "uniform"), ("DeepSeek-V3", 8, "skewed")]
    assert sweep_points(given, selected) == given
    assert sweep_points(None, selected) == [pt for pt in SWEEP_POINTS if pt[0] != "Qwen3-30B-A3B"]


def test_sweeps_offer_wider_token_tiles_for_concentrated_loads():
    from mok_serve.kernels.cuda.configs import pick_configs
    from mok_serve.loadtest.bench.layer import sweep_variants

    decode = {label: (g1, g2) for label, g1, g2 in sweep_variants(256, 8, 256, 7168, 2048)}  # 8 rows per expert
    assert [decode[m][0]["BLOCK_M"] for m in ("default", "m32", "m64")] == [16, 32, 64]
    assert all(decode[m][0]["BLOCK_M"] == decode[m][1]["BLOCK_M"] for m in ("m32", "m64"))
    # Heavy tiles (experts with more than 16 rows) are 64 rows by default; the sweep times 32 and none.
    assert [decode[m][0].get("HEAVY_M", 0) for m in ("default", "heavy32", "no heavy")] == [64, 32, 0]
    assert "HEAVY_STAGES" not in decode["no heavy"][1]
    streaming = {label: (g1, g2) for label, g1, g2 in sweep_variants(1024, 8, 256, 7168, 2048)}  # 32 rows
    assert streaming["default"][0]["BLOCK_M"] == 64
    assert streaming["m128 tiles"] == pick_configs(4096, 8, 256, 7168, 2048)  # the 128-row regime's 4-stage tiles
    # By default only hot experts get 128-row tiles (more than 64 rows, 3 stages); the sweep times
    # 2 stages and none, and the one-launch and swapped variants at one height.
    for label, st in (("default", 3), ("heavy128 s2", 2)):
        assert all(g["HEAVY_M"] == 128 and g["HEAVY_STAGES"] == st and g["BLOCK_M"] == 64 for g in streaming[label])
    for label in ("no heavy", "swapped", "one launch", "one launch m16 swap"):
        assert not any(k in g for g in streaming[label] for k in ("HEAVY_M", "HEAVY_STAGES")), label


def test_fp8_sweep_offers_both_gemm1_column_tiles_at_decode_only():
    from mok_serve.loadtest.bench.layer import sweep_variants_fp8

    decode = {label: g1 for label, g1, _ in sweep_variants_fp8(1, 8, 128, 2048, 768)}  # 16-row tiles
    assert [decode[m]["BLOCK_N"] for m in ("default", "g1 n128", "g1 n64 s4", "g1 n64 s8", "g1 n32")] == [64, 128, 64, 64, 32]
    wider = {label: g1 for label, g1, _ in sweep_variants_fp8(512, 8, 256, 7168, 2048)}  # 16 rows per expert
    assert wider["default"]["BLOCK_N"] == 64 and wider["g1 n128"]["BLOCK_N"] == 128
    # The 32-row swapped tiles (the default there before 9a331f9's sweep) at 128 columns.
    assert (wider["swap m32 s6/5"]["BLOCK_M"], wider["swap m32 s6/5"]["BLOCK_N"]) == (32, 128)
    streaming = [label for label, _, _ in sweep_variants_fp8(4096, 8, 128, 2048, 768)]
    assert not any(label.startswith("g1 n64") for label in streaming)
    # From 48 rows per expert, GEMM2 in 64-row tiles (vLLM's) beside the default 128-row ones.
    big = {label: g2 for label, _, g2 in sweep_variants_fp8(2048, 8, 256, 7168, 2048)}
    assert big["default"]["BLOCK_M"] == 128 and big["g2 m64 s4"] == {**big["default"], "BLOCK_M": 64, "num_warps": 4}
    assert "g2 m64 s3" not in dict.fromkeys(label for label, _, _ in sweep_variants_fp8(1024, 8, 256, 7168, 2048))


def test_fp8_sweep_offers_hot_expert_variants():
    from mok_serve.kernels.cuda.launch import check_heavy_m
    from mok_serve.loadtest.bench.layer import sweep_variants_fp8

    decode = {label: (g1, g2) for label, g1, g2 in sweep_variants_fp8(256, 8, 256, 7168, 2048)}  # 8 rows per expert
    heavy = [label for label in decode if label.startswith("heavy64")]
    assert heavy == ["heavy64 s2", "heavy64 group4"]
    for label in ("default", *heavy):  # the default has hot experts' 64-row tiles, 4 stages
        for g in decode[label]:
            assert g["HEAVY_M"] == 64 and g["BLOCK_M"] == 16 and g["HEAVY_STAGES"] == (2 if label == "heavy64 s2" else 4)
            check_heavy_m(g)
    assert decode["heavy64 group4"][1]["GROUP_M"] == 4
    # Without them, and the one-launch kernel (tiles of one height) never with them.
    for label in ("no heavy", "one launch", "one launch n32"):
        assert not any(k in g for g in decode[label] for k in ("HEAVY_M", "HEAVY_STAGES")), label
    assert not any(label.startswith("heavy64") for label, _, _ in sweep_variants_fp8(1024, 8, 256, 7168, 2048))
    streaming = {label: (g1, g2) for label, g1, g2 in sweep_variants_fp8(1024, 8, 256, 7168, 2048)}  # 32 rows
    assert [streaming[f"group{g}"][i]["GROUP_M"] for g in (4, 8) for i in (0, 1)] == [4, 4, 8, 8]


def test_host_profile_rows_rank_functions_per_profiled_call():
    import cProfile
    import pstats
    import time

    from mok_serve.loadtest.bench.layer import host_profile_rows

    def slow():
        time.sleep(0.002)

    def op():
        slow()
        sum(range(10))

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        op()
    prof.disable()
    table = host_profile_rows(pstats.Stats(prof).stats, calls=5, top=3)
    assert len(table["own"]) == len(table["cumulative"]) == 3
    assert "sleep" in table["own"][0]["function"] and table["own"][0]["calls_per_call"] == 1.0
    assert table["own"][0]["own_us"] >= 2000
    by_name = {r["function"].split("(")[-1]: r for r in table["cumulative"]}
    assert by_name["op)"]["cum_us"] >= by_name["slow)"]["cum_us"] >= 2000
    assert [r["own_us"] for r in table["own"]] == sorted((r["own_us"] for r in table["own"]), reverse=True)


def test_decode_sweep_times_the_one_launch_default_against_two_launches():
    from mok_serve.kernels.cuda.moe import one_launch_decode
    from mok_serve.loadtest.bench.layer import sweep_variants

    for tokens in (1, 8, 128):  # DeepSeek-V3's decode regime
        variants = {label: (g1, g2) for label, g1, g2 in sweep_variants(tokens, 8, 256, 7168, 2048)}
        assert not one_launch_decode(*variants.pop("two launches"))
        assert all(one_launch_decode(*configs) for configs in variants.values()), tokens
    assert not any(one_launch_decode(g1, g2) for _, g1, g2 in sweep_variants(2048, 8, 256, 7168, 2048))


@pytest.mark.parametrize("argv,message", [
    (["--profile", "Foo:8"], "unknown shape(s) Foo"),
    (["--sweep", "--sweep-points", "DeepSeek-V3:8:hot"], "point 'DeepSeek-V3:8:hot': expected SHAPE:TOKENS"),
])
def test_layer_bench_rejects_bad_points_before_gpu_work(capsys, argv, message):
    from mok_serve.loadtest.bench.layer import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_layer_markdown_shows_the_clock_of_each_row(tmp_path):
    from mok_serve.loadtest.gpu_clocks import clock_text
    from mok_serve.loadtest.bench.report import write_markdown

    base = dict(shape="DeepSeek-V3", tokens=8192, routing="uniform", kittens_ms=12.6, floor_ms=7.31, bound="compute",
                ratio_to_floor=1.72, torch_ms=18.2, transformers_ms=20.2, speedup_vs_torch=1.44,
                speedup_vs_transformers=1.6, speedup_vs_best_baseline=1.44, target="<= 1.3x floor", target_met=False,
                flops=5.77e12, bytes=2.3e10)
    rows = [{**base, "clock": {"kittens": dict(sm_mhz=1410.0, power_w=690.0, power_capped=0.92, samples=40)}},
            {**base, "tokens": 2048, "clock": {"kittens": None}}]
    meta = dict(gpu="NVIDIA H200", commit="abc1234", date="d", torch="t", triton="3.6.0", transformers="5",
                timing="graphs", read_tb_s=4.28)
    write_markdown(meta, rows, tmp_path / "t.md")
    table = [line for line in (tmp_path / "t.md").read_text().splitlines() if line.startswith("| DeepSeek-V3")]
    assert "| 1.72 | 1410 MHz (cap 92%) | 18.200 |" in table[0]
    assert "| 1.72 | - | 18.200 |" in table[1]
    assert clock_text(None) == "-"


def test_layer_markdown_says_by_how_much_each_missed_target_is_missed(tmp_path):
    import json

    from mok_serve.loadtest.bench.layer import main
    from mok_serve.loadtest.bench.report import judge

    def row(tokens, kittens_ms, floor_ms, bound, best_ms, flops, nbytes, mhz=1980.0):
        r = dict(shape="S", tokens=tokens, routing="uniform", kittens_ms=kittens_ms, floor_ms=floor_ms, bound=bound,
                 ratio_to_floor=kittens_ms / floor_ms, torch_ms=best_ms, transformers_ms=best_ms * 1.1,
                 speedup_vs_torch=best_ms / kittens_ms, speedup_vs_transformers=best_ms * 1.1 / kittens_ms,
                 speedup_vs_best_baseline=best_ms / kittens_ms, rel_err=dict(kittens=1e-5), flops=flops, bytes=nbytes,
                 clock=dict(kittens=dict(sm_mhz=mhz, power_w=600.0, power_capped=1.0, samples=20)))
        return {**r, **judge(r)}

    rows = [
        row(128, 1.0, 1.0, "weights", 1.5, 1e12, 4.4e9),  # 1.0x the floor: met
        row(32, 1.0, 0.9, "weights", 0.95, 1e11, 4.4e9),  # no time target, but a baseline is faster
        row(1, 0.1, 0.08, "weights", 0.19, 1e9, 3.6e8),  # needs floor + 10 us = 0.09 ms: 4.0 TB/s
        row(8192, 10.0, 7.0, "compute", 15.0, 5.53e12, 2e10, mhz=1500.0),  # needs 1.3x the floor, 9.1 ms
    ]
    assert [r["target_met"] for r in rows] == [True, False, False, False]
    assert [r["target"] for r in rows] == ["<= 1.1x floor (weights)", "no baseline faster [slower than a baseline]",
                                           "<= floor + 10 us", "<= 1.3x floor"]
    meta = dict(gpu="NVIDIA H200", commit="abc1234", date="d", torch="t", triton="3", transformers="5",
                timing="graphs", read_tb_s=4.2, sms=132)
    (tmp_path / "t.json").write_text(json.dumps(dict(meta=meta, rows=rows)))
    assert main(["--replot", str(tmp_path / "t.json")]) == 0  # the report, rewritten from the JSON
    assert (tmp_path / "t.png").stat().st_size > 10_000
    text = (tmp_path / "t.md").read_text()
    misses = [line for line in text.split("## Targets not met")[1].splitlines() if line.startswith("| S |")]
    assert len(misses) == 3 and not any(line.startswith("| S | 128 |") for line in misses)
    # No time target at 32 tokens: it needs the baseline's 0.95 ms, 4.63 TB/s, more than the run's
    # fastest read (the met row's 4.4 TB/s).
    assert "| 0.950 | 1.000 | 5.3% | 4.63 | 4.40 |" in misses[0] and "faster than any row" in misses[0]
    # 4.0 TB/s is 91% of the run's fastest read.
    assert "| 0.090 | 0.100 | 11.1% | 4.00 | 3.60 |" in misses[1] and "weight streaming: 91%" in misses[1]
    # 4096 FLOP per SM per clock x 132 SMs x 1.5 GHz = 811 TFLOP/s; 608 of them is 75%.
    assert "| 9.100 | 10.000 | 9.9% |" in misses[2] and "| 608 | 553 | 811 | compute: 75%" in misses[2]
    # A run whose L2 flush writes says what the flush's write-back costs; a read-flushed run does not.
    assert "dirty lines" in text
    (tmp_path / "r.json").write_text(json.dumps(dict(meta={**meta, "l2_flush": "read"}, rows=rows)))
    assert main(["--replot", str(tmp_path / "r.json")]) == 0
    assert "dirty lines" not in (tmp_path / "r.md").read_text()
    # With the L2 read rate measured and each row's operand bytes, a column says what L2 rate the
    # target needs; a row that needs more than the measured rate reads so (before compute).
    l2_rows = [{**rows[1], "operand_bytes": 1e10}, {**rows[2], "operand_bytes": 1e9},
               {**rows[3], "operand_bytes": 1e11}, {**rows[3], "tokens": 4096}]
    (tmp_path / "l2.json").write_text(json.dumps(dict(meta={**meta, "l2_tb_s": 8.0}, rows=[rows[0]] + l2_rows)))
    assert main(["--replot", str(tmp_path / "l2.json")]) == 0
    l2_text = (tmp_path / "l2.md").read_text()
    assert "measured in this run: 8.00 TB/s" in l2_text
    got = [line for line in l2_text.split("## Targets not met")[1].splitlines() if line.startswith("| S |")]
    assert "| 4.63 | 4.40 | 10.53 | 105 |" in got[0] and "faster than any row" in got[0]
    assert "| 4.00 | 3.60 | 11.11 | 11 |" in got[1] and "L2 operand traffic: 139% of the measured L2 read rate" in got[1]
    assert "| 10.99 | 608 |" in got[2] and "L2 operand traffic: 137%" in got[2]
    # 4096 tokens: 1.2x the floor, 8.4 ms; no operand bytes: no L2 reading
    assert "| - | 658 |" in got[3] and "compute: 81%" in got[3]


def _ep_run(world, rows, commit="abc1234"):
    meta = dict(world=world, gpu="NVIDIA H200", commit=commit, torch="x", time="t", fp8=False)
    out = []
    for shape, tokens, routing, kittens, best in rows:
        ms = dict(kittens_pull=kittens, kittens_push=kittens * 1.2, kittens_gemm1pull=kittens, a2a=best * 1.1, agrs=best)
        out.append(dict(shape=shape, world=world, tokens=tokens, routing=routing, ms=ms, kittens_ms=kittens,
                        best_baseline_ms=best, speedup_vs_best_baseline=best / kittens, floor_ms=kittens / 2,
                        ratio_to_floor=2.0, bound="hbm", nvlink_GBps=1.0, wait_us=dict(pull=1.0, push=2.0),
                        rel_err_vs_a2a=dict(pull=0.0), target="t", target_met=False))
    return dict(meta=meta, rows=out)


def test_ep_scaling_matches_rows_across_world_sizes(tmp_path):
    import json

    from mok_serve.loadtest.bench import ep_scaling

    runs = {2: _ep_run(2, [("A", 1, "uniform", 0.5, 2.0), ("A", 128, "uniform", 1.0, 3.0)]),
            4: _ep_run(4, [("A", 1, "uniform", 0.25, 2.0), ("B", 32, "skewed", 1.0, 1.5)])}
    paths = []
    for w, data in runs.items():
        paths.append(tmp_path / f"w{w}.json")
        paths[-1].write_text(json.dumps(data))
    out = tmp_path / "scaling"
    assert ep_scaling.main([str(p) for p in reversed(paths)] + ["--out", str(out)]) == 0
    md = out.with_suffix(".md").read_text()
    assert "| A | 1 | uniform | 0.500 | 0.250 | 4.00x | 8.00x |" in md  # worlds in order whatever the argument order
    assert "| A | 128 | uniform | 1.000 | - | 3.00x | - |" in md  # a row missing at EP=4 shows as -
    assert "| B | 32 | skewed | - | 1.000 | - | 1.50x |" in md
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert ep_scaling.main([str(paths[0]), str(paths[0]), "--out", str(out)]) == 2  # one run per world size


def test_ep_bench_replot_writes_markdown_and_plot(tmp_path):
    import json

    from mok_serve.loadtest.bench import ep as ep_bench

    src = tmp_path / "ep.json"
    src.write_text(json.dumps(_ep_run(2, [("A", 1, "uniform", 0.5, 2.0), ("A", 128, "skewed", 1.0, 3.0)])))
    assert ep_bench.main(["--replot", str(src)]) == 0
    md = (tmp_path / "ep.md").read_text()
    assert "| A | 128 | skewed | 1.000 | 1.200 | 1.000 | 3.300 | 3.000 |" in md
    assert "workspace for" not in md
    assert (tmp_path / "ep.png").stat().st_size > 10_000


def test_ep_bench_says_by_how_much_each_missed_target_is_missed():
    from mok_serve.loadtest.bench import ep as ep_bench

    run = _ep_run(2, [("A", 32, "uniform", 1.0, 1.5), ("A", 512, "skewed", 1.0, 3.0), ("A", 128, "uniform", 0.6, 3.0)])
    rows = run["rows"]
    for r in rows:
        r["floor_ms"], r["ratio_to_floor"] = 0.5, r["kittens_ms"] / 0.5
        r["target"] = "<= 1.25x floor" if r["tokens"] >= 128 else ">= 2x best baseline"
        r["target_met"] = r["kittens_ms"] <= ep_bench.target_ms(r)
    assert [r["target_met"] for r in rows] == [False, False, True]
    rows[1]["wait_us"]["pull"] = 250.0
    misses = [line for line in ep_bench.markdown(rows, run["meta"]).split("## Targets not met")[1].splitlines()
              if line.startswith("| A |")]
    assert len(misses) == 2
    # 2x the best baseline asks for 0.75 ms, 1.5x the floor; 1.25x the floor is 0.625 ms.
    assert "| 0.750 | 1.000 | 33.3% | 0.500 (hbm) | 1.50 | 0% | kittens at 2.00x the floor (hbm) |" in misses[0]
    assert "| 0.625 | 1.000 | 60.0% | 0.500 (hbm) | 1.25 | 25% |" in misses[1]
    rows[0]["best_baseline_ms"] = 0.8  # now the target (0.4 ms) lies below the floor
    assert "below the floor (hbm)" in ep_bench.markdown(rows, run["meta"]).split("## Targets not met")[1]


def test_ep_bench_reports_the_slowest_ranks_clock():
    from mok_serve.loadtest.bench import ep as ep_bench

    def rank_row(mhz):
        times = {n: [1.0, 1.1, 0.9] for n in ("kittens_pull", "kittens_push", "a2a", "agrs")}
        terms = [dict(floor_ms=0.5, nvlink=1e6, rows=8, flops=1e9, hbm=1e9)]
        clock = None if mhz is None else dict(sm_mhz=mhz, power_w=600.0, power_capped=0.5, samples=9)
        return dict(shape="A", world=2, tokens=128, routing="uniform", experts=8, hidden=64, inter=32, top_k=2,
                    times=times, terms=terms, waits_ns={"pull": [1e3] * 3, "push": [2e3] * 3},
                    errs={"pull": 0.0, "push": 0.0, "variants_equal": True}, clock=clock)

    row = ep_bench.summarize([rank_row(1980.0), rank_row(1410.0)])
    assert row["clock"]["sm_mhz"] == 1410.0
    md = ep_bench.markdown([row, ep_bench.summarize([rank_row(None), rank_row(None)])], dict(world=2, gpu="g", commit="c"))
    lines = [line for line in md.splitlines() if line.startswith("| A |")]
    assert "| 2.00 | 1410 MHz (cap 50%) |" in lines[0] and "| 2.00 | - |" in lines[1]


def test_ep_bench_serving_limit_table():
    from mok_serve.loadtest.bench import ep as ep_bench

    run = _ep_run(2, [("A", 1, "uniform", 0.5, 2.0), ("A", 8192, "uniform", 4.0, 9.0)])
    run["meta"]["serving_limit"] = 8192
    run["rows"][0]["ms"].update(kittens_limit=2.0, kittens_limit_bounded=0.55)  # 8192 has no smaller-limit twin
    run["rows"][1]["ms"].update(kittens_nopdl=5.0)
    md = ep_bench.markdown(run["rows"], run["meta"])
    assert "| A | 8192 | uniform | 4.000 | 5.000 | 0.800 |" in md.split("## Programmatic dependent launch")[1]
    assert "## On a workspace for 8192 tokens per rank" in md
    assert "| A | 1 | uniform | 0.500 | 2.000 | 0.550 | 4.00 | 1.10 |" in md
    assert "| A | 8192 | uniform | 4.000 |" not in md.split("## On a workspace")[1]


def test_decode_timeline_summary_finds_the_steady_rate_the_tail_and_the_waits():
    import torch

    from mok_serve.kernels.cuda.moe import TIMELINE_WORDS
    from mok_serve.loadtest.bench.layer import timeline_summary

    us = 1000  # records are in ns
    t0 = 5_000_000
    rows = [  # drawn, ready, done, SM, columns (0: unused); two GEMM1 items, then GEMM2 items
        (0, 0, 10 * us, 3, 1), (0, 0, 10 * us, 4, 1),
        (0, 10 * us, 20 * us, 3, 1), (5 * us, 10 * us, 20 * us, 5, 1), (10 * us, 10 * us, 30 * us, 6, 1),
        (0, 0, 0, 0, 0),  # an item without rows: not counted
    ]
    records = torch.tensor([(a + t0, b + t0, c + t0, sm, used) if used else (0, 0, 0, 0, 0)
                            for a, b, c, sm, used in rows], dtype=torch.int64)
    assert records.shape[1] == TIMELINE_WORDS
    nbytes = torch.tensor([20e6, 20e6, 20e6, 20e6, 4e6, 1e9], dtype=torch.float64)
    got = timeline_summary(records, nbytes, gemm1_items=2)
    assert got["items"] == 5 and got["sms"] == 4 and got["span_us"] == 30.0 and got["last_draw_us"] == 10.0
    # 40 MB in each 10 us half of the first 20 us: 4 TB/s; the last item alone reads 0.2 TB/s.
    assert abs(got["steady_tb_s"] - 4.0) < 0.25
    assert got["ramp_us"] <= 0.5 and abs(got["tail_us"] - 10.0) <= 1.0
    assert abs(got["lost_us"] - (30.0 - 84e6 / (got["steady_tb_s"] * 1e12) * 1e6)) < 1e-9
    assert got["gemm2_wait_mean_us"] == 5.0 and got["gemm2_wait_max_us"] == 10.0  # waits 10, 5 and 0 us
    assert abs(got["gemm2_wait_share"] - 15.0 / (10 + 10 + 20 + 15 + 20)) < 1e-12
    # First wave: the three items drawn at 0 (60 MB, done by 20 us); the rest 24 MB in the last 10 us.
    assert got["first_wave_us"] == 20.0 and abs(got["first_wave_tb_s"] - 3.0) < 1e-9
    assert abs(got["rest_tb_s"] - 2.4) < 1e-9


def test_decode_item_bytes_come_from_each_records_columns():
    import torch

    from mok_serve.loadtest.bench.layer import decode_item_bytes

    # Two GEMM1 items (32 and 16 columns), then GEMM2 items of 64, 36 and 0 columns (no rows).
    records = torch.zeros(5, 5, dtype=torch.int64)
    records[:, 4] = torch.tensor([32, 16, 64, 36, 0])
    got = decode_item_bytes(records, gemm1_items=2, hidden=100, inter=80).tolist()
    assert got == [2 * 32 * 100 * 2, 2 * 16 * 100 * 2, 64 * 80 * 2, 36 * 80 * 2, 0]


def test_l2_rates_needs_a_gpu(capsys, monkeypatch):
    from mok_serve.loadtest.bench import l2_rates

    monkeypatch.setattr(l2_rates.torch.cuda, "is_available", lambda: False)
    assert l2_rates.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_concentrated_routing_sends_every_token_to_the_same_experts():
    import torch

    from mok_serve.loadtest.bench.harness import DEFAULT_ROUTINGS, ROUTINGS, floor_of, make_routing
    from mok_serve.loadtest.bench.layer import parse_points

    gen = torch.Generator().manual_seed(3)
    w, ids = make_routing(64, 256, 8, "concentrated", gen, device="cpu")
    assert ids.dtype == torch.int32 and ids.shape == (64, 8)
    assert all(set(row.tolist()) == set(ids[0].tolist()) for row in ids) and len(set(ids[0].tolist())) == 8
    assert len({tuple(row.tolist()) for row in ids}) > 1  # each token its own order
    assert torch.allclose(w.sum(-1), torch.ones(64))
    assert floor_of(64, 7168, 2048, 8, ids)["touched"] == 8
    assert parse_points(["DeepSeek-V3:460:concentrated"]) == [("DeepSeek-V3", 460, "concentrated")]
    assert DEFAULT_ROUTINGS == ROUTINGS == ("uniform", "skewed", "concentrated")  # every routing by default (issue 38)


def test_h200_check_sweep_names_variants_that_exist_at_its_points():
    # loadtest/h200_check.sh sweep-fp8 picks variants by label: a renamed variant would drop out silently.
    import pathlib
    import re
    import shlex

    from mok_serve.loadtest.bench.harness import load_shapes
    from mok_serve.loadtest.bench.layer import sweep_variants_fp8

    script = (pathlib.Path(__file__).parents[3] / "loadtest" / "h200_check.sh").read_text()
    words = shlex.split(re.search(r"sweep-fp8\)(.*?);;", script, re.S).group(1).replace("\\\n", " "), comments=True)
    points = words[words.index("--sweep-points") + 1: words.index("--sweep-labels")]
    labels = words[words.index("--sweep-labels") + 1: words.index("$@")]
    shapes = load_shapes()
    offered = set()
    for point in points:
        name, tokens = point.split(":")
        s = shapes[name]
        offered |= {label for label, _, _ in sweep_variants_fp8(
            int(tokens), s["top_k"], s["routed_experts"], s["hidden"], s["moe_intermediate"])}
    assert len(labels) >= 8 and set(labels) <= offered, set(labels) - offered


def test_fp8_sweep_offers_128_row_hot_expert_tiles_in_the_64_row_regime():
    from mok_serve.kernels.cuda.launch import check_heavy_m
    from mok_serve.loadtest.bench.layer import sweep_variants_fp8

    streaming = {label: (g1, g2) for label, g1, g2 in sweep_variants_fp8(1024, 8, 256, 7168, 2048)}  # 32 rows per expert
    assert "HEAVY_M" not in streaming["default"][0]
    heavy = [label for label in streaming if label.startswith("heavy128")]
    assert heavy == ["heavy128 n64", "heavy128 n64 s2", "heavy128 g2 w8"]
    for label in heavy:
        g1, g2 = streaming[label]
        assert g1["BLOCK_N"] == 64 and g1["BLOCK_M"] == 64 and g2["BLOCK_M"] == 64, label
        for g in (g1, g2):
            assert g["HEAVY_M"] == 128 and g["HEAVY_STAGES"] == (2 if label.endswith("s2") else 3), label
            check_heavy_m(g)
    assert (streaming["heavy128 g2 w8"][1]["BLOCK_N"], streaming["heavy128 g2 w8"][1]["num_warps"]) == (128, 8)
    assert streaming["heavy128 n64"][1]["BLOCK_N"] == 64
    # Not offered outside that regime (the swapped one has its own 64-row heavy tiles).
    assert not any(label.startswith("heavy128") for label, _, _ in sweep_variants_fp8(256, 8, 256, 7168, 2048))
