"""Tests for the embedded tiny random-weight MoE models (CPU, no vLLM server)."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mok_serve import tiny_models as tm  # noqa: E402

FAMILY_NAMES = ["qwen3_moe", "deepseek_v3", "glm4_moe"]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="module")
def built(cache_root):
    return {f: tm.build_tiny_model(f, cache_dir=cache_root) for f in FAMILY_NAMES}


def test_api_surface():
    assert tm.DEFAULT_FAMILY == "qwen3_moe"
    assert set(FAMILY_NAMES) <= set(tm.FAMILIES)
    assert isinstance(tm.UNSERVABLE_ON_CPU, dict)
    with pytest.raises(ValueError):
        tm.build_tiny_model("no_such_family")


def test_family_shapes():
    for name, fam in tm.FAMILIES.items():
        c = fam.config
        assert c["hidden_size"] % 32 == 0, name
        assert c["moe_intermediate_size"] % 32 == 0, name
        assert c["intermediate_size"] % 32 == 0, name
        assert c["max_position_embeddings"] >= 2048, name
        assert c["tie_word_embeddings"] is False, name
    q = tm.FAMILIES["qwen3_moe"].config
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_experts"], q["num_experts_per_tok"]) == (256, 2, 8, 2)
    assert q["moe_intermediate_size"] == 128
    d = tm.FAMILIES["deepseek_v3"]
    dc = d.config
    assert dc["n_group"] > 1 and dc["topk_group"] < dc["n_group"]
    assert dc["routed_scaling_factor"] != 1.0 and dc["norm_topk_prob"] is True
    assert dc["n_shared_experts"] >= 1
    assert dc["first_k_dense_replace"] >= 1
    assert dc["num_hidden_layers"] - dc["first_k_dense_replace"] >= 2
    assert d.extra_config["scoring_func"] == "sigmoid" and d.extra_config["topk_method"] == "noaux_tc"
    g = tm.FAMILIES["glm4_moe"].config
    assert g["n_group"] == 1 and g["n_shared_experts"] >= 1 and g["routed_scaling_factor"] != 1.0


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_files_and_config(built, family):
    path = built[family]
    assert path.name.startswith(f"tiny-{family}-")
    for f in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (path / f).is_file(), f
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == family
    tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert "chat_template" in tok_cfg
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert keys
        assert all(f.get_slice(k).get_dtype() == "BF16" for k in keys)
        # HF hub layout: one tensor per expert projection.
        assert any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
        assert "lm_head.weight" in keys


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_loads_and_generates_in_transformers(built, family):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built[family]
    tok = AutoTokenizer.from_pretrained(path)
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert model.config.vocab_size == len(tok)
    ids = tok("The cat sat on the", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    new = out[0, ids.shape[1] :]
    assert new.numel() >= 1
    assert isinstance(tok.decode(new), str)


def test_random_ids_decode(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[tm.DEFAULT_FAMILY])
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tok), (200,), generator=g).tolist()
    text = tok.decode(ids, skip_special_tokens=True)
    assert isinstance(text, str) and text
    assert tok.decode(tok("Hello world, experts!").input_ids) == "Hello world, experts!"


def test_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built[tm.DEFAULT_FAMILY])
    msgs = [
        {"role": "system", "content": "You are a cat."},
        {"role": "user", "content": "Hello!"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a cat.<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert no_gen.endswith("<|im_end|>\n") and not no_gen.endswith("assistant\n")
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]}]
    assert tok.apply_chat_template(parts, tokenize=False) == "<|im_start|>user\nHi there<|im_end|>\n"
    ids = tok(text, add_special_tokens=False).input_ids
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.bos_token is not None


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rebuild_is_byte_identical(built, tmp_path, family):
    other = tm.build_tiny_model(family, cache_dir=tmp_path)
    assert other.name == built[family].name
    for f in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json"):
        assert _sha(other / f) == _sha(built[family] / f), f


def test_cache_reuse_and_force(tmp_path, monkeypatch):
    first = tm.build_tiny_model(cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(tm, "_build_into", boom)
    again = tm.build_tiny_model(cache_dir=tmp_path)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp
    monkeypatch.undo()
    forced = tm.build_tiny_model(cache_dir=tmp_path, force=True)
    assert forced == first and (forced / "model.safetensors").is_file()
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert leftovers == []


def test_env_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MOK_SERVE_CACHE", str(tmp_path / "envcache"))
    assert tm.default_cache_dir() == tmp_path / "envcache"


def test_concurrent_builders(tmp_path):
    results, errors = [], []

    def run():
        try:
            results.append(tm.build_tiny_model(cache_dir=tmp_path))
        except Exception as e:  # pragma: no cover
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(results)) == 1
    assert (results[0] / "model.safetensors").is_file()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_cli(tmp_path, capsys):
    assert tm.main(["--list"]) == 0
    listed = capsys.readouterr().out
    for f in FAMILY_NAMES:
        assert f in listed
    assert tm.main(["--family", "qwen3_moe", "--cache-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == str(tm.build_tiny_model(cache_dir=tmp_path))


FP8_FAMILIES = ["deepseek_v3_fp8", "qwen3_moe_fp8", "qwen3_moe_fp8_dense"]


@pytest.fixture(scope="module")
def built_fp8(cache_root):
    return {f: tm.build_tiny_model(f, cache_dir=cache_root) for f in FP8_FAMILIES}


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_family_is_its_bf16_family_with_block_fp8_layers(built, built_fp8, family):
    from safetensors.torch import load_file

    from mok_serve.kernels.fp8 import dequantize_fp8_blocks

    base = tm.FAMILIES[family].base
    fp8, bf16 = load_file(str(built_fp8[family] / "model.safetensors")), load_file(str(built[base] / "model.safetensors"))
    cfg = json.loads((built_fp8[family] / "config.json").read_text())
    quant = cfg.pop("quantization_config")
    assert cfg == json.loads((built[base] / "config.json").read_text())
    assert {k: quant[k] for k in ("quant_method", "weight_block_size", "activation_scheme")} == {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    # The routed experts, or with quantized_dense every linear layer but the routers.
    dense = tm.FAMILIES[family].quantized_dense
    linears = {k for k, v in bf16.items() if v.dim() == 2} - {"model.embed_tokens.weight", "lm_head.weight"}
    routers = {k for k in linears if k.endswith(".mlp.gate.weight")}
    experts = sorted(linears - routers if dense else {k for k in bf16 if ".mlp.experts." in k})
    assert experts and (not dense or any(".self_attn." in k for k in experts))
    assert set(fp8) == set(bf16) | {k.removesuffix("weight") + "weight_scale_inv" for k in experts}
    for name, w in bf16.items():
        if name not in experts:
            assert torch.equal(fp8[name], w), name
            continue
        q, scale = fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"]
        assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
        assert scale.dtype == torch.float32 and scale.shape == (w.shape[0] // 128, w.shape[1] // 128)
        # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 of the value (subnormals: scale/1024).
        w, error = w.float(), (dequantize_fp8_blocks(q, scale) - w.float()).abs()
        bound = torch.maximum(w.abs() / 16, scale.repeat_interleave(128, 0).repeat_interleave(128, 1) / 1024)
        assert (error <= bound * 1.0001).all(), name
    # Every other linear layer, routers included, stays bf16 and is named so.
    assert set(quant["ignored_layers"]) == {k.removesuffix(".weight") for k in linears if k not in experts}


@pytest.mark.parametrize("family", FP8_FAMILIES)
def test_fp8_rebuild_is_byte_identical(built_fp8, tmp_path, family):
    other = tm.build_tiny_model(family, cache_dir=tmp_path)
    assert other.name == built_fp8[family].name and other.name.startswith(f"tiny-{family}-")
    for f in ("model.safetensors", "config.json"):
        assert _sha(other / f) == _sha(built_fp8[family] / f), f
