"""Triton fused MoE with block-scaled FP8 experts (Hopper FP8 tensor cores), one GPU.

Computes the function of ``fp8.fused_moe_fp8_reference`` with the structure of ``cuda/moe.py``
(whose schedule, tile mapping and combine kernels it reuses) in four launches, no host sync:

1. ``_fp8_schedule_quantize_kernel`` -- programs ``< E_local`` run ``cuda.moe``'s prefix-sum
   schedule; the others quantize ``hidden_states`` per token in 1 x 128 groups into ``xq`` (e4m3)
   and ``xs`` (fp32). Quantizing once here instead of in GEMM1's K loop does the division once per
   element instead of once per (element, top-k slot, column tile) -- 128x fewer at DeepSeek-V3
   (K=8, 16 column tiles) -- and halves GEMM1's A-gather bytes; the quantize programs run beside
   the latency-bound schedule programs, so it costs no extra launch.
2. ``_fp8_gemm1_kernel`` -- grouped GEMM over ``w13``: A rows gathered from ``xq`` by token index,
   gate and up rows interleaved into one ``[128, 2*128]`` B tile, and per 128-wide K block
   ``acc += dot(a, b) * xs[row] * w13_scale[col block]`` (the fp8 partial products of one K block
   are scaled in fp32 before they join the accumulator; the tensor core only ever sums 128
   products). Epilogue: gate/up rounded to the input dtype, ``silu(gate) * up`` rounded to the input
   dtype, then quantized per row over the tile's 128 columns -- exactly one activation group, which
   is why GEMM1's column tile is always 128 -- into ``act_q`` (e4m3) and ``act_s`` (fp32).
3. ``_fp8_gemm2_kernel`` -- grouped GEMM over ``w2`` on ``act_q`` with the same per-K-block scaling,
   each output row rounded to the input dtype and scattered to its (token, k) slot of ``y``.
4. ``cuda/moe.py``'s ``_moe_combine_kernel`` -- fp32 weighted top-k sum in k order.

Quantization (both places) is ``fp8.py``'s rounding bit for bit: IEEE division (``tl.div_rn``, not
the approximate ``/``), round to nearest even, NaN propagated into the group's scale.
Batch invariance: BLOCK_K = 128 everywhere, K blocks in increasing order on one fp32 accumulator,
no split-K, block sizes from static shapes only, always wgmma (the token rows on its M side, BLOCK_M
>= 64, or at decode sizes the weight columns: ``SWAP_AB``, the same products and sums). Unrouted slots (-1),
out-of-range ids and non-local experts are masked by the reused schedule/combine kernels; the
schedule kernel reports out-of-range ids to the next call (``bad_ids.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import bad_ids
from ..env import knob
from ..fp8 import BLOCK_SHAPE, FP8_DTYPE, check_fused_moe_fp8_args
from .configs import pick_configs_fp8
from .fp8_tiles import GROUP, fp8_gemm2_tile, quantize_rows, quantize_tile, scaled_block_dot
from .launch import e_pad, gemm_config, interpreting, layer_setup, max_row_tiles, pdl_launch, w2_operand
from .moe import launch_combine, launch_schedule
from .tiles import acc_zeros, cast, expert_tile, grid_dependency, load_cols, load_rows, moe_schedule_kernel, scatter_rows, tile_rows

__all__ = [
    "fused_moe_fp8_triton", "launch_fp8_gemm1", "launch_fp8_gemm2", "launch_fp8_schedule_quantize", "quantize_programs",
]

_GROUP = tl.constexpr(GROUP)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_rows", "tokens"])  # per-call counts, as moe_schedule_kernel
def _fp8_schedule_quantize_kernel(
    topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
    num_rows, num_global, num_local, stride_it, stride_ik,
    x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh,
    TOPK: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK: tl.constexpr, QROWS: tl.constexpr,
    RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    pid = tl.program_id(0)
    if pid < num_local:
        moe_schedule_kernel(
            topk_ids_ptr, expert_map_ptr, counts_ptr, sorted_rows_ptr, report_ptr,
            num_rows, num_global, num_local, stride_it, stride_ik, TOPK, HAS_MAP, BLOCK, False,
        )
    else:
        quantize_tile(pid - num_local, x_ptr, xq_ptr, xs_ptr, tokens, H, stride_xt, stride_xh, QROWS, RNE_FIX)


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm1_kernel(
    xq_ptr, xs_ptr, w_ptr, ws_ptr, actq_ptr, acts_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    IN_DTYPE: tl.constexpr, TOPK: tl.constexpr, E_PAD: tl.constexpr, SCALE_BN: tl.constexpr,
    BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, I, _GROUP, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        tok = (rows // TOPK).to(tl.int64)
        offs_k = tl.arange(0, _GROUP)
        # Columns of the B tile interleave gate row n and up row I + n of w13 (one dot for both).
        offs_j = tl.arange(0, 2 * _GROUP)
        n_j = pid_n * _GROUP + offs_j // 2
        nj_ok = n_j < I
        w_row = n_j + (offs_j % 2) * I
        e64 = e.to(tl.int64)
        a_ptrs = xq_ptr + tok[:, None] * H + offs_k[None, :]
        as_ptrs = xs_ptr + tok * tl.cdiv(H, _GROUP)
        w_ptrs = w_ptr + e64 * stride_we + w_row[None, :] * stride_wn + offs_k[:, None] * stride_wk
        ws_ptrs = ws_ptr + e64 * stride_se + (w_row // SCALE_BN) * stride_sn
        acc = acc_zeros(BLOCK_M, 2 * _GROUP, SWAP_AB)
        for kb in range(0, tl.cdiv(H, _GROUP)):
            k_ok = offs_k < H - kb * _GROUP
            a = load_rows(a_ptrs, row_ok, k_ok, EVEN_K)
            b = load_cols(w_ptrs, nj_ok, k_ok, EVEN_K, EVEN_N)
            sa = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            sb = tl.load(ws_ptrs + kb * stride_sk, mask=nj_ok, other=0.0)
            acc = scaled_block_dot(a, b, sa, sb, acc, SWAP_AB)
            a_ptrs += _GROUP
            w_ptrs += _GROUP * stride_wk
        if SWAP_AB:
            acc = tl.trans(acc)
        # Same rounding points as the reference: gate/up, then SiLU*up, in the input dtype.
        acc_g, acc_u = tl.split(tl.reshape(acc, [BLOCK_M, _GROUP, 2]))
        gate = cast(acc_g, IN_DTYPE, RNE_FIX).to(tl.float32)
        up = cast(acc_u, IN_DTYPE, RNE_FIX).to(tl.float32)
        h = cast(gate / (1.0 + tl.exp(-gate)) * up, IN_DTYPE, RNE_FIX).to(tl.float32)
        offs_n = pid_n * _GROUP + tl.arange(0, _GROUP)
        n_ok = offs_n < I
        act_q, act_s = quantize_rows(tl.where(n_ok[None, :], h, 0.0), RNE_FIX)
        dst = (start_e + offs_m).to(tl.int64)
        tl.store(actq_ptr + dst[:, None] * I + offs_n[None, :], act_q, mask=row_ok[:, None] & n_ok[None, :])
        tl.store(acts_ptr + dst * tl.cdiv(I, _GROUP) + pid_n, act_s, mask=row_ok)


@triton.jit(do_not_specialize=["num_m"])  # per-call tile count
def _fp8_gemm2_kernel(
    actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, y_ptr, sorted_rows_ptr, counts_ptr,
    num_local, H, I, num_m,
    stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
    E_PAD: tl.constexpr, SCALE_BN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, USE_TMA: tl.constexpr, GROUP_M: tl.constexpr,
    SWAP_AB: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr,
):
    grid_dependency(PDL)
    in_use, pid_n, e, m0, count_e, start_e = expert_tile(
        tl.program_id(0), counts_ptr, num_local, num_m, H, BLOCK_N, E_PAD, BLOCK_M, GROUP_M
    )
    if in_use:
        offs_m, row_ok, rows = tile_rows(sorted_rows_ptr, m0, count_e, start_e, BLOCK_M)
        acc, offs_n, n_ok = fp8_gemm2_tile(
            actq_ptr, acts_ptr, w_ptr, w_desc, ws_ptr, e, start_e, offs_m, row_ok, pid_n, H, I,
            stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
            SCALE_BN, BLOCK_M, BLOCK_N, EVEN_K, EVEN_N, USE_TMA, SWAP_AB,
        )
        scatter_rows(acc, rows, row_ok, offs_n, n_ok, y_ptr, H, RNE_FIX)


# ----------------------------------------------------------------------------------------------
# Launch steps (shared by fused_moe_fp8_triton and the expert-parallel workspace in cuda/ep.py)
# ----------------------------------------------------------------------------------------------

QROWS = 32  # tokens per quantization program


def quantize_programs(tokens: int, hidden: int) -> int:
    """Programs of the quantization pass (``quantize_tile``) for ``tokens`` rows of ``hidden``."""
    return triton.cdiv(tokens, QROWS) * triton.cdiv(hidden, GROUP)


def launch_fp8_schedule_quantize(
    x: torch.Tensor,
    xq: torch.Tensor,
    xs: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    counts: torch.Tensor,
    sorted_rows: torch.Tensor,
    num_local: int,
    num_global: int,
    *,
    pdl: bool | None = None,
    interpret: bool,
) -> None:
    """Launch 1: ``cuda.moe``'s schedule over ``topk_ids`` (programs ``< num_local``) and the
    per-token 1 x 128 quantization of ``x`` into ``xq`` / ``xs`` (the other programs)."""
    tokens, hidden = x.shape
    launch_schedule(
        topk_ids, expert_map, counts, sorted_rows, num_local, num_global,
        kernel=_fp8_schedule_quantize_kernel, extra_programs=quantize_programs(tokens, hidden),
        extra_args=(x, xq, xs, tokens, hidden, x.stride(0), x.stride(1)), QROWS=QROWS, RNE_FIX=interpret,
        pdl=pdl,
    )


def launch_fp8_gemm1(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    act_q: torch.Tensor,
    act_s: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    top_k: int,
    config: dict,
    *,
    pdl: bool | None = None,
    in_dtype: torch.dtype,
    scale_bn: int,
    interpret: bool,
) -> None:
    """``_fp8_gemm1_kernel``: for the ``i``-th scheduled row ``t * top_k + k`` (``rows`` of them at
    most), ``silu(gate) * up`` of quantized token row ``xq[t]`` (scales ``xs[t]``; both contiguous
    ``[*, H]`` / ``[*, cdiv(H, 128)]``), rounded as ``in_dtype``, quantized into ``act_q[i]`` /
    ``act_s[i]``. ``config`` is GEMM1's entry of ``pick_configs_fp8``; ``w13`` has >= 1 expert."""
    num_local, two_i, hidden = w13.shape
    inter = two_i // 2
    g = dict(config)
    g.setdefault("GROUP_M", 1)
    g.setdefault("SWAP_AB", False)
    num_m = max_row_tiles(rows, num_local, g["BLOCK_M"])
    _fp8_gemm1_kernel[(num_m * triton.cdiv(inter, GROUP),)](
        xq, xs, w13, w13_scale, act_q, act_s, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w13.stride(0), w13.stride(1), w13.stride(2), w13_scale.stride(0), w13_scale.stride(1), w13_scale.stride(2),
        IN_DTYPE=_TL_DTYPES[in_dtype], TOPK=top_k, E_PAD=e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=hidden % GROUP == 0, EVEN_N=inter % GROUP == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl, interpret), **g,
    )


