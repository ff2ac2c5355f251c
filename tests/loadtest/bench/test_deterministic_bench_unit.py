"""The deterministic-serving benchmarks without a GPU: step-profile's kernel kinds and decode-step
difference, linear's and attention's floors, tables, history rows and sweep points."""

from mok_serve.loadtest.bench import attention, linear, step_profile


def test_kernel_kinds():
    kinds = {name: step_profile.kind_of(name) for name in [
        "_moe_decode_experts_kernel", "fused_moe_kernel", "kernel_unified_attention", "reshape_and_cache_flash_kernel",
        "matmul_kernel_persistent", "_linear_kernel", "nvjet_tst_128x64_64x8", "sm90_xmma_gemm_bf16bf16",
        "_rms_norm_kernel", "void vllm::fused_add_rms_norm_kernel", "_log_softmax_kernel", "triton_poi_fused_mul_0",
        "_fp8_gemm1_kernel", "_fp8_gemm2_kernel", "_fp8_schedule_quantize_kernel"]}
    assert [kinds[k] for k in kinds] == ["moe", "moe", "attention", "attention", "dense gemm", "dense gemm",
                                         "dense gemm", "dense gemm", "norm", "norm", "sampling/logits", "other",
                                         "moe", "moe", "moe"]  # (kittens' block-FP8 experts)


def test_decode_step_is_the_difference_per_step_and_tables_render():
    short = {"_linear_kernel": 100.0, "kernel_unified_attention": 10.0}
    long = {"_linear_kernel": 900.0, "kernel_unified_attention": 170.0, "_moe_decode_experts_kernel": 400.0}
    step = step_profile.decode_step(short, long, 8)
    assert step == {"_linear_kernel": 100.0, "kernel_unified_attention": 20.0, "_moe_decode_experts_kernel": 50.0}
    kinds = step_profile.by_kind(step)
    assert list(kinds) == ["dense gemm", "moe", "attention"]
    result = dict(label="x", model="m", moe_backend="kittens", deterministic=True, gpu="g", commit="c", vllm="v",
                  input_len=512, decode_steps=8, batch=256,
                  decode_step=dict(wall_ms=1.5, gpu_us=170.0, kernels=3.0, by_kind_us=kinds,
                                   top_kernels_us=sorted(step.items())))
    md = step_profile.markdown(result)
    assert "| dense gemm | 100.0 | 58.8% |" in md and "wall time per decode step: 1.500 ms" in md
    assert "kernels: 3" in md and "compilation config" not in md
    assert md.startswith("# One decode step at c=256: x") and "256 prompt(s) of 512 tokens" in md
    assert "Prefill" not in md
    result["prefill"] = dict(step_profile.summary(long, 40.0, 3), prompts=4)
    result["compilation_config"] = {"max_cudagraph_capture_size": 1024}
    assert result["prefill"]["gpu_us"] == 1470.0 and list(result["prefill"]["by_kind_us"])[0] == "dense gemm"
    md = step_profile.markdown(result)
    assert "## Prefill of 4 prompts x 512 tokens together (2048 tokens" in md and "| dense gemm | 900.0 | 61.2% |" in md
    assert '- compilation config: `{"max_cudagraph_capture_size": 1024}`' in md


