"""mok-loadtest attention: the paged attention of a deterministic server, kittens' batch-invariant
kernel (``mok_serve.kernels.invariant_attention``) against vLLM's Triton kernel in the same place.

Baselines, timed in the same run where vLLM imports: ``vllm`` (``unified_attention`` as vLLM's
Triton attention backend calls it by default: its segment-parallel "3D" kernel for decode calls of
at most 128 / KV-heads sequences, else the single-pass "2D" one) and ``vllm-2d`` (the single-pass
kernel for every call: what ``VLLM_BATCH_INVARIANT=1`` runs). ``--layouts`` adds kittens with its
operands swapped and not (``kittens-swapped``, ``kittens-unswapped``) whatever the call's shape:
a measurement of the plan's choice (the same bits either way); ``--segment-programs N...`` adds
kittens with N programs sharing a query block's segments on the split path (``kittens-pN``).

Calls (``CALLS``): decode steps (one query token per sequence) and prefill (every token of fresh
prompts, or a chunk of a longer one), on a paged cache of 16-token pages spread over the cache at
random, as vLLM lays it out. Each call is checked before it is timed: every provider's output
within 1e-2 relative error norm of an fp32 reference (NaN fails). Times are medians of CUDA-graph
replays with the L2 flushed before each (``harness.graph_time``); the floor is max(FLOPs / 790
TFLOP/s, bytes / 4.4 TB/s), FLOPs = 4 x head size x query heads x visible (query, key) pairs,
bytes = each sequence's keys and values once + queries + outputs. Results:
``attention_bench.{json,md}`` in ``--out``, rows in ``history.csv`` (benchmark ``attention_bench``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from .. import history
from .harness import (PEAK_BYTES, PEAK_FLOPS, add_ratios, bench_meta, graph_time, passes, rel_err,
                      timed_history_rows)

RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
TOL = 1e-2
PAGE = 16
MAX_MODEL_LEN = 8192  # the bound a server passes (its max_model_len)

# (query heads, KV heads, head size) of the served shapes (public configs). DeepSeek-V3-MHA: its
# attention as vLLM runs it with VLLM_MLA_DISABLE=1 (the GPU kit has no MLA backend): 128 heads
# of 192 (128 + 64 rope), values zero-padded from 128 to 192 in the cache.
HEADS = {"Qwen3-30B-A3B": (32, 4, 128), "GLM-4.5-Air": (96, 8, 128), "DeepSeek-V3-MHA": (128, 128, 192)}
# name -> (query tokens, KV length) per sequence; a sequence's queries are its last tokens.
CALLS = {
    "decode 1 x 512": [(1, 512)],
    "decode 1 x 4096": [(1, 4096)],
    "decode 32 x 2048": [(1, 2048)] * 32,
    "decode 256 x 1024": [(1, 1024)] * 256,
    "prefill 2 x 4096": [(4096, 4096)] * 2,
    "prefill 16 x 512": [(512, 512)] * 16,
    "chunk 2048 of 8192": [(2048, 8192)],
}


def visible_pairs(seqs) -> int:
    """(query, key) pairs a causal call computes: query i of n at position kv - n + i sees its
    position + 1 keys."""
    return sum(n * (kv - n) + n * (n + 1) // 2 for n, kv in seqs)


def floor_ms(seqs, heads: int, kv_heads: int, head: int, elem_bytes: int = 2) -> float:
    flops = 4.0 * head * heads * visible_pairs(seqs)
    tokens = sum(n for n, _ in seqs)
    moved = (2 * sum(kv for _, kv in seqs) * kv_heads + 2 * tokens * heads) * head * elem_bytes
    return max(flops / PEAK_FLOPS, moved / PEAK_BYTES) * 1e3


def make_call(seqs, heads: int, kv_heads: int, head: int, gen) -> dict:
    """Queries, a paged KV cache (pages shuffled) and the metadata of one call, on the GPU."""
    pages = [-(-kv // PAGE) for _, kv in seqs]
    total = sum(pages) + 1
    perm = torch.randperm(total, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(seqs), max(pages)), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(pages):
        table[i, :n] = perm[used : used + n]
        used += n
    # Drawn in bf16: an fp32 draw of DeepSeek-V3-MHA's 256 x 1024 cache alone would take 52 GB.
    kv = torch.randn(total, PAGE, kv_heads, 2 * head, device="cuda", generator=gen, dtype=torch.bfloat16)
    k, v = kv.split(head, dim=-1)  # strided views of one cache, as vLLM's
    tokens = sum(n for n, _ in seqs)
    q = torch.randn(tokens, heads, head, device="cuda", generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, *torch.tensor([n for n, _ in seqs]).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    lens = torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, cu=cu, lens=lens, table=table, seqs=seqs, scale=head**-0.5,
                max_q=max(n for n, _ in seqs), max_kv=max(kv for _, kv in seqs))


def reference(c: dict) -> torch.Tensor:
    """fp32 causal attention, sequence by sequence, from the paged cache."""
    heads, kv_heads = c["q"].shape[1], c["k"].shape[2]
    out = torch.empty_like(c["q"], dtype=torch.float32)
    for i, (n, kv) in enumerate(c["seqs"]):
        blocks = c["table"][i, : -(-kv // PAGE)].long()
        k = c["k"][blocks].reshape(-1, kv_heads, c["k"].shape[-1])[:kv].float().repeat_interleave(heads // kv_heads, 1)
        v = c["v"][blocks].reshape(-1, kv_heads, c["v"].shape[-1])[:kv].float().repeat_interleave(heads // kv_heads, 1)
        q = c["q"][c["cu"][i] : c["cu"][i] + n].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * c["scale"]
        pos = torch.arange(kv - n, kv, device="cuda")[:, None]
        s = s.masked_fill(torch.arange(kv, device="cuda")[None, :] > pos, float("-inf"))
        out[c["cu"][i] : c["cu"][i] + n] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


def providers(layouts: bool, segment_programs: list[int]) -> dict:
    """name -> fn(call, out) writing ``out``."""
    from mok_serve.kernels.cuda.attention import invariant_attention_triton

    def kittens(**kw):
        return lambda c, out: invariant_attention_triton(c["q"], c["k"], c["v"], out, c["cu"], c["lens"], c["table"],
                                                         MAX_MODEL_LEN, c["scale"], **kw)

    impls = {"kittens": kittens()}
    if layouts:
        impls.update({"kittens-swapped": kittens(swap=True), "kittens-unswapped": kittens(swap=False)})
    impls.update({f"kittens-p{n}": kittens(segment_programs=n) for n in segment_programs})
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except ImportError:
        return impls

    def vllm(three_d: bool):
        def run(c, out):
            heads, kv_heads, head = c["q"].shape[1], c["k"].shape[2], c["q"].shape[2]
            kw = {}
            threshold = 128 // kv_heads  # the Triton backend's seq_threshold_3D (before capture sizes)
            if three_d:
                pad = 1 << (head - 1).bit_length()  # head size padded to a power of two
                kw = dict(seq_threshold_3D=threshold, num_par_softmax_segments=16,
                          softmax_segm_output=c.setdefault("segm_out", torch.empty(
                              (threshold, heads, 16, pad), dtype=torch.float32, device="cuda")),
                          softmax_segm_max=c.setdefault("segm_max", torch.empty(
                              (threshold, heads, 16), dtype=torch.float32, device="cuda")),
                          softmax_segm_expsum=c.setdefault("segm_sum", torch.empty(
                              (threshold, heads, 16), dtype=torch.float32, device="cuda")))
            unified_attention(q=c["q"], k=c["k"], v=c["v"], out=out, cu_seqlens_q=c["cu"], max_seqlen_q=c["max_q"],
                              seqused_k=c["lens"], max_seqlen_k=c["max_kv"], softmax_scale=c["scale"], causal=True,
                              window_size=(-1, -1), block_table=c["table"], softcap=0, q_descale=None,
                              k_descale=None, v_descale=None, **kw)
        return run

    impls["vllm"] = vllm(True)
    impls["vllm-2d"] = vllm(False)
    return impls


def measure(model: str, call: str, impls: dict, gen) -> dict:
    heads, kv_heads, head = HEADS[model]
    c = make_call(CALLS[call], heads, kv_heads, head, gen)
    ref = reference(c)
    row = {"model": model, "call": call, "tokens": c["q"].shape[0], "seqs": len(c["seqs"]),
           "floor_ms": floor_ms(c["seqs"], heads, kv_heads, head)}
    for name, fn in impls.items():
        out = torch.full_like(c["q"], float("nan"))  # poisoned: an unwritten row fails the check
        fn(c, out)
        row[f"{name}_err"] = err = rel_err(out, ref)
        row[f"{name}_ms"] = graph_time(lambda fn=fn, out=out: fn(c, out))[0] if passes(err, TOL) else None
    add_ratios(row, impls)
    return row


def markdown(meta: dict, rows: list[dict], names: list[str]) -> str:
    head = ["model", "call", "tokens", "floor us", *[f"{n} us" for n in names], "kittens x floor",
            *[f"vs {n}" for n in names if n != "kittens"]]
    lines = [f"# Paged attention: kittens' batch-invariant kernel vs vLLM's ({meta['gpu']}, commit {meta['commit']})",
             "", meta["timing"], "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def us(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    for r in rows:
        x_floor = r.get("kittens_x_floor")
        cells = [r["model"], r["call"], str(r["tokens"]), us(r["floor_ms"]), *[us(r.get(f"{n}_ms")) for n in names],
                 "-" if x_floor is None else f"{x_floor:.2f}",
                 *[f"{r[f'speedup_vs_{n}']:.2f}x" if r.get(f"speedup_vs_{n}") else "-" for n in names if n != "kittens"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def history_rows(meta: dict, rows: list[dict], names: list[str]) -> list[dict]:
    return timed_history_rows(meta, rows, names, "attention_bench", lambda r: f"{r['model']}:{r['call']}",
                              lambda r: r["tokens"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mok-loadtest attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(HEADS), help="comma-separated, of: " + ", ".join(HEADS))
    p.add_argument("--calls", nargs="*", default=list(CALLS), metavar="CALL", help="of: " + "; ".join(CALLS))
    p.add_argument("--layouts", action="store_true", help="also time kittens with operands swapped and not")
    p.add_argument("--segment-programs", type=int, nargs="*", default=[],
                   help="also time kittens with these programs per query block on the split path (kittens-pN)")
    p.add_argument("--out", default=str(RESULTS), help="folder for attention_bench.{json,md}")
    p.add_argument("--seed", type=int, default=1234)
    history.add_arguments(p)
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(HEADS) or set(args.calls) - set(CALLS):
        p.error("unknown model or call")
    if not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    from tqdm import tqdm

    impls = providers(args.layouts, args.segment_programs)
    names = list(impls)
    meta = bench_meta("Median of CUDA-graph replays, L2 flushed before each (triton.testing.do_bench); bf16 "
                      f"queries and cache, {PAGE}-token pages; `vs X`: X's time / kittens' time.")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    rows = []
    for model, call in tqdm([(m, c) for m in models for c in args.calls], desc="attention calls", unit="call"):
        rows.append(measure(model, call, impls, gen))
        torch.cuda.empty_cache()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_bench.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    text = markdown(meta, rows, names)
    (out / "attention_bench.md").write_text(text)
    history.write(history_rows(meta, rows, names), history.resolve(args), "mok-loadtest attention")
    print(text)
    return 0 if all(r.get(f"{n}_ms") is not None for r in rows for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
