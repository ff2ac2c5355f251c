"""The batch-invariant dense layer: ``y = x @ w.T (+ bias)`` whose rows never depend on the batch.

A deterministic server needs every dense layer (attention projections, shared experts, router,
LM head) to give a token's row the same bits whatever else shares the step. cuBLAS picks kernels
and split-K factors by the row count, so it does not; vLLM's batch-invariant mode runs one fixed
128x128 Triton tile for every row count instead, which wastes most of each tile at decode sizes.

The function (what every implementation here computes, bit for bit on one device):

    out[m, n] = round( P_0 + P_1 + ... + P_{C-1} (+ bias[n]) )

where ``P_c = sum_{k in chunk c} x[m, k] * w[n, k]`` is accumulated in fp32 in increasing ``k``,
the chunks are consecutive runs of ``k_chunk(N, K)`` columns of K, their sums are added in chunk
order starting from ``P_0`` (no ``0 +``, so a row of -0.0 stays -0.0), the bias is added in fp32
and ``round`` is one rounding to the input dtype. The chunk length depends on the weight's shape
alone, never on the row count: that is what lets a decode-sized call spread a narrow weight over
all SMs (one program per chunk and column tile, chunk sums added afterwards in chunk order) while
a prefill-sized call adds the same chunk sums inside each program.

Block FP8 (``invariant_linear_fp8``, the dense layers of DeepSeek-V3-style checkpoints: e4m3 weights
with one fp32 scale per 128 x 128 block): ``x`` is first quantized per token in groups of 128
columns (``fp8.quantize_fp8_groups``), and each K block ``b`` of 128 columns contributes
``D_b * xs[m, b] * ws[n // 128, b]`` with ``D_b`` the fp32 sum of its 128 e4m3 products; a chunk's
sum ``P_c`` adds its blocks' contributions in K order to 0. The chunks, their order, the bias and
the rounding are as above.

On CUDA the Triton kernels of ``cuda/linear.py`` compute it (each output element chains the same
16-deep wgmma k-steps on one fp32 accumulator per chunk, whatever the tile; ``cuda/configs.py``);
elsewhere ``invariant_linear_reference`` below, whose GEMMs run as fixed 8-row GEMMs on the CPU
(``reference.rows_mm``).
"""

import math

import torch

from .reference import rows_mm

__all__ = ["K_CHUNK_ALIGN", "check_linear_args", "check_linear_fp8_args", "invariant_linear_fp8_reference",
           "invariant_linear_reference", "k_chunk"]

FP8_BLOCK = 128  # the weights' scale block (both sides) and the activations' quantization group

# Chunk lengths are multiples of every K block the kernels use, so no K block straddles two chunks.
K_CHUNK_ALIGN = 128
# The fewest columns of K a chunk has (shorter chunks would cost more in partial sums than they
# gain in programs), and the target number of (column tile, chunk) programs: two per SM of an
# H100/H200 SXM (132 SMs), a constant so that the function is the same on every device.
_MIN_CHUNK = 512
_TARGET_PROGRAMS = 2 * 132
_DECODE_COLUMNS = 64


