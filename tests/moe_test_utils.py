"""Helpers shared by the MoE kernel tests: random inputs, relative error, and for the GPU tests the
model shapes, fresh seeds, routings, a one-family weight cache and NaN-poisoned calls."""

import contextlib
import json
import pathlib

import pytest
import torch

SHAPES = json.loads((pathlib.Path(__file__).resolve().parents[1] / "configs" / "model_shapes.json").read_text())
FAMILIES = [k for k in SHAPES if not k.startswith("_")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; fails on a NaN in ``out``."""
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def fp8_linear_float64_reference(x, wq, ws, b):
    """A block-FP8 dense layer on the same quantized operands (``x`` quantized per token in 1 x 128
    groups, ``wq`` / ``ws`` 128 x 128 blocks), products summed in float64."""
    from mok_serve.kernels.fp8 import dequantize_fp8_groups, quantize_fp8_groups

    xq = dequantize_fp8_groups(*quantize_fp8_groups(x.float())).double()
    w = (wq.float() * ws.repeat_interleave(128, 0)[: wq.shape[0]].repeat_interleave(128, 1)[:, : wq.shape[1]]).double()
    return xq @ w.t() + (b.double() if b is not None else 0)


def make_inputs(tokens, hidden, inter, experts, top_k, dtype=torch.bfloat16, seed=None, num_global=None,
                weight_dtype=None):
    """(x, w13, w2, weights, ids) on the CPU: x in ``dtype``, experts in ``weight_dtype`` (default
    ``dtype``), ids over ``num_global`` experts (default ``experts``); ``seed`` None draws one."""
    g = torch.Generator().manual_seed(seed if seed is not None else torch.seed() % 2**31)
    num_global = num_global or experts
    weight_dtype = weight_dtype or dtype
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(weight_dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(weight_dtype)
    ids = torch.rand(tokens, num_global, generator=g).argsort(dim=1)[:, :top_k].to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=g)
    return x, w13, w2, weights, ids


def make_layer(tokens, hidden, inter, experts, top_k, dtype, seed=0):
    """One layer's inputs from a fixed seed: x, w13, w2, top-k weights and distinct top-k ids."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return x, w13, w2, weights, ids


def check_alone_equals_in_batch(op, x, experts, weights, ids, every=7):
    """``op(x, *experts, weights, ids)``: every ``every``-th token alone gives its bits in the
    whole batch."""
    batch = op(x, *experts, weights, ids)
    for t in range(0, x.shape[0], every):
        alone = op(x[t : t + 1], *experts, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t]), f"token {t} differs alone vs in a batch of {x.shape[0]}"


def make_fp8_inputs(tokens, hidden, inter, experts, top_k, dtype=torch.bfloat16, seed=0, num_global=None,
                    block=(128, 128), weight_dtype=None):
    """``make_inputs`` and the experts' FP8 quantization: (x, w13, w2, weights, ids, (q13, q2, s13, s2))."""
    from mok_serve.kernels.fp8 import quantize_fp8_blocks

    x, w13, w2, weights, ids = make_inputs(tokens, hidden, inter, experts, top_k, dtype, seed, num_global, weight_dtype)
    (q13, s13), (q2, s2) = quantize_fp8_blocks(w13, block), quantize_fp8_blocks(w2, block)
    return x, w13, w2, weights, ids, (q13, q2, s13, s2)


# --------------------------------------------------------------------------------- GPU tests

DEV = "cuda"
_WEIGHTS: dict = {}


def fresh_seed() -> int:
    seed = torch.seed() % 2**31
    print(f"seed={seed}")
    return seed


def cached_weights(key, make):
    """``make()``, cached under ``key``; one key at a time (a family's full-size experts take up to
    34 GB), shared by every test module."""
    if key not in _WEIGHTS:
        _WEIGHTS.clear()
        torch.cuda.empty_cache()
        _WEIGHTS[key] = make()
    return _WEIGHTS[key]


@contextlib.contextmanager
def triton_compiles():
    """The names of the Triton kernels compiled (first calls of a variant in this process, from
    source or Triton's disk cache) inside the block, through the hook vLLM's JIT monitor uses."""
    from triton import knobs

    names: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(**kwargs):
        # Triton names a kernel by its __qualname__ ("outer.<locals>.never_ran" for a nested one).
        names.append(getattr(kwargs.get("fn"), "name", "?").rsplit(".", 1)[-1])
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    try:
        yield names
    finally:
        knobs.runtime.jit_post_compile_hook = previous


