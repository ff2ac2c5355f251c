"""Triton fused MoE for one GPU: schedule, grouped GEMM1 (+SiLU*up), grouped GEMM2, top-k combine.

Computes exactly the function of ``reference.py`` (same rounding points: gate/up and the activation
rounded to the input dtype, each expert output rounded to the input dtype, the top-k sum in fp32 in
k order) in four launches and with no host synchronisation:

1. ``moe_schedule_kernel`` -- one program per local expert ``e``. It scans all ``T*K`` (token, k)
   rows twice: first it counts the rows whose local id is ``< e`` (its segment start) and ``== e``
   (its count); then it writes the row indices of expert ``e`` into ``sorted_rows[start + rank]``,
   the rank coming from a prefix sum (``tl.cumsum``) over the rows in order. Positions are
   therefore decided by prefix sums only (no atomics), each expert's rows are in token order, and
   no program depends on another one, so no grid-wide synchronisation is needed. Redundant reads
   (every program scans every id) hit L2: ``E * T * K * 4`` bytes, ~100 MB at 8192 tokens, a few
   microseconds.
2. ``_moe_gemm1_kernel`` -- grouped GEMM over ``w13``: a program is one (row tile, column tile).
   Row tiles are numbered expert by expert; each program maps its tile id to (expert, first row)
   from the per-expert counts (a cumsum over at most 512 experts, in registers). The grid is the
   worst case (``T*K // BM + min(E, T*K)`` row tiles) and surplus programs exit at once. The A rows
   are gathered from ``hidden_states`` by token index inside the K loop (no permuted copy). A
   column tile's gate rows and up rows of ``w13`` form one ``2*BLOCK_N``-wide B tile (one TMA box)
   so one dot makes both. The epilogue computes ``silu(gate) * up`` in fp32 and writes the
   activation in expert order.
3. ``_moe_gemm2_kernel`` -- grouped GEMM over ``w2`` (weight tiles by TMA) reading the activation
   rows in expert order and scattering each output row to its (token, k) slot of ``y``
   (``[T*K, H]``), so the combine reads a token's k rows contiguously.
4. ``_moe_combine_kernel`` -- ``out[t] = sum_k w[t,k] * y[t,k]`` in fp32, k in order; rows whose
   expert is not local (or whose id is out of range) are not read and contribute zero.

At decode sizes (``one_launch_decode``) steps 2 and 3 are one launch, ``_moe_decode_experts_kernel``:
its programs draw GEMM1 tiles, then GEMM2 tiles, from an atomic ticket, and a GEMM2 tile waits inside
the kernel until the GEMM1 tiles of its rows are done, so there is no grid-wide barrier between the
GEMMs (the schedule launch zeroes the kernel's sync words).

Every kernel is launched with programmatic dependent launch on Hopper and newer (``pdl_launch``):
it waits for the previous kernel in the stream before touching memory (``grid_dependency``) and
lets the next one's programs start early, which hides the launch gaps (~2 us per call at decode
sizes, loadtest/JOURNAL.md#programmatic-dependent-launch-55183c9-2026-11-30); ``MOK_PDL=0``
launches them the ordinary way.

Batch invariance: every output element of a GEMM accumulates its K dimension in the same order
(wgmma's 16-deep k-steps, in increasing k, chained on one fp32 accumulator, no split-K) whatever the
number of rows; the block sizes are chosen from static shape information. Every regime runs the
same matrix instruction on Hopper (wgmma): its M side is the token rows (``BLOCK_M >= 64``) or, with
``SWAP_AB`` at decode sizes, the weight columns (>= 64), and neither the K block (64 or 128) nor the
operand order changes a product or the order of the sums. The GPU tests check bitwise that a token
alone equals the same token inside batches of 7, 128 and 4096, and that every regime's tiles give
the same bits.

Unrouted slots (id -1), out-of-range ids (``< -1`` or ``>= E_global``) and expert_map values
outside ``[0, E_local)`` are treated as "not local" by every kernel (masked, never dereferenced).
The schedule kernel reports out-of-range values (not -1) to the host without a synchronisation,
and the next call raises ``ValueError`` naming them (``bad_ids.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import bad_ids
from ..env import knob
from ..reference import check_fused_moe_args
from .configs import combine_block, pick_configs, schedule_block
from .launch import (
    check_heavy_m, e_pad, gemm_config, interpreting, layer_setup, max_row_tiles, pdl_launch, w13_operand, w2_operand,
)
from .tiles import (
    cast,
    gemm1_tile,
    gemm2_tile,
    grid_dependency,
    moe_schedule_kernel,
    now,
    program_tile,
    scatter_rows,
    tile_rows,
    two_height_expert_tile,
    two_height_tile_of,
    wait_count,
    zero_words,
)

__all__ = [
    "decode_items", "decode_sync_words", "fused_moe_triton", "launch_combine", "launch_decode_experts", "launch_gemm1",
    "launch_gemm2", "launch_schedule", "one_launch_decode", "operand_bytes",
]


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count, see moe_schedule_kernel
def _moe_gemm1_kernel(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, HALF_TAIL: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr, HEAVY_M: tl.constexpr = 0, HEAVY_STAGES: tl.constexpr = None,
):
    """``HEAVY_M`` (0: off): an expert with more than ``BLOCK_M`` rows (a hot expert) runs in tiles
    of ``HEAVY_M`` rows with ``HEAVY_STAGES``-deep pipelines (``two_height_tile_of``, from the counts
    on the device), so it reads each weight tile once per ``HEAVY_M`` rows; the bits do not change."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e, heavy = two_height_expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, BLOCK_N, E_PAD, BLOCK_M, GROUP_M, HEAVY_M
    )
    if in_use:
        _gemm1_tile_rows(
            x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
            stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
            TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
            None, HALF_TAIL, HEAVY_M, HEAVY_STAGES,
        )


