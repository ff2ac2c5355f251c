"""Triton fused MoE for one GPU: schedule, grouped GEMM1 (+SiLU*up), grouped GEMM2, top-k combine.

Computes exactly the function of ``reference.py`` (same rounding points: gate/up and the activation
rounded to the input dtype, each expert output rounded to the input dtype, the top-k sum in fp32 in
k order) in four launches and with no host synchronisation:

1. ``_moe_schedule_kernel`` -- one program per local expert ``e``. It scans all ``T*K`` (token, k)
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
it waits for the previous kernel in the stream before touching memory (``_grid_dependency``) and
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

import functools

import torch
import triton
import triton.language as tl

from .. import bad_ids
from ..env import knob
from ..reference import check_fused_moe_args

__all__ = [
    "combine_block", "fused_moe_triton", "kernel_variants", "launch_combine", "launch_gemm1", "launch_gemm2",
    "launch_schedule", "pick_configs", "schedule_block",
]


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit
def _cast(x, ty: tl.constexpr, RNE_FIX: tl.constexpr):
    """``x.to(ty)``. Under the interpreter (``RNE_FIX``) fp32 -> bf16 truncates instead of
    rounding to nearest even, so round the fp32 bits first; compiled code casts directly."""
    if RNE_FIX:
        if ty == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def _expert_ids(
    topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global, num_local, stride_it, stride_ik,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """``(local, gid, mapped)`` of each (token, k) row in ``rows``: its local expert id (-1 for
    non-local, unrouted (-1) or invalid rows), its global id as stored (-1 where ``row_ok`` is
    false) and, with ``HAS_MAP``, its expert_map value (-1 where the id is not a valid global id).

    Range checks happen in the ids' own dtype (int64 ids are not truncated before the check), and a
    masked load never dereferences an invalid address.
    """
    tok = rows // TOPK
    kk = rows % TOPK
    gid = tl.load(topk_ids_ptr + tok * stride_it + kk * stride_ik, mask=row_ok, other=-1)
    ok = row_ok & (gid >= 0) & (gid < num_global)
    if HAS_MAP:
        mapped = tl.load(expert_map_ptr + tl.where(ok, gid, 0), mask=ok, other=-1)
        ok = ok & (mapped >= 0) & (mapped < num_local)
        lid = mapped
    else:
        mapped = gid
        lid = gid
        ok = ok & (lid < num_local)
    return tl.where(ok, lid, -1).to(tl.int32), gid, mapped


@triton.jit
def _local_expert_ids(
    topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global, num_local, stride_it, stride_ik,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """Local expert id of each (token, k) row in ``rows``; -1 for non-local, unrouted or invalid rows."""
    return _expert_ids(topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global, num_local, stride_it, stride_ik,
                       TOPK, HAS_MAP)[0]


@triton.jit
def _grid_dependency(PDL: tl.constexpr):
    """First statement of every kernel here. With programmatic dependent launch (``PDL``, launched
    with ``launch_pdl``) a kernel's programs may start while the previous kernel in the stream still
    runs: wait until it has finished and its writes are visible, before touching memory, then let
    the next kernel's programs start in turn. They take SMs as this grid's last programs leave and
    wait the same way, so the gap between two launches overlaps the first kernel's tail."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _now(USE_TIMER: tl.constexpr):
    """The GPU's global nanosecond clock (``%globaltimer``), or 0 without ``USE_TIMER`` (the Triton
    interpreter has no inline assembly)."""
    if USE_TIMER:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)
    else:
        t = tl.full((), 0, tl.int64)
    return t


_I64_MAX = tl.constexpr(2**63 - 1)
# bad_ids.py's report: its words and the kinds of bad value.
_KIND, _LO, _HI, _BOUND = (tl.constexpr(w) for w in (bad_ids.KIND, bad_ids.LO, bad_ids.HI, bad_ids.BOUND))
_TOPK_IDS, _EXPERT_MAP = tl.constexpr(bad_ids.TOPK_IDS), tl.constexpr(bad_ids.EXPERT_MAP)


# The row count changes from call to call: unspecialized, one compiled kernel serves every count
# (a server would otherwise compile new variants while serving, at 1 row and at multiples of 16).
@triton.jit(do_not_specialize=["num_rows"])
def _moe_schedule_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    below = tl.zeros([BLOCK], dtype=tl.int32)
    mine = tl.zeros([BLOCK], dtype=tl.int32)
    # Program 0 also keeps the range of ids outside [-1, num_global) and of expert_map values
    # outside [-1, num_local) for the bad-id report (bad_ids.py), as scalars: four int64 vectors
    # of BLOCK would spill registers at BLOCK = 4096.
    id_lo = tl.full((), _I64_MAX, tl.int64)
    id_hi = tl.full((), -_I64_MAX, tl.int64)
    map_lo = tl.full((), _I64_MAX, tl.int64)
    map_hi = tl.full((), -_I64_MAX, tl.int64)
    # Pass 1: segment start (rows of experts < e) and count of expert e.
    for start in range(0, num_rows, BLOCK):
        rows = start + offs
        row_ok = rows < num_rows
        lid, gid, mapped = _expert_ids(topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global,
                                       num_local, stride_it, stride_ik, TOPK, HAS_MAP)
        below += ((lid >= 0) & (lid < e)).to(tl.int32)
        mine += (lid == e).to(tl.int32)
        if e == 0:
            g64 = gid.to(tl.int64)
            bad = row_ok & ((g64 < -1) | (g64 >= num_global))
            id_lo = tl.minimum(id_lo, tl.min(tl.where(bad, g64, _I64_MAX), axis=0))
            id_hi = tl.maximum(id_hi, tl.max(tl.where(bad, g64, -_I64_MAX), axis=0))
            if HAS_MAP:
                m64 = mapped.to(tl.int64)
                bad = row_ok & (g64 >= 0) & (g64 < num_global) & ((m64 < -1) | (m64 >= num_local))
                map_lo = tl.minimum(map_lo, tl.min(tl.where(bad, m64, _I64_MAX), axis=0))
                map_hi = tl.maximum(map_hi, tl.max(tl.where(bad, m64, -_I64_MAX), axis=0))
    if e == 0:
        _report_bad_ids(report_ptr, id_lo, id_hi, num_global, map_lo, map_hi, num_local)
    seg_start = tl.sum(below, axis=0)
    tl.store(counts_ptr + e, tl.sum(mine, axis=0))
    # Pass 2: rows of expert e, in row (= token) order, at seg_start + prefix-sum rank.
    base = seg_start
    for start in range(0, num_rows, BLOCK):
        rows = start + offs
        lid = _local_expert_ids(topk_ids_ptr, expert_map_ptr, rows, rows < num_rows, num_global,
                                num_local, stride_it, stride_ik, TOPK, HAS_MAP)
        hit = (lid == e).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_rows_ptr + base + rank, rows, mask=hit != 0)
        base += tl.sum(hit, axis=0)


