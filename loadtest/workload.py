"""The seeded workload: the same list of requests for every server of a comparison.

Random prompts are lists of token ids drawn uniformly (seeded ``numpy`` generator) from the
tokenizer's vocabulary without its special tokens, sent as token-id prompts to
``/v1/completions``; their input length is therefore exact, and with ``ignore_eos`` so is their
output length. A dataset file gives text prompts instead (their length is whatever the server's
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


def vocab_from_tokenizer(tokenizer_path: str | os.PathLike) -> np.ndarray:
    """Token ids that are safe for random prompts: the whole vocabulary without special tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_path))
    special = set(tok.all_special_ids)
    ids = [i for i in range(len(tok)) if i not in special]
    if not ids:
        raise ValueError(f"tokenizer {tokenizer_path} has no non-special tokens")
    return np.asarray(ids, dtype=np.int64)


def random_workload(
    n: int, input_len: int, output_len: int, vocab: np.ndarray, seed: int, range_ratio: float = 0.0
) -> list[WorkItem]:
    """``n`` random token-id prompts. With ``range_ratio`` r > 0 the lengths are drawn uniformly
    from [len * (1 - r), len * (1 + r)] (as vLLM's random dataset does), else they are fixed."""
    rng = np.random.default_rng(seed)
    items = []
    for _ in range(n):
        il = _draw_len(rng, input_len, range_ratio)
        ol = _draw_len(rng, output_len, range_ratio)
        prompt = vocab[rng.integers(0, len(vocab), size=il)].tolist()
        items.append(WorkItem(prompt=prompt, prompt_len=il, output_len=ol))
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
