"""The Triton kernels of kittens' expert parallelism on CUDA GPUs: flag sync, post, gather (pull),
GEMM1 that pulls its rows, GEMM2 with the push epilogue, combine and, across nodes, collect. What
they do together, the segment layout and the ordering argument: ``ep.py`` (the workspace that
launches them) and kernels/DESIGN.md.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp8_tiles import fp8_gemm2_tile, quantize_tile
from .tiles import cast, expert_tile, gemm1_tile, gemm2_tile, grid_dependency, now, tile_rows

__all__ = [
    "BOUND", "COMPUTED", "INBOX", "NUM_SLOTS", "POSTED", "ROWS", "ep_collect_kernel", "ep_combine_kernel",
    "ep_fp8_gemm2_push_kernel", "ep_gather_kernel", "ep_gemm1_pull_kernel", "ep_gemm2_push_kernel", "ep_post_kernel",
    "ep_sync_kernel",
]

POSTED, COMPUTED, INBOX = 0, 1, 2  # flag slots; INBOX: across nodes, the rows received for the node are posted
NUM_SLOTS = 3
ROWS = 3  # error code only: GEMM1 waited in vain for pulled rows (no flag slot)
_ROWS_ERR = tl.constexpr(1 + ROWS)
BOUND = 4  # error code only: a peer's call was sized by another max_tokens_across_ranks
_BOUND_ERR = tl.constexpr(1 + BOUND)
# The state (local int64 words): 0 epoch, 1 error code (slot + 1), 2 error peer, 3 error epoch, 4-6
# the last wait's ns per flag slot, 7 the sync kernel's clock word.
_CLOCK = tl.constexpr(7)


@triton.jit
def _uniform_now(clock_ptr, USE_TIMER: tl.constexpr):
    """The clock as one value in every thread: one thread's reading goes through the clock word by
    a scalar atomic exchange, and a scalar atomic read broadcasts it back."""
    tl.atomic_xchg(clock_ptr, now(USE_TIMER), sem="relaxed")
    return tl.atomic_add(clock_ptr, 0, sem="relaxed")


@triton.jit
def ep_sync_kernel(
    flags_ptr, flagtab_ptr, state_ptr, slot, rank, world, timeout_ns, max_spins,
    BUMP_EPOCH: tl.constexpr, USE_TIMER: tl.constexpr, SIGNAL: tl.constexpr, WAIT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Signal ``slot`` with this call's epoch to every peer, then wait (bounded) for every peer."""
    grid_dependency(PDL)
    if BUMP_EPOCH:
        epoch = tl.load(state_ptr + 0) + 1
        tl.store(state_ptr + 0, epoch)
    else:
        epoch = tl.load(state_ptr + 0)
    e32 = epoch.to(tl.int32)
    if SIGNAL:
        for p in range(world):
            dst = tl.load(flagtab_ptr + p).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(dst + slot * world + rank, e32, sem="release", scope="sys")
    # Every value in the wait loop's condition comes from a scalar atomic, which Triton broadcasts,
    # so all threads agree on the trip count: the atomics' broadcast contains a barrier.
    clock = state_ptr + _CLOCK
    t0 = _uniform_now(clock, USE_TIMER)
    for p in range(world * WAIT):
        f = flags_ptr + slot * world + p
        val = tl.atomic_add(f, 0, sem="acquire", scope="sys")
        err = tl.atomic_add(state_ptr + 1, 0, sem="relaxed")
        spins = tl.full((), 0, tl.int64)
        elapsed = tl.full((), 0, tl.int64)
        while (val < e32) & (err == 0) & (spins < max_spins) & (elapsed < timeout_ns):
            val = tl.atomic_add(f, 0, sem="acquire", scope="sys")
            err = tl.atomic_add(state_ptr + 1, 0, sem="relaxed")
            spins += 1
            elapsed = _uniform_now(clock, USE_TIMER) - t0
        if (val < e32) & (err == 0):
            tl.store(state_ptr + 2, tl.full((), 0, tl.int64) + p)
            tl.store(state_ptr + 3, epoch)
            tl.store(state_ptr + 1, tl.full((), 1, tl.int64) + slot)
    tl.store(state_ptr + 4 + slot, _uniform_now(clock, USE_TIMER) - t0)