@triton.jit
def _gemm1_tile_rows(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr, HALF_TAIL: tl.constexpr,
    HEAVY_M: tl.constexpr, HEAVY_STAGES: tl.constexpr,
):
    """GEMM1 for the rows ``m0``.. of expert ``e``: ``HEAVY_M`` of them in a ``heavy`` tile
    (``HEAVY_M`` > 0; ``HEAVY_STAGES``-deep pipeline), else ``BLOCK_M`` (``STAGES``; None: the
    kernel's ``num_stages``), or with ``HALF_TAIL`` an expert's last tile at ``BLOCK_M // 2`` rows
    where they hold what is left. A row's result does not depend on its tile's height."""
    # (nested: a constexpr and a tensor cannot share one condition)
    if HEAVY_M > 0:
        if heavy:
            _gemm1_rows(
                x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                TOPK, HEAVY_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, HEAVY_STAGES,
            )
        else:
            _gemm1_block_rows(
                x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES, HALF_TAIL,
            )
    else:
        _gemm1_block_rows(
            x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
            stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
            TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES, HALF_TAIL,
        )


@triton.jit
def _gemm1_block_rows(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr, HALF_TAIL: tl.constexpr,
):
    """A ``BLOCK_M``-row GEMM1 tile, or with ``HALF_TAIL`` an expert's last at ``BLOCK_M // 2``."""
    if HALF_TAIL:
        if count_e - m0 <= BLOCK_M // 2:
            _gemm1_rows(
                x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
            )
        else:
            _gemm1_rows(
                x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
            )
    else:
        _gemm1_rows(
            x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
            stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
            TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
        )


