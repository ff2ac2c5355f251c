"""Reference semantics of the kittens MoE layer, in plain torch, on any device.

Every kittens kernel computes exactly this function (up to floating-point rounding):

    out[t] = sum over k in 0..K-1, in that order, in fp32, of
             topk_weights[t, k] * expert(local(topk_ids[t, k]), hidden_states[t])

    expert(e, x) = w2[e] @ (silu(w13[e, :I] @ x) * (w13[e, I:] @ x))

with vLLM's layouts: ``w13`` is ``[E_local, 2*I, H]`` (gate rows, then up rows) and ``w2`` is
``[E_local, H, I]``. ``topk_ids`` are global expert ids, or -1 for a slot routed nowhere (vLLM's
mark; such a (token, k) row contributes nothing, the token's other experts still count);
``expert_map`` (global -> local, -1 for experts that live on another rank) makes an id local, and
an id that maps to -1 contributes nothing. The activation between the GEMMs and each expert's output are rounded to the input
dtype (as vLLM's kernels do); the top-k sum is fp32 and the result is cast back to the input dtype.

The implementation here sorts (token, k) rows by local expert with a stable sort, so each expert
sees its rows in token order, and runs both GEMMs as one ``torch._grouped_mm`` each (off the
CPU). A row's result must depend only on that row, so that a token's output is bitwise the same
whatever else shares the call. On the CPU the GEMMs run in float32 on exactly upcast operands
(the same function as a bf16/fp16 GEMM with fp32 accumulation): CPUs without native bf16 matmul
convert the weights on every bf16 call. Float32 BLAS picks its kernel by the row count, and the
kernels sum in different orders: on an AVX2 CPU every row count that is a multiple of 8 gave the
same bits, but on an AVX-512 CPU (MKL in torch 2.13) 8 rows and 16 rows already differ once
K >= 256 (measured). So ``rows_mm`` runs every CPU GEMM as GEMMs of exactly 8 rows (each expert's
rows padded to a multiple of 8): a row's bits then come from one fixed GEMM shape, whatever the
batch.
The weights may also be given in float32 on the CPU (an exact upcast copy). ``fused_moe`` on CPU
tensors runs the faster C++ kernel of ``cpu/moe.py``, which computes the same function.
"""

import torch
import torch.nn.functional as F

from . import bad_ids

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SUPPORTED_ACTIVATIONS = ("silu",)