@triton.jit
def ep_post_kernel(
    x_ptr, ids_ptr, seg_x_ptr, seg_xs_ptr, seg_ids_ptr, seg_n_ptr, tokens, bound, H, id_programs,
    stride_xt, stride_xh, stride_it, stride_ik,
    TOPK: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr,
    COPY_X: tl.constexpr, QUANT: tl.constexpr, QROWS: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    """Programs ``< id_programs``: ``n``, the call's token bound, the ids and (``COPY_X``) the token
    rows of ``BT`` tokens into the segment. The others (``QUANT``): ``cuda.moe_fp8``'s
    quantization pass, e4m3 rows into ``seg_x`` and their 1 x 128 group scales into ``seg_xs``, bit
    for bit as on one GPU."""
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < id_programs:
        if pid == 0:
            tl.store(seg_n_ptr, tokens)
            tl.store(seg_n_ptr + 1, bound)
        offs_t = pid * BT + tl.arange(0, BT)
        t_ok = offs_t < tokens
        offs_k = tl.arange(0, K_PAD)
        km = t_ok[:, None] & (offs_k < TOPK)[None, :]
        ids = tl.load(ids_ptr + offs_t[:, None].to(tl.int64) * stride_it + offs_k[None, :] * stride_ik, mask=km, other=-1)
        tl.store(seg_ids_ptr + offs_t[:, None].to(tl.int64) * TOPK + offs_k[None, :], ids.to(tl.int32), mask=km)
        if COPY_X:
            for h0 in range(0, H, BLOCK_H):
                offs_h = h0 + tl.arange(0, BLOCK_H)
                m = t_ok[:, None] & (offs_h < H)[None, :]
                v = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_h[None, :] * stride_xh, mask=m)
                tl.store(seg_x_ptr + offs_t[:, None].to(tl.int64) * H + offs_h[None, :], v, mask=m)
    else:
        if QUANT:
            quantize_tile(pid - id_programs, x_ptr, seg_x_ptr, seg_xs_ptr, tokens, H, stride_xt, stride_xh,
                           QROWS, RNE_FIX)


@triton.jit
def _rows_needed(ids, t_ok, emap_ptr, num_global, num_local):
    """Which of these tokens (``ids [BT, K_PAD]``, -1 padded) have at least one local expert."""
    ok = (ids >= 0) & (ids < num_global)
    lid = tl.load(emap_ptr + tl.where(ok, ids, 0), mask=ok, other=-1)
    local = (ok & (lid >= 0) & (lid < num_local)).to(tl.int32)
    return (tl.sum(local, axis=1) > 0) & t_ok


@triton.jit
def _copy_rows(src_ptr, dst_ptr, src_rows, dst_rows, need, width, begin, end, BLOCK: tl.constexpr):
    """``dst[dst_rows, begin:end] = src[src_rows, begin:end]`` for the rows in ``need``; rows of
    ``width`` elements."""
    for h0 in range(begin, end, BLOCK):
        offs_h = h0 + tl.arange(0, BLOCK)
        m = need[:, None] & (offs_h < end)[None, :]
        v = tl.load(src_ptr + src_rows[:, None].to(tl.int64) * width + offs_h[None, :], mask=m)
        tl.store(dst_ptr + dst_rows[:, None] * width + offs_h[None, :], v, mask=m)