def k_chunk(n: int, k: int) -> int:
    """Length of the K chunks of a weight ``[n, k]`` (``k`` when there is a single chunk).

    Chunks double while a decode-sized call (64-column tiles) has at most ``_TARGET_PROGRAMS``
    (column tile, chunk) programs and each chunk keeps ``_MIN_CHUNK`` columns or more: a narrow
    weight (few column tiles, long K, such as an attention output projection) is then read by
    every SM instead of a few.
    """
    if n < 1 or k < 1:
        raise ValueError(f"k_chunk needs a non-empty weight, got [{n}, {k}]")
    tiles = -(-n // _DECODE_COLUMNS)
    chunks = 1
    while tiles * chunks * 2 <= _TARGET_PROGRAMS and k // (chunks * 2) >= _MIN_CHUNK:
        chunks *= 2
    if chunks == 1:
        return k
    per_chunk = -(-k // chunks)
    return -(-per_chunk // K_CHUNK_ALIGN) * K_CHUNK_ALIGN


def check_linear_args(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming what is wrong with the arguments of ``invariant_linear``."""
    if x.dim() < 1:
        raise ValueError(f"x must have at least one dimension (..., K), got shape {list(x.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {list(weight.shape)}")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal weight's K ({weight.shape[1]})")
    if not x.is_floating_point() or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must equal x's ({x.dtype})")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, x on {x.device}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must be [N] = [{weight.shape[0]}], got shape {list(bias.shape)}")
        if bias.device != x.device:
            raise ValueError(f"bias is on {bias.device}, x on {x.device}")
        if not bias.is_floating_point():
            raise ValueError(f"bias must be floating point, got {bias.dtype}")


def invariant_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The function of the module docstring in plain torch (any device): ``[..., N]`` in ``x``'s dtype."""
    check_linear_args(x, weight, bias)
    n, k = weight.shape
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    out_shape = (*x.shape[:-1], n)
    if rows.shape[0] == 0 or n == 0:
        return x.new_empty(out_shape)
    if k == 0:
        total = torch.zeros((rows.shape[0], n), dtype=torch.float32, device=x.device)
    else:
        step = k_chunk(n, k)
        total = None
        for k0 in range(0, k, step):
            part = rows_mm(rows[:, k0 : k0 + step].float(), weight[:, k0 : k0 + step].float())
            total = part if total is None else total + part
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype).reshape(out_shape)


def check_linear_fp8_args(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                          bias: torch.Tensor | None) -> None:
    """Raise ``ValueError`` naming what is wrong with the arguments of ``invariant_linear_fp8``."""
    if x.dim() < 1 or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"x must be bfloat16 or float16 with shape [..., K], got {x.dtype} {list(x.shape)}")
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"weight must be float8_e4m3fn [N, K], got {weight.dtype} {list(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal weight's K ({k})")
    blocks = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if weight_scale.dtype != torch.float32 or tuple(weight_scale.shape) != blocks:
        raise ValueError(f"weight_scale must be float32 {list(blocks)} (one per {FP8_BLOCK}x{FP8_BLOCK} block), "
                         f"got {weight_scale.dtype} {list(weight_scale.shape)}")
    for name, t in (("weight", weight), ("weight_scale", weight_scale), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}")
    if bias is not None and (bias.shape != (n,) or not bias.is_floating_point()):
        raise ValueError(f"bias must be floating point [N] = [{n}], got {bias.dtype} {list(bias.shape)}")


def invariant_linear_fp8_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The block-FP8 function of the module docstring in plain torch (any device): ``[..., N]`` in
    ``x``'s dtype."""
    from .fp8 import quantize_fp8_groups

    check_linear_fp8_args(x, weight, weight_scale, bias)
    n, k = weight.shape
    rows = x.reshape(math.prod(x.shape[:-1]), k)
    out_shape = (*x.shape[:-1], n)
    if rows.shape[0] == 0 or n == 0:
        return x.new_empty(out_shape)
    xq, xs = quantize_fp8_groups(rows, FP8_BLOCK)
    ws = weight_scale.repeat_interleave(FP8_BLOCK, 0)[:n]  # [N, K blocks]
    step = k_chunk(n, k) if k else 1
    total = torch.zeros((rows.shape[0], n), dtype=torch.float32, device=x.device) if k == 0 else None
    for k0 in range(0, k, step):
        part = torch.zeros((rows.shape[0], n), dtype=torch.float32, device=x.device)
        for b0 in range(k0, min(k0 + step, k), FP8_BLOCK):
            b = b0 // FP8_BLOCK
            d = rows_mm(xq[:, b0 : b0 + FP8_BLOCK].float(), weight[:, b0 : b0 + FP8_BLOCK].float())
            part = part + d * (xs[:, b : b + 1] * ws[:, b][None, :])  # as the kernels: D_b * (xs * ws)
        total = part if total is None else total + part
    if bias is not None:
        total = total + bias.float()
    return total.to(x.dtype).reshape(out_shape)
