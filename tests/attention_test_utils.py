"""Paged-attention test batches: random queries and a paged KV cache shuffled over its blocks, as
vLLM lays them out ([blocks, block_size, kv_heads, head_size] views of one cache)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_test_utils import rel_err

__all__ = ["Batch", "rel_err"]


@dataclass
class Batch:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cu_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    max_seq_len: int
    scale: float
    page: int

    @classmethod
    def random(cls, seqs: list[tuple[int, int]], heads: int, kv_heads: int, head: int, *, seed: int, page: int = 16,
               dtype=torch.bfloat16, device="cpu") -> Batch:
        """``seqs``: (query tokens, KV length) per sequence; the queries are the last tokens."""
        g = torch.Generator(device=device).manual_seed(seed)
        pages = [-(-n // page) for _, n in seqs]
        total = sum(pages) + 3
        perm = torch.randperm(total, generator=g, device=device)
        table = torch.zeros((len(seqs), max(pages)), dtype=torch.int32, device=device)
        used = 0
        for i, n in enumerate(pages):
            table[i, :n] = perm[used : used + n].to(torch.int32)
            used += n
        kv = torch.randn(total, page, kv_heads, 2 * head, generator=g, device=device).to(dtype)
        k, v = kv.split(head, dim=-1)  # strided views, as vLLM's cache
        tokens = sum(q for q, _ in seqs)
        q = torch.randn(tokens, heads, head, generator=g, device=device).to(dtype)
        cu = torch.tensor([0] + list(torch.tensor([q for q, _ in seqs]).cumsum(0)), dtype=torch.int32, device=device)
        lens = torch.tensor([n for _, n in seqs], dtype=torch.int32, device=device)
        return cls(q, k, v, cu, lens, table, max(n for _, n in seqs), head**-0.5, page)

    def subset_queries(self, seq: int, first: int, seq_len: int) -> Batch:
        """Sequence ``seq``'s query tokens at positions ``first .. seq_len - 1`` alone (its cache as is)."""
        q0, q1 = int(self.cu_q[seq]), int(self.cu_q[seq + 1])
        n_q = q1 - q0
        start = q0 + (first - (int(self.seq_lens[seq]) - n_q))
        q = self.q[start : start + seq_len - first]
        cu = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        return Batch(q, self.k, self.v, cu, torch.tensor([seq_len], dtype=torch.int32, device=q.device),
                     self.block_table[seq : seq + 1], self.max_seq_len, self.scale, self.page)

    @staticmethod
    def concat(a: Batch, b: Batch) -> Batch:
        """Both batches' sequences in one call: b's cache blocks renumbered after a's."""
        blocks = a.k.shape[0]
        kv = torch.cat([torch.cat([a.k, a.v], -1), torch.cat([b.k, b.v], -1)])
        k, v = kv.split(a.k.shape[-1], dim=-1)
        width = max(a.block_table.shape[1], b.block_table.shape[1])
        table = torch.zeros((a.block_table.shape[0] + b.block_table.shape[0], width), dtype=torch.int32,
                            device=a.q.device)
        table[: a.block_table.shape[0], : a.block_table.shape[1]] = a.block_table
        table[a.block_table.shape[0] :, : b.block_table.shape[1]] = b.block_table + blocks
        cu = torch.cat([a.cu_q, b.cu_q[1:] + a.cu_q[-1]])
        return Batch(torch.cat([a.q, b.q]), k, v, cu, torch.cat([a.seq_lens, b.seq_lens]), table,
                     max(a.max_seq_len, b.max_seq_len), a.scale, a.page)
