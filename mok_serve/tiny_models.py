"""Tiny random-weight MoE models, built offline and deterministically.

The project needs small MoE checkpoints that vLLM and transformers can load without a
network.  This module builds them from scratch: a byte-level BPE tokenizer trained on an
embedded English text, a ``config.json`` for one of the supported model families, and
bfloat16 safetensors weights drawn from a fixed-seed generator (one independent stream
per tensor, keyed by the tensor name), so two builds on any machine give byte-identical
weight and tokenizer files.

Block FP8.  ``deepseek_v3_fp8`` and ``qwen3_moe_fp8`` are the bf16 families with their routed
experts quantized as DeepSeek-V3 ships them (float8_e4m3fn weights, an fp32 ``weight_scale_inv``
per 128x128 block, ``quantization_config`` in ``config.json``); all other layers stay bf16 (vLLM's
CPU FP8 linear kernels need AMX). ``qwen3_moe_fp8_dense`` quantizes every linear layer but the
routers, as the real checkpoints do: for GPUs, where its dense layers run vLLM's block-FP8 GEMM.

Greedy robustness.  The project compares greedy outputs between configurations that only
differ by floating-point rounding (MoE backends, TP1 vs TP2).  A purely random model has
flat logits whose argmax flips on tiny rounding differences, so the output head is given
a planted structure: ``lm_head`` is a scaled, permuted copy of the (large) input
embedding plus noise.  Each position therefore has a clear favourite next token, while the
attention and MoE layers (initialised with fan-in scaled weights so they contribute a
sizeable share of the residual stream) still move the hidden state enough that a broken
MoE changes the generated tokens.

Usage::

    from mok_serve.tiny_models import build_tiny_model
    path = build_tiny_model("qwen3_moe")       # cached under $MOK_SERVE_CACHE or ~/.cache/mok-serve

    python -m mok_serve.tiny_models --family deepseek_v3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = [
    "FAMILIES",
    "DEFAULT_FAMILY",
    "UNSERVABLE_ON_CPU",
    "TinyFamily",
    "build_tiny_model",
    "default_cache_dir",
    "model_dir_name",
    "main",
]

SEED = 20240917
# Bump to force new cache folders even if nothing else changed.
BUILDER_VERSION = 1

# Special tokens (ids 0..N-1 of the tokenizer, in this order).
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]
TOKENIZER_VOCAB_SIZE = 2048

# ChatML-style template. Accepts string content or a list of OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}"
    "{{- message['content'] -}}"
    "{%- elif message['content'] is not none -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Training text for the tokenizer (written for this module).
CORPUS = """\
The small cat sat on the warm mat by the kitchen window and watched the rain fall on the garden.
Every morning the baker opened the shop at six, and the smell of fresh bread filled the narrow street.
A mixture of experts is a neural network layer in which a router sends each token to a few experts.
Each expert is a small feed-forward network; only the selected experts run for a given token.
The router computes a score for every expert, keeps the top k scores, and mixes the expert outputs.
Some models add a shared expert that every token visits, and a bias that balances the load.
In grouped routing the experts are split into groups, the best groups are chosen first,
and the final experts are picked only from those groups.
Tensor parallel inference splits every weight matrix across devices and sums the partial results.
Expert parallel inference places whole experts on different devices and moves tokens between them.
The server streams tokens back to the client as soon as they are generated.
Latency is the time until the first token arrives; throughput is the number of tokens per second.
Once upon a time there was a little fox who lived at the edge of a great forest.
The fox liked to read old maps, count the stars, and ask the owl difficult questions.
One evening the owl said: the river remembers every stone it has ever carried.
The fox thought about this for a long time and then went to sleep under the pine trees.
In the spring the children planted beans, tomatoes, carrots and sunflowers in neat rows.
They measured the plants every week and wrote the numbers in a green notebook.
Numbers such as 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 32, 64, 128, 256, 512 and 1024 appear often.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.
Please write a short poem about the sea. Summarize the following paragraph in one sentence.
What is the capital of France? Paris is the capital of France and its largest city.
How many legs does a spider have? A spider has eight legs and usually eight eyes.
Translate the sentence into French, German and Spanish, then explain the grammar.
def add(a, b):
    return a + b