@triton.jit
def _report_bad_ids(report_ptr, id_lo, id_hi, num_global, map_lo, map_hi, num_local):
    """Write the bad-id report (bad_ids.py's words: kind, lo, hi, bound) when a range is not empty;
    ids first. Nothing is written for a call without bad values, so a report stays until read."""
    if id_lo <= id_hi:
        tl.store(report_ptr + _LO, id_lo)
        tl.store(report_ptr + _HI, id_hi)
        tl.store(report_ptr + _BOUND, tl.cast(num_global, tl.int64))  # (tl.cast: a 1 arrives as a constexpr)
        tl.store(report_ptr + _KIND, _TOPK_IDS)
    elif map_lo <= map_hi:
        tl.store(report_ptr + _LO, map_lo)
        tl.store(report_ptr + _HI, map_hi)
        tl.store(report_ptr + _BOUND, tl.cast(num_local, tl.int64))
        tl.store(report_ptr + _KIND, _EXPERT_MAP)


@triton.jit
def _tile_of(pid_m, counts_ptr, num_local, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a row-tile id to (tiles in use, expert, first row inside the expert, rows of the
    expert, expert's first position in the sorted order). Pure function of the counts."""
    eo = tl.arange(0, E_PAD)
    cnt = tl.load(counts_ptr + eo, mask=eo < num_local, other=0)
    tiles = (cnt + BLOCK_M - 1) // BLOCK_M
    cum = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    e = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = eo == e
    tile0 = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
    count_e = tl.sum(tl.where(sel, cnt, 0), axis=0)
    start_e = tl.sum(tl.where(eo < e, cnt, 0), axis=0)
    return total, e, (pid_m - tile0) * BLOCK_M, count_e, start_e


@triton.jit
def _dot(a, b, acc, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    if DOT_F32:
        # The Triton interpreter (CPU tests) mis-multiplies bf16 dots: upcast there.
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if DOT_IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _acc_zeros(M: tl.constexpr, N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The fp32 accumulator of an [M, N] output tile, held transposed under ``SWAP_AB``."""
    if SWAP_AB:
        acc = tl.zeros([N, M], dtype=tl.float32)
    else:
        acc = tl.zeros([M, N], dtype=tl.float32)
    return acc


@triton.jit
def _mma(a, b, acc, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += a @ b`` (a: [rows, K] activations, b: [K, columns] weights). ``SWAP_AB`` computes
    the transpose, ``acc.T += b.T @ a.T``, so the weight columns are the matrix instruction's M side
    and a handful of token rows its N side (as small as 16, where wgmma's M is 64): at decode sizes
    the shared memory then holds weight tiles, not padding rows, and more of them are in flight.
    Each output element sums the same products in the same K order either way."""
    if SWAP_AB:
        acc = _dot(tl.trans(b), tl.trans(a), acc, DOT_IEEE, DOT_F32)
    else:
        acc = _dot(a, b, acc, DOT_IEEE, DOT_F32)
    return acc


@triton.jit
def _program_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of a program. Groups of GROUP_M row tiles sweep all column tiles
    together, row tiles fastest: the row tiles of one expert (adjacent) read each weight tile at the
    same time, so it comes from HBM once, and a row tile's A rows stay in L2 across the columns.
    GROUP_M = 1 is plain column-fastest order."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % in_group
    return first_m + local % size, local // size


@triton.jit
def _expert_tile(pid, counts_ptr, num_local, num_m, N, BLOCK_N: tl.constexpr,
                 E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``pid`` (the program id, or a work item of the one-launch decode kernel) of a grouped
    GEMM over the scheduled rows (``N`` columns in tiles of ``BLOCK_N``): (tile in use, column
    tile, expert, first row inside the expert, rows of the expert, expert's first sorted
    position). Shared by every GEMM kernel here, in triton_moe_fp8.py and in ep_cuda.py."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _program_tile(pid, num_m, num_n, GROUP_M)
    total, e, m0, count_e, start_e = _tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M)
    return pid_m < total, pid_n, e, m0, count_e, start_e


@triton.jit
def _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M: tl.constexpr):
    """(row offsets inside the expert, row mask, scheduled rows ``t * K + k``) of a tile in use."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count_e
    rows = tl.load(sorted_rows_ptr + start_e + offs_m, mask=row_ok, other=0)
    return offs_m, row_ok, rows


@triton.jit
def _scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, RNE_FIX: tl.constexpr):
    """GEMM2 epilogue: each row (rounded to ``y``'s dtype) to its (token, k) slot; ``y`` is
    [T*K, H] in row order."""
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * H + offs_n[None, :]
    tl.store(y_ptrs, _cast(acc, y_ptr.dtype.element_ty, RNE_FIX), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _load_rows(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] A tile: zero in rows past the expert's count and (``k_ok``, only read when
    not ``EVEN_K``) past the K range. Every GEMM here and in triton_moe_fp8.py loads A this way."""
    if EVEN_K:
        a = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a


@triton.jit
def _load_cols(ptrs, n_ok, k_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """A [BLOCK_K, columns] weight tile by pointer loads (where TMA is not used): zero past the
    columns (``n_ok``) and the K range (``k_ok``), masks dropped where the shape is even."""
    if EVEN_K:
        if EVEN_N:
            b = tl.load(ptrs)
        else:
            b = tl.load(ptrs, mask=n_ok[None, :], other=0.0)
    else:
        b = tl.load(ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
    return b


@triton.jit
def _gemm1_tile(
    x_ptr, w_ptr, w_desc, act_ptr, tok, offs_m, row_ok, pid_n, e, start_e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    """One [BLOCK_M, BLOCK_N] tile of GEMM1 for expert ``e`` (A rows ``x[tok]``), SiLU(gate) * up
    stored into ``act``. Shared with the expert-parallel GEMM1 that pulls its rows (ep_cuda.py).
    ``STAGES``: the K loop's pipeline depth (None: the kernel's ``num_stages``).

    The B tile is [BLOCK_K, 2*BLOCK_N]: this column tile's gate rows of ``w13`` then its up rows,
    so a single dot (one wgmma chain of width 2*BLOCK_N) makes both; the epilogue splits the
    accumulator in halves. With ``USE_TMA`` one TMA box of ``w13`` viewed as [E, 2, I, H] holds it
    (past I or H: zero fill); else pointer loads. ``SWAP_AB``: see ``_mma``."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    # A rows gathered from hidden_states by token index (no permuted copy).
    a_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xh
    if not USE_TMA:
        offs_j = tl.arange(0, 2 * BLOCK_N)
        n_j = pid_n * BLOCK_N + offs_j % BLOCK_N
        nj_ok = n_j < I
        w_ptrs = (w_ptr + e.to(tl.int64) * stride_we + (n_j + (offs_j // BLOCK_N) * I)[None, :] * stride_wn
                  + offs_k[:, None] * stride_wk)
    acc = _acc_zeros(BLOCK_M, 2 * BLOCK_N, SWAP_AB)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < H - k0
        a = _load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([e, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
        else:
            b = _load_cols(w_ptrs, nj_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
        acc = _mma(a, b, acc, DOT_IEEE, DOT_F32, SWAP_AB)
        a_ptrs += BLOCK_K * stride_xh
    if SWAP_AB:
        acc = tl.trans(acc)
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    # Same rounding points as the reference: gate/up in the input dtype, SiLU*up in fp32.
    out_ty = act_ptr.dtype.element_ty
    gate = _cast(acc_g, out_ty, DOT_F32).to(tl.float32)
    up = _cast(acc_u, out_ty, DOT_F32).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + (start_e + offs_m)[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(act_ptrs, _cast(h, out_ty, DOT_F32), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count, see _moe_schedule_kernel
def _moe_gemm1_kernel(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, HALF_TAIL: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = _expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        # HALF_TAIL: an expert's last tile, when half a tile holds its rows, runs as a tile of
        # BLOCK_M // 2 rows (less padding; a row's result does not depend on the tile's height).
        if HALF_TAIL:
            if count_e - m0 <= BLOCK_M // 2:
                _gemm1_rows(
                    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                    TOPK, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
                )
            else:
                _gemm1_rows(
                    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                    TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
                )
        else:
            _gemm1_rows(
                x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
                TOPK, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
            )


@triton.jit
def _gemm1_rows(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    offs_m, row_ok, rows = _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    _gemm1_tile(
        x_ptr, w_ptr, w_desc, act_ptr, (rows // TOPK).to(tl.int64), offs_m, row_ok, pid_n, e, start_e, H, I,
        stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
    )


@triton.jit
def _gemm2_tile(
    act_ptr, w_ptr, w_desc, e, start_e, offs_m, row_ok, pid_n, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    """One [BLOCK_M, BLOCK_N] tile of GEMM2 for expert ``e``: fp32 accumulator, columns, mask.
    Shared by every GEMM2 epilogue (here and the expert-parallel push in ep_cuda.py). ``SWAP_AB``:
    see ``_mma``; ``STAGES``: as in ``_gemm1_tile``."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    a_ptrs = act_ptr + (start_e + offs_m)[:, None].to(tl.int64) * I + offs_k[None, :]
    if USE_TMA:
        row_w = e * H + pid_n * BLOCK_N  # row of w2 viewed as [E*H, I]
    else:
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = _acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < I - k0
        a = _load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([row_w, k0]).T
        else:
            b = _load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
        acc = _mma(a, b, acc, DOT_IEEE, DOT_F32, SWAP_AB)
        a_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc, offs_n, n_ok


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count, see _moe_schedule_kernel
def _moe_gemm2_kernel(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, HALF_TAIL: tl.constexpr, SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    _grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = _expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        if HALF_TAIL:  # as in _moe_gemm1_kernel
            if count_e - m0 <= BLOCK_M // 2:
                _gemm2_rows(
                    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                    stride_we, stride_wn, stride_wk,
                    BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
                )
            else:
                _gemm2_rows(
                    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                    stride_we, stride_wn, stride_wk,
                    BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
                )
        else:
            _gemm2_rows(
                act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_we, stride_wn, stride_wk,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
            )


@triton.jit
def _gemm2_rows(
    act_ptr, w_ptr, w_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    offs_m, row_ok, rows = _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
    acc, offs_n, n_ok = _gemm2_tile(
        act_ptr, w_ptr, w_desc, e, start_e, offs_m, row_ok, pid_n, H, I,
        stride_we, stride_wn, stride_wk,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
    )
    _scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, DOT_F32)


# The one-launch decode kernel's sync words (int32, zeroed by ``_moe_schedule_zero_kernel``): the
# work-item ticket, the error flag, then one GEMM1 completion count per row tile.
SYNC_TICKET, SYNC_ERROR, SYNC_TILES = 0, 1, 2
_SYNC_TICKET, _SYNC_ERROR, _SYNC_TILES = tl.constexpr(SYNC_TICKET), tl.constexpr(SYNC_ERROR), tl.constexpr(SYNC_TILES)


@triton.jit(do_not_specialize=["num_rows"])
def _moe_schedule_zero_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    sync_ptr, num_sync,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """``_moe_schedule_kernel``, plus one program that zeroes the decode kernel's sync words (the
    previous call's kernel has finished: this one waits for it, see ``_grid_dependency``)."""
    _grid_dependency(PDL)
    if tl.program_id(0) < num_local:
        _moe_schedule_kernel(
            topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
            num_rows, num_global, num_local, stride_it, stride_ik, TOPK, HAS_MAP, BLOCK, False,
        )
    else:
        offs = tl.arange(0, BLOCK)
        for start in range(0, num_sync, BLOCK):
            tl.store(sync_ptr + start + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=start + offs < num_sync)


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
    TIMELINE: tl.constexpr,
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
    the tile's rows instead of hanging or computing on unwritten data. With ``NARROW_N2`` (0: off)
    the last ``narrow_m`` row tiles in use take GEMM2 items ``NARROW_N2`` columns wide
    (``w2_narrow_desc``'s boxes). Each tile's arithmetic is that of the two-launch kernels, so the
    bits are the same. ``TIMELINE`` records each item's
    times (``_timeline_record``) for the profile, without changing what is computed."""
    _grid_dependency(PDL)
    item = tl.atomic_add(sync_ptr + _SYNC_TICKET, 1, sem="relaxed")
    t_start = _now(TIMELINE)
    num_n1 = tl.cdiv(I, BLOCK_N1)
    gemm1_items = num_m * num_n1
    if item < gemm1_items:
        in_use, pid_n, e, m0, count_e, start_e = _expert_tile(
            item, counts_ptr, num_local, num_m, I, BLOCK_N1, E_PAD, BLOCK_M, 1
        )
        if in_use:
            _gemm1_rows(
                x_ptr, w13_ptr, w13_desc, act_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_xt, stride_xh, stride_w13e, stride_w13n, stride_w13k,
                TOPK, BLOCK_M, BLOCK_N1, BLOCK_K1, EVEN_K1, EVEN_N1, DOT_IEEE, DOT_F32, USE_TMA1, SWAP_AB, STAGES1,
            )
            tl.debug_barrier()
            tl.atomic_add(sync_ptr + _SYNC_TILES + item // num_n1, 1, sem="release", scope="gpu")
            if TIMELINE:
                _timeline_record(timeline_ptr, item, t_start, t_start, tl.minimum(BLOCK_N1, I - pid_n * BLOCK_N1))
    elif item < gemm1_items + (num_m + narrow_m) * tl.cdiv(H, BLOCK_N2):  # (a ticket past the last item does nothing)
        item2 = item - gemm1_items
        num_n2 = tl.cdiv(H, BLOCK_N2)
        if NARROW_N2 == 0:
            wide_items = num_m * num_n2
        else:
            # The last ``narrow_m`` row tiles in use run GEMM2 in NARROW_N2-wide column tiles, so
            # the items drawn last are short and the grid's tail drains sooner.
            total = _tile_of(0, counts_ptr, num_local, E_PAD, BLOCK_M)[0]
            wide_items = tl.maximum(total - narrow_m, 0) * num_n2
        if item2 < wide_items:
            pid_m = item2 // num_n2
            total, e, m0, count_e, start_e = _tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M)
            _decode_gemm2_item(
                act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
                pid_m < total, pid_m, item2 % num_n2, e, m0, count_e, start_e, num_n1, H, I, max_polls,
                stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, BLOCK_N2, BLOCK_K2, STAGES2, EVEN_K2, EVEN_N2, USE_TMA2, DOT_IEEE, DOT_F32, SWAP_AB, TIMELINE,
            )
        elif NARROW_N2 > 0:
            narrow = item2 - wide_items
            pid_m = wide_items // num_n2 + narrow // tl.cdiv(H, NARROW_N2)
            total, e, m0, count_e, start_e = _tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M)
            _decode_gemm2_item(
                act_ptr, w2_ptr, w2_narrow_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
                pid_m < total, pid_m, narrow % tl.cdiv(H, NARROW_N2), e, m0, count_e, start_e, num_n1, H, I,
                max_polls, stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, NARROW_N2, BLOCK_K2, STAGES2, EVEN_K2, H % NARROW_N2 == 0, USE_TMA2, DOT_IEEE, DOT_F32,
                SWAP_AB, TIMELINE,
            )


@triton.jit
def _decode_gemm2_item(
    act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, sync_ptr, timeline_ptr, item, t_start,
    in_use, pid_m, pid_n, e, m0, count_e, start_e, num_n1, H, I, max_polls,
    stride_w2e, stride_w2n, stride_w2k,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, DOT_IEEE: tl.constexpr,
    DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr, TIMELINE: tl.constexpr,
):
    """A GEMM2 work item of ``_moe_decode_experts_kernel``: wait (bounded) until every GEMM1
    column tile of row tile ``pid_m`` is done, then the tile (or NaN rows if the wait ran out)."""
    if in_use:
        # Scalar atomics: Triton broadcasts their result, so every thread agrees on the loop.
        done_ptr = sync_ptr + _SYNC_TILES + pid_m
        done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
        polls = 0
        while (done < num_n1) & (polls < max_polls):
            done = tl.atomic_add(done_ptr, 0, sem="acquire", scope="gpu")
            polls += 1
        tl.debug_barrier()
        t_ready = _now(TIMELINE)
        if done < num_n1:
            tl.atomic_xchg(sync_ptr + _SYNC_ERROR, 1, sem="relaxed")
            offs_m, row_ok, rows = _tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            nan = tl.full([BLOCK_M, BLOCK_N], float("nan"), dtype=tl.float32)
            _scatter_rows(nan, rows, row_ok, offs_n, offs_n < H, y_ptr, H, DOT_F32)
        else:
            _gemm2_rows(
                act_ptr, w2_ptr, w2_desc, y_ptr, sorted_rows_ptr, m0, count_e, start_e, pid_n, e, H, I,
                stride_w2e, stride_w2n, stride_w2k,
                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB, STAGES,
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
    t_end = _now(True)
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
    _grid_dependency(PDL)
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
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, _cast(acc, out_ptr.dtype.element_ty, RNE_FIX), mask=h_ok)


# ----------------------------------------------------------------------------------------------
# Configuration: a function of static shapes only (tokens, top_k, experts, hidden, intermediate).
# ----------------------------------------------------------------------------------------------

def _kdim_block(k_dim: int, most: int = 64) -> int:
    """The K block: ``most`` (64, or 128 in the decode regime), less for a short K dimension."""
    return min(most, max(16, triton.next_power_of_2(k_dim)))


def pick_configs(tokens: int, top_k: int, num_local: int, hidden: int, inter: int, *,
                 one_launch: bool = False) -> tuple[dict, dict]:
    """(GEMM1 config, GEMM2 config) for a call; depends on shapes only, never on device values.

    Regimes by the average rows per expert (``tokens * top_k / experts``, a static quantity):
    up to 8 -> decode: operands swapped (``SWAP_AB``: weight columns on wgmma's M side, 16-row token
    tiles on its N side), 128-deep K blocks and deep pipelines, narrow column tiles so that a few
    hundred programs read weights; up to 48 -> weight streaming with 64-row tiles; more rows ->
    128-row tiles, 128x256 output tiles. Measured on an H200 (kernels/DESIGN.md#tiling-regimes,
    loadtest/JOURNAL.md#versions). Every regime gives the same bits for a row: each output element
    chains the same 16-deep wgmma k-steps on one fp32 accumulator in K order, whatever the tile
    shape, the operand order or the K block.

    ``one_launch``: at decode sizes, configs for both GEMMs in one launch (``ONE_LAUNCH`` in GEMM1's
    config, see ``one_launch_decode``); elsewhere it changes nothing.
    """
    rows = tokens * top_k
    avg = rows / max(num_local, 1)
    busy = max(1, min(rows, num_local))
    few = busy <= 2 * top_k  # at most two tokens' experts: a grid of a few hundred programs
    if avg <= 8:
        # Decode (sweeps at d1dc340-5767485, sweep_swap*_*.log): a 16-row token tile holds an expert's
        # rows (8 on average), so shared memory holds weight tiles rather than padding rows: 6 stages
        # of 128-deep GEMM1 tiles and 3 of GEMM2's. 2-6% faster than 64-row tiles with 64-deep K
        # blocks at 1-128 tokens on all five shapes; 18-44% slower at 16-32 rows per expert (a second
        # tile per expert reads the weights again).
        bn1 = 64
        while bn1 > 32 and busy * triton.cdiv(inter, bn1) < 2 * _SMS:  # 2 * BLOCK_N >= 64: wgmma's M
            bn1 //= 2
        bn2 = _gemm2_columns(busy, hidden, few, least=64)
        stages1 = 6
        tile = dict(BLOCK_M=16, num_warps=4, USE_TMA=True, SWAP_AB=True)
        if one_launch:
            # One kernel holds both GEMMs, so a program's shared memory is the larger one's: keep
            # both within half an SM (GEMM1 64 columns at 4 stages, GEMM2 128 columns at 3: ~110 KB)
            # so that two programs per SM run either (sweeps at a8aadca and 8ef0ff0,
            # loadtest/JOURNAL.md#both-gemms-in-one-launch-a8aadca-to-fa66538).
            bn2 = min(bn2, 128)
            stages1 = 6 if bn1 == 32 else 4
            tile["ONE_LAUNCH"] = True
        g2 = dict(BLOCK_N=bn2, BLOCK_K=_kdim_block(inter, 128), num_stages=3, **tile)
        if one_launch and busy <= top_k and bn2 >= 128:
            # One token's experts: the last two row tiles in use take half-width GEMM2 items, so
            # the items drawn last are short (interleaved sweeps, 5 repeats: 1 token 0-4% faster
            # on four shapes, e.g. Qwen3-235B-A22B skewed 0.068 vs 0.071 ms, git history: loadtest/results/sweep_tail_3e74f2c.log at 70c7c60;
            # 2 tokens within 1 us either way, 8 tokens tie, git history: loadtest/results/sweep_two_70c7c60.log at e533052).
            g2["NARROW_TAIL"] = 2
        return dict(BLOCK_N=bn1, BLOCK_K=_kdim_block(hidden, 128), num_stages=stages1, **tile), g2
    bk1, bk2 = _kdim_block(hidden), _kdim_block(inter)
    if avg <= 48:
        # Weight streaming: fill 132 SMs with narrow column tiles. 4 stages fit more programs per
        # SM than 5 (sweeps at d12e81a/c32df4d, loadtest/results/history.csv, commits d12e81a and c32df4d:
        # 1-7% faster at 8-128 tokens on all five shapes).
        bn1 = 64
        while bn1 > 16 and busy * triton.cdiv(inter, bn1) < 2 * _SMS:
            bn1 //= 2
        bn2 = _gemm2_columns(busy, hidden, few, least=32)
        g1 = dict(BLOCK_M=64, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=4, num_stages=4, USE_TMA=True)
        g2 = dict(BLOCK_M=64, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4, num_stages=4, USE_TMA=True)
    else:
        # 4 stages hide more HBM latency where weights still dominate (~5-12% faster at 2048 tokens);
        # at >160 rows/expert the 4th stage (192 KB of shared memory) was up to 33% slower.
        stages = 4 if avg <= 160 else 3
        # Half-height last tiles (HALF_TAIL) were 1-7% faster at 2048-8192 tokens (sweep at 93218e1).
        g1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk1, num_warps=8, num_stages=stages, USE_TMA=True, GROUP_M=4,
                  HALF_TAIL=True)
        g2 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk2, num_warps=8, num_stages=stages, USE_TMA=True, GROUP_M=4,
                  HALF_TAIL=True)
    return g1, g2


# Hopper as on the H100/H200 SXM: 132 SMs.
_SMS = 132


def _gemm2_columns(busy: int, hidden: int, few: bool, least: int) -> int:
    """GEMM2's column tile (at least ``least``) where weights are streamed. With few experts busy
    one program per SM streams enough, and wider tiles are faster (interleaved sweep at b22b37b,
    history.csv (commit b22b37b): 1-2 tokens, all five shapes, 0-12% faster than half as wide); beyond,
    two programs per SM."""
    bn2, min_programs = (256, _SMS) if few else (128, 2 * _SMS)
    while bn2 > least and busy * triton.cdiv(hidden, bn2) < min_programs:
        bn2 //= 2
    return bn2


def _max_row_tiles(rows: int, num_local: int, block_m: int) -> int:
    # sum_e ceil(c_e / BM) <= floor(sum_e c_e / BM) + (number of non-empty experts).
    return rows // block_m + min(num_local, rows)


def _descriptor(t2d: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


def _tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` as the 2-D (or reshaped) views here: contiguous, 16-byte aligned
    start and rows."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def _interpreting() -> bool:
    return knob("interpret")


@functools.lru_cache(maxsize=None)
def _cc_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def pdl_launch(t: torch.Tensor, pdl: bool | None = None) -> dict:
    """The launch keywords of a kernel on ``t``'s device: ``PDL`` (the kernel's constexpr) and
    ``launch_pdl``, both on for compiled code on Hopper and newer when ``pdl`` is (default: the
    ``pdl`` knob, ``MOK_PDL``, read now; programmatic dependent launch for every kernel of a call,
    see ``_grid_dependency``)."""
    on = knob("pdl", pdl) and t.is_cuda and not _interpreting() and _cc_major(t.device.index or 0) >= 9
    return dict(PDL=on, launch_pdl=on)


# ----------------------------------------------------------------------------------------------
# Launch steps (shared by fused_moe_triton and the expert-parallel workspace in ep_cuda.py)
# ----------------------------------------------------------------------------------------------


def _gemm_config(config: dict, act: torch.Tensor, interpret: bool, **defaults) -> dict:
    """A copy of a ``pick_configs`` entry with its defaults filled in. TMA needs compiled code,
    contiguous weights and 16-byte aligned rows: it stays off under the interpreter, off the GPU
    and for fp32 data here, and the launchers turn it off for weights ``_tma_ok`` rejects."""
    g = dict(config)
    for key, value in defaults.items():
        g.setdefault(key, value)
    g["USE_TMA"] = bool(g.get("USE_TMA", False)) and not interpret and act.is_cuda and act.dtype != torch.float32
    return g


def _w13_operand(w13: torch.Tensor, g: dict):
    """GEMM1's weight operand for config ``g``: a TMA descriptor of ``w13`` viewed as [E, 2, I, H]
    (one box holds a column tile's gate rows then its up rows), or ``w13`` itself for pointer loads
    (``g["USE_TMA"]`` is turned off where TMA cannot read it)."""
    if g["USE_TMA"]:
        if _tma_ok(w13):
            num_local, two_i, hidden = w13.shape
            return _descriptor(w13.view(num_local, 2, two_i // 2, hidden), [1, 2, g["BLOCK_N"], g["BLOCK_K"]])
        g["USE_TMA"] = False
    return w13


def _w2_operand(w2: torch.Tensor, g: dict, block_k: int):
    """GEMM2's weight operand (bf16 or FP8), as ``_w13_operand``: a TMA descriptor of ``w2`` viewed
    as [E*H, I] with [BLOCK_N, block_k] boxes, or ``w2``."""
    if g["USE_TMA"]:
        if _tma_ok(w2):
            num_local, hidden, inter = w2.shape
            return _descriptor(w2.view(num_local * hidden, inter), [g["BLOCK_N"], block_k])
        g["USE_TMA"] = False
    return w2


def _e_pad(num_local: int) -> int:
    return max(16, triton.next_power_of_2(num_local))


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
    """``_moe_schedule_kernel`` over every (token, k) row of ``topk_ids`` ``[N, K]``: per-expert
    ``counts`` and ``sorted_rows`` (each expert's rows, in row order). ``num_local >= 1``.
    ``kernel`` replaces it by a kernel with the same leading parameters whose programs
    ``>= num_local`` do other work (``extra_programs`` of them; the FP8 quantization pass),
    ``extra_args`` / ``extra_constexprs`` being its own ones."""
    rows = topk_ids.shape[0] * topk_ids.shape[1]
    has_map = expert_map is not None
    (_moe_schedule_kernel if kernel is None else kernel)[(num_local + extra_programs,)](
        topk_ids, expert_map if has_map else topk_ids, counts, sorted_rows,  # (dummy pointer without a map)
        bad_ids.report_words(topk_ids.device),
        rows, num_global, num_local, topk_ids.stride(0), topk_ids.stride(1), *extra_args,
        TOPK=topk_ids.shape[1], HAS_MAP=has_map, **schedule_block(rows), **pdl_launch(counts, pdl), **extra_constexprs,
    )


def schedule_block(rows: int) -> dict:
    """BLOCK and num_warps of the schedule kernel over ``rows`` (token, k) rows. Every program scans
    all rows (twice): wide blocks keep that latency-bound loop short."""
    if rows > 2048:
        return dict(BLOCK=4096, num_warps=8)
    return dict(BLOCK=256 if rows <= 256 else 1024, num_warps=4)


def kernel_variants(tokens: int, top_k: int, num_local: int, hidden: int, inter: int, *,
                    one_launch: bool | None = None) -> tuple:
    """What selects the compiled kernels a ``fused_moe_triton`` call of ``tokens`` tokens runs: the
    schedule's block and both GEMM configs. Per-call counts are never specialized on, so calls with
    equal variants (and equal dtypes) run the same binaries (``kernels.warm_up`` compiles each).
    ``one_launch`` as ``fused_moe_triton``'s."""
    g1, g2 = pick_configs(tokens, top_k, num_local, hidden, inter, one_launch=knob("one_launch", one_launch))
    return tuple(tuple(sorted(d.items())) for d in (schedule_block(tokens * top_k), g1, g2))


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
    g = _gemm_config(config, act, interpret, GROUP_M=1, HALF_TAIL=False, SWAP_AB=False)
    if kernel is not None:
        g.pop("HALF_TAIL")  # the expert-parallel kernels always run full tiles
    bm, bn = g["BLOCK_M"], g["BLOCK_N"]
    w13_desc = _w13_operand(w13, g)
    num_m = _max_row_tiles(rows, num_local, bm)
    (_moe_gemm1_kernel if kernel is None else kernel)[(num_m * triton.cdiv(inter, bn),)](
        x, w13, w13_desc, act, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), *extra_args,
        TOPK=top_k, E_PAD=_e_pad(num_local),
        EVEN_K=hidden % g["BLOCK_K"] == 0, EVEN_N=inter % bn == 0,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret,
        **pdl_launch(act, pdl), **extra_constexprs, **g,
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
    g = _gemm_config(config, act, interpret, GROUP_M=1, HALF_TAIL=False, SWAP_AB=False)
    if kernel is not None:
        g.pop("HALF_TAIL")  # the expert-parallel kernels always run full tiles
    bm, bn = g["BLOCK_M"], g["BLOCK_N"]
    w2_desc = _w2_operand(w2, g, g["BLOCK_K"])
    num_m = _max_row_tiles(rows, num_local, bm)
    (_moe_gemm2_kernel if kernel is None else kernel)[(num_m * triton.cdiv(hidden, bn),)](
        act, w2, w2_desc, y, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), w2.stride(2), *extra_args,
        E_PAD=_e_pad(num_local),
        EVEN_K=inter % g["BLOCK_K"] == 0, EVEN_N=hidden % bn == 0,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret,
        **pdl_launch(act, pdl), **extra_constexprs, **g,
    )


# Polls of a GEMM2 tile's wait in the one-launch decode kernel (an L2 round trip each, about a
# microsecond): seconds, where a wait that ends lasts at most one GEMM1 tile.
DECODE_MAX_POLLS = 1 << 22


def one_launch_decode(g1: dict, g2: dict) -> bool:
    """Whether ``fused_moe_triton`` runs both GEMMs of a call with these configs as one launch
    (``_moe_decode_experts_kernel``): ``pick_configs(..., one_launch=True)`` marks them so at decode
    sizes, which ``fused_moe_triton`` asks for unless ``ONE_LAUNCH_DECODE`` is off
    (``MOK_DECODE_ONE_LAUNCH=0``)."""
    return g1.get("ONE_LAUNCH", False)


def decode_sync_words(rows: int, num_local: int, block_m: int) -> int:
    """Int32 sync words of a one-launch decode call (ticket, error flag, a count per row tile)."""
    return SYNC_TILES + _max_row_tiles(rows, num_local, block_m)


def decode_items(rows: int, num_local: int, hidden: int, inter: int, configs: tuple[dict, dict]) -> tuple[int, int]:
    """Work items of a one-launch decode call, (GEMM1's, GEMM2's): every row tile's GEMM1 column
    tiles come first in ticket order, then its GEMM2 ones; the grid has one program per item."""
    g1, g2 = configs
    num_m = _max_row_tiles(rows, num_local, g1["BLOCK_M"])
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
    once per half-width column tile."""
    g1, g2 = configs
    bm = g1["BLOCK_M"]
    tile_rows = [min(bm, c - m0) for c in counts for m0 in range(0, c, bm)]
    rows = sum(tile_rows)
    n1 = triton.cdiv(inter, g1["BLOCK_N"])
    n2 = triton.cdiv(hidden, g2["BLOCK_N"])
    narrow = min(g2.get("NARROW_TAIL", 0), len(tile_rows))
    narrow_rows = sum(tile_rows[len(tile_rows) - narrow:])
    return dict(
        gemm1_a=rows * hidden * n1 * elem_bytes,
        gemm1_b=len(tile_rows) * 2 * inter * hidden * elem_bytes,
        gemm2_a=((rows - narrow_rows) * n2 + narrow_rows * triton.cdiv(hidden, g2["BLOCK_N"] // 2)) * inter * elem_bytes,
        gemm2_b=len(tile_rows) * hidden * inter * elem_bytes,
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
    g1 = _gemm_config(configs[0], act, interpret)
    g2 = _gemm_config(configs[1], act, interpret)
    if not (g1.get("SWAP_AB", False) == g2.get("SWAP_AB", False) and g1["BLOCK_M"] == g2["BLOCK_M"]
            and g1["num_warps"] == g2["num_warps"]):
        raise ValueError(f"one-launch decode configs need tiles of one height, operand order and warp count: {configs}")
    w13_desc = _w13_operand(w13, g1)
    w2_desc = _w2_operand(w2, g2, g2["BLOCK_K"])
    bm, bn1, bk1, bn2, bk2 = g1["BLOCK_M"], g1["BLOCK_N"], g1["BLOCK_K"], g2["BLOCK_N"], g2["BLOCK_K"]
    narrow_m = g2.get("NARROW_TAIL", 0)
    narrow_n2 = bn2 // 2 if narrow_m else 0
    if narrow_m and g2.get("SWAP_AB", False) and narrow_n2 < 64:
        raise ValueError(f"a narrow GEMM2 tail needs BLOCK_N >= 128 (its half is wgmma's M side): {configs}")
    w2_narrow_desc = _w2_operand(w2, dict(g2, BLOCK_N=narrow_n2), bk2) if narrow_m else w2_desc
    num_m = _max_row_tiles(rows, num_local, bm)
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
        TOPK=top_k, E_PAD=_e_pad(num_local), BLOCK_M=bm,
        BLOCK_N1=bn1, BLOCK_K1=bk1, STAGES1=g1["num_stages"], EVEN_K1=hidden % bk1 == 0, EVEN_N1=inter % bn1 == 0,
        USE_TMA1=g1["USE_TMA"],
        BLOCK_N2=bn2, BLOCK_K2=bk2, STAGES2=g2["num_stages"], EVEN_K2=inter % bk2 == 0, EVEN_N2=hidden % bn2 == 0,
        USE_TMA2=g2["USE_TMA"], NARROW_N2=narrow_n2,
        DOT_IEEE=act.dtype == torch.float32 or interpret, DOT_F32=interpret, SWAP_AB=g1.get("SWAP_AB", False),
        TIMELINE=timeline is not None, num_warps=g1["num_warps"], num_stages=g1["num_stages"], **pdl_launch(act, pdl),
    )


def combine_block(hidden: int) -> int:
    """BLOCK_H of the top-k combine kernels (a program per (token, BLOCK_H columns))."""
    return min(1024, max(16, triton.next_power_of_2(hidden)))


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
        **pdl_launch(out, pdl),
    )


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def _layer_setup(hidden_states: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, expert_map):
    """What a Triton MoE layer call starts with (bf16 or FP8 experts): ``(out, None)`` where the
    freshly allocated ``out`` is already the answer (no tokens: empty; no top-k, experts or
    intermediate columns: zeros), else ``(out, (tokens, hidden, num_local, inter, top_k, rows,
    num_global, counts, sorted_rows))`` with the schedule's two buffers allocated after ``out``."""
    tokens, hidden = hidden_states.shape
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dev = hidden_states.device
    out = torch.empty((tokens, hidden), dtype=hidden_states.dtype, device=dev)
    if tokens == 0:
        return out, None
    if top_k == 0 or num_local == 0 or inter == 0:
        return out.zero_(), None
    rows = tokens * top_k
    num_global = expert_map.numel() if expert_map is not None else num_local
    counts = torch.empty(num_local, dtype=torch.int32, device=dev)
    sorted_rows = torch.empty(rows, dtype=torch.int32, device=dev)
    return out, (tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows)


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
    _configs: tuple[dict, dict] | None = None,
    _timeline: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts of one MoE layer (see ``reference.py``) in four Triton launches.

    No host synchronisation: the arguments' shapes, dtypes and devices are checked on the host,
    the ids' values by the schedule kernel, which reports bad ones to the next call (``bad_ids.py``).
    ``pdl``: launch with programmatic dependent launch (``pdl_launch``); ``one_launch``: both GEMMs
    as one launch at decode sizes (``one_launch_decode``); either left at ``None`` is read from the
    environment now (``env.py``: ``MOK_PDL``, ``MOK_DECODE_ONE_LAUNCH``, both on by default).
    ``_configs`` overrides the block sizes (benchmark sweeps only); ``_timeline`` receives the
    one-launch decode kernel's per-item records (profiles only, see ``launch_decode_experts``).
    """
    bad_ids.raise_if_reported(hidden_states.device)
    check_fused_moe_args(
        hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation, check_values=False
    )
    out, layer = _layer_setup(hidden_states, w13, topk_ids, expert_map)
    if layer is None:
        return out
    tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows = layer
    dev = hidden_states.device
    interpret = _interpreting()
    pdl = knob("pdl", pdl)
    act = torch.empty((rows, inter), dtype=hidden_states.dtype, device=dev)
    y = torch.empty((rows, hidden), dtype=hidden_states.dtype, device=dev)

    if _configs is None:
        _configs = pick_configs(tokens, top_k, num_local, hidden, inter, one_launch=knob("one_launch", one_launch))
    g1, g2 = _configs
    if one_launch_decode(g1, g2):
        sync = torch.empty(decode_sync_words(rows, num_local, g1["BLOCK_M"]), dtype=torch.int32, device=dev)
        launch_schedule(topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
                        kernel=_moe_schedule_zero_kernel, extra_programs=1, extra_args=(sync, sync.numel()), pdl=pdl)
        launch_decode_experts(hidden_states, w13, w2, act, y, sorted_rows, counts, sync, rows, top_k, (g1, g2),
                              interpret=interpret, timeline=_timeline, pdl=pdl)
    elif _timeline is not None:
        raise ValueError("a timeline records the one-launch decode kernel, and this call's configs do not run it")
    else:
        launch_schedule(topk_ids, expert_map, counts, sorted_rows, num_local, num_global, pdl=pdl)
        launch_gemm1(hidden_states, w13, act, sorted_rows, counts, rows, top_k, g1, interpret=interpret, pdl=pdl)
        launch_gemm2(act, w2, y, sorted_rows, counts, rows, g2, interpret=interpret, pdl=pdl)
    launch_combine(y, out, topk_ids, topk_weights, expert_map, num_local, num_global, interpret=interpret, pdl=pdl)
    return out
