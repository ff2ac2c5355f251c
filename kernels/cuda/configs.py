"""Block sizes of the CUDA kernels: a function of static shapes only (tokens, top_k, experts,
hidden, intermediate), never of the per-call routing, which is what keeps them batch invariant.
``pick_configs`` (bf16) and ``pick_configs_fp8``, and the kernel variants a call of a given size
runs (``kernel_variants*``, what ``kernels.warm_up`` compiles)."""

from __future__ import annotations

import functools

import triton

from ..env import knob

__all__ = [
    "LINEAR_SPLIT_BELOW_TILES", "combine_block", "fp8_split_max_tokens", "kernel_variants", "kernel_variants_fp8",
    "one_height", "pick_configs", "pick_configs_fp8", "pick_linear_config", "schedule_block",
]


def kdim_block(k_dim: int, most: int = 64) -> int:
    """The K block: ``most`` (64, or 128 in the decode regime), less for a short K dimension."""
    return min(most, max(16, triton.next_power_of_2(k_dim)))


def pick_configs(tokens: int, top_k: int, num_local: int, hidden: int, inter: int, *,
                 one_launch: bool = False) -> tuple[dict, dict]:
    """(GEMM1 config, GEMM2 config) for a call; depends on shapes only, never on device values.

    Regimes by the average rows per expert (``tokens * top_k / experts``, a static quantity):
    up to 8 -> decode: operands swapped (``SWAP_AB``: weight columns on wgmma's M side, 16-row token
    tiles on its N side), 128-deep K blocks and deep pipelines, narrow column tiles so that a few
    hundred programs read weights; up to 48 -> weight streaming with 64-row tiles; more rows ->
    128-row tiles, 128x256 output tiles. Measured on an H200 (kernels/DESIGN.md#tiling-regimes,
    loadtest/JOURNAL.md#versions). Every regime gives the same bits for a row: each output element
    chains the same 16-deep wgmma k-steps on one fp32 accumulator in K order, whatever the tile
    shape, the operand order or the K block.

    ``one_launch``: at decode sizes, configs for both GEMMs in one launch (``ONE_LAUNCH`` in GEMM1's
    config, see ``one_launch_decode``); elsewhere it changes nothing.
    """
    g1, g2 = _pick_configs(tokens, top_k, num_local, hidden, inter, bool(one_launch))
    return dict(g1), dict(g2)  # copies: callers may fill in keys