for i in range(10):
    print(i, i * i)

import json
data = {"name": "kitten", "experts": 8, "top_k": 2, "hidden": [256, 512]}
print(json.dumps(data, indent=2))
The weather today is sunny with a light breeze from the west and a high of twenty degrees.
Tomorrow will be cloudy, and there may be showers in the afternoon and evening.
She opened the letter, read it twice, and smiled because the news was good.
He carried the heavy box up the stairs, set it down on the table, and caught his breath.
The library closes at nine in the evening on weekdays and at five on weekends.
Scientists study the stars, the oceans, the forests, the mountains and the smallest cells.
Music, painting, dance and poetry are different ways of telling the same human story.
The train left the station on time, crossed the long bridge, and disappeared into the hills.
A good test is small, fast, deterministic, and fails for exactly one reason.
Hello! How are you today? I am fine, thank you. Could you help me with a question?
Sure, I would be happy to help. Let us think about the problem step by step.
First, we read the input. Second, we compute the answer. Finally, we check the result.
"""


@dataclass(frozen=True)
class TinyFamily:
    """Everything that defines one tiny model family."""

    name: str
    architecture: str
    description: str
    # Keyword arguments for the transformers config class (vocab and token ids are added).
    config: dict[str, Any]
    # Extra keys written into config.json that vLLM reads (e.g. DeepSeek's scoring_func).
    extra_config: dict[str, Any] = field(default_factory=dict)
    # Initialisation knobs (see _init_tensor).
    embed_std: float = 1.0
    lm_head_planted: float = 0.6  # weight of the permuted-embedding part of lm_head
    lm_head_noise: float = 1.0  # std of the random part of lm_head (in units of 1/sqrt(H))
    linear_gain: float = 1.0  # std of linear layers = gain / sqrt(fan_in)
    router_gain: float = 4.0  # router weights std = router_gain / sqrt(H)
    correction_bias_std: float = 0.1
    # A quantized family is its bf16 ``base`` family (same weights, drawn from the same seeds)
    # with the routed experts quantized as ``quantization`` (the checkpoint's quantization_config).
    base: str | None = None
    quantization: dict[str, Any] | None = None
    # Every linear layer but the routers quantized too, not only the routed experts (GPU only).
    quantized_dense: bool = False

    @property
    def model_type(self) -> str:
        return self.base or self.name

    def spec(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "architecture": self.architecture,
            "config": self.config,
            "extra_config": self.extra_config,
            "init": [
                self.embed_std,
                self.lm_head_planted,
                self.lm_head_noise,
                self.linear_gain,
                self.router_gain,
                self.correction_bias_std,
            ],
            "base": self.base,
            "quantization": self.quantization,
            "quantized_dense": self.quantized_dense,
        }


FAMILIES: dict[str, TinyFamily] = {
    "qwen3_moe": TinyFamily(
        name="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        description="Qwen3-MoE: softmax top-2 of 8 experts, GQA attention with q/k norm",
        config=dict(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            tie_word_embeddings=False,
            hidden_act="silu",
            attention_bias=False,
        ),
    ),
    "deepseek_v3": TinyFamily(
        name="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        description=(
            "DeepSeek-V3: MLA attention, 1 dense + 2 MoE layers, 16 routed experts in 4 groups, "
            "top-4 from 2 groups, sigmoid + e_score_correction_bias, 1 shared expert, scaling 2.5"
        ),
        config=dict(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=4,
            # vLLM's CPU MLA decode kernel only supports kv_lora_rank + rope = 576.
            q_lora_rank=128,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=64,
            v_head_dim=64,
            n_routed_experts=16,
            n_shared_experts=1,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_interleave=True,
            tie_word_embeddings=False,
            hidden_act="silu",
            attention_bias=False,
        ),
        extra_config=dict(
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            moe_layer_freq=1,
            num_nextn_predict_layers=0,
        ),
        lm_head_planted=0.8,
    ),
    "glm4_moe": TinyFamily(
        name="glm4_moe",
        architecture="Glm4MoeForCausalLM",
        description=(
            "GLM-4.5: 1 dense + 2 MoE layers, sigmoid + e_score_correction_bias, 1 group, "
            "top-2 of 8 experts, 1 shared expert, routed scaling 2.5, partial rotary, qkv bias"
        ),
        config=dict(
            hidden_size=256,
            intermediate_size=512,
            moe_intermediate_size=128,
            num_hidden_layers=3,
            first_k_dense_replace=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,  # vLLM's Glm4MoeDecoderLayer reads config.head_dim
            n_routed_experts=8,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            use_qk_norm=False,
            attention_bias=True,
            max_position_embeddings=4096,
            rms_norm_eps=1e-5,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1000000.0,
                "partial_rotary_factor": 0.5,
            },
            tie_word_embeddings=False,
            hidden_act="silu",
        ),
        extra_config=dict(num_nextn_predict_layers=0),
        lm_head_planted=0.8,
    ),
}

# DeepSeek-V3's FP8 checkpoint format: float8_e4m3fn weights with one fp32 ``weight_scale_inv``
# per 128x128 block; activations are quantized at run time (per token, in groups of 128).
FP8_BLOCK_QUANTIZATION: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}


def _block_fp8(base: TinyFamily, dense: bool = False) -> TinyFamily:
    block_n, block_k = FP8_BLOCK_QUANTIZATION["weight_block_size"]
    c = base.config
    # Whole blocks only (what DeepSeek-V3 ships), so every scale covers a full 128x128 tile.
    assert c["hidden_size"] % block_k == 0 and c["moe_intermediate_size"] % block_n == 0, base.name
    return replace(
        base,
        name=f"{base.name}_fp8" + ("_dense" if dense else ""),
        base=base.name,
        description=f"{base.description}; "
        + ("every linear layer but the routers" if dense else "routed experts") + " in block FP8 (e4m3, 128x128 scales)",
        quantization=FP8_BLOCK_QUANTIZATION,
        quantized_dense=dense,
    )


def _quantized(fam: TinyFamily, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """The parameters of ``fam`` stored in block FP8."""
    return [(name, shape, kind) for name, shape, kind in param_specs(fam, vocab)
            if kind == "linear" and (fam.quantized_dense or _is_routed_expert(name))]


FAMILIES.update((f.name, f) for f in (_block_fp8(FAMILIES["deepseek_v3"]), _block_fp8(FAMILIES["qwen3_moe"]),
                                      _block_fp8(FAMILIES["qwen3_moe"], dense=True)))

DEFAULT_FAMILY = "qwen3_moe"

# Families that vLLM 0.32 (CPU build) could not serve, with the error seen.
UNSERVABLE_ON_CPU: dict[str, str] = {}


# --------------------------------------------------------------------------- hashing / paths


def _builder_fingerprint(family: TinyFamily) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(family.spec(), sort_keys=True).encode())
    if family.quantization:
        from mok_serve.kernels import fp8

        h.update(pathlib.Path(fp8.__file__).read_bytes())
    h.update(f"seed={SEED};v={BUILDER_VERSION};vocab={TOKENIZER_VOCAB_SIZE}".encode())
    h.update(CORPUS.encode())
    h.update(CHAT_TEMPLATE.encode())
    try:
        h.update(pathlib.Path(__file__).read_bytes())
    except OSError:  # pragma: no cover - e.g. zipped install
        pass
    return h.hexdigest()[:10]


def model_dir_name(family: str = DEFAULT_FAMILY) -> str:
    """Name of the cache subfolder for ``family`` (family plus a short hash of the builder)."""
    fam = _get_family(family)
    return f"tiny-{fam.name}-{_builder_fingerprint(fam)}"


def default_cache_dir() -> pathlib.Path:
    env = os.environ.get("MOK_SERVE_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "mok-serve"


def _get_family(family: str) -> TinyFamily:
    try:
        return FAMILIES[family]
    except KeyError:
        raise ValueError(
            f"unknown tiny model family {family!r}; choose one of {sorted(FAMILIES)}"
        ) from None


# --------------------------------------------------------------------------- tokenizer


def build_tokenizer():
    """Byte-level BPE trained on CORPUS; deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus with deterministic variations so the trainer has enough pairs.
    lines = CORPUS.splitlines()
    texts = list(lines)
    texts += [ln.lower() for ln in lines]
    texts += [ln.upper() for ln in lines]
    texts += [" ".join(reversed(ln.split())) for ln in lines]
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def write_tokenizer(tok, out: pathlib.Path, max_len: int) -> dict[str, int]:
    tok.save(str(out / "tokenizer.json"), pretty=True)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [EOS_TOKEN, IM_START],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": IM_END,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [EOS_TOKEN, IM_START],
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    return ids


