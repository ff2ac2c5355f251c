"""Expert ids out of range on CUDA: found by the kernels, reported on the host without a synchronisation.

Valid top-k ids are ``-1`` (no expert: vLLM's mark for an unrouted slot; the row contributes
nothing, the token's other experts still count) and global ids in ``[0, E)``; valid expert_map
values are ``-1`` (another rank's expert) and local ids in ``[0, E_local)``. Every CUDA call of
``fused_moe``, ``fused_moe_fp8`` and the expert-parallel workspace runs ``cuda.moe``'s schedule
kernel over its ids, which masks anything else (no memory is read or written through it) and has
its program 0 write the smallest and largest offending value into this device's report: a few
int64 words of pinned host memory, which the kernel writes through unified addressing. No copy,
no launch, nothing to wait for, and the same inside CUDA graphs.

The host reads the report with a plain memory read at the start of every kittens CUDA call that
runs Python (eager calls and CUDA-graph captures) and raises ``ValueError`` naming the values
there; so an error of a call replayed from a graph shows at the next such call. ``check_ids()``
synchronises first and so reports every call issued before it (tests, or a debugging session
that wants the error at the offending call). CPU calls check the values on the host directly.
"""

import ctypes

import torch

NONE, TOPK_IDS, EXPERT_MAP = 0, 1, 2
# int64 words: what was found (NONE, TOPK_IDS or EXPERT_MAP), smallest and largest bad value, bound.
KIND, LO, HI, BOUND = 0, 1, 2, 3
WORDS = 4

_reports: dict[torch.device, tuple[torch.Tensor, ctypes.Array]] = {}


def _report(device: torch.device) -> tuple[torch.Tensor, ctypes.Array]:
    """The tensor the kernels write, and the same memory as a ctypes array: reading a word through
    it costs tens of nanoseconds, a tensor index and ``int()`` a few microseconds."""
    report = _reports.get(device)
    if report is None:
        # Pinned (host memory the GPU writes directly) for CUDA; a plain tensor for the Triton
        # interpreter's CPU runs.
        words = torch.zeros(WORDS, dtype=torch.int64, pin_memory=device.type == "cuda")
        report = _reports[device] = (words, (ctypes.c_int64 * WORDS).from_address(words.data_ptr()))
    return report


def report_words(device: torch.device) -> torch.Tensor:
    """The report the schedule kernel writes for calls on ``device`` (int64 [WORDS], host memory)."""
    return _report(device)[0]


def out_of_range_message(kind: int, lo: int, hi: int, bound: int) -> str:
    """The error for bad values in ``[lo, hi]``; the same text on the CPU (reference.py, cpu_moe.cpp)."""
    if kind == TOPK_IDS:
        return (f"topk_ids out of range: found ids in [{lo}, {hi}] outside the valid range [-1, {bound}) "
                f"(-1: no expert)")
    return f"expert_map values must be -1 or local expert ids in [0, {bound}); found [{lo}, {hi}]"


def raise_if_reported(device: torch.device) -> None:
    """Raise ``ValueError`` if a kernel reported bad ids on ``device`` since the last report (and
    clear it). A plain read of host memory: no synchronisation."""
    words = _report(device)[1]
    if not words[KIND]:
        return
    if device.type == "cuda":
        # The kernel wrote the kind with the other words: let all of them land before reading them.
        torch.cuda.synchronize(device)
    kind, lo, hi, bound = words
    words[KIND] = NONE
    raise ValueError(f"{out_of_range_message(kind, lo, hi, bound)}, in an earlier kittens MoE call on {device} "
                     f"(those rows were skipped)")


def check_ids(device: torch.device | str | int | None = None) -> None:
    """Synchronise ``device`` (default: the current CUDA device) and raise ``ValueError`` if any kittens
    call issued on it so far met ids out of range."""
    device = torch.device("cuda" if device is None else device)
    if device.type == "cuda":
        if device.index is None:  # reports are kept per indexed device, as tensors carry them
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.synchronize(device)
    raise_if_reported(device)
