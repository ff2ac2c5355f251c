"""Batch-invariant paged attention on CUDA (``invariant_attention``; the function is in ``../attention.py``).

A program owns one query block (``BLOCK_Q`` tokens of one sequence times the ``GROUP`` query heads
of one KV head: ``BLOCK_M`` rows) and either every segment its rows see, merged in order inside the
program (``_attention_kernel``), or one segment (``SPLIT``: grid axis 2) whose (m, l, acc) it writes
to a workspace that ``_attention_merge_kernel`` merges in the same order.

Every sum over keys or head dimensions is a chain of 16-deep tensor-core k-steps (wgmma), which
gives an element the same bits whichever operand it sits in. Prefill-shaped calls run 64-row
blocks (``q @ K^T``: rows on wgmma's M side); decode calls (one query token per sequence: 8-16 rows
of a block are real) run 16-row blocks with the operands swapped (``K @ q^T``: a segment's 64 keys,
or the head dimension, on the M side), so no tile is mostly padding. A segment's ``l`` is ``P @ 1``
on the tensor cores too, not a register reduction, whose tree would follow the layout. Same
segments, same merges in the same order on every path: a row's bits depend on none of the path,
its block's other rows or the call.

A head size that is not a power of two runs as two column tiles where both stay on wgmma's M side
(``head_parts``: 192 = 128 + 64) instead of one padded tile: scores chain the second tile's k-steps
onto the first's accumulator (the same chain on every path), and each tile's ``P @ V`` columns are
their own sums, so no padded column is loaded, multiplied or held in shared memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..attention import SEGMENT, check_attention_args
from .launch import interpreting, pdl_launch
from .tiles import grid_dependency

__all__ = ["attention_paths", "attention_plan", "head_parts", "invariant_attention_triton", "num_stages", "num_warps"]

PREFILL_ROWS = 64  # query rows of a program in a call with prefill tokens (wgmma's M side)
DECODE_ROWS = 16  # query rows of a program in a decode call, operands swapped (wgmma's N side)


@triton.jit
def _find_block(cu_q_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    """(sequence, its first query token, query tokens, block inside it) of query block ``pid``; a
    sequence of ``n`` query tokens owns ``n // BLOCK_Q + 1`` block ids (the grid's bound)."""
    lo = 0
    hi = num_seqs  # invariant: the sequence is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        start = tl.load(cu_q_ptr + mid)
        if start // BLOCK_Q + mid <= pid:
            lo = mid
        else:
            hi = mid
    q0 = tl.load(cu_q_ptr + lo)
    q1 = tl.load(cu_q_ptr + lo + 1)
    return lo, q0, q1 - q0, pid - (q0 // BLOCK_Q + lo)


@triton.jit
def _load_tile(ptr, row_off, row_ok, offs_d, HEAD: tl.constexpr, ROWS_FIRST: tl.constexpr):
    """Rows at offsets ``row_off``, head columns ``offs_d`` (columns past ``HEAD`` and rows not
    ``row_ok`` read 0): ``[rows, width]`` with ``ROWS_FIRST``, else its transpose."""
    d_ok = offs_d < HEAD
    if ROWS_FIRST:
        t = tl.load(ptr + row_off[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        t = tl.load(ptr + row_off[None, :] + offs_d[:, None], mask=row_ok[None, :] & d_ok[:, None], other=0.0)
    return t


@triton.jit
def _p_v(p_v, v_ptr, v_off, key_ok, offs_d, HEAD: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """``P @ V`` for head columns ``offs_d``: ``[BLOCK_M, width]``, transposed with ``SWAP``."""
    if SWAP:
        acc = _dot(_load_tile(v_ptr, v_off, key_ok, offs_d, HEAD, False), p_v, DOT_F32)
    else:
        acc = _dot(p_v, _load_tile(v_ptr, v_off, key_ok, offs_d, HEAD, True), DOT_F32)
    return acc


@triton.jit
def _segment(q_a, q_b, offs_a, offs_b, k_ptr, v_ptr, bt_row_ptr, kv_head, seq_len, seg, pos, lo, scale,
             stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
             PAGE: tl.constexpr, HEAD: tl.constexpr, HEAD_A: tl.constexpr, HEAD_B: tl.constexpr,
             BLOCK_M: tl.constexpr, SEG: tl.constexpr, SWAP: tl.constexpr, DOT_F32: tl.constexpr):
    """(m, l, acc_a, acc_b) of segment ``seg`` for the block's rows (positions ``pos``, first visible
    key ``lo``): m the max visible score, P = e^(s - m) in the value dtype, l = P @ 1, acc = P @ V
    for head columns ``[0, HEAD_A)`` and ``[HEAD_A, HEAD_A + HEAD_B)`` (acc_b is acc_a when
    ``HEAD_B`` is 0); a row without a visible key gets l = 0. ``q_a`` and ``q_b`` are the query's
    two column tiles, ``[BLOCK_M, width]`` or their transposes with ``SWAP``, and so are the accs;
    ``offs_a`` and ``offs_b`` their head columns."""
    keys = seg * SEG + tl.arange(0, SEG)
    key_ok = keys < seq_len
    page = tl.load(bt_row_ptr + keys // PAGE, mask=key_ok, other=0).to(tl.int64)
    slot = keys % PAGE
    k_off = page * stride_kb + slot * stride_ks + kv_head * stride_kh
    v_off = page * stride_vb + slot * stride_vs + kv_head * stride_vh
    if SWAP:  # keys on the M side: [SEG, BLOCK_M] scores
        s = _dot(_load_tile(k_ptr, k_off, key_ok, offs_a, HEAD, True), q_a, DOT_F32)
        if HEAD_B > 0:  # the second tile's k-steps chained onto the first's
            s = _dot(_load_tile(k_ptr, k_off, key_ok, offs_b, HEAD, True), q_b, DOT_F32, s)
        s = s * scale
        visible = (keys[:, None] <= pos[None, :]) & (keys[:, None] >= lo[None, :])
        s = tl.where(visible, s, float("-inf"))
        m = tl.max(s, axis=0)
        p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[None, :])
        p_v = p.to(v_ptr.dtype.element_ty)
    else:  # query rows on the M side: [BLOCK_M, SEG] scores
        s = _dot(q_a, _load_tile(k_ptr, k_off, key_ok, offs_a, HEAD, False), DOT_F32)
        if HEAD_B > 0:
            s = _dot(q_b, _load_tile(k_ptr, k_off, key_ok, offs_b, HEAD, False), DOT_F32, s)
        s = s * scale
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] >= lo[:, None])
        s = tl.where(visible, s, float("-inf"))
        m = tl.max(s, axis=1)
        p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
        p_v = p.to(v_ptr.dtype.element_ty)
    acc_a = _p_v(p_v, v_ptr, v_off, key_ok, offs_a, HEAD, SWAP, DOT_F32)
    acc_b = acc_a
    if HEAD_B > 0:
        acc_b = _p_v(p_v, v_ptr, v_off, key_ok, offs_b, HEAD, SWAP, DOT_F32)
    if SWAP:
        ones = tl.full([64, SEG], 1.0, p_v.dtype)  # 64 rows: wgmma's M side (every row the same sums)
        l = tl.max(_dot(ones, p_v, DOT_F32), axis=0)
    else:
        ones = tl.full([SEG, 16], 1.0, p_v.dtype)
        l = tl.max(_dot(p_v, ones, DOT_F32), axis=1)
    return m, l, acc_a, acc_b


@triton.jit
def _dot(a, b, DOT_F32: tl.constexpr, acc=None):
    """``a @ b``, or ``acc + a @ b`` with a's k-steps chained onto ``acc`` (as one longer dot would)."""
    if DOT_F32:  # fp32 data, and the interpreter (which mis-multiplies bf16 dots): fp32 ieee dots
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc)
    return c


@triton.jit
def _merge_weights(M, L, m, l):
    """Merging a segment's (m, l) into the running (M, L) where the segment saw a key (l > 0):
    the new (M, L), the weights of the running and the segment's accumulators, and where to merge."""
    has = l > 0
    M_new = tl.maximum(M, m)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    a = tl.exp(M - M_safe)
    b = tl.exp(m - M_safe)
    L_new = L * a + l * b
    return tl.where(has, M_new, M), tl.where(has, L_new, L), a, b, has


@triton.jit
def _merge_acc(O, acc, a, b, has, SWAP: tl.constexpr):
    """``O a + acc b`` on the rows that merge (O and acc transposed with ``SWAP``)."""
    if SWAP:
        O = tl.where(has[None, :], O * a[None, :] + acc * b[None, :], O)
    else:
        O = tl.where(has[:, None], O * a[:, None] + acc * b[:, None], O)
    return O


@triton.jit
def _rows(cu_q_ptr, seq_lens_ptr, pid_q, kv_head, num_seqs, window,
          GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, SEG: tl.constexpr,
          HAS_WINDOW: tl.constexpr):
    """The block's rows: (sequence, its KV length, token index, query head, row ok, position, first
    visible key) of each of the BLOCK_M rows (row r: token r // GROUP of the block, head r % GROUP),
    and the first and last segment any of them sees (last = -1: the block has no rows)."""
    seq, q0, q_len, block = _find_block(cu_q_ptr, pid_q, num_seqs, BLOCK_Q)
    seq_len = tl.load(seq_lens_ptr + seq)
    r = tl.arange(0, BLOCK_M)
    local = block * BLOCK_Q + r // GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (local < q_len)
    token = q0 + local
    head = kv_head * GROUP + r % GROUP
    pos = tl.where(row_ok, seq_len - q_len + local, -1)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window, 0)
    else:
        lo = tl.zeros([BLOCK_M], tl.int32)
    first = tl.min(tl.where(row_ok, lo, 2**30), axis=0) // SEG
    last = tl.max(tl.where(row_ok, pos, -SEG), axis=0) // SEG
    return seq, seq_len, token, head, row_ok, pos, lo, first, last


