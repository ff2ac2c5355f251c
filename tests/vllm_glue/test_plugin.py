"""The vLLM plugin, without starting a server: registration, CLI choice, config validation."""

import importlib.metadata

import pytest

vllm = pytest.importorskip("vllm")


def test_entry_point_registered():
    plugins = importlib.metadata.entry_points(group="vllm.general_plugins")
    assert any(ep.name == "kittens" and ep.value == "mok_serve.plugin:register" for ep in plugins)


def test_vllm_serve_parser_accepts_kittens():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from mok_serve.plugin import register

    register()
    parser = make_arg_parser(FlexibleArgumentParser())
    assert parser.parse_args(["--moe-backend", "kittens"]).moe_backend == "kittens"
    assert parser.parse_args(["--moe-backend", "triton"]).moe_backend == "triton"
    with pytest.raises(SystemExit):
        parser.parse_args(["--moe-backend", "kitten"])


def test_kernel_config_validates_kittens():
    from vllm.config.kernel import KernelConfig

    from mok_serve.plugin import register

    register()
    assert KernelConfig(moe_backend="Kittens").moe_backend == "kittens"
    with pytest.raises(Exception, match="kitten"):
        KernelConfig(moe_backend="kitten")


def test_mok_serve_defaults():
    from mok_serve.cli import build_parser
    from mok_serve.plugin import register

    register()
    args = build_parser().parse_args([])
    assert args.moe_backend == "kittens"
    assert args.host == "127.0.0.1"
    assert build_parser().parse_args(["--moe-backend", "auto"]).moe_backend == "auto"


BLOCK_FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


@pytest.mark.parametrize(
    "quantization, quant_cfg, expected",
    [
        ("awq", {"quant_method": "awq"}, "this model is quantized with 'awq'"),
        ("fp8", None, "this model is quantized with 'fp8' at load time"),
        ("fp8", {"quant_method": "fp8", "activation_scheme": "static"}, "'fp8' checkpoint with per-tensor scales"),
        ("fp8", {**BLOCK_FP8, "weight_block_size": [64, 64]}, "'fp8' checkpoint with weight_block_size [64, 64]"),
        ("fp8", {**BLOCK_FP8, "store_dtype": "mxfp4"}, "'fp8' checkpoint storing its experts as mxfp4"),
    ],
)
def test_unsupported_quantization_is_named_with_what_is_supported(quantization, quant_cfg, expected):
    from mok_serve.vllm.experts_fp8 import kittens_quantization_error

    error = kittens_quantization_error(quantization, quant_cfg)
    assert expected in error
    assert "block-FP8 checkpoints (quant_method 'fp8', weight_block_size [128, 128]" in error
    assert error.endswith("Serve it without --moe-backend kittens.")


def test_block_fp8_and_unquantized_are_accepted():
    from mok_serve.vllm.experts_fp8 import kittens_quantization_error

    assert kittens_quantization_error(None, None) is None
    assert kittens_quantization_error("fp8", BLOCK_FP8) is None


