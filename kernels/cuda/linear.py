"""The batch-invariant dense layer on CUDA (``invariant_linear`` and, for block-FP8 weights,
``invariant_linear_fp8``; the functions are in ``../linear.py``).

``_linear_kernel`` computes output tiles: each program adds its tile's K-chunk sums in chunk order
and writes the rounded result, or (``SPLIT``, for calls with fewer output tiles than SMs, i.e.
decode sizes) computes one chunk's fp32 sum into a workspace that ``_linear_reduce_kernel`` then
adds up in chunk order. Either way each output element is the same chain of 16-deep wgmma k-steps
per chunk and the same chunk order, so a row's bits never depend on the row count, the tile
(``configs.pick_linear_config``) or the path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..linear import FP8_BLOCK, check_linear_args, check_linear_fp8_args, k_chunk
from .configs import LINEAR_SPLIT_BELOW_TILES, pick_linear_config
from .fp8_tiles import quantize_tile, scaled_block_dot_one_weight_block
from .launch import descriptor, gemm_config, interpreting, pdl_launch, tma_ok
from .tiles import acc_zeros, cast, grid_dependency, load_cols, load_rows, mma, program_tile

__all__ = ["invariant_linear_fp8_triton", "invariant_linear_triton", "linear_plan"]

_REDUCE_BLOCK_M = 16
_REDUCE_BLOCK_N = 128
_QUANTIZE_ROWS = 16  # token rows per activation-quantization program (one 128-column group each)


@triton.jit
def _chunk_sum(
    x_ptr, x_desc, w_ptr, w_desc, xs_ptr, ws_ptr, offs_m, row_ok, offs_n, n_ok, pid_m, pid_n, k_lo, k_hi, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, TMA_A: tl.constexpr, SWAP_AB: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` sum of ``x[offs_m, k] * w[offs_n, k]`` over ``k_lo <= k < k_hi``
    in K order (``k_lo`` a multiple of BLOCK_K; only the tensor's end, ``K``, can be ragged). ``FP8``:
    e4m3 operands, 128-column K blocks, each block's products scaled by the activation row's scale
    ``xs[m, b]`` and the weight block's ``ws[n // 128, b]`` (``scaled_block_dot_one_weight_block``). ``TMA_A``: the
    activation tiles through ``x_desc`` (zero past the rows and K, as the masked loads). ``WARP_SPEC``:
    the loads in a producer partition of warps apart from the wgmma ones (Triton's warp specialization)."""
    offs_k = tl.arange(0, BLOCK_K)
    if FP8:
        # A tile's BLOCK_N (<= 128) columns start at a multiple of BLOCK_N, so they lie in one 128-column
        # weight block: one weight scale per K block (a per-column vector cost a load per column a thread
        # holds, 32 at 128 x 128, and a product per element).
        tl.static_assert(BLOCK_N <= BLOCK_K, "an FP8 tile's columns must lie in one weight block")
        xs_ptrs = xs_ptr + offs_m.to(tl.int64) * stride_xs
        ws_ptrs = ws_ptr + (pid_n * BLOCK_N // BLOCK_K) * stride_ws
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    if not USE_TMA:
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None] * stride_wk
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES, warp_specialize=WARP_SPEC):
        k_ok = offs_k < K - k0
        if TMA_A:
            a = x_desc.load([pid_m * BLOCK_M, k0])
        else:
            a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([pid_n * BLOCK_N, k0]).T
        else:
            b = load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
        if FP8:
            sa = tl.load(xs_ptrs + k0 // BLOCK_K, mask=row_ok, other=0.0)
            sb = tl.load(ws_ptrs + k0 // BLOCK_K)
            acc = scaled_block_dot_one_weight_block(a, b, sa, sb, acc, SWAP_AB)
        else:
            acc = mma(a, b, acc, DOT_IEEE, DOT_F32, SWAP_AB)
        a_ptrs += BLOCK_K * stride_xk
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _store_rows(total, bias_ptr, y_ptr, offs_m, row_ok, offs_n, n_ok, stride_ym,
                HAS_BIAS: tl.constexpr, RNE_FIX: tl.constexpr):
    """``y[offs_m, offs_n] = round(total + bias)``: the bias added in fp32, one rounding."""
    if HAS_BIAS:
        total += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, cast(total, y_ptr.dtype.element_ty, RNE_FIX), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M", "stride_part"])  # per-call row counts: one compile for every count
def _linear_kernel(
    x_ptr, x_desc, w_ptr, w_desc, xs_ptr, ws_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, K_CHUNK,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws, stride_ym, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, MULTI_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, TMA_A: tl.constexpr, SWAP_AB: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, FP8: tl.constexpr, WARP_SPEC: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile[, chunk]): with ``SPLIT`` the fp32 sum of chunk ``program_id(1)`` into
    ``part[chunk]`` ([chunks, M, N]); else the tile's chunk sums added in chunk order, the bias, one
    rounding into ``y``. ``MULTI_CHUNK``: K holds more than one chunk (else one accumulator).
    ``FP8``: ``x`` and ``w`` e4m3 with the scales ``xs`` / ``ws`` (``_chunk_sum``)."""
    grid_dependency(PDL)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = program_tile(tl.program_id(0), num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if SPLIT:
        k_lo = tl.program_id(1) * K_CHUNK
        acc = _chunk_sum(x_ptr, x_desc, w_ptr, w_desc, xs_ptr, ws_ptr, offs_m, row_ok, offs_n, n_ok, pid_m, pid_n, k_lo, tl.minimum(k_lo + K_CHUNK, K), K,
                         stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws,
                         BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA, TMA_A, SWAP_AB, DOT_IEEE, DOT_F32, FP8, WARP_SPEC)
        p_ptrs = part_ptr + tl.program_id(1).to(tl.int64) * stride_part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])
    else:
        total = _chunk_sum(x_ptr, x_desc, w_ptr, w_desc, xs_ptr, ws_ptr, offs_m, row_ok, offs_n, n_ok, pid_m, pid_n, 0, tl.minimum(K_CHUNK, K), K,
                           stride_xm, stride_xk, stride_wn, stride_wk, stride_xs, stride_ws,
                           BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA, TMA_A, SWAP_AB, DOT_IEEE, DOT_F32, FP8, WARP_SPEC)
        if MULTI_CHUNK:
            for k_lo in range(K_CHUNK, K, K_CHUNK):
                total += _chunk_sum(x_ptr, x_desc, w_ptr, w_desc, xs_ptr, ws_ptr, offs_m, row_ok, offs_n, n_ok, pid_m, pid_n, k_lo,
                                    tl.minimum(k_lo + K_CHUNK, K), K, stride_xm, stride_xk, stride_wn, stride_wk,
                                    stride_xs, stride_ws, BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA,
                                    TMA_A, SWAP_AB, DOT_IEEE, DOT_F32, FP8, WARP_SPEC)
        _store_rows(total, bias_ptr, y_ptr, offs_m, row_ok, offs_n, n_ok, stride_ym, HAS_BIAS, DOT_F32)


@triton.jit(do_not_specialize=["M", "stride_part"])
def _linear_reduce_kernel(
    part_ptr, bias_ptr, y_ptr, M, N, NUM_CHUNKS, stride_ym, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    """``y = round(part[0] + part[1] + ... + bias)`` over a [BLOCK_M, BLOCK_N] block, chunks in order."""
    grid_dependency(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    mask = row_ok[:, None] & n_ok[None, :]
    p_ptrs = part_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    total = tl.load(p_ptrs, mask=mask, other=0.0)
    for _ in range(1, NUM_CHUNKS):
        p_ptrs += stride_part
        total += tl.load(p_ptrs, mask=mask, other=0.0)
    _store_rows(total, bias_ptr, y_ptr, offs_m, row_ok, offs_n, n_ok, stride_ym, HAS_BIAS, RNE_FIX)


def linear_plan(rows: int, n: int, k: int, config: dict | None = None, *, fp8: bool = False) -> tuple[dict, int, bool]:
    """(tile config, K chunk length, whether chunks run in separate programs) of a call with
    ``rows`` rows and a weight ``[n, k]``; shapes only. ``config`` overrides the tile; ``fp8``
    (block-FP8 weights) takes 128-column K blocks, one weight scale block each. Prefill tiles read
    the activations by TMA (``TMA_A``: FP8 past 64 rows, bf16 past 256)."""
    g = dict(config) if config is not None else pick_linear_config(rows, n, k, fp8=fp8)
    if fp8:
        g["BLOCK_K"] = FP8_BLOCK
    chunk = k_chunk(n, k)
    tiles = triton.cdiv(rows, g["BLOCK_M"]) * triton.cdiv(n, g["BLOCK_N"])
    return g, chunk, chunk < k and tiles < LINEAR_SPLIT_BELOW_TILES


@triton.jit(do_not_specialize=["M"])  # per-call row count
def _quantize_kernel(x_ptr, xq_ptr, xs_ptr, M, K, stride_xm, stride_xk,
                     QROWS: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr):
    """``invariant_linear_fp8``'s activations per token in 128-column groups (``quantize_tile``)."""
    grid_dependency(PDL)
    quantize_tile(tl.program_id(0), x_ptr, xq_ptr, xs_ptr, M, K, stride_xm, stride_xk, QROWS, RNE_FIX)


def invariant_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    split: bool | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``invariant_linear`` with the Triton kernels: ``[..., N]`` in ``x``'s dtype. ``config`` (a
    ``pick_linear_config`` entry) and ``split`` override the choices by shape, for tests and sweeps:
    every choice gives the same bits."""
    check_linear_args(x, weight, bias)
    return _linear(x, weight, None, bias, config, split, pdl)


def invariant_linear_fp8_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    config: dict | None = None,
    split: bool | None = None,
    pdl: bool | None = None,
) -> torch.Tensor:
    """``invariant_linear_fp8`` with the Triton kernels (one launch quantizes ``x``, then the GEMM's),
    with the overrides of ``invariant_linear_triton``."""
    check_linear_fp8_args(x, weight, weight_scale, bias)
    return _linear(x, weight, weight_scale.contiguous(), bias, config, split, pdl)


def _linear(x, weight, weight_scale, bias, config, split, pdl) -> torch.Tensor:
    """Both launchers' work; ``weight_scale`` None for plain weights, else the block-FP8 scales."""
    fp8 = weight_scale is not None
    n, k = weight.shape
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    if not (rows.is_contiguous() and rows.data_ptr() % 16 == 0):
        # Triton specializes a kernel on its pointers' 16-byte alignment and its strides: a view the
        # caller passes (an offset slice of a compiled graph's buffer, say) would make a variant no
        # warm-up compiled, so the kernels read an aligned copy instead (same values, same bits).
        rows = torch.empty_like(rows, memory_format=torch.contiguous_format).copy_(rows)
    m = rows.shape[0]
    if bias is not None:
        bias = bias.contiguous()  # (a broadcast bias has stride 0; the kernels read it densely)
    out_shape = (*x.shape[:-1], n)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y.view(out_shape)
    if k == 0:
        y.copy_(bias.float().expand(m, n) if bias is not None else torch.zeros_like(y))
        return y.view(out_shape)
    interpret = interpreting()
    g, chunk, split_by_shape = linear_plan(m, n, k, config, fp8=fp8)
    split = split_by_shape if split is None else (split and chunk < k)
    g = gemm_config(g, x, interpret, GROUP_M=1, SWAP_AB=False)
    bm, bn, bk = g["BLOCK_M"], g["BLOCK_N"], g["BLOCK_K"]
    if 128 % bk:
        raise ValueError(f"BLOCK_K must divide the chunk alignment 128, got {bk}")
    if fp8:
        a = torch.empty((m, k), dtype=weight.dtype, device=x.device)
        xs = torch.empty((m, triton.cdiv(k, FP8_BLOCK)), dtype=torch.float32, device=x.device)
        _quantize_kernel[(triton.cdiv(m, _QUANTIZE_ROWS) * triton.cdiv(k, FP8_BLOCK),)](
            rows, a, xs, m, k, rows.stride(0), rows.stride(1), QROWS=_QUANTIZE_ROWS, RNE_FIX=interpret,
            num_warps=4, **pdl_launch(y, pdl, interpret),
        )
        ws = weight_scale
    else:
        a, xs, ws = rows, y, y  # (xs, ws: unread placeholders)
    # TMA for the activations: ``a`` is this call's quantized copy or the contiguous, aligned ``rows``, so
    # whether TMA can read it is the layer's choice (K), never the call's: no variant appears while serving.
    tma_a = bool(g.get("TMA_A")) and not interpret and tma_ok(a)
    x_desc = descriptor(a, [bm, bk]) if tma_a else a
    w_desc = weight
    if g["USE_TMA"]:
        if tma_ok(weight):
            w_desc = descriptor(weight, [bn, bk])
        else:
            g["USE_TMA"] = False
    chunks = triton.cdiv(k, chunk)
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else y
    b = bias if bias is not None else y
    common = dict(DOT_IEEE=(x.dtype == torch.float32 or interpret) and not fp8, DOT_F32=interpret, FP8=fp8)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _linear_kernel[(tiles, chunks if split else 1)](
        a, x_desc, weight, w_desc, xs, ws, b, y, part, m, n, k, chunk,
        a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), xs.stride(0), ws.stride(0), y.stride(0), m * n,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g["GROUP_M"], STAGES=g["num_stages"], SPLIT=split,
        MULTI_CHUNK=chunks > 1, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, EVEN_N=n % bn == 0,
        USE_TMA=g["USE_TMA"], TMA_A=tma_a, SWAP_AB=g["SWAP_AB"],
        WARP_SPEC=bool(g.get("WARP_SPEC")) and tma_a and g["USE_TMA"], **common,
        num_warps=g["num_warps"], num_stages=g["num_stages"], **pdl_launch(y, pdl, interpret),
    )
    if split:
        _linear_reduce_kernel[(triton.cdiv(m, _REDUCE_BLOCK_M), triton.cdiv(n, _REDUCE_BLOCK_N))](
            part, b, y, m, n, chunks, y.stride(0), m * n,
            BLOCK_M=_REDUCE_BLOCK_M, BLOCK_N=_REDUCE_BLOCK_N, HAS_BIAS=bias is not None, RNE_FIX=interpret,
            num_warps=4, **pdl_launch(y, pdl, interpret),
        )
    return y.view(out_shape)
