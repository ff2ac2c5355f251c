"""Kittens as a vLLM MoE backend: the experts class and the MoE method that selects it.

vLLM keeps everything around the experts (weight creation and loading, expert maps, routing,
prepare/finalize, the runner); ``--moe-backend kittens`` swaps the experts for ``fused_moe``.
"""

import time

import torch
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.logger import init_logger
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.config import (
    FusedMoEConfig,
    FusedMoEParallelConfig,
    RoutingMethodType,
)
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization.utils.quant_utils import QuantKey
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from mok_serve.kernels import fused_moe, warm_up
from mok_serve.kernels.cpu import moe as cpu_moe
from mok_serve.vllm import KITTENS, deterministic, expert_parallel
from mok_serve.vllm import timing

# vLLM configures handlers for its own logger tree only.
logger = init_logger("vllm.mok_serve")

# Layer shapes and dtypes whose kernels KittensExperts._warm_up compiled in this process.
_WARMED_UP: set[tuple] = set()


class KittensExperts(mk.FusedMoEExpertsModular):
    """Routed experts through ``mok_serve.kernels.fused_moe``: GEMMs, SiLU-mul and the fp32
    fixed-order top-k sum in one call, so the weight-and-reduce step after it is a no-op."""

    def __init__(self, moe_config: FusedMoEConfig, quant_config):
        super().__init__(moe_config, quant_config)
        # With the passthrough all-to-all (bound for kittens by expert_parallel.py) vLLM leaves
        # dispatch and combine to the experts; without data parallelism all ranks hold the same tokens.
        parallel = moe_config.moe_parallel_config
        self.owns_dispatch = parallel.use_passthrough_all2all
        self._warmed_up = False
        if self.owns_dispatch:
            expert_parallel.configure(moe_config.max_num_tokens, replicated_tokens=parallel.dp_size == 1)

    @staticmethod
    def activation_format() -> mk.FusedMoEActivationFormat:
        return mk.FusedMoEActivationFormat.Standard

    @staticmethod
    def _supports_current_device() -> bool:
        return current_platform.is_cpu() or current_platform.is_cuda()

    @staticmethod
    def _supports_no_act_and_mul() -> bool:
        return False

    @staticmethod
    def _supports_activation(activation: MoEActivation) -> bool:
        return activation == MoEActivation.SILU

    @staticmethod
    def _supports_quant_scheme(weight_key: QuantKey | None, activation_key: QuantKey | None) -> bool:
        return (weight_key, activation_key) == (None, None)

    @staticmethod
    def _supports_parallel_config(moe_parallel_config: FusedMoEParallelConfig) -> bool:
        return True

    @staticmethod
    def _supports_routing_method(
        routing_method: RoutingMethodType, weight_key: QuantKey | None, activation_key: QuantKey | None
    ) -> bool:
        # vLLM's router runs before the experts; they only see top-k ids and weights.
        return True

    @staticmethod
    def _supports_router_logits_dtype(router_logits_dtype: torch.dtype | None, routing_method) -> bool:
        return True

    @staticmethod
    def _supports_batch_invariance() -> bool:
        return True

    @staticmethod
    def is_supported_config(cls, moe_config: FusedMoEConfig, weight_key, activation_key, activation_format):
        if moe_config.has_bias:
            return False, "kernel does not support expert biases"
        return mk.FusedMoEExperts.is_supported_config(cls, moe_config, weight_key, activation_key, activation_format)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if current_platform.is_cpu():
            # The CPU kernel (kernels/cpu/moe.py) reads each expert's weights transposed: keep them
            # so in memory, still shaped as vLLM expects, so no call transposes them again.
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                replace_parameter(layer, name, weight.transpose(1, 2).contiguous().transpose(1, 2))

    def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta, activation):
        return (0,), (0,), (M, K)

    def finalize_weight_and_reduce_impl(self) -> mk.TopKWeightAndReduce:
        return TopKWeightAndReduceNoOP()

    def apply(
        self,
        output: torch.Tensor,
        hidden_states: torch.Tensor,
        w1: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        activation: MoEActivation,
        global_num_experts: int,
        expert_map: torch.Tensor | None,
        a1q_scale: torch.Tensor | None,
        a2_scale: torch.Tensor | None,
        workspace13: torch.Tensor,
        workspace2: torch.Tensor,
        expert_tokens_meta: mk.ExpertTokensMetadata | None,
        apply_router_weight_on_input: bool,
    ) -> None:
        if apply_router_weight_on_input:
            # prepare() already scaled the input by the (top-1) router weight.
            topk_weights = torch.ones_like(topk_weights)
        output.copy_(self._run(hidden_states, w1, w2, topk_weights, topk_ids, expert_map))

    @property
    def _timing_slot(self) -> int:
        """The layer's timing slot for the EP ops' phase stamps, -1 when timing is off. Without
        expert parallelism dispatch and combine happen inside the one fused op, so a layer's
        time has no phases."""
        slot = getattr(self, "_kittens_timing_slot", None)
        return -1 if slot is None else slot

    def _run(self, hidden_states, w1, w2, topk_weights, topk_ids, expert_map) -> torch.Tensor:
        if self.owns_dispatch:
            return expert_parallel.ep_fused_moe(
                hidden_states, w1, w2, topk_weights, topk_ids, expert_map, self._timing_slot
            )
        if not self._warmed_up:
            self._warm_up(hidden_states, w1, w2, topk_weights, topk_ids, expert_map)
        return fused_moe(hidden_states, w1, w2, topk_weights, topk_ids, expert_map=expert_map)

    def _warm_up(self, hidden_states, w1, w2, topk_weights, topk_ids, expert_map, **scales) -> None:
        """At a layer's first call (vLLM's memory-profiling run, before any CUDA graph), compile
        every kernel variant of calls up to vLLM's batch limit (``kernels.warm_up``): vLLM's own
        warm-up runs the largest batch and the captured sizes only, and a variant first met while
        serving stalled the server for ~1.7 s (Qwen3-30B-A3B on an H200, 769-2560-token steps).
        Once per layer shape: a model's layers share their kernels."""
        self._warmed_up = True
        if not hidden_states.is_cuda or torch.cuda.is_current_stream_capturing():
            return
        key = (tuple(w1.shape), tuple(w2.shape), w1.dtype, hidden_states.dtype, topk_weights.dtype, topk_ids.dtype,
               expert_map is None, hidden_states.device, self.moe_config.max_num_tokens)
        if key in _WARMED_UP:
            return
        _WARMED_UP.add(key)
        start = time.perf_counter()
        counts = warm_up(hidden_states, w1, w2, topk_weights, topk_ids, self.moe_config.max_num_tokens,
                         expert_map=expert_map, **scales)
        logger.info("kittens: compiled the kernels of %d to %d-token calls (%d variants, first at %s tokens) in %.1f s",
                    1, self.moe_config.max_num_tokens, len(counts), counts, time.perf_counter() - start)