def check_warm_up_leaves_nothing_to_compile(call, warm, max_tokens: int, boundaries: list[int]):
    """After ``warm(example args of 1 token, max_tokens)`` (``kernels.warm_up``), ``call(tokens)``
    at random token counts up to ``max_tokens`` and at the variant ``boundaries`` compiles nothing;
    the hook does see a kernel that never ran (so an empty list means something)."""
    import triton
    import triton.language as tl

    warm()
    g = torch.Generator().manual_seed(fresh_seed())
    sizes = sorted({int(t) for t in torch.randint(1, max_tokens + 1, (40,), generator=g)} | {1, max_tokens, *boundaries})
    with triton_compiles() as names:
        for tokens in sizes:
            call(tokens)
        torch.cuda.synchronize()
    assert names == [], f"compiled after warm_up: {names} (token counts {sizes})"

    @triton.jit
    def never_ran(p, SEED: tl.constexpr):
        tl.store(p, SEED)

    with triton_compiles() as names:
        never_ran[(1,)](torch.empty(1, device=DEV, dtype=torch.int32), SEED=fresh_seed() % 1000)
    assert names == ["never_ran"]


def routing(tokens, experts, top_k, *, skewed=False, gen=None):
    ids = torch.rand(tokens, experts, device=DEV, generator=gen).argsort(dim=1)[:, :top_k]
    if skewed:  # half of all (token, k) assignments to expert 0 (duplicates within a token allowed)
        flat = ids.reshape(-1)
        pick = torch.randperm(flat.numel(), device=DEV, generator=gen)[: flat.numel() // 2]
        flat[pick] = 0
    w = torch.rand(tokens, top_k, device=DEV, generator=gen)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def poisoned_call(op, *args, **kw):
    """``op(*args, **kw)`` with the caching allocator's next block of the output's size filled
    with NaN first."""
    junk = torch.full_like(args[0], float("nan"))
    del junk  # the kernel's `out` is likely to reuse this NaN-filled block
    return op(*args, **kw)


# One-GPU checks run alike on bf16 experts (w13, w2) and FP8 ones (q13, q2, s13, s2): ``op`` is
# ``fused_moe`` or ``fused_moe_fp8``, called as ``op(x, *experts, topk_weights, topk_ids)``.


def _sizes(experts):
    """(experts, hidden, intermediate) of an experts tuple."""
    return experts[0].shape[0], experts[0].shape[2], experts[1].shape[2]


def check_batch_invariant(op, experts, configs, label):
    """A token alone equals itself at the start, middle and end of batches of 7, 128 and 4096
    tokens, bit for bit, and every call repeats bitwise; ``configs(tokens, top_k, E, H, I)`` (the
    tile configs) goes into a failure's message."""
    E, H, I = _sizes(experts)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    x1 = torch.randn(1, H, device=DEV, dtype=torch.bfloat16, generator=g)
    tw1, ids1 = routing(1, E, 8, gen=g)
    alone = op(x1, *experts, tw1, ids1)
    assert torch.equal(alone, op(x1, *experts, tw1, ids1))
    for batch in (7, 128, 4096):
        x = torch.randn(batch, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(batch, E, 8, gen=g)
        for pos in (0, batch // 2, batch - 1):
            xb, twb, idsb = x.clone(), tw.clone(), ids.clone()
            xb[pos], twb[pos], idsb[pos] = x1[0], tw1[0], ids1[0]
            out = op(xb, *experts, twb, idsb)
            assert torch.equal(out[pos], alone[0]), (label, batch, pos, configs(batch, 8, E, H, I))
        again = op(xb, *experts, twb, idsb)
        assert torch.equal(out, again), (label, batch, "not repeatable")


def check_graph_replay(op, experts):
    """Captured in a CUDA graph at 1, 64 and 2048 tokens, replays on new inputs (uniform, then
    skewed routing) equal the eager call bitwise."""
    E, H, _ = _sizes(experts)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for tokens in (1, 64, 2048):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, gen=g)
        op(x, *experts, tw, ids)  # warm up (compile) outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            op(x, *experts, tw, ids)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, *experts, tw, ids)
        for skewed in (False, True):
            x.copy_(torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g))
            tw_new, ids_new = routing(tokens, E, 8, skewed=skewed, gen=g)
            tw.copy_(tw_new)
            ids.copy_(ids_new)
            out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, op(x, *experts, tw, ids)), (tokens, skewed)


