"""How fast TMA tiles stream into the SMs from L2 and from HBM, alone and together.

Every operand tile of kittens' GEMMs comes through L2: the weights stream from HBM (each row tile
loads its expert's weight columns whole) while the token rows, loaded once per column tile, mostly
hit. ``tile_read_rates`` times a kernel that loads [256, 64] bf16 tiles by TMA, pipelined as the
GEMMs' weight tiles are (3 in flight for one tile per step), from two buffers at once: ``hits`` tiles per step from one
that fits in L2 (it stays there between calls) and ``streamed`` tiles per step from one of 4 GiB,
each of its tiles loaded once. The layer benchmark compares what each missed target asks of L2
with ``l2_read_bandwidth``; ``python -m mok_serve.loadtest.l2_rates`` prints the mixed rates.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

TILE = (256, 64)  # rows x bf16 columns: 32 KB, a GEMM weight tile
STREAM_BYTES = 4 << 30


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


def tile_read_rates(hits: int, streamed: int, programs: int, hit_bytes: int, calls: int = 20) -> dict:
    """TB/s of the hit tiles, the streamed tiles and both, with ``programs`` programs loading
    ``hits`` tiles from an L2-resident buffer of ``hit_bytes`` and ``streamed`` tiles from a 4 GiB
    one per step (as many steps as read the 4 GiB once; 4096 per program without it). Checked
    first: each program's sum is its tile count times the tile size (both buffers hold ones).
    Median of ``calls`` timed calls after a warm-up call."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tile_bytes = TILE[0] * TILE[1] * 2
    num_hit = max(1, hit_bytes // tile_bytes)
    num_stream = STREAM_BYTES // tile_bytes if streamed else 1
    hit = torch.ones(num_hit * TILE[0], TILE[1], device="cuda", dtype=torch.bfloat16)
    stream = torch.ones(num_stream * TILE[0], TILE[1], device="cuda", dtype=torch.bfloat16)
    iters = num_stream // (programs * streamed) if streamed else 4096 * 132 // programs
    out = torch.full((programs,), float("nan"), device="cuda")
    kernel = _tile_read_kernel()
    launch = lambda: kernel[(programs,)](
        TensorDescriptor.from_tensor(hit, list(TILE)), num_hit, TensorDescriptor.from_tensor(stream, list(TILE)),
        num_stream, out, iters, HITS=hits, STREAMED=streamed, BLOCK_R=TILE[0], BLOCK_C=TILE[1], num_warps=8,
        # 3 tiles in flight for one load per step (as the GEMMs), 2 per load for two, 1 beyond.
        STAGES={1: 4, 2: 3}.get(hits + streamed, 2))
    launch()
    expect = float(iters * (hits + streamed) * TILE[0] * TILE[1])
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
    s = statistics.median(times)
    per_tile = programs * iters * tile_bytes / s / 1e12
    return dict(hit_tb_s=hits * per_tile, stream_tb_s=streamed * per_tile, total_tb_s=(hits + streamed) * per_tile)


def l2_read_bandwidth() -> float:
    """The fastest rate (TB/s) at which TMA tiles stream from L2 alone into the SMs: a buffer of a
    third of the L2, the best of 1, 2 and 4 programs per SM."""
    props = torch.cuda.get_device_properties(0)
    return max(tile_read_rates(1, 0, per_sm * props.multi_processor_count, props.L2_cache_size // 3)["hit_tb_s"]
               for per_sm in (1, 2, 4))


MIXES = ((1, 0), (0, 1), (1, 1), (2, 1), (1, 2), (3, 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mok_serve.loadtest.l2_rates", description=__doc__.split("\n")[0])
    p.add_argument("--per-sm", type=int, nargs="*", default=[1, 2], help="programs per SM to try")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {props.L2_cache_size >> 20} MiB; "
          f"hit buffer {props.L2_cache_size // 3 >> 20} MiB, streamed buffer {STREAM_BYTES >> 30} GiB")
    print("| hit tiles per step | streamed tiles per step | programs per SM | hits TB/s | streamed TB/s | total TB/s |")
    print("|---|---|---|---|---|---|")
    for hits, streamed in MIXES:
        for per_sm in args.per_sm:
            r = tile_read_rates(hits, streamed, per_sm * props.multi_processor_count, props.L2_cache_size // 3)
            print(f"| {hits} | {streamed} | {per_sm} | {r['hit_tb_s']:.2f} | {r['stream_tb_s']:.2f} | {r['total_tb_s']:.2f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