@pytest.fixture
def vllm_single_rank():
    """vLLM's config context and a one-rank gloo group, which building MoE weights needs."""
    import tempfile

    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with tempfile.TemporaryDirectory() as tmp, set_current_vllm_config(VllmConfig()):
        init_distributed_environment(1, 0, f"file://{tmp}/init", 0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield
        destroy_model_parallel()
        destroy_distributed_environment()


def _moe_config(moe_backend: str, E=4, H=256, I=128):
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import (
        FusedMoEConfig,
        FusedMoEParallelConfig,
        RoutingMethodType,
    )

    return FusedMoEConfig(
        num_experts=E,
        experts_per_token=2,
        hidden_dim=H,
        intermediate_size=I,
        num_local_experts=E,
        num_logical_experts=E,
        activation=MoEActivation.SILU,
        device="cpu",
        routing_method=RoutingMethodType.Renormalize,
        moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(),
        in_dtype=torch.bfloat16,
        moe_backend=moe_backend,
    )


def test_kittens_takes_over_vllms_block_fp8_moe_method(vllm_single_rank):
    """Fp8Config builds the kittens method; vLLM creates and processes the weights, the experts
    are KittensFp8Experts, and a call through vLLM's modular kernel is fused_moe_fp8_reference."""
    import torch
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    from mok_serve.kernels.fp8 import fused_moe_fp8_reference, quantize_fp8_blocks
    from mok_serve.plugin import register
    from mok_serve.vllm.experts_fp8 import KittensFp8Experts, KittensFp8MoEMethod

    register()
    assert vllm_fp8.Fp8MoEMethod is KittensFp8MoEMethod
    E, H, I = 4, 256, 128

    class Layer(torch.nn.Module):  # the attributes of vLLM's RoutedExperts the method reads
        moe_config = _moe_config("kittens", E, H, I)
        local_num_experts = global_num_experts = E
        expert_map = None
        activation = MoEActivation.SILU
        apply_router_weight_on_input = False

        def _expert_routing_tables(self):
            return None

    layer = Layer()
    method = KittensFp8MoEMethod(vllm_fp8.Fp8Config(weight_block_size=[128, 128]), layer)
    method.create_weights(layer, E, H, I, torch.bfloat16, weight_loader=None)
    g = torch.Generator().manual_seed(0)
    w13, w13_scale = quantize_fp8_blocks(torch.randn(E, 2 * I, H, generator=g) / 16)
    w2, w2_scale = quantize_fp8_blocks(torch.randn(E, H, I, generator=g) / 11)
    loaded = {"w13_weight": w13, "w2_weight": w2, "w13_weight_scale_inv": w13_scale, "w2_weight_scale_inv": w2_scale}
    for name, value in loaded.items():
        getattr(layer, name).data.copy_(value)
    method.process_weights_after_loading(layer)
    assert type(method.moe_kernel.fused_experts) is KittensFp8Experts

    x = torch.randn(5, H, generator=g).bfloat16()
    topk_weights = torch.rand(5, 2, generator=g)
    topk_ids = torch.randint(0, E, (5, 2), generator=g, dtype=torch.int32)
    out = method.apply(layer, x, topk_weights, topk_ids, None, None)
    assert torch.equal(out, fused_moe_fp8_reference(x, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids))


def test_stock_fp8_method_is_untouched_without_kittens():
    from vllm.model_executor.layers.quantization import fp8 as vllm_fp8

    from mok_serve.plugin import register
    from mok_serve.vllm.experts_fp8 import KittensFp8Experts

    register()
    layer = type("Layer", (), {"moe_config": _moe_config("auto")})()
    method = vllm_fp8.Fp8MoEMethod(vllm_fp8.Fp8Config(weight_block_size=[128, 128]), layer)
    assert method.experts_cls is not KittensFp8Experts


@pytest.mark.parametrize(
    "replicated,dp_tokens,expected",
    [(False, [3, 17], 17), (False, [3, 5000], 4096), (False, None, None), (True, [3, 17], None)],
    ids=["dp-step", "dp-clipped-to-limit", "no-dp-metadata", "replicated"],
)
def test_ep_calls_are_sized_by_the_steps_largest_dp_count(monkeypatch, replicated, dp_tokens, expected):
    # Under data parallelism vLLM's forward context holds every DP rank's token count; the glue passes
    # its maximum (within the workspace limit) as max_tokens_across_ranks, the same on every rank.
    import types

    import torch

    from mok_serve.vllm import expert_parallel

    dp = None if dp_tokens is None else types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(dp_tokens))
    monkeypatch.setattr(expert_parallel, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(expert_parallel, "get_forward_context", lambda: types.SimpleNamespace(dp_metadata=dp))
    ws = types.SimpleNamespace(replicated=replicated, max_tokens=4096)
    assert expert_parallel._max_tokens_across_ranks(ws) == expected
    monkeypatch.setattr(expert_parallel, "is_forward_context_available", lambda: False)
    assert expert_parallel._max_tokens_across_ranks(ws) is None


def test_every_moe_method_zeroes_the_dummy_routing_bias():
    # Both vLLM MoE methods mok-serve installs (unquantized and block FP8, kittens or stock) mark
    # a layer's e_score_correction_bias for a zero dummy value, and vLLM's dummy loader honours it.
    import torch
    from vllm.model_executor.model_loader.weight_utils import initialize_single_dummy_weight

    from mok_serve.vllm.experts import KittensFusedMoEMethod, TimedMoEMethod
    from mok_serve.vllm.experts_fp8 import KittensFp8MoEMethod

    for cls in (KittensFusedMoEMethod, KittensFp8MoEMethod):
        assert cls.create_weights is TimedMoEMethod.create_weights  # ahead of vLLM's own

    class Base:
        def create_weights(self, layer, *args, **kwargs):
            layer.e_score_correction_bias = torch.nn.Parameter(torch.empty(8))

    class Method(TimedMoEMethod, Base):
        pass

    layer = torch.nn.Module()
    Method().create_weights(layer, 8, 16, 32, torch.float32)
    initialize_single_dummy_weight(layer.e_score_correction_bias)
    assert torch.equal(layer.e_score_correction_bias.detach(), torch.zeros(8))
    plain = torch.nn.Parameter(torch.empty(8))
    initialize_single_dummy_weight(plain)
    assert plain.abs().max() > 0  # without the mark: vLLM's +-1e-3 noise


def test_ep_node_layouts_at_start_up(monkeypatch):
    from types import SimpleNamespace

    from mok_serve.vllm import expert_parallel as ep

    def config(dp=1, dp_local=1, nnodes_within_dp=1, tp=1, external_lb=False):
        return SimpleNamespace(data_parallel_size=dp, data_parallel_size_local=dp_local, nnodes=nnodes_within_dp,
                               nnodes_within_dp=nnodes_within_dp, tensor_parallel_size=tp, enable_expert_parallel=True,
                               enable_eplb=False, all2all_backend=ep.DEFAULT_ALL2ALL,
                               data_parallel_external_lb=external_lb)

    assert ep.ep_nodes_from_config(config(dp=8, dp_local=8)) == 1
    assert ep.ep_nodes_from_config(config(dp=16, dp_local=8)) == 2
    assert ep.ep_nodes_from_config(config(dp=2, dp_local=1, nnodes_within_dp=2, tp=8)) == 4
    assert ep.ep_nodes_from_config(config(tp=16, nnodes_within_dp=2)) == 2
    assert ep.ep_nodes_from_config(config(dp=8, dp_local=1, external_lb=True)) == 1  # the host check decides
    one = config(dp=2, dp_local=2, tp=2)
    ep.bind_all2all_backend("kittens", one, stock_bind=None)
    assert one.all2all_backend == "passthrough"
    # On the CPU an EP group across nodes runs the two-level exchange; on GPUs it is refused.
    ep.bind_all2all_backend("kittens", config(dp=16, dp_local=4, tp=2), stock_bind=None)
    monkeypatch.setattr(ep.current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(ep.current_platform, "is_cuda", lambda: True)
    with pytest.raises(ValueError, match=r"EP group of 32 ranks spans 4 nodes .*--moe-backend auto"):
        ep.bind_all2all_backend("kittens", config(dp=16, dp_local=4, tp=2), stock_bind=None)
    assert ep.node_size_of(["a"] * 4, multi_node=False) == 4
    assert ep.node_size_of(["a", "a", "b", "b"], multi_node=True) == 2
    assert ep.node_size_of(["a"] * 4, 2, multi_node=True) == 2
    with pytest.raises(RuntimeError, match=r"spans 2 nodes \(hosts a, b\)"):
        ep.node_size_of(["a", "a", "b", "b"], multi_node=False)
    with pytest.raises(RuntimeError, match=r"4 ranks spans 2 nodes \(MOK_EP_NODE_SIZE=2\)"):
        ep.node_size_of(["a"] * 4, 2, multi_node=False)
    with pytest.raises(RuntimeError, match="equal blocks of consecutive ranks"):
        ep.node_size_of(["a", "b", "a", "b"], multi_node=True)
    with pytest.raises(RuntimeError, match="does not divide"):
        ep.node_size_of(["a"] * 4, 3, multi_node=True)
