"""`mok-serve build-model`: real-shape model directories without weights (``shaped_models``).
Their sizes against the published parameter counts, the layer cut, the configs, and (slow) vLLM
serving them on the CPU with dummy weights, cut to one layer."""

import json

import pytest

from mok_serve import shaped_models
from mok_serve.server_process import ServerProcess


def _params(shape) -> int:
    """Parameters counted from the shapes alone (written here apart from ``tiny_models``)."""
    c, V = shape.config, shape.vocab_size
    H, L = c["hidden_size"], c["num_hidden_layers"]
    mlp = lambda inter: 3 * H * inter  # noqa: E731
    if shape.model_type == "qwen3_moe":
        hd, nh, nkv, E = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"], c["num_experts"]
        attention = H * hd * (2 * nh + 2 * nkv) + 2 * hd
        layer = attention + 2 * H + H * E + E * mlp(c["moe_intermediate_size"])
        return 2 * V * H + H + L * layer
    nh, r, kvr, rope = c["num_attention_heads"], c["q_lora_rank"], c["kv_lora_rank"], c["qk_rope_head_dim"]
    nope, v, E = c["qk_nope_head_dim"], c["v_head_dim"], c["n_routed_experts"]
    attention = H * r + r + r * nh * (nope + rope) + H * (kvr + rope) + kvr + kvr * nh * (nope + v) + nh * v * H
    dense = min(L, c["first_k_dense_replace"])
    moe = (L - dense) * (H * E + E + (E + c["n_shared_experts"]) * mlp(c["moe_intermediate_size"]))
    return 2 * V * H + H + L * (attention + 2 * H) + dense * mlp(c["intermediate_size"]) + moe


@pytest.mark.parametrize("name, published", [("qwen3-30b-a3b", 30.5e9), ("deepseek-v3", 671e9)])
def test_weight_bytes_are_the_published_models(name, published):
    shape = shaped_models.SHAPES[name]
    assert shaped_models.weight_bytes(shape) == 2 * _params(shape)
    assert abs(_params(shape) / published - 1) < 0.005


def test_fp8_shapes_count_one_byte_per_linear_weight_and_a_scale_per_block():
    bf16, fp8 = (shaped_models.SHAPES[n].with_layers(1) for n in ("qwen3-30b-a3b", "qwen3-30b-a3b-fp8"))
    # One Qwen3-30B-A3B layer's linear weights (out x in): q 4096x2048, k and v 512x2048,
    # o 2048x4096, 128 experts of gate and up 768x2048 and down 2048x768; the router stays bf16.
    linears = [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096)] + 128 * [(768, 2048), (768, 2048), (2048, 768)]
    saved = sum(o * i for o, i in linears)  # 2 bytes -> 1
    scales = sum(-(-o // 128) * -(-i // 128) * 4 for o, i in linears)
    assert shaped_models.weight_bytes(bf16) - shaped_models.weight_bytes(fp8) == saved - scales


def test_layers_that_fit_the_budget():
    shape = shaped_models.SHAPES["deepseek-v3"]
    layers = shaped_models.layers_that_fit(shape, 80)
    assert shaped_models.weight_bytes(shape.with_layers(layers)) <= 80 * 2**30
    assert shaped_models.weight_bytes(shape.with_layers(layers + 1)) > 80 * 2**30
    assert layers > shape.config["first_k_dense_replace"]  # at least one MoE layer
    full = shaped_models.SHAPES["qwen3-30b-a3b"]
    assert shaped_models.layers_that_fit(full, 80) == full.num_layers
    with pytest.raises(ValueError, match="one layer alone"):
        shaped_models.layers_that_fit(shape, 0.5)


def test_build_model_writes_the_real_architecture(tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    out = tmp_path / "ds"
    info = shaped_models.build_model("deepseek-v3-fp8", out, 5)
    assert info["weight_bytes"] == shaped_models.weight_bytes(shaped_models.SHAPES["deepseek-v3-fp8"].with_layers(5))
    config = AutoConfig.from_pretrained(out)
    assert config.model_type == "deepseek_v3" and config.num_hidden_layers == 5
    assert (config.hidden_size, config.moe_intermediate_size, config.n_routed_experts) == (7168, 2048, 256)
    assert config.vocab_size == 129280 and config.kv_lora_rank == 512
    raw = json.loads((out / "config.json").read_text())
    assert raw["scoring_func"] == "sigmoid" and raw["topk_method"] == "noaux_tc"
    q = raw["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == [128, 128]
    assert q["ignored_layers"] == [f"model.layers.{i}.mlp.gate" for i in (3, 4)]  # routers stay bf16
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert max(tokenizer("The quick brown fox").input_ids) < config.vocab_size
    assert json.loads((out / "mok_serve_shape.json").read_text())["layers"] == 5
    with pytest.raises(ValueError, match="61 layers"):
        shaped_models.build_model("deepseek-v3", tmp_path / "x", 62)


def test_cli_lists_and_refuses_a_missing_shape(capsys):
    assert shaped_models.main(["--list"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in shaped_models.SHAPES)
    with pytest.raises(SystemExit):
        shaped_models.main([])
    assert "--shape is required" in capsys.readouterr().err


@pytest.mark.server
def test_vllm_serves_one_layer_with_dummy_weights(tmp_path):
    # One layer: the full vocabulary and a MoE layer of the real width, through kittens. (The
    # DeepSeek-V3 shape cut to its first, dense, layer served the same way on this CPU too; its
    # MoE layers, 22 GB each in bf16, do not fit here: the GPU runs them.)
    name = "qwen3-30b-a3b"
    out = tmp_path / name
    shaped_models.build_model(name, out, 1)
    args = [str(out), "--load-format", "dummy", "--max-model-len", "1024"]
    with ServerProcess(args, env={"VLLM_CPU_KVCACHE_SPACE": "2"}, startup_timeout=900) as server:
        import httpx

        body = {"model": str(out), "prompt": "The quick brown fox", "max_tokens": 4, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert "Using KittensExperts MoE backend" in server.log()


@pytest.mark.server
def test_dummy_weights_spread_tokens_over_the_experts():
    # vLLM's dummy weights put the same +-1e-3 noise into DeepSeek-V3's routing bias as into every
    # weight; it outweighs the dummy router's scores, and every token then went to the same top-k
    # experts (expert_tokens [0, .., 80, 0, 80, 80, 0, 80] here; the DeepSeek-V3 shape on the H200:
    # 8 of 256 experts, imbalance 32). mok-serve zeroes that bias under dummy loading, for every
    # backend (stock here; the method mixin is kittens' too).
    import httpx

    from mok_serve import tiny_models

    model = tiny_models.build_tiny_model("deepseek_v3")
    args = [str(model), "--load-format", "dummy", "--max-model-len", "1024", "--moe-backend", "auto"]
    with ServerProcess(args, startup_timeout=900) as server:
        for i in range(4):
            body = {"model": str(model), "prompt": f"Prompt {i} on kittens and experts", "max_tokens": 8,
                    "ignore_eos": True}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=300).status_code == 200
        layers = httpx.get(f"{server.url}/v1/kittens/layers", timeout=60).json()["layers"]
    for layer in layers:
        rank = layer["ranks"][0]
        top_k, experts = layer["top_k"], layer["num_experts"]
        assert sum(rank["expert_tokens"]) > 0
        used = sum(1 for t in rank["expert_tokens"] if t)
        assert used > 2 * top_k, (layer["name"], rank["expert_tokens"])  # collapsed: exactly top_k
        assert rank["imbalance"] < experts / top_k / 2, (layer["name"], rank["imbalance"])
