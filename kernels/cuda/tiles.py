"""The tile library of the CUDA kernels: the ``@triton.jit`` device functions that the bf16 op
(``moe.py``), the FP8 op (``moe_fp8.py`` with ``fp8_tiles.py``) and the expert-parallel kernels
(``ep.py``) share, and the schedule kernel (``moe_schedule_kernel``) every call starts with (the FP8
and decode variants call it as a function). Every name here is public: importing them is what they
are for. How the kernels use them: ``moe.py``'s docstring and DESIGN.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import bad_ids

__all__ = [
    "acc_zeros", "cast", "dot", "expert_ids", "expert_tile", "gemm1_tile", "gemm2_tile", "grid_dependency",
    "load_cols", "load_rows", "local_expert_ids", "mma", "moe_schedule_kernel", "now", "program_tile",
    "report_bad_ids", "scatter_rows", "tile_of", "tile_rows", "two_height_expert_tile", "two_height_tile_of",
    "wait_count", "zero_words",
]


@triton.jit
def cast(x, ty: tl.constexpr, RNE_FIX: tl.constexpr):
    """``x.to(ty)``. Under the interpreter (``RNE_FIX``) fp32 -> bf16 truncates instead of
    rounding to nearest even, so round the fp32 bits first; compiled code casts directly."""
    if RNE_FIX:
        if ty == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(ty)


@triton.jit
def expert_ids(
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
def local_expert_ids(
    topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global, num_local, stride_it, stride_ik,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr,
):
    """Local expert id of each (token, k) row in ``rows``; -1 for non-local, unrouted or invalid rows."""
    return expert_ids(topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global, num_local, stride_it, stride_ik,
                       TOPK, HAS_MAP)[0]


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """First statement of every kernel here. With programmatic dependent launch (``PDL``, launched
    with ``launch_pdl``) a kernel's programs may start while the previous kernel in the stream still
    runs: wait until it has finished and its writes are visible, before touching memory, then let
    the next kernel's programs start in turn. They take SMs as this grid's last programs leave and
    wait the same way, so the gap between two launches overlaps the first kernel's tail."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def zero_words(ptr, n, BLOCK: tl.constexpr):
    """Zero ``n`` int32 words at ``ptr`` (one program; the sync words and tickets a schedule launch
    clears for the kernels after it)."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n, BLOCK):
        tl.store(ptr + start + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=start + offs < n)


@triton.jit
def wait_count(ptr, target, max_polls):
    """Poll the int32 count at ``ptr`` (acquire, GPU scope) until it reaches ``target`` or
    ``max_polls`` polls have passed, then a CTA barrier; returns the last count read (below
    ``target``: the wait ran out). The one-launch decode kernels' GEMM2 items wait so for their
    row tile's GEMM1 items. Scalar atomics: Triton broadcasts the result, so every thread agrees
    on the loop."""
    done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    polls = 0
    while (done < target) & (polls < max_polls):
        done = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        polls += 1
    tl.debug_barrier()
    return done


@triton.jit
def now(USE_TIMER: tl.constexpr):
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
def moe_schedule_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
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
        lid, gid, mapped = expert_ids(topk_ids_ptr, expert_map_ptr, rows, row_ok, num_global,
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
        report_bad_ids(report_ptr, id_lo, id_hi, num_global, map_lo, map_hi, num_local)
    seg_start = tl.sum(below, axis=0)
    tl.store(counts_ptr + e, tl.sum(mine, axis=0))
    # Pass 2: rows of expert e, in row (= token) order, at seg_start + prefix-sum rank.
    base = seg_start
    for start in range(0, num_rows, BLOCK):
        rows = start + offs
        lid = local_expert_ids(topk_ids_ptr, expert_map_ptr, rows, rows < num_rows, num_global,
                                num_local, stride_it, stride_ik, TOPK, HAS_MAP)
        hit = (lid == e).to(tl.int32)
        rank = tl.cumsum(hit, axis=0) - 1
        tl.store(sorted_rows_ptr + base + rank, rows, mask=hit != 0)
        base += tl.sum(hit, axis=0)


@triton.jit
def report_bad_ids(report_ptr, id_lo, id_hi, num_global, map_lo, map_hi, num_local):
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
def tile_of(pid_m, counts_ptr, num_local, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Map a row-tile id to (tiles in use, expert, first row inside the expert, rows of the
    expert, expert's first position in the sorted order). Pure function of the counts."""
    total, e, m0, count_e, start_e, _ = two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M, BLOCK_M)
    return total, e, m0, count_e, start_e


