"""Triton fused MoE with block-scaled FP8 experts (Hopper FP8 tensor cores), one GPU.

Computes the function of ``fp8.fused_moe_fp8_reference`` with the structure of ``cuda/moe.py``
(whose schedule, tile mapping and combine kernels it reuses) in four launches, no host sync:

1. ``_fp8_schedule_quantize_kernel`` -- programs ``< E_local`` run ``cuda.moe``'s prefix-sum
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
   is why GEMM1's column tile is 128, or 64 or 32 with two or four programs per group of which the
   last to finish quantizes the whole group (``BLOCK_N``) -- into ``act_q`` (e4m3) and ``act_s`` (fp32).
3. ``_fp8_gemm2_kernel`` -- grouped GEMM over ``w2`` on ``act_q`` with the same per-K-block scaling,
   each output row rounded to the input dtype and scattered to its (token, k) slot of ``y``.
4. ``cuda/moe.py``'s ``_moe_combine_kernel`` -- fp32 weighted top-k sum in k order.

With ``ONE_LAUNCH`` in GEMM1's config (a sweep variant, not a default: not yet measured), steps 2
and 3 run as one launch, ``_fp8_decode_experts_kernel``, as the bf16 decode kernel does.

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
from ..fp8 import BLOCK_SHAPE, FP8_DTYPE, check_fused_moe_fp8_args
from .configs import pick_configs_fp8
from .fp8_tiles import GROUP, fp8_gemm2_tile, quantize_rows, quantize_tile, scaled_block_dot
from .launch import check_heavy_m, e_pad, gemm_config, interpreting, layer_setup, max_row_tiles, pdl_launch, w2_operand
from .moe import (
    DECODE_MAX_POLLS, SYNC_ERROR, SYNC_TICKET, SYNC_TILES, decode_sync_words, launch_combine, launch_schedule,
)
from .tiles import (
    acc_zeros, cast, grid_dependency, load_cols, load_rows, moe_schedule_kernel, program_tile, scatter_rows, tile_of,
    tile_rows, two_height_expert_tile, wait_count, zero_words,
)

__all__ = [
    "fp8_decode_sync_words", "fused_moe_fp8_triton", "launch_fp8_decode_experts", "launch_fp8_gemm1", "launch_fp8_gemm2",
    "launch_fp8_schedule_quantize", "quantize_programs", "split_group_tickets",
]

_GROUP = tl.constexpr(GROUP)
_SYNC_TICKET, _SYNC_ERROR, _SYNC_TILES = tl.constexpr(SYNC_TICKET), tl.constexpr(SYNC_ERROR), tl.constexpr(SYNC_TILES)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows", "tokens", "num_tickets"])  # per-call counts, as moe_schedule_kernel
def _fp8_schedule_quantize_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, ticket_ptr, num_tickets,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, QROWS: tl.constexpr,
    RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < num_local:
        moe_schedule_kernel(
            topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
            num_rows, num_global, num_local, stride_it, stride_ik, TOPK, HAS_MAP, BLOCK, False,
        )
    else:
        if pid == num_local:  # GEMM1's group tickets (split column tiles), zero before GEMM1 starts
            zero_words(ticket_ptr, num_tickets, BLOCK)
        quantize_tile(pid - num_local, x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, QROWS, RNE_FIX)


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm1_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    IN_DTYPE: tl.constexpr, TOPK: tl.constexpr, E_PAD: tl.constexpr, SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
    GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
    HEAVY_M: tl.constexpr = 0, HEAVY_STAGES: tl.constexpr = None,
):
    """``BLOCK_N`` intermediate columns (gate and up) per program: 128, one activation group, or
    64 or 32, where two or four programs share a group: each writes its ``silu(gate) * up``
    part to ``acth`` and takes a ticket of the group (``ticket_ptr``: int32 per (row tile, group),
    zeroed by the schedule launch), and the last to arrive (acquire after the other's release)
    quantizes the whole group from ``acth``. Every element's arithmetic is the 128-column tile's
    and the group's maximum is exact, so all give the same bits; the split multiplies the programs
    that read weights where one token's few experts would leave most SMs idle.

    ``HEAVY_M`` (0: off): an expert with more than ``BLOCK_M`` rows (a hot expert) runs in tiles of
    ``HEAVY_M`` rows with ``HEAVY_STAGES``-deep pipelines, so it reads each weight tile once per
    ``HEAVY_M`` rows instead of once per ``BLOCK_M`` (``two_height_tile_of``, from the counts on the
    device); a row's arithmetic does not depend on its tile's height, so neither do its bits."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e, heavy = two_height_expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, BLOCK_N, E_PAD, BLOCK_M, GROUP_M, HEAVY_M
    )
    if in_use:
        # (nested: a constexpr and a tensor cannot share one condition)
        if HEAVY_M > 0:
            if heavy:
                _fp8_gemm1_tile(
                    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr,
                    e, m0, count_e, start_e, pid_n, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                    stride_sk, IN_DTYPE, TOPK, SCALE_BN, HEAVY_M, BLOCK_N, EVEN_K, EVEN_N, SWAP_AB, RNE_FIX, HEAVY_STAGES,
                )
            else:
                _fp8_gemm1_tile(
                    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr,
                    e, m0, count_e, start_e, pid_n, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn,
                    stride_sk, IN_DTYPE, TOPK, SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, SWAP_AB, RNE_FIX,
                )
        else:
            _fp8_gemm1_tile(
                xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr,
                e, m0, count_e, start_e, pid_n, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                IN_DTYPE, TOPK, SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, SWAP_AB, RNE_FIX,
            )