def check_heavy_tiles_give_the_same_bits(op, experts, token_counts, pick, heavy_variants):
    """Hot-expert tiles: ``op`` (``fused_moe_triton`` or ``fused_moe_fp8_triton``) with each of
    ``heavy_variants`` (keys added to both GEMM configs, ``HEAVY_M`` among them) gives the bits of
    ``pick(tokens)``'s configs at one tile height (``one_height``), with every token on the same
    experts, skewed and uniform routing; and a CUDA graph captured with the first variant at the
    first count follows each replay's counts (hot, uniform, hot)."""
    from mok_serve.kernels.cuda.configs import one_height

    E, H, _ = _sizes(experts)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())

    def inputs(tokens, kind):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, skewed=kind == "skewed", gen=g)
        if kind == "hot":
            ids[:] = ids[0]
        return x, tw, ids

    def pick_one_height(tokens):
        return tuple(one_height(c) for c in pick(tokens))

    for tokens in token_counts:
        configs = pick_one_height(tokens)
        for kind in ("hot", "skewed", "uniform"):
            x, tw, ids = inputs(tokens, kind)
            base = poisoned_call(op, x, *experts, tw, ids, configs=configs)
            for extra in heavy_variants:
                heavy = tuple(dict(c, **extra) for c in configs)
                assert torch.equal(poisoned_call(op, x, *experts, tw, ids, configs=heavy), base), (tokens, kind, extra)
    tokens, configs = token_counts[0], pick_one_height(token_counts[0])
    heavy = tuple(dict(c, **heavy_variants[0]) for c in configs)
    x, tw, ids = inputs(tokens, "uniform")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = op(x, *experts, tw, ids, configs=heavy)
    for kind in ("hot", "uniform", "hot"):
        new = inputs(tokens, kind)
        for old, fresh in zip((x, tw, ids), new):
            old.copy_(fresh)
        expect = op(x, *experts, tw, ids, configs=configs)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect), kind


def check_nan_stays_in_its_token(op, experts):
    """A NaN in token 2's input makes all of token 2's output NaN and no other token's."""
    E, H, _ = _sizes(experts)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for tokens in (5, 600):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, skewed=True, gen=g)
        x[2, 17] = float("nan")
        out = op(x, *experts, tw, ids)
        assert torch.isnan(out[2]).all()
        assert not torch.isnan(torch.cat([out[:2], out[3:]])).any()


def check_bad_ids_masked_and_reported(op, experts, reference, tol):
    """Unrouted slots (-1) drop out and the token's other experts still count; ids outside [-1, E)
    are masked too. The eager call does not synchronise (torch's sync debug mode would raise), and
    the next call raises ``ValueError`` naming the bad values; from a CUDA-graph replay as well,
    and ``check_ids()`` reports it. ``reference(x, tw, ids)`` is a higher-precision result."""
    from mok_serve.kernels import bad_ids

    E, H, _ = _sizes(experts)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    x = torch.randn(16, H, device=DEV, dtype=torch.bfloat16, generator=g)
    tw, ids = routing(16, E, 8, gen=g)
    op(x, *experts, tw, ids)  # compiled before the sync check
    bad = ids.clone()
    bad[3, 2] = E + 5
    bad[9, 0] = -4
    bad[5, 1] = bad[5, 6] = -1
    keep = (bad == ids).float()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = op(x, *experts, tw, bad)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rel_err(out, reference(x, tw * keep, ids)) <= tol
    with pytest.raises(ValueError, match=rf"found ids in \[-4, {E + 5}\] outside the valid range \[-1, {E}\)"):
        op(x, *experts, tw, ids)
    unrouted = ids.clone()
    unrouted[:, 7] = -1
    op(x, *experts, tw, unrouted)
    bad_ids.check_ids()  # -1 alone reports nothing
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = op(x, *experts, tw, bad)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(captured, reference(x, tw * keep, ids)) <= tol
    with pytest.raises(ValueError, match="outside the valid range"):
        bad_ids.check_ids()
    bad_ids.check_ids()


# ---------------------------------------------------- one-launch decode kernel (CPU and GPU tests)