# --------------------------------------------------------------------------- weights


def param_specs(fam: TinyFamily, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) of every tensor, in HF hub checkpoint naming (per-expert weights)."""
    c = fam.config
    H = c["hidden_size"]
    L = c["num_hidden_layers"]
    specs: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (vocab, H), "embed")]

    def mlp(prefix: str, inter: int) -> None:
        specs.append((f"{prefix}.gate_proj.weight", (inter, H), "linear"))
        specs.append((f"{prefix}.up_proj.weight", (inter, H), "linear"))
        specs.append((f"{prefix}.down_proj.weight", (H, inter), "linear"))

    for i in range(L):
        p = f"model.layers.{i}"
        specs.append((f"{p}.input_layernorm.weight", (H,), "norm"))
        specs.append((f"{p}.post_attention_layernorm.weight", (H,), "norm"))
        a = f"{p}.self_attn"
        nh = c["num_attention_heads"]
        if fam.model_type == "deepseek_v3":
            qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
            if c.get("q_lora_rank"):
                r = c["q_lora_rank"]
                specs.append((f"{a}.q_a_proj.weight", (r, H), "linear"))
                specs.append((f"{a}.q_a_layernorm.weight", (r,), "norm"))
                specs.append((f"{a}.q_b_proj.weight", (nh * qk, r), "linear"))
            else:
                specs.append((f"{a}.q_proj.weight", (nh * qk, H), "linear"))
            kvr = c["kv_lora_rank"]
            specs.append((f"{a}.kv_a_proj_with_mqa.weight", (kvr + c["qk_rope_head_dim"], H), "linear"))
            specs.append((f"{a}.kv_a_layernorm.weight", (kvr,), "norm"))
            specs.append(
                (f"{a}.kv_b_proj.weight", (nh * (c["qk_nope_head_dim"] + c["v_head_dim"]), kvr), "linear")
            )
            specs.append((f"{a}.o_proj.weight", (H, nh * c["v_head_dim"]), "linear"))
        else:
            hd = c.get("head_dim") or H // nh
            nkv = c["num_key_value_heads"]
            specs.append((f"{a}.q_proj.weight", (nh * hd, H), "linear"))
            specs.append((f"{a}.k_proj.weight", (nkv * hd, H), "linear"))
            specs.append((f"{a}.v_proj.weight", (nkv * hd, H), "linear"))
            if c.get("attention_bias"):
                specs.append((f"{a}.q_proj.bias", (nh * hd,), "bias"))
                specs.append((f"{a}.k_proj.bias", (nkv * hd,), "bias"))
                specs.append((f"{a}.v_proj.bias", (nkv * hd,), "bias"))
            specs.append((f"{a}.o_proj.weight", (H, nh * hd), "linear"))
            if fam.model_type == "qwen3_moe" or c.get("use_qk_norm"):
                specs.append((f"{a}.q_norm.weight", (hd,), "norm"))
                specs.append((f"{a}.k_norm.weight", (hd,), "norm"))

        m = f"{p}.mlp"
        if fam.model_type == "qwen3_moe":
            E = c["num_experts"]
            is_moe = i not in c["mlp_only_layers"] and (i + 1) % c["decoder_sparse_step"] == 0
        else:
            E = c["n_routed_experts"]
            is_moe = i >= c["first_k_dense_replace"]
        if not is_moe:
            mlp(m, c["intermediate_size"])
            continue
        specs.append((f"{m}.gate.weight", (E, H), "router"))
        if fam.model_type in ("deepseek_v3", "glm4_moe"):
            specs.append((f"{m}.gate.e_score_correction_bias", (E,), "correction_bias"))
        for e in range(E):
            mlp(f"{m}.experts.{e}", c["moe_intermediate_size"])
        if c.get("n_shared_experts"):
            mlp(f"{m}.shared_experts", c["moe_intermediate_size"] * c["n_shared_experts"])
    specs.append(("model.norm.weight", (H,), "norm"))
    specs.append(("lm_head.weight", (vocab, H), "lm_head"))
    return specs


def _rng(fam: TinyFamily, name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{SEED}:{fam.model_type}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))


def _make_weights(fam: TinyFamily, vocab: int, n_special: int) -> dict[str, Any]:
    import torch

    H = fam.config["hidden_size"]
    arrays: dict[str, np.ndarray] = {}
    for name, shape, kind in param_specs(fam, vocab):
        g = _rng(fam, name)
        if kind == "norm":
            a = np.ones(shape, dtype=np.float32)
        elif kind == "embed":
            a = g.standard_normal(shape, dtype=np.float32) * np.float32(fam.embed_std)
        elif kind == "linear":
            a = g.standard_normal(shape, dtype=np.float32) * np.float32(fam.linear_gain / np.sqrt(shape[1]))
        elif kind == "bias":
            a = g.standard_normal(shape, dtype=np.float32) * np.float32(0.1)
        elif kind == "router":
            a = g.standard_normal(shape, dtype=np.float32) * np.float32(fam.router_gain / np.sqrt(shape[1]))
        elif kind == "correction_bias":
            a = g.standard_normal(shape, dtype=np.float32) * np.float32(fam.correction_bias_std)
        elif kind == "lm_head":
            # Planted structure: lm_head[perm[t]] ~ embed[t], so the token after t has a
            # clear favourite (large logit margin); plus noise so context still matters.
            emb = arrays["model.embed_tokens.weight"]
            perm = g.permutation(vocab)
            planted = np.empty_like(emb)
            planted[perm] = emb / np.float32(fam.embed_std)
            noise = g.standard_normal(shape, dtype=np.float32)
            a = (np.float32(fam.lm_head_planted) * planted + np.float32(fam.lm_head_noise) * noise) / np.float32(
                np.sqrt(H)
            )
            # Never favour special tokens (pad/bos/chat markers) in random generation.
            a[:n_special] *= np.float32(0.25)
        else:  # pragma: no cover
            raise AssertionError(kind)
        arrays[name] = np.ascontiguousarray(a, dtype=np.float32)
    weights = {k: torch.from_numpy(v).to(torch.bfloat16) for k, v in arrays.items()}
    return _quantize(fam, weights, vocab) if fam.quantization else weights


def _is_routed_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _quantize(fam: TinyFamily, weights: dict[str, Any], vocab: int) -> dict[str, Any]:
    """Block-FP8 layers (``_quantized``) in the checkpoint layout vLLM loads (``weight`` +
    ``weight_scale_inv``), quantized from the bf16 weights, so dequantizing gives back the base
    family's weights."""
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    block = tuple(fam.quantization["weight_block_size"])
    quantized = {name for name, _, _ in _quantized(fam, vocab)}
    out = {}
    for name, w in weights.items():
        if name not in quantized:
            out[name] = w
            continue
        q, scale = quantize_fp8_blocks(w, block=block)
        out[name] = q.contiguous()
        out[name.removesuffix("weight") + "weight_scale_inv"] = scale.float().contiguous()
    return out


