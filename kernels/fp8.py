"""Block-scaled FP8 experts (DeepSeek-V3 / Kimi-K2 checkpoints): quantization helpers and the
reference semantics of the FP8 MoE layer, in plain torch, on any device.

Format. Expert weights are ``torch.float8_e4m3fn`` with one fp32 scale per ``block_shape``
(default 128 x 128) block of each expert's ``[N, K]`` matrix (the checkpoints' ``weight_scale_inv``:
multiply to dequantize). Activations are quantized dynamically per token in groups of
``block_shape[1]`` columns (the weights' K block), one fp32 scale per group.

Rounding (the same in the Triton kernels, bit for bit): ``scale = max(amax, AMAX_FLOOR) / 448``
in fp32, ``q = round_to_nearest_even_e4m3(x / scale)`` with an IEEE fp32 division. ``|x| <= amax``
so ``|x / scale| <= 448`` up to one fp32 rounding, which rounds back to 448: no clamp or saturation
is ever needed. ``AMAX_FLOOR`` keeps the scale of an all-zero (or denormal) group positive and
normal; a NaN anywhere in a group makes its scale NaN, so NaN is never hidden.

``fused_moe_fp8_reference`` computes the function of ``fused_moe_reference`` (reference.py: same
layouts, expert_map, rounding of gate/up, activation and expert outputs to the input dtype, fp32
top-k sum in k order) with FP8 operands:

    xq = quantize per token (1 x 128 groups)(hidden_states)
    gate_up = dequant(xq) @ dequant(w13[e]).T          fp32 accumulation, rounded to the input dtype
    act = silu(gate) * up                              rounded to the input dtype
    y = dequant(quantize per row(act)) @ dequant(w2[e]).T   rounded to the input dtype
"""

import math

import torch
import torch.nn.functional as F

from .reference import check_fused_moe_args, combine_topk, local_expert_ids, rows_mm

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-10
BLOCK_SHAPE = (128, 128)

__all__ = [
    "BLOCK_SHAPE",
    "FP8_DTYPE",
    "as_block_shape",
    "check_fused_moe_fp8_args",
    "dequantize_fp8_blocks",
    "dequantize_fp8_groups",
    "fused_moe_fp8_reference",
    "quantize_fp8_blocks",
    "quantize_fp8_groups",
]