@triton.jit
def _store_rows(out_ptr, O, L, token, head, row_ok, bad, offs_d, stride_ot, stride_oh,
                HEAD: tl.constexpr, SWAP: tl.constexpr):
    """``out[token, head, offs_d] = O / L`` rounded once (O transposed with ``SWAP``); rows marked
    ``bad`` NaN."""
    L_safe = tl.where(L > 0, L, 1.0)  # (rows past the block's tokens: never stored)
    if SWAP:
        out = tl.where(bad[None, :], float("nan"), O / L_safe[None, :])
        ptrs = out_ptr + token.to(tl.int64)[None, :] * stride_ot + head[None, :] * stride_oh + offs_d[:, None]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[None, :] & (offs_d < HEAD)[:, None])
    else:
        out = tl.where(bad[:, None], float("nan"), O / L_safe[:, None])
        ptrs = out_ptr + token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_d < HEAD)[None, :])


@triton.jit(do_not_specialize=["num_seqs"])  # per-call: one compile whether a call has 1, 16 or 17 sequences
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, seq_lens_ptr, bt_ptr, part_ptr, ml_ptr,
    num_seqs, scale, window, max_segs,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, PAGE: tl.constexpr,
    HEAD: tl.constexpr, HEAD_A: tl.constexpr, HEAD_B: tl.constexpr, SEG: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SWAP: tl.constexpr, SPLIT: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    kv_head = tl.program_id(1)
    seq, seq_len, token, head, row_ok, pos, lo, first, last = _rows(
        cu_q_ptr, seq_lens_ptr, tl.program_id(0), kv_head, num_seqs, window, GROUP, BLOCK_Q, BLOCK_M, SEG, HAS_WINDOW)
    if last < 0:
        return
    q_rows = token.to(tl.int64) * stride_qt + head * stride_qh
    offs_a = tl.arange(0, HEAD_A)
    q_a = _load_tile(q_ptr, q_rows, row_ok, offs_a, HEAD, not SWAP)
    offs_b = offs_a  # the second tile's columns, queries and accumulator: the first's when there is none
    q_b = q_a
    if HEAD_B > 0:
        offs_b = HEAD_A + tl.arange(0, HEAD_B)
        q_b = _load_tile(q_ptr, q_rows, row_ok, offs_b, HEAD, not SWAP)
    bt_row_ptr = bt_ptr + seq.to(tl.int64) * stride_bt
    if SPLIT:
        # Program j of axis 2 computes the segments s = j (mod its size), each kept apart: the
        # merge kernel merges them all in order. Segments past the workspace (a KV length above
        # the call's bound) are not computed: the merge kernel poisons those rows.
        step = tl.num_programs(2)
        seg0 = first + (tl.program_id(2) - first % step + step) % step
        for rel in range(0, tl.minimum(last, max_segs - 1) + 1 - seg0, step):  # from 0: see _attention_merge_kernel
            seg = seg0 + rel
            m, l, acc_a, acc_b = _segment(q_a, q_b, offs_a, offs_b, k_ptr, v_ptr, bt_row_ptr, kv_head, seq_len, seg,
                                          pos, lo, scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                          stride_vh, PAGE, HEAD, HEAD_A, HEAD_B, BLOCK_M, SEG, SWAP, DOT_F32)
            cell = (token.to(tl.int64) * tl.num_programs(1) * GROUP + head) * max_segs + seg  # [tokens, heads, segs]
            _store_part(part_ptr, acc_a, cell, row_ok, offs_a, HEAD_A + HEAD_B, SWAP)
            if HEAD_B > 0:
                _store_part(part_ptr, acc_b, cell, row_ok, offs_b, HEAD_A + HEAD_B, SWAP)
            tl.store(ml_ptr + cell * 2, m, mask=row_ok)
            tl.store(ml_ptr + cell * 2 + 1, l, mask=row_ok)
    else:
        M = tl.full([BLOCK_M], float("-inf"), tl.float32)
        L = tl.zeros([BLOCK_M], tl.float32)
        O_a = _zeros(HEAD_A, BLOCK_M, SWAP)
        O_b = O_a
        if HEAD_B > 0:
            O_b = _zeros(HEAD_B, BLOCK_M, SWAP)
        for rel in range(0, last + 1 - first):  # from 0: see _attention_merge_kernel
            seg = first + rel
            m, l, acc_a, acc_b = _segment(q_a, q_b, offs_a, offs_b, k_ptr, v_ptr, bt_row_ptr, kv_head, seq_len, seg,
                                          pos, lo, scale, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
                                          stride_vh, PAGE, HEAD, HEAD_A, HEAD_B, BLOCK_M, SEG, SWAP, DOT_F32)
            M, L, a, b, has = _merge_weights(M, L, m, l)
            O_a = _merge_acc(O_a, acc_a, a, b, has, SWAP)
            if HEAD_B > 0:
                O_b = _merge_acc(O_b, acc_b, a, b, has, SWAP)
        no_row = row_ok & False
        _store_rows(out_ptr, O_a, L, token, head, row_ok, no_row, offs_a, stride_ot, stride_oh, HEAD, SWAP)
        if HEAD_B > 0:
            _store_rows(out_ptr, O_b, L, token, head, row_ok, no_row, offs_b, stride_ot, stride_oh, HEAD, SWAP)