def launch_fp8_gemm2(
    act_q: torch.Tensor,
    act_s: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    y: torch.Tensor,
    sorted_rows: torch.Tensor,
    counts: torch.Tensor,
    rows: int,
    config: dict,
    *,
    pdl: bool | None = None,
    scale_bn: int,
    interpret: bool,
    kernel=None,
    extra_args: tuple = (),
    **extra_constexprs,
) -> None:
    """``_fp8_gemm2_kernel``: ``y[row] = dequant(act_q[i]) @ dequant(w2[e]).T`` rounded to ``y``'s
    dtype, for the ``i``-th scheduled row. ``kernel`` replaces it by a kernel with the same leading
    parameters (the expert-parallel push epilogue), ``extra_args`` / ``extra_constexprs`` its own."""
    num_local, hidden, inter = w2.shape
    g = gemm_config(config, act_q, interpret, GROUP_M=1, SWAP_AB=False)
    bn = g["BLOCK_N"]
    w2_desc = w2_operand(w2, g, GROUP)
    num_m = max_row_tiles(rows, num_local, g["BLOCK_M"])
    (_fp8_gemm2_kernel if kernel is None else kernel)[(num_m * triton.cdiv(hidden, bn),)](
        act_q, act_s, w2, w2_desc, w2_scale, y, sorted_rows, counts,
        num_local, hidden, inter, num_m,
        w2.stride(0), w2.stride(1), w2.stride(2), w2_scale.stride(0), w2_scale.stride(1), w2_scale.stride(2),
        *extra_args,
        E_PAD=e_pad(num_local), SCALE_BN=scale_bn,
        EVEN_K=inter % GROUP == 0, EVEN_N=hidden % bn == 0, RNE_FIX=interpret, **pdl_launch(act_q, pdl, interpret),
        **extra_constexprs, **g,
    )