@triton.jit
def _gemm1_rows(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    gemm1_tile(
        x_ptr, w_ptr, w_desc, act_ptr, (rows // TOPK).to(tl.int64), offs_m, row_ok, pid_n, e, start_e, H, I,
        stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
    )


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count, see moe_schedule_kernel
def _moe_gemm2_kernel(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, HALF_TAIL: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr, HEAVY_M: tl.constexpr = 0, HEAVY_STAGES: tl.constexpr = None,
):
    """``HEAVY_M`` / ``HEAVY_STAGES``: hot experts' tiles, as ``_moe_gemm1_kernel``'s."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e, heavy = two_height_expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M, HEAVY_M
    )
    if in_use:
        _gemm2_tile_rows(
            act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
            stride_we, stride_wn, stride_wk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
            None, HALF_TAIL, HEAVY_M, HEAVY_STAGES,
        )


@triton.jit
def _gemm2_tile_rows(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr, HALF_TAIL: tl.constexpr,
    HEAVY_M: tl.constexpr, HEAVY_STAGES: tl.constexpr,
):
    """GEMM2 for the rows ``m0``.. of expert ``e``, with ``_gemm1_tile_rows``' tile heights."""
    if HEAVY_M > 0:
        if heavy:
            _gemm2_rows(
                act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_we, stride_wn, stride_wk,
                HEAVY_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, HEAVY_STAGES,
            )
        else:
            _gemm2_block_rows(
                act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_we, stride_wn, stride_wk,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES, HALF_TAIL,
            )
    else:
        _gemm2_block_rows(
            act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
            stride_we, stride_wn, stride_wk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES, HALF_TAIL,
        )


@triton.jit
def _gemm2_block_rows(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr, HALF_TAIL: tl.constexpr,
):
    """A ``BLOCK_M``-row GEMM2 tile, with ``_gemm1_block_rows``' half tails."""
    if HALF_TAIL:
        if count_e - m0 <= BLOCK_M // 2:
            _gemm2_rows(
                act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_we, stride_wn, stride_wk,
                BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
            )
        else:
            _gemm2_rows(
                act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_we, stride_wn, stride_wk,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
            )
    else:
        _gemm2_rows(
            act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
            stride_we, stride_wn, stride_wk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
        )


@triton.jit
def _gemm2_rows(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    acc, offs_n, n_ok = gemm2_tile(
        act_ptr, w_ptr, w_desc, e, start_e, offs_m, row_ok, pid_n, H, I,
        stride_we, stride_wn, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
    )
    scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, DOT_F32)


# The one-launch decode kernel's sync words (int32, zeroed by ``_moe_schedule_zero_kernel``): the
# work-item ticket, the error flag, then one GEMM1 completion count per row tile.
SYNC_TICKET, SYNC_ERROR, SYNC_TILES = 0, 1, 2
_SYNC_TICKET, _SYNC_ERROR, _SYNC_TILES = tl.constexpr(SYNC_TICKET), tl.constexpr(SYNC_ERROR), tl.constexpr(SYNC_TILES)


@triton.jit(do_not_specialize=["num_rows", "num_sync"])  # per-call counts: num_sync follows the row tiles
def _moe_schedule_zero_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    sync_ptr, num_sync,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """``moe_schedule_kernel``, plus one program that zeroes the decode kernel's sync words (the
    previous call's kernel has finished: this one waits for it, see ``grid_dependency``)."""
    grid_dependency(PDL)
    if tl.program_id(0) < num_local:
        moe_schedule_kernel(
            topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
            num_rows, num_global, num_local, stride_it, stride_ik, TOPK, HAS_MAP, BLOCK, False,
        )
    else:
        zero_words(sync_ptr, num_sync, BLOCK)


@triton.jit(do_not_specialize=["num_m", "narrow_m"])  # per-call tile counts
def _moe_decode_experts_kernel(
    x_ptr, w13_ptr, w13_desc, w2_ptr, w2_desc, w2_narrow_desc, act_ptr, y_ptr, sorted_rows_ptr, counts_ptr, sync_ptr,
    timeline_ptr, num_local, H, I, num_m, narrow_m, max_polls,
    stride_xt, stride_xh, stride_w13e, stride_w13n, stride_w13k, stride_w2e, stride_w2n, stride_w2k,
    TOPK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N1: tl.constexpr, BLOCK_K1: tl.constexpr, STAGES1: tl.constexpr, EVEN_K1: tl.constexpr,
    EVEN_N1: tl.constexpr, USE_TMA1: tl.constexpr,
    BLOCK_N2: tl.constexpr, BLOCK_K2: tl.constexpr, STAGES2: tl.constexpr, EVEN_K2: tl.constexpr,
    EVEN_N2: tl.constexpr, USE_TMA2: tl.constexpr, NARROW_N2: tl.constexpr,
    DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
    TIMELINE: tl.constexpr, GROUP_M1: tl.constexpr, GROUP_M2: tl.constexpr,
    HEAVY_M: tl.constexpr, HEAVY_STAGES1: tl.constexpr, HEAVY_STAGES2: tl.constexpr,
):
    """GEMM1 and GEMM2 in one launch (decode sizes): no grid-wide barrier between them, so the
    weight stream does not drain and refill at the boundary, and GEMM2 tiles fill the SMs that
    GEMM1's last wave leaves idle. Work items are GEMM1's tiles (row tile major) then GEMM2's,
    handed out by an atomic ticket rather than by program id: a program that draws a GEMM2 item
    knows that every GEMM1 item was drawn by a program already running, and GEMM1 items wait on
    nothing, so the waits below always end (no deadlock, whatever order the hardware starts
    programs in). A GEMM1 tile counts itself done for its row tile (release at GPU scope after
    a CTA barrier, so every thread's ``act`` stores are ordered before it); a GEMM2 tile waits
    (acquire, bounded by ``max_polls``) until all GEMM1 column tiles of its row tile are done.
    A wait that runs out, which only a bug could cause, sets the error word and writes NaN into
    the tile's rows instead of hanging or computing on unwritten data. GEMM1 items go in
    ``program_tile`` order: ``GROUP_M1`` row tiles sweep the column tiles together, so the row
    tiles of an expert with many rows read each weight tile at about the same time (from HBM once)
    instead of one after another; GEMM2's full-width items likewise with ``GROUP_M2``. With
    ``NARROW_N2`` (0: off) the last ``narrow_m`` row tiles in use take GEMM2 items ``NARROW_N2`` columns wide
    (``w2_narrow_desc``'s boxes). Each tile's arithmetic is that of the two-launch kernels, so the
    bits are the same. ``HEAVY_M`` (0: off): an expert with more than ``BLOCK_M`` rows runs in
    tiles of ``HEAVY_M`` rows (``two_height_tile_of``; pipelines ``HEAVY_STAGES1``/``2`` deep),
    so it reads its weights once per ``HEAVY_M`` rows. ``TIMELINE`` records each item's
    times (``_timeline_record``) for the profile, without changing what is computed."""
    grid_dependency(PDL)
    item = tl.atomic_add(sync_ptr + _SYNC_TICKET, 1, sem="relaxed")
    t_start = now(TIMELINE)
    num_n1 = tl.cdiv(I, BLOCK_N1)
    gemm1_items = num_m * num_n1
    if item < gemm1_items:
        pid_m, pid_n = program_tile(item, num_m, num_n1, GROUP_M1)
        total, e, m0, count_e, start_e, heavy = two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M, HEAVY_M)
        if pid_m < total:
            _gemm1_tile_rows(
                x_ptr, w13_ptr, w13_desc, act_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_w13e, stride_w13n, stride_w13k,
                TOPK, BLOCK_M, BLOCK_N1, BLOCK_K1, EVEN_K1, EVEN_N1, DOT_IEEE, DOT_F32, USE_TMA1, SWAP_AB,
                STAGES1, False, HEAVY_M, HEAVY_STAGES1,
            )
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + _SYNC_TILES + pid_m, 1, sem="release", scope="gpu")
            if TIMELINE:
                _timeline_record(timeline_ptr, item, t_start, t_start, tl.minimum(BLOCK_N1, I - pid_n * BLOCK_N1))
    elif item < gemm1_items + (num_m + narrow_m) * tl.cdiv(H, BLOCK_N2):  # (a ticket past the last item does nothing)
        item2 = item - gemm1_items
        num_n2 = tl.cdiv(H, BLOCK_N2)
        if NARROW_N2 == 0:
            wide_m = num_m  # (an upper bound: items of row tiles past the last in use do nothing)
        else:
            # The last ``narrow_m`` row tiles in use run GEMM2 in NARROW_N2-wide column tiles, so
            # the items drawn last are short and the grid's tail drains sooner.
            total = two_height_tile_of(0, counts_ptr, num_local, E_PAD, BLOCK_M, HEAVY_M)[0]
            wide_m = tl.maximum(total - narrow_m, 0)
        wide_items = wide_m * num_n2
        if item2 < wide_items:
            pid_m, pid_n = program_tile(item2, wide_m, num_n2, GROUP_M2)
            total, e, m0, count_e, start_e, heavy = two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M, HEAVY_M)
            _decode_gemm2_item(
                act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
                pid_m < total, heavy, pid_m, pid_n, e, m0, count_e, start_e, num_n1, H, I, max_polls,
                stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, BLOCK_N2, BLOCK_K2, STAGES2, EVEN_K2, EVEN_N2, USE_TMA2, DOT_IEEE, DOT_F32, SWAP_AB, TIMELINE,
                HEAVY_M, HEAVY_STAGES2,
            )
        elif NARROW_N2 > 0:
            narrow = item2 - wide_items
            pid_m = wide_items // num_n2 + narrow // tl.cdiv(H, NARROW_N2)
            total, e, m0, count_e, start_e, heavy = two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M, HEAVY_M)
            _decode_gemm2_item(
                act_ptr, w2_ptr, w2_narrow_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
                pid_m < total, heavy, pid_m, narrow % tl.cdiv(H, NARROW_N2), e, m0, count_e, start_e, num_n1, H, I,
                max_polls, stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, NARROW_N2, BLOCK_K2, STAGES2, EVEN_K2, H % NARROW_N2 == 0, USE_TMA2, DOT_IEEE, DOT_F32,
                SWAP_AB, TIMELINE, HEAVY_M, HEAVY_STAGES2,
            )


