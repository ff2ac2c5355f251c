"""The kittens MoE layer on the CPU: a small C++ kernel (``cpu_moe.cpp``) built on first use.

It computes the function of ``reference.py``. The torch reference runs its GEMMs through BLAS,
which is only batch invariant with each expert's rows padded to a multiple of 8 and costs tens
of torch ops per call; at decode sizes that overhead is most of a layer's time. The C++ kernel
sums every GEMM element in a fixed order itself (batch invariant by construction, no padding),
reads bf16 weights directly and runs the whole layer in one call.

The extension registers that kernel as the CPU kernel of ``torch.ops.mok_serve.fused_moe``, with
``reference.check_fused_moe_args``' checks in C++: once it is loaded, a call on CPU tensors goes
from the dispatcher straight to C++, without Python (whose wrapper and checks cost as much as the
kernel at decode sizes). Until then the op's Python kernel runs ``fused_moe_cpu``, which loads it.

The GEMMs run on one of two instruction sets, chosen once per process when the kernel loads:
``avx512_bf16`` (the AVX-512 BF16 dot-product instruction, for bf16 activations) where CPUID reports
AVX-512 F/BW/VL/BF16, else ``generic`` (portable 8-float vectors: AVX2 + FMA code on x86). fp16 and
fp32 activations always take the generic path. For bf16 both sum every GEMM element in the same order
and give the same bits on normal numbers (``cpu_moe.cpp``'s header). The environment variable ``MOK_SERVE_CPU_ISA`` (``auto``, the default, ``generic`` or
``avx512_bf16``), read here at load and nowhere else, forces one; an ISA the CPU lacks is an error.

It is compiled with ``torch.utils.cpp_extension`` (a C++ compiler and ninja, which vLLM's CPU
build needs as well) into torch's extension cache, once per machine. Where it cannot be built,
a warning says why and the torch reference runs instead: same function, slower.
"""

import contextlib
import fcntl
import hashlib
import logging
import platform
import time
from pathlib import Path

import torch

from .. import reference
from ..env import KNOBS, knob

logger = logging.getLogger(__name__)

# cpu_timer.cpp: mok_serve.vllm.timing's per-layer timer op, built into the same extension.
_SOURCES = [Path(__file__).with_name(n) for n in ("cpu_moe.cpp", "cpu_timer.cpp")]
# -fopenmp: at::parallel_for is a header template that runs its body serially unless the extension
# itself is compiled with OpenMP. The extension's libgomp.so.1 is the one torch already loaded (same
# soname), so it shares torch's thread pool and torch.set_num_threads.
_CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_built: bool | None = None
# The variable that forces the kernel's ISA (read once, by available()).
ISA_ENV = KNOBS["cpu_isa"][0]  # MOK_SERVE_CPU_ISA
_isa_error: str | None = None
# Redispatching with this key set calls the extension's CPU kernel of an op whatever its inputs' devices.
_CPU_KERNEL = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)


def _build_name() -> str:
    # -march=native code must not be loaded on another kind of CPU sharing the same cache, and two
    # checkouts with different sources (a CI clone beside a working tree) must not rebuild one
    # folder in turn: the name covers both.
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith(("flags", "Features")))
    except (OSError, StopIteration):
        flags = ""
    digest = hashlib.sha1(f"{platform.machine()} {flags} {_CFLAGS} {_LDFLAGS}".encode())
    for source in _SOURCES:
        digest.update(source.read_bytes())
    return f"mok_serve_cpu_{digest.hexdigest()[:10]}"