@triton.jit
def two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                       HEAVY_M: tl.constexpr):
    """``tile_of`` with two tile heights chosen from the counts on the device: an expert with more
    than ``BLOCK_M`` rows is cut into tiles of ``HEAVY_M`` rows (so its weights are read once per
    ``HEAVY_M`` rows, not once per ``BLOCK_M``), the others into ``BLOCK_M``-row tiles (``HEAVY_M``
    0 or ``BLOCK_M``: one height, ``tile_of``). Returns ``tile_of``'s tuple and whether the tile is a
    heavy one (only meaningful where ``HEAVY_M`` > 0). A row's arithmetic does not depend on its
    tile's height, so neither do its bits."""
    heavy_m = HEAVY_M if HEAVY_M > 0 else BLOCK_M
    eo = tl.arange(0, E_PAD)
    cnt = tl.load(counts_ptr + eo, mask=eo < num_local, other=0)
    height = tl.where(cnt > BLOCK_M, heavy_m, BLOCK_M)
    tiles = (cnt + height - 1) // height
    cum = tl.cumsum(tiles, axis=0)
    total = tl.sum(tiles, axis=0)
    e = tl.sum((cum <= pid_m).to(tl.int32), axis=0)
    sel = eo == e
    tile0 = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
    count_e = tl.sum(tl.where(sel, cnt, 0), axis=0)
    start_e = tl.sum(tl.where(eo < e, cnt, 0), axis=0)
    heavy = count_e > BLOCK_M
    return total, e, (pid_m - tile0) * tl.where(heavy, heavy_m, BLOCK_M), count_e, start_e, heavy


@triton.jit
def dot(a, b, acc, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr):
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
def acc_zeros(M: tl.constexpr, N: tl.constexpr, SWAP_AB: tl.constexpr):
    """The fp32 accumulator of an [M, N] output tile, held transposed under ``SWAP_AB``."""
    if SWAP_AB:
        acc = tl.zeros([N, M], dtype=tl.float32)
    else:
        acc = tl.zeros([M, N], dtype=tl.float32)
    return acc


@triton.jit
def mma(a, b, acc, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr, SWAP_AB: tl.constexpr):
    """``acc += a @ b`` (a: [rows, K] activations, b: [K, columns] weights). ``SWAP_AB`` computes
    the transpose, ``acc.T += b.T @ a.T``, so the weight columns are the matrix instruction's M side
    and a handful of token rows its N side (as small as 16, where wgmma's M is 64): at decode sizes
    the shared memory then holds weight tiles, not padding rows, and more of them are in flight.
    Each output element sums the same products in the same K order either way."""
    if SWAP_AB:
        acc = dot(tl.trans(b), tl.trans(a), acc, DOT_IEEE, DOT_F32)
    else:
        acc = dot(a, b, acc, DOT_IEEE, DOT_F32)
    return acc


@triton.jit
def program_tile(pid, num_m, num_n, GROUP_M: tl.constexpr):
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
def expert_tile(pid, counts_ptr, num_local, num_m, N, BLOCK_N: tl.constexpr,
                 E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr):
    """Tile ``pid`` (the program id, or a work item of the one-launch decode kernel) of a grouped
    GEMM over the scheduled rows (``N`` columns in tiles of ``BLOCK_N``): (tile in use, column
    tile, expert, first row inside the expert, rows of the expert, expert's first sorted
    position). Shared by every GEMM kernel in moe.py, moe_fp8.py and ep.py."""
    in_use, pid_n, e, m0, count_e, start_e, _ = two_height_expert_tile(
        pid, counts_ptr, num_local, num_m, N, BLOCK_N, E_PAD, BLOCK_M, GROUP_M, BLOCK_M
    )
    return in_use, pid_n, e, m0, count_e, start_e


@triton.jit
def two_height_expert_tile(pid, counts_ptr, num_local, num_m, N, BLOCK_N: tl.constexpr, E_PAD: tl.constexpr,
                           BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, HEAVY_M: tl.constexpr):
    """``expert_tile`` with ``two_height_tile_of``'s row tiles (an expert with more than ``BLOCK_M``
    rows in tiles of ``HEAVY_M``; 0: one height), and whether the tile is a heavy one."""
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = program_tile(pid, num_m, num_n, GROUP_M)
    total, e, m0, count_e, start_e, heavy = two_height_tile_of(pid_m, counts_ptr, num_local, E_PAD, BLOCK_M, HEAVY_M)
    return pid_m < total, pid_n, e, m0, count_e, start_e, heavy


