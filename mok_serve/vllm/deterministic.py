"""Deterministic serving: vLLM's batch-invariant mode with kittens' faster invariant kernels.

``mok-serve --deterministic`` (or ``VLLM_BATCH_INVARIANT=1 vllm serve MODEL --moe-backend kittens``)
runs vLLM's batch-invariant mode (``vllm/model_executor/determinism/batch_invariant.py``: invariant
attention, norms, softmax and sampling ops, NCCL and all-reduce pinned) with the kittens experts,
which need no invariant fallback, and puts three kittens kernels where that mode is slow or not
invariant:

- the dense layers (``mok_serve.kernels.invariant_linear``) where vLLM's invariant mode calls its
  own GEMM, which runs one fixed 128x128 tile for every row count, so a decode step's skinny
  matmuls use a fraction of each tile and, for narrow weights, a fraction of the SMs; and the
  block-FP8 dense layers (``invariant_linear_fp8``), which vLLM's invariant mode leaves to its usual
  block-FP8 GEMM (on Hopper a CUTLASS kernel whose batch invariance vLLM does not state; with
  ``MOK_DETERMINISTIC_FP8_GEMM=cutlass`` the layers where its source makes it invariant keep it);
- the RMSNorms (``mok_serve.kernels.invariant_rms_norm``, the residual add fused) where vLLM's
  invariant mode calls its own: its residual path runs vLLM's CUDA ``fused_add_rms_norm``, whose
  thread block (so its sum order) changes at 256 rows for hidden sizes above 2048 as its public
  source reads, which is not batch invariant, and it is unfused (2 launches where Inductor fuses one);
- the paged attention of vLLM's Triton attention backend (``mok_serve.kernels.invariant_attention``):
  vLLM's invariant mode runs its single-pass kernel, one program per query block and KV head (4
  programs for a Qwen3-30B-A3B decode step alone); kittens' cuts the keys into segments at fixed
  positions and spreads a small call's segments over programs. Calls it does not cover (ALiBi,
  sinks, soft-capping, quantized KV caches, prefix-LM ranges, chunked attention, fused output
  quantization) go to vLLM's kernel as before.

Only a server whose MoE backend is kittens changes: ``install`` runs when the first kittens MoE
layer is built (in each worker, before any forward pass or compilation), so stock servers with
``VLLM_BATCH_INVARIANT=1`` stay stock and comparable. ``adapt_vllm_start_up`` (at plugin
registration, before any config is built) keeps such a server's forward compiled, its RMSNorms
kittens', and captures CUDA graphs of prefill-sized steps.
"""

import os

import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform

import torch

from mok_serve.kernels import (
    invariant_attention,
    invariant_linear,
    invariant_linear_fp8,
    invariant_rms_norm,
    warm_up_invariant_kernels,
)

logger = init_logger("vllm.mok_serve")

# The modules that call vLLM's invariant dense layer by a name bound at their import: each gets
# kittens' in its place (the determinism module itself too, for callers that import it lazily).
LINEAR_CALLERS = (
    "vllm.model_executor.determinism.batch_invariant",
    "vllm.model_executor.layers.linear",
    "vllm.model_executor.layers.vocab_parallel_embedding",
)
NORM_CALLER = "vllm.model_executor.layers.layernorm"
FP8_LINEAR = "vllm.model_executor.layers.quantization.fp8"  # its Fp8LinearMethod
ATTENTION_CALLER = "vllm.v1.attention.backends.triton_attn"

_installed = False
INSTALLED = ("kittens: deterministic serving: dense layers (bf16 and block FP8), RMSNorms and Triton paged "
             "attention run mok-serve's batch-invariant kernels")


def kittens_linear_batch_invariant(input, weight, bias=None):
    """vLLM's ``linear_batch_invariant(input, weight, bias)`` contract (weight ``[N, K]``; a bias may
    be broadcastable to ``[N]``) through ``invariant_linear``."""
    if bias is not None:
        bias = bias.expand(weight.shape[0])
    return invariant_linear(input, weight, bias)


def kittens_rms_norm_batch_invariant(input, weight, eps=1e-6, residual=None):
    """vLLM's ``rms_norm_batch_invariant`` contract: the normalized ``input``, or with a residual
    ``(normalized input + residual, input + residual)``, through ``invariant_rms_norm``."""
    y, z = invariant_rms_norm(input, weight, eps, residual)
    return y if residual is None else (y, z)