@triton.jit
def ep_gather_kernel(
    ntab_ptr, idtab_ptr, xtab_ptr, xstab_ptr, all_ids_ptr, xl_ptr, xsl_ptr, emap_ptr, queue_ptr, state_ptr,
    words_ptr, inboxtab_ptr, inboxstab_ptr,
    max_tokens, H, G, num_global, num_local, node_size, my_node,
    TOPK: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr,
    COPY_ROWS: tl.constexpr, SCALES: tl.constexpr, BLOCK_G: tl.constexpr, ACROSS_NODES: tl.constexpr,
    PDL: tl.constexpr,
):
    """Source ``s``'s ids into ``all_ids[s]`` (-1 past its token count) and, with ``COPY_ROWS``, a
    pull of each of its token rows that has a local expert, once, from its segment into
    ``xl[s * max_tokens + t]`` (FP8: the e4m3 row, copied as bytes, and with ``SCALES`` its ``G`` fp32
    group scales into ``xsl``). Without ``COPY_ROWS`` GEMM1 pulls the rows (``ep_gemm1_pull_kernel``)
    and this zeroes its chunk queue. ``max_tokens`` is the call's bound on any source's tokens: source
    ``s``'s rows start at ``s * max_tokens`` in ``all_ids`` and ``xl``.

    Grid ``(S, token blocks, column blocks)``: program ``(s, i, j)`` copies columns
    ``[j * BLOCK_H, (j + 1) * BLOCK_H)`` of its rows, so a row's remote reads are issued by
    ``H / BLOCK_H`` programs at once instead of one after another by a loop (at decode sizes the
    loop's serial NVLink round trips were most of the kernel's time).

    ``ACROSS_NODES``: every source's count, bound and ids come from ``words`` (gathered over the
    group, ``2 + max_tokens * TOPK`` words per source), and another node's source's rows from the
    inbox of this node's rank of its local index (``_Layout``), where the exchange put them."""
    grid_dependency(PDL)
    s = tl.program_id(0)
    hb = tl.program_id(2)
    if not COPY_ROWS:
        if (s == 0) & (tl.program_id(1) == 0):
            tl.store(queue_ptr, 0)
    offs_t = tl.program_id(1) * BT + tl.arange(0, BT)
    if ACROSS_NODES:
        n_ptr = words_ptr + s * (2 + max_tokens * TOPK)
        src_ids = n_ptr + 2
    else:
        n_ptr = tl.load(ntab_ptr + s).to(tl.pointer_type(tl.int32))
        src_ids = tl.load(idtab_ptr + s).to(tl.pointer_type(tl.int32))
    n_s = tl.minimum(tl.maximum(tl.load(n_ptr), 0), max_tokens)
    if (tl.program_id(1) == 0) & (hb == 0):
        # Every rank lays the call's rows out by the same bound (``max_tokens`` here); a source that
        # posted another one is a caller's error, reported like a timeout (every later wait gives up).
        # After a timeout the silent peer's words are stale: the timeout is the error to report.
        if (tl.load(n_ptr + 1) != max_tokens) & (tl.load(state_ptr + 1) == 0):
            tl.store(state_ptr + 2, s.to(tl.int64))
            tl.store(state_ptr + 3, tl.load(state_ptr + 0))
            tl.store(state_ptr + 1, tl.full((), _BOUND_ERR, tl.int64))
    offs_k = tl.arange(0, K_PAD)
    k_ok = offs_k < TOPK
    t_in = offs_t < max_tokens
    t_ok = offs_t < n_s
    ids = tl.load(src_ids + offs_t[:, None].to(tl.int64) * TOPK + offs_k[None, :],
                  mask=t_ok[:, None] & k_ok[None, :], other=-1)
    dst_rows = (s * max_tokens + offs_t).to(tl.int64)
    if hb == 0:
        tl.store(all_ids_ptr + dst_rows[:, None] * TOPK + offs_k[None, :], ids, mask=t_in[:, None] & k_ok[None, :])
    if COPY_ROWS:
        need = _rows_needed(ids, t_ok, emap_ptr, num_global, num_local)
        if ACROSS_NODES:
            node = s // node_size
            here = node == my_node
            forwarder = my_node * node_size + s % node_size
            slot = (node - (node > my_node).to(tl.int32)).to(tl.int64) * max_tokens  # first inbox row
            x_bytes: tl.constexpr = xl_ptr.dtype.element_ty.primitive_bitwidth // 8
            src_x = tl.where(here, tl.load(xtab_ptr + s), tl.load(inboxtab_ptr + forwarder) + slot * H * x_bytes)
            src_x = src_x.to(tl.pointer_type(xl_ptr.dtype.element_ty))
        else:
            src_x = tl.load(xtab_ptr + s).to(tl.pointer_type(xl_ptr.dtype.element_ty))
        h0 = hb * BLOCK_H
        _copy_rows(src_x, xl_ptr, offs_t, dst_rows, need, H, h0, tl.minimum(h0 + BLOCK_H, H), BLOCK_H)
        if SCALES:
            if hb == 0:
                if ACROSS_NODES:
                    src_s = tl.where(here, tl.load(xstab_ptr + s), tl.load(inboxstab_ptr + forwarder) + slot * G * 4)
                    src_s = src_s.to(tl.pointer_type(tl.float32))
                else:
                    src_s = tl.load(xstab_ptr + s).to(tl.pointer_type(tl.float32))
                _copy_rows(src_s, xsl_ptr, offs_t, dst_rows, need, G, 0, G, BLOCK_G)