@triton.jit
def _decode_gemm2_item(
    act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
    in_use, heavy, pid_m, pid_n, e, m0, count_e, start_e, num_n1, H, I, max_polls,
    stride_w2e, stride_w2n, stride_w2k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, DOT_IEEE: tl.constexpr,
    DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr, TIMELINE: tl.constexpr,
    HEAVY_M: tl.constexpr, HEAVY_STAGES: tl.constexpr,
):
    """A GEMM2 work item of ``_moe_decode_experts_kernel``: wait (bounded) until every GEMM1
    column tile of row tile ``pid_m`` is done, then the tile (or NaN rows if the wait ran out). A
    ``heavy`` tile (``HEAVY_M`` > 0) holds ``HEAVY_M`` rows, others ``BLOCK_M``."""
    if in_use:
        done = wait_count(sync_ptr + _SYNC_TILES + pid_m, num_n1, max_polls)
        t_ready = now(TIMELINE)
        if done < num_n1:
            tl.atomic_xchg(sync_ptr + _SYNC_ERROR, 1, sem="relaxed")
            pieces = 1  # BLOCK_M-row pieces of the tile
            if HEAVY_M > 0:
                pieces = tl.where(heavy, HEAVY_M // BLOCK_M, 1)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            nan = tl.full([BLOCK_M, BLOCK_N], float("nan"), dtype=tl.float32)
            for piece in range(pieces):
                offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0 + piece * BLOCK_M, count_e, start_e, BLOCK_M)
                scatter_rows(nan, rows, row_ok, offs_n, offs_n < H, y_ptr, H, DOT_F32)
        else:
            _gemm2_tile_rows(
                act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, heavy, m0, count_e, start_e, pid_n, e, H, I,
                stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
                STAGES, False, HEAVY_M, HEAVY_STAGES,
            )
        if TIMELINE:
            _timeline_record(timeline_ptr, item, t_start, t_ready, tl.minimum(BLOCK_N, H - pid_n * BLOCK_N))