@functools.lru_cache(maxsize=4096)  # every eager call asks again: uncached, 7% of a decode call's host time (cProfile)
def _pick_configs(tokens: int, top_k: int, num_local: int, hidden: int, inter: int, one_launch: bool) -> tuple[dict, dict]:
    rows = tokens * top_k
    avg = rows / max(num_local, 1)
    busy = max(1, min(rows, num_local))
    few = busy <= 2 * top_k  # at most two tokens' experts: a grid of a few hundred programs
    if avg <= 8:
        # Decode (sweeps at d1dc340-5767485, sweep_swap*_*.log): a 16-row token tile holds an expert's
        # rows (8 on average), so shared memory holds weight tiles rather than padding rows: 6 stages
        # of 128-deep GEMM1 tiles and 3 of GEMM2's. 2-6% faster than 64-row tiles with 64-deep K
        # blocks at 1-128 tokens on all five shapes; 18-44% slower at 16-32 rows per expert (a second
        # tile per expert reads the weights again).
        bn1 = 64
        while bn1 > 32 and busy * triton.cdiv(inter, bn1) < 2 * _SMS:  # 2 * BLOCK_N >= 64: wgmma's M
            bn1 //= 2
        bn2 = gemm2_columns(busy, hidden, few, least=64)
        stages1 = 6
        tile = dict(BLOCK_M=16, num_warps=4, USE_TMA=True, SWAP_AB=True)
        if one_launch:
            # One kernel holds both GEMMs, so a program's shared memory is the larger one's: keep
            # both within half an SM (GEMM1 64 columns at 4 stages, GEMM2 128 columns at 3: ~110 KB)
            # so that two programs per SM run either (sweeps at a8aadca and 8ef0ff0,
            # loadtest/JOURNAL.md#both-gemms-in-one-launch-a8aadca-to-fa66538).
            bn2 = min(bn2, 128)
            stages1 = 6 if bn1 == 32 else 4
            tile["ONE_LAUNCH"] = True
        g2 = dict(BLOCK_N=bn2, BLOCK_K=kdim_block(inter, 128), num_stages=3, **tile)
        if one_launch and busy <= top_k and bn2 >= 128:
            # One token's experts: the last two row tiles in use take half-width GEMM2 items, so
            # the items drawn last are short (interleaved sweeps, 5 repeats: 1 token 0-4% faster
            # on four shapes, e.g. Qwen3-235B-A22B skewed 0.068 vs 0.071 ms, git history: loadtest/results/sweep_tail_3e74f2c.log at 70c7c60;
            # 2 tokens within 1 us either way, 8 tokens tie, git history: loadtest/results/sweep_two_70c7c60.log at e533052).
            g2["NARROW_TAIL"] = 2
        g1 = dict(BLOCK_N=bn1, BLOCK_K=kdim_block(hidden, 128), num_stages=stages1, **tile)
        if one_launch:
            # GEMM1 items in groups of 4 row tiles per column tile (program_tile): an expert whose
            # rows fill several 16-row tiles reads each weight tile about once for the group. Sweep
            # at a8ceab5 (3 repeats, history.csv): DeepSeek-V3 with every token on the same experts
            # 4% faster at 64 tokens and 7% at 256; uniform routing within 0.2% at 8-256 tokens on
            # DeepSeek-V3 and Qwen3-30B-A3B. 16-row groups gained more there (12% at 256) but cost
            # 0.9% at 256 uniform.
            g1["GROUP_M"] = 4
            # Experts with more than 16 rows run 64-row tiles with 2-deep pipelines (HEAVY_M, chosen
            # on the device from the counts), the others 16-row ones. Sweep at aab4017 (3 repeats,
            # history.csv): DeepSeek-V3 with every token on the same experts 2.0x faster at 256
            # tokens, 1.4x at 64 (Qwen3-30B-A3B 1.07x); uniform routing within 0.7% (0.3 us) at
            # 1-256 tokens on both shapes. 32-row heavy tiles (3 stages) cost 3-13% uniform.
            g1.update(HEAVY_M=64, HEAVY_STAGES=2)
            g2["HEAVY_STAGES"] = 2
        return g1, g2
    bk1, bk2 = kdim_block(hidden), kdim_block(inter)
    if avg <= 48:
        # Weight streaming: fill 132 SMs with narrow column tiles. 4 stages fit more programs per
        # SM than 5 (sweeps at d12e81a/c32df4d, loadtest/results/history.csv, commits d12e81a and c32df4d:
        # 1-7% faster at 8-128 tokens on all five shapes).
        bn1 = 64
        while bn1 > 16 and busy * triton.cdiv(inter, bn1) < 2 * _SMS:
            bn1 //= 2
        bn2 = gemm2_columns(busy, hidden, few, least=32)
        # Experts with more than 64 rows (hot experts) run 128-row tiles with 3-deep pipelines
        # (HEAVY_M, chosen on the device from the counts), the others 64-row ones. Sweep at 15e3cd9
        # (3 repeats, history.csv): every token on the same experts 1.42x faster at DeepSeek-V3 1024
        # tokens (1.845 -> 1.299 ms), 1.05x at Qwen3-30B-A3B 512; uniform routing within 0.6% at both;
        # 2-deep heavy pipelines 1.05x at DeepSeek-V3 1024.
        heavy = dict(HEAVY_M=128, HEAVY_STAGES=3)
        g1 = dict(BLOCK_M=64, BLOCK_N=bn1, BLOCK_K=bk1, num_warps=4, num_stages=4, USE_TMA=True, **heavy)
        g2 = dict(BLOCK_M=64, BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4, num_stages=4, USE_TMA=True, **heavy)
    else:
        # 4 stages hide more HBM latency where weights still dominate (~5-12% faster at 2048 tokens);
        # at >160 rows/expert the 4th stage (192 KB of shared memory) was up to 33% slower.
        stages = 4 if avg <= 160 else 3
        # Half-height last tiles (HALF_TAIL) were 1-7% faster at 2048-8192 tokens (sweep at 93218e1).
        g1 = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk1, num_warps=8, num_stages=stages, USE_TMA=True, GROUP_M=4,
                  HALF_TAIL=True)
        g2 = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk2, num_warps=8, num_stages=stages, USE_TMA=True, GROUP_M=4,
                  HALF_TAIL=True)
    return g1, g2