class TimedMoEMethod:
    """What mok-serve adds to every vLLM MoE method, kittens or stock: per-layer timing (timing.py)
    and a neutral routing bias under dummy weights (``create_weights``). Mixed in ahead of the vLLM
    method class; ``__init__`` calls ``_init_timing`` first."""

    def create_weights(self, layer, *args, **kwargs) -> None:
        super().create_weights(layer, *args, **kwargs)
        # DeepSeek-V3's routing adds a learned per-expert bias (e_score_correction_bias, trained to
        # balance the load) to tiny router scores. vLLM's dummy weights fill it with the same
        # uniform +-1e-3 noise as every weight, which outweighs the dummy router's scores, so every
        # token picks the same top-k experts (expert-load imbalance 32 on the DeepSeek-V3 shape):
        # a load no trained model has, and not the cost `--load-format dummy` is meant to show. A
        # zero bias leaves the choice to the router's scores, which vary per token. Only the dummy
        # loader reads dummy_weight_value; checkpoints load the real bias.
        bias = getattr(layer, "e_score_correction_bias", None)
        if isinstance(bias, torch.nn.Parameter):
            bias.dummy_weight_value = 0.0

    def _init_timing(self) -> None:
        # None when off, and then apply() is the stock one.
        self._kittens_timing = timing.config_from_vllm()
        self._kittens_timing_slot: int | None = None

    def _stock_backend(self) -> str:
        """The name of the stock backend vLLM picked, for the per-layer stats."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        super().process_weights_after_loading(layer)
        if not self._kittens_timing.enabled or self.moe_kernel is None:
            return
        experts = self.moe_kernel.fused_experts
        backend = KITTENS if isinstance(experts, KittensExperts) else f"stock ({self._stock_backend()})"
        self._kittens_timing_slot = timing.register_layer(
            layer, self._kittens_timing, backend, type(experts).__name__
        )
        if isinstance(experts, KittensExperts):
            experts._kittens_timing_slot = self._kittens_timing_slot

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        slot = self._kittens_timing_slot
        if slot is None:
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        # The timer's copy of topk_ids feeds the experts and its copy of the output feeds the
        # rest of the model, so a compiler cannot move either timer off the work it brackets.
        topk_ids = timing.mark(topk_ids, slot, timing.BEGIN)
        out = super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        if isinstance(out, torch.Tensor):
            out = timing.mark(out, slot, timing.END)
        return out


class KittensFusedMoEMethod(TimedMoEMethod, UnquantizedFusedMoEMethod):
    """vLLM's unquantized MoE method, with kittens experts when ``--moe-backend kittens``.

    Registered out-of-tree in place of ``UnquantizedFusedMoEMethod``; any other backend value
    runs the stock method unchanged.
    """

    def __init__(self, moe: FusedMoEConfig):
        self._init_timing()
        if moe.moe_backend != KITTENS:
            super().__init__(moe)
            return
        deterministic.install()
        # The stock oracle rejects backend names it does not know, so skip it.
        FusedMoEMethodBase.__init__(self, moe)
        supported, reason = KittensExperts.is_supported_config(
            KittensExperts, moe, None, None, mk.FusedMoEActivationFormat.Standard
        )
        if not supported:
            raise ValueError(f"--moe-backend kittens cannot run this MoE layer: {reason}")
        # TRITON's weight handling is what kittens needs: vLLM's layout, contiguous, no padding.
        self.unquantized_backend = UnquantizedMoeBackend.TRITON
        self.experts_cls = KittensExperts
        self.supports_pre_processed_weights = True
        if current_platform.is_cuda():
            kernel = "Triton kernels"
        else:
            kernel = "C++ CPU kernel" if cpu_moe.available() else "torch reference"
        logger.info_once("kittens: unquantized MoE layers run mok-serve's kittens experts (%s)", kernel)

    def _stock_backend(self) -> str:
        return self.unquantized_backend.value