def kittens_unified_attention(vllm_kernel, max_model_len: int):
    """A stand-in for vLLM's ``unified_attention`` (called with keywords by its Triton attention
    backend) that runs ``invariant_attention`` where it covers the call, else ``vllm_kernel``."""

    def unified_attention(**kw):
        window = kw.get("window_size") or (-1, -1)
        causal = kw.get("causal")
        covered = (
            causal is True
            and kw["k"].dtype == kw["q"].dtype
            and window[1] in (-1, 0)
            and not kw.get("softcap")
            and kw.get("q_descale") is None
            and all(kw.get(name) is None for name in (
                "alibi_slopes", "sinks", "output_scale", "qq_bias", "mm_prefix_range", "rswa_prefix_lens",
                "k_scale_cache", "v_scale_cache"))
            and kw.get("chunk_lookback", -1) in (-1, 0, None)
            and not kw.get("use_td", False)
            and getattr(kw.get("kv_quant_mode"), "name", "NONE") == "NONE"
            and kw["q"].shape[1] // kw["k"].shape[2] <= 16
        )
        if not covered:
            return vllm_kernel(**kw)
        return invariant_attention(
            kw["q"], kw["k"], kw["v"], kw["out"], kw["cu_seqlens_q"], kw["seqused_k"], kw["block_table"],
            max(max_model_len, kw["max_seqlen_k"]), kw["softmax_scale"], window[0] if window[0] >= 0 else None,
        )

    unified_attention.vllm_kernel = vllm_kernel
    return unified_attention


# Which GEMM a --deterministic server's block-FP8 dense layers run: ``kittens`` (the default,
# ``invariant_linear_fp8`` on every such layer) or ``cutlass``: vLLM's CUTLASS blockwise GEMM on the
# layers where it is batch invariant by construction (``cutlass_is_invariant``), kittens' on the rest.
# At 2048-8192 rows CUTLASS took 0.42-0.46x kittens' time (H100, a6f81c8,
# loadtest/results/deterministic/linear_sweep_fp8_a6f81c8_h100.md); at 1-64 rows the two are within
# 0.72-1.70x of each other (linear_bench_fp8_15e3cd9.md). Not the default until a GPU run checks its
# bits (loadtest/fp8_cutlass_bits.py) and its serving grid.
FP8_GEMM_VARIABLE = "MOK_DETERMINISTIC_FP8_GEMM"
FP8_GEMMS = ("kittens", "cutlass")


def fp8_gemm() -> str:
    """The block-FP8 dense GEMM chosen by ``MOK_DETERMINISTIC_FP8_GEMM`` (``kittens`` when unset)."""
    value = os.environ.get(FP8_GEMM_VARIABLE, "") or "kittens"
    if value not in FP8_GEMMS:
        raise ValueError(f"{FP8_GEMM_VARIABLE}={value!r}: expected one of {', '.join(FP8_GEMMS)}")
    return value


def cutlass_is_invariant(n: int, k: int, capability) -> bool:
    """Whether vLLM's block-FP8 CUTLASS GEMM gives a row of a ``[n, k]`` layer the same bits whatever
    the batch. On Hopper (sm90) vLLM's dispatch (``scaled_mm_blockwise_sm90_fp8_dispatch.cuh``) runs
    one 128 x 128 x 128 tile shape for every row count, each output tile summed over the whole K in
    order by one persistent program, where K <= 3N; where K > 3N it runs stream-K, whose partial sums
    over K ranges (set by the tile count, so by the batch) are reduced in arrival order. Its 128-column
    weight blocks need N and K in whole blocks. Other architectures dispatch other kernels: not
    covered."""
    return (capability is not None and (capability.major, capability.minor) == (9, 0)
            and n % 128 == 0 and k % 128 == 0 and k <= 3 * n)


def vllm_cutlass_linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                            bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ dequantized(weight).T (+ bias)`` through vLLM's per-token activation quantization
    (1 x 128 groups, row-local) and its CUTLASS blockwise GEMM, as vLLM's own CUTLASS path calls them."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.utils.fp8_utils import per_token_group_quant_fp8

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    # use_ue8m0 stated: left to vLLM, it asks for the device's capability, which torch.compile cannot
    # trace (a server's start failed there); power-of-two scales are DeepGEMM's format, not CUTLASS's
    xq, xs = per_token_group_quant_fp8(rows, 128, column_major_scales=True, use_ue8m0=False)
    out = ops.cutlass_scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.t(), out_dtype=x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def kittens_fp8_linear_apply(vllm_apply):
    """A stand-in for vLLM's ``Fp8LinearMethod.apply`` that runs block-FP8 (128x128) layers through
    ``invariant_linear_fp8`` (or, with ``MOK_DETERMINISTIC_FP8_GEMM=cutlass``, vLLM's CUTLASS GEMM
    on the layers where it is invariant: a choice per layer, from its shape, the same for every
    call), and every other FP8 layer through ``vllm_apply``."""
    use_cutlass = fp8_gemm() == "cutlass"
    capability = current_platform.get_device_capability() if use_cutlass else None

    def apply(self, layer, x, bias=None):
        if not (self.block_quant and list(self.weight_block_size) == [128, 128]):
            return vllm_apply(self, layer, x, bias)
        scale = getattr(layer, "weight_scale_inv", None)
        if scale is None or layer.weight.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32:
            # vLLM re-laid the weights out for another kernel (e8m0 scales, say): not ours to read.
            raise RuntimeError(
                f"kittens --deterministic: a block-FP8 layer holds {layer.weight.dtype} weights with "
                f"{None if scale is None else scale.dtype} scales; it runs e4m3 weights with fp32 "
                "weight_scale_inv (DeepSeek-V3's checkpoint format)")
        if use_cutlass and cutlass_is_invariant(*layer.weight.shape, capability):
            return vllm_cutlass_linear_fp8(x, layer.weight, scale, bias)
        return invariant_linear_fp8(x, layer.weight, scale, bias)

    apply.vllm_apply = vllm_apply
    return apply