def one_height(config: dict) -> dict:
    """``config`` without hot experts' tiles (``HEAVY_M``, ``HEAVY_STAGES``): every row tile
    ``BLOCK_M`` high, as the one-launch FP8 kernel needs (and the same bits)."""
    return {k: v for k, v in config.items() if k not in ("HEAVY_M", "HEAVY_STAGES")}


# Hopper as on the H100/H200 SXM: 132 SMs.
_SMS = 132


def gemm2_columns(busy: int, hidden: int, few: bool, least: int) -> int:
    """GEMM2's column tile (at least ``least``) where weights are streamed. With few experts busy
    one program per SM streams enough, and wider tiles are faster (interleaved sweep at b22b37b,
    history.csv (commit b22b37b): 1-2 tokens, all five shapes, 0-12% faster than half as wide); beyond,
    two programs per SM."""
    bn2, min_programs = (256, _SMS) if few else (128, 2 * _SMS)
    while bn2 > least and busy * triton.cdiv(hidden, bn2) < min_programs:
        bn2 //= 2
    return bn2


def schedule_block(rows: int) -> dict:
    """BLOCK and num_warps of the schedule kernel over ``rows`` (token, k) rows. Every program scans
    all rows (twice): wide blocks keep that latency-bound loop short."""
    if rows > 2048:
        return dict(BLOCK=4096, num_warps=8)
    return dict(BLOCK=256 if rows <= 256 else 1024, num_warps=4)


def kernel_variants(tokens: int, top_k: int, num_local: int, hidden: int, inter: int, *,
                    one_launch: bool | None = None) -> tuple:
    """What selects the compiled kernels a ``fused_moe_triton`` call of ``tokens`` tokens runs: the
    schedule's block and both GEMM configs. Per-call counts are never specialized on, so calls with
    equal variants (and equal dtypes) run the same binaries (``kernels.warm_up`` compiles each).
    ``one_launch`` as ``fused_moe_triton``'s."""
    g1, g2 = pick_configs(tokens, top_k, num_local, hidden, inter, one_launch=knob("one_launch", one_launch))
    return tuple(tuple(sorted(d.items())) for d in (schedule_block(tokens * top_k), g1, g2))


def combine_block(hidden: int) -> int:
    """BLOCK_H of the top-k combine kernels (a program per (token, BLOCK_H columns))."""
    return min(1024, max(16, triton.next_power_of_2(hidden)))


