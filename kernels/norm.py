"""Batch-invariant RMSNorm with the residual add fused: a row's bits never depend on the other rows.

vLLM's batch-invariant mode normalizes with a Triton kernel and, for the residual add, with its
CUDA ``fused_add_rms_norm``, whose thread block (as its public source reads) is 1024 wide below 256
rows and 256 wide above: a row longer than 8 x 256 columns (hidden 4096 or 7168) is then summed in
another order when the step holds more rows, so a token's bits change with the batch. Here one function, whatever the
row count:

    z = round(x + residual)                       (the new residual; z = x without one)
    y = round(z * rsqrt(sum(z^2) / H + eps) * w)  (fp32; without a weight, w = 1)

with ``sum(z^2)`` over the row's H values in fp32 in an order fixed by H alone (the Triton kernel's
reduction tree over one row, ``cuda/norm.py``; elsewhere torch's row sum).
"""

from __future__ import annotations

import torch

__all__ = ["check_rms_norm_args", "rms_norm_reference"]


def check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor | None, residual: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming what is wrong with the arguments of ``invariant_rms_norm``."""
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., H] with H > 0, got shape {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if weight is not None and (weight.shape != (x.shape[-1],) or weight.device != x.device):
        raise ValueError(f"weight must be [H] = [{x.shape[-1]}] on {x.device}, got {list(weight.shape)} on {weight.device}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device):
        raise ValueError(f"residual must match x ({list(x.shape)}, {x.dtype}, {x.device}), got {list(residual.shape)}, "
                         f"{residual.dtype}, {residual.device}")


def rms_norm_reference(x, weight, eps: float, residual=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, z) of the module docstring in plain torch; z is None without a residual."""
    check_rms_norm_args(x, weight, residual)
    z = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    zf = z.float()
    y = zf * torch.rsqrt((zf * zf).sum(-1, keepdim=True) / x.shape[-1] + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype), (None if residual is None else z)
