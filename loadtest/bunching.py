"""Bunched streams: requests whose tokens reached the client in bursts, so that their TTFT, TPOT
and ITL time the bursts and not the server's per-token work.

On a loaded machine (client and server on the same few cores) a server's HTTP front end can fall
behind its engine; vLLM's then merges the tokens it could not send yet into one chunk, and the
client may read many chunks in one network read. Seen on 2 cores: a request's 64 tokens in one
burst at its end, so TTFT = the whole request and TPOT ~ 0.003 ms.

The rule, per successful request with two or more output tokens:

- the streamed chunks that carry tokens arrive at TTFT, TTFT + ITL[0], ...; an *arrival* is a
  run of chunks each less than ``BURST_GAP_S`` (0.5 ms) after the one before: chunks of one
  network read are parsed microseconds apart, while a server's decode steps are never that close;
- the request is *bunched* when its tokens came in at most half as many arrivals as tokens
  (``MIN_TOKENS_PER_ARRIVAL`` = 2 tokens per arrival on average). Then more than half of its
  tokens arrived together with another one; every request whose last arrival holds more than
  half its tokens is bunched, and so is one whose chunks each carry two or more tokens.

A run's TTFT, TPOT and ITL statistics count as *distorted* when its bunched requests are at least
``DISTORTED_SHARE`` (1%) of the requests checked, so any one of the default 48: one request of 48
whose tokens all come at its end raises mean TTFT by (its E2E - TTFT) / 48, 13% of the mean TTFT
of the 2-core c=1 runs (27 ms TTFT, 200 ms E2E). Peak output tok/s counts as distorted too: like
vLLM's, it counts chunks, not tokens. E2E latency and the throughputs are not affected.

Not detectable from the client: chunks sent one by one, more than 0.5 ms apart, but all late.
"""

from __future__ import annotations

from typing import Any

BURST_GAP_S = 0.0005
MIN_TOKENS_PER_ARRIVAL = 2.0
DISTORTED_SHARE = 0.01
# Summary keys whose statistics bunching distorts (peak output tok/s counts chunks).
DISTORTED_KEYS = ("ttft", "tpot", "itl", "peak_output_throughput")
DISTORTED_NAMES = "TTFT, TPOT, ITL"


def arrivals(itl: list[float]) -> int:
    """Arrivals of a request's token chunks: the first one, then each gap of BURST_GAP_S or more."""
    return 1 + sum(1 for gap in itl if gap >= BURST_GAP_S)


def is_bunched(success: bool, output_tokens: int, itl: list[float]) -> bool:
    if not success or output_tokens < 2:
        return False
    return output_tokens >= MIN_TOKENS_PER_ARRIVAL * arrivals(itl)


def summarize(records: list) -> dict[str, Any]:
    """Bunched requests of a run among the successful ones with two or more tokens, and whether
    the run's per-token statistics count as distorted."""
    checked = [r for r in records if r.success and r.output_tokens >= 2]
    bunched = sum(1 for r in checked if is_bunched(r.success, r.output_tokens, r.itl))
    share = bunched / len(checked) if checked else 0.0
    return {"bunched": bunched, "checked": len(checked), "share": share,
            "distorted": bunched > 0 and share >= DISTORTED_SHARE}


def of_run(run: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run's bunching summary; None for a missing or skipped run or results written before
    bunched streams were detected."""
    if not run or run.get("skipped"):
        return None
    return run["summary"].get("bunching")


def distorted(run: dict[str, Any] | None) -> bool:
    return bool((of_run(run) or {}).get("distorted"))


def count_text(b: dict[str, Any]) -> str:
    return f"{b['bunched']} of {b['checked']}"


RULE_TEXT = (
    f"A request is *bunched* when its tokens reached the client in bursts: {MIN_TOKENS_PER_ARRIVAL:g} or more "
    f"tokens per arrival on average, an arrival being streamed chunks less than {BURST_GAP_S * 1e3:g} ms apart "
    "(one network read, or one chunk carrying many tokens). Its TTFT then waits for tokens held back, its ITLs "
    "are ~0 and its TPOT too small. When bunched requests are at least "
    f"{DISTORTED_SHARE:.0%} of a run's completed requests (of two or more tokens), that run's {DISTORTED_NAMES} and peak output tok/s "
    "(which counts chunks) are marked ⚠ as distorted and their ratios are withheld; E2E latency and "
    "throughputs stand. Streams bunch when the client or the server's HTTP front end falls behind, e.g. "
    "both on a few busy cores."
)