def test_linear_bench_floor_table_and_history_rows():
    assert linear.floor_ms(1, 2048, 4096) == (2048 * 4096 + 4096 + 2048) * 2 / linear.PEAK_BYTES * 1e3
    assert linear.floor_ms(8192, 8192, 8192) == 2.0 * 8192**3 / linear.PEAK_FLOPS * 1e3
    meta = dict(gpu="g", commit="c", date="2026-12-04T00:00:00+00:00", torch="t", triton="tr", vllm=None,
                timing="median")
    rows = [dict(model="Qwen3-30B-A3B", layer="o_proj", n=2048, k=4096, rows=1, floor_ms=0.004, kittens_ms=0.005,
                 cublas_ms=0.006, kittens_x_floor=1.25, speedup_vs_cublas=1.2, kittens_row_alone_equal=True)]
    md = linear.markdown(meta, rows, ["kittens", "cublas"])
    assert "| Qwen3-30B-A3B | o_proj | 2048 x 4096 | 1 | 4.0 | 5.0 | 6.0 | 1.25 | 1.20x | yes | - |" in md
    # Block FP8: 1-byte weights at the FP8 rate; a provider that refuses a shape is listed, not timed.
    assert linear.floor_ms(1, 2048, 4096, 1.5e15) == (2048 * 4096 + (4096 + 2048) * 2) / linear.PEAK_BYTES * 1e3
    assert linear.floor_ms(8192, 8192, 8192, 1.5e15) == 2.0 * 8192**3 / 1.5e15 * 1e3
    refused = dict(rows[0], cublas_ms=None, cublas_error="RuntimeError: N must be a multiple of 128",
                   speedup_vs_cublas=None, cublas_row_alone_equal=False)
    md = linear.markdown(meta, [refused], ["kittens", "cublas"])
    assert "| 1.25 | - | yes | **NO** |" in md
    assert "- Qwen3-30B-A3B o_proj 1 rows, cublas: RuntimeError: N must be a multiple of 128" in md
    assert linear.history_rows(meta, rows, ["kittens"], "linear_bench_fp8")[0]["benchmark"] == "linear_bench_fp8"
    hist = linear.history_rows(meta, rows, ["kittens", "cublas"])
    assert [(h["provider"], h["metric"]) for h in hist] == [("kittens", "time_ms"), ("cublas", "time_ms"),
                                                            ("floor", "floor_ms")]


def test_linear_sweep_points_and_table():
    import pytest

    assert linear.parse_point("Qwen3-30B-A3B:o_proj:2048") == ("Qwen3-30B-A3B", "o_proj", 2048)
    for bad in ("Qwen3-30B-A3B:o_proj", "Qwen3-30B-A3B:nope:8", "Qwen3-30B-A3B:o_proj:0"):
        with pytest.raises(ValueError, match="point"):
            linear.parse_point(bad)
    assert set(linear.SWEEP) >= {"default", "split", "no split"}
    from mok_serve.kernels.cuda.linear import linear_plan

    for label in (x for x in linear.SWEEP if x.startswith("fp8 ")):  # block-FP8 tiles (prefill: TMA A on or off)
        overrides, _ = linear.SWEEP[label]
        rows = 1 if "swap" in label else 2048
        config, _, _ = linear_plan(rows, 5120, 2048, {**linear_plan(rows, 5120, 2048, fp8=True)[0], **overrides}, fp8=True)
        assert config["BLOCK_K"] == 128 and config.get("TMA_A", False) == ("TMA A" in label), label
        assert config["SWAP_AB"] == ("swap" in label), label
    assert linear_plan(2048, 5120, 2048)[0]["TMA_A"]  # bf16 prefill: activations by TMA by default
    for label in ("128x128 s4 w8 pointer A", "128x128 s4 w8 WS"):  # ... against pointer loads, warp-specialized
        overrides, _ = linear.SWEEP[label]
        config, _, _ = linear_plan(2048, 5120, 2048, {**linear_plan(2048, 5120, 2048)[0], **overrides})
        assert config["TMA_A"] == label.endswith(" WS") and config["WARP_SPEC"] == label.endswith(" WS"), label
    meta = dict(gpu="g", commit="c", timing="median")
    results = [dict(model="m", layer="l", rows=8, label="default", same_bits=True, floor_ms=0.01, median_ms=0.02),
               dict(model="m", layer="l", rows=8, label="x", same_bits=False, floor_ms=0.01),
               dict(model="m", layer="l", rows=8, label="y", same_bits=None, error="CompilationError: z", floor_ms=0.01),
               dict(model="m", layer="l", rows=8, label="cublas", same_bits=None, floor_ms=0.01, median_ms=0.01)]
    md = linear.sweep_markdown(meta, results)
    assert "| m | l | 8 | default | 20.0 | 2.00 | 0.50 | yes |" in md and "| m | l | 8 | x | - | - | - | **NO** |" in md
    assert "| m | l | 8 | cublas | 10.0 | 1.00 | 1.00 | n/a |" in md and "| m | l | 8 | y | - | - | - | error |" in md
    assert "- m l 8 rows, y: CompilationError: z" in md


