"""The batch-invariant dense layer on CUDA (``invariant_linear``; the function is in ``../linear.py``).

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

from ..linear import check_linear_args, k_chunk
from .configs import LINEAR_SPLIT_BELOW_TILES, pick_linear_config
from .launch import descriptor, gemm_config, interpreting, pdl_launch, tma_ok
from .tiles import acc_zeros, cast, grid_dependency, load_cols, load_rows, mma, program_tile

__all__ = ["invariant_linear_triton", "linear_plan"]

_REDUCE_BLOCK_M = 16
_REDUCE_BLOCK_N = 128


@triton.jit
def _chunk_sum(
    x_ptr, w_ptr, w_desc, offs_m, row_ok, offs_n, n_ok, pid_n, k_lo, k_hi, K,
    stride_xm, stride_xk, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
):
    """fp32 ``[BLOCK_M, BLOCK_N]`` sum of ``x[offs_m, k] * w[offs_n, k]`` over ``k_lo <= k < k_hi``
    in K order (``k_lo`` a multiple of BLOCK_K; only the tensor's end, ``K``, can be ragged)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + (k_lo + offs_k)[None, :] * stride_xk
    if not USE_TMA:
        w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + (k_lo + offs_k)[:, None] * stride_wk
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < K - k0
        a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([pid_n * BLOCK_N, k0]).T
        else:
            b = load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
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
    x_ptr, w_ptr, w_desc, bias_ptr, y_ptr, part_ptr, M, N, K, K_CHUNK,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_part,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr, SPLIT: tl.constexpr, MULTI_CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    """Program (tile[, chunk]): with ``SPLIT`` the fp32 sum of chunk ``program_id(1)`` into
    ``part[chunk]`` ([chunks, M, N]); else the tile's chunk sums added in chunk order, the bias, one
    rounding into ``y``. ``MULTI_CHUNK``: K holds more than one chunk (else one accumulator)."""
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
        acc = _chunk_sum(x_ptr, w_ptr, w_desc, offs_m, row_ok, offs_n, n_ok, pid_n, k_lo, tl.minimum(k_lo + K_CHUNK, K), K,
                         stride_xm, stride_xk, stride_wn, stride_wk,
                         BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, DOT_IEEE, DOT_F32)
        p_ptrs = part_ptr + tl.program_id(1).to(tl.int64) * stride_part + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(p_ptrs, acc, mask=row_ok[:, None] & n_ok[None, :])
    else:
        total = _chunk_sum(x_ptr, w_ptr, w_desc, offs_m, row_ok, offs_n, n_ok, pid_n, 0, tl.minimum(K_CHUNK, K), K,
                           stride_xm, stride_xk, stride_wn, stride_wk,
                           BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, DOT_IEEE, DOT_F32)
        if MULTI_CHUNK:
            for k_lo in range(K_CHUNK, K, K_CHUNK):
                total += _chunk_sum(x_ptr, w_ptr, w_desc, offs_m, row_ok, offs_n, n_ok, pid_n, k_lo,
                                    tl.minimum(k_lo + K_CHUNK, K), K, stride_xm, stride_xk, stride_wn, stride_wk,
                                    BLOCK_M, BLOCK_N, BLOCK_K, STAGES, EVEN_K, EVEN_N, USE_TMA, SWAP_AB,
                                    DOT_IEEE, DOT_F32)
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


def linear_plan(rows: int, n: int, k: int, config: dict | None = None) -> tuple[dict, int, bool]:
    """(tile config, K chunk length, whether chunks run in separate programs) of a call with
    ``rows`` rows and a weight ``[n, k]``; shapes only. ``config`` overrides the tile."""
    g = dict(config) if config is not None else pick_linear_config(rows, n, k)
    chunk = k_chunk(n, k)
    tiles = triton.cdiv(rows, g["BLOCK_M"]) * triton.cdiv(n, g["BLOCK_N"])
    return g, chunk, chunk < k and tiles < LINEAR_SPLIT_BELOW_TILES


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
    n, k = weight.shape
    rows = x.reshape(math.prod(x.shape[:-1]), k)
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
    g, chunk, split_by_shape = linear_plan(m, n, k, config)
    split = split_by_shape if split is None else (split and chunk < k)
    g = gemm_config(g, x, interpret, GROUP_M=1, SWAP_AB=False)
    bm, bn, bk = g["BLOCK_M"], g["BLOCK_N"], g["BLOCK_K"]
    if 128 % bk:
        raise ValueError(f"BLOCK_K must divide the chunk alignment 128, got {bk}")
    w_desc = weight
    if g["USE_TMA"]:
        if tma_ok(weight):
            w_desc = descriptor(weight, [bn, bk])
        else:
            g["USE_TMA"] = False
    chunks = triton.cdiv(k, chunk)
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if split else y
    b = bias if bias is not None else y
    common = dict(DOT_IEEE=x.dtype == torch.float32 or interpret, DOT_F32=interpret)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    _linear_kernel[(tiles, chunks if split else 1)](
        rows, weight, w_desc, b, y, part, m, n, k, chunk,
        rows.stride(0), rows.stride(1), weight.stride(0), weight.stride(1), y.stride(0), m * n,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g["GROUP_M"], STAGES=g["num_stages"], SPLIT=split,
        MULTI_CHUNK=chunks > 1, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, EVEN_N=n % bn == 0,
        USE_TMA=g["USE_TMA"], SWAP_AB=g["SWAP_AB"], **common,
        num_warps=g["num_warps"], num_stages=g["num_stages"], **pdl_launch(y, pdl, interpret),
    )
    if split:
        _linear_reduce_kernel[(triton.cdiv(m, _REDUCE_BLOCK_M), triton.cdiv(n, _REDUCE_BLOCK_N))](
            part, b, y, m, n, chunks, y.stride(0), m * n,
            BLOCK_M=_REDUCE_BLOCK_M, BLOCK_N=_REDUCE_BLOCK_N, HAS_BIAS=bias is not None, RNE_FIX=interpret,
            num_warps=4, **pdl_launch(y, pdl, interpret),
        )
    return y.view(out_shape)
