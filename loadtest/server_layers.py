"""The server's per-layer MoE stats (``GET /v1/kittens/layers``), parsed without assuming their schema.

The endpoint (issue 5) returns JSON with a list of per-layer entries. This module finds that list
(the first list of objects under ``layers`` or, failing that, anywhere in the document), names
each entry by its layer / rank fields, and keeps every numeric field (nested objects flattened
with dots, e.g. ``latency_us.p50``). Fields whose names look like times (``latency``, ``time``,
``_us``, ``_ms``, ``_ns``, ``mean``, ``p50`` ...) are the ones shown in reports; the rest (calls,
tokens, expert counts) stay in the JSON.
"""

from __future__ import annotations

import re
from typing import Any

NAME_KEYS = ("layer", "layer_name", "name", "prefix", "layer_index", "index", "id")
RANK_KEYS = ("rank", "ep_rank", "tp_rank")
TIME_RE = re.compile(r"(lat|time|dur|elapsed|_us|_ms|_ns|(^|\.)us|(^|\.)ms|mean|median|p50|p90|p99|avg)", re.I)
NOT_TIME_RE = re.compile(r"(count|calls|tokens|load|imbalance|rank|index|window|size|rate|samples|pid)", re.I)


def find_layer_list(doc: Any) -> list[dict] | None:
    if isinstance(doc, dict):
        for key in ("layers", "per_layer", "moe_layers"):
            v = doc.get(key)
            if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
                return v
            if isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
                return [{"layer": k, **x} for k, x in v.items()]
        for v in doc.values():
            found = find_layer_list(v)
            if found:
                return found
    elif isinstance(doc, list):
        if doc and all(isinstance(x, dict) for x in doc):
            return doc
        for v in doc:
            found = find_layer_list(v)
            if found:
                return found
    return None


def flatten_numeric(obj: Any, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, bool):
        return out
    if isinstance(obj, (int, float)):
        out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten_numeric(v, f"{prefix}.{k}" if prefix else str(k)))
    return out  # lists (e.g. per-expert counts) are left to the raw JSON


def layer_label(entry: dict, i: int) -> str:
    name = next((entry[k] for k in NAME_KEYS if k in entry and not isinstance(entry[k], (dict, list))), i)
    rank = next((entry[k] for k in RANK_KEYS if k in entry and not isinstance(entry[k], (dict, list))), None)
    return f"{name}" if rank is None else f"{name} (rank {rank})"


def is_time_field(key: str) -> bool:
    last = key.rsplit(".", 1)[-1]
    return bool(TIME_RE.search(key)) and not NOT_TIME_RE.search(key) and "expert" not in last.lower()


def parse_layers(doc: Any) -> list[dict[str, Any]] | None:
    """``[{"label": ..., "fields": {name: number}, "time_fields": [...]}, ...]`` or None.

    A layer entry holding a list of objects (per-rank statistics, as mok-serve's ``ranks``) gives
    one row per item, labelled ``<layer> (rank <r>)``, with the layer's own numbers added."""
    entries = find_layer_list(doc)
    if not entries:
        return None
    parsed = []
    skip = NAME_KEYS + RANK_KEYS
    for i, e in enumerate(entries):
        own = {k: v for k, v in flatten_numeric(e).items() if k not in skip}
        subs = next((v for v in e.values() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)), None)
        rows = []
        if subs:
            for j, sub in enumerate(subs):
                rank = next((sub[k] for k in RANK_KEYS if k in sub and not isinstance(sub[k], (dict, list))), j)
                fields = own | {k: v for k, v in flatten_numeric(sub).items() if k not in skip}
                rows.append((f"{layer_label(e, i)} (rank {rank})", fields))
        else:
            rows.append((layer_label(e, i), own))
        for label, fields in rows:
            parsed.append({"label": label, "fields": fields, "time_fields": [k for k in fields if is_time_field(k)]})
    return parsed


def headline_field(parsed: list[dict[str, Any]]) -> str | None:
    """The time field to plot: a mean if there is one, else a median/p50, else the first."""
    common = None
    for layer in parsed:
        keys = set(layer["time_fields"])
        common = keys if common is None else common & keys
    if not common:
        return None
    ordered = sorted(common)
    for pattern in ("mean", "avg", "p50", "median"):
        for k in ordered:
            if pattern in k.lower() and "phase" not in k.lower():
                return k
    return ordered[0]
