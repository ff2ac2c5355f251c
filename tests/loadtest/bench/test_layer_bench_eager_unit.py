"""The layer benchmark's vLLM / eager columns (CPU only): written where a run measured them, absent
from older runs' JSON (which still replots), the eager target judged per row, vLLM's output
checked before it is timed, and the block-size file vLLM's ``fused_experts`` looks up for each
model shape on an H200 (by vLLM's own functions, with the CPU build of vLLM)."""

import copy
import json
import math
import pathlib

import pytest
import torch

from mok_serve.loadtest.bench import harness, layer, report

BF16_RUN = pathlib.Path(layer.RESULTS) / "layer_bench.json"
FP8_RUN = pathlib.Path(layer.RESULTS) / "layer_bench_fp8.json"


def older_run(path):
    """A committed result as a run from before vLLM's baseline and the eager columns wrote it:
    its rows and meta without those keys (the files here are replaced by each new headline run)."""
    data = json.loads(path.read_text())
    newer = ("eager_", "kittens_eager", "speedup_vs_vllm", "vllm")
    return dict(meta={k: v for k, v in data["meta"].items() if not k.startswith(newer)},
                rows=[{k: v for k, v in r.items() if not k.startswith(newer)} for r in data["rows"]])


OLD_HEADER = ("| shape | tokens | routing | kittens ms | floor ms | bound | x floor | SM clock | torch ms | "
              "transformers ms | vs torch | vs transformers | target | met |")


def test_an_older_run_replots_without_the_vllm_section(tmp_path):
    data = older_run(BF16_RUN)
    report.write_markdown(data["meta"], data["rows"], tmp_path / "old.md")
    text = (tmp_path / "old.md").read_text()
    assert "Targets met:" in text and "vLLM's Triton fused_experts" not in text


def test_vllm_and_eager_columns_and_the_eager_target(tmp_path):
    data = older_run(BF16_RUN)
    rows = copy.deepcopy(data["rows"][:2])
    for r, (k_eager, v_eager) in zip(rows, [(0.010, 0.020), (0.030, 0.005)]):
        r.update(vllm_ms=2 * r["kittens_ms"], vllm_configs="vLLM defaults (no E=1.json)", speedup_vs_vllm=2.0,
                 kittens_eager_ms=r["kittens_ms"] + k_eager, vllm_eager_ms=2 * r["kittens_ms"] + v_eager)
        r["eager_extra_ms"] = {"kittens": k_eager, "vllm": v_eager}
        r["eager_target_met"] = k_eager <= v_eager
    report.write_markdown(data["meta"], rows, tmp_path / "new.md")
    text = (tmp_path / "new.md").read_text()
    assert "## Against vLLM's Triton fused_experts, replayed and eager" in text
    assert "Eager target met: 1 / 2 rows; kittens faster than vLLM replayed in 2 / 2." in text
    assert "vLLM defaults (no E=1.json)" in text
    section = text.split("## Against vLLM's Triton fused_experts")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith(f"| {rows[0]['shape']} |")]
    assert len(table) == 2 and table[0].endswith("| yes |") and table[1].endswith("| **no** |")