def test_multinode_ep_model_counts_are_consistent():
    import numpy as np
    import pytest

    from mok_serve.loadtest.bench import ep_multinode_model as m

    ids = m.sample_routing(500, np.random.default_rng(1))
    groups = ids // (m.EXPERTS // m.GROUPS)
    assert ids.shape == (500, m.TOP_K) and all(len(set(g)) <= m.TOPK_GROUPS for g in groups)
    assert all(len(set(row)) == m.TOP_K for row in ids)
    two, four = m.traffic(2, samples=3000), m.traffic(4, samples=3000)
    assert 0.9 < two["remote_nodes"] <= 1 and 0 < two["remote_k"] < m.TOP_K  # DeepSeek's groups reach the other node
    assert two["remote_k"] < four["remote_k"] and four["remote_nodes"] <= 3
    row = m.layer(2, 128)
    assert row["rdma_combine_k_mb"] > row["rdma_combine_node_mb"]  # per-(token, k) returns cost more bytes
    # As built, fixed-size exchanges: every token to the other node, all 8 results back, every rank's ids.
    built = 128 * (m.FP8_ROW + 8 * m.BF16_ROW) + 8 * (2 + 128 * 8) * 4
    assert row["built_rdma_mb"] == pytest.approx(built / 1e6)
    assert row["built_rdma_mb"] > row["rdma_dispatch_mb"] + row["rdma_combine_k_mb"]
    assert "| 16 (2 x 8) | 128 |" in m.markdown([row])


def test_benchmark_routings_are_a_routers_top_k():
    import pytest
    import torch

    from mok_serve.loadtest.bench.harness import make_routing

    g = torch.Generator().manual_seed(0)
    for routing in ("uniform", "skewed", "concentrated"):
        w, ids = make_routing(4000, 64, 8, routing, g, device="cpu")
        assert ids.dtype == torch.int32 and ids.shape == (4000, 8) and torch.allclose(w.sum(1), torch.ones(4000))
        assert all(len(set(row)) == 8 for row in ids.tolist())  # distinct experts per token
    load = lambda ids: torch.bincount(ids.reshape(-1).long(), minlength=64).sort(descending=True).values  # noqa: E731
    uniform, skewed = load(make_routing(4000, 64, 8, "uniform", g, "cpu")[1]), load(make_routing(4000, 64, 8, "skewed", g, "cpu")[1])
    assert uniform[0] < 1.3 * uniform.float().mean()  # flat
    assert skewed[0] > 5 * skewed[-1] and skewed[0] > 2 * skewed[8]  # falls with rank
    assert load(make_routing(100, 64, 8, "concentrated", g, "cpu")[1]).count_nonzero() == 8
    with pytest.raises(ValueError, match="routing 'zipf'"):
        make_routing(4, 64, 8, "zipf", g, "cpu")


def test_attention_bench_pairs_floor_table_and_rows():
    assert attention.visible_pairs([(1, 512)]) == 512  # a decode token sees every key
    assert attention.visible_pairs([(4, 4)]) == 1 + 2 + 3 + 4
    assert attention.visible_pairs([(2, 10)]) == 9 + 10
    # decode: bound by reading the cache; prefill: by FLOPs
    seqs = [(1, 4096)]
    assert attention.floor_ms(seqs, 32, 4, 128) == (2 * 4096 * 4 + 2 * 32) * 128 * 2 / attention.PEAK_BYTES * 1e3
    seqs = [(4096, 4096)]
    assert attention.floor_ms(seqs, 32, 4, 128) == 4.0 * 128 * 32 * 4096 * 4097 / 2 / attention.PEAK_FLOPS * 1e3
    meta = dict(gpu="g", commit="c", date="2026-12-04T00:00:00+00:00", torch="t", triton="tr", vllm="v",
                timing="median")
    rows = [dict(model="Qwen3-30B-A3B", call="decode 1 x 512", tokens=1, seqs=1, floor_ms=0.002, kittens_ms=0.01,
                 vllm_ms=0.02, kittens_x_floor=5.0, speedup_vs_vllm=2.0)]
    md = attention.markdown(meta, rows, ["kittens", "vllm"])
    assert "| Qwen3-30B-A3B | decode 1 x 512 | 1 | 2.0 | 10.0 | 20.0 | 5.00 | 2.00x |" in md
    hist = attention.history_rows(meta, rows, ["kittens", "vllm"])
    assert [h["provider"] for h in hist] == ["kittens", "vllm", "floor"]