def kittens_runs_the_dense_layers(config) -> bool:
    """Whether this server is in batch-invariant mode (``wanted``) with kittens' invariant GEMM on
    every dense layer and no vLLM matmul left that looks its tiles up by row count: the MoE backend
    is kittens, the model has experts (``install`` runs when the first kittens MoE layer is built),
    and the GPU is Hopper or newer, where vLLM's invariant mode overrides no aten matmul (on Ampere
    and Ada it puts its own tuned matmul under ``aten::mm``)."""
    from mok_serve.vllm import KITTENS

    model = config.model_config
    if not wanted() or config.kernel_config.moe_backend != KITTENS or model is None or not model.is_moe:
        return False
    capability = current_platform.get_device_capability()
    return capability is not None and capability.major >= 9


# CUDA-graph sizes a kittens --deterministic server captures beyond vLLM's default ceiling (512
# tokens on Hopper): vLLM's grid up to 512, then steps of 11-13.3% (the most padding a step pays) to
# 8192, vLLM's default --max-num-batched-tokens. A step past the largest captured size runs eagerly,
# and there every kittens kernel pays a Python Triton launch: an eager 8192-token FP8 Qwen3-30B-A3B
# step left 60 ms of its 223 ms wall time uncovered by GPU work, against stock's 17 (H100, 94ea732).
# With graphs to 8192 (and the q/k norms read in place) FP8 Qwen3-30B-A3B at c=256 went from 0.84x
# to 0.95x stock's output tok/s, for a start-up of 242 s against stock's 196 and 1.13 GiB of graph
# memory against 0.27 (H100, c61a76e, loadtest/results/deterministic/serve_fp8_c61a76e_h100).
EXTRA_GRAPH_SIZES = (*range(8, 256, 8), *range(256, 513, 16), 576, 640, 720, 816, 912, 1024, 1152, 1280, 1440,
                     1616, 1824, 2048, 2304, 2592, 2912, 3264, 3664, 4112, 4624, 5200, 5840, 6560, 7376, 8192)


