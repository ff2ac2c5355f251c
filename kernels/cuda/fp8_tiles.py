"""The FP8 tiles of the CUDA kernels (public, as ``tiles.py``): e4m3 rounding, per-token group
quantization of activation rows, the block-scaled dot and GEMM2's FP8 tile, shared by the FP8 op
(``moe_fp8.py``) and the expert-parallel kernels (``ep.py``)."""

from __future__ import annotations

import triton
import triton.language as tl

from ..fp8 import AMAX_FLOOR, FP8_MAX
from .tiles import acc_zeros, load_cols, load_rows

__all__ = ["GROUP", "fp8_gemm2_tile", "max_nan", "quantize_rows", "quantize_tile", "scaled_block_dot",
           "scaled_block_dot_one_weight_block", "to_fp8"]

GROUP = 128  # activation group = weight K block = every GEMM's BLOCK_K = GEMM1's column tile
_GROUP = tl.constexpr(GROUP)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@triton.jit
def max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def to_fp8(x, RNE_FIX: tl.constexpr):
    """fp32 -> e4m3, round to nearest even. The interpreter (``RNE_FIX``) rounds this cast wrongly
    (no carry into the exponent, ties away), so round to the e4m3 grid in fp32 first: normals keep 3
    mantissa bits, subnormals (< 2**-6) snap to multiples of 2**-9, keeping the sign (of zero too:
    set by bits, since Triton 3.7's interpreter negates 0.0 to +0.0); the cast is then exact."""
    if RNE_FIX:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        magnitude = (tl.abs(x) + 24576.0) - 24576.0  # 1.5 * 2**14: fp32 spacing 2**-9 around it
        subnormal = (magnitude.to(tl.uint32, bitcast=True) | (bits & 0x80000000)).to(tl.float32, bitcast=True)
        x = tl.where(tl.abs(x) < 0.015625, subnormal, normal)
    return x.to(tl.float8e4nv)


@triton.jit
def quantize_rows(v, RNE_FIX: tl.constexpr):
    """(e4m3 ``v / scale``, ``scale``) per row of a ``[R, 128]`` fp32 tile, as ``fp8.quantize_fp8_groups``."""
    amax = tl.reduce(tl.abs(v), 1, max_nan)
    scale = tl.div_rn(tl.where(amax < _AMAX_FLOOR, _AMAX_FLOOR, amax), _FP8_MAX)
    return to_fp8(tl.div_rn(v, scale[:, None]), RNE_FIX), scale


@triton.jit
def quantize_tile(q, x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, QROWS: tl.constexpr, RNE_FIX: tl.constexpr):
    """Quantization program ``q``: one ``[QROWS tokens, 128 columns]`` tile of ``x`` into ``xq``
    (e4m3, ``[tokens, H]`` contiguous) and ``xs`` (fp32, ``[tokens, cdiv(H, 128)]`` contiguous).
    Shared by the one-GPU launch 1 and the expert-parallel post (cuda/ep.py): the same bits."""
    num_g = tl.cdiv(H, _GROUP)
    g = q % num_g
    offs_t = (q // num_g) * QROWS + tl.arange(0, QROWS)
    offs_c = g * _GROUP + tl.arange(0, _GROUP)
    t_ok = offs_t < tokens
    ok = t_ok[:, None] & (offs_c < H)[None, :]
    t64 = offs_t.to(tl.int64)
    v = tl.load(x_ptr + t64[:, None] * stride_xt + offs_c[None, :] * stride_xh, mask=ok, other=0.0)
    xq, xs = quantize_rows(v.to(tl.float32), RNE_FIX)
    tl.store(xq_ptr + t64[:, None] * H + offs_c[None, :], xq, mask=ok)
    tl.store(xs_ptr + t64 * num_g + g, xs, mask=t_ok)


@triton.jit
def scaled_block_dot(a, b, sa, sb, acc, SWAP_AB: tl.constexpr):
    """``acc += (a @ b) * sa[:, None] * sb[None, :]`` for one 128-deep K block: ``a`` [rows, 128]
    e4m3 activations with per-row scales ``sa``, ``b`` [128, columns] e4m3 weights with per-column
    scales ``sb``. ``SWAP_AB`` keeps ``acc`` transposed and puts the weight columns on wgmma's M
    side (``tiles.mma``); the products, their K order and the scaling (fp32 products commute)
    are the same."""
    if SWAP_AB:
        acc += tl.dot(tl.trans(b), tl.trans(a)) * (sb[:, None] * sa[None, :])
    else:
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    return acc


@triton.jit
def scaled_block_dot_one_weight_block(a, b, sa, sb, acc, SWAP_AB: tl.constexpr):
    """``scaled_block_dot`` for a tile whose columns all lie in one 128-column weight block: ``sb``
    is that block's scale (a scalar), so each row's scale product ``sa * sb`` is formed once, not per
    element; the products and sums are the same fp32 operations."""
    s = sa * sb
    if SWAP_AB:
        acc += tl.dot(tl.trans(b), tl.trans(a)) * s[None, :]
    else:
        acc += tl.dot(a, b) * s[:, None]
    return acc


@triton.jit
def fp8_gemm2_tile(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    """One [BLOCK_M, BLOCK_N] tile of FP8 GEMM2 for expert ``e``: fp32 accumulator, columns, mask.
    Shared by every FP8 GEMM2 epilogue (moe_fp8.py's and the expert-parallel push in ep.py).
    ``STAGES``: the K loop's pipeline depth (None: the kernel's ``num_stages``)."""
    offs_k = tl.arange(0, _GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    e64 = e.to(tl.int64)
    src = (start_e + offs_m).to(tl.int64)
    a_ptrs = actq_ptr + src[:, None] * I + offs_k[None, :]
    as_ptrs = acts_ptr + src * tl.cdiv(I, _GROUP)
    if BLOCK_N <= SCALE_BN:  # the tile's columns lie in one weight block: one scale a K block
        ws_ptrs = ws_ptr + e64 * stride_se + (pid_n * BLOCK_N // SCALE_BN) * stride_sn
    else:  # (masked by n_ok: TMA tiles of the last expert reach past its scale rows)
        ws_ptrs = ws_ptr + e64 * stride_se + (offs_n // SCALE_BN) * stride_sn
    if USE_TMA:
        row_w = e * H + pid_n * BLOCK_N  # row of w2 viewed as [E*H, I]
    else:
        w_ptrs = w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for kb in tl.range(0, tl.cdiv(I, _GROUP), num_stages=STAGES):
        k_ok = offs_k < I - kb * _GROUP
        a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            # Rows past H spill into the next expert (masked at the store); past the tensor: zeros.
            b = w_desc.load([row_w, kb * _GROUP]).T
        else:
            b = load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += _GROUP * stride_wk
        sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        if BLOCK_N <= SCALE_BN:
            acc = scaled_block_dot_one_weight_block(a, b, sa, tl.load(ws_ptrs + kb * stride_sk), acc, SWAP_AB)
        else:
            sb = tl.load(ws_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
            acc = scaled_block_dot(a, b, sa, sb, acc, SWAP_AB)
        a_ptrs += _GROUP
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc, offs_n, n_ok