@triton.jit
def _fp8_gemm1_tile(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr,
    e, m0, count_e, start_e, pid_n, H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    IN_DTYPE: tl.constexpr, TOPK: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    """Column tile ``pid_n`` of GEMM1 for the rows ``m0``.. of expert ``e`` (``_fp8_gemm1_kernel``).
    ``STAGES``: the K loop's pipeline depth (None: the kernel's ``num_stages``)."""
    offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    tok = (rows // TOPK).to(tl.int64)
    offs_k = tl.arange(0, _GROUP)
    # Columns of the B tile interleave gate row n and up row I + n of w13 (one dot for both).
    offs_j = tl.arange(0, 2 * BLOCK_N)
    n_j = pid_n * BLOCK_N + offs_j // 2
    nj_ok = n_j < I
    w_row = n_j + (offs_j % 2) * I
    e64 = e.to(tl.int64)
    a_ptrs = xq_ptr + tok[:, None] * H + offs_k[None, :]
    as_ptrs = xs_ptr + tok * tl.cdiv(H, _GROUP)
    w_ptrs = w_ptr + e64 * stride_we + w_row[None, :] * stride_wn + offs_k[:, None] * stride_wk
    if EVEN_N and BLOCK_N <= SCALE_BN:
        # I % 128 == 0, so the tile's gate rows and its up rows each lie in one weight block: two scales a K
        # block, spread over the interleaved columns in registers (not a scale load per column).
        wsg_ptr = ws_ptr + e64 * stride_se + (pid_n * BLOCK_N // SCALE_BN) * stride_sn
        wsu_ptr = ws_ptr + e64 * stride_se + ((I + pid_n * BLOCK_N) // SCALE_BN) * stride_sn
        gate_col = offs_j % 2 == 0
    else:
        ws_ptrs = ws_ptr + e64 * stride_se + (w_row // SCALE_BN) * stride_sn
    acc = acc_zeros(BLOCK_M, 2 * BLOCK_N, SWAP_AB)
    for kb in tl.range(0, tl.cdiv(H, _GROUP), num_stages=STAGES):
        k_ok = offs_k < H - kb * _GROUP
        a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        b = load_cols(w_ptrs, nj_ok, k_ok, EVEN_K, EVEN_N)
        sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
        if EVEN_N and BLOCK_N <= SCALE_BN:
            sb = tl.where(gate_col, tl.load(wsg_ptr + kb * stride_sk), tl.load(wsu_ptr + kb * stride_sk))
        else:
            sb = tl.load(ws_ptrs + kb * stride_sk, mask=nj_ok, other=0.0)
        acc = scaled_block_dot(a, b, sa, sb, acc, SWAP_AB)
        a_ptrs += _GROUP
        w_ptrs += _GROUP * stride_wk
    if SWAP_AB:
        acc = tl.trans(acc)
    # Same rounding points as the reference: gate/up, then SiLU*up, in the input dtype.
    acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
    gate = cast(acc_g, IN_DTYPE, RNE_FIX).to(tl.float32)
    up = cast(acc_u, IN_DTYPE, RNE_FIX).to(tl.float32)
    h = cast(gate / (1.0 + tl.exp(-gate)) * up, IN_DTYPE, RNE_FIX)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    dst = (start_e + offs_m).to(tl.int64)
    num_groups = tl.cdiv(I, _GROUP)
    if BLOCK_N == _GROUP:
        act_q, act_s = quantize_rows(tl.where(n_ok[None, :], h.to(tl.float32), 0.0), RNE_FIX)
        tl.store(actq_ptr + dst[:, None] * I + offs_n[None, :], act_q, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(acts_ptr + dst * num_groups + pid_n, act_s, mask=row_ok)
    else:
        tl.store(acth_ptr + dst[:, None] * I + offs_n[None, :], h, mask=row_ok[:, None] & n_ok[None, :])
        grp = pid_n // (_GROUP // BLOCK_N)
        parts = tl.minimum(_GROUP // BLOCK_N, tl.cdiv(I - grp * _GROUP, BLOCK_N))  # (the last group may be short)
        tl.debug_barrier()  # every thread's acth stores are ordered before the release below
        # A tile's first sorted row names it (tiles of one call never share one).
        arrived = tl.atomic_add(ticket_ptr + (start_e + m0) * num_groups + grp, 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            tl.debug_barrier()
            offs_g = grp * _GROUP + tl.arange(0, _GROUP)
            ok = row_ok[:, None] & (offs_g < I)[None, :]
            # (.cg: read from L2, where the other program's stores are, not this SM's L1)
            hg = tl.load(acth_ptr + dst[:, None] * I + offs_g[None, :], mask=ok, other=0.0, cache_modifier=".cg")
            act_q, act_s = quantize_rows(hg.to(tl.float32), RNE_FIX)
            tl.store(actq_ptr + dst[:, None] * I + offs_g[None, :], act_q, mask=ok)
            tl.store(acts_ptr + dst * num_groups + grp, act_s, mask=row_ok)


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm2_kernel(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    E_PAD: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr, HALF_TAIL: tl.constexpr = False,
    HEAVY_M: tl.constexpr = 0, HEAVY_STAGES: tl.constexpr = None,
):
    """``HALF_TAIL``: an expert's last tile, when half a tile holds its rows, runs ``BLOCK_M // 2``
    rows (less padding; a row's bits do not depend on the tile's height), as bf16's GEMM2.
    ``HEAVY_M`` / ``HEAVY_STAGES``: hot experts' tiles, as ``_fp8_gemm1_kernel``'s."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e, heavy = two_height_expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M, HEAVY_M
    )
    if in_use:
        # (nested: a constexpr and a tensor cannot share one condition)
        if HEAVY_M > 0:
            if heavy:
                _fp8_gemm2_rows(
                    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
                    H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                    SCALE_BN, HEAVY_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX, HEAVY_STAGES,
                )
            else:
                _fp8_gemm2_block_rows(
                    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
                    H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                    SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX, HALF_TAIL,
                )
        else:
            _fp8_gemm2_block_rows(
                actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
                H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX, HALF_TAIL,
            )


@triton.jit
def _fp8_gemm2_block_rows(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr,
    HALF_TAIL: tl.constexpr,
):
    """A ``BLOCK_M``-row tile, or with ``HALF_TAIL`` an expert's last tile at ``BLOCK_M // 2`` rows."""
    if HALF_TAIL:
        if count_e - m0 <= BLOCK_M // 2:
            _fp8_gemm2_rows(
                actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
                H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                SCALE_BN, BLOCK_M // 2, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX,
            )
        else:
            _fp8_gemm2_rows(
                actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
                H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX,
            )
    else:
        _fp8_gemm2_rows(
            actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e,
            H, I, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
            SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, RNE_FIX,
        )


@triton.jit
def _fp8_gemm2_rows(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr,
    STAGES: tl.constexpr = None,
):
    offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    acc, offs_n, n_ok = fp8_gemm2_tile(
        actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
        stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
        SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB, STAGES,
    )
    scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, RNE_FIX)


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_decode_experts_kernel(
    xq_ptr, xs_ptr, w13_ptr, w13s_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr, counts_ptr,
    w2_ptr, w2_desc, w2s_ptr, y_ptr, sync_ptr,
    num_local, H, I, num_m, max_polls,
    stride_w13e, stride_w13n, stride_w13k, stride_s13e, stride_s13n, stride_s13k,
    stride_w2e, stride_w2n, stride_w2k, stride_s2e, stride_s2n, stride_s2k,
    IN_DTYPE: tl.constexpr, TOPK: tl.constexpr, E_PAD: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr, EVEN_K1: tl.constexpr, EVEN_N1: tl.constexpr, GROUP_M1: tl.constexpr,
    BLOCK_N2: tl.constexpr, EVEN_K2: tl.constexpr, EVEN_N2: tl.constexpr, GROUP_M2: tl.constexpr,
    USE_TMA2: tl.constexpr, SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    """GEMM1 and GEMM2 in one launch at decode sizes, as ``cuda.moe``'s ``_moe_decode_experts_kernel``
    (its comments say why no wait can hang): work items by an atomic ticket, GEMM1's column tiles
    first; each counts itself done for its row tile after its stores (the last of a split group
    after quantizing the group, so a full count means every group of the row tile is in ``act_q``);
    a GEMM2 item waits, bounded by ``max_polls``, for its row tile's count, and on running out sets
    the error word and writes NaN rows. The tiles' arithmetic is the two launches', so the bits are."""
    grid_dependency(PDL)
    item = tl.atomic_add(sync_ptr + _SYNC_TICKET, 1, sem="relaxed")
    num_n1 = tl.cdiv(I, BLOCK_N1)
    num_n2 = tl.cdiv(H, BLOCK_N2)
    gemm1_items = num_m * num_n1
    if item < gemm1_items:
        pid_m, pid_n = program_tile(item, num_m, num_n1, GROUP_M1)
        total, e, m0, count_e, start_e = tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M)
        if pid_m < total:
            _fp8_gemm1_tile(
                xq_ptr, xs_ptr, w13_ptr, w13s_ptr, actq_ptr, acts_ptr, acth_ptr, ticket_ptr, sorted_rows_ptr,
                e, m0, count_e, start_e, pid_n, H, I,
                stride_w13e, stride_w13n, stride_w13k, stride_s13e, stride_s13n, stride_s13k,
                IN_DTYPE, TOPK, SCALE_BN, BLOCK_M, BLOCK_N1, EVEN_K1, EVEN_N1, SWAP_AB, RNE_FIX,
            )
            tl.debug_barrier()  # every thread's stores are ordered before the release below
            tl.atomic_add(sync_ptr + _SYNC_TILES + pid_m, 1, sem="release", scope="gpu")
    elif item < gemm1_items + num_m * num_n2:  # (a ticket past the last item does nothing)
        pid_m, pid_n = program_tile(item - gemm1_items, num_m, num_n2, GROUP_M2)
        total, e, m0, count_e, start_e = tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M)
        if pid_m < total:
            done = wait_count(sync_ptr + _SYNC_TILES + pid_m, num_n1, max_polls)
            if done < num_n1:
                tl.atomic_xchg(sync_ptr + _SYNC_ERROR, 1, sem="relaxed")
                offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
                offs_n = pid_n * BLOCK_N2 + tl.arange(0, BLOCK_N2)
                nan = tl.full([BLOCK_M, BLOCK_N2], float("nan"), dtype=tl.float32)
                scatter_rows(nan, rows, row_ok, offs_n, offs_n < H, y_ptr, H, RNE_FIX)
            else:
                _fp8_gemm2_rows(
                    actq_ptr, acts_ptr, w2_ptr, w2_desc, w2s_ptr, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n,
                    e, H, I, stride_w2e, stride_w2n, stride_w2k, stride_s2e, stride_s2n, stride_s2k,
                    SCALE_BN, BLOCK_M, BLOCK_N2, EVEN_K2, EVEN_N2, USE_TMA2, SWAP_AB, RNE_FIX,
                )


# ----------------------------------------------------------------------------------------------
# Launch steps (shared by fused_moe_fp8_triton and the expert-parallel workspace in cuda/ep.py)
# ----------------------------------------------------------------------------------------------

QROWS = 32  # tokens per quantization program


def quantize_programs(tokens: int, hidden: int) -> int:
    """Programs of the quantization pass (``quantize_tile``) for ``tokens`` rows of ``hidden``."""
    return triton.cdiv(tokens, QROWS) * triton.cdiv(hidden, GROUP)


def split_group_tickets(rows: int, inter: int) -> int:
    """Int32 tickets of GEMM1's split column tiles (``BLOCK_N`` < 128): one per (row, group), as a
    tile's first sorted row names it."""
    return rows * triton.cdiv(inter, GROUP)


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
    tickets: torch.Tensor | None = None,
    pdl: bool | None = None,
    interpret: bool,
) -> None:
    """Launch 1: ``cuda.moe``'s schedule over ``topk_ids`` (programs ``< num_local``) and the
    per-token 1 x 128 quantization of ``x`` into ``xq`` / ``xs`` (the other programs; the first
    of them also zeroes ``tickets``, GEMM1's split-tile tickets, where given)."""
    tokens, hidden = x.shape
    launch_schedule(
        topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
        kernel=_fp8_schedule_quantize_kernel, extra_programs=quantize_programs(tokens, hidden),
        extra_args=(x, xq, xs, tokens, hidden, x.stride(0), x.stride(1),
                    counts if tickets is None else tickets, 0 if tickets is None else tickets.numel()),
        QROWS=QROWS, RNE_FIX=interpret, pdl=pdl,
    )


def _check_group_parts(act_h: torch.Tensor | None, rows: int, inter: int, in_dtype: torch.dtype) -> None:
    """Split GEMM1 tiles write their group parts to ``act_h``: ``[>= rows, inter]`` in the input dtype."""
    if act_h is None or act_h.dtype != in_dtype or act_h.dim() != 2 or act_h.shape[0] < rows or act_h.shape[1] != inter:
        raise ValueError(f"split FP8 GEMM1 tiles (BLOCK_N 64 or 32) need act_h [>= {rows}, {inter}] in {in_dtype}")


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
    act_h: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    pdl: bool | None = None,
    in_dtype: torch.dtype,
    scale_bn: int,
    interpret: bool,
) -> None:
    """``_fp8_gemm1_kernel``: for the ``i``-th scheduled row ``t * top_k + k`` (``rows`` of them at
    most), ``silu(gate) * up`` of quantized token row ``xq[t]`` (scales ``xs[t]``; both contiguous
    ``[*, H]`` / ``[*, cdiv(H, 128)]``), rounded as ``in_dtype``, quantized into ``act_q[i]`` /
    ``act_s[i]``. ``config`` is GEMM1's entry of ``pick_configs_fp8``; ``w13`` has >= 1 expert.
    With ``BLOCK_N`` 64 or 32 in it, ``act_h`` (``[>= rows, I]``, ``in_dtype``) holds the
    group parts and ``tickets`` (``split_group_tickets`` int32 words) must be zero, as the
    schedule launch leaves them."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g = dict(config)
    g.setdefault("GROUP_M", 1)
    g.setdefault("SWAP_AB", False)
    bn = g.setdefault("BLOCK_N", GROUP)
    if bn != GROUP:
        if bn not in (GROUP // 2, GROUP // 4):
            raise ValueError(f"FP8 GEMM1's BLOCK_N is 128 (one activation group), 64 or 32 (two or four programs a group): {config}")
        _check_group_parts(act_h, rows, inter, in_dtype)
        if tickets is None or tickets.dtype != torch.int32 or tickets.numel() < split_group_tickets(rows, inter):
            raise ValueError(f"split FP8 GEMM1 tiles (BLOCK_N 64 or 32) need {split_group_tickets(rows, inter)} "
                             "int32 tickets (split_group_tickets)")
    check_heavy_m(g)
    num_m = max_row_tiles(rows, num_local, g["BLOCK_M"])
    _fp8_gemm1_kernel[(num_m * triton.cdiv(inter, bn),)](
        xq, xs, w13, w13_scale, act_q, act_s, act_q if act_h is None else act_h, counts if tickets is None else tickets,
        sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w13.stride(0), w13.stride(1), w13.stride(2), w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        IN_DTYPE=_TL_DTYPES[in_dtype], TOPK=top_k, E_PAD=e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=hidden % GROUP == 0, EVEN_N=inter % GROUP == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl, interpret), **g,
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
    g = gemm_config(config, act_q, interpret, GROUP_M=1, SWAP_AB=False)
    check_heavy_m(g)
    if kernel is not None:  # the expert-parallel push epilogue always runs full tiles of one height
        for key in ("HALF_TAIL", "HEAVY_M", "HEAVY_STAGES"):
            g.pop(key, None)
    bn = g["BLOCK_N"]
    w2_desc = w2_operand(w2, g, GROUP)
    num_m = max_row_tiles(rows, num_local, g["BLOCK_M"])
    (_fp8_gemm2_kernel if kernel is None else kernel)[(num_m * triton.cdiv(hidden, bn),)](
        act_q, act_s, w2, w2_desc, w2_scale, y, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), w2.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        *extra_args,
        E_PAD=e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=inter % GROUP == 0, EVEN_N=hidden % bn == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl, interpret),
        **extra_constexprs, **g,
    )


def fp8_decode_sync_words(rows: int, num_local: int, inter: int, g1: dict) -> tuple[int, int]:
    """Int32 words of a one-launch FP8 decode call: (``cuda.moe``'s decode sync words, GEMM1's split
    group tickets after them, 0 without the split), all zeroed by the schedule launch."""
    split = split_group_tickets(rows, inter) if g1.get("BLOCK_N", GROUP) != GROUP else 0
    return decode_sync_words(rows, num_local, g1["BLOCK_M"]), split


def launch_fp8_decode_experts(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    act_q: torch.Tensor,
    act_s: torch.Tensor,
    act_h: torch.Tensor | None,
    y: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    sync: torch.Tensor,
    rows: int,
    top_k: int,
    configs: tuple[dict, dict],
    *,
    pdl: bool | None = None,
    in_dtype: torch.dtype,
    scale_bn: int,
    interpret: bool,
    max_polls: int = DECODE_MAX_POLLS,
) -> None:
    """``_fp8_decode_experts_kernel``: ``launch_fp8_gemm1`` then ``launch_fp8_gemm2`` as one launch
    (``ONE_LAUNCH`` in GEMM1's config). ``sync``: ``sum(fp8_decode_sync_words(...))`` int32 words,
    zero (the schedule launch's tickets); ``act_h`` as ``launch_fp8_gemm1``'s for split GEMM1 tiles."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g1 = dict(configs[0])
    g2 = gemm_config(configs[1], act_q, interpret, GROUP_M=1, SWAP_AB=False)
    bm, bn1, bn2 = g1["BLOCK_M"], g1.get("BLOCK_N", GROUP), g2["BLOCK_N"]
    swap = g1.get("SWAP_AB", False)
    if g1.get("HEAVY_M", 0) or g2.get("HEAVY_M", 0):
        raise ValueError(f"the one-launch FP8 decode kernel has tiles of one height (no HEAVY_M): {configs}")
    if not (swap == g2["SWAP_AB"] and bm == g2["BLOCK_M"] and g1["num_warps"] == g2["num_warps"]):
        raise ValueError(f"one-launch FP8 decode configs need tiles of one height, operand order and warp count: {configs}")
    if bn1 not in (GROUP, GROUP // 2, GROUP // 4):
        raise ValueError(f"FP8 GEMM1's BLOCK_N is 128 (one activation group), 64 or 32: {configs}")
    n_sync, n_tickets = fp8_decode_sync_words(rows, num_local, inter, g1)
    if sync.dtype != torch.int32 or sync.numel() != n_sync + n_tickets:
        raise ValueError(f"sync must be {n_sync + n_tickets} int32 words, got {sync.dtype} [{sync.numel()}]")
    if n_tickets:
        _check_group_parts(act_h, rows, inter, in_dtype)
    w2_desc = w2_operand(w2, g2, GROUP)
    num_m = max_row_tiles(rows, num_local, bm)
    items = num_m * (triton.cdiv(inter, bn1) + triton.cdiv(hidden, bn2))
    _fp8_decode_experts_kernel[(items,)](
        xq, xs, w13, w13_scale, act_q, act_s, act_q if act_h is None else act_h, sync[n_sync:] if n_tickets else sync,
        sorted_rows, counts, w2, w2_desc, w2_scale, y, sync,
        num_local, hidden, inter, num_m, max_polls,
        w13.stride(0), w13.stride(1), w13.stride(2), w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        w2.stride(0), w2.stride(1), w2.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        IN_DTYPE=_TL_DTYPES[in_dtype], TOPK=top_k, E_PAD=e_pad(num_local), SCALE_BN=scale_bn, BLOCK_M=bm,
        BLOCK_N1=bn1, EVEN_K1=hidden % GROUP == 0, EVEN_N1=inter % GROUP == 0, GROUP_M1=g1.get("GROUP_M", 1),
        BLOCK_N2=bn2, EVEN_K2=inter % GROUP == 0, EVEN_N2=hidden % bn2 == 0, GROUP_M2=g2["GROUP_M"],
        USE_TMA2=g2["USE_TMA"], SWAP_AB=swap, RNE_FIX=interpret,
        num_warps=g1["num_warps"], num_stages=g1["num_stages"], **pdl_launch(act_q, pdl, interpret),
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
    configs: tuple[dict, dict] | None = None,
) -> torch.Tensor:
    """The FP8 MoE layer's routed experts (see ``fp8.py``) in four Triton launches.

    No host synchronisation: ids' values are checked by the schedule kernel, as in
    ``fused_moe_triton``, and ``pdl`` as there. ``configs`` overrides the block sizes (benchmark sweeps).
    """
    bad_ids.raise_if_reported(hidden_states.device)
    bn_scale, bk_scale = check_fused_moe_fp8_args(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation,
        block_shape, check_values=False,
    )
    if bk_scale != GROUP:
        raise ValueError(f"the Triton FP8 kernels need a K block of {GROUP} (block_shape[1]), got {bk_scale}")
    out, layer = layer_setup(hidden_states, w13, topk_ids, expert_map)
    if layer is None:
        return out
    tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows = layer
    dtype, dev = hidden_states.dtype, hidden_states.device
    interpret = interpreting()
    pdl = knob("pdl", pdl)
    xq = torch.empty((tokens, hidden), dtype=FP8_DTYPE, device=dev)
    xs = torch.empty((tokens, triton.cdiv(hidden, GROUP)), dtype=torch.float32, device=dev)
    act_q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=dev)
    act_s = torch.empty((rows, triton.cdiv(inter, GROUP)), dtype=torch.float32, device=dev)
    y = torch.empty((rows, hidden), dtype=dtype, device=dev)
    g1, g2 = configs if configs is not None else pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    split = g1.get("BLOCK_N", GROUP) != GROUP
    act_h = torch.empty((rows, inter), dtype=dtype, device=dev) if split else None
    if g1.get("ONE_LAUNCH", False):
        g1 = {k: v for k, v in g1.items() if k != "ONE_LAUNCH"}
        # The decode sync words and the split tickets after them: the schedule launch zeroes all.
        sync = torch.empty(sum(fp8_decode_sync_words(rows, num_local, inter, g1)), dtype=torch.int32, device=dev)
        launch_fp8_schedule_quantize(
            hidden_states, xq, xs, topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
            tickets=sync, interpret=interpret, pdl=pdl,
        )
        launch_fp8_decode_experts(
            xq, xs, w13, w13_scale, w2, w2_scale, act_q, act_s, act_h, y, sorted_rows, counts, sync, rows, top_k,
            (g1, g2), in_dtype=dtype, scale_bn=bn_scale, interpret=interpret, pdl=pdl,
        )
    else:
        tickets = torch.empty(split_group_tickets(rows, inter), dtype=torch.int32, device=dev) if split else None
        launch_fp8_schedule_quantize(
            hidden_states, xq, xs, topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
            tickets=tickets, interpret=interpret, pdl=pdl,
        )
        launch_fp8_gemm1(
            xq, xs, w13, w13_scale, act_q, act_s, sorted_rows, counts, rows, top_k, g1,
            act_h=act_h, tickets=tickets, in_dtype=dtype, scale_bn=bn_scale, interpret=interpret, pdl=pdl,
        )
        launch_fp8_gemm2(act_q, act_s, w2, w2_scale, y, sorted_rows, counts, rows, g2, scale_bn=bn_scale,
                         interpret=interpret, pdl=pdl)
    launch_combine(y, out, topk_ids, topk_weights, expert_map, num_local, num_global, interpret=interpret, pdl=pdl)
    return out
