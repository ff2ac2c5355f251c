"""Batch-invariant RMSNorm on CUDA (``invariant_rms_norm``; the function is in ``../norm.py``): one
program per row, the whole row in registers, its square sum by one ``tl.sum`` whose tree depends on
the row length alone (the block and warp count are functions of H)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..norm import check_rms_norm_args
from .launch import interpreting, pdl_launch
from .tiles import cast, grid_dependency

__all__ = ["invariant_rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, z_ptr, H, eps, stride_x, stride_r, stride_y, stride_z,
                     BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     RNE_FIX: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    z = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=ok, other=0.0)
        z = cast(z.to(tl.float32) + r.to(tl.float32), z_ptr.dtype.element_ty, RNE_FIX)
        tl.store(z_ptr + row * stride_z + cols, z, mask=ok)
    zf = z.to(tl.float32)
    y = zf * tl.rsqrt(tl.sum(zf * zf, axis=0) / H + eps)
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, cast(y, y_ptr.dtype.element_ty, RNE_FIX), mask=ok)


def invariant_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                              residual: torch.Tensor | None = None, *, pdl: bool | None = None):
    """(y, z) as ``rms_norm_reference``; z is an empty tensor without a residual."""
    check_rms_norm_args(x, weight, residual)
    h = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    x2 = x.reshape(rows, h)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty((rows, h), dtype=x.dtype, device=x.device)
    z = torch.empty((rows, h) if residual is not None else (0,), dtype=x.dtype, device=x.device)
    if rows == 0:
        return y.view(x.shape), z.view(x.shape) if residual is not None else z
    r2 = residual.reshape(rows, h).contiguous() if residual is not None else x2
    w = weight.contiguous() if weight is not None else x2
    block = triton.next_power_of_2(h)
    interpret = interpreting()
    _rms_norm_kernel[(rows,)](
        x2, r2, w, y, z if residual is not None else y, h, eps, x2.stride(0), r2.stride(0), y.stride(0),
        h if residual is not None else 0,
        BLOCK=block, HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None, RNE_FIX=interpret,
        num_warps=4 if block <= 1024 else 8 if block <= 4096 else 16, **pdl_launch(y, pdl, interpret),
    )
    return y.view(x.shape), (z.view(x.shape) if residual is not None else z)
