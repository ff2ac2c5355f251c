"""Deterministic serving's glue without a GPU: kittens' dense layer put where vLLM's batch-invariant
mode calls its own (only in that mode, only on CUDA), the --deterministic flag, and the
kittens-random weights."""

import subprocess
import sys
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from mok_serve.vllm import deterministic, random_weights  # noqa: E402


def test_install_puts_kittens_linear_where_vllm_calls_its_own(monkeypatch):
    import importlib

    monkeypatch.setattr(deterministic, "wanted", lambda: True)
    monkeypatch.setattr(deterministic, "_installed", False)
    modules = [importlib.import_module(name) for name in deterministic.LINEAR_CALLERS]
    norm = importlib.import_module(deterministic.NORM_CALLER)
    attention = importlib.import_module(deterministic.ATTENTION_CALLER)
    for m in modules:  # restored after the test
        monkeypatch.setattr(m, "linear_batch_invariant", m.linear_batch_invariant)
    monkeypatch.setattr(norm, "rms_norm_batch_invariant", norm.rms_norm_batch_invariant)
    monkeypatch.setattr(attention, "unified_attention", attention.unified_attention)
    fp8 = importlib.import_module(deterministic.FP8_LINEAR)
    monkeypatch.setattr(fp8.Fp8LinearMethod, "apply", fp8.Fp8LinearMethod.apply)
    vllm_fp8_apply = fp8.Fp8LinearMethod.apply
    vllm_attention = attention.unified_attention
    from vllm.config import SchedulerConfig, VllmConfig, set_current_vllm_config

    from mok_serve import kernels

    monkeypatch.setattr(kernels, "_invariant_warm_up_rows", 0)
    monkeypatch.setattr(kernels, "_invariant_warm_up_report", None)
    scheduler = SchedulerConfig(max_num_batched_tokens=1234, max_model_len=1234, is_encoder_decoder=False)
    with set_current_vllm_config(VllmConfig(scheduler_config=scheduler)):
        assert deterministic.install()
    # The dense and attention kernels' first calls compile every batch the scheduler can form.
    assert kernels._invariant_warm_up_rows == 1234
    assert kernels._invariant_warm_up_report is deterministic.log_warm_up  # each warm-up in the server's log
    assert all(m.linear_batch_invariant is deterministic.kittens_linear_batch_invariant for m in modules)
    assert norm.rms_norm_batch_invariant is deterministic.kittens_rms_norm_batch_invariant
    assert attention.unified_attention.vllm_kernel is vllm_attention
    assert fp8.Fp8LinearMethod.apply.vllm_apply is vllm_fp8_apply
    # vLLM's contract: weight [N, K], a bias broadcastable to [N].
    x, w = torch.randn(3, 5, 64), torch.randn(7, 64)
    out = deterministic.kittens_linear_batch_invariant(x, w, torch.tensor([0.5]))
    assert out.shape == (3, 5, 7)
    assert torch.allclose(out, x @ w.t() + 0.5, atol=1e-4)


def test_rms_norm_stand_in_keeps_vllms_contract():
    x, r, w = torch.randn(5, 3, 32), torch.randn(5, 3, 32), torch.rand(32) + 0.5
    y = deterministic.kittens_rms_norm_batch_invariant(x, w, 1e-6)
    assert isinstance(y, torch.Tensor) and y.shape == x.shape
    y2, z2 = deterministic.kittens_rms_norm_batch_invariant(x, w, 1e-6, residual=r)
    assert torch.equal(z2, x + r)
    zd = (x + r).double()
    assert torch.allclose(y2.double(), zd * torch.rsqrt((zd * zd).mean(-1, keepdim=True) + 1e-6) * w.double(), atol=1e-5)


def test_nothing_changes_outside_batch_invariant_mode_or_off_cuda(monkeypatch):
    from vllm.model_executor.layers import linear

    before = linear.linear_batch_invariant
    monkeypatch.setattr(deterministic, "_installed", False)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # on, but this machine is no CUDA one
    assert not deterministic.wanted() and not deterministic.install()
    assert linear.linear_batch_invariant is before


class _Platform:
    def __init__(self, cuda: bool, major: int):
        self.cuda, self.major = cuda, major

    def is_cuda(self):
        return self.cuda

    def get_device_capability(self):
        return types.SimpleNamespace(major=self.major, minor=0)


