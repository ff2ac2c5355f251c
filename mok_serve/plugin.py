"""The ``vllm.general_plugins`` entry point: makes ``--moe-backend kittens`` a vLLM option.

vLLM calls ``register()`` in every process (API server, engine core, workers) before it builds
its CLI and configs. Without ``--moe-backend kittens`` nothing in vLLM behaves differently.
"""

import typing

_registered = False


def _add_moe_backend_choice(name: str) -> None:
    """Widen ``KernelConfig.moe_backend``'s Literal type, which both pydantic validation and
    the ``--moe-backend`` CLI choices are computed from."""
    import pydantic
    from vllm.config import kernel as kernel_config
    from vllm.engine import arg_utils

    cls = kernel_config.KernelConfig
    choices = typing.get_args(cls.__dataclass_fields__["moe_backend"].type)
    if name in choices:
        return
    widened = typing.Literal[(*choices, name)]
    cls.__dataclass_fields__["moe_backend"].type = widened
    cls.__annotations__["moe_backend"] = widened
    pydantic.dataclasses.rebuild_dataclass(cls, force=True)
    arg_utils._compute_kwargs.cache_clear()


def _reject_unsupported_quantization() -> None:
    """Fail at start-up, in the API server, when kittens is asked to run a quantization scheme
    it has no experts for (anything but unquantized and 128x128 block FP8)."""
    from vllm.config.kernel import KernelConfig

    from mok_serve.vllm import KITTENS
    from mok_serve.vllm.experts_fp8 import kittens_quantization_error

    stock_set_platform_defaults = KernelConfig.set_platform_defaults

    def set_platform_defaults(self, vllm_config):
        stock_set_platform_defaults(self, vllm_config)
        model_config = vllm_config.model_config
        if self.moe_backend != KITTENS or model_config is None:
            return
        error = kittens_quantization_error(
            model_config.quantization, model_config.model_arch_config.quantization_config
        )
        if error:
            raise ValueError(error)

    KernelConfig.set_platform_defaults = set_platform_defaults


def _bind_all2all_for_kittens() -> None:
    """Under expert parallelism kittens dispatches and combines itself (expert_parallel.py)."""
    from vllm.config import kernel as kernel_config

    from mok_serve.vllm.expert_parallel import bind_all2all_backend

    stock_bind = kernel_config.bind_passthrough_all2all_backend

    def bind(moe_backend, parallel_config):
        bind_all2all_backend(moe_backend, parallel_config, stock_bind)

    kernel_config.bind_passthrough_all2all_backend = bind


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.quantization import fp8

    from mok_serve.vllm import KITTENS
    from mok_serve.vllm.experts import KittensFusedMoEMethod
    from mok_serve.vllm import deterministic, random_weights
    from mok_serve.vllm.experts_fp8 import KittensFp8MoEMethod

    _add_moe_backend_choice(KITTENS)
    random_weights.register()
    _reject_unsupported_quantization()
    _bind_all2all_for_kittens()
    deterministic.adapt_vllm_start_up()
    UnquantizedFusedMoEMethod.register_oot(KittensFusedMoEMethod)
    # Fp8MoEMethod is no custom op (no out-of-tree slot): Fp8Config.get_quant_method looks the
    # name up in its module at each call, so binding the subclass there makes it the FP8 method.
    fp8.Fp8MoEMethod = KittensFp8MoEMethod
    _registered = True
