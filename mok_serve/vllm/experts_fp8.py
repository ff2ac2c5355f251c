"""Kittens for block-FP8 checkpoints: vLLM's FP8 MoE method with ``fused_moe_fp8`` experts.

DeepSeek-V3 class checkpoints ship their experts as float8_e4m3fn weights with one fp32 scale
(``weight_scale_inv``) per 128x128 block. vLLM keeps creating and loading those weights and
scales (``Fp8MoEMethod``); with ``--moe-backend kittens`` the experts that run them are
``mok_serve.kernels.fused_moe_fp8``, which quantizes the activations itself (per token, in
groups of 128) and sums the top-k outputs in fp32 in a fixed order, as ``fused_moe`` does.
What kittens cannot run is refused at start-up (``plugin.py``, ``kittens_quantization_error``).
"""

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend, refine_fp8_moe_block_shape
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import (
    QuantKey,
    kFp8Dynamic128Sym,
    kFp8Static128BlockSym,
)
from vllm.platforms import current_platform

from mok_serve.kernels import fused_moe_fp8
from mok_serve.vllm import KITTENS
from mok_serve.vllm import deterministic, expert_parallel
from mok_serve.vllm.experts import KittensExperts, TimedMoEMethod, logger

BLOCK = [128, 128]  # the one weight block shape kittens runs (DeepSeek-V3's)

SUPPORTED = (
    "--moe-backend kittens runs unquantized MoE layers (bfloat16, float16 or float32 expert "
    "weights) and block-FP8 checkpoints (quant_method 'fp8', weight_block_size [128, 128], "
    "dynamic activation scheme, as DeepSeek-V3 ships)"
)


def kittens_quantization_error(quantization: str | None, quant_cfg: dict | None) -> str | None:
    """Why kittens cannot run a model quantized this way, or None when it can.

    ``quantization`` is vLLM's resolved method name, ``quant_cfg`` the checkpoint's
    ``quantization_config`` (None when quantizing online).
    """
    if quantization is None:
        return None
    if quantization != "fp8" or quant_cfg is None:
        what = f"quantized with '{quantization}'" + ("" if quant_cfg else " at load time (online)")
    elif quant_cfg.get("store_dtype"):
        what = f"an 'fp8' checkpoint storing its experts as {quant_cfg['store_dtype']}"
    elif quant_cfg.get("weight_block_size") is None:
        what = "an 'fp8' checkpoint with per-tensor scales (no weight_block_size)"
    elif list(quant_cfg["weight_block_size"]) != BLOCK:
        what = f"an 'fp8' checkpoint with weight_block_size {list(quant_cfg['weight_block_size'])}"
    else:
        return None
    return f"{SUPPORTED}; this model is {what}. Serve it without --moe-backend kittens."


class KittensFp8Experts(KittensExperts):
    """Block-FP8 routed experts through ``fused_moe_fp8``: W8A8 GEMMs with 128x128 weight
    scales and per-token 1x128 activation scales, the fp32 fixed-order top-k sum included."""

    @property
    def expects_unquantized_inputs(self) -> bool:
        # fused_moe_fp8 quantizes the activations itself, so prepare() must leave them alone.
        return True

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == (kFp8Static128BlockSym, kFp8Dynamic128Sym)

    def _run(self, hidden_states, w1, w2, topk_weights, topk_ids, expert_map) -> torch.Tensor:
        if self.owns_dispatch:
            return expert_parallel.ep_fused_moe_fp8(
                hidden_states, w1, w2, self.w1_scale, self.w2_scale, topk_weights, topk_ids, expert_map,
                self._timing_slot,
            )
        if not self._warmed_up:
            self._warm_up(hidden_states, w1, w2, topk_weights, topk_ids, expert_map, w13_scale=self.w1_scale,
                          w2_scale=self.w2_scale, block_shape=tuple(self.block_shape))
        return fused_moe_fp8(
            hidden_states,
            w1,
            w2,
            self.w1_scale,
            self.w2_scale,
            topk_weights,
            topk_ids,
            expert_map=expert_map,
            block_shape=tuple(self.block_shape),
        )


class KittensFp8MoEMethod(TimedMoEMethod, Fp8MoEMethod):
    """vLLM's FP8 MoE method, with kittens experts when ``--moe-backend kittens``.

    Put in place of ``Fp8MoEMethod`` (the name ``Fp8Config.get_quant_method`` builds) by the
    plugin; any other backend value runs the stock method unchanged.
    """

    def __init__(self, quant_config, layer):
        self._init_timing()
        moe: FusedMoEConfig = layer.moe_config
        if moe.moe_backend != KITTENS:
            super().__init__(quant_config, layer)
            return
        deterministic.install()
        # The stock constructor maps the backend name to one of vLLM's kernels and raises on
        # names it does not know, so set up what the rest of Fp8MoEMethod reads here.
        FusedMoEMethodBase.__init__(self, moe)
        self.quant_config = quant_config
        self.weight_block_size = quant_config.weight_block_size
        self.block_quant = True
        self.weight_scale_name = "weight_scale_inv"
        # vLLM would refine the blocks of a TP shard that splits a 128 block; kittens keeps 128x128.
        if refine_fp8_moe_block_shape(moe, self.weight_block_size) is not None:
            raise ValueError(
                f"--moe-backend kittens runs block-FP8 experts in whole 128x128 blocks: the "
                f"tensor-parallel shard of the expert intermediate size "
                f"({moe.intermediate_size_per_partition}) must be a multiple of 128"
            )
        self.weight_scale_refine = None
        self.moe_block_shape = self.weight_block_size
        supported, reason = KittensFp8Experts.is_supported_config(
            KittensFp8Experts, moe, kFp8Static128BlockSym, kFp8Dynamic128Sym, mk.FusedMoEActivationFormat.Standard
        )
        if not supported:
            raise ValueError(f"--moe-backend kittens cannot run this block-FP8 MoE layer: {reason}")
        # TRITON's handling is what kittens needs: vLLM's weight layout unchanged and a W8A8
        # block-quant config carrying the weight scales and the block shape.
        self.fp8_backend = Fp8MoeBackend.TRITON
        self.experts_cls = KittensFp8Experts
        logger.info_once(
            "kittens: block-FP8 MoE layers run mok-serve's kittens experts (fused_moe_fp8, %s)",
            "Triton kernels" if current_platform.is_cuda() else "torch reference",
        )

    def _stock_backend(self) -> str:
        return self.fp8_backend.value