def test_issue_28_targets_and_vllm_replayed_or_eager():
    row = dict(tokens=8, floor_ms=0.1, bound="weights", kittens_ms=0.105, rel_err=dict(kittens=1e-4),
               speedup_vs_best_baseline=1.5)
    assert report.target_ms(row) == pytest.approx(0.11)  # floor + 10 us at 1-8 tokens
    assert report.judge(row) == dict(target="<= floor + 10 us", target_met=True)
    assert not report.judge({**row, "kittens_ms": 0.111})["target_met"]
    # vLLM faster replayed (the best baseline) or eager: missed, and the text says which.
    assert report.judge({**row, "speedup_vs_best_baseline": 0.98})["target"].endswith("[slower than a baseline]")
    eager = report.judge({**row, "kittens_eager_ms": 0.150, "vllm_eager_ms": 0.140})
    assert eager == dict(target="<= floor + 10 us [slower than vLLM eager]", target_met=False)
    assert report.judge({**row, "kittens_eager_ms": 0.140, "vllm_eager_ms": 0.140})["target_met"]  # ties meet it
    assert report.target_ms({**row, "tokens": 32}) is None
    assert report.target_ms({**row, "tokens": 512, "bound": "compute"}) == pytest.approx(0.125)
    assert report.target_ms({**row, "tokens": 2048}) == pytest.approx(0.12)
    assert report.target_ms({**row, "tokens": 8192}) == pytest.approx(0.13)
    fp8 = {**row, "quant": "fp8 block 128x128"}
    assert [report.target_ms({**fp8, "tokens": t}) for t in (1, 8, 512, 2048)] == [None, pytest.approx(0.115),
                                                                                 pytest.approx(0.115), None]
    assert report.target_ms({**fp8, "tokens": 8192}) == pytest.approx(0.15)
    # A compute-bound FP8 miss reads against the dense FP8 rate measured in the run: 1.5x a 1 ms
    # floor needs 1e12 FLOP in 1.5 ms, 667 TFLOP/s, 67% of 1000.
    big = {**fp8, "tokens": 8192, "bound": "compute", "floor_ms": 1.0, "kittens_ms": 2.0, "flops": 1e12, "bytes": 1e9}
    m = report.miss_reading(big, 4.0, 132, None, fp8_tflops=1000.0)
    assert m["need_ms"] == pytest.approx(1.5) and m["kind"] == "compute"
    assert m["detail"] == "67% of the dense FP8 rate measured in this run"
    # FP8 rows are judged at FP8's error tolerance.
    assert report.judge({**fp8, "rel_err": dict(kittens=2e-2)})["target_met"]
    assert not report.judge({**row, "rel_err": dict(kittens=2e-2)})["target_met"]


# ---------------------------------------------------------------------------- eager target


def test_eager_target_is_kittens_extra_no_larger_than_vllms():
    judge = report.eager_target
    assert judge({"eager_extra_ms": {"kittens": 0.010, "vllm": 0.020}}) is True
    assert judge({"eager_extra_ms": {"kittens": 0.020, "vllm": 0.020}}) is True  # "no larger": ties meet it
    assert judge({"eager_extra_ms": {"kittens": 0.021, "vllm": 0.020}}) is False
    assert judge({"eager_extra_ms": {"kittens": 0.010}}) is None  # no vLLM eager time: not judged
    assert judge({}) is None  # a run before the eager columns


def test_eager_calls_fill_the_budget_within_bounds():
    assert harness.eager_call_count(0.2, budget_ms=60.0, calls=(10, 500)) == 300  # decode: several hundred
    assert harness.eager_call_count(0.05, budget_ms=60.0, calls=(10, 500)) == 500  # bounded above
    assert harness.eager_call_count(13.0, budget_ms=60.0, calls=(10, 500)) == 10  # 8192 tokens: at least 10
    assert harness.eager_call_count(0.0) == harness.EAGER_CALLS[1]


def _times():
    return {"kittens": 1.0, "torch": 2.0, "transformers": 2.2, "vllm": 1.5}


CFG = dict(file="E=8,N=16,device_name=NVIDIA_H200.json", shipped=False, source="defaults",
           text="vLLM defaults (no E=8,N=16,device_name=NVIDIA_H200.json)",
           config=dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=4))


def test_row_fields_with_vllm_right_wrong_and_absent():
    errs = {"kittens": 0.0, "torch": 4e-3, "transformers": 4e-3, "vllm": 4e-3}
    eager, calls = {"kittens": 1.030, "vllm": 1.520}, {"kittens": 300, "vllm": 250}
    got = report.vllm_and_eager_fields(_times(), errs, eager, calls, harness.TOL_BF16, CFG)
    assert got["vllm_ms"] == 1.5 and got["speedup_vs_vllm"] == 1.5 and got["vllm_correct"] is True
    assert got["vllm_config"] == CFG and got["vllm_configs"] == CFG["text"]
    assert got["kittens_eager_ms"] == 1.030 and got["vllm_eager_ms"] == 1.520 and got["eager_calls"] == calls
    assert got["eager_extra_ms"] == pytest.approx({"kittens": 0.030, "vllm": 0.020})
    assert got["eager_target_met"] is False  # 30 us of host work against vLLM's 20

    # vLLM's output failed its check: it was not timed (no "vllm" in times or eager), nothing judged.
    wrong = {**errs, "vllm": float("nan")}
    times = {k: v for k, v in _times().items() if k != "vllm"}
    got = report.vllm_and_eager_fields(times, wrong, {"kittens": 1.03}, {"kittens": 300}, harness.TOL_BF16,
                                            CFG, "RuntimeError: boom")
    assert got["vllm_correct"] is False and got["vllm_error"] == "RuntimeError: boom"
    assert "vllm_ms" not in got and "speedup_vs_vllm" not in got and got["eager_target_met"] is None

    # No vLLM at all: only kittens' eager fields, no vLLM fields (rows then read like a run without it).
    got = report.vllm_and_eager_fields(times, errs, {"kittens": 1.03}, {"kittens": 300}, harness.TOL_BF16, None)
    assert not any(k.startswith("vllm") for k in got) and got["eager_target_met"] is None
    assert got["eager_extra_ms"] == pytest.approx({"kittens": 0.030})


