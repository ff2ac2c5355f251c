"""The layer benchmark's vLLM / eager columns (CPU only): written where a run measured them, absent
from older runs' JSON (which still replots), and the eager target judged per row."""

import copy
import json
import pathlib

from mok_serve.loadtest import layer_bench

OLD_RUN = pathlib.Path(layer_bench.RESULTS) / "layer_bench.json"


def test_an_older_run_replots_without_the_vllm_section(tmp_path):
    data = json.loads(OLD_RUN.read_text())
    assert not any("vllm_ms" in r for r in data["rows"])
    layer_bench.write_markdown(data["meta"], data["rows"], tmp_path / "old.md")
    text = (tmp_path / "old.md").read_text()
    assert "Targets met:" in text and "vLLM's Triton fused_experts" not in text


def test_vllm_and_eager_columns_and_the_eager_target(tmp_path):
    data = json.loads(OLD_RUN.read_text())
    rows = copy.deepcopy(data["rows"][:2])
    for r, (k_eager, v_eager) in zip(rows, [(0.010, 0.020), (0.030, 0.005)]):
        r.update(vllm_ms=2 * r["kittens_ms"], vllm_configs="vLLM defaults (no E=1.json)", speedup_vs_vllm=2.0,
                 kittens_eager_ms=r["kittens_ms"] + k_eager, vllm_eager_ms=2 * r["kittens_ms"] + v_eager)
        r["eager_extra_ms"] = {"kittens": k_eager, "vllm": v_eager}
        r["eager_target_met"] = k_eager <= v_eager
    layer_bench.write_markdown(data["meta"], rows, tmp_path / "new.md")
    text = (tmp_path / "new.md").read_text()
    assert "## Against vLLM's Triton fused_experts, replayed and eager" in text
    assert "Eager target met: 1 / 2 rows; kittens faster than vLLM replayed in 2 / 2." in text
    assert "vLLM defaults (no E=1.json)" in text
    section = text.split("## Against vLLM's Triton fused_experts")[1].split("\n## ")[0]
    table = [line for line in section.splitlines() if line.startswith(f"| {rows[0]['shape']} |")]
    assert len(table) == 2 and table[0].endswith("| yes |") and table[1].endswith("| **no** |")


def test_the_best_baseline_includes_vllm_where_measured():
    row = {"tokens": 8, "torch_ms": 1.0, "transformers_ms": 2.0}
    assert layer_bench.target_ms(row) == 0.5
    assert layer_bench.target_ms({**row, "vllm_ms": 0.4}) == 0.2