def pick_configs_fp8(tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> tuple[dict, dict]:
    """(GEMM1 config, GEMM2 config); depends on shapes only, never on device values.

    Fixed by the format: BLOCK_K = 128 (one scale block per dot) and GEMM1's column tile = 128 (one
    activation group) or 64 (``BLOCK_N``: two programs per group), so the K order never depends on
    the batch. Each K block keeps its dot result
    beside the fp32 accumulator, so a ``[BM, BN]`` tile holds ``2*BM*BN/threads`` fp32 registers per
    thread; the warps keep that at 128 (GEMM1's fused gate/up tile is 256 wide: 8 warps at BM = 64).
    Compiled for sm_90a (Triton 3.9, tests/kernels/test_triton_moe_fp8_compile.py) these configs use 216-228
    registers and do not spill; the 256-per-thread variants (GEMM1 BM=128 at 8 warps or BM=64 at 4,
    GEMM2 128x256 at 8) spill. Regimes by average rows per expert: up to 16, operands swapped
    (``SWAP_AB``, weight columns on wgmma's M side, 16-row token tiles and 64-row ones for experts with
    more); up to 48 rows, weight
    streaming with 64-row tiles (GEMM2 columns narrowed until >= 264 programs read weights, deeper
    pipelines); beyond, 128-row GEMM2 tiles and grouped program order. Timed on an H200 in
    loadtest/results/layer_bench_fp8.md.
    """
    g1, g2 = _pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    return dict(g1), dict(g2)


# Rows per expert up to which FP8 decode swaps operands, with 16-row tiles and GEMM1's split
# column tiles.
_FP8_SPLIT_AVG_ROWS = 16


def fp8_split_max_tokens(top_k: int, num_local: int) -> int:
    """The most tokens a call may have for ``pick_configs_fp8`` to give GEMM1 split column tiles
    (``BLOCK_N`` < 128), so a workspace sizes their half-activation buffer for those calls only."""
    return _FP8_SPLIT_AVG_ROWS * max(num_local, 1) // top_k


@functools.lru_cache(maxsize=4096)
def _pick_configs_fp8(tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> tuple[dict, dict]:
    avg = tokens * top_k / max(num_local, 1)
    if avg <= 48:
        busy = max(1, min(tokens * top_k, num_local))
        swap = avg <= _FP8_SPLIT_AVG_ROWS
        bn2 = 128
        while bn2 > (64 if swap else 32) and busy * triton.cdiv(hidden, bn2) < 264:
            bn2 //= 2
        if swap:
            # As pick_configs' decode regime: weight columns on wgmma's M side, 16-row token tiles,
            # so the shared memory holds weight tiles and GEMM1 fits 6 stages (34-36 KB each). Sweeps
            # at 19e0e05 and 1ff7aa2 (git history: loadtest/results/sweep_fp8_swap_19e0e05.log at
            # bc6ca55, sweep_fp8_m32_1ff7aa2.log at d7a715b; DeepSeek-V3 and Kimi-K2, 1-512 tokens):
            # 12-19% faster than 64-row tiles. GEMM1 in 64-column programs, two per activation group
            # (the last quantizes it): twice the programs reading weights. Sweep at 9aa0de9 (history.csv):
            # Qwen3-30B-A3B 3% faster at 1 token, 9% at 8 and 32; DeepSeek-V3 3% at 1, 4% at 8.
            g1 = dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, num_stages=6, GROUP_M=1, SWAP_AB=True)
            g2 = dict(BLOCK_M=16, BLOCK_N=bn2, num_warps=4, num_stages=5, USE_TMA=True, GROUP_M=1, SWAP_AB=True)
            # Experts with more than 16 rows (hot experts, and the busy ones of skewed routing) run
            # 64-row tiles with 4-deep pipelines (HEAVY_M, chosen on the device from the counts).
            # Sweep at 15e3cd9 (H200, history.csv): every token on the same experts 1.85x faster at
            # DeepSeek-V3 256 tokens (0.825 -> 0.446 ms), 1.44x at 64, Qwen3-30B-A3B 64 tokens 1.20x;
            # uniform routing within 0.6%. At 12-16 rows per expert they replace the 32-row tiles
            # used there before (sweeps at 9a331f9, H100, loadtest/results/sweep_fp8_9a331f9.log):
            # skewed routing 4-5.5% faster (Qwen3-30B-A3B 240 and 256 tokens, DeepSeek-V3 512),
            # uniform Qwen3-30B-A3B 208-240 tokens 0.4-3% faster, 256 tokens and DeepSeek-V3 448-512
            # 0.8-1.3% slower.
            for g in (g1, g2):
                g.update(HEAVY_M=64, HEAVY_STAGES=4)
        else:
            g1 = dict(BLOCK_M=64, num_warps=8, num_stages=4, GROUP_M=1)
            g2 = dict(BLOCK_M=64, BLOCK_N=bn2, num_warps=4, num_stages=5, USE_TMA=True, GROUP_M=1)
    else:
        g1 = dict(BLOCK_M=64, num_warps=8, num_stages=3, GROUP_M=4)
        g2 = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4, USE_TMA=True, GROUP_M=4)
    return g1, g2


def kernel_variants_fp8(tokens: int, top_k: int, num_local: int, hidden: int, inter: int) -> tuple:
    """As ``kernel_variants``, for ``fused_moe_fp8_triton``."""
    g1, g2 = pick_configs_fp8(tokens, top_k, num_local, hidden, inter)
    return tuple(tuple(sorted(d.items())) for d in (schedule_block(tokens * top_k), g1, g2))