def adapt_vllm_start_up() -> None:
    """Three start-up decisions of vLLM's batch-invariant mode, changed for a kittens server where
    kittens' kernels run the dense layers (``kittens_runs_the_dense_layers``):

    - vLLM turns on breakable CUDA graphs, and with them turns torch.compile off, for bf16 models
      whose dense shapes are in its tuned-tile table (Qwen3-30B-A3B is, by its
      ``intermediate_size``): its invariant matmul picks tiles by the row count at run time, which
      a compiled forward would freeze (vLLM #54243). Kittens' invariant GEMM is a custom op that
      picks its tiles at each call, eager or captured, so the server keeps vLLM's default compiled
      forward and piecewise CUDA graphs. Setting ``VLLM_USE_BREAKABLE_CUDAGRAPH`` still decides.
    - A compiled forward runs RMSNorm's native code, which Inductor turns into a reduction whose
      sum order follows the launch config it autotunes at start-up (so it may differ between two
      servers). The server enables vLLM's ``rms_norm`` custom op instead, whose CUDA path runs
      kittens' ``invariant_rms_norm`` (``install``), as in an eager server; ``-rms_norm`` in
      ``--compilation-config``'s ``custom_ops`` still decides.
    - vLLM captures CUDA graphs up to 512 tokens, so a step with a prefill in it often runs eagerly,
      host-bound with kittens' Triton launches. The server also captures ``EXTRA_GRAPH_SIZES``
      (those above vLLM's ceiling, up to ``--max-num-batched-tokens``). Setting
      ``cudagraph_capture_sizes`` or ``max_cudagraph_capture_size`` still decides."""
    from vllm.config import VllmConfig
    from vllm.config.kernel import KernelConfig

    stock_breakable = VllmConfig._uses_breakable_cudagraph_for_batch_invariance
    stock_defaults = KernelConfig.set_platform_defaults
    stock_graph_sizes = VllmConfig._set_cudagraph_sizes

    def uses_breakable_cudagraph_for_batch_invariance(self) -> bool:
        return not kittens_runs_the_dense_layers(self) and stock_breakable(self)

    def set_platform_defaults(self, vllm_config) -> None:
        stock_defaults(self, vllm_config)
        ops = vllm_config.compilation_config.custom_ops
        if kittens_runs_the_dense_layers(vllm_config) and not {"+rms_norm", "-rms_norm"} & set(ops):
            ops.append("+rms_norm")

    def set_cudagraph_sizes(self) -> None:
        compilation = self.compilation_config
        chosen = compilation.cudagraph_capture_sizes is not None or compilation.max_cudagraph_capture_size is not None
        stock_graph_sizes(self)
        sizes = compilation.cudagraph_capture_sizes
        if chosen or not sizes or not kittens_runs_the_dense_layers(self):
            return  # the user's sizes, or no graphs at all
        limit = self.scheduler_config.max_num_batched_tokens
        extra = [n for n in EXTRA_GRAPH_SIZES if sizes[-1] < n <= limit]
        if extra:
            compilation.cudagraph_capture_sizes = sizes + extra
            compilation.max_cudagraph_capture_size = extra[-1]
            logger.info_once("kittens: deterministic serving captures CUDA graphs up to %d tokens (%d sizes; vLLM's "
                             "default stops at %d)", extra[-1], len(sizes) + len(extra), sizes[-1])

    uses_breakable_cudagraph_for_batch_invariance.vllm_method = stock_breakable
    set_platform_defaults.vllm_method = stock_defaults
    set_cudagraph_sizes.vllm_method = stock_graph_sizes
    VllmConfig._uses_breakable_cudagraph_for_batch_invariance = uses_breakable_cudagraph_for_batch_invariance
    KernelConfig.set_platform_defaults = set_platform_defaults
    VllmConfig._set_cudagraph_sizes = set_cudagraph_sizes


def wanted() -> bool:
    """Whether this process serves in batch-invariant mode on CUDA, where kittens' kernels apply."""
    return bool(envs.VLLM_BATCH_INVARIANT) and current_platform.is_cuda()


def install() -> bool:
    """Put kittens' invariant dense layer in vLLM's invariant mode, once per process, when
    ``wanted()``; returns whether it is installed."""
    global _installed
    if _installed or not wanted():
        return _installed
    import importlib

    from vllm.config import get_current_vllm_config_or_none

    for name in LINEAR_CALLERS:
        module = importlib.import_module(name)
        if not hasattr(module, "linear_batch_invariant"):
            raise RuntimeError(f"kittens: {name} has no linear_batch_invariant (vLLM version not supported)")
        module.linear_batch_invariant = kittens_linear_batch_invariant
    norm = importlib.import_module(NORM_CALLER)
    if not hasattr(norm, "rms_norm_batch_invariant"):
        raise RuntimeError(f"kittens: {NORM_CALLER} has no rms_norm_batch_invariant (vLLM version not supported)")
    norm.rms_norm_batch_invariant = kittens_rms_norm_batch_invariant
    attention = importlib.import_module(ATTENTION_CALLER)
    if not hasattr(attention, "unified_attention"):
        raise RuntimeError(f"kittens: {ATTENTION_CALLER} has no unified_attention (vLLM version not supported)")
    config = get_current_vllm_config_or_none()
    max_model_len = config.model_config.max_model_len if config is not None and config.model_config else 0
    attention.unified_attention = kittens_unified_attention(attention.unified_attention, max_model_len)
    fp8 = importlib.import_module(FP8_LINEAR)
    fp8.Fp8LinearMethod.apply = kittens_fp8_linear_apply(fp8.Fp8LinearMethod.apply)
    # Each dense layer's and attention layer's first call compiles the kernel variants of every
    # batch the scheduler can form, as the kittens experts' first call does (experts.py).
    max_tokens = config.scheduler_config.max_num_batched_tokens if config is not None else 0
    warm_up_invariant_kernels(max_tokens or 0, report=log_warm_up)
    _installed = True
    logger.info_once(INSTALLED)
    logger.info_once("kittens: block-FP8 dense layers run %s", "vLLM's CUTLASS GEMM where it is batch invariant "
                     "(K <= 3N on Hopper), kittens' elsewhere" if fp8_gemm() == "cutlass" else "kittens' GEMM")
    return True


def log_warm_up(what: str, variants: list, seconds: float) -> None:
    """Log one first-call warm-up of an invariant kernel (so a compile seen later while serving can
    be told apart from one the warm-up should have done)."""
    logger.info("kittens: compiled %s for its calls (%d variants: %s) in %.1f s", what, len(variants), variants,
                seconds)