def check_fused_moe_args(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    activation: str,
    *,
    check_values: bool = True,
) -> None:
    """Raise ``ValueError`` naming the first problem with the arguments of ``fused_moe``.

    ``check_values``: also check the values of ``topk_ids`` and ``expert_map``
    (``check_id_values``); the CUDA kernels pass False.
    """
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"activation {activation!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}")
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be 2-D [tokens, hidden], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"hidden_states dtype {hidden_states.dtype} is not one of {SUPPORTED_DTYPES}")
    tokens, hidden = hidden_states.shape
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be [E, 2*I, H] and w2 [E, H, I]; got w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}"
        )
    num_local, two_i, w13_hidden = w13.shape
    if two_i % 2:
        raise ValueError(f"w13 dim 1 (2*I) must be even, got {two_i}")
    if w13_hidden != hidden:
        raise ValueError(f"w13 hidden size {w13_hidden} != hidden_states hidden size {hidden}")
    if tuple(w2.shape) != (num_local, hidden, two_i // 2):
        raise ValueError(
            f"w2 shape {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}: expected "
            f"{(num_local, hidden, two_i // 2)}"
        )
    weight_dtypes = (hidden_states.dtype, torch.float32) if hidden_states.device.type == "cpu" else (hidden_states.dtype,)
    if w13.dtype not in weight_dtypes or w2.dtype not in weight_dtypes:
        raise ValueError(
            f"weights must have the dtype of hidden_states ({hidden_states.dtype}, or float32 on the CPU); "
            f"got w13 {w13.dtype}, w2 {w2.dtype}"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids must be [tokens={tokens}, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_weights shape {tuple(topk_weights.shape)} != topk_ids shape {tuple(topk_ids.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if expert_map is not None:
        if expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"expert_map must be a 1-D int32/int64 tensor, got {expert_map.dtype} {tuple(expert_map.shape)}"
            )
    tensors = {"w13": w13, "w2": w2, "topk_weights": topk_weights, "topk_ids": topk_ids}
    if expert_map is not None:
        tensors["expert_map"] = expert_map
    for name, t in tensors.items():
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device} but hidden_states is on {hidden_states.device}")
    if check_values:
        check_id_values(topk_ids, expert_map, num_local)


def _outside(values: torch.Tensor, lo: int, end: int) -> tuple[int, int] | None:
    """The smallest and largest of ``values`` outside ``[lo, end)``, or None."""
    bad = values[(values < lo) | (values >= end)]
    return (int(bad.min()), int(bad.max())) if bad.numel() else None


def check_id_values(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int) -> None:
    """Raise ``ValueError`` for top-k ids outside ``[-1, E_global)`` (-1: no expert) or expert_map
    values outside ``[-1, E_local)``. Reads the values: on CUDA tensors a synchronisation, so the
    CUDA kernels skip this and report bad values themselves (``bad_ids.py``)."""
    num_global = expert_map.numel() if expert_map is not None else num_local
    found = _outside(topk_ids, -1, num_global)
    if found:
        raise ValueError(bad_ids.out_of_range_message(bad_ids.TOPK_IDS, *found, num_global))
    found = _outside(expert_map, -1, num_local) if expert_map is not None else None
    if found:
        raise ValueError(bad_ids.out_of_range_message(bad_ids.EXPERT_MAP, *found, num_local))


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Local expert id of every (token, k) row, flattened; -1 where the expert lives elsewhere or the
    row is unrouted (id -1). Ids must be in ``[-1, E_global)``."""
    ids = topk_ids.reshape(-1).long()
    if expert_map is None:
        return ids
    return torch.where(ids >= 0, expert_map.long()[ids.clamp(min=0)], -1)


def combine_topk(expert_out: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Sum ``expert_out`` ``[T, K, H]`` over k in fixed k order, in fp32, weighted."""
    weighted = expert_out.float() * topk_weights.float().unsqueeze(-1)
    out = torch.zeros(expert_out.shape[0], expert_out.shape[2], dtype=torch.float32, device=expert_out.device)
    for k in range(expert_out.shape[1]):
        out += weighted[:, k]
    return out


ROW_ALIGN_CPU = 8


def rows_mm(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``a @ w.T`` (``a`` with at least one row). On the CPU as GEMMs of exactly ``ROW_ALIGN_CPU``
    rows, ``a``'s rows zero-padded to a multiple of it, so that a row's bits do not depend on how
    many rows share the call (see the module docstring); elsewhere as one GEMM."""
    if a.device.type != "cpu":
        return a @ w.t()
    rows = a.shape[0]
    padded = F.pad(a, (0, 0, 0, -rows % ROW_ALIGN_CPU))
    return torch.cat([torch.mm(chunk, w.t()) for chunk in padded.split(ROW_ALIGN_CPU)])[:rows]


def _grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``a``'s block of rows of expert ``e`` (ending at ``ends[e]``) times ``w[e].T``. On the CPU
    by ``rows_mm``: the blocks start at multiples of ``ROW_ALIGN_CPU`` rows there, so its GEMMs
    never mix experts."""
    if a.device.type != "cpu":
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    bounds = [0, *ends.tolist()]
    return torch.cat([rows_mm(a[start:end], w[e]) for e, (start, end) in enumerate(zip(bounds, bounds[1:]))
                      if end > start])


def run_experts(
    x: torch.Tensor, row_token: torch.Tensor, row_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Expert output of each row: row i is ``x[row_token[i]]`` through local expert ``row_expert[i]``.

    Returns ``[rows, H]`` in ``x``'s dtype; rows whose expert is -1 (not local) are zero. The rows
    are sorted by expert with a stable sort so each expert sees its rows in their given order.
    """
    num_local = w13.shape[0]
    on_cpu = x.device.type == "cpu"
    compute_dtype = torch.float32 if on_cpu else x.dtype
    align = ROW_ALIGN_CPU if on_cpu else 1
    # Rows of experts that live elsewhere (-1) sort after every local expert and are dropped.
    sort_key = row_expert.remainder(num_local + 1)
    order = torch.argsort(sort_key, stable=True)
    counts = torch.bincount(sort_key, minlength=num_local + 1)[:num_local]
    rows = order[: int(counts.sum())]
    out = torch.zeros(row_token.numel(), x.shape[1], dtype=x.dtype, device=x.device)
    if not rows.numel():
        return out
    # Each expert's block of rows starts at a multiple of `align` in the GEMM operands: `pad`
    # empty rows follow each block.
    pad = (counts + align - 1) // align * align - counts
    offsets = torch.cumsum(counts + pad, 0)
    dest = torch.arange(rows.numel(), device=x.device) + (torch.cumsum(pad, 0) - pad)[sort_key[rows]]
    a = torch.zeros(int(offsets[-1]), x.shape[1], dtype=compute_dtype, device=x.device)
    a[dest] = x[row_token[rows]].to(compute_dtype)
    offsets = offsets.to(torch.int32)
    # Both GEMM outputs are rounded to x's dtype, as a GEMM in that dtype would return them.
    gate_up = _grouped_mm(a, w13.to(compute_dtype), offsets)
    gate, up = gate_up.to(x.dtype).float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(x.dtype).to(compute_dtype)
    y = _grouped_mm(act, w2.to(compute_dtype), offsets)
    out[rows] = y[dest].to(x.dtype)
    return out


def fused_moe_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """The MoE layer's routed experts, ``[T, H]`` in the input dtype (see the module docstring)."""
    check_fused_moe_args(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation)
    tokens, hidden = hidden_states.shape
    top_k = topk_ids.shape[1]
    row_token = torch.arange(tokens * top_k, device=hidden_states.device) // top_k
    rows = run_experts(hidden_states, row_token, local_expert_ids(topk_ids, expert_map), w13, w2)
    return combine_topk(rows.view(tokens, top_k, hidden), topk_weights).to(hidden_states.dtype)
