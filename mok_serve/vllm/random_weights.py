"""``--load-format kittens-random``: random weights at a trained model's scales, the same in every server.

vLLM's ``--load-format dummy`` fills every tensor with uniform noise of +-1e-3 (norm weights too),
so activations shrink to nearly nothing and a model's greedy output hardly depends on its inputs
or on rounding: a server that is not batch invariant still gives one completion per prompt, and a
determinism probe on such a model proves nothing. These weights keep real-model magnitudes:

- matrices (and expert stacks) ``normal(0, 1/sqrt(fan_in))``, fan_in the last dimension, so each
  layer keeps its input's scale and the logits spread like a trained model's (std ~1);
- block-FP8 weights: e4m3 ``normal(0, 1)`` with every 128x128 block's scale ``1/sqrt(fan_in)``;
- norm weights 1, biases 0 (DeepSeek-V3's routing bias too), other vectors ``normal(0, 0.02)``,
  scalar scales (the attention layers' KV-cache scales) 1.

Each tensor's values come from a generator seeded by its name, so every server built from the same
config, stock or kittens, holds the same weights (shards: the same per tensor-parallel degree).
Block FP8 and unquantized models; other quantized formats are refused at load time.
"""

import math
import zlib

import torch
from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
from vllm.model_executor.model_loader.reload.utils import get_layer_tensors

LOAD_FORMAT = "kittens-random"
FP8_BLOCK = 128


def seed_of(name: str) -> int:
    return zlib.crc32(name.encode())


def fill(tensor: torch.Tensor, name: str) -> None:
    """Fill one named tensor as the module docstring says."""
    if tensor.device.type == "meta":
        return
    value = getattr(tensor, "dummy_weight_value", None)
    if value is not None:
        tensor.fill_(value)
        return
    if not torch.is_floating_point(tensor):
        return
    leaf = name.rsplit(".", 1)[-1]
    if "scale" in leaf:
        if tensor.dim() == 0:  # the attention layers' KV-cache and query scales: identity
            tensor.fill_(1.0)
            return
        if tensor.dim() < 2:
            raise ValueError(f"--load-format {LOAD_FORMAT} fills block-FP8 scales only; {name} has shape "
                             f"{list(tensor.shape)} (a per-tensor or per-channel scale)")
        tensor.fill_(1.0 / math.sqrt(FP8_BLOCK * tensor.shape[-1]))
        return
    if tensor.dim() < 2:
        if "norm" in name and leaf == "weight":
            tensor.fill_(1.0)
        elif leaf == "bias" or leaf.endswith("_bias"):
            tensor.zero_()
        else:
            _normal(tensor, 0.02, name)
        return
    _normal(tensor, 1.0 if torch.finfo(tensor.dtype).bits < 16 else 1.0 / math.sqrt(tensor.shape[-1]), name)


def _normal(tensor: torch.Tensor, std: float, name: str, chunk_elems: int = 1 << 26) -> None:
    """``normal(0, std)`` drawn in fp32 slices along the first dimension (bounded scratch memory),
    from one generator seeded by ``name``: a function of the name and the shape."""
    g = torch.Generator(device=tensor.device).manual_seed(seed_of(name))
    per_row = max(1, tensor[0].numel()) if tensor.dim() else 1
    rows = max(1, chunk_elems // per_row)
    for part in tensor.split(rows) if tensor.dim() else (tensor,):
        values = torch.empty(part.shape, dtype=torch.float32, device=tensor.device)
        values.normal_(0.0, std, generator=g)
        part.copy_(values)


class ScaledRandomLoader(DummyModelLoader):
    """vLLM's dummy loader with ``fill`` in place of its uniform +-1e-3 noise."""

    @torch.no_grad()
    def load_weights(self, model: torch.nn.Module, model_config) -> None:
        for prefix, layer in model.named_modules():
            info = get_layerwise_info(layer)
            if info.can_load():
                raise ValueError(f"--load-format {LOAD_FORMAT} does not fill online-quantized layers ({prefix})")
            for name, tensor in get_layer_tensors(layer).items():
                if name not in layer._non_persistent_buffers_set:
                    fill(tensor, f"{prefix}.{name}" if prefix else name)


def register() -> None:
    from vllm.model_executor.model_loader import register_model_loader

    register_model_loader(LOAD_FORMAT)(ScaledRandomLoader)
