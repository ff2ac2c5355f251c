"""How fast TMA tiles stream into the SMs from L2 and from HBM, alone and together.

Every operand tile of kittens' GEMMs comes through L2: the weights stream from HBM (each row tile
loads its expert's weight columns whole) while the token rows, loaded once per column tile, mostly
hit. ``tile_read_rates`` times a kernel that loads [rows, 64] bf16 tiles by TMA, pipelined as the
GEMMs' tiles are (``stages - 1`` steps in flight), from two buffers at once: ``hits`` tiles per
step from one that fits in L2 (it stays there between calls) and ``streamed`` tiles per step from
one of 4 GiB, each of its tiles loaded once. The layer benchmark compares what each missed target
asks of L2 with ``l2_read_bandwidth``; ``python -m mok_serve.loadtest.bench.l2_rates`` prints the HBM
stream's rate by bytes in flight per SM, and hits and stream together.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys

import torch

STREAM_BYTES = 4 << 30


@functools.cache  # one JIT function, so its compiled variants are kept between calls
def _tile_read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def tile_read_kernel(hit_desc, num_hit, stream_desc, num_stream, out_ptr, iters,
                         HITS: tl.constexpr, STREAMED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                         STAGES: tl.constexpr):
        """Program ``pid`` sums tiles ``(pid + i * grid) * HITS + j`` (modulo) of the L2-resident
        buffer and ``(pid + i * grid) * STREAMED + j`` of the streamed one for ``iters`` steps."""
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for i in tl.range(iters, num_stages=STAGES):
            step = pid + i * tl.num_programs(0)
            for j in tl.static_range(HITS):
                acc += hit_desc.load([((step * HITS + j) % num_hit) * BLOCK_R, 0]).to(tl.float32)
            for j in tl.static_range(STREAMED):
                acc += stream_desc.load([((step * STREAMED + j) % num_stream) * BLOCK_R, 0]).to(tl.float32)
        tl.store(out_ptr + pid, tl.sum(acc))

    return tile_read_kernel


def tile_read_rates(hits: int, streamed: int, programs: int, hit_bytes: int, *, tile_rows: int = 256,
                    stages: int = 4, calls: int = 20) -> dict:
    """TB/s of the hit tiles, the streamed tiles and both, with ``programs`` programs loading
    ``hits`` [tile_rows, 64] bf16 tiles from an L2-resident buffer of ``hit_bytes`` and
    ``streamed`` tiles from a 4 GiB one per step (as many steps as read the 4 GiB once; 4096 * 132
    / programs without it), ``stages - 1`` steps in flight. Checked first: each program's sum is
    its tile count times the tile size (both buffers hold ones). Median of ``calls`` timed calls
    after a warm-up call."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tile = (tile_rows, 64)
    tile_bytes = tile[0] * tile[1] * 2
    num_hit = max(1, hit_bytes // tile_bytes)
    num_stream = STREAM_BYTES // tile_bytes if streamed else 1
    hit = torch.ones(num_hit * tile[0], tile[1], device="cuda", dtype=torch.bfloat16)
    stream = torch.ones(num_stream * tile[0], tile[1], device="cuda", dtype=torch.bfloat16)
    iters = num_stream // (programs * streamed) if streamed else 4096 * 132 // programs
    out = torch.full((programs,), float("nan"), device="cuda")
    kernel = _tile_read_kernel()
    launch = lambda: kernel[(programs,)](
        TensorDescriptor.from_tensor(hit, list(tile)), num_hit, TensorDescriptor.from_tensor(stream, list(tile)),
        num_stream, out, iters, HITS=hits, STREAMED=streamed, BLOCK_R=tile[0], BLOCK_C=tile[1], STAGES=stages,
        num_warps=8)
    launch()
    expect = float(iters * (hits + streamed) * tile[0] * tile[1])
    if not bool((out == expect).all()):
        raise RuntimeError(f"tile read kernel summed {out.tolist()[:4]}..., expected {expect}")
    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    del hit, stream
    torch.cuda.empty_cache()
    per_tile = programs * iters * tile_bytes / statistics.median(times) / 1e12
    return dict(hit_tb_s=hits * per_tile, stream_tb_s=streamed * per_tile, total_tb_s=(hits + streamed) * per_tile)


def l2_read_bandwidth() -> float:
    """The fastest rate (TB/s) at which TMA tiles stream from L2 alone into the SMs: a buffer of a
    third of the L2, the best of 1, 2 and 4 programs per SM."""
    props = torch.cuda.get_device_properties(0)
    return max(tile_read_rates(1, 0, per_sm * props.multi_processor_count, props.L2_cache_size // 3)["hit_tb_s"]
               for per_sm in (1, 2, 4))


# Shared memory a program may take (of an SM's 228 KB, 1 KB reserved per program).
SMEM_PER_SM = 227 * 1024


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_serve.loadtest.bench.l2_rates", description=__doc__.split("\n")[0])
    p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    sms, hit_bytes = props.multi_processor_count, props.L2_cache_size // 3
    print(f"{props.name}: {sms} SMs, L2 {props.L2_cache_size >> 20} MiB; hit buffer {hit_bytes >> 20} MiB, "
          f"streamed buffer {STREAM_BYTES >> 30} GiB")
    print("\nHBM stream alone, by bytes in flight per SM (tile x (stages - 1) x programs per SM):")
    print("| tile KB | stages | programs per SM | KB in flight per SM | streamed TB/s |")
    print("|---|---|---|---|---|")
    for tile_rows in (64, 128, 256):
        kb = tile_rows * 64 * 2 // 1024
        for stages in (2, 3, 4, 5, 7, 9):
            for per_sm in (1, 2):
                if per_sm * kb * (stages - 1) * 1024 > SMEM_PER_SM:  # stages - 1 buffers
                    continue
                r = tile_read_rates(0, 1, per_sm * sms, hit_bytes, tile_rows=tile_rows, stages=stages)
                print(f"| {kb} | {stages} | {per_sm} | {kb * (stages - 1) * per_sm} | {r['stream_tb_s']:.2f} |", flush=True)
    print("\nL2 hits and the HBM stream together, 16 KB tiles, 3 steps in flight, one program per SM:")
    print("| hit tiles per step | streamed tiles per step | hits TB/s | streamed TB/s | total TB/s |")
    print("|---|---|---|---|---|")
    for hits, streamed in ((1, 0), (0, 1), (1, 1), (2, 1), (1, 2), (3, 1)):
        r = tile_read_rates(hits, streamed, sms, hit_bytes, tile_rows=128, stages=4)
        print(f"| {hits} | {streamed} | {r['hit_tb_s']:.2f} | {r['stream_tb_s']:.2f} | {r['total_tb_s']:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
