"""Batch-invariant RMSNorm on CUDA (``invariant_rms_norm``; the function is in ``../norm.py``): a
program normalizes ``rows_per_program(H)`` whole rows in registers, each row's square sum by one
``tl.sum`` whose tree depends on the row length alone (rows per program, block and warp count are
functions of H)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..norm import check_rms_norm_args
from .launch import interpreting, pdl_launch
from .tiles import cast, grid_dependency

__all__ = ["invariant_rms_norm_triton"]


@triton.jit(do_not_specialize=["n_rows"])  # per-call row count: one compile for every count
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, z_ptr, n_rows, H, eps, heads, stride_x, stride_xh, stride_r, stride_y,
                     stride_z, ROWS: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     HAS_WEIGHT: tl.constexpr, RNE_FIX: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < H)[None, :]
    # x's row r is head r % heads of token r // heads: per-head q/k norms read the heads in place
    # from the fused qkv output (heads = 1 elsewhere).
    x_rows = (rows // heads) * stride_x + (rows % heads) * stride_xh
    z = tl.load(x_ptr + x_rows[:, None] + cols[None, :], mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + rows[:, None] * stride_r + cols[None, :], mask=ok, other=0.0)
        z = cast(z.to(tl.float32) + r.to(tl.float32), z_ptr.dtype.element_ty, RNE_FIX)
        tl.store(z_ptr + rows[:, None] * stride_z + cols[None, :], z, mask=ok)
    zf = z.to(tl.float32)
    y = zf * tl.rsqrt(tl.sum(zf * zf, axis=1) / H + eps)[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty, RNE_FIX), mask=ok)


def rows_per_program(h: int) -> int:
    """Rows a program normalizes: short rows (per-head q/k norms, 128 wide) share a program so that
    each has 2048 elements; a function of H alone, as the sum tree (the tile's layout) must be."""
    return max(1, 2048 // triton.next_power_of_2(h))


def _token_head_view(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[tokens, heads, H]`` with unit column stride. Per-head rows of a wider row (the q
    or k heads of a fused qkv output: tokens strided by the qkv width) stay a view with their heads;
    anything else is one row per token (a view where the rows merge, else a contiguous copy), so
    ``heads`` is 1 or a layer's head count, never a per-call size."""
    h = x.shape[-1]
    if x.dim() >= 3 and x.stride(-1) == 1 and not x.is_contiguous():
        try:
            return x.view(-1, x.shape[-2], h)
        except RuntimeError:  # leading dimensions that do not merge without a copy
            pass
    x2 = x.reshape(-1, h)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()).view(-1, 1, h)


def invariant_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                              residual: torch.Tensor | None = None, *, pdl: bool | None = None):
    """(y, z) as ``rms_norm_reference``; z is an empty tensor without a residual."""
    check_rms_norm_args(x, weight, residual)
    h = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    y = torch.empty((rows, h), dtype=x.dtype, device=x.device)
    z = torch.empty((rows, h) if residual is not None else (0,), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y.view(x.shape), z.view(x.shape) if residual is not None else z
    x3 = _token_head_view(x)
    heads = x3.shape[1]
    r2 = residual.reshape(rows, h).contiguous() if residual is not None else y
    w = weight.contiguous() if weight is not None else y
    block = triton.next_power_of_2(h)
    interpret = interpreting()
    per_program = rows_per_program(h)
    _rms_norm_kernel[(triton.cdiv(rows, per_program),)](
        x3, r2, w, y, z if residual is not None else y, rows, h, eps, heads, x3.stride(0), x3.stride(1), r2.stride(0),
        y.stride(0), h if residual is not None else 0,
        ROWS=per_program, BLOCK=block, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, RNE_FIX=interpret,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16, **pdl_launch(y, pdl, interpret),
    )
    return y.view(x.shape), (z.view(x.shape) if residual is not None else z)