# --------------------------------------------------------------------------- config


def make_config(fam: TinyFamily, vocab: int, ids: dict[str, int]) -> dict[str, Any]:
    from transformers import AutoConfig

    kwargs = dict(fam.config)
    kwargs.update(
        vocab_size=vocab,
        bos_token_id=ids[BOS_TOKEN],
        eos_token_id=ids[IM_END],
        pad_token_id=ids[PAD_TOKEN],
        architectures=[fam.architecture],
        dtype="bfloat16",
        initializer_range=0.02,
    )
    cfg = AutoConfig.for_model(fam.model_type, **kwargs)
    d = cfg.to_dict()
    d.update(fam.extra_config)
    d["architectures"] = [fam.architecture]
    d["torch_dtype"] = "bfloat16"
    d["dtype"] = "bfloat16"
    d.pop("transformers_version", None)
    if fam.quantization:
        # Every linear layer left in bf16 (routers included: Qwen3-MoE's is a quantizable linear
        # in vLLM) is listed as such.
        quantized = {name for name, _, _ in _quantized(fam, vocab)}
        linears = [name for name, _, kind in param_specs(fam, vocab) if kind in ("linear", "router")]
        ignored = [name.removesuffix(".weight") for name in linears if name not in quantized]
        d["quantization_config"] = {**fam.quantization, "ignored_layers": ignored}
    return d