def test_vllm_is_timed_only_if_its_output_passes():
    ref = torch.ones(4, 8)
    cases = {
        "right": (lambda: ref * (1 + 1e-3), True, None),
        "nan": (lambda: torch.full((4, 8), float("nan")), False, None),
        "inf": (lambda: torch.full((4, 8), float("inf")), False, None),
        "wrong": (lambda: ref * 1.5, False, None),
        "raises": (lambda: (_ for _ in ()).throw(RuntimeError("no kernel image")), False, "RuntimeError: no kernel image"),
    }
    for name, (fn, kept, error) in cases.items():
        impls, errs = {"kittens": lambda: ref, "vllm": fn}, {"kittens": 0.0}
        assert harness.check_vllm(impls, errs, ref, harness.TOL_BF16) == error, name
        assert ("vllm" in impls) is kept, name
        assert "kittens" in impls
    assert not harness.passes(float("nan"), 1.0) and not harness.passes(math.inf, 1.0)
    assert harness.passes(1e-2, harness.TOL_BF16) and not harness.passes(1.01e-2, harness.TOL_BF16)


# ---------------------------------------------------------------------------- reports


def _new_rows(base_rows):
    """Rows of an older run with the new fields, as ``bench_rows`` sets them: vLLM right and met,
    right and missed, and wrong (not timed)."""
    errs_ok = {"kittens": 0.0, "torch": 4e-3, "transformers": 4e-3, "vllm": 4e-3}
    rows = []
    for r, (vllm, k_extra, v_extra) in zip(copy.deepcopy(base_rows[:3]),
                                           [(1.2, 0.010, 0.020), (1.1, 0.030, 0.005), (None, 0.010, None)]):
        times = {"kittens": r["kittens_ms"], "torch": r["torch_ms"], "transformers": r["transformers_ms"]}
        eager = {"kittens": r["kittens_ms"] + k_extra}
        errs = dict(errs_ok)
        if vllm is None:
            errs["vllm"] = 0.3
        else:
            times["vllm"] = vllm * r["kittens_ms"]
            eager["vllm"] = times["vllm"] + v_extra
        r["rel_err"] = errs
        r.update(report.vllm_and_eager_fields(times, errs, eager, {k: 100 for k in eager}, harness.TOL_BF16, CFG))
        rows.append(r)
    return rows


def test_a_new_run_replots_with_the_vllm_section(tmp_path):
    data = older_run(BF16_RUN)
    meta = {**data["meta"], "vllm": "0.32.0", "eager_timing": "one call from Python (test)",
            "vllm_config_files": {"DeepSeek-V3": {k: v for k, v in CFG.items() if k != "config"}}}
    (tmp_path / "new.json").write_text(json.dumps(dict(meta=meta, rows=_new_rows(data["rows"]))))
    assert layer.main(["--replot", str(tmp_path / "new.json")]) == 0
    text = (tmp_path / "new.md").read_text()
    assert OLD_HEADER in text  # the main table as before
    section = text.split("## Against vLLM's Triton fused_experts, replayed and eager")[1].split("\n## ")[0]
    assert "Eager: one call from Python (test);" in section and "vLLM is timed only where its output passed" in section
    assert "DeepSeek-V3 vLLM defaults (no E=8,N=16,device_name=NVIDIA_H200.json)" in section
    table = [line for line in section.splitlines() if line.startswith("| DeepSeek-V3 |")]
    assert len(table) == 3
    assert "| 1.20x | defaults: M16 N64 K128 G1 w4 s4 |" in table[0] and table[0].endswith("| 0.010 | 0.020 | yes |")
    assert table[1].endswith("| 0.030 | 0.005 | **no** |")
    assert "| wrong (err 3.0e-01), not timed | - |" in table[2] and table[2].endswith("| 0.010 | - | - |")
    assert ("Eager target met: 1 / 2 rows; kittens faster than vLLM replayed in 2 / 2. "
            "vLLM's output failed the check in 1 rows (not timed).") in section
    assert (tmp_path / "new.png").stat().st_size > 10_000


