"""Triton fused MoE with block-scaled FP8 experts (Hopper FP8 tensor cores), one GPU.

Computes the function of ``fp8.fused_moe_fp8_reference`` with the structure of ``triton_moe.py``
(whose schedule, tile mapping and combine kernels it reuses) in four launches, no host sync:

1. ``_fp8_schedule_quantize_kernel`` -- programs ``< E_local`` run ``triton_moe``'s prefix-sum
   schedule; the others quantize ``hidden_states`` per token in 1 x 128 groups into ``xq`` (e4m3)
   and ``xs`` (fp32). Quantizing once here instead of in GEMM1's K loop does the division once per
   element instead of once per (element, top-k slot, column tile) -- 128x fewer at DeepSeek-V3
   (K=8, 16 column tiles) -- and halves GEMM1's A-gather bytes; the quantize programs run beside
   the latency-bound schedule programs, so it costs no extra launch.
2. ``_fp8_gemm1_kernel`` -- grouped GEMM over ``w13``: A rows gathered from ``xq`` by token index,
   gate and up rows interleaved into one ``[128, 2*128]`` B tile, and per 128-wide K block
   ``acc += dot(a, b) * xs[row] * w13_scale[col block]`` (the fp8 partial products of one K block
   are scaled in fp32 before they join the accumulator; the tensor core only ever sums 128
   products). Epilogue: gate/up rounded to the input dtype, ``silu(gate) * up`` rounded to the input
   dtype, then quantized per row over the tile's 128 columns -- exactly one activation group, which
   is why GEMM1's column tile is always 128 -- into ``act_q`` (e4m3) and ``act_s`` (fp32).
3. ``_fp8_gemm2_kernel`` -- grouped GEMM over ``w2`` on ``act_q`` with the same per-K-block scaling,
   each output row rounded to the input dtype and scattered to its (token, k) slot of ``y``.
4. ``triton_moe._moe_combine_kernel`` -- fp32 weighted top-k sum in k order.

Quantization (both places) is ``fp8.py``'s rounding bit for bit: IEEE division (``tl.div_rn``, not
the approximate ``/``), round to nearest even, NaN propagated into the group's scale.
Batch invariance: BLOCK_K = 128 everywhere, K blocks in increasing order on one fp32 accumulator,
no split-K, block sizes from static shapes only, always wgmma (the token rows on its M side, BLOCK_M
>= 64, or at decode sizes the weight columns: ``SWAP_AB``, the same products and sums). Unrouted slots (-1),
out-of-range ids and non-local experts are masked by the reused schedule/combine kernels; the
schedule kernel reports out-of-range ids to the next call (``bad_ids.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import bad_ids
from ..env import knob
from ..fp8 import AMAX_FLOOR, BLOCK_SHAPE, FP8_DTYPE, FP8_MAX, check_fused_moe_fp8_args
from .moe import (
    _acc_zeros,
    _cast,
    _e_pad,
    _expert_tile,
    _gemm_config,
    _grid_dependency,
    _interpreting,
    _layer_setup,
    _load_cols,
    _load_rows,
    _max_row_tiles,
    _moe_schedule_kernel,
    _scatter_rows,
    _tile_rows,
    _w2_operand,
    launch_combine,
    launch_schedule,
    pdl_launch,
    schedule_block,
)

__all__ = [
    "fused_moe_fp8_triton", "kernel_variants_fp8", "launch_fp8_gemm1", "launch_fp8_gemm2",
    "launch_fp8_schedule_quantize", "pick_configs_fp8", "quantize_programs",
]

GROUP = 128  # activation group = weight K block = every GEMM's BLOCK_K = GEMM1's column tile
_GROUP = tl.constexpr(GROUP)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _to_fp8(x, RNE_FIX: tl.constexpr):
    """fp32 -> e4m3, round to nearest even. The interpreter (``RNE_FIX``) rounds this cast wrongly
    (no carry into the exponent, ties away), so round to the e4m3 grid in fp32 first: normals keep 3
    mantissa bits, subnormals (< 2**-6) snap to multiples of 2**-9, keeping the sign of zero; the
    cast is then exact."""
    if RNE_FIX:
        bits = x.to(tl.uint32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
        subnormal = (tl.abs(x) + 24576.0) - 24576.0  # 1.5 * 2**14: fp32 spacing 2**-9 around it
        x = tl.where(tl.abs(x) < 0.015625, tl.where(x < 0, -subnormal, subnormal), normal)
    return x.to(tl.float8e4nv)


@triton.jit
def _quantize_rows(v, RNE_FIX: tl.constexpr):
    """(e4m3 ``v / scale``, ``scale``) per row of a ``[R, 128]`` fp32 tile, as ``fp8.quantize_fp8_groups``."""
    amax = tl.reduce(tl.abs(v), 1, _max_nan)
    scale = tl.div_rn(tl.where(amax < _AMAX_FLOOR, _AMAX_FLOOR, amax), _FP8_MAX)
    return _to_fp8(tl.div_rn(v, scale[:, None]), RNE_FIX), scale


@triton.jit
def _quantize_tile(q, x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, QROWS: tl.constexpr, RNE_FIX: tl.constexpr):
    """Quantization program ``q``: one ``[QROWS tokens, 128 columns]`` tile of ``x`` into ``xq``
    (e4m3, ``[tokens, H]`` contiguous) and ``xs`` (fp32, ``[tokens, cdiv(H, 128)]`` contiguous).
    Shared by the one-GPU launch 1 and the expert-parallel post (ep_cuda.py): the same bits."""
    num_g = tl.cdiv(H, _GROUP)
    g = q % num_g
    offs_t = (q // num_g) * QROWS + tl.arange(0, QROWS)
    offs_c = g * _GROUP + tl.arange(0, _GROUP)
    t_ok = offs_t < tokens
    ok = t_ok[:, None] & (offs_c < H)[None, :]
    t64 = offs_t.to(tl.int64)
    v = tl.load(x_ptr + t64[:, None] * stride_xt + offs_c[None, :] * stride_xh, mask=ok, other=0.0)
    xq, xs = _quantize_rows(v.to(tl.float32), RNE_FIX)
    tl.store(xq_ptr + t64[:, None] * H + offs_c[None, :], xq, mask=ok)
    tl.store(xs_ptr + t64 * num_g + g, xs, mask=t_ok)


@triton.jit(do_not_specialize=["num_rows", "tokens"])  # per-call counts, as triton_moe's schedule
def _fp8_schedule_quantize_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, QROWS: tl.constexpr,
    RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < num_local:
        _moe_schedule_kernel(
            topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
            num_rows, num_global, num_local, stride_it, stride_ik, TOPK, HAS_MAP, BLOCK, False,
        )
    else:
        _quantize_tile(pid - num_local, x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, QROWS, RNE_FIX)


@triton.jit
def _scaled_block_dot(a, b, sa, sb, acc, SWAP_AB: tl.constexpr):
    """``acc += (a @ b) * sa[:, None] * sb[None, :]`` for one 128-deep K block: ``a`` [rows, 128]
    e4m3 activations with per-row scales ``sa``, ``b`` [128, columns] e4m3 weights with per-column
    scales ``sb``. ``SWAP_AB`` keeps ``acc`` transposed and puts the weight columns on wgmma's M
    side (``triton_moe._mma``); the products, their K order and the scaling (fp32 products commute)
    are the same."""
    if SWAP_AB:
        acc += tl.dot(tl.trans(b), tl.trans(a)) * (sb[:, None] * sa[None, :])
    else:
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    return acc


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm1_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    IN_DTYPE: tl.constexpr, TOPK: tl.constexpr, E_PAD: tl.constexpr, SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = _expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, _GROUP, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        tok = (rows // TOPK).to(tl.int64)
        offs_k = tl.arange(0, _GROUP)
        # Columns of the B tile interleave gate row n and up row I + n of w13 (one dot for both).
        offs_j = tl.arange(0, 2 * _GROUP)
        n_j = pid_n * _GROUP + offs_j // 2
        nj_ok = n_j < I
        w_row = n_j + (offs_j % 2) * I
        e64 = e.to(tl.int64)
        a_ptrs = xq_ptr + tok[:, None] * H + offs_k[None, :]
        as_ptrs = xs_ptr + tok * tl.cdiv(H, _GROUP)
        w_ptrs = w_ptr + e64 * stride_we + w_row[None, :] * stride_wn + offs_k[:, None] * stride_wk
        ws_ptrs = ws_ptr + e64 * stride_se + (w_row // SCALE_BN) * stride_sn
        acc = _acc_zeros(BLOCK_M, 2 * _GROUP, SWAP_AB)
        for kb in range(0, tl.cdiv(H, _GROUP)):
            k_ok = offs_k < H - kb * _GROUP
            a = _load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
            b = _load_cols(w_ptrs, nj_ok, k_ok, EVEN_K, EVEN_N)
            sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            sb = tl.load(ws_ptrs + kb * stride_sk, mask=nj_ok, other=0.0)
            acc = _scaled_block_dot(a, b, sa, sb, acc, SWAP_AB)
            a_ptrs += _GROUP
            w_ptrs += _GROUP * stride_wk
        if SWAP_AB:
            acc = tl.trans(acc)
        # Same rounding points as the reference: gate/up, then SiLU*up, in the input dtype.
        acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, _GROUP, 2]))
        gate = _cast(acc_g, IN_DTYPE, RNE_FIX).to(tl.float32)
        up = _cast(acc_u, IN_DTYPE, RNE_FIX).to(tl.float32)
        h = _cast(gate / (1.0 + tl.exp(-gate)) * up, IN_DTYPE, RNE_FIX).to(tl.float32)
        offs_n = pid_n * _GROUP + tl.arange(0, _GROUP)
        n_ok = offs_n < I
        act_q, act_s = _quantize_rows(tl.where(n_ok[None, :], h, 0.0), RNE_FIX)
        dst = (start_e + offs_m).to(tl.int64)
        tl.store(actq_ptr + dst[:, None] * I + offs_n[None, :], act_q, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(acts_ptr + dst * tl.cdiv(I, _GROUP) + pid_n, act_s, mask=row_ok)


@triton.jit
def _fp8_gemm2_tile(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of FP8 GEMM2 for expert ``e``: fp32 accumulator, columns, mask.
    Shared by every FP8 GEMM2 epilogue (here and the expert-parallel push in ep_cuda.py)."""
    offs_k = tl.arange(0, _GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    e64 = e.to(tl.int64)
    src = (start_e + offs_m).to(tl.int64)
    a_ptrs = actq_ptr + src[:, None] * I + offs_k[None, :]
    as_ptrs = acts_ptr + src * tl.cdiv(I, _GROUP)
    # (masked by n_ok: TMA tiles of the last expert reach past its scale rows)
    ws_ptrs = ws_ptr + e64 * stride_se + (offs_n // SCALE_BN) * stride_sn
    if USE_TMA:
        row_w = e * H + pid_n * BLOCK_N  # row of w2 viewed as [E*H, I]
    else:
        w_ptrs = w_ptr + e64 * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for kb in range(0, tl.cdiv(I, _GROUP)):
        k_ok = offs_k < I - kb * _GROUP
        a = _load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            # Rows past H spill into the next expert (masked at the store); past the tensor: zeros.
            b = w_desc.load([row_w, kb * _GROUP]).T
        else:
            b = _load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += _GROUP * stride_wk
        sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        sb = tl.load(ws_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
        acc = _scaled_block_dot(a, b, sa, sb, acc, SWAP_AB)
        a_ptrs += _GROUP
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc, offs_n, n_ok


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm2_kernel(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    E_PAD: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = _expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        acc, offs_n, n_ok = _fp8_gemm2_tile(
            actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
            SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB,
        )
        _scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, RNE_FIX)


# ----------------------------------------------------------------------------------------------
# Configuration: a function of static shapes only (tokens, top_k, experts, hidden, intermediate).
# ----------------------------------------------------------------------------------------------


def pick_configs_fp8(tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> tuple[dict, dict]:
    """(GEMM1 config, GEMM2 config); depends on shapes only, never on device values.

    Fixed by the format: BLOCK_K = 128 (one scale block per dot) and GEMM1's column tile = 128 (one
    activation group), so the K order never depends on the batch. Each K block keeps its dot result
    beside the fp32 accumulator, so a ``[BM, BN]`` tile holds ``2*BM*BN/threads`` fp32 registers per
    thread; the warps keep that at 128 (GEMM1's fused gate/up tile is 256 wide: 8 warps at BM = 64).
    Compiled for sm_90a (Triton 3.9, tests/test_triton_moe_fp8_compile.py) these configs use 216-228
    registers and do not spill; the 256-per-thread variants (GEMM1 BM=128 at 8 warps or BM=64 at 4,
    GEMM2 128x256 at 8) spill. Regimes by average rows per expert: up to 16, operands swapped
    (``SWAP_AB``, weight columns on wgmma's M side, 16- or 32-row token tiles); up to 48 rows, weight
    streaming with 64-row tiles (GEMM2 columns narrowed until >= 264 programs read weights, deeper
    pipelines); beyond, 128-row GEMM2 tiles and grouped program order. Timed on an H200 in
    loadtest/results/layer_bench_fp8.md.
    """
    avg = tokens * top_k / max(num_local, 1)
    if avg <= 48:
        busy = max(1, min(tokens * top_k, num_local))
        swap = avg <= 16
        bn2 = 128
        while bn2 > (64 if swap else 32) and busy * triton.cdiv(hidden, bn2) < 264:
            bn2 //= 2
        if swap:
            # As triton_moe's decode regime: weight columns on wgmma's M side, 16- or 32-row token
            # tiles, so the shared memory holds weight tiles and GEMM1 fits 6 stages (34-36 KB each).
            # Sweeps at 19e0e05 and 1ff7aa2 (git history: loadtest/results/sweep_fp8_swap_19e0e05.log at bc6ca55, git history: loadtest/results/sweep_fp8_m32_1ff7aa2.log at d7a715b,
            # DeepSeek-V3 and Kimi-K2, 1-512 tokens): 12-19% faster than 64-row tiles; 16 rows best up
            # to 10.7 rows per expert, 32 rows at 16 (where 16-row tiles split more experts in two).
            bm = 16 if avg <= 12 else 32
            g1 = dict(BLOCK_M=bm, num_warps=4, num_stages=6, GROUP_M=1, SWAP_AB=True)
            g2 = dict(BLOCK_M=bm, BLOCK_N=bn2, num_warps=4, num_stages=5, USE_TMA=True, GROUP_M=1, SWAP_AB=True)
        else:
            g1 = dict(BLOCK_M=64, num_warps=8, num_stages=4, GROUP_M=1)
            g2 = dict(BLOCK_M=64, BLOCK_N=bn2, num_warps=4, num_stages=5, USE_TMA=True, GROUP_M=1)
    else:
        g1 = dict(BLOCK_M=64, num_warps=8, num_stages=3, GROUP_M=4)
        g2 = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, USE_TMA=True, GROUP_M=4)
    return g1, g2


def kernel_variants_fp8(tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> tuple:
    """As ``triton_moe.kernel_variants``, for ``fused_moe_fp8_triton``."""
    g1, g2 = pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    return tuple(tuple(sorted(d.items())) for d in (schedule_block(tokens * top_k), g1, g2))


# ----------------------------------------------------------------------------------------------
# Launch steps (shared by fused_moe_fp8_triton and the expert-parallel workspace in ep_cuda.py)
# ----------------------------------------------------------------------------------------------

QROWS = 32  # tokens per quantization program


def quantize_programs(tokens: int, hidden: int) -> int:
    """Programs of the quantization pass (``_quantize_tile``) for ``tokens`` rows of ``hidden``."""
    return triton.cdiv(tokens, QROWS) * triton.cdiv(hidden, GROUP)


def launch_fp8_schedule_quantize(
    x: torch.Tensor,
    xq: torch.Tensor,
    xs: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    counts: torch.Tensor,
    sorted_rows: torch.Tensor,
    num_local: int,
    num_global: int,
    *,
    pdl: bool | None = None,
    interpret: bool,
) -> None:
    """Launch 1: ``triton_moe``'s schedule over ``topk_ids`` (programs ``< num_local``) and the
    per-token 1 x 128 quantization of ``x`` into ``xq`` / ``xs`` (the other programs)."""
    tokens, hidden = x.shape
    launch_schedule(
        topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
        kernel=_fp8_schedule_quantize_kernel, extra_programs=quantize_programs(tokens, hidden),
        extra_args=(x, xq, xs, tokens, hidden, x.stride(0), x.stride(1)), QROWS=QROWS, RNE_FIX=interpret,
        pdl=pdl,
    )


def launch_fp8_gemm1(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    act_q: torch.Tensor,
    act_s: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    top_k: int,
    config: dict,
    *,
    pdl: bool | None = None,
    in_dtype: torch.dtype,
    scale_bn: int,
    interpret: bool,
) -> None:
    """``_fp8_gemm1_kernel``: for the ``i``-th scheduled row ``t * top_k + k`` (``rows`` of them at
    most), ``silu(gate) * up`` of quantized token row ``xq[t]`` (scales ``xs[t]``; both contiguous
    ``[*, H]`` / ``[*, cdiv(H, 128)]``), rounded as ``in_dtype``, quantized into ``act_q[i]`` /
    ``act_s[i]``. ``config`` is GEMM1's entry of ``pick_configs_fp8``; ``w13`` has >= 1 expert."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g = dict(config)
    g.setdefault("GROUP_M", 1)
    g.setdefault("SWAP_AB", False)
    num_m = _max_row_tiles(rows, num_local, g["BLOCK_M"])
    _fp8_gemm1_kernel[(num_m * triton.cdiv(inter, GROUP),)](
        xq, xs, w13, w13_scale, act_q, act_s, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w13.stride(0), w13.stride(1), w13.stride(2), w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        IN_DTYPE=_TL_DTYPES[in_dtype], TOPK=top_k, E_PAD=_e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=hidden % GROUP == 0, EVEN_N=inter % GROUP == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl), **g,
    )


def launch_fp8_gemm2(
    act_q: torch.Tensor,
    act_s: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    y: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    config: dict,
    *,
    pdl: bool | None = None,
    scale_bn: int,
    interpret: bool,
    kernel=None,
    extra_args: tuple = (),
    **extra_constexprs,
) -> None:
    """``_fp8_gemm2_kernel``: ``y[row] = dequant(act_q[i]) @ dequant(w2[e]).T`` rounded to ``y``'s
    dtype, for the ``i``-th scheduled row. ``kernel`` replaces it by a kernel with the same leading
    parameters (the expert-parallel push epilogue), ``extra_args`` / ``extra_constexprs`` its own."""
    num_local, hidden, inter = w2.shape
    g = _gemm_config(config, act_q, interpret, GROUP_M=1, SWAP_AB=False)
    bn = g["BLOCK_N"]
    w2_desc = _w2_operand(w2, g, GROUP)
    num_m = _max_row_tiles(rows, num_local, g["BLOCK_M"])
    (_fp8_gemm2_kernel if kernel is None else kernel)[(num_m * triton.cdiv(hidden, bn),)](
        act_q, act_s, w2, w2_desc, w2_scale, y, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), w2.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        *extra_args,
        E_PAD=_e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=inter % GROUP == 0, EVEN_N=hidden % bn == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl),
        **extra_constexprs, **g,
    )


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def fused_moe_fp8_triton(
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
    block_shape=BLOCK_SHAPE,
    pdl: bool | None = None,
    _configs: tuple[dict, dict] | None = None,
) -> torch.Tensor:
    """The FP8 MoE layer's routed experts (see ``fp8.py``) in four Triton launches.

    No host synchronisation: ids' values are checked by the schedule kernel, as in
    ``fused_moe_triton``, and ``pdl`` as there. ``_configs`` overrides the block sizes (benchmark sweeps).
    """
    bad_ids.raise_if_reported(hidden_states.device)
    bn_scale, bk_scale = check_fused_moe_fp8_args(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation,
        block_shape, check_values=False,
    )
    if bk_scale != GROUP:
        raise ValueError(f"the Triton FP8 kernels need a K block of {GROUP} (block_shape[1]), got {bk_scale}")
    out, layer = _layer_setup(hidden_states, w13, topk_ids, expert_map)
    if layer is None:
        return out
    tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows = layer
    dtype, dev = hidden_states.dtype, hidden_states.device
    interpret = _interpreting()
    pdl = knob("pdl", pdl)
    xq = torch.empty((tokens, hidden), dtype=FP8_DTYPE, device=dev)
    xs = torch.empty((tokens, triton.cdiv(hidden, GROUP)), dtype=torch.float32, device=dev)
    act_q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=dev)
    act_s = torch.empty((rows, triton.cdiv(inter, GROUP)), dtype=torch.float32, device=dev)
    y = torch.empty((rows, hidden), dtype=dtype, device=dev)

    launch_fp8_schedule_quantize(
        hidden_states, xq, xs, topk_ids, expert_map, counts, sorted_rows, num_local, num_global, interpret=interpret, pdl=pdl
    )
    g1, g2 = _configs if _configs is not None else pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    launch_fp8_gemm1(
        xq, xs, w13, w13_scale, act_q, act_s, sorted_rows, counts, rows, top_k, g1,
        in_dtype=dtype, scale_bn=bn_scale, interpret=interpret, pdl=pdl,
    )
    launch_fp8_gemm2(act_q, act_s, w2, w2_scale, y, sorted_rows, counts, rows, g2, scale_bn=bn_scale, interpret=interpret, pdl=pdl)
    launch_combine(y, out, topk_ids, topk_weights, expert_map, num_local, num_global, interpret=interpret, pdl=pdl)
    return out
