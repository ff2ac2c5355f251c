"""kernels.warm_up's and warm_up_linear's choice of token counts, warm_up_attention's paths: one call per compiled
kernel variant (CPU, no kernel runs)."""

import pytest
import torch

pytest.importorskip("triton")

from mok_serve.kernels import (  # noqa: E402
    warm_up,
    warm_up_invariant_kernels,
    warm_up_linear,
    warm_up_linear_rows,
    warm_up_token_counts,
)
from mok_serve.kernels.cuda.attention import attention_paths  # noqa: E402
from mok_serve.kernels.cuda.configs import kernel_variants, kernel_variants_fp8  # noqa: E402

QWEN3_30B = dict(num_local=128, hidden=2048, inter=768, top_k=8)


def test_qwen3_30b_counts_and_why():
    # 1 token: its experts' last GEMM2 items half-width; 2: two tokens' experts, wide GEMM2 tiles;
    # 3: more experts busy, narrower GEMM2 tiles; 33: the schedule's block (> 256 rows); 129: weight
    # streaming (> 8 rows per expert); 257: the schedule's widest block (> 2048 rows); 769: 128-row
    # tiles (> 48 rows per expert); 2561: 3 pipeline stages (> 160 rows per expert).
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=8192) == [1, 2, 3, 33, 129, 257, 769, 2561]
    # FP8: 257 is also where swapped 16-row tiles give way to 64-row ones (> 16 rows per expert).
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=8192, fp8=True) == [1, 3, 33, 257, 769]
    assert warm_up_token_counts(**QWEN3_30B, max_tokens=512) == [1, 2, 3, 33, 129, 257]


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", [QWEN3_30B, dict(num_local=256, hidden=7168, inter=2048, top_k=8),
                                   dict(num_local=64, hidden=256, inter=128, top_k=4)])
def test_every_token_count_shares_the_variant_of_a_warmed_count(shape, fp8):
    variants = kernel_variants_fp8 if fp8 else kernel_variants
    args = (shape["top_k"], shape["num_local"], shape["hidden"], shape["inter"])
    counts = warm_up_token_counts(**shape, max_tokens=4096, fp8=fp8)
    assert counts[0] == 1 and counts == sorted(counts)
    for c in counts[1:]:  # each count starts a new variant...
        assert variants(c - 1, *args) != variants(c, *args)
    warmed = {variants(c, *args) for c in counts}
    assert len(warmed) == len(counts)  # ...and no two share one
    assert all(variants(t, *args) in warmed for t in range(1, 4097))


def test_nothing_runs_on_the_cpu():
    x, w13, w2 = torch.zeros(1, 8), torch.zeros(2, 8, 8), torch.zeros(2, 8, 4)
    assert warm_up(x, w13, w2, torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32), 4096) == []


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (151936, 2048), (256, 128)])
def test_every_row_count_shares_the_linear_variant_of_a_warmed_count(n, k, fp8):
    from mok_serve.kernels.cuda.linear import linear_plan

    def variant(rows):
        config, _, split = linear_plan(rows, n, k, fp8=fp8)
        return tuple(sorted(config.items())), split

    rows = warm_up_linear_rows(n, k, 3000, fp8=fp8)
    assert rows[0] == 1 and rows == sorted(rows)
    for r in rows[1:]:  # each count starts a new variant...
        assert variant(r - 1) != variant(r)
    warmed = {variant(r) for r in rows}
    assert len(warmed) == len(rows)  # ...and no two share one
    assert all(variant(r) in warmed for r in range(1, 3001))


def test_qwen3_30b_qkv_rows_and_why():
    # 1-16, 17-32, 33-64 rows: swapped 16/32/64-row decode tiles, K chunks split over programs;
    # 65: 64 x 128 tiles, split while under 132 tiles, whole from 193 (4 x 40 tiles); 257: 128 x 128
    # tiles, split again (3 x 40), whole from 385.
    assert warm_up_linear_rows(5120, 2048, 8192) == [1, 17, 33, 65, 193, 257, 385]


def test_prefill_tiles_read_activations_by_tma():
    from mok_serve.kernels.cuda.linear import linear_plan

    # Up to 512 rows 64-row tiles: 64 columns where K <= 4096; else 128, on one warpgroup where they
    # fill the SMs (4 x 56 tiles at 256 rows of a 7168-row weight), two where not (4 x 17); beyond,
    # 128 x 128 on two.
    for rows, n, k, tile in ((65, 5120, 2048, (64, 64, 4)), (512, 5120, 4096, (64, 64, 4)),
                             (256, 7168, 16384, (64, 128, 4)), (256, 2112, 7168, (64, 128, 8)),
                             (513, 5120, 2048, (128, 128, 8)), (8192, 5120, 2048, (128, 128, 8))):
        config, _, _ = linear_plan(rows, n, k, fp8=True)
        assert (config["BLOCK_M"], config["BLOCK_N"], config["num_warps"]) == tile and config["BLOCK_K"] == 128
        assert config["TMA_A"] and not config.get("SWAP_AB")
    for rows in (1, 64):  # decode: swapped operands, activations by pointer loads
        config, _, _ = linear_plan(rows, 5120, 2048, fp8=True)
        assert config["SWAP_AB"] and "TMA_A" not in config
    # bf16 past 256 rows too: the launcher reads an aligned, contiguous copy of a view that is not, so
    # whether TMA can read the activations depends on K alone (the layer), never on the call.
    assert linear_plan(257, 5120, 2048)[0]["TMA_A"] and linear_plan(8192, 2048, 4096)[0]["TMA_A"]
    assert "TMA_A" not in linear_plan(256, 5120, 2048)[0] and "TMA_A" not in linear_plan(8, 5120, 2048)[0]