def _load(name: str, build_dir: Path, timeout_s: float) -> None:
    """Compile (first use) and load the kernel. One builder at a time per machine, through an
    flock the kernel drops if the builder dies: torch's own lock is a plain file that a process
    killed mid-build leaves behind, and every later load would then wait for it forever."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "mok-build.flock", "w") as guard:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {build_dir} for over {timeout_s:g} s")
                time.sleep(0.2)
        # Every builder holds the flock, so a torch lock file seen now is a dead builder's.
        (build_dir / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=_CFLAGS,
            extra_ldflags=_LDFLAGS,
            build_directory=str(build_dir),
            is_python_module=False,
        )


def available() -> bool:
    """Build and load the C++ kernel once per process; False (with a warning) if it cannot be."""
    global _built
    if _built is None:
        from torch.utils import cpp_extension

        name = _build_name()
        try:
            _load(name, Path(cpp_extension.get_default_build_root()) / name, timeout_s=300)
            # Compiled models call the timer op directly: tracing needs its output's shape.
            torch.library.register_fake("mok_serve_cpu::moe_timer")(lambda t, slot, point: torch.empty_like(t))
            _built = True
        except Exception as exc:  # a missing compiler or ninja shows up as any of several errors
            logger.warning("kittens: cannot build the CPU kernel (%s); using the slower torch reference", exc)
            _built = False
        if _built:
            # Outside the try: an unknown ISA, or one this CPU lacks, is the caller's error (raised
            # by every call), not a reason to fall back to the reference.
            try:
                chosen = torch.ops.mok_serve_cpu.set_isa(knob("cpu_isa"))
                logger.info("kittens: CPU kernel loaded, ISA %s", chosen)
            except ValueError as exc:
                global _isa_error
                _isa_error = f"{ISA_ENV}: {exc}"
    if _isa_error is not None:
        raise ValueError(_isa_error)
    return _built


def isa() -> str | None:
    """The ISA the kernel's GEMMs run on in this process (None where the kernel cannot be built)."""
    return torch.ops.mok_serve_cpu.set_isa("") if available() else None


def supported_isas() -> list[str]:
    """The ISAs this CPU can run, worst first (empty where the kernel cannot be built)."""
    return list(torch.ops.mok_serve_cpu.supported_isas()) if available() else []


@contextlib.contextmanager
def forced_isa(name: str):
    """Run the kernel on ISA ``name`` inside the block, for tests and benchmarks (process-wide: not
    for use while other threads call the kernel)."""
    previous = isa()
    torch.ops.mok_serve_cpu.set_isa(name)
    try:
        yield
    finally:
        torch.ops.mok_serve_cpu.set_isa(previous)


def expert_rows(
    x: torch.Tensor, row_token: torch.Tensor, row_expert: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """``reference.run_experts`` on the CPU: expert output of each row, zero where its expert is -1.

    Weights are fastest as transposed views of contiguous ``[E, H, 2I]`` and ``[E, I, H]`` tensors
    (``w.transpose(1, 2).contiguous().transpose(1, 2)``); other layouts are transposed per call.
    """
    if not available():
        return reference.run_experts(x, row_token, row_expert, w13, w2)
    return torch.ops.mok_serve_cpu.expert_rows(x, row_token.long(), row_expert.long(), w13, w2)


def combine_topk(rows: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Sum ``rows`` ``[T, K, H]`` over k in k order, in fp32, weighted; ``[T, H]`` in rows' dtype."""
    if not available():
        return reference.combine_topk(rows, topk_weights).to(rows.dtype)
    return torch.ops.mok_serve_cpu.combine_topk(rows, topk_weights)


def fused_moe_cpu(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    """``fused_moe`` on CPU ``hidden_states`` in the op's Python kernel (same arguments and result as
    ``reference.fused_moe_reference``). It runs where the dispatcher has no C++ kernel to call: on the
    first CPU call, which loads the extension; on every call where it cannot be built; on calls with
    other tensors on another device, which the C++ checks reject."""
    if not available():
        return reference.fused_moe_reference(
            hidden_states, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation
        )
    return torch.ops.mok_serve.fused_moe.default.redispatch(
        _CPU_KERNEL, hidden_states, w13, w2, topk_weights, topk_ids, expert_map, activation
    )