def _config(backend: str, moe: bool = True, custom_ops=("none",)):
    return types.SimpleNamespace(kernel_config=types.SimpleNamespace(moe_backend=backend),
                                 model_config=types.SimpleNamespace(is_moe=moe),
                                 compilation_config=types.SimpleNamespace(custom_ops=list(custom_ops)))


def test_a_kittens_moe_server_on_hopper_keeps_its_forward_compiled_and_its_norms(monkeypatch):
    """vLLM's invariant mode would turn breakable CUDA graphs on (torch.compile off) for bf16 models in
    its tuned-tile table, and a compiled forward runs Inductor's RMSNorm; where kittens' GEMM runs
    every dense layer the graphs stay unbroken and the rms_norm custom op (kittens' kernel) is on,
    elsewhere vLLM decides as before."""
    from vllm.config import VllmConfig
    from vllm.config.kernel import KernelConfig

    from mok_serve import plugin

    plugin.register()
    assert hasattr(VllmConfig._uses_breakable_cudagraph_for_batch_invariance, "vllm_method")
    assert hasattr(KernelConfig.set_platform_defaults, "vllm_method")
    monkeypatch.setattr(VllmConfig, "_uses_breakable_cudagraph_for_batch_invariance", lambda self: True)  # vLLM: on
    monkeypatch.setattr(KernelConfig, "set_platform_defaults", lambda self, vllm_config: None)
    monkeypatch.setattr(VllmConfig, "_set_cudagraph_sizes", VllmConfig._set_cudagraph_sizes)  # restored after
    deterministic.adapt_vllm_start_up()
    uses_breakable = VllmConfig._uses_breakable_cudagraph_for_batch_invariance
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    for platform, config, kittens_dense in [
        (_Platform(True, 9), _config("kittens"), True),
        (_Platform(True, 10), _config("kittens"), True),
        (_Platform(True, 9), _config("triton"), False),  # a stock server stays stock
        (_Platform(True, 9), _config("kittens", moe=False), False),  # no experts: install() never runs
        (_Platform(True, 8), _config("kittens"), False),  # Ampere and Ada: vLLM's matmul under aten::mm
        (_Platform(False, 9), _config("kittens"), False),
    ]:
        monkeypatch.setattr(deterministic, "current_platform", platform)
        assert deterministic.kittens_runs_the_dense_layers(config) is kittens_dense
        assert uses_breakable(config) is not kittens_dense
        KernelConfig.set_platform_defaults(None, config)
        KernelConfig.set_platform_defaults(None, config)  # vLLM may call it twice
        assert config.compilation_config.custom_ops == (["none", "+rms_norm"] if kittens_dense else ["none"])
    monkeypatch.setattr(deterministic, "current_platform", _Platform(True, 9))
    user_off = _config("kittens", custom_ops=("none", "-rms_norm"))
    KernelConfig.set_platform_defaults(None, user_off)
    assert user_off.compilation_config.custom_ops == ["none", "-rms_norm"]  # the user's choice stands
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    plain = _config("kittens")
    KernelConfig.set_platform_defaults(None, plain)
    assert plain.compilation_config.custom_ops == ["none"]  # outside invariant mode nothing changes


def _graph_config(backend: str, sizes=None, max_size=None, max_tokens=8192):
    config = _config(backend)
    config.compilation_config.cudagraph_capture_sizes = sizes
    config.compilation_config.max_cudagraph_capture_size = max_size
    config.scheduler_config = types.SimpleNamespace(max_num_batched_tokens=max_tokens)
    return config


