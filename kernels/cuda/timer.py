"""The device-side MoE timer: one single-program Triton kernel per mark (``mok_serve/vllm/timing.py``
registers one per layer and reads the buffer; ``kernels/cpu/cpu_timer.cpp`` is its C++ twin, with
the same int64 buffer layout).

No host synchronisation, nothing that depends on host state at replay time, so it can be
captured in CUDA graphs: the sampling decision, the ring index and the histogram bucket are
computed on the device from the layer's call counter. Under ``TRITON_INTERPRET=1`` (CPU tests)
``USE_GLOBALTIMER=False`` stamps a host timestamp passed as an argument instead.
"""

import time

import triton
import triton.language as tl

__all__ = ["launch_moe_timer"]


# Per-call values are not specialized: Triton would otherwise compile a kernel for each of
# tokens == 1, tokens % 16 == 0 and the rest, and pass a 1 as a constant (a Python int).
@triton.jit(do_not_specialize=["point", "tokens", "host_ts"])
def _moe_timer_kernel(
    buf_ptr,
    bounds_ptr,
    point,
    tokens,
    sample_every,
    window,
    host_ts,
    RING: tl.constexpr,
    HIST: tl.constexpr,
    SUMS: tl.constexpr,
    NB: tl.constexpr,
    NBP: tl.constexpr,
    USE_GLOBALTIMER: tl.constexpr,
):
    if USE_GLOBALTIMER:
        ts = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        ts = tl.cast(host_ts, tl.int64)
    if point == 0:
        c = tl.atomic_add(buf_ptr, 1)
        tl.atomic_add(buf_ptr + 1, tl.cast(tokens, tl.int64))
    else:
        c = tl.load(buf_ptr) - 1
    if c % sample_every == 0:
        base = buf_ptr + RING + ((c // sample_every) % window) * 4
        if point == 0:
            tl.store(base + 1, 0)
            tl.store(base + 2, 0)
            tl.store(base + 3, 0)
            tl.store(base, ts)
        elif point < 3:
            tl.store(base + point, ts)
        else:
            tl.store(base + 3, ts)
            t0 = tl.load(base)
            t1 = tl.load(base + 1)
            t2 = tl.load(base + 2)
            bounds = tl.load(bounds_ptr + tl.arange(0, NBP))
            dt = ts - t0
            b = tl.sum((dt > bounds).to(tl.int32), axis=0)
            tl.atomic_add(buf_ptr + HIST + b, 1)
            tl.atomic_add(buf_ptr + SUMS, dt)
            if (t1 > 0) & (t2 > 0):
                d1 = t1 - t0
                d2 = t2 - t1
                d3 = ts - t2
                tl.atomic_add(buf_ptr + HIST + NB + tl.sum((d1 > bounds).to(tl.int32), axis=0), 1)
                tl.atomic_add(buf_ptr + HIST + 2 * NB + tl.sum((d2 > bounds).to(tl.int32), axis=0), 1)
                tl.atomic_add(buf_ptr + HIST + 3 * NB + tl.sum((d3 > bounds).to(tl.int32), axis=0), 1)
                tl.atomic_add(buf_ptr + SUMS + 1, d1)
                tl.atomic_add(buf_ptr + SUMS + 2, d2)
                tl.atomic_add(buf_ptr + SUMS + 3, d3)


def launch_moe_timer(
    buf, bounds, point: int, tokens: int, sample_every: int, window: int, *,
    ring: int, hist: int, sums: int, nb: int, nbp: int, use_globaltimer: bool,
) -> None:
    """One mark: ``point`` of a layer's call of ``tokens`` tokens into the int64 buffer ``buf``
    (ring of ``ring`` samples, histograms at word ``hist`` of ``nb`` buckets each with the ``nbp``
    padded bounds in ``bounds``, sums at word ``sums``), sampled every ``sample_every`` calls over a
    ``window``. ``use_globaltimer=False`` (the interpreter) stamps the host clock instead."""
    _moe_timer_kernel[(1,)](
        buf,
        bounds,
        point,
        tokens,
        sample_every,
        window,
        0 if use_globaltimer else time.perf_counter_ns(),
        RING=ring,
        HIST=hist,
        SUMS=sums,
        NB=nb,
        NBP=nbp,
        USE_GLOBALTIMER=use_globaltimer,
    )