# A decode timeline record (int64 words per work item): drawn, ready (a GEMM2 item's wait over),
# done, the SM it ran on, and the item's weight columns (items without rows leave their record at 0).
TIMELINE_WORDS = 5
_TIMELINE_WORDS = tl.constexpr(TIMELINE_WORDS)


@triton.jit
def _timeline_record(timeline_ptr, item, t_start, t_ready, columns):
    tl.debug_barrier()  # every thread's part of the item is done
    t_end = now(True)
    sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    rec = timeline_ptr + item.to(tl.int64) * _TIMELINE_WORDS
    tl.store(rec + 0, t_start)
    tl.store(rec + 1, t_ready)
    tl.store(rec + 2, t_end)
    tl.store(rec + 3, sm.to(tl.int64))
    tl.store(rec + 4, columns.to(tl.int64))


@triton.jit
def _moe_combine_kernel(
    y_ptr, out_ptr, topk_ids_ptr, topk_w_ptr, expert_map_ptr,
    H, num_global, num_local,
    stride_it, stride_ik, stride_wt, stride_wk, stride_ot,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr, RNE_FIX: tl.constexpr,
    PDL: tl.constexpr,
):
    grid_dependency(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        gid = tl.load(topk_ids_ptr + t * stride_it + k * stride_ik)
        ok = (gid >= 0) & (gid < num_global)
        if HAS_MAP:
            lid = tl.load(expert_map_ptr + tl.where(ok, gid, 0), mask=ok, other=-1)
            ok = ok & (lid >= 0) & (lid < num_local)
        else:
            ok = ok & (gid < num_local)
        w = tl.load(topk_w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
        # (broadcast the scalar flag through an int32 vector: the interpreter rejects a scalar
        # bool broadcast into a mask)
        y_ok = h_ok & ((tl.zeros([BLOCK_H], dtype=tl.int32) + ok.to(tl.int32)) != 0)
        y = tl.load(y_ptr + (t * TOPK + k).to(tl.int64) * H + offs, mask=y_ok, other=0.0)
        # Separate multiply and add, as the reference's `out += w * y` rounds the product first.
        prod = w * y.to(tl.float32)
        acc = acc + prod
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, cast(acc, out_ptr.dtype.element_ty, RNE_FIX), mask=h_ok)


# ----------------------------------------------------------------------------------------------
# Launch steps (shared by fused_moe_triton and the expert-parallel workspace in cuda/ep.py)
# ----------------------------------------------------------------------------------------------


def launch_schedule(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    counts: torch.Tensor,
    sorted_rows: torch.Tensor,
    num_local: int,
    num_global: int,
    *,
    pdl: bool | None = None,
    kernel=None,
    extra_programs: int = 0,
    extra_args: tuple = (),
    **extra_constexprs,
) -> None:
    """``moe_schedule_kernel`` over every (token, k) row of ``topk_ids`` ``[N, K]``: per-expert
    ``counts`` and ``sorted_rows`` (each expert's rows, in row order). ``num_local >= 1``.
    ``kernel`` replaces it by a kernel with the same leading parameters whose programs
    ``>= num_local`` do other work (``extra_programs`` of them; the FP8 quantization pass),
    ``extra_args`` / ``extra_constexprs`` being its own ones."""
    rows = topk_ids.shape[0] * topk_ids.shape[1]
    has_map = expert_map is not None
    (moe_schedule_kernel if kernel is None else kernel)[(num_local + extra_programs,)](
        topk_ids, expert_map if has_map else topk_ids, counts, sorted_rows,  # (dummy pointer without a map)
        bad_ids.report_words(topk_ids.device),
        rows, num_global, num_local, topk_ids.stride(0), topk_ids.stride(1), *extra_args,
        TOPK=topk_ids.shape[1], HAS_MAP=has_map, **schedule_block(rows), **pdl_launch(counts, pdl), **extra_constexprs,
    )


def launch_gemm1(
    x: torch.Tensor,
    w13: torch.Tensor,
    act: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    top_k: int,
    config: dict,
    *,
    pdl: bool | None = None,
    interpret: bool,
    kernel=None,
    extra_args: tuple = (),
    **extra_constexprs,
) -> None:
    """``_moe_gemm1_kernel``: ``act[i] = silu(x[t] @ gate.T) * (x[t] @ up.T)`` for the ``i``-th
    scheduled row ``t * top_k + k`` (``rows`` of them at most; ``x`` rows gathered by token).
    ``config`` is GEMM1's entry of ``pick_configs``. ``w13`` has ``num_local >= 1`` experts.
    ``kernel`` replaces it by a kernel with the same leading parameters (the expert-parallel
    GEMM1 that pulls its rows), ``extra_args`` / ``extra_constexprs`` being its own ones."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    _check_two_launch_config(config)
    g = gemm_config(config, act, interpret, GROUP_M=1, HALF_TAIL=False, SWAP_AB=False)
    check_heavy_m(g)
    if kernel is not None:  # the expert-parallel kernels always run full tiles of one height
        for key in ("HALF_TAIL", "HEAVY_M", "HEAVY_STAGES"):
            g.pop(key, None)
    bm, bn = g["BLOCK_M"], g["BLOCK_N"]
    w13_desc = w13_operand(w13, g)
    num_m = max_row_tiles(rows, num_local, bm)
    (_moe_gemm1_kernel if kernel is None else kernel)[(num_m * triton.cdiv(inter, bn),)](
        x, w13, w13_desc, act, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), *extra_args,
        TOPK=top_k, E_PAD=e_pad(num_local),
        EVEN_K=hidden % g["BLOCK_K"] == 0, EVEN_N=inter % bn == 0,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret,
        **pdl_launch(act, pdl, interpret), **extra_constexprs, **g,
    )


def launch_gemm2(
    act: torch.Tensor,
    w2: torch.Tensor,
    y: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    config: dict,
    *,
    pdl: bool | None = None,
    interpret: bool,
    kernel=None,
    extra_args: tuple = (),
    **extra_constexprs,
) -> None:
    """``_moe_gemm2_kernel``: ``y[row] = act[i] @ w2[e].T`` for the ``i``-th scheduled row (``rows``
    of them at most). ``kernel`` replaces it by a kernel with the same leading parameters (the
    expert-parallel push epilogue), ``extra_args`` / ``extra_constexprs`` being its own ones."""
    num_local, hidden, inter = w2.shape
    _check_two_launch_config(config)
    g = gemm_config(config, act, interpret, GROUP_M=1, HALF_TAIL=False, SWAP_AB=False)
    check_heavy_m(g)
    if kernel is not None:  # the expert-parallel kernels always run full tiles of one height
        for key in ("HALF_TAIL", "HEAVY_M", "HEAVY_STAGES"):
            g.pop(key, None)
    bm, bn = g["BLOCK_M"], g["BLOCK_N"]
    w2_desc = w2_operand(w2, g, g["BLOCK_K"])
    num_m = max_row_tiles(rows, num_local, bm)
    (_moe_gemm2_kernel if kernel is None else kernel)[(num_m * triton.cdiv(hidden, bn),)](
        act, w2, w2_desc, y, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), w2.stride(2), *extra_args,
        E_PAD=e_pad(num_local),
        EVEN_K=inter % g["BLOCK_K"] == 0, EVEN_N=hidden % bn == 0,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret,
        **pdl_launch(act, pdl, interpret), **extra_constexprs, **g,
    )


# Polls of a GEMM2 tile's wait in the one-launch decode kernel (an L2 round trip each, about a
# microsecond): seconds, where a wait that ends lasts at most one GEMM1 tile.
DECODE_MAX_POLLS = 1 << 22


# Config keys of the one-launch decode kernel alone (``launch_decode_experts``).
_ONE_LAUNCH_KEYS = frozenset({"ONE_LAUNCH", "NARROW_TAIL"})


def _check_two_launch_config(config: dict) -> None:
    """A GEMM config for ``launch_gemm1``/``launch_gemm2`` must not carry the one-launch kernel's keys."""
    if _ONE_LAUNCH_KEYS & set(config):
        raise ValueError(f"{sorted(_ONE_LAUNCH_KEYS & set(config))} apply to the one-launch decode kernel only "
                         f"(ONE_LAUNCH in GEMM1's config): {config}")


def one_launch_decode(g1: dict, g2: dict) -> bool:
    """Whether ``fused_moe_triton`` runs both GEMMs of a call with these configs as one launch
    (``_moe_decode_experts_kernel``): ``pick_configs(..., one_launch=True)`` marks them so at decode
    sizes, which ``fused_moe_triton`` asks for unless ``ONE_LAUNCH_DECODE`` is off
    (``MOK_DECODE_ONE_LAUNCH=0``)."""
    return g1.get("ONE_LAUNCH", False)


def decode_sync_words(rows: int, num_local: int, block_m: int) -> int:
    """Int32 sync words of a one-launch decode call (ticket, error flag, a count per row tile)."""
    return SYNC_TILES + max_row_tiles(rows, num_local, block_m)


def decode_items(rows: int, num_local: int, hidden: int, inter: int, configs: tuple[dict, dict]) -> tuple[int, int]:
    """Work items of a one-launch decode call, (GEMM1's, GEMM2's): every row tile's GEMM1 column
    tiles come first in ticket order, then its GEMM2 ones; the grid has one program per item."""
    g1, g2 = configs
    num_m = max_row_tiles(rows, num_local, g1["BLOCK_M"])
    # Narrow tail: the last NARROW_TAIL row tiles in use take twice as many GEMM2 items.
    return num_m * triton.cdiv(inter, g1["BLOCK_N"]), (num_m + g2.get("NARROW_TAIL", 0)) * triton.cdiv(hidden, g2["BLOCK_N"])


def operand_bytes(counts: list[int], hidden: int, inter: int, configs: tuple[dict, dict],
                  elem_bytes: int = 2) -> dict:
    """Bytes the GEMM tiles of a call load into shared memory, by operand, for the per-expert
    ``counts`` of the call and its ``configs`` (a model of the kernels' tiling, for the layer
    benchmark; every load goes through L2, so this is the L2-to-SM traffic of the operands).

    Every row tile in use loads its expert's weight columns whole, whatever its rows (a half
    tail too); its A operand loads only its rows (masked rows fetch nothing), once per column
    tile. With a narrow GEMM2 tail the last ``NARROW_TAIL`` row tiles in use load their A rows
    once per half-width column tile. With ``HEAVY_M`` an expert with more than ``BLOCK_M`` rows
    has tiles of ``HEAVY_M`` rows."""
    g1, g2 = configs
    bm, heavy = g1["BLOCK_M"], g1.get("HEAVY_M", 0)
    row_tile_sizes = [min(h, c - m0) for c in counts for h in [heavy if heavy and c > bm else bm]
                      for m0 in range(0, c, h)]
    rows = sum(row_tile_sizes)
    n1 = triton.cdiv(inter, g1["BLOCK_N"])
    n2 = triton.cdiv(hidden, g2["BLOCK_N"])
    narrow = min(g2.get("NARROW_TAIL", 0), len(row_tile_sizes))
    narrow_rows = sum(row_tile_sizes[len(row_tile_sizes) - narrow:])
    return dict(
        gemm1_a=rows * hidden * n1 * elem_bytes,
        gemm1_b=len(row_tile_sizes) * 2 * inter * hidden * elem_bytes,
        gemm2_a=((rows - narrow_rows) * n2 + narrow_rows * triton.cdiv(hidden, g2["BLOCK_N"] // 2)) * inter * elem_bytes,
        gemm2_b=len(row_tile_sizes) * hidden * inter * elem_bytes,
    )


def launch_decode_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    act: torch.Tensor,
    y: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    sync: torch.Tensor,
    rows: int,
    top_k: int,
    configs: tuple[dict, dict],
    *,
    pdl: bool | None = None,
    interpret: bool,
    max_polls: int = DECODE_MAX_POLLS,
    timeline: torch.Tensor | None = None,
) -> None:
    """``_moe_decode_experts_kernel``: ``launch_gemm1`` then ``launch_gemm2`` in one launch, with
    ``sync`` (``decode_sync_words`` int32 words) zeroed by ``_moe_schedule_zero_kernel`` in this
    call's schedule launch. ``configs``: ``pick_configs``' pair, ``one_launch_decode`` true.
    ``timeline`` (compiled code only): zeroed int64 ``[sum(decode_items(...)), TIMELINE_WORDS]`` that
    the call fills with one record per work item (``_timeline_record``)."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g1 = gemm_config(configs[0], act, interpret)
    g2 = gemm_config(configs[1], act, interpret)
    if not (g1.get("SWAP_AB", False) == g2.get("SWAP_AB", False) and g1["BLOCK_M"] == g2["BLOCK_M"]
            and g1["num_warps"] == g2["num_warps"]):
        raise ValueError(f"one-launch decode configs need tiles of one height, operand order and warp count: {configs}")
    w13_desc = w13_operand(w13, g1)
    w2_desc = w2_operand(w2, g2, g2["BLOCK_K"])
    bm, bn1, bk1, bn2, bk2 = g1["BLOCK_M"], g1["BLOCK_N"], g1["BLOCK_K"], g2["BLOCK_N"], g2["BLOCK_K"]
    narrow_m = g2.get("NARROW_TAIL", 0)
    narrow_n2 = bn2 // 2 if narrow_m else 0
    if narrow_m and g2.get("SWAP_AB", False) and narrow_n2 < 64:
        raise ValueError(f"a narrow GEMM2 tail needs BLOCK_N >= 128 (its half is wgmma's M side): {configs}")
    w2_narrow_desc = w2_operand(w2, dict(g2, BLOCK_N=narrow_n2), bk2) if narrow_m else w2_desc
    check_heavy_m(g1)
    heavy_m = g1.get("HEAVY_M", 0)
    num_m = max_row_tiles(rows, num_local, bm)  # (heavy tiles only make fewer)
    assert sync.numel() == SYNC_TILES + num_m and sync.dtype == torch.int32
    items = sum(decode_items(rows, num_local, hidden, inter, (g1, g2)))
    if timeline is not None:
        if interpret or not timeline.is_cuda:
            raise ValueError("the decode timeline reads the GPU clock: compiled CUDA code only")
        if timeline.shape != (items, TIMELINE_WORDS) or timeline.dtype != torch.int64:
            raise ValueError(f"timeline must be int64 [{items}, {TIMELINE_WORDS}], got {timeline.dtype} {list(timeline.shape)}")
    _moe_decode_experts_kernel[(items,)](
        x, w13, w13_desc, w2, w2_desc, w2_narrow_desc, act, y, sorted_rows, counts, sync,
        sync if timeline is None else timeline,  # (dummy pointer without a timeline)
        num_local, hidden, inter, num_m, narrow_m, max_polls,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), w2.stride(0), w2.stride(1), w2.stride(2),
        TOPK=top_k, E_PAD=e_pad(num_local), BLOCK_M=bm,
        BLOCK_N1=bn1, BLOCK_K1=bk1, STAGES1=g1["num_stages"], EVEN_K1=hidden % bk1 == 0, EVEN_N1=inter % bn1 == 0,
        USE_TMA1=g1["USE_TMA"],
        BLOCK_N2=bn2, BLOCK_K2=bk2, STAGES2=g2["num_stages"], EVEN_K2=inter % bk2 == 0, EVEN_N2=hidden % bn2 == 0,
        USE_TMA2=g2["USE_TMA"], NARROW_N2=narrow_n2,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret, SWAP_AB=g1.get("SWAP_AB", False),
        TIMELINE=timeline is not None, GROUP_M1=g1.get("GROUP_M", 1), GROUP_M2=g2.get("GROUP_M", 1),
        HEAVY_M=heavy_m, HEAVY_STAGES1=g1.get("HEAVY_STAGES", g1["num_stages"]),
        HEAVY_STAGES2=g2.get("HEAVY_STAGES", g2["num_stages"]),
        num_warps=g1["num_warps"], num_stages=g1["num_stages"],
        **pdl_launch(act, pdl, interpret),
    )


def launch_combine(
    y: torch.Tensor,
    out: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_local: int,
    num_global: int,
    *,
    pdl: bool | None = None,
    interpret: bool,
) -> None:
    """``_moe_combine_kernel``: ``out[t] = sum_k w[t, k] * y[t * K + k]`` in fp32, k in order,
    over the local experts' rows only. ``out`` has ``tokens >= 1`` rows."""
    tokens, hidden = out.shape
    has_map = expert_map is not None
    block_h = combine_block(hidden)
    _moe_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        y, out, topk_ids, topk_weights, expert_map if has_map else topk_ids,
        hidden, num_global, num_local,
        topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1), out.stride(0),
        TOPK=topk_ids.shape[1], HAS_MAP=has_map, BLOCK_H=block_h, RNE_FIX=interpret, num_warps=4,
        **pdl_launch(out, pdl, interpret),
    )


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def fused_moe_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    pdl: bool | None = None,
    one_launch: bool | None = None,
    configs: tuple[dict, dict] | None = None,
    timeline: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts of one MoE layer (see ``reference.py``) in four Triton launches.

    No host synchronisation: the arguments' shapes, dtypes and devices are checked on the host,
    the ids' values by the schedule kernel, which reports bad ones to the next call (``bad_ids.py``).
    ``pdl``: launch with programmatic dependent launch (``pdl_launch``); ``one_launch``: both GEMMs
    as one launch at decode sizes (``one_launch_decode``); either left at ``None`` is read from the
    environment now (``env.py``: ``MOK_PDL``, ``MOK_DECODE_ONE_LAUNCH``, both on by default).
    ``configs`` overrides the block sizes (benchmark sweeps, tests); ``timeline`` receives the
    one-launch decode kernel's per-item records (profiles only, see ``launch_decode_experts``).
    """
    bad_ids.raise_if_reported(hidden_states.device)
    check_fused_moe_args(
        hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation, check_values=False
    )
    out, layer = layer_setup(hidden_states, w13, topk_ids, expert_map)
    if layer is None:
        return out
    tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows = layer
    dev = hidden_states.device
    interpret = interpreting()
    pdl = knob("pdl", pdl)
    act = torch.empty((rows, inter), dtype=hidden_states.dtype, device=dev)
    y = torch.empty((rows, hidden), dtype=hidden_states.dtype, device=dev)

    if configs is None:
        configs = pick_configs(tokens, top_k, num_local, hidden, inter, one_launch=knob("one_launch", one_launch))
    g1, g2 = configs
    if one_launch_decode(g1, g2):
        sync = torch.empty(decode_sync_words(rows, num_local, g1["BLOCK_M"]), dtype=torch.int32, device=dev)
        launch_schedule(topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
                        kernel=_moe_schedule_zero_kernel, extra_programs=1, extra_args=(sync, sync.numel()), pdl=pdl)
        launch_decode_experts(hidden_states, w13, w2, act, y, sorted_rows, counts, sync, rows, top_k, (g1, g2),
                              interpret=interpret, timeline=timeline, pdl=pdl)
    elif timeline is not None:
        raise ValueError("a timeline records the one-launch decode kernel, and this call's configs do not run it")
    else:
        launch_schedule(topk_ids, expert_map, counts, sorted_rows, num_local, num_global, pdl=pdl)
        launch_gemm1(hidden_states, w13, act, sorted_rows, counts, rows, top_k, g1, interpret=interpret, pdl=pdl)
        launch_gemm2(act, w2, y, sorted_rows, counts, rows, g2, interpret=interpret, pdl=pdl)
    launch_combine(y, out, topk_ids, topk_weights, expert_map, num_local, num_global, interpret=interpret, pdl=pdl)
    return out
