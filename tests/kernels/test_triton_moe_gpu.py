"""The Triton fused MoE on a CUDA GPU (Hopper): numerics, determinism, graphs, model-level greedy.

Run with ``pytest -m gpu``; skipped without CUDA. Every check draws fresh random inputs (the seed
is printed so a failure can be replayed) and poisons outputs where the kernel writes them.
"""

import types

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("triton")

from mok_serve.kernels import fused_moe, warm_up, warm_up_token_counts  # noqa: E402
from mok_serve.kernels.cuda import moe as triton_moe  # noqa: E402
from mok_serve.kernels.cuda.moe import fused_moe_triton, pick_configs  # noqa: E402
from moe_test_utils import (  # noqa: E402
    DEV, FAMILIES, SHAPES, cached_weights, check_bad_ids_masked_and_reported, check_batch_invariant, check_decode_one_launch_bits,
    check_warm_up_leaves_nothing_to_compile,
    check_decode_wait_gives_up, check_graph_replay, check_heavy_tiles_give_the_same_bits, check_nan_stays_in_its_token,
    fresh_seed, poisoned_call, rel_err, routing,
)


def weights_for(family, dtype=torch.bfloat16):
    """Full-size expert weights of a family (one family cached at a time: up to 34 GB)."""

    def make():
        s = SHAPES[family]
        E, H, I = s["routed_experts"], s["hidden"], s["moe_intermediate"]
        g = torch.Generator(device=DEV).manual_seed(fresh_seed())
        # Scaled in place: the caller may still hold the previous family's weights, and Kimi-K2's w13
        # alone is 21 GiB (an 80 GB H100 ran out of memory with a scaled copy beside it).
        w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=dtype, generator=g).div_(H**0.5)
        w2 = torch.randn(E, H, I, device=DEV, dtype=dtype, generator=g).div_(I**0.5)
        return w13, w2

    return cached_weights((family, dtype), make)