@triton.jit
def _ep_pull_chunk(c, xtab_ptr, all_ids_ptr, xl_ptr, emap_ptr, ready_ptr, epoch, sources, max_tokens, H,
                   num_global, num_local, TOPK: tl.constexpr, K_PAD: tl.constexpr, BT: tl.constexpr,
                   BLOCK_H: tl.constexpr):
    """Pull chunk ``c`` (tokens ``(c // S) * BT ...`` of source ``c % S``: chunks interleave the
    sources, so the first tokens of every source come first), the rows with a local expert, into
    ``xl``; then flag it ready for this GPU's GEMM tiles (release at GPU scope, after a CTA barrier
    so every thread's stores are ordered before the flag)."""
    s = c % sources
    offs_t = (c // sources) * BT + tl.arange(0, BT)
    t_ok = offs_t < max_tokens
    offs_k = tl.arange(0, K_PAD)
    rows = (s * max_tokens + offs_t).to(tl.int64)
    ids = tl.load(all_ids_ptr + rows[:, None] * TOPK + offs_k[None, :],
                  mask=t_ok[:, None] & (offs_k < TOPK)[None, :], other=-1)
    need = _rows_needed(ids, t_ok, emap_ptr, num_global, num_local)
    src_x = tl.load(xtab_ptr + s).to(tl.pointer_type(xl_ptr.dtype.element_ty))
    _copy_rows(src_x, xl_ptr, offs_t, rows, need, H, 0, H, BLOCK_H)
    tl.debug_barrier()
    tl.atomic_xchg(ready_ptr + c, epoch, sem="release", scope="gpu")


@triton.jit
def ep_gemm1_pull_kernel(
    x_ptr, w_ptr, w_desc, act_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
    xtab_ptr, all_ids_ptr, emap_ptr, ready_ptr, queue_ptr, state_ptr,
    sources, max_tokens, num_global, num_chunks, max_polls,
    TOPK: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr,
    K_PAD: tl.constexpr, BT: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    """GEMM1 that pulls its own A rows (``x_ptr`` is ``xl``): chunks of ``BT`` source tokens are
    claimed in order from a queue, pulled and flagged ready; a tile starts as soon as the chunks
    of its rows are ready, not after all rows have arrived. A tile first claims chunks until
    every chunk it reads has been claimed: a claimed chunk's puller never waits on anything, so
    no tile ever waits on a program that has not started (no deadlock, whatever the scheduling).

    Every loop condition is the same in all threads of the program (values from scalar atomics,
    which Triton broadcasts, and from reductions): the loops contain barriers (the pull's, the
    reductions'), and threads that disagree on a trip count would hang there. So the wait is
    bounded by a poll count, not by per-thread clock reads; it waits only for chunks that
    programs of this kernel have claimed, never for a peer."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        tok = (rows // TOPK).to(tl.int64)
        src = (tok // max_tokens).to(tl.int32)
        chunk = ((tok % max_tokens) // BT).to(tl.int32) * sources + src
        last = tl.max(tl.where(row_ok, chunk, -1), axis=0)
        epoch = tl.load(state_ptr + 0).to(tl.int32)
        head = tl.atomic_add(queue_ptr, 0, sem="relaxed")
        while head <= last:
            c = tl.atomic_add(queue_ptr, 1, sem="relaxed")
            if c < num_chunks:
                _ep_pull_chunk(c, xtab_ptr, all_ids_ptr, x_ptr, emap_ptr, ready_ptr, epoch, sources, max_tokens,
                               H, num_global, num_local, TOPK, K_PAD, BT, BLOCK_H)
            head = c + 1
        # Wait for the chunks pulled by other programs: poll with plain volatile loads (many tiles
        # poll the same flags; atomics would contend with the pullers' releases), then one acquire
        # read orders this tile's loads of the rows after the pullers' stores.
        flag = tl.load(ready_ptr + chunk, mask=row_ok, other=0, volatile=True)
        pending = tl.sum((row_ok & (flag != epoch)).to(tl.int32), axis=0)
        polls = 0
        while (pending > 0) & (polls < max_polls):
            flag = tl.load(ready_ptr + chunk, mask=row_ok, other=0, volatile=True)
            pending = tl.sum((row_ok & (flag != epoch)).to(tl.int32), axis=0)
            polls += 1
        if pending > 0:
            late = tl.min(tl.where(row_ok & (flag != epoch), src, sources), axis=0)
            tl.store(state_ptr + 2, late.to(tl.int64))
            tl.store(state_ptr + 3, epoch.to(tl.int64))
            tl.store(state_ptr + 1, tl.full((), _ROWS_ERR, tl.int64))
        tl.atomic_add(ready_ptr + chunk, 0, mask=row_ok, sem="acquire", scope="gpu")
        tl.debug_barrier()
        gemm1_tile(
            x_ptr, w_ptr, w_desc, act_ptr, tok, offs_m, row_ok, pid_n, e, start_e, H, I,
            stride_xt, stride_xh, stride_we, stride_wn, stride_wk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
        )


@triton.jit
def _push_rows(acc, rows, row_ok, offs_n, n_ok, ret_ptr, rettab_ptr, rank, rows_per_source, H,
               ELEM_BYTES: tl.constexpr, RNE_FIX: tl.constexpr):
    """Push epilogue: store each GEMM2 row (rounded to ``ret``'s dtype) into the ``ret`` buffer of
    the row's home rank, row ``t * K + k``."""
    src = rows // rows_per_source
    lrow = (rows % rows_per_source).to(tl.int64)
    # Element offset of the home rank's ret buffer from ours (pointer + int64 offsets, no
    # vector int->pointer casts).
    base = tl.load(rettab_ptr + src, mask=row_ok, other=0)
    mine = tl.load(rettab_ptr + rank)
    elem = (base - mine) // ELEM_BYTES
    y_ptrs = ret_ptr + (elem + lrow * H)[:, None] + offs_n[None, :]
    tl.store(y_ptrs, cast(acc, ret_ptr.dtype.element_ty, RNE_FIX), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def ep_gemm2_push_kernel(
    act_ptr, w_ptr, w_desc, ret_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk,
    rettab_ptr, rank, rows_per_source,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, DOT_IEEE: tl.constexpr, DOT_F32: tl.constexpr,
    USE_TMA: tl.constexpr, GROUP_M: tl.constexpr, SWAP_AB: tl.constexpr, ELEM_BYTES: tl.constexpr,
    PDL: tl.constexpr,
):
    """``cuda/moe.py``'s ``_moe_gemm2_kernel`` (same arithmetic) whose epilogue stores each row straight
    into the ``ret`` buffer of the row's home rank (push return). Same leading parameters, so
    ``launch_gemm2`` launches it; its own ones follow the strides."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        acc, offs_n, n_ok = gemm2_tile(
            act_ptr, w_ptr, w_desc, e, start_e, offs_m, row_ok, pid_n, H, I,
            stride_we, stride_wn, stride_wk,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, DOT_IEEE, DOT_F32, USE_TMA, SWAP_AB,
        )
        _push_rows(acc, rows, row_ok, offs_n, n_ok, ret_ptr, rettab_ptr, rank, rows_per_source, H,
                   ELEM_BYTES, DOT_F32)


@triton.jit
def ep_fp8_gemm2_push_kernel(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, ret_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    rettab_ptr, rank, rows_per_source,
    E_PAD: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, ELEM_BYTES: tl.constexpr, PDL: tl.constexpr,
):
    """``cuda.moe_fp8``'s ``_fp8_gemm2_kernel`` (same arithmetic) with the push epilogue; launched by
    ``launch_fp8_gemm2``."""
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        acc, offs_n, n_ok = fp8_gemm2_tile(
            actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
            SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB,
        )
        _push_rows(acc, rows, row_ok, offs_n, n_ok, ret_ptr, rettab_ptr, rank, rows_per_source, H,
                   ELEM_BYTES, RNE_FIX)


@triton.jit
def _spread(flag, BLOCK: tl.constexpr):
    """A scalar condition as a [BLOCK] mask (the interpreter rejects a scalar in a vector mask)."""
    return (tl.zeros([BLOCK], dtype=tl.int32) + flag.to(tl.int32)) != 0


@triton.jit
def ep_combine_kernel(
    ytab_ptr, ret_ptr, out_ptr, ids_ptr, w_ptr, owner_ptr, res_ptr,
    H, num_global, src_row0, node_size, my_node, rows_per_node,
    stride_it, stride_ik, stride_wt, stride_wk, stride_ot,
    TOPK: tl.constexpr, PULL: tl.constexpr, ACROSS_NODES: tl.constexpr, BLOCK_H: tl.constexpr,
    RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    """``out[t] = sum_k w[t,k] * y[t,k]`` in fp32 in k order (``cuda.moe``'s arithmetic); ``y``
    pulled from the owner's ``y`` row ``src_row0 + t*K + k`` or read from the local ``ret``.
    ``ACROSS_NODES``: an owner on another node sent its node's results for this rank's tokens, in
    ``res`` from row ``slot * rows_per_node`` (``ep_collect_kernel``'s layout)."""
    grid_dependency(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        gid = tl.load(ids_ptr + t * stride_it + k * stride_ik)
        ok = (gid >= 0) & (gid < num_global)
        w = tl.load(w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
        y_ok = h_ok & _spread(ok, BLOCK_H)
        row = (src_row0 + t * TOPK + k).to(tl.int64)
        if PULL:
            o = tl.load(owner_ptr + tl.where(ok, gid, 0).to(tl.int64))
            src = tl.load(ytab_ptr + o).to(tl.pointer_type(out_ptr.dtype.element_ty))
            if ACROSS_NODES:
                node = o // node_size
                here = node == my_node
                far = node != my_node
                slot = (node - (node > my_node).to(tl.int32)).to(tl.int64)
                y_here = tl.load(src + row * H + offs, mask=y_ok & _spread(here, BLOCK_H), other=0.0)
                far_row = slot * rows_per_node + t * TOPK + k
                y_far = tl.load(res_ptr + far_row * H + offs, mask=y_ok & _spread(far, BLOCK_H), other=0.0)
                y = tl.where(here, y_here, y_far)
            else:
                y = tl.load(src + row * H + offs, mask=y_ok, other=0.0)
        else:
            y = tl.load(ret_ptr + row * H + offs, mask=y_ok, other=0.0)
        prod = w * y.to(tl.float32)
        acc = acc + prod
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, cast(acc, out_ptr.dtype.element_ty, RNE_FIX), mask=h_ok)


@triton.jit
def ep_collect_kernel(
    ytab_ptr, all_ids_ptr, owner_ptr, res_ptr, max_tokens, H, num_global, node_size, my_node, local_index,
    TOPK: tl.constexpr, REPLICATED: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):
    """Across nodes, after this node's experts: for the rank of this local index on each other node
    (``slot`` j, nodes in order without this one), the results this node computed for that rank's
    tokens, ``res[(j * max_tokens + t) * K + k]``: row ``(s * max_tokens + t) * K + k`` of the owner's
    ``y`` (``s``: that rank's source index), zero where another node computed it. Every (token, k)
    result travels, not a per-node sum (kernels/DESIGN.md, across nodes). Program (j * max_tokens + t,
    column block)."""
    grid_dependency(PDL)
    row = tl.program_id(0)
    slot = row // max_tokens
    t = row % max_tokens
    node = slot + (slot >= my_node).to(tl.int32)
    if REPLICATED:
        s = 0
    else:
        s = node * node_size + local_index
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    for k in tl.static_range(TOPK):
        src_row = ((s * max_tokens + t) * TOPK + k).to(tl.int64)
        gid = tl.load(all_ids_ptr + src_row)
        ok = (gid >= 0) & (gid < num_global)
        o = tl.load(owner_ptr + tl.where(ok, gid, 0).to(tl.int64))
        here = ok & (o // node_size == my_node)
        src = tl.load(ytab_ptr + o).to(tl.pointer_type(res_ptr.dtype.element_ty))
        y = tl.load(src + src_row * H + offs, mask=h_ok & _spread(here, BLOCK_H), other=0.0)
        tl.store(res_ptr + (row.to(tl.int64) * TOPK + k) * H + offs, y, mask=h_ok)