@triton.jit
def tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M: tl.constexpr):
    """(row offsets inside the expert, row mask, scheduled rows ``t * K + k``) of a tile in use."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = offs_m < count_e
    rows = tl.load(sorted_rows_ptr + start_e + offs_m, mask=row_ok, other=0)
    return offs_m, row_ok, rows


@triton.jit
def scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, RNE_FIX: tl.constexpr):
    """GEMM2 epilogue: each row (rounded to ``y``'s dtype) to its (token, k) slot; ``y`` is
    [T*K, H] in row order."""
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * H + offs_n[None, :]
    tl.store(y_ptrs, cast(acc, y_ptr.dtype.element_ty, RNE_FIX), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def load_rows(ptrs, row_ok, k_ok, EVEN_K: tl.constexpr):
    """A [rows, BLOCK_K] A tile: zero in rows past the expert's count and (``k_ok``, only read when
    not ``EVEN_K``) past the K range. Every GEMM in moe.py and moe_fp8.py loads A this way."""
    if EVEN_K:
        a = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    else:
        a = tl.load(ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return a


@triton.jit
def load_cols(ptrs, n_ok, k_ok, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
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
def gemm1_tile(
    x_ptr, w_ptr, w_desc, act_ptr, tok, offs_m, row_ok, pid_n, e, start_e, H, I,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    """One [BLOCK_M, BLOCK_N] tile of GEMM1 for expert ``e`` (A rows ``x[tok]``), SiLU(gate) * up
    stored into ``act``. Shared with the expert-parallel GEMM1 that pulls its rows (ep.py).
    ``STAGES``: the K loop's pipeline depth (None: the kernel's ``num_stages``).

    The B tile is [BLOCK_K, 2*BLOCK_N]: this column tile's gate rows of ``w13`` then its up rows,
    so a single dot (one wgmma chain of width 2*BLOCK_N) makes both; the epilogue splits the
    accumulator in halves. With ``USE_TMA`` one TMA box of ``w13`` viewed as [E, 2, I, H] holds it
    (past I or H: zero fill); else pointer loads. ``SWAP_AB``: see ``mma``."""
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
    acc = acc_zeros(BLOCK_M, 2 * BLOCK_N, SWAP_AB)
    for k0 in tl.range(0, H, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < H - k0
        a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([e, 0, pid_n * BLOCK_N, k0]).reshape(2 * BLOCK_N, BLOCK_K).T
        else:
            b = load_cols(w_ptrs, nj_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
        acc = mma(a, b, acc, DOT_IEEE, DOT_F32, SWAP_AB)
        a_ptrs += BLOCK_K * stride_xh
    if SWAP_AB:
        acc = tl.trans(acc)
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
    # Same rounding points as the reference: gate/up in the input dtype, SiLU*up in fp32.
    out_ty = act_ptr.dtype.element_ty
    gate = cast(acc_g, out_ty, DOT_F32).to(tl.float32)
    up = cast(acc_u, out_ty, DOT_F32).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + (start_e + offs_m)[:, None].to(tl.int64) * I + offs_n[None, :]
    tl.store(act_ptrs, cast(h, out_ty, DOT_F32), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def gemm2_tile(
    act_ptr, w_ptr, w_desc, e, start_e, offs_m, row_ok, pid_n, H, I,
    stride_we, stride_wn, stride_wk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, STAGES: tl.constexpr = None,
):
    """One [BLOCK_M, BLOCK_N] tile of GEMM2 for expert ``e``: fp32 accumulator, columns, mask.
    Shared by every GEMM2 epilogue (moe.py's and the expert-parallel push in ep.py). ``SWAP_AB``:
    see ``mma``; ``STAGES``: as in ``gemm1_tile``."""
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    a_ptrs = act_ptr + (start_e + offs_m)[:, None].to(tl.int64) * I + offs_k[None, :]
    if USE_TMA:
        row_w = e * H + pid_n * BLOCK_N  # row of w2 viewed as [E*H, I]
    else:
        w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = acc_zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    for k0 in tl.range(0, I, BLOCK_K, num_stages=STAGES):
        k_ok = offs_k < I - k0
        a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
        if USE_TMA:
            b = w_desc.load([row_w, k0]).T
        else:
            b = load_cols(w_ptrs, n_ok, k_ok, EVEN_K, EVEN_N)
            w_ptrs += BLOCK_K * stride_wk
        acc = mma(a, b, acc, DOT_IEEE, DOT_F32, SWAP_AB)
        a_ptrs += BLOCK_K
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc, offs_n, n_ok
