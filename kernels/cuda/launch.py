"""Host-side launch helpers of the CUDA kernels, shared by ``moe.py``, ``moe_fp8.py`` and ``ep.py``:
programmatic dependent launch keywords, TMA operands, GEMM config defaults, the per-call setup and
grid bounds. No kernels here; the knobs come from ``..env`` at call time."""

from __future__ import annotations

import functools

import torch
import triton

from ..env import knob

__all__ = [
    "cc_major", "check_heavy_m", "descriptor", "e_pad", "gemm_config", "interpreting", "layer_setup", "max_row_tiles",
    "pdl_launch", "tma_ok", "w13_operand", "w2_operand",
]


def max_row_tiles(rows: int, num_local: int, block_m: int) -> int:
    # sum_e ceil(c_e / BM) <= floor(sum_e c_e / BM) + (number of non-empty experts). Heavy tiles
    # (``HEAVY_M``, a multiple of BM) only make fewer.
    return rows // block_m + min(num_local, rows)


def check_heavy_m(config: dict) -> None:
    """``HEAVY_M`` (hot experts' tile height) is 0 (off) or a multiple of ``BLOCK_M`` above it."""
    heavy_m, bm = config.get("HEAVY_M", 0), config["BLOCK_M"]
    if heavy_m and (heavy_m % bm or heavy_m <= bm):
        raise ValueError(f"HEAVY_M must be a multiple of BLOCK_M above it: {config}")


def descriptor(t2d: torch.Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t2d, block)


def tma_ok(t: torch.Tensor) -> bool:
    """Whether TMA can read ``t`` as the 2-D (or reshaped) views here: contiguous, 16-byte aligned
    start and rows."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0 and (t.shape[-1] * t.element_size()) % 16 == 0


def interpreting() -> bool:
    return knob("interpret")


@functools.lru_cache(maxsize=None)
def cc_major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def pdl_launch(t: torch.Tensor, pdl: bool | None = None, interpret: bool | None = None) -> dict:
    """The launch keywords of a kernel on ``t``'s device: ``PDL`` (the kernel's constexpr) and
    ``launch_pdl``, both on for compiled code on Hopper and newer when ``pdl`` is (default: the
    ``pdl`` knob, ``MOK_PDL``, read now; programmatic dependent launch for every kernel of a call,
    see ``grid_dependency``). ``interpret``: the call's ``interpreting()``, read now if not given."""
    on = knob("pdl", pdl) and t.is_cuda and not knob("interpret", interpret) and cc_major(t.device.index or 0) >= 9
    return dict(PDL=on, launch_pdl=on)


def gemm_config(config: dict, act: torch.Tensor, interpret: bool, **defaults) -> dict:
    """A copy of a ``pick_configs`` entry with its defaults filled in. TMA needs compiled code,
    contiguous weights and 16-byte aligned rows: it stays off under the interpreter, off the GPU
    and for fp32 data here, and the launchers turn it off for weights ``tma_ok`` rejects."""
    g = dict(config)
    for key, value in defaults.items():
        g.setdefault(key, value)
    g["USE_TMA"] = bool(g.get("USE_TMA", False)) and not interpret and act.is_cuda and act.dtype != torch.float32
    return g


def w13_operand(w13: torch.Tensor, g: dict):
    """GEMM1's weight operand for config ``g``: a TMA descriptor of ``w13`` viewed as [E, 2, I, H]
    (one box holds a column tile's gate rows then its up rows), or ``w13`` itself for pointer loads
    (``g["USE_TMA"]`` is turned off where TMA cannot read it)."""
    if g["USE_TMA"]:
        if tma_ok(w13):
            num_local, two_i, hidden = w13.shape
            return descriptor(w13.view(num_local, 2, two_i // 2, hidden), [1, 2, g["BLOCK_N"], g["BLOCK_K"]])
        g["USE_TMA"] = False
    return w13


def w2_operand(w2: torch.Tensor, g: dict, block_k: int):
    """GEMM2's weight operand (bf16 or FP8), as ``w13_operand``: a TMA descriptor of ``w2`` viewed
    as [E*H, I] with [BLOCK_N, block_k] boxes, or ``w2``."""
    if g["USE_TMA"]:
        if tma_ok(w2):
            num_local, hidden, inter = w2.shape
            return descriptor(w2.view(num_local * hidden, inter), [g["BLOCK_N"], block_k])
        g["USE_TMA"] = False
    return w2


def e_pad(num_local: int) -> int:
    return max(16, triton.next_power_of_2(num_local))


def layer_setup(hidden_states: torch.Tensor, w13: torch.Tensor, topk_ids: torch.Tensor, expert_map):
    """What a Triton MoE layer call starts with (bf16 or FP8 experts): ``(out, None)`` where the
    freshly allocated ``out`` is already the answer (no tokens: empty; no top-k, experts or
    intermediate columns: zeros), else ``(out, (tokens, hidden, num_local, inter, top_k, rows,
    num_global, counts, sorted_rows))`` with the schedule's two buffers allocated after ``out``."""
    tokens, hidden = hidden_states.shape
    num_local, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    dev = hidden_states.device
    out = torch.empty((tokens, hidden), dtype=hidden_states.dtype, device=dev)
    if tokens == 0:
        return out, None
    if top_k == 0 or num_local == 0 or inter == 0:
        return out.zero_(), None
    rows = tokens * top_k
    num_global = expert_map.numel() if expert_map is not None else num_local
    counts = torch.empty(num_local, dtype=torch.int32, device=dev)
    sorted_rows = torch.empty(rows, dtype=torch.int32, device=dev)
    return out, (tokens, hidden, num_local, inter, top_k, rows, num_global, counts, sorted_rows)