def test_a_kittens_deterministic_server_captures_prefill_sized_graphs(monkeypatch):
    """Past vLLM's 512-token ceiling a step runs eagerly, host-bound with kittens' Triton launches:
    a kittens server in invariant mode also captures the sizes of EXTRA_GRAPH_SIZES above vLLM's
    ceiling, up to the batched-token budget; sizes the user chose, stock servers, servers outside
    invariant mode and servers without graphs keep vLLM's."""
    from vllm.config import VllmConfig

    from mok_serve import plugin

    plugin.register()
    assert hasattr(VllmConfig._set_cudagraph_sizes, "vllm_method")
    default = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]

    def vllm_sizes(self):  # vLLM's default grid (or the user's list), as its _set_cudagraph_sizes leaves it
        compilation = self.compilation_config
        if compilation.cudagraph_capture_sizes is None:
            top = compilation.max_cudagraph_capture_size or getattr(self, "vllm_ceiling", 512)  # (max_num_seqs * 2)
            compilation.cudagraph_capture_sizes = [n for n in default if n <= top]
        compilation.max_cudagraph_capture_size = (compilation.cudagraph_capture_sizes or [0])[-1]

    monkeypatch.setattr(VllmConfig, "_set_cudagraph_sizes", vllm_sizes)
    deterministic.adapt_vllm_start_up()
    set_sizes = VllmConfig._set_cudagraph_sizes
    monkeypatch.setattr(deterministic, "current_platform", _Platform(True, 9))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")

    def sizes_of(config):
        set_sizes(config)
        compilation = config.compilation_config
        assert compilation.cudagraph_capture_sizes[-1:] == [compilation.max_cudagraph_capture_size] or \
            compilation.cudagraph_capture_sizes == []
        return compilation.cudagraph_capture_sizes

    extended = sizes_of(_graph_config("kittens"))
    assert extended[:len(default)] == default and extended == sorted(set(extended))
    assert extended[len(default):] == [576, 640, 720, 816, 912, 1024, 1152, 1280, 1440, 1616, 1824, 2048, 2304, 2592,
                                      2912, 3264, 3664, 4112, 4624, 5200, 5840, 6560, 7376, 8192]
    assert all(b <= a * 1.134 for a, b in zip(extended[len(default) - 1:], extended[len(default):]))  # padding
    assert sizes_of(_graph_config("kittens", max_tokens=1000))[-1] == 912  # within the batched-token budget
    few_seqs = _graph_config("kittens")
    few_seqs.vllm_ceiling = 128  # vLLM's ceiling at --max-num-seqs 64: its grid continues to 512, then the steps
    assert sizes_of(few_seqs) == extended
    assert sizes_of(_graph_config("kittens", max_size=256))[-1] == 256  # the user's ceiling
    assert sizes_of(_graph_config("kittens", sizes=[1, 8]))[-1] == 8  # the user's sizes
    assert sizes_of(_graph_config("kittens", sizes=[])) == []  # no graphs
    assert sizes_of(_graph_config("triton")) == default  # a stock server stays stock
    monkeypatch.delenv("VLLM_BATCH_INVARIANT")
    assert sizes_of(_graph_config("kittens")) == default  # outside invariant mode nothing changes