def test_a_run_without_vllm_says_the_column_is_absent(tmp_path):
    data = older_run(BF16_RUN)
    rows = copy.deepcopy(data["rows"][:2])
    for r in rows:
        times = {"kittens": r["kittens_ms"], "torch": r["torch_ms"], "transformers": r["transformers_ms"]}
        r.update(report.vllm_and_eager_fields(times, r["rel_err"], {"kittens": r["kittens_ms"] + 0.02},
                                              {"kittens": 300}, harness.TOL_BF16, None))
    meta = {**data["meta"], "eager_timing": "t", "vllm_absent": "ModuleNotFoundError: No module named 'vllm'"}
    report.write_markdown(meta, rows, tmp_path / "t.md")
    text = (tmp_path / "t.md").read_text()
    assert "vLLM's fused_experts was not measured in this run (vLLM did not import: ModuleNotFoundError" in text
    assert "Eager target not judged: no vLLM eager times." in text
    section = text.split("## Against vLLM")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith("| DeepSeek-V3 |")]
    assert len(table) == 2 and "| - | - | - |" in table[0] and table[0].endswith("| 0.020 | - | - |")


def test_fp8_reports_old_and_new(tmp_path):
    data = older_run(FP8_RUN)
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert layer.main(["--replot", str(tmp_path / "old.json")]) == 0
    old = (tmp_path / "old.md").read_text()
    assert "## Against vLLM" not in old and "vLLM ms" not in old  # an older FP8 run: no vLLM columns
    rows = copy.deepcopy(data["rows"][:1])
    r = rows[0]
    times = {"kittens": r["kittens_ms"], "dequant_torch": r["dequant_torch_ms"], "vllm": 1.25 * r["kittens_ms"]}
    errs = {**r["rel_err"], "vllm": 2.5e-2}  # within FP8's 3e-2, beyond bf16's 1e-2
    eager = {"kittens": r["kittens_ms"] + 0.01, "vllm": times["vllm"] + 0.02}
    r.update(report.vllm_and_eager_fields(times, errs, eager, {"kittens": 9, "vllm": 9}, harness.TOL_FP8, CFG))
    r.update(report.judge(r))
    assert r["vllm_correct"] and r["speedup_vs_vllm"] == pytest.approx(1.25)
    meta = {**data["meta"], "eager_timing": "t"}
    report.write_markdown_fp8(meta, rows, tmp_path / "new.md")
    text = (tmp_path / "new.md").read_text()
    assert "speedup is against the row's fastest baseline" in text and "(relative error <= 0.03" in text
    assert "Eager target met: 1 / 1 rows" in text


# ---------------------------------------------------------------------------- vLLM's config lookup