@triton.jit
def _zeros(WIDTH: tl.constexpr, BLOCK_M: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        z = tl.zeros([WIDTH, BLOCK_M], tl.float32)
    else:
        z = tl.zeros([BLOCK_M, WIDTH], tl.float32)
    return z


@triton.jit
def _store_part(part_ptr, acc, cell, row_ok, offs_d, WIDTH: tl.constexpr, SWAP: tl.constexpr):
    """A segment's ``acc`` at columns ``offs_d`` of its workspace rows (``WIDTH`` columns a row)."""
    if SWAP:
        tl.store(part_ptr + cell[None, :] * WIDTH + offs_d[:, None], acc, mask=row_ok[None, :])
    else:
        tl.store(part_ptr + cell[:, None] * WIDTH + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs"])
def _attention_merge_kernel(
    out_ptr, cu_q_ptr, seq_lens_ptr, part_ptr, ml_ptr, num_seqs, window, max_segs,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, HEAD: tl.constexpr,
    WIDTH: tl.constexpr, COLS: tl.constexpr, SEG: tl.constexpr, HAS_WINDOW: tl.constexpr, PDL: tl.constexpr,
):
    """The split path's second step: each row's segments merged in order, as ``_attention_kernel``
    merges them in one program, for the ``COLS`` output columns of grid axis 2 (every program of a
    block walks the same (m, l) chain, so each column gets the bits of a whole-row merge); the
    workspace has ``WIDTH`` columns a row."""
    grid_dependency(PDL)
    kv_head = tl.program_id(1)
    seq, seq_len, token, head, row_ok, pos, lo, first, last = _rows(
        cu_q_ptr, seq_lens_ptr, tl.program_id(0), kv_head, num_seqs, window, GROUP, BLOCK_Q, BLOCK_M, SEG, HAS_WINDOW)
    if last < 0:
        return
    offs_d = tl.program_id(2) * COLS + tl.arange(0, COLS)
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    L = tl.zeros([BLOCK_M], tl.float32)
    O = tl.zeros([BLOCK_M, COLS], tl.float32)
    base = (token.to(tl.int64) * tl.num_programs(1) * GROUP + head) * max_segs
    # Every segment loop counts from 0: with a lower bound computed by a reduction (first), Triton
    # 3.9's alignment analysis gave the loop body nothing, and the loads there went scalar (2-byte
    # K and V loads, 255 registers and spills at head 192); Triton 3.6 vectorized them either way.
    for rel in range(0, tl.minimum(last, max_segs - 1) + 1 - first):
        seg = first + rel
        # A row outside this segment's reach was not written there: it reads l = 0 (no merge).
        sees = row_ok & (pos >= seg * SEG) & (lo < (seg + 1) * SEG)
        cell = base + seg
        m = tl.load(ml_ptr + cell * 2, mask=sees, other=float("-inf"))
        l = tl.load(ml_ptr + cell * 2 + 1, mask=sees, other=0.0)
        acc = tl.load(part_ptr + cell[:, None] * WIDTH + offs_d[None, :], mask=sees[:, None], other=0.0)
        M, L, a, b, has = _merge_weights(M, L, m, l)
        O = _merge_acc(O, acc, a, b, has, False)
    # A KV length past the bound: segments the workspace could not hold, so the row is poisoned.
    _store_rows(out_ptr, O, L, token, head, row_ok, pos // SEG >= max_segs, offs_d, stride_ot, stride_oh, HEAD, False)


# Split segments over programs while the call has fewer (query block, KV head) programs than this,
# and its workspace stays under _SPLIT_MAX_BYTES; _SEGMENT_PROGRAMS programs per query block and
# KV head then share the segments.
_SPLIT_BELOW_PROGRAMS = 132
_SPLIT_MAX_BYTES = 256 << 20
_SEGMENT_PROGRAMS = 16
_MERGE_COLS = 32  # output columns per merge program


def num_warps(swap: bool) -> int:
    """Warps of an attention program: two warpgroups for 64-row blocks (registers for the 64 x 64
    scores beside the 64 x head accumulator), one for swapped 16-row ones."""
    return 4 if swap else 8


def head_parts(head_size: int) -> tuple[int, int]:
    """The column tiles a head runs as: ``(a, 0)``, one tile padded to a power of two, or ``(a, b)``
    where two tiles both at least 64 wide (wgmma's M side when the operands are swapped) cover it
    with fewer columns: 192 = 128 + 64, 160 = 128 + 64, 96 -> (128, 0)."""
    padded = max(16, triton.next_power_of_2(head_size))
    a = padded // 2
    b = max(64, triton.next_power_of_2(head_size - a)) if head_size > a else 0
    return (a, b) if a >= 64 and b and a + b < padded else (padded, 0)


def num_stages(width: int, itemsize: int, swap: bool) -> int:
    """Pipeline stages of the segment loop: two, unless a segment's K and V tiles (64 keys x the
    head's ``width`` columns, padding included) pass 64 KB, where two copies would not fit shared
    memory (fp32 at head 192-256), or pass 48 KB in the swapped (decode) layout, by measurement
    (H100, Triton 3.6, 32 sequences of 2048 keys at DeepSeek-V3's head 192): as two tiles (48 KB)
    two stages took 2279 against 3074 us with one (7d34d91); padded to 256 (64 KB) one stage took
    2885 against 3592 us with two (c42af5c). The stages move loads, never the order of a sum: the
    same bits either way."""
    limit = 48 * 1024 if swap else 64 * 1024
    return 1 if 2 * SEGMENT * width * itemsize > limit else 2


def attention_paths(head_size: int) -> list[tuple[bool, bool]]:
    """Every (swap, split) pair ``attention_plan`` can pick for calls of this head size."""
    swaps = (False, True) if triton.next_power_of_2(head_size) >= 64 else (False,)
    return [(swap, split) for swap in swaps for split in (False, True)]


def attention_plan(tokens: int, num_seqs: int, heads: int, kv_heads: int, head_size: int,
                   max_seq_len: int, swap: bool | None = None) -> tuple[int, int, int, bool, bool]:
    """(query rows per program, tokens per query block, query-block grid bound, whether operands
    are swapped, whether segments split over programs) of a call; static shapes only. Unless
    ``swap`` says, decode calls (one query token per sequence) swap, where the swapped tiles stay
    on wgmma (head size >= 64)."""
    group = triton.next_power_of_2(heads // kv_heads)
    if group > DECODE_ROWS:
        raise ValueError(f"{heads // kv_heads} query heads per KV head: at most {DECODE_ROWS} supported")
    if swap is None:
        swap = tokens == num_seqs and triton.next_power_of_2(head_size) >= 64
    block_m = DECODE_ROWS if swap else PREFILL_ROWS
    block_q = block_m // group
    q_blocks = tokens // block_q + num_seqs
    segs = triton.cdiv(max(max_seq_len, 1), SEGMENT)
    workspace = tokens * heads * segs * (triton.next_power_of_2(head_size) + 2) * 4
    split = q_blocks * kv_heads < _SPLIT_BELOW_PROGRAMS and workspace <= _SPLIT_MAX_BYTES
    return block_m, block_q, q_blocks, swap, split


def invariant_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, max_seq_len: int,
    scale: float, window: int | None = None, *, split: bool | None = None, swap: bool | None = None,
    segment_programs: int = _SEGMENT_PROGRAMS, pdl: bool | None = None,
) -> torch.Tensor:
    """Writes ``out`` ``[tokens, heads, head_size]`` (``q``'s layout) and returns it. ``max_seq_len``:
    a bound on ``seq_lens`` that holds at every replay of a captured call (vLLM: the model's
    ``max_model_len``); it sizes the split path's workspace, and rows of a longer sequence come out
    NaN there. ``split``, ``swap`` and ``segment_programs`` (programs per query block sharing its
    segments on the split path) override the plan (tests, measurements): every path gives the same
    bits (a swapped call with a head size under 64 leaves wgmma, so its bits may differ)."""
    check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
    tokens, heads, head_size = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if tokens == 0:
        return out
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("the head dimension of q, out and the caches must be contiguous")
    if segment_programs < 1:
        raise ValueError(f"segment_programs must be >= 1, got {segment_programs}")
    interpret = interpreting()
    num_seqs = seq_lens.shape[0]
    block_m, block_q, q_blocks, swap, split_by_shape = attention_plan(tokens, num_seqs, heads, kv_heads, head_size,
                                                                      max_seq_len, swap)
    split = split_by_shape if split is None else split
    group = heads // kv_heads
    head_a, head_b = head_parts(head_size)
    width = head_a + head_b  # columns of a row's tiles, and of the split path's workspace
    max_segs = triton.cdiv(max(max_seq_len, 1), SEGMENT)
    if split:
        part = torch.empty((tokens, heads, max_segs, width), dtype=torch.float32, device=q.device)
        ml = torch.empty((tokens, heads, max_segs, 2), dtype=torch.float32, device=q.device)
    else:
        part = ml = out
    consts = dict(GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD=head_size, SEG=SEGMENT,
                  HAS_WINDOW=window is not None)
    _attention_kernel[(q_blocks, kv_heads, min(max_segs, segment_programs) if split else 1)](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_table, part, ml,
        num_seqs, scale, window or 0, max_segs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        PAGE=page, HEAD_A=head_a, HEAD_B=head_b, SWAP=swap, SPLIT=split,
        DOT_F32=interpret or q.dtype == torch.float32, **consts,
        num_warps=num_warps(swap), num_stages=num_stages(width, k_cache.element_size(), swap),
        **pdl_launch(out, pdl, interpret),
    )
    if split:  # merged in 16-row blocks whatever the segments' blocks (the workspace is by token and head),
        # the columns spread over programs (a decode step alone has one block per KV head)
        merge_block_q = DECODE_ROWS // triton.next_power_of_2(group)
        cols = min(width, _MERGE_COLS)
        consts.update(BLOCK_Q=merge_block_q, BLOCK_M=DECODE_ROWS)
        _attention_merge_kernel[(tokens // merge_block_q + num_seqs, kv_heads, width // cols)](
            out, cu_seqlens_q, seq_lens, part, ml, num_seqs, window or 0, max_segs, out.stride(0), out.stride(1),
            **consts, WIDTH=width, COLS=cols, num_warps=4, **pdl_launch(out, pdl, interpret),
        )
    return out