def ref_fp32(x, w13, w2, tw, ids, expert_map=None):
    """float32 reference, one expert at a time (the fp32 copy of all weights would not fit)."""
    T, K = ids.shape
    I = w13.shape[1] // 2
    local = ids.long()
    if expert_map is not None:
        local = expert_map.long()[local]
    y = torch.zeros(T, K, x.shape[1], device=DEV, dtype=torch.float32)
    flat = local.reshape(-1)
    for e in torch.unique(flat).tolist():
        if e < 0:
            continue
        r = (flat == e).nonzero().squeeze(1)
        gu = x[r // K].float() @ w13[e].float().t()
        a = F.silu(gu[:, :I]) * gu[:, I:]
        y.view(T * K, -1)[r] = a @ w2[e].float().t()
    return (y * tw.float().unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_against_fp32_reference(family):
    w13, w2 = weights_for(family)
    E, H = w13.shape[0], w13.shape[2]
    top_k = SHAPES[family]["top_k"]
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for tokens in (1, 7, 128, 1024):
        for skewed in (False, True):
            x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
            tw, ids = routing(tokens, E, top_k, skewed=skewed, gen=g)
            out = poisoned_call(fused_moe, x, w13, w2, tw, ids)
            assert out.shape == x.shape and out.dtype == x.dtype
            err = rel_err(out, ref_fp32(x, w13, w2, tw, ids))
            print(f"{family} T={tokens} skewed={skewed} rel_err={err:.2e}")
            assert err <= 1e-2, (family, tokens, skewed, err)


def test_fp16_and_int64_ids():
    w13, w2 = weights_for("Qwen3-30B-A3B", torch.float16)
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    x = torch.randn(37, w13.shape[2], device=DEV, dtype=torch.float16, generator=g)
    tw, ids = routing(37, w13.shape[0], 8, gen=g)
    out = fused_moe(x, w13, w2, tw.half(), ids.long())
    assert rel_err(out, ref_fp32(x, w13, w2, tw, ids)) <= 5e-3


def test_bitwise_repeatable_and_batch_invariant():
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        check_batch_invariant(fused_moe, weights_for(family), pick_configs, family)


def test_cuda_graph_capture_and_replay_with_new_data():
    check_graph_replay(fused_moe, weights_for("Qwen3-30B-A3B"))


def test_expert_map_with_remote_experts():
    w13, w2 = weights_for("Qwen3-235B-A22B")
    local, H = w13.shape[0], w13.shape[2]
    num_global = 2 * local
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    perm = torch.randperm(num_global, device=DEV, generator=g)
    expert_map = torch.full((num_global,), -1, device=DEV, dtype=torch.int32)
    expert_map[perm[:local]] = torch.arange(local, device=DEV, dtype=torch.int32)
    for tokens in (1, 33, 700):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, num_global, 8, gen=g)
        out = poisoned_call(fused_moe, x, w13, w2, tw, ids, expert_map=expert_map)
        assert rel_err(out, ref_fp32(x, w13, w2, tw, ids, expert_map)) <= 1e-2
    # A token routed only to remote experts is exactly zero.
    remote = perm[local : local + 8].to(torch.int32)
    ids[0] = remote
    out = fused_moe(x, w13, w2, tw, ids, expert_map=expert_map)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_unrouted_and_out_of_range_ids_without_a_host_sync():
    w13, w2 = weights_for("Qwen3-235B-A22B")
    check_bad_ids_masked_and_reported(fused_moe, (w13, w2), lambda x, tw, ids: ref_fp32(x, w13, w2, tw, ids), 1e-2)


def test_weights_tma_cannot_read_take_pointer_loads_with_the_same_bits():
    """Weight tiles come by TMA where the weights are contiguous with 16-byte rows, else by pointer
    loads: both give the same bits, and rows of 200 / 72 bytes still match the reference."""
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    E, H, I, K, T = 8, 256, 128, 2, 300
    w13 = torch.randn(E, 2 * I, 2 * H, device=DEV, dtype=torch.bfloat16, generator=g) / H**0.5
    w2 = torch.randn(E, 2 * H, I, device=DEV, dtype=torch.bfloat16, generator=g) / I**0.5
    strided13, strided2 = w13[:, :, :H], w2[:, ::2, :]  # non-contiguous: no TMA
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    tw, ids = routing(T, E, K, gen=g)
    by_tma = poisoned_call(fused_moe, x, strided13.contiguous(), strided2.contiguous(), tw, ids)
    by_pointer = poisoned_call(fused_moe, x, strided13, strided2, tw, ids)
    assert torch.equal(by_tma, by_pointer)
    assert rel_err(by_tma, ref_fp32(x, strided13, strided2, tw, ids)) <= 1e-2
    H, I = 100, 36  # 200- and 72-byte rows
    w13 = torch.randn(E, 2 * I, H, device=DEV, dtype=torch.bfloat16, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, device=DEV, dtype=torch.bfloat16, generator=g) / I**0.5
    x = torch.randn(T, H, device=DEV, dtype=torch.bfloat16, generator=g)
    out = poisoned_call(fused_moe, x, w13, w2, tw, ids)
    assert rel_err(out, ref_fp32(x, w13, w2, tw, ids)) <= 1e-2


def test_tile_regimes_give_the_same_bits():
    """What batch invariance rests on: the decode regime's swapped 16-row tiles (128-deep K blocks),
    the 64-row and the 128-row tiles give every row the same bits, with TMA or pointer weights."""
    w13, w2 = weights_for("Qwen3-30B-A3B")
    E, H, I = w13.shape[0], w13.shape[2], w2.shape[2]
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    others = [pick_configs(512, 8, E, H, I), pick_configs(8192, 8, E, H, I)]
    assert pick_configs(1, 8, E, H, I)[0].get("SWAP_AB") and not any(c[0].get("SWAP_AB") for c in others)
    for tokens in (1, 9, 100):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, gen=g)
        decode = poisoned_call(fused_moe_triton, x, w13, w2, tw, ids)
        for configs in others:
            assert torch.equal(fused_moe_triton(x, w13, w2, tw, ids, configs=configs), decode), (tokens, configs)
    # Swapped tiles with pointer weight loads (strided weights): the same bits as by TMA.
    E, H, I = 16, 512, 256
    w13 = torch.randn(E, 2 * I, 2 * H, device=DEV, dtype=torch.bfloat16, generator=g)[:, :, :H] / H**0.5
    w2 = torch.randn(E, H, 2 * I, device=DEV, dtype=torch.bfloat16, generator=g)[:, :, :I] / I**0.5
    x = torch.randn(3, H, device=DEV, dtype=torch.bfloat16, generator=g)
    tw, ids = routing(3, E, 4, gen=g)
    assert pick_configs(3, 4, E, H, I)[0].get("SWAP_AB")
    by_pointer = poisoned_call(fused_moe, x, w13, w2, tw, ids)
    assert torch.equal(by_pointer, fused_moe(x, w13.contiguous(), w2.contiguous(), tw, ids))
    assert rel_err(by_pointer, ref_fp32(x, w13, w2, tw, ids)) <= 1e-2