@pytest.fixture
def vllm_on_h200(monkeypatch):
    """vLLM's fused_moe module, told it runs on an H200 (vLLM names its files by the device name)."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: "NVIDIA_H200")
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    fm.get_moe_configs.cache_clear()  # its cache key has no device name
    yield fm
    fm.get_moe_configs.cache_clear()


# vLLM 0.32 ships H200 files for Qwen3-30B-A3B (E=128, N=768), bf16 and block FP8, and for none of
# the other shapes at one GPU (its files for them are per tensor-parallel shard: N=256, 192, ...).
SHIPPED = {"Qwen3-30B-A3B"}


@pytest.mark.parametrize("fp8", [False, True])
def test_the_file_vllm_looks_up_for_each_shape_on_an_h200(vllm_on_h200, fp8):
    fm = vllm_on_h200
    for name, s in harness.load_shapes().items():
        E, H, I, K = s["routed_experts"], s["hidden"], s["moe_intermediate"], s["top_k"]
        want = f"E={E},N={I},device_name=NVIDIA_H200" + (",dtype=fp8_w8a8,block_shape=[128,128]" if fp8 else "") + ".json"
        got = harness.vllm_config(fm, E, H, I, K, 8, fp8=fp8)
        assert got["file"] == want, name
        assert got["shipped"] is (name in SHIPPED), name
        assert got["source"] == ("shipped file" if name in SHIPPED else "defaults"), name
        assert got["text"] == (f"tuned, shipped with vLLM ({want})" if name in SHIPPED else f"vLLM defaults (no {want})")
        if name in SHIPPED:  # the entry of vLLM's file nearest to 8 tokens
            table = json.loads((pathlib.Path(fm.__file__).parent / "configs" / want).read_text())
            table.pop("triton_version", None)
            nearest = min((int(k) for k in table), key=lambda m: abs(m - 8))
            assert got["config"] == table[str(nearest)], name
        else:  # vLLM's defaults for this shape and token count
            block = [128, 128] if fp8 else None
            assert got["config"] == fm.get_default_config(8, E, I, H, K, "fp8_w8a8" if fp8 else None, block), name


def test_an_h200_variant_looks_up_the_h200_file_and_a_user_folder_comes_first(vllm_on_h200, monkeypatch, tmp_path):
    fm = vllm_on_h200
    monkeypatch.setattr(fm, "get_device_name_as_file_name", lambda device_id=0: "NVIDIA_H200_NVL")
    name = "E=256,N=2048,device_name=NVIDIA_H200.json"
    assert harness.vllm_config_file(fm, 256, 2048)["file"] == name
    tuned = {"1": dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=4, num_stages=5)}
    (tmp_path / name).write_text(json.dumps(tuned))
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    fm.get_moe_configs.cache_clear()
    got = harness.vllm_config(fm, 256, 7168, 2048, 8, 1)
    assert got["source"] == "user file" and got["shipped"] is False and got["config"] == tuned["1"]


def test_vllm_gets_kittens_fp8_weights_and_scales_unchanged():
    from mok_serve.kernels.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

    torch.manual_seed(0)
    calls = []

    class FakeVllm:  # records what fused_experts is called with (the Triton kernel needs a GPU)
        @staticmethod
        def fused_experts(*args, **kwargs):
            calls.append((args, kwargs))
            return args[0]

    w13q, w13s = quantize_fp8_blocks(torch.randn(2, 256, 128))
    w2q, w2s = quantize_fp8_blocks(torch.randn(2, 128, 128))
    x, tw, ids = torch.randn(3, 128, dtype=torch.bfloat16), torch.rand(3, 2), torch.zeros(3, 2, dtype=torch.int32)
    harness.vllm_experts(FakeVllm, w13q, w2q, w13s, w2s)(x, tw, ids)
    (args, kwargs), = calls
    assert args[0] is x and args[1] is w13q and args[2] is w2q and args[3] is tw and args[4] is ids
    quant = kwargs["quant_config"]
    assert quant.use_fp8_w8a8 and quant.block_shape == [128, 128] and not quant.per_act_token_quant
    assert quant.w1_scale is w13s and quant.w2_scale is w2s
    harness.vllm_experts(FakeVllm, w13q, w2q)(x, tw, ids)  # bf16 weights: vLLM's unquantized config
    assert calls[1][1]["quant_config"] is None

    # vLLM's own block quantizer gives the scales kittens' does and both reconstruct w as q * scale,
    # so kittens' scales are what vLLM's kernel expects (an inverse convention, 448 / amax, would
    # differ by amax^2 / 448^2). vLLM multiplies by 1 / scale where kittens divides, so a few e4m3
    # roundings may differ; each stays within e4m3's half step (2^-4 relative, 2^-10 x scale near 0).
    # Uncompiled: torch.compile on the CPU takes longer than the rest of this file.
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    w = torch.randn(256, 384, dtype=torch.bfloat16)
    q, s = per_block_cast_to_fp8.__wrapped__(w, [128, 128])
    kq, ks = quantize_fp8_blocks(w)
    assert torch.equal(s, ks)
    for got in (dequantize_fp8_blocks(q, s), dequantize_fp8_blocks(kq, ks)):
        torch.testing.assert_close(got, w.float(), rtol=2**-4, atol=float(s.max()) * 2**-10)
