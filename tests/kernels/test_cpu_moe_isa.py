"""The C++ CPU kernel's instruction sets (kernels/cpu/cpu_moe.cpp): which one a CPU gets, forcing one with
MOK_SERVE_CPU_ISA, the ISAs' agreement bit for bit, and its loops running on torch's threads.

tests/kernels/test_cpu_moe.py runs the reference, invariance and thread-count tests on every ISA this CPU has."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from moe_test_utils import make_layer

from mok_serve.kernels import fused_moe
from mok_serve.kernels.cpu import moe as cpu_moe

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="the C++ CPU kernel cannot be built here")

# What the AVX-512 BF16 path needs, as /proc/cpuinfo names it (the kernel asks CPUID itself).
AVX512_BF16_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"}


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return set()


def run_fresh(code: str, isa_env: str | None) -> subprocess.CompletedProcess:
    """Runs ``code`` in a new Python process with MOK_SERVE_CPU_ISA set to ``isa_env`` (None: unset)."""
    env = {k: v for k, v in os.environ.items() if k != cpu_moe.ISA_ENV}
    if isa_env is not None:
        env[cpu_moe.ISA_ENV] = isa_env
    prelude = "import torch\nfrom mok_serve.kernels import fused_moe\nfrom mok_serve.kernels.cpu import moe as cpu_moe\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs /proc/cpuinfo")
def test_the_best_isa_of_the_cpu_is_chosen():
    """AVX-512 BF16 where the CPU has it (this project's AVX-512 EPYC), else the generic path."""
    want = "avx512_bf16" if AVX512_BF16_FLAGS <= cpu_flags() else "generic"
    proc = run_fresh("print(cpu_moe.isa(), cpu_moe.supported_isas())", isa_env=None)
    assert proc.returncode == 0, proc.stderr
    chosen, supported = proc.stdout.split(" ", 1)
    assert chosen == want
    assert eval(supported) == (["generic", "avx512_bf16"] if want == "avx512_bf16" else ["generic"])


@pytest.mark.parametrize("name", ["generic", "auto", ""])
def test_the_environment_variable_forces_the_isa(name):
    want = {"generic": "generic"}.get(name, cpu_moe.supported_isas()[-1])
    proc = run_fresh("print(cpu_moe.isa())", isa_env=name)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == want


def test_an_isa_the_kernel_lacks_is_an_error_on_every_call():
    proc = run_fresh("""
        for _ in range(2):
            try:
                cpu_moe.available()
                raise SystemExit("no error")
            except ValueError as exc:
                assert "MOK_SERVE_CPU_ISA" in str(exc) and "unknown ISA 'avx9000'" in str(exc), exc
    """, isa_env="avx9000")
    assert proc.returncode == 0, proc.stderr + proc.stdout


@pytest.mark.skipif("avx512_bf16" in cpu_moe.supported_isas(), reason="this CPU has AVX-512 BF16")
def test_an_isa_the_cpu_lacks_is_an_error():
    with pytest.raises(ValueError, match="does not support ISA 'avx512_bf16'"):
        torch.ops.mok_serve_cpu.set_isa("avx512_bf16")


def test_forced_isa_restores_the_previous_one():
    before = cpu_moe.isa()
    with cpu_moe.forced_isa("generic"):
        assert cpu_moe.isa() == "generic"
    assert cpu_moe.isa() == before


# Odd H and I (the lone last k of a pair), column tails of every width, 1-8 row blocks, the tiny
# models' shape.
AGREEMENT_SHAPES = [(1, 64, 32, 4, 2), (17, 33, 15, 3, 2), (9, 31, 7, 4, 3), (40, 132, 68, 16, 4),
                    (64, 256, 128, 8, 2), (100, 256, 128, 16, 4)]


@pytest.mark.skipif("avx512_bf16" not in cpu_moe.supported_isas(), reason="needs AVX-512 BF16")
@pytest.mark.parametrize("shape", AGREEMENT_SHAPES)
def test_the_isas_give_the_same_bits(shape):
    """Both ISAs sum every element in pair order, and vdpbf16ps' two steps are the generic path's
    FMAs on bf16 (exact products): the same bits wherever no subnormal number occurs."""
    x, w13, w2, weights, ids = make_layer(*shape, torch.bfloat16)
    got = {}
    for isa in ("generic", "avx512_bf16"):
        with cpu_moe.forced_isa(isa):
            got[isa] = fused_moe(x, w13, w2, weights, ids)
            got[isa + " float32 weights"] = fused_moe(x, w13.float(), w2.float(), weights, ids)
    for name, out in got.items():
        assert torch.equal(out, got["generic"]), name


@pytest.mark.parametrize("threads", [2, 3])
def test_the_kernel_loops_run_on_torchs_threads(threads):
    """The extension is built with OpenMP: without it at::parallel_for runs serially (it did, silently)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert torch.ops.mok_serve_cpu.parallel_workers(threads) == threads
    finally:
        torch.set_num_threads(before)
