"""The seeded workload: the same list of requests for every server of a comparison.

Random prompts are token ids drawn uniformly (seeded ``numpy`` generator) from the tokenizer's
vocabulary without its special tokens, sent by default as text that re-encodes to exactly the
chosen length (as ``vllm bench serve --dataset-name random`` does; the server tokenizes it), or
with ``--prompt-format ids`` as token-id lists; with ``ignore_eos`` the output length is exact. A dataset file gives text prompts instead (their length is whatever the server's
tokenizer makes of them; the server reports it in ``usage.prompt_tokens``).

Dataset file formats: ``.jsonl`` (one JSON object per line with ``prompt`` or ``text``, optional
``output_len`` / ``max_tokens``), ``.json`` (a list of strings or of such objects) or any other
extension: plain text, one prompt per non-empty line.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class WorkItem:
    prompt: list[int] | str
    prompt_len: int  # exact for token-id prompts, 0 (unknown until the server says) for text
    output_len: int


def load_tokenizer(tokenizer_path: str | os.PathLike):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_path))


def vocab_of(tok) -> np.ndarray:
    """Token ids that are safe for random prompts: the whole vocabulary without special tokens."""
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no non-special tokens")
    return np.asarray(ids, dtype=np.int64)


def ids_to_text(tok, ids: list[int], target_len: int, vocab: np.ndarray, rng: np.random.Generator,
                max_retry: int = 10, max_draws: int = 50) -> tuple[str, int]:
    """Text whose re-encoding has ``target_len`` tokens, as vLLM's random dataset makes it
    (``gen_prompt_decode_to_target_len``: decode, re-encode, truncate or extend, retry), with
    fresh random ids when that does not converge (vLLM would accept the mismatch).
    Returns (text, its length in tokens)."""
    seq = list(ids)
    for _ in range(max_draws):
        for _ in range(max_retry + 1):
            text = tok.decode(seq)
            seq = tok.encode(text, add_special_tokens=False)
            if len(seq) == target_len:
                return text, target_len
            if len(seq) < target_len:
                seq += vocab[rng.integers(0, len(vocab), size=target_len - len(seq))].tolist()
            else:
                seq = seq[:target_len]
        seq = vocab[rng.integers(0, len(vocab), size=target_len)].tolist()
    return text, len(tok.encode(text, add_special_tokens=False))


def random_workload(
    n: int, input_len: int, output_len: int, vocab: np.ndarray, seed: int, range_ratio: float = 0.0,
    tokenizer=None,
) -> list[WorkItem]:
    """``n`` random prompts. With ``range_ratio`` r > 0 the lengths are drawn uniformly from
    [len * (1 - r), len * (1 + r)] (as vLLM's random dataset does), else they are fixed. Without
    ``tokenizer`` the prompts are token-id lists; with it, text that re-encodes to that length
    (the form ``vllm bench serve --dataset-name random`` sends, so tokenization is part of the
    measured work)."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        il = _draw_len(rng, input_len, range_ratio)
        ol = _draw_len(rng, output_len, range_ratio)
        ids = vocab[rng.integers(0, len(vocab), size=il)].tolist()
        if tokenizer is None:
            items.append(WorkItem(prompt=ids, prompt_len=il, output_len=ol))
        else:
            text, length = ids_to_text(tokenizer, ids, il, vocab, rng)
            items.append(WorkItem(prompt=text, prompt_len=length, output_len=ol))
    return items


def _draw_len(rng: np.random.Generator, mean: int, r: float) -> int:
    if r <= 0:
        return int(mean)
    lo, hi = max(1, int(mean * (1 - r))), max(1, int(mean * (1 + r)))
    return int(rng.integers(lo, hi + 1))


def load_dataset(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Prompts of a dataset file as ``{"prompt": str, "output_len": int | None}``."""
    path = Path(path)
    text = path.read_text()
    entries: list[Any]
    if path.suffix == ".jsonl":
        entries = [json.loads(line) for line in text.splitlines() if line.strip()]
    elif path.suffix == ".json":
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError(f"{path}: expected a JSON list of prompts")
    else:
        entries = [line for line in text.splitlines() if line.strip()]
    out = []
    for i, e in enumerate(entries):
        if isinstance(e, str):
            out.append({"prompt": e, "output_len": None})
        elif isinstance(e, dict) and isinstance(e.get("prompt", e.get("text")), str):
            ol = e.get("output_len", e.get("max_tokens"))
            out.append({"prompt": e.get("prompt", e.get("text")), "output_len": int(ol) if ol else None})
        else:
            raise ValueError(f"{path}: entry {i} is neither a string nor an object with 'prompt'")
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


def dataset_workload(entries: list[dict[str, Any]], n: int, output_len: int, seed: int) -> list[WorkItem]:
    """``n`` prompts drawn from the dataset: a seeded shuffle, repeated if the file is short."""
    rng = np.random.default_rng(seed)
    items: list[WorkItem] = []
    while len(items) < n:
        for j in rng.permutation(len(entries)):
            e = entries[int(j)]
            items.append(WorkItem(prompt=e["prompt"], prompt_len=0, output_len=e["output_len"] or output_len))
            if len(items) == n:
                break
    return items


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (s from the start) of ``n`` requests at ``rate`` requests/s, as vLLM's
    ``get_request``: gamma-distributed gaps (burstiness 1 = Poisson process), cumulated, then
    rescaled so the last one falls at n / rate. ``rate`` inf: all at 0."""
    if math_isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t = t * ((n / rate) / t[-1])
    return t.tolist()


def math_isinf(x: float) -> bool:
    return x == float("inf")
