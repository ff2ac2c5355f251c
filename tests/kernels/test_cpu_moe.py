"""The C++ CPU kernel (kernels/cpu/cpu_moe.cpp) against the torch reference, its invariances, and its
registration as the CPU kernel of mok_serve::fused_moe (no Python per call, the reference's errors)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from moe_test_utils import make_layer

from mok_serve.kernels import fused_moe, reference
from mok_serve.kernels.cpu import moe as cpu_moe

pytestmark = pytest.mark.skipif(not cpu_moe.available(), reason="the C++ CPU kernel cannot be built here")

TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
# Every ISA the kernel has; those this CPU lacks are skipped (a CI machine without AVX-512 still
# tests the generic path; tests/kernels/test_cpu_moe_isa.py checks which one is chosen).
ISAS = ["generic", "avx512_bf16"]


@pytest.fixture(params=ISAS)
def isa(request):
    """Runs the test with the kernel forced to each ISA in turn."""
    if request.param not in cpu_moe.supported_isas():
        pytest.skip(f"this CPU does not support {request.param}")
    with cpu_moe.forced_isa(request.param):
        yield request.param


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not got.isnan().any(), "NaN in output"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def transposed_in_memory(w: torch.Tensor) -> torch.Tensor:
    return w.transpose(1, 2).contiguous().transpose(1, 2)


# Odd sizes exercise the 8-wide and scalar column tails and the 1-3 row blocks (the reference
# needs rows of a multiple of 16 bytes, so I is a multiple of 4).
SHAPES = [(1, 64, 32, 4, 2), (13, 72, 36, 5, 3), (64, 256, 128, 8, 2), (40, 132, 68, 16, 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, isa):
    x, w13, w2, weights, ids = make_layer(*shape, dtype)
    want = reference.fused_moe_reference(x, w13, w2, weights, ids)
    got = fused_moe(x, transposed_in_memory(w13), transposed_in_memory(w2), weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    assert rel_err(got, want) <= TOLERANCE[dtype]


def test_rows_of_remote_experts_are_zero_and_others_match(isa):
    x, w13, w2, _, _ = make_layer(9, 72, 36, 6, 2, torch.bfloat16)
    row_token = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8])
    row_expert = torch.tensor([0, -1, 5, 5, -1, 2, 5, 5, 5, 0])
    got = cpu_moe.expert_rows(x, row_token, row_expert, w13, w2)
    want = reference.run_experts(x, row_token, row_expert, w13, w2)
    remote = row_expert < 0
    assert torch.equal(got[remote], torch.zeros_like(got[remote]))
    for row in (~remote).nonzero().flatten().tolist():  # every local row written and right
        assert rel_err(got[row], want[row]) <= 1e-2, row


def test_bitwise_batch_invariant(isa):
    """A token alone equals the same token in batches where its expert has 1 to 40 rows."""
    x, w13, w2, weights, ids = make_layer(64, 132, 68, 4, 2, torch.bfloat16, seed=3)
    w13, w2 = transposed_in_memory(w13), transposed_in_memory(w2)
    alone = torch.cat([fused_moe(x[t : t + 1], w13, w2, weights[t : t + 1], ids[t : t + 1]) for t in range(64)])
    for size in (2, 3, 5, 7, 64):
        batch = torch.cat([fused_moe(x[s : s + size], w13, w2, weights[s : s + size], ids[s : s + size])
                           for s in range(0, 64, size)])
        assert torch.equal(batch, alone), size


def test_bitwise_equal_across_thread_counts_and_weight_layouts(isa):
    x, w13, w2, weights, ids = make_layer(33, 72, 36, 5, 3, torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = fused_moe(x, w13, w2, weights, ids)
        for n in (2, 3):  # 3: more threads than this 2-core CI machine has, and an uneven split
            torch.set_num_threads(n)
            assert torch.equal(fused_moe(x, w13, w2, weights, ids), one_thread), n
    finally:
        torch.set_num_threads(threads)
    for a, b in ((w13, w2), (transposed_in_memory(w13), transposed_in_memory(w2)), (w13.float(), w2.float())):
        assert torch.equal(fused_moe(x, a, b, weights, ids), one_thread)


def test_nan_stays_in_its_token(isa):
    x, w13, w2, weights, ids = make_layer(16, 64, 32, 4, 2, torch.bfloat16)
    x[5, 3] = float("nan")
    out = fused_moe(x, w13, w2, weights, ids)
    assert out[5].isnan().any()
    assert not out[torch.arange(16) != 5].isnan().any()


def test_bad_rows_raise_naming_the_problem():
    x, w13, w2, _, _ = make_layer(4, 64, 32, 4, 2, torch.bfloat16)
    with pytest.raises(IndexError, match="local expert 4 outside"):
        cpu_moe.expert_rows(x, torch.tensor([0, 1]), torch.tensor([0, 4]), w13, w2)
    with pytest.raises(IndexError, match="token 9 outside"):
        cpu_moe.expert_rows(x, torch.tensor([9]), torch.tensor([0]), w13, w2)
    with pytest.raises(RuntimeError, match="dtype"):
        cpu_moe.expert_rows(x.double(), torch.tensor([0]), torch.tensor([0]), w13.double(), w2.double())


def run_fresh(code: str) -> None:
    """Runs ``code`` in a new Python process, where the extension is not loaded yet."""
    prelude = """
        import torch
        from mok_serve.kernels import fused_moe, reference
        from mok_serve.kernels.cpu import moe as cpu_moe
        x, w13, w2 = torch.randn(5, 64).bfloat16(), torch.randn(4, 64, 64).bfloat16(), torch.randn(4, 64, 32).bfloat16()
        weights, ids = torch.rand(5, 2), torch.randint(0, 4, (5, 2))
        def has_cpu_kernel():
            return torch._C._dispatch_has_kernel_for_dispatch_key("mok_serve::fused_moe", "CPU")
    """
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(prelude) + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr


def test_the_first_cpu_call_loads_the_kernel_and_later_ones_skip_python():
    run_fresh("""
        python_calls = []
        real = cpu_moe.fused_moe_cpu
        cpu_moe.fused_moe_cpu = lambda *a, **kw: python_calls.append(1) or real(*a, **kw)
        assert not has_cpu_kernel()
        first = fused_moe(x, w13, w2, weights, ids)
        assert python_calls == [1] and has_cpu_kernel()
        assert torch.equal(fused_moe(x, w13, w2, weights, ids), first) and python_calls == [1]
    """)


def test_without_the_kernel_the_reference_runs():
    run_fresh("""
        def no_compiler(*args, **kwargs):
            raise OSError("no compiler here")
        cpu_moe._load = no_compiler
        got = fused_moe(x, w13, w2, weights, ids)
        assert not cpu_moe.available() and not has_cpu_kernel()
        assert torch.equal(got, reference.fused_moe_reference(x, w13, w2, weights, ids))
    """)


def python_kernel_fails(*args, **kwargs):
    raise AssertionError("the Python kernel of mok_serve::fused_moe ran")


def test_cpu_calls_go_straight_to_the_cpp_kernel(monkeypatch):
    x, w13, w2, weights, ids = make_layer(13, 72, 36, 5, 3, torch.bfloat16)
    through_python = cpu_moe.fused_moe_cpu(x, w13, w2, weights, ids)
    monkeypatch.setattr(cpu_moe, "fused_moe_cpu", python_kernel_fails)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("mok_serve::fused_moe", "CPU")
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), through_python)


def set_meta(name):
    return lambda a: a.update({name: a[name].to("meta")})


# Every check of reference.check_fused_moe_args, and a few calls it accepts.
ARGUMENT_CHANGES = [
    lambda a: a.update(activation="gelu"),
    lambda a: a.update(activation="it's \\ a\n\x01"),
    lambda a: a.update(x=a["x"][None]),
    lambda a: a.update(x=a["x"][0]),
    lambda a: a.update(x=a["x"].to(torch.int32)),
    lambda a: a.update(x=a["x"].double()),
    lambda a: a.update(x=a["x"].to(torch.float8_e4m3fn)),
    lambda a: a.update(w13=a["w13"][0]),
    lambda a: a.update(w2=a["w2"][None]),
    lambda a: a.update(w13=a["w13"][:, :-1]),
    lambda a: a.update(x=a["x"][:, :-1]),
    lambda a: a.update(w2=a["w2"][:, :, :-1]),
    lambda a: a.update(w2=a["w2"][:-1]),
    lambda a: a.update(w13=a["w13"].half()),
    lambda a: a.update(w2=a["w2"].double()),
    lambda a: a.update(w13=a["w13"].float(), w2=a["w2"].float()),  # accepted: float32 weights on the CPU
    lambda a: a.update(ids=a["ids"][0]),
    lambda a: a.update(ids=a["ids"][:-1]),
    lambda a: a.update(ids=a["ids"].float()),
    lambda a: a.update(ids=a["ids"].to(torch.int16)),
    lambda a: a.update(weights=a["weights"][:, :1]),
    lambda a: a.update(weights=a["weights"].long()),
    lambda a: a.update(expert_map=torch.zeros(2, 4, dtype=torch.int32)),
    lambda a: a.update(expert_map=torch.arange(4.0)),
    lambda a: a.update(expert_map=torch.tensor([0, 1, 2, 9], dtype=torch.int32)),
    lambda a: a.update(expert_map=torch.tensor([0, -2, 2, 3])),
    lambda a: a.update(expert_map=torch.tensor([0, 1, 2, 3, -1])),  # accepted: global expert 4 is not local
    lambda a: a.update(ids=a["ids"] + 100),
    lambda a: a.update(ids=a["ids"] - 100),
    lambda a: a.update(expert_map=torch.tensor([0, 1, -1], dtype=torch.int32)),  # ids of 3 global experts
    # accepted: no ids, so no value checks
    lambda a: a.update(x=a["x"][:0], weights=a["weights"][:0], ids=a["ids"][:0] + 100, expert_map=torch.tensor([9])),
    set_meta("w13"),
    set_meta("w2"),
    set_meta("weights"),
    set_meta("ids"),
    lambda a: a.update(expert_map=torch.arange(4, device="meta")),
]


@pytest.mark.parametrize("change", ARGUMENT_CHANGES)
def test_bad_arguments_raise_the_reference_message(change, monkeypatch):
    x, w13, w2, weights, ids = make_layer(6, 64, 32, 4, 2, torch.bfloat16)
    args = dict(x=x, w13=w13, w2=w2, weights=weights, ids=ids, expert_map=None, activation="silu")
    change(args)
    tensors = list(args.values())[:5]

    def message(fn):
        try:
            fn(*tensors, expert_map=args["expert_map"], activation=args["activation"])
        except ValueError as exc:
            return str(exc)
        return None

    want = message(reference.check_fused_moe_args)
    # Tensors on two devices reach the C++ kernel through the op's Python kernel (as CPU and CUDA
    # tensors do: their dispatch key is CUDA's); the others straight from the dispatcher.
    if any(isinstance(a, torch.Tensor) and a.is_meta for a in args.values()):
        got = message(cpu_moe.fused_moe_cpu)
    else:
        monkeypatch.setattr(cpu_moe, "fused_moe_cpu", python_kernel_fails)
        got = message(fused_moe)
    assert got == want


def test_a_dead_builders_lock_does_not_block_loading(tmp_path, monkeypatch):
    """torch's build lock left by a process killed mid-build is removed, not waited for."""
    from torch.utils import cpp_extension

    loads = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: loads.append(kw["build_directory"]))
    (tmp_path / "lock").touch()
    cpu_moe._load("mok_serve_cpu_test_lock", tmp_path, timeout_s=5)
    assert loads == [str(tmp_path)] and not (tmp_path / "lock").exists()


def test_a_live_builder_is_waited_for_with_a_bound(tmp_path):
    import fcntl

    with open(tmp_path / "mok-build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # flock locks are per open file: this one blocks _load's
        with pytest.raises(TimeoutError, match="building"):
            cpu_moe._load("mok_serve_cpu_test_lock", tmp_path, timeout_s=0.5)
