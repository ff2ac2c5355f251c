"""``invariant_linear_fp8``'s prefill tile on two consumer warpgroups (Gluon, Hopper): the same bits as
``linear.py``'s ``_linear_kernel``, with the tensor cores busy while a K block is scaled.

``_linear_kernel`` waits for each 128-deep K block's wgmma before scaling it into the accumulator, so
the tensor cores idle through every scale-and-add (one 8192-token Qwen3-30B-A3B FP8 prefill step on an
H100: 40.1 ms in it, the bf16 routers included, against 12.1 ms in CUTLASS's block-FP8 GEMM). Here a producer warp streams the activation and weight tiles by
TMA through a ring of ``STAGES`` buffers, and two consumer warpgroups each own half of the tile's rows:
each waits for its own wgmma and scales it while the other's runs. Neither reads a wgmma result while
another of its own is in flight, which is what keeps ptxas from serializing the wgmma (C7514, seen
with an in-warpgroup ``wait(1)`` design under Triton 3.6 and 3.7.1; kernels/DESIGN.md).

Each output element is what ``_linear_kernel`` computes: per K block the e4m3 k32 wgmma chain from
zero, times ``xs[m, b] * ws[n // 128, b]``, added to the chunk's sum in block order; the chunks' sums
(``k_chunk``) added to the total in order from +0, the bias in fp32, one rounding. The total waits in
shared memory between chunk ends, so a consumer holds two fp32 tiles in registers, not three.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .fp8_tiles import GROUP

__all__ = ["linear_fp8_two_consumers"]

_BLOCK_K = gl.constexpr(GROUP)  # one weight scale block, one activation group
# Triton 3.9 renamed the TMA load; 3.6 (the GPU machines') and 3.7 (what users run) have the old name.
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


@gluon.jit
def _producer(a_desc, w_desc, a0_bufs, a1_bufs, w_bufs, ready, empty, off_m, off_n, num_k, STAGES: gl.constexpr):
    """One warp: K block ``kb``'s two activation halves and weight tile into stage ``kb % STAGES`` once
    both consumers have released that stage's previous block."""
    for kb in range(num_k):
        s = kb % STAGES
        mbarrier.wait(empty.index(s), ((kb // STAGES) & 1) ^ 1)  # (a fresh barrier passes parity 1)
        mbarrier.expect(ready.index(s), 2 * a_desc.block_type.nbytes + w_desc.block_type.nbytes)
        _tma_load(a_desc, [off_m, kb * _BLOCK_K], ready.index(s), a0_bufs.index(s))
        _tma_load(a_desc, [off_m + a_desc.block_type.shape[0], kb * _BLOCK_K], ready.index(s), a1_bufs.index(s))
        _tma_load(w_desc, [off_n, kb * _BLOCK_K], ready.index(s), w_bufs.index(s))


@gluon.jit
def _consumer(a_bufs, w_bufs, total_smem, ready, empty, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, num_k, blocks_per_chunk,
              stride_xs, stride_ws, stride_ym, off_m, off_n,
              HALF_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
    """One warpgroup: rows ``off_m .. off_m + HALF_M`` of the tile, every K block, then the store."""
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 32])
    offs_m = off_m + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
    offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    row_ok = offs_m < M
    n_ok = offs_n < N
    xs_rows = xs_ptr + offs_m.to(gl.int64) * stride_xs
    ws_cols = ws_ptr + (offs_n // _BLOCK_K) * stride_ws
    total_smem.store(gl.zeros([HALF_M, BLOCK_N], gl.float32, layout))
    acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    for kb in range(num_k):
        s = kb % STAGES
        sa = gl.load(xs_rows + kb, mask=row_ok, other=0.0)
        sb = gl.load(ws_cols + kb, mask=n_ok, other=0.0)
        mbarrier.wait(ready.index(s), (kb // STAGES) & 1)
        d = warpgroup_mma(a_bufs.index(s), w_bufs.index(s).permute((1, 0)),
                          gl.zeros([HALF_M, BLOCK_N], gl.float32, layout), use_acc=False)
        mbarrier.arrive(empty.index(s), count=1)
        acc = acc + d * (sa[:, None] * sb[None, :])
        if ((kb + 1) % blocks_per_chunk == 0) | (kb + 1 == num_k):  # a chunk's end: its sum joins the total
            total_smem.store(total_smem.load(layout) + acc)
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout)
    total = total_smem.load(layout)
    if HAS_BIAS:
        total += gl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(gl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(gl.int64) * stride_ym + offs_n[None, :]
    gl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@gluon.jit
def _linear_fp8_consumers_kernel(a_desc, w_desc, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, K_CHUNK,
                                 stride_xs, stride_ws, stride_ym,
                                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 HAS_BIAS: gl.constexpr, num_warps: gl.constexpr):
    """Program (row tile, column tile): the first consumer in the kernel's own 4 warps, the second and
    the producer as warp-specialized partitions."""
    HALF_M: gl.constexpr = BLOCK_M // 2
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    a0_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF_M, _BLOCK_K], a_desc.layout)
    a1_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF_M, _BLOCK_K], a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, _BLOCK_K], w_desc.layout)
    sum_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0])
    total0 = gl.allocate_shared_memory(gl.float32, [HALF_M, BLOCK_N], sum_layout)
    total1 = gl.allocate_shared_memory(gl.float32, [HALF_M, BLOCK_N], sum_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a stage
    num_k = gl.cdiv(K, _BLOCK_K)
    blocks_per_chunk = K_CHUNK // _BLOCK_K
    gl.warp_specialize([
        (_consumer, (a0_bufs, w_bufs, total0, ready, empty, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, num_k,
                     blocks_per_chunk, stride_xs, stride_ws, stride_ym, off_m, off_n, HALF_M, BLOCK_N, STAGES, HAS_BIAS)),
        (_consumer, (a1_bufs, w_bufs, total1, ready, empty, xs_ptr, ws_ptr, bias_ptr, y_ptr, M, N, num_k,
                     blocks_per_chunk, stride_xs, stride_ws, stride_ym, off_m + HALF_M, off_n, HALF_M, BLOCK_N, STAGES,
                     HAS_BIAS)),
        (_producer, (a_desc, w_desc, a0_bufs, a1_bufs, w_bufs, ready, empty, off_m, off_n, num_k, STAGES)),
    ], [4, 1], [232, 40])
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


def linear_fp8_two_consumers(a: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                             bias: torch.Tensor | None, y: torch.Tensor, chunk: int, config: dict) -> None:
    """``y = round(a @ weight.T scaled + bias)`` as ``_linear_kernel`` (not split): ``a`` the call's
    e4m3 activations ``[m, k]`` (contiguous, 16-byte aligned rows: TMA), ``xs`` their fp32 group scales,
    ``weight`` e4m3 ``[n, k]`` with ``weight_scale`` per 128 x 128 block, ``chunk`` the layer's K chunk
    (``k_chunk``), ``config`` a ``pick_linear_config`` entry (BLOCK_M, BLOCK_N, num_stages)."""
    m, k = a.shape
    n = weight.shape[0]
    bm, bn, stages = config["BLOCK_M"], config["BLOCK_N"], config["num_stages"]
    if bm != 128 or chunk % GROUP:
        raise ValueError(f"two-consumer tiles are 128 rows tall (64 a warpgroup) with 128-aligned K chunks, got {config}, "
                         f"chunk {chunk}")
    a_layout = gl.NVMMASharedLayout.get_default_for([bm // 2, GROUP], gl.float8e4nv)
    w_layout = gl.NVMMASharedLayout.get_default_for([bn, GROUP], gl.float8e4nv)
    a_desc = TensorDescriptor.from_tensor(a, [bm // 2, GROUP], a_layout)
    w_desc = TensorDescriptor.from_tensor(weight, [bn, GROUP], w_layout)
    _linear_fp8_consumers_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        a_desc, w_desc, xs, weight_scale, bias if bias is not None else y, y, m, n, k, chunk,
        xs.stride(0), weight_scale.stride(0), y.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, STAGES=stages, HAS_BIAS=bias is not None, num_warps=4,
    )
