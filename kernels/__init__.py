"""mok_serve.kernels: the kittens MoE kernels. Imports with torch alone (triton only on CUDA).

``fused_moe`` is one torch custom op, ``torch.ops.mok_serve.fused_moe``, so that Dynamo (which
vLLM uses to compile models) treats it as a single opaque call: on CUDA tensors it runs the
Triton kernels, on CPU tensors the C++ kernel of ``cpu/moe.py`` (registered for the CPU dispatch
key once built: the dispatcher then calls it without Python), elsewhere the torch reference.
All compute the function documented in ``reference.py``. ``fused_moe_fp8``
(``torch.ops.mok_serve.fused_moe_fp8``) is the same for block-scaled FP8 experts (``fp8.py``;
Triton kernels in ``cuda/moe_fp8.py``). ``invariant_linear`` (``torch.ops.mok_serve.invariant_linear``)
is the batch-invariant dense layer a deterministic server runs its other layers with (``linear.py``;
Triton kernels in ``cuda/linear.py``; ``invariant_linear_fp8`` the same for block-FP8 weights), ``invariant_rms_norm`` (``torch.ops.mok_serve.invariant_rms_norm``)
its norms with the residual add (``norm.py``; ``cuda/norm.py``), ``invariant_attention`` its paged attention (``attention.py``;
``cuda/attention.py``; called where vLLM calls its attention kernel, outside compiled graphs, so a
plain function).
"""

import time

import torch

from .attention import attention_reference
from .fp8 import BLOCK_SHAPE, as_block_shape, fused_moe_fp8_reference
from .linear import invariant_linear_fp8_reference, invariant_linear_reference
from .norm import rms_norm_reference
from .reference import check_fused_moe_args, fused_moe_reference
from .routing import grouped_sigmoid_topk, softmax_topk

__all__ = [
    "attention_reference",
    "check_fused_moe_args",
    "fused_moe",
    "fused_moe_fp8",
    "fused_moe_fp8_reference",
    "fused_moe_reference",
    "grouped_sigmoid_topk",
    "invariant_attention",
    "invariant_linear",
    "invariant_linear_fp8",
    "invariant_linear_fp8_reference",
    "invariant_linear_reference",
    "invariant_rms_norm",
    "rms_norm_reference",
    "softmax_topk",
    "warm_up",
    "warm_up_attention",
    "warm_up_invariant_kernels",
    "warm_up_linear",
    "warm_up_linear_rows",
    "warm_up_token_counts",
]


# Defined with the low-level torch.library API: the torch.library.custom_op wrapper costs tens of
# microseconds per call, as much as the whole CPU kernel at decode sizes.
_lib = torch.library.Library("mok_serve", "FRAGMENT")


# Only the installed package defines the ops. Where the checkout's root is on sys.path (`python -m`
# run from it, pytest), transformers' probe for the Hugging Face `kernels` package imports this
# folder a second time as `kernels`: a copy with its own Triton kernels and warm-up state. Ops
# defined by that copy ran its unwarmed kernels (a deterministic server compiled while serving).
_DEFINES_OPS = __name__ == "mok_serve.kernels"


def _define_op(name: str, arguments: str, impl, fake=None) -> None:
    """``torch.ops.mok_serve.<name>(arguments) -> Tensor``, shaped by ``fake`` (default: like its
    first argument); once, by the installed package (``_DEFINES_OPS``)."""
    if not _DEFINES_OPS or hasattr(torch.ops.mok_serve, name):
        return
    _lib.define(f"{name}({arguments}) -> Tensor")
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    if fake is None:
        fake = lambda hidden_states, *_: torch.empty_like(hidden_states)  # noqa: E731
    torch.library.register_fake(f"mok_serve::{name}", fake, lib=_lib)


def _fused_moe_impl(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation):
    if hidden_states.is_cuda:
        from .cuda.moe import fused_moe_triton

        return fused_moe_triton(
            hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation
        )
    if hidden_states.device.type == "cpu":
        from .cpu.moe import fused_moe_cpu

        return fused_moe_cpu(hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation)
    return fused_moe_reference(
        hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation
    )


_define_op(
    "fused_moe",
    "Tensor hidden_states, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, Tensor? expert_map, "
    "str activation",
    _fused_moe_impl,
)


def fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """Routed experts of one MoE layer: ``[T, H]`` in the input dtype.

    ``hidden_states`` ``[T, H]``; ``w13`` ``[E_local, 2*I, H]`` (gate rows then up rows); ``w2``
    ``[E_local, H, I]``; ``topk_weights`` and ``topk_ids`` ``[T, K]`` with global expert ids;
    ``expert_map`` ``[E_global]`` global -> local, -1 for experts on other ranks. Each token's
    top-k expert outputs are summed in fp32 in k order; bitwise deterministic and batch invariant.
    Bad arguments raise ``ValueError`` naming the problem.
    """
    return torch.ops.mok_serve.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation)