def _blocks_view(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``[..., N, K]`` zero-padded to whole blocks, viewed as ``[..., N/bn, bn, K/bk, bk]``."""
    bn, bk = block
    n, k = t.shape[-2:]
    padded = F.pad(t, (0, -k % bk, 0, -n % bn))
    return padded.view(*t.shape[:-2], padded.shape[-2] // bn, bn, padded.shape[-1] // bk, bk)


def _expand_scale(scale: torch.Tensor, block: tuple[int, int], n: int, k: int) -> torch.Tensor:
    return scale.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., :n, :k]


def quantize_fp8_blocks(w: torch.Tensor, block: tuple[int, int] = BLOCK_SHAPE) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., N, K]`` -> (``q`` e4m3 ``[..., N, K]``, ``scale`` fp32 ``[..., ceil(N/bn), ceil(K/bk)]``)
    with ``w ~= q.float() * scale`` expanded over each ``bn x bk`` block (rounding: module docstring)."""
    n, k = w.shape[-2:]
    amax = _blocks_view(w.float().abs(), block).amax(dim=(-3, -1))
    scale = torch.where(amax < AMAX_FLOOR, AMAX_FLOOR, amax) / FP8_MAX
    q = (w.float() / _expand_scale(scale, block, n, k)).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8_blocks(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = BLOCK_SHAPE) -> torch.Tensor:
    """fp32 ``q * scale``, each scale expanded over its block."""
    return q.float() * _expand_scale(scale, block, *q.shape[-2:])


def quantize_fp8_groups(x: torch.Tensor, group: int = BLOCK_SHAPE[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``x`` ``[T, K]`` in groups of ``group`` columns: (``q`` e4m3
    ``[T, K]``, ``scale`` fp32 ``[T, ceil(K/group)]``). The 1 x group case of ``quantize_fp8_blocks``."""
    return quantize_fp8_blocks(x, (1, group))


def dequantize_fp8_groups(q: torch.Tensor, scale: torch.Tensor, group: int = BLOCK_SHAPE[1]) -> torch.Tensor:
    return dequantize_fp8_blocks(q, scale, (1, group))


def as_block_shape(block_shape) -> tuple[int, int]:
    """``block_shape`` as ``(N block, K block)``; ``ValueError`` unless two positive ints."""
    if (
        not isinstance(block_shape, (tuple, list))
        or len(block_shape) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block_shape)
    ):
        raise ValueError(f"block_shape must be two positive ints (N block, K block), got {block_shape!r}")
    return int(block_shape[0]), int(block_shape[1])


def _shape_stand_in(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor with ``w``'s shape and device and ``dtype``, without memory (one expanded element),
    so reference.py's argument checks apply unchanged to FP8 weights."""
    return torch.empty((), dtype=dtype, device=w.device).expand(w.shape)


def check_fused_moe_fp8_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    block_shape,
    *,
    check_values: bool = True,
) -> tuple[int, int]:
    """``check_fused_moe_args`` for FP8 experts, plus the weights' dtype and the scales' shape,
    dtype and device. Raises ``ValueError`` naming the first problem; returns the block shape."""
    bn, bk = as_block_shape(block_shape)
    if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE:
        raise ValueError(f"FP8 experts need w13 and w2 in {FP8_DTYPE}; got w13 {w13.dtype}, w2 {w2.dtype}")
    check_fused_moe_args(
        hidden_states,
        _shape_stand_in(w13, hidden_states.dtype),
        _shape_stand_in(w2, hidden_states.dtype),
        topk_weights, topk_ids, expert_map, activation, check_values=check_values,
    )
    for name, scale, w in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        expected = (w.shape[0], math.ceil(w.shape[1] / bn), math.ceil(w.shape[2] / bk))
        if scale.dtype != torch.float32:
            raise ValueError(f"{name} must be float32, got {scale.dtype}")
        if tuple(scale.shape) != expected:
            raise ValueError(
                f"{name} shape {tuple(scale.shape)} does not match {name[:-6]} {tuple(w.shape)} with "
                f"{bn}x{bk} blocks: expected {expected}"
            )
        if scale.device != hidden_states.device:
            raise ValueError(f"{name} is on {scale.device} but hidden_states is on {hidden_states.device}")
    return bn, bk


def fused_moe_fp8_reference(
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
) -> torch.Tensor:
    """The FP8 MoE layer's routed experts, ``[T, H]`` in the input dtype (see the module docstring).

    One expert at a time (its weights dequantized to fp32 only while it runs), its rows in token
    order, so a row's result depends on that row alone: batch invariant and deterministic.
    """
    block = check_fused_moe_fp8_args(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map, activation, block_shape
    )
    tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    row_token = torch.arange(tokens * top_k, device=hidden_states.device) // top_k
    rows = fp8_expert_rows(
        hidden_states, row_token, local_expert_ids(topk_ids, expert_map), w13, w2, w13_scale, w2_scale, block
    )
    return combine_topk(rows.view(tokens, top_k, hidden), topk_weights).to(hidden_states.dtype)


def fp8_expert_rows(
    x: torch.Tensor,
    row_token: torch.Tensor,
    row_expert: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    block: tuple[int, int] = BLOCK_SHAPE,
) -> torch.Tensor:
    """Expert output of each row (``[rows, H]`` in x's dtype; zero where the expert is -1): row i
    is ``x[row_token[i]]``, quantized per 1 x 128 group, through local expert ``row_expert[i]``.

    One expert at a time (its weights dequantized to fp32 only while it runs); a row's result
    depends on that row alone, so callers may pass rows in any order (expert parallelism does).
    """
    dtype = x.dtype
    xq = dequantize_fp8_groups(*quantize_fp8_groups(x, block[1]), block[1])
    y = torch.zeros(row_token.numel(), x.shape[1], dtype=dtype, device=x.device)
    for e in row_expert.unique().tolist():
        if e < 0:
            continue
        rows = (row_expert == e).nonzero().squeeze(1)
        gate_up = rows_mm(xq[row_token[rows]], dequantize_fp8_blocks(w13[e], w13_scale[e], block))
        gate, up = gate_up.to(dtype).float().chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(dtype)
        act = dequantize_fp8_groups(*quantize_fp8_groups(act, block[1]), block[1])
        y[rows] = rows_mm(act, dequantize_fp8_blocks(w2[e], w2_scale[e], block)).to(dtype)
    return y