# --------------------------------------------------------------------------- build


def _build_into(fam: TinyFamily, out: pathlib.Path) -> None:
    from safetensors.torch import save_file

    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    max_len = fam.config["max_position_embeddings"]
    ids = write_tokenizer(tok, out, max_len)
    cfg = make_config(fam, vocab, ids)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[IM_END], ids[EOS_TOKEN]],
        "pad_token_id": ids[PAD_TOKEN],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    weights = _make_weights(fam, vocab, len(SPECIAL_TOKENS))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    info = {
        "family": fam.name,
        "description": fam.description,
        "fingerprint": _builder_fingerprint(fam),
        "seed": SEED,
        "builder_version": BUILDER_VERSION,
        "num_parameters": int(sum(w.numel() for w in weights.values())),
    }
    (out / "mok_serve_tiny.json").write_text(json.dumps(info, indent=2) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)
    out.chmod(0o755)


def _is_complete(path: pathlib.Path) -> bool:
    return (path / "mok_serve_tiny.json").is_file() and (path / "model.safetensors").is_file()


def build_tiny_model(
    family: str = DEFAULT_FAMILY,
    cache_dir: str | os.PathLike | None = None,
    force: bool = False,
) -> pathlib.Path:
    """Build (or reuse) the tiny model of ``family`` and return its directory.

    The directory is ``<cache_dir>/tiny-<family>-<hash>``; it is built in a temporary
    sibling directory and renamed into place atomically, so concurrent builders never see
    a partial model.  ``force=True`` rebuilds even if the directory exists.
    """
    fam = _get_family(family)
    root = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    final = root / model_dir_name(family)
    if _is_complete(final) and not force:
        return final
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        _build_into(fam, tmp)
        if force and final.exists():
            old = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=root))
            try:
                os.replace(final, old / "m")
            except OSError:
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first (target exists and is non-empty): use theirs.
            if not _is_complete(final):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- CLI


def served_name(family: str) -> str:
    """The name ``mok-serve`` serves a tiny model under when it picks one itself (no MODEL given)."""
    return f"tiny-{family}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mok-serve build-tiny",
        description="Build the embedded tiny random-weight MoE models (offline, deterministic).",
    )
    parser.add_argument("--family", default=DEFAULT_FAMILY, choices=sorted(FAMILIES))
    parser.add_argument("--cache-dir", default=None, help="default: $MOK_SERVE_CACHE or ~/.cache/mok-serve")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--list", action="store_true", help="list the families and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, fam in FAMILIES.items():
            mark = " (default)" if name == DEFAULT_FAMILY else ""
            note = f"  [not servable by vLLM CPU: {UNSERVABLE_ON_CPU[name]}]" if name in UNSERVABLE_ON_CPU else ""
            print(f"{name}{mark}: {fam.description}{note}")
        return 0
    path = build_tiny_model(args.family, cache_dir=args.cache_dir, force=args.force)
    print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
