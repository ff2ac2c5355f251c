"""Batch-invariant paged attention: a query token's output never depends on the rest of the batch.

A deterministic server must give a token the same attention output whether it is decoded alone,
decoded beside 255 others, or recomputed inside a prefill chunk (preemption, prefix caching), and
whatever the chunking of its prompt. vLLM's batch-invariant mode gets there by running its
single-pass ("2D") Triton kernel for every token: one program walks a sequence's whole context,
so a decode step alone uses (query blocks x KV heads) programs, 4 on Qwen3-30B-A3B.

The function (every implementation here computes it; bit for bit on one device for the Triton
kernels of ``cuda/attention.py``): for query token ``t`` at absolute position ``p`` of its sequence
and query head ``h`` (KV head ``h // (num_heads / num_kv_heads)``), the visible keys are ``[lo, p]``
(``lo = 0``, or ``p - window`` with a sliding window). Keys are cut into segments of ``SEGMENT``
keys at absolute positions (segment ``s`` = keys ``[s * SEGMENT, (s + 1) * SEGMENT)``). For each
segment with a visible key: scores ``q . k * scale`` in fp32 (keys outside ``[lo, p]`` at ``-inf``),
``m`` their max, ``P = e^(s - m)`` rounded to the value dtype, ``l = sum P`` and ``acc = P @ V``
in fp32. The segments are then merged in increasing order from ``(-inf, 0, 0)``: ``M' = max(M,
m)``, ``L' = L e^(M - M') + l e^(m - M')``, ``O' = O e^(M - M') + acc e^(m - M')``. The output is
``O / L`` rounded once. Every boundary is an absolute key position and no step depends on other
tokens, so the result is a function of the token's own query, keys and values: the same in any
batch, chunk or number of programs. (Exponentials are ``exp`` in fp32; the Triton kernels and this
reference differ in their roundings, not in the function: the kernels' sums over a segment's keys
are the tensor cores' k-step chains, ``l`` among them as ``P @ 1``.)

``attention_reference`` below computes it in plain torch, one token at a time (tests). The
Triton kernels run the segments of a call inside one program per query block and KV head, or,
for calls with few query blocks (decode), one program per segment with the merges afterwards:
the same merges in the same order, so the same bits.
"""

from __future__ import annotations

import math

import torch

__all__ = ["SEGMENT", "attention_reference", "check_attention_args"]

SEGMENT = 64  # keys per segment: the kernels' key tile, and a tensor-core M side (64) when keys are one


def check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table) -> None:
    """Raise ``ValueError`` naming what is wrong with a call's shapes, dtypes or devices (values are
    not checked: that would read device memory)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_size], got shape {list(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must be [blocks, block_size, kv_heads, head_size] alike, got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if k_cache.shape[3] != q.shape[2]:
        raise ValueError(f"head sizes differ: q {q.shape[2]}, cache {k_cache.shape[3]}")
    if q.dtype not in (torch.bfloat16, torch.float16, torch.float32) or k_cache.dtype != q.dtype:
        raise ValueError(f"q and the cache must share a float dtype (bf16, fp16, fp32), got {q.dtype} and {k_cache.dtype}")
    if cu_seqlens_q.dim() != 1 or seq_lens.dim() != 1 or cu_seqlens_q.shape[0] != seq_lens.shape[0] + 1:
        raise ValueError(f"cu_seqlens_q must be [seqs + 1] and seq_lens [seqs], got {list(cu_seqlens_q.shape)} and "
                         f"{list(seq_lens.shape)}")
    if block_table.dim() != 2 or block_table.shape[0] < seq_lens.shape[0]:
        raise ValueError(f"block_table must be [seqs, blocks per seq], got {list(block_table.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("seq_lens", seq_lens), ("block_table", block_table)):
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    for t in (k_cache, v_cache, cu_seqlens_q, seq_lens, block_table):
        if t.device != q.device:
            raise ValueError(f"every tensor must be on {q.device}; one is on {t.device}")


def attention_reference(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, scale: float,
                        window: int | None = None) -> torch.Tensor:
    """The function of the module docstring, one token at a time: ``[tokens, heads, head_size]``."""
    check_attention_args(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
    tokens, heads, head_size = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    out = torch.empty_like(q)
    starts, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    for seq, seq_len in enumerate(lens):
        q0, q1 = starts[seq], starts[seq + 1]
        keys = torch.arange(seq_len, device=q.device)
        slots = block_table[seq, keys // block_size].long() * block_size + keys % block_size
        k = k_cache.reshape(-1, kv_heads, head_size)[slots]  # [seq_len, kv_heads, D]
        v = v_cache.reshape(-1, kv_heads, head_size)[slots]
        for t in range(q0, q1):
            p = seq_len - (q1 - q0) + (t - q0)
            lo = 0 if window is None else max(0, p - window)
            for h in range(heads):
                out[t, h] = _one_query(q[t, h], k[:, h // group], v[:, h // group], p, lo, scale)
    return out


def _one_query(q, k, v, p, lo, scale):
    M = torch.tensor(-math.inf)
    L = torch.tensor(0.0)
    O = torch.zeros(q.shape[0])
    for s in range(lo // SEGMENT, p // SEGMENT + 1):
        a, b = max(s * SEGMENT, lo), min((s + 1) * SEGMENT, p + 1)
        scores = (k[a:b].float() @ q.float()) * scale
        m = scores.max()
        probs = torch.exp(scores - m).to(v.dtype).float()
        l, acc = probs.sum(), probs @ v[a:b].float()
        M_new = torch.maximum(M, m)
        e_old, e_new = torch.exp(M - M_new), torch.exp(m - M_new)
        L, O, M = L * e_old + l * e_new, O * e_old + acc * e_new, M_new
    return (O / L).to(q.dtype)