def _fused_moe_fp8_impl(
    hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation, block_shape
):
    args = (hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids)
    kwargs = dict(expert_map=expert_map, activation=activation, block_shape=tuple(block_shape))
    if hidden_states.is_cuda:
        from .cuda.moe_fp8 import fused_moe_fp8_triton

        return fused_moe_fp8_triton(*args, **kwargs)
    return fused_moe_fp8_reference(*args, **kwargs)


_define_op(
    "fused_moe_fp8",
    "Tensor hidden_states, Tensor w13, Tensor w2, Tensor w13_scale, Tensor w2_scale, Tensor topk_weights, "
    "Tensor topk_ids, Tensor? expert_map, str activation, int[] block_shape",
    _fused_moe_fp8_impl,
)


def fused_moe_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    block_shape: tuple[int, int] = BLOCK_SHAPE,
) -> torch.Tensor:
    """Routed experts of one MoE layer with block-scaled FP8 weights: ``[T, H]`` in the input dtype.

    As ``fused_moe``, with ``w13`` / ``w2`` in ``torch.float8_e4m3fn`` and fp32 ``w13_scale``
    ``[E_local, ceil(2I/bn), ceil(H/bk)]`` / ``w2_scale`` ``[E_local, ceil(H/bn), ceil(I/bk)]``, one
    per ``block_shape = (bn, bk)`` block (multiply to dequantize). Activations are quantized per
    token in groups of ``bk`` columns. The Triton kernels (CUDA) need ``bk = 128``.
    """
    return torch.ops.mok_serve.fused_moe_fp8(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation,
        list(as_block_shape(block_shape)),
    )


def _invariant_linear_impl(x, weight, bias):
    if x.is_cuda:
        from .cuda.linear import invariant_linear_triton

        if _invariant_warm_up_rows and _first_call(("linear", x.device, x.dtype, weight.dtype, tuple(weight.shape),
                                                     weight.stride(), bias is None)):
            _reported_warm_up(f"invariant_linear {list(weight.shape)} {x.dtype}",
                              lambda: warm_up_linear(x, weight, bias, _invariant_warm_up_rows))
        return invariant_linear_triton(x, weight, bias)
    return invariant_linear_reference(x, weight, bias)


