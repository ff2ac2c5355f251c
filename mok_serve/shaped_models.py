"""Real-shape MoE models without weights, for serving benchmarks on GPUs (``mok-serve build-model``).

A model directory here holds what vLLM needs to build a model with ``--load-format dummy``: a
``config.json`` with the real architecture (the public config's shapes, routing and attention),
the embedded tiny models' tokenizer and chat template, and a generation config; vLLM fills the
weights with random values itself. The text such a model writes is meaningless, but every layer
has the real shapes, so time and memory per token are the real model's. No checkpoint is
downloaded (the GPU machines have no network).

``DeepSeek-V3`` at full depth (671B parameters) fits no single GPU: its directories are cut to as
many layers as fit a weight budget (``--weight-gib``; the three dense layers come first, as in
the model), or to ``--layers N``. The FP8 shapes are block FP8 as the FP8 checkpoints ship it
(e4m3 weights, 128x128 blocks, activations quantized at run time per 1x128 group): every linear
layer but the routers, the embedding and the output head.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from dataclasses import dataclass, field, replace
from typing import Any

from mok_serve import tiny_models

# What a parameter of each kind costs in bytes, per element.
BF16_BYTES, FP8_BYTES, SCALE_BYTES = 2, 1, 4
DEFAULT_WEIGHT_GIB = 80.0  # of an H200's ~140 GB: the rest for the KV cache, activations, graphs


@dataclass(frozen=True)
class ModelShape:
    """A public model's architecture, as transformers config arguments (``tiny_models`` writes the
    config from them, as for the tiny families)."""

    name: str
    model_type: str
    architecture: str
    description: str
    vocab_size: int
    config: dict[str, Any]
    extra_config: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] | None = None

    @property
    def num_layers(self) -> int:
        return self.config["num_hidden_layers"]

    def with_layers(self, layers: int) -> ModelShape:
        return replace(self, config={**self.config, "num_hidden_layers": layers})


QWEN3_30B_A3B = ModelShape(
    name="qwen3-30b-a3b",
    model_type="qwen3_moe",
    architecture="Qwen3MoeForCausalLM",
    description="Qwen3-30B-A3B: 48 layers, 128 experts of 768, top-8 softmax, GQA 32/4 heads",
    vocab_size=151936,
    config=dict(
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
    ),
)

DEEPSEEK_V3 = ModelShape(
    name="deepseek-v3",
    model_type="deepseek_v3",
    architecture="DeepseekV3ForCausalLM",
    description=(
        "DeepSeek-V3: MLA attention, 3 dense then MoE layers, 256 experts of 2048 in 8 groups, top-8 "
        "from 4 groups, sigmoid + correction bias, 1 shared expert (61 layers in the model)"
    ),
    vocab_size=129280,
    config=dict(
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        first_k_dense_replace=3,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        rope_interleave=True,
        tie_word_embeddings=False,
        hidden_act="silu",
        attention_bias=False,
    ),
    # The multi-token-prediction layer serves speculative decoding only: left out.
    extra_config=dict(scoring_func="sigmoid", topk_method="noaux_tc", moe_layer_freq=1, num_nextn_predict_layers=0),
)


def _block_fp8(shape: ModelShape) -> ModelShape:
    return replace(
        shape,
        name=f"{shape.name}-fp8",
        description=f"{shape.description}; block FP8 (e4m3, 128x128 scales)",
        quantization=tiny_models.FP8_BLOCK_QUANTIZATION,
    )


SHAPES: dict[str, ModelShape] = {
    s.name: s for base in (QWEN3_30B_A3B, DEEPSEEK_V3) for s in (base, _block_fp8(base))
}


def weight_bytes(shape: ModelShape) -> int:
    """Bytes of the model's weights on the GPU: bf16, or e4m3 linear layers with an fp32 scale
    per 128x128 block."""
    total = 0
    for name, dims, kind in tiny_models.param_specs(shape, shape.vocab_size):
        n = 1
        for d in dims:
            n *= d
        if shape.quantization and kind == "linear":  # not routers, embedding, output head, norms
            bn, bk = shape.quantization["weight_block_size"]
            total += n * FP8_BYTES + -(-dims[0] // bn) * -(-dims[1] // bk) * SCALE_BYTES
        else:
            total += n * BF16_BYTES
    return total


def layers_that_fit(shape: ModelShape, weight_gib: float) -> int:
    """The most layers (from the first) whose weights fit ``weight_gib``; the model's own depth at
    most. Raises ValueError when not even one layer fits."""
    budget = weight_gib * 2**30
    fit = 0
    for layers in range(1, shape.num_layers + 1):
        if weight_bytes(shape.with_layers(layers)) > budget:
            break
        fit = layers
    if fit == 0:
        raise ValueError(f"{shape.name}: one layer alone needs more than {weight_gib:g} GiB of weights")
    return fit


def _config(shape: ModelShape, ids: dict[str, int]) -> dict[str, Any]:
    d = tiny_models.make_config(replace(shape, quantization=None), shape.vocab_size, ids)
    if shape.quantization:
        specs = tiny_models.param_specs(shape, shape.vocab_size)
        routers = [name.removesuffix(".weight") for name, _, kind in specs if kind == "router"]
        d["quantization_config"] = {**shape.quantization, "ignored_layers": routers}
    return d


def build_model(shape_name: str, out: pathlib.Path, layers: int) -> dict[str, Any]:
    """Write the directory of ``shape_name`` cut to ``layers`` layers into ``out`` (created);
    returns what ``mok_serve_shape.json`` there says of it."""
    shape = SHAPES[shape_name]
    if not 1 <= layers <= shape.num_layers:
        raise ValueError(f"{shape.name} has {shape.num_layers} layers; asked for {layers}")
    shape = shape.with_layers(layers)
    out.mkdir(parents=True, exist_ok=True)
    ids = tiny_models.write_tokenizer(tiny_models.build_tokenizer(), out, shape.config["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(_config(shape, ids), indent=2, sort_keys=True) + "\n")
    generation = {"bos_token_id": ids[tiny_models.BOS_TOKEN], "eos_token_id": ids[tiny_models.IM_END]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    info = {
        "shape": shape_name,
        "description": shape.description,
        "layers": layers,
        "model_layers": SHAPES[shape_name].num_layers,
        "weight_bytes": weight_bytes(shape),
        "weights": "none: serve with --load-format dummy",
    }
    (out / "mok_serve_shape.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


HELP = """\
Write a directory that vLLM serves with --load-format dummy: the real architecture's config.json
(shapes, routing, attention), a tokenizer and a generation config, no weights. vLLM fills the
weights with random values: the text is meaningless, but every layer has the real shapes, so the
time and memory per token are the real model's. Models too large for the weight budget are cut to
the layers that fit (dense layers first, as in the model). DeepSeek-V3's routing bias is set to
zero under dummy weights (by mok-serve's vLLM plugin, for every MoE backend), so tokens spread over
the experts instead of all following the random bias to the same 8.

  mok-serve build-model --shape qwen3-30b-a3b --out /tmp/qwen3
  mok-serve /tmp/qwen3 --load-format dummy
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mok-serve build-model", description=HELP, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), help="the model to shape")
    parser.add_argument("--out", type=pathlib.Path, help="directory to write (default: ~/.cache/mok-serve/SHAPE-LAYERS)")
    parser.add_argument("--layers", type=int, help="cut the model to its first N layers (default: all that fit)")
    parser.add_argument(
        "--weight-gib", type=float, default=DEFAULT_WEIGHT_GIB,
        help=f"weight budget that picks the layers when --layers is not given (default {DEFAULT_WEIGHT_GIB:g})",
    )  # fmt: skip
    parser.add_argument("--list", action="store_true", help="list the shapes, their depth and weight size, and exit")
    args = parser.parse_args(argv)
    if args.list:
        for shape in SHAPES.values():
            print(f"{shape.name}: {shape.description}; {weight_bytes(shape) / 2**30:.1f} GiB of weights at full depth")
        return 0
    if args.shape is None:
        parser.error("--shape is required (see --list)")
    shape = SHAPES[args.shape]
    try:
        layers = args.layers or layers_that_fit(shape, args.weight_gib)
        out = args.out or tiny_models.default_cache_dir() / f"{shape.name}-{layers}l"
        info = build_model(shape.name, out, layers)
    except ValueError as e:
        parser.error(str(e))
    gib = info["weight_bytes"] / 2**30
    print(f"{out}  ({layers} of {shape.num_layers} layers, {gib:.1f} GiB of weights; serve with --load-format dummy)")
    return 0