def test_two_launch_heavy_tiles_give_the_same_bits():
    """Hot experts' tiles beside the 64-row ones (the default's: an expert with more than 64 rows
    in 128-row tiles with 3 stages; the sweep's 2 stages with half tails): the same bits as one
    tile height."""
    for family in ("DeepSeek-V3", "Qwen3-30B-A3B"):
        experts = weights_for(family)
        E, H, I = experts[0].shape[0], experts[0].shape[2], experts[1].shape[2]
        for t in (300, 700):
            g1, g2 = pick_configs(t, 8, E, H, I)
            assert g1["BLOCK_M"] == 64 and g1["HEAVY_M"] == g2["HEAVY_M"] == 128, (family, t)
        check_heavy_tiles_give_the_same_bits(
            fused_moe_triton, experts, (300, 700), lambda t: pick_configs(t, 8, E, H, I),
            [dict(HEAVY_M=128, HEAVY_STAGES=3), dict(HEAVY_M=128, HEAVY_STAGES=2, HALF_TAIL=True)],
        )


def test_decode_one_launch_gives_the_two_launches_bits():
    """Both GEMMs as one launch at decode sizes (GEMM2 tiles wait on GEMM1's row tiles inside the
    kernel): the same bits as two launches, and the float32 reference, for every family at 1, 8
    and 100 tokens (uniform and skewed routing: the hot expert runs many 16-row tiles), also with
    GEMM1's items row-tile major, GEMM2's in groups of row tiles, and 16- or 32-row tiles for
    experts with more than 16 rows instead of the default's 64 (HEAVY_M), and with an expert map; a wait that never ends gives up
    (error word, NaN rows) instead of hanging."""
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    for family in FAMILIES:
        w13, w2 = weights_for(family)
        E, H = w13.shape[0], w13.shape[2]
        for tokens in (1, 8, 100):
            for skewed in (False, True):
                x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
                tw, ids = routing(tokens, E, 8, skewed=skewed, gen=g)
                out = check_decode_one_launch_bits(triton_moe, x, w13, w2, tw, ids)
                assert rel_err(out, ref_fp32(x, w13, w2, tw, ids)) <= 1e-2, (family, tokens, skewed)
                g1, g2 = pick_configs(tokens, 8, E, H, w2.shape[2], one_launch=True)
                if triton_moe.one_launch_decode(g1, g2):  # GEMM1 items row-tile major, not in groups: the order only
                    ungrouped = triton_moe.fused_moe_triton(x, w13, w2, tw, ids, configs=(dict(g1, GROUP_M=1), g2))
                    assert torch.equal(ungrouped, out), (family, tokens, skewed, "GROUP_M=1")
                    grouped2 = triton_moe.fused_moe_triton(x, w13, w2, tw, ids, configs=(g1, dict(g2, GROUP_M=4)))
                    assert torch.equal(grouped2, out), (family, tokens, skewed, "GEMM2 GROUP_M=4")
                    assert g1.get("HEAVY_M") == 64  # the default: heavy tiles where an expert has > 16 rows
                    for heavy_m in (0, 32):
                        other = triton_moe.fused_moe_triton(x, w13, w2, tw, ids, configs=(dict(g1, HEAVY_M=heavy_m), g2))
                        assert torch.equal(other, out), (family, tokens, skewed, f"HEAVY_M={heavy_m}")
        expert_map = torch.randperm(2 * E, device=DEV, generator=g).to(torch.int32)
        expert_map = torch.where(expert_map < E, expert_map, -1).to(torch.int32)
        tw, ids = routing(8, 2 * E, 8, gen=g)
        out = check_decode_one_launch_bits(triton_moe, x[:8], w13, w2, tw, ids, expert_map)
        assert rel_err(out, ref_fp32(x[:8], w13, w2, tw, ids, expert_map)) <= 1e-2, (family, "expert map")
    check_decode_wait_gives_up(triton_moe, x[:3], w13, w2, routing(3, E, 8, gen=g)[1])