def test_deterministic_flag_is_refused_without_a_gpu():
    run = subprocess.run([sys.executable, "-m", "mok_serve.cli", "--deterministic"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode != 0
    assert "--deterministic needs a CUDA GPU" in run.stderr


def test_deterministic_flag_contradicting_the_environment_is_refused(monkeypatch):
    from mok_serve import cli

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    with pytest.raises(SystemExit, match="contradicts VLLM_BATCH_INVARIANT=0"):
        cli._deterministic()


def test_random_weights_keep_trained_scales_and_are_the_same_everywhere():
    w13 = torch.empty(4, 96, 256, dtype=torch.bfloat16)
    random_weights.fill(w13, "model.layers.3.mlp.experts.w13_weight")
    assert abs(w13.float().std().item() * 256**0.5 - 1) < 0.05
    again = torch.empty_like(w13)
    random_weights.fill(again, "model.layers.3.mlp.experts.w13_weight")
    other = torch.empty_like(w13)
    random_weights.fill(other, "model.layers.4.mlp.experts.w13_weight")
    assert torch.equal(w13, again) and not torch.equal(w13, other)
    norm, bias = torch.empty(8), torch.empty(8)
    random_weights.fill(norm, "model.layers.0.post_attention_layernorm.weight")
    random_weights.fill(bias, "model.layers.0.self_attn.qkv_proj.bias")
    assert torch.equal(norm, torch.ones(8)) and torch.equal(bias, torch.zeros(8))
    routing_bias = torch.empty(8)
    routing_bias.dummy_weight_value = 0.0  # what TimedMoEMethod sets on DeepSeek-V3's routing bias
    random_weights.fill(routing_bias, "model.layers.3.mlp.gate.e_score_correction_bias")
    assert torch.equal(routing_bias, torch.zeros(8))
    q = torch.empty(256, 512, dtype=torch.float8_e4m3fn)
    scale = torch.empty(2, 4)
    random_weights.fill(q, "model.layers.0.self_attn.o_proj.weight")
    random_weights.fill(scale, "model.layers.0.self_attn.o_proj.weight_scale_inv")
    assert abs(q.float().std().item() - 1) < 0.05 and torch.equal(scale, torch.full((2, 4), 512**-0.5))
    with pytest.raises(ValueError, match="block-FP8 scales only"):
        random_weights.fill(torch.empty(1), "model.layers.0.self_attn.o_proj.weight_scale")


def test_random_weights_load_format_is_registered():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    from mok_serve.plugin import register

    register()
    assert isinstance(get_model_loader(LoadConfig(load_format="kittens-random")), random_weights.ScaledRandomLoader)


def test_attention_stand_in_runs_kittens_where_it_covers_the_call_and_vllm_elsewhere():
    from attention_test_utils import Batch

    from mok_serve.kernels import attention_reference

    calls = []
    stand_in = deterministic.kittens_unified_attention(lambda **kw: calls.append(kw) or kw["out"], max_model_len=512)
    b = Batch.random([(1, 90), (4, 40)], 4, 2, 32, seed=1)

    def kwargs(**changes):
        kw = dict(q=b.q, k=b.k, v=b.v, out=torch.zeros_like(b.q), cu_seqlens_q=b.cu_q, max_seqlen_q=4,
                  seqused_k=b.seq_lens, max_seqlen_k=90, softmax_scale=b.scale, causal=True, window_size=(-1, -1),
                  block_table=b.block_table, softcap=0, q_descale=None, k_descale=None, v_descale=None,
                  alibi_slopes=None, sinks=None, output_scale=None)
        kw.update(changes)
        return kw

    out = stand_in(**kwargs())
    ref = attention_reference(b.q, b.k, b.v, b.cu_q, b.seq_lens, b.block_table, b.scale)
    assert not calls and torch.equal(out, ref)
    windowed = stand_in(**kwargs(window_size=(9, 0)))
    assert torch.equal(windowed, attention_reference(b.q, b.k, b.v, b.cu_q, b.seq_lens, b.block_table, b.scale, 9))
    for change in (dict(softcap=30.0), dict(sinks=torch.zeros(4)), dict(alibi_slopes=torch.zeros(4)),
                   dict(window_size=(9, 9)), dict(causal=False)):
        stand_in(**kwargs(**change))
    assert len(calls) == 5


def test_fp8_linear_stand_in_runs_block_fp8_layers_through_kittens():
    from types import SimpleNamespace

    from mok_serve.kernels import invariant_linear_fp8_reference
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    calls = []
    apply = deterministic.kittens_fp8_linear_apply(lambda self, layer, x, bias=None: calls.append(layer) or "vllm")
    wq, ws = quantize_fp8_blocks(torch.randn(256, 384) / 20)
    layer = SimpleNamespace(weight=wq, weight_scale_inv=ws)
    block = SimpleNamespace(block_quant=True, weight_block_size=[128, 128])
    x = torch.randn(3, 384).to(torch.bfloat16)
    assert torch.equal(apply(block, layer, x), invariant_linear_fp8_reference(x, wq, ws))
    assert not calls
    # Per-tensor FP8 and other block shapes stay vLLM's.
    for method in (SimpleNamespace(block_quant=False, weight_block_size=None),
                   SimpleNamespace(block_quant=True, weight_block_size=[64, 64])):
        assert apply(method, layer, x) == "vllm"
    # Weights laid out for another kernel are refused, naming what was found.
    with pytest.raises(RuntimeError, match="e8m0|float8_e8m0fnu"):
        apply(block, SimpleNamespace(weight=wq, weight_scale_inv=ws.to(torch.float8_e8m0fnu)), x)


def test_cutlass_counts_as_invariant_only_where_vllm_runs_its_persistent_tile_on_hopper():
    from types import SimpleNamespace

    hopper, blackwell = SimpleNamespace(major=9, minor=0), SimpleNamespace(major=10, minor=0)
    # DeepSeek-V3's dense layers [N, K]: the fused q_a/kv_a projection has K > 3N (stream-K) and
    # N = 2112, not whole 128-column blocks; the rest run the persistent tile.
    persistent = [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (36864, 7168),
                  (7168, 18432), (5120, 2048), (2048, 4096)]
    assert all(deterministic.cutlass_is_invariant(n, k, hopper) for n, k in persistent)
    assert not deterministic.cutlass_is_invariant(2112, 7168, hopper)
    assert not deterministic.cutlass_is_invariant(1024, 3200, hopper)  # K > 3N, whole blocks
    assert deterministic.cutlass_is_invariant(1024, 3072, hopper)  # K = 3N
    assert not deterministic.cutlass_is_invariant(7168, 16384, blackwell)
    assert not deterministic.cutlass_is_invariant(7168, 16384, None)


def test_fp8_gemm_choice_sends_invariant_cutlass_layers_to_cutlass_and_the_rest_to_kittens(monkeypatch):
    from types import SimpleNamespace

    from mok_serve.kernels import invariant_linear_fp8_reference
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    cutlass_calls = []
    monkeypatch.setattr(deterministic, "vllm_cutlass_linear_fp8",
                        lambda x, w, ws, bias: cutlass_calls.append(tuple(w.shape)) or "cutlass")
    monkeypatch.setattr(deterministic.current_platform, "get_device_capability",
                        lambda *a, **k: SimpleNamespace(major=9, minor=0))
    block = SimpleNamespace(block_quant=True, weight_block_size=[128, 128])
    square = quantize_fp8_blocks(torch.randn(256, 384) / 20)  # K <= 3N: CUTLASS's persistent tile
    tall_k = quantize_fp8_blocks(torch.randn(128, 512) / 20)  # K > 3N: stream-K
    x_square, x_tall = torch.randn(3, 384).to(torch.bfloat16), torch.randn(3, 512).to(torch.bfloat16)

    def vllm_apply(self, layer, x, bias=None):
        raise AssertionError("a block-FP8 layer went to vLLM's apply")

    monkeypatch.setenv(deterministic.FP8_GEMM_VARIABLE, "cutlass")
    apply = deterministic.kittens_fp8_linear_apply(vllm_apply)
    assert apply(block, SimpleNamespace(weight=square[0], weight_scale_inv=square[1]), x_square) == "cutlass"
    out = apply(block, SimpleNamespace(weight=tall_k[0], weight_scale_inv=tall_k[1]), x_tall)
    assert torch.equal(out, invariant_linear_fp8_reference(x_tall, *tall_k))
    assert cutlass_calls == [(256, 384)]

    for unset in ("", "kittens"):  # the default: kittens' GEMM on every block-FP8 layer
        monkeypatch.setenv(deterministic.FP8_GEMM_VARIABLE, unset)
        apply = deterministic.kittens_fp8_linear_apply(vllm_apply)
        out = apply(block, SimpleNamespace(weight=square[0], weight_scale_inv=square[1]), x_square)
        assert torch.equal(out, invariant_linear_fp8_reference(x_square, *square))
    assert cutlass_calls == [(256, 384)]

    monkeypatch.setenv(deterministic.FP8_GEMM_VARIABLE, "cublas")
    with pytest.raises(ValueError, match="MOK_DETERMINISTIC_FP8_GEMM='cublas'.*kittens, cutlass"):
        deterministic.kittens_fp8_linear_apply(vllm_apply)


def test_cutlass_path_states_the_scale_format_instead_of_asking_the_device(monkeypatch):
    """vLLM's activation quantization picks power-of-two scales from the device when ``use_ue8m0``
    is unset, a capability query torch.compile cannot trace: a DeepSeek-V3 FP8 server's start
    failed there (0b850cd). CUTLASS takes plain fp32 scales, so the call says so."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils import fp8_utils

    seen = {}

    def quantize(rows, group, **kwargs):
        seen.update(kwargs, group=group, rows=tuple(rows.shape))
        return rows, torch.ones(rows.shape[0], rows.shape[1] // group)

    monkeypatch.setattr(fp8_utils, "per_token_group_quant_fp8", quantize)
    monkeypatch.setattr(ops, "cutlass_scaled_mm", lambda a, b, scale_a, scale_b, out_dtype: a @ b)
    x, w = torch.randn(2, 3, 256), torch.randn(128, 256)
    out = deterministic.vllm_cutlass_linear_fp8(x, w, torch.ones(1, 2), torch.ones(128))
    assert seen == dict(group=128, rows=(6, 256), column_major_scales=True, use_ue8m0=False)
    torch.testing.assert_close(out, (x.reshape(6, 256) @ w.t() + 1).reshape(2, 3, 128))