# A dense-layer call with fewer output tiles than SMs runs its K chunks in separate programs.
LINEAR_SPLIT_BELOW_TILES = _SMS


# Block-FP8 dense layers of 65 to this many rows take one-warpgroup tiles (``_pick_linear_config``).
_FP8_NARROW_MAX_ROWS = 512


@functools.lru_cache(maxsize=4096)
def _pick_linear_config(rows: int, n: int, k: int, fp8: bool) -> tuple:
    if rows <= 64:
        # Decode: operands swapped (SWAP_AB), as the MoE decode regime: the weight rows are wgmma's
        # M side (64) and the 16-64 token rows its N side, so shared memory holds weight tiles.
        bm = 16 if rows <= 16 else 32 if rows <= 32 else 64
        return dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=kdim_block(k, 128), num_warps=4,
                    num_stages=4 if bm < 64 else 3, USE_TMA=True, SWAP_AB=True, GROUP_M=1).items()
    if fp8:
        # Block FP8 (BLOCK_K 128, one weight scale block each): every K block waits for its dot to
        # finish before scaling it into the accumulator, and the activation tiles come by TMA from
        # the call's quantized copy (TMA_A). Up to 512 rows, 64-row tiles on one warpgroup, so more
        # programs share an SM and hide those waits: 64 columns where K is short (<= 4096), else
        # 128, on two warpgroups where those tiles are fewer than the SMs (their K then splits).
        # Sweeps at 9a331f9 and ef62cf1 (H100, loadtest/results/deterministic/linear_sweep_fp8_*.md),
        # against the 64 x 128 two-warpgroup tile: Qwen3-30B-A3B qkv_proj 256 rows 34.5 -> 23.4 us,
        # o_proj 44.1 -> 38.6, 512 rows 50.0 -> 38.3 and 66.2 -> 46.5; DeepSeek-V3 o_proj 256 rows
        # (K 16384, 224 tiles) 196 -> 154, q_b_proj and kv_b_proj within 2%; with K 7168 and 68 or 128
        # tiles (qkv_a_proj, shared_gate_up) one warpgroup was 4-26% slower. Beyond 512 rows, two-warpgroup
        # 128 x 128 tiles (products and accumulator need 248 registers a thread on two).
        if rows > _FP8_NARROW_MAX_ROWS:
            bm, bn, warps = 128, 128, 8
        elif k <= 4096:
            bm, bn, warps = 64, 64, 4
        else:
            bm, bn = 64, 128
            warps = 4 if triton.cdiv(rows, bm) * triton.cdiv(n, bn) >= _SMS else 8
        return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, num_warps=warps, num_stages=4, USE_TMA=True, TMA_A=True,
                    GROUP_M=8).items()
    if rows <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=kdim_block(k), num_warps=4, num_stages=4, USE_TMA=True,
                    GROUP_M=8).items()
    # Past 256 rows the activations come by TMA too (TMA_A): H100 sweep at b5eefb9
    # (loadtest/results/deterministic/linear_sweep_b5eefb9_h100.md), against pointer loads: 1-4% faster
    # at 2048 and 8192 rows on Qwen3-30B-A3B's qkv_proj and o_proj and GLM-4.5-Air's o_proj. Wider
    # tiles (128 x 256, 256 x 128) ran 1.3-3.9x slower (they spill registers in an sm_90a compile).
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=kdim_block(k), num_warps=8, num_stages=4, USE_TMA=True, TMA_A=True,
                GROUP_M=8).items()


def pick_linear_config(rows: int, n: int, k: int, *, fp8: bool = False) -> dict:
    """Tile config of an ``invariant_linear`` call (``fp8``: ``invariant_linear_fp8``, block-FP8
    weights) of ``rows`` rows with a weight ``[n, k]``: by the shape only, since every tile gives the
    same bits (kernels/linear.py). BLOCK_K divides 128 (the K chunks' alignment)."""
    return dict(_pick_linear_config(rows, n, k, fp8))