def test_decode_timeline_records_every_item_and_changes_no_bits():
    """``timeline`` (the profile's per-item records): one record per work item that has rows,
    drawn <= ready <= done on the GPU clock, GEMM1 items never waiting, and the same output bits."""
    g = torch.Generator(device=DEV).manual_seed(fresh_seed())
    w13, w2 = weights_for("Qwen3-30B-A3B")
    E, two_i, H = w13.shape
    for tokens in (1, 2, 8):
        x = torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16, generator=g)
        tw, ids = routing(tokens, E, 8, gen=g)
        configs = pick_configs(tokens, 8, E, H, two_i // 2, one_launch=True)
        n1, n2 = triton_moe.decode_items(tokens * 8, E, H, two_i // 2, configs)
        buf = torch.zeros(n1 + n2, triton_moe.TIMELINE_WORDS, dtype=torch.int64, device=DEV)
        out = fused_moe_triton(x, w13, w2, tw, ids, configs=configs, timeline=buf)
        assert torch.equal(out, fused_moe_triton(x, w13, w2, tw, ids, configs=configs))
        rec = buf.cpu()
        used = rec[:, 4] > 0  # an item's columns
        in_use_tiles = int(torch.unique(ids).numel())  # one 16-row tile per expert with rows at <= 8 rows
        assert int(used[:n1].sum()) == in_use_tiles * -(-(two_i // 2) // configs[0]["BLOCK_N"])
        narrow = min(in_use_tiles, configs[1].get("NARROW_TAIL", 0))  # row tiles with half-width GEMM2 items
        bn2 = configs[1]["BLOCK_N"]
        assert int(used[n1:].sum()) == (in_use_tiles - narrow) * -(-H // bn2) + narrow * -(-H // (bn2 // 2))
        # Every column of every tile in use, once.
        assert int(rec[:n1, 4].sum()) == in_use_tiles * (two_i // 2) and int(rec[n1:, 4].sum()) == in_use_tiles * H
        r = rec[used]
        assert bool((r[:, 0] <= r[:, 1]).all() and (r[:, 1] <= r[:, 2]).all() and (r[:, 0] > 0).all())
        assert bool((rec[:n1][used[:n1], 0] == rec[:n1][used[:n1], 1]).all())
        assert int(r[:, 2].max() - r[:, 0].min()) < 10**7  # within 10 ms
    with pytest.raises(ValueError, match="one-launch decode kernel"):
        fused_moe_triton(x, w13, w2, tw, ids, configs=pick_configs(8, 8, E, H, two_i // 2), timeline=buf)


def test_nan_stays_in_its_token():
    check_nan_stays_in_its_token(fused_moe, weights_for("Qwen3-235B-A22B"))


# --------------------------------------------------------------------------- model level


def _kittens_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index)


def _greedy(model, tok, prompts, new_tokens):
    outs = []
    for p in prompts:
        enc = tok(p, return_tensors="pt").to(DEV)
        seq = model.generate(**enc, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        outs.append(seq[0, enc["input_ids"].shape[1] :].tolist())
    return outs


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_model_greedy_tokens_match_transformers(family, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mok_serve.tiny_models import build_tiny_model

    path = build_tiny_model(family, cache_dir=tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEV).eval()
    experts = [m for m in model.modules() if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj")]
    assert experts, "no 3-D experts modules found"
    print(family, "transformers experts implementation:", model.config._experts_implementation)
    prompts = ["The quick brown fox", "Once upon a time, in a small village", "Numbers: one two three"]
    with torch.no_grad():
        theirs = _greedy(model, tok, prompts, 16)
        for m in experts:
            m.forward = types.MethodType(_kittens_experts_forward, m)
        ours = _greedy(model, tok, prompts, 16)
    print(family, theirs, ours)
    assert ours == theirs


def test_warm_up_leaves_nothing_to_compile():
    """A server that ran kernels.warm_up at start-up never stalls on a compile: before it, vLLM's
    warm-up (its largest batch, the captured sizes) left Qwen3-30B-A3B's 769-2560-token variant to
    a serving step, a 1.7 s stall (loadtest/results/h200_serving/qwen3-30b-a3b)."""
    w13, w2 = weights_for("Qwen3-30B-A3B")
    E, H, I = w13.shape[0], w13.shape[2], w13.shape[1] // 2
    max_tokens = 3000
    assert warm_up_token_counts(E, H, I, 8, max_tokens) == [1, 2, 3, 33, 129, 257, 769, 2561]

    def args(tokens):
        tw, ids = routing(tokens, E, 8)
        return torch.randn(tokens, H, device=DEV, dtype=torch.bfloat16), w13, w2, tw, ids

    def warm():
        assert warm_up(*args(1), max_tokens) == warm_up_token_counts(E, H, I, 8, max_tokens)

    check_warm_up_leaves_nothing_to_compile(lambda t: fused_moe(*args(t)), warm, max_tokens, [768, 769, 2560, 2561])