def check_decode_one_launch_bits(tm, x, w13, w2, tw, ids, expert_map=None):
    """At decode sizes both GEMMs run as one launch and give the bits of the two launches;
    ``tm`` is the kernels.cuda.moe module (the interpreter tests reload it). Returns the output.

    Under the interpreter (CPU tensors) the one-launch kernel's 64-row heavy tiles (``HEAVY_M``)
    are compared within 1e-6 and its 16-row ones bit for bit: numpy's matmul, which stands in for
    ``tl.dot`` there, may order its sums by the tile's height. On the GPU every tile gives the bits."""
    tokens, hidden = x.shape
    num_local, two_i, _ = w13.shape
    g1, g2 = tm.pick_configs(tokens, ids.shape[1], num_local, hidden, two_i // 2, one_launch=True)
    assert tm.one_launch_decode(g1, g2)
    one = tm.fused_moe_triton(x, w13, w2, tw, ids, expert_map=expert_map, one_launch=True)
    two = tm.fused_moe_triton(x, w13, w2, tw, ids, expert_map=expert_map, one_launch=False)
    if x.is_cuda:
        assert torch.equal(one, two)
    else:
        light = tm.fused_moe_triton(x, w13, w2, tw, ids, expert_map=expert_map, configs=(dict(g1, HEAVY_M=0), g2))
        assert torch.equal(light, two)
        assert rel_err(one, two) <= 1e-6
    return one


def check_decode_wait_gives_up(tm, x, w13, w2, ids, configs=None):
    """A GEMM2 tile of the one-launch decode kernel whose GEMM1 tiles never run (their tickets
    taken beforehand) stops waiting after ``max_polls``: the error word is set and its rows of
    ``y`` are NaN; nothing hangs. Needs at least one scheduled row. ``configs``: the kernel's
    (default: ``pick_configs``')."""
    tokens, hidden = x.shape
    num_local, two_i, _ = w13.shape
    inter, top_k = two_i // 2, ids.shape[1]
    rows = tokens * top_k
    g1, g2 = configs or tm.pick_configs(tokens, top_k, num_local, hidden, inter, one_launch=True)
    counts = torch.empty(num_local, dtype=torch.int32, device=x.device)
    sorted_rows = torch.empty(rows, dtype=torch.int32, device=x.device)
    sync = torch.full((tm.decode_sync_words(rows, num_local, g1["BLOCK_M"]),), 7, dtype=torch.int32, device=x.device)
    tm.launch_schedule(ids, None, counts, sorted_rows, num_local, num_local, kernel=tm._moe_schedule_zero_kernel,
                       extra_programs=1, extra_args=(sync, sync.numel()))
    assert int(sync.abs().sum()) == 0, "the schedule launch zeroes the sync words"
    num_m = sync.numel() - tm.SYNC_TILES
    sync[tm.SYNC_TICKET] = num_m * -(-inter // g1["BLOCK_N"])  # every GEMM1 item already drawn
    act = torch.zeros(rows, inter, dtype=x.dtype, device=x.device)
    y = torch.zeros(rows, hidden, dtype=x.dtype, device=x.device)
    tm.launch_decode_experts(x, w13, w2, act, y, sorted_rows, counts, sync, rows, top_k, (g1, g2),
                             interpret=tm.interpreting(), max_polls=3)
    assert int(sync[tm.SYNC_ERROR]) == 1
    assert torch.isnan(y).all(), "every scheduled row's GEMM2 tile gave up"


def interpreted_cuda_modules():
    """``kernels.cuda``'s ``moe``, ``moe_fp8`` and ``ep`` modules with interpreted Triton kernels
    (set ``TRITON_INTERPRET=1`` first). Modules imported while it was unset hold compiled-mode
    kernels: then every module is reloaded, in import order, so that each one also holds the
    current functions of the tile modules it imports."""
    import importlib

    from mok_serve.kernels.cuda import configs, ep, ep_kernels, fp8_tiles, launch, moe, moe_fp8, tiles

    mods = [tiles, fp8_tiles, launch, configs, moe, moe_fp8, ep_kernels, ep]
    stale = False
    for m in mods:
        for name, obj in vars(m).items():
            kind = type(obj).__name__
            if kind == "JITFunction":
                stale = True
            elif kind == "InterpretedFunction":
                stale |= any(m is not src and getattr(src, name, obj) is not obj for src in (tiles, fp8_tiles))
    if stale:
        for m in mods:
            importlib.reload(m)
    return moe, moe_fp8, ep