# ----------------------------------------------------------------------------------------------
# Launcher
# ----------------------------------------------------------------------------------------------


def fused_moe_fp8_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
    block_shape=BLOCK_SHAPE,
    pdl: bool | None = None,
    configs: tuple[dict, dict] | None = None,
) -> torch.Tensor:
    """The FP8 MoE layer's routed experts (see ``fp8.py``) in four Triton launches.

    No host synchronisation: ids' values are checked by the schedule kernel, as in
    ``fused_moe_triton``, and ``pdl`` as there. ``configs`` overrides the block sizes (benchmark sweeps).
    """
    bad_ids.raise_if_reported(hidden_states.device)
    bn_scale, bk_scale = check_fused_moe_fp8_args(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation,
        block_shape, check_values=False,
    )
    if bk_scale != GROUP:
        raise ValueError(f"the Triton FP8 kernels need a K block of {GROUP} (block_shape[1]), got {bk_scale}")
    out, layer = layer_setup(hidden_states, w13, topk_ids, expert_map)
    if layer is None:
        return out
    tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows = layer
    dtype, dev = hidden_states.dtype, hidden_states.device
    interpret = interpreting()
    pdl = knob("pdl", pdl)
    xq = torch.empty((tokens, hidden), dtype=FP8_DTYPE, device=dev)
    xs = torch.empty((tokens, triton.cdiv(hidden, GROUP)), dtype=torch.float32, device=dev)
    act_q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=dev)
    act_s = torch.empty((rows, triton.cdiv(inter, GROUP)), dtype=torch.float32, device=dev)
    y = torch.empty((rows, hidden), dtype=dtype, device=dev)

    launch_fp8_schedule_quantize(
        hidden_states, xq, xs, topk_ids, expert_map, counts, sorted_rows, num_local, num_global, interpret=interpret, pdl=pdl
    )
    g1, g2 = configs if configs is not None else pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    launch_fp8_gemm1(
        xq, xs, w13, w13_scale, act_q, act_s, sorted_rows, counts, rows, top_k, g1,
        in_dtype=dtype, scale_bn=bn_scale, interpret=interpret, pdl=pdl,
    )
    launch_fp8_gemm2(act_q, act_s, w2, w2_scale, y, sorted_rows, counts, rows, g2, scale_bn=bn_scale, interpret=interpret, pdl=pdl)
    launch_combine(y, out, topk_ids, topk_weights, expert_map, num_local, num_global, interpret=interpret, pdl=pdl)
    return out