def test_a_warm_up_is_reported_when_it_ends():
    import mok_serve.kernels as kernels

    heard = []
    try:
        warm_up_invariant_kernels(64, report=lambda *a: heard.append(a))
        kernels._reported_warm_up("invariant_linear [4, 8]", lambda: [1, 17])
    finally:
        warm_up_invariant_kernels(0)
    (what, variants, seconds), = heard
    assert (what, variants) == ("invariant_linear [4, 8]", [1, 17]) and seconds >= 0
    kernels._reported_warm_up("unheard", lambda: [])  # no report set: nothing to tell
    assert len(heard) == 1


def test_attention_paths_and_the_warm_up_switch():
    assert attention_paths(128) == [(False, False), (False, True), (True, False), (True, True)]
    assert attention_paths(32) == [(False, False), (False, True)]  # swapped tiles need a head of 64+
    with pytest.raises(ValueError, match="max_rows"):
        warm_up_invariant_kernels(-1)
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    assert warm_up_linear(x, w, None, 4096) == []  # CPU: nothing compiled per call


def launch_signatures(monkeypatch, fp8: bool, shape: dict, token_counts) -> dict[int, tuple]:
    """For each token count, what selects the binaries of a ``fused_moe_triton`` (or FP8) call's
    launches as Triton compiles them: each kernel's name, its launch keywords (constexprs, warps,
    stages) and, for every int argument it specializes on, whether the value is 1 and whether 16
    divides it. The kernels are replaced by recorders: nothing runs."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from mok_serve.kernels.cuda import moe, moe_fp8

    launches = []

    class Recorder:
        def __init__(self, name, kernel):
            self.name = name
            if isinstance(kernel, JITFunction):
                self.unspecialized = [p.do_not_specialize for p in kernel.params]
            else:  # under TRITON_INTERPRET=1 (tests/conftest.py)
                names = kernel.kwargs.get("do_not_specialize") or ()
                self.unspecialized = [n in names for n in kernel.arg_names]

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                specialized = tuple((i, a == 1, a % 16 == 0) for i, a in enumerate(args)
                                    if type(a) is int and not self.unspecialized[i])
                constants = tuple(sorted((k, v) for k, v in kwargs.items() if isinstance(v, (bool, int, float, str))))
                launches.append((self.name, specialized, constants))
            return launch

    for module in (moe, moe_fp8):
        for name, value in list(vars(module).items()):
            if isinstance(value, (JITFunction, InterpretedFunction)):
                monkeypatch.setattr(module, name, Recorder(name, value))
    E, H, I, K = shape["num_local"], shape["hidden"], shape["inter"], shape["top_k"]
    wdtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    w13, w2 = torch.empty(E, 2 * I, H, dtype=wdtype), torch.empty(E, H, I, dtype=wdtype)  # never read: no pages touched
    signatures = {}
    for tokens in token_counts:
        x = torch.zeros(tokens, H, dtype=torch.bfloat16)
        ids = (torch.arange(tokens * K) % E).view(tokens, K).to(torch.int32)
        weights = torch.full((tokens, K), 1.0 / K)
        launches.clear()
        if fp8:
            scales = (torch.ones(E, 2 * I // 128, H // 128), torch.ones(E, H // 128, I // 128))
            moe_fp8.fused_moe_fp8_triton(x, w13, w2, *scales, weights, ids)
        else:
            moe.fused_moe_triton(x, w13, w2, weights, ids)
        signatures[tokens] = tuple(launches)
    return signatures


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", [QWEN3_30B, dict(num_local=256, hidden=7168, inter=2048, top_k=8)])
def test_token_counts_of_one_variant_launch_the_same_binaries(monkeypatch, shape, fp8):
    """What warm_up relies on: calls whose kernel_variants agree compile nothing new. Fails where a
    per-call int (a count of rows, tiles or sync words) is left to Triton's specialization on 1 and
    multiples of 16: 73fc68d's _moe_schedule_zero_kernel compiled after warm_up on the H200."""
    variants = kernel_variants_fp8 if fp8 else kernel_variants
    args = (shape["top_k"], shape["num_local"], shape["hidden"], shape["inter"])
    counts = [*range(1, 300), *range(300, 4097, 37)]
    first: dict[tuple, tuple] = {}
    for tokens, signature in launch_signatures(monkeypatch, fp8, shape, counts).items():
        assert signature, f"{tokens} tokens: no launch recorded"
        warmed, expected = first.setdefault(variants(tokens, *args), (tokens, signature))
        assert signature == expected, f"{tokens} tokens launch binaries that {warmed} (same variant) did not"