_define_op(
    "invariant_linear",
    "Tensor x, Tensor weight, Tensor? bias",
    _invariant_linear_impl,
    fake=lambda x, weight, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[..., K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None) as
    ``[..., N]`` in ``x``'s dtype, each row's bits independent of the other rows of the call: fp32
    sums over K chunks fixed by the weight's shape, added in chunk order, rounded once
    (``linear.py``). Bad arguments raise ``ValueError`` naming the problem."""
    return torch.ops.mok_serve.invariant_linear(x, weight, bias)


def _invariant_linear_fp8_impl(x, weight, weight_scale, bias):
    if x.is_cuda:
        from .cuda.linear import invariant_linear_fp8_triton

        if _invariant_warm_up_rows and _first_call(("linear_fp8", x.device, x.dtype, tuple(weight.shape),
                                                     weight.stride(), bias is None)):
            _reported_warm_up(f"invariant_linear_fp8 {list(weight.shape)} {x.dtype}", lambda: warm_up_linear(
                x, weight, bias, _invariant_warm_up_rows, weight_scale=weight_scale))
        return invariant_linear_fp8_triton(x, weight, weight_scale, bias)
    return invariant_linear_fp8_reference(x, weight, weight_scale, bias)


_define_op(
    "invariant_linear_fp8",
    "Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias",
    _invariant_linear_fp8_impl,
    fake=lambda x, weight, weight_scale, bias: x.new_empty((*x.shape[:-1], weight.shape[0])),
)


def invariant_linear_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """``invariant_linear`` for block-FP8 weights (DeepSeek-V3's dense layers): ``weight`` e4m3
    ``[N, K]`` with fp32 ``weight_scale`` ``[ceil(N/128), ceil(K/128)]`` (multiply to dequantize),
    ``x`` bf16 or fp16 quantized per token in 128-column groups; each row's bits independent of
    the other rows (``linear.py``). Bad arguments raise ``ValueError`` naming the problem."""
    return torch.ops.mok_serve.invariant_linear_fp8(x, weight, weight_scale, bias)


def _invariant_rms_norm_impl(x, residual, weight, eps):
    if x.is_cuda:
        from .cuda.norm import invariant_rms_norm_triton

        return invariant_rms_norm_triton(x, weight, eps, residual)
    y, z = rms_norm_reference(x, weight, eps, residual)
    return y, (z if z is not None else x.new_empty(0))


if _DEFINES_OPS and not hasattr(torch.ops.mok_serve, "invariant_rms_norm"):
    _lib.define("invariant_rms_norm(Tensor x, Tensor? residual, Tensor? weight, float eps) -> (Tensor, Tensor)")
    _lib.impl("invariant_rms_norm", _invariant_rms_norm_impl, "CompositeExplicitAutograd")
    torch.library.register_fake(
        "mok_serve::invariant_rms_norm",
        lambda x, residual, weight, eps: (torch.empty_like(x), torch.empty_like(x) if residual is not None else x.new_empty(0)),
        lib=_lib,
    )


def invariant_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                       residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``x`` ``[..., H]`` (after adding ``residual``, when given) whose rows never depend on
    the other rows (``norm.py``): ``(y, z)``, z the new residual ``round(x + residual)`` (an empty
    tensor without a residual). Bad arguments raise ``ValueError`` naming the problem."""
    return torch.ops.mok_serve.invariant_rms_norm(x, residual, weight, eps)


def invariant_attention(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seq_len: int,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """Causal paged attention whose output for a query token depends on that token's query, keys
    and values alone (``attention.py``): ``q`` ``[tokens, heads, D]``, caches ``[blocks, block_size,
    kv_heads, D]`` (strided views allowed), ``cu_seqlens_q`` ``[seqs + 1]``, ``seq_lens`` ``[seqs]``
    (KV lengths, the query tokens last), ``block_table`` ``[seqs, blocks per seq]``, ``max_seq_len``
    a bound on ``seq_lens`` for every replay of a captured call, ``window`` keys before the token's own
    (None: all). Writes ``out`` (``q``'s shape) and returns it."""
    if q.is_cuda:
        from .cuda.attention import invariant_attention_triton

        if _invariant_warm_up_rows and q.shape[0] and seq_lens.shape[0] and _first_call(("attention", q.device, q.dtype, k_cache.dtype, q.shape[1:],
                                                     q.stride(), out.stride(), k_cache.shape[1:], k_cache.stride(),
                                                     v_cache.stride(), window is None)):
            _reported_warm_up(f"invariant_attention {list(q.shape[1:])} {q.dtype}", lambda: warm_up_attention(
                q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seq_len, scale, window))
        return invariant_attention_triton(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seq_len,
                                          scale, window)
    return out.copy_(attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale, window))


def warm_up(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    max_tokens: int,
    *,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block_shape: tuple[int, int] = BLOCK_SHAPE,
) -> list[int]:
    """Compile now every Triton kernel that calls of 1 to ``max_tokens`` tokens with these weights
    and argument dtypes can run, so that no call waits for a compile later (Triton compiles a
    kernel variant at its first call: ~1 s, or a disk-cache load, during which a server stalls).

    The arguments are those of a ``fused_moe`` call (``fused_moe_fp8`` with the scales); only the
    weights, ``expert_map`` and the other tensors' dtypes and devices matter. One call on zeros runs
    at the smallest token count of each kernel variant. Returns those token counts; nothing runs
    (``[]``) for tensors not on CUDA, whose kernels are not compiled per call.
    """
    if not hidden_states.is_cuda:
        return []
    num_local, two_inter, hidden = w13.shape
    top_k = topk_ids.shape[1]
    counts = warm_up_token_counts(num_local, hidden, two_inter // 2, top_k, max_tokens, fp8=w13_scale is not None)
    num_global = num_local if expert_map is None else expert_map.shape[0]
    dev = hidden_states.device
    for tokens in counts:
        x = torch.zeros((tokens, hidden), dtype=hidden_states.dtype, device=dev)
        ids = (torch.arange(tokens * top_k, device=dev) % num_global).view(tokens, top_k).to(topk_ids.dtype)
        weights = torch.full((tokens, top_k), 1.0 / top_k, dtype=topk_weights.dtype, device=dev)
        if w13_scale is None:
            fused_moe(x, w13, w2, weights, ids, expert_map=expert_map)
        else:
            fused_moe_fp8(x, w13, w2, w13_scale, w2_scale, weights, ids, expert_map=expert_map, block_shape=block_shape)
    return counts


def warm_up_token_counts(num_local: int, hidden: int, inter: int, top_k: int, max_tokens: int, *,
                         fp8: bool = False) -> list[int]:
    """The smallest token count of each Triton kernel variant that calls of 1 to ``max_tokens``
    tokens run, in increasing order (``warm_up`` calls each)."""
    if fp8:
        from .cuda.configs import kernel_variants_fp8 as variants
    else:
        from .cuda.configs import kernel_variants as variants
    first: dict[tuple, int] = {}
    for tokens in range(1, max_tokens + 1):
        first.setdefault(variants(tokens, top_k, num_local, hidden, inter), tokens)
    return list(first.values())


# Rows bound of the invariant kernels' first-call warm-up (0: off) and who hears of each one; see
# warm_up_invariant_kernels.
_invariant_warm_up_rows = 0
_invariant_warm_up_report = None
_warmed_up_calls: set[tuple] = set()


def warm_up_invariant_kernels(max_rows: int, report=None) -> None:
    """From now on, the first CUDA call of ``invariant_linear`` with each weight layout, and of
    ``invariant_attention`` with each query and cache layout, first compiles every Triton variant
    that calls of 1 to ``max_rows`` rows (tokens) can run (``warm_up_linear``, ``warm_up_attention``),
    as ``warm_up`` does for the experts. A deterministic vLLM server turns it on at start-up: vLLM's
    own warm-up runs the largest batch and the captured sizes only, so a small prefill met first
    while serving stalled the server for a compile. A first call during CUDA-graph capture waits for
    the next call (vLLM runs each captured size once eagerly first). ``max_rows`` 0 turns it off.
    ``report(what, variants, seconds)``, when given, hears of each warm-up as it ends (``what`` names
    the op and layout, ``variants`` what the warm-up returned), so a server can log when it ran."""
    global _invariant_warm_up_rows, _invariant_warm_up_report
    if max_rows < 0:
        raise ValueError(f"max_rows must be >= 0, got {max_rows}")
    _invariant_warm_up_rows = max_rows
    _invariant_warm_up_report = report


def _reported_warm_up(what: str, warm_up_call) -> None:
    """Run ``warm_up_call`` and tell ``_invariant_warm_up_report`` what it compiled, in how long."""
    start = time.perf_counter()
    variants = warm_up_call()
    if _invariant_warm_up_report is not None:
        _invariant_warm_up_report(what, variants, time.perf_counter() - start)


def _first_call(key: tuple) -> bool:
    """Whether a call of this static layout is the first outside a CUDA-graph capture (and marks it)."""
    if key in _warmed_up_calls or torch.cuda.is_current_stream_capturing():
        return False
    _warmed_up_calls.add(key)
    return True


def warm_up_linear_rows(n: int, k: int, max_rows: int, *, fp8: bool = False) -> list[int]:
    """The smallest row count of each ``invariant_linear`` (``fp8``: ``invariant_linear_fp8``) variant
    (tile config, split or not) that calls of 1 to ``max_rows`` rows with a weight ``[n, k]`` run,
    in increasing order."""
    from .cuda.linear import linear_plan

    first: dict[tuple, int] = {}
    for rows in range(1, max_rows + 1):
        config, _, split = linear_plan(rows, n, k, fp8=fp8)
        first.setdefault((tuple(sorted(config.items())), split), rows)
    return list(first.values())


def warm_up_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, *,
                   weight_scale: torch.Tensor | None = None) -> list[int]:
    """Compile now every Triton variant of ``invariant_linear`` (with ``weight_scale``:
    ``invariant_linear_fp8``) calls of 1 to ``max_rows`` rows with this weight (and bias, and
    ``x``'s dtype and device): one call on zeros at each of ``warm_up_linear_rows``, which it
    returns (``[]`` off CUDA, where nothing is compiled per call)."""
    if not x.is_cuda:
        return []
    from .cuda.linear import invariant_linear_fp8_triton, invariant_linear_triton

    n, k = weight.shape
    rows = warm_up_linear_rows(n, k, max_rows, fp8=weight_scale is not None)
    for m in rows:
        zeros = torch.zeros((m, k), dtype=x.dtype, device=x.device)
        if weight_scale is None:
            invariant_linear_triton(zeros, weight, bias)
        else:
            invariant_linear_fp8_triton(zeros, weight, weight_scale, bias)
    return rows


def warm_up_attention(q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, max_seq_len: int, scale: float,
                      window: int | None = None) -> list[tuple[bool, bool]]:
    """Compile now every Triton variant of ``invariant_attention`` calls with these layouts (the
    arguments of a call, at least one query token): each (swapped operands, split segments) path
    the plan can pick, run for the first query token alone into a scratch output. Returns those
    paths (``[]`` off CUDA)."""
    if not q.is_cuda:
        return []
    from .cuda.attention import attention_paths, invariant_attention_triton

    scratch = torch.empty_strided((1, *out.shape[1:]), out.stride(), dtype=out.dtype, device=out.device)
    one = torch.arange(2, dtype=cu_seqlens_q.dtype, device=q.device)
    paths = attention_paths(q.shape[2])
    for swap, split in paths:
        invariant_attention_triton(q[:1], k_cache, v_cache, scratch, one, seq_lens[:1], block_table[:1], max_seq_len,
                                   scale, window, split=split, swap=swap)
    return paths
