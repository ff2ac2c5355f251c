"""The vLLM glue's CUDA expert-parallel branch (``mok_serve/vllm/expert_parallel.py``) on the GPUs
of the machine (up to 2; spawned ranks, NCCL group).

The GPU machines have no vLLM, so each rank installs stand-ins for the vLLM names the module
imports (the passthrough backend's name, ``get_ep_group``, the forward context, ``init_logger``,
``current_platform``); ``get_ep_group()`` returns the rank's real groups: NCCL for the device, gloo
for the CPU side, as vLLM's ``GroupCoordinator`` has them; under DP the forward context holds every
DP rank's token count, as vLLM's ``DPMetadata`` does, so calls are sized by the step's largest
count (below the workspace limit here). Everything else is the glue's own code: the workspace made at
the first call from the all-gathered expert maps, shared by every layer, ``ep_fused_moe`` and
``ep_fused_moe_fp8`` as vLLM's experts call them (per-rank tokens under DP, replicated tokens
under TP), a CUDA graph replay, and the per-layer timing's phase stamps. Each result is compared
bitwise with one-GPU ``fused_moe`` on the global inputs.
"""

import functools
import sys
import types

import pytest
import rank_runner
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA GPUs", allow_module_level=True)

WORLD = min(2, torch.cuda.device_count())
H, I, E, K = 512, 256, 16, 4
MAX_T = 96


def install_vllm_stand_ins(rank, world, dp_tokens):
    """vLLM's names used by expert_parallel.py, backed by this rank's real process groups;
    ``dp_tokens``: every DP rank's token count in the forward context (None: no DP metadata)."""
    import logging

    import torch.distributed as dist

    group = types.SimpleNamespace(world_size=world, rank_in_group=rank, device_group=dist.group.WORLD,
                                  cpu_group=dist.new_group(backend="gloo"))
    dp = None if dp_tokens is None else types.SimpleNamespace(num_tokens_across_dp_cpu=torch.tensor(dp_tokens))
    context = types.SimpleNamespace(dp_metadata=dp)
    names = {
        "vllm": {},
        "vllm.config": {},
        "vllm.config.kernel": {"PASSTHROUGH_ALL2ALL_BACKEND": "passthrough"},
        "vllm.distributed": {"get_ep_group": lambda: group},
        "vllm.forward_context": {"get_forward_context": lambda: context, "is_forward_context_available": lambda: True},
        "vllm.logger": {"init_logger": logging.getLogger},
        "vllm.platforms": {"current_platform": types.SimpleNamespace(is_cpu=lambda: False, is_cuda=lambda: True)},
    }
    for name, attrs in names.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        sys.modules[name] = module


def layer_inputs(seed, counts, quant):
    """Global tokens, experts and routing of one layer, the same on every rank."""
    from ep_sim import global_inputs

    return global_inputs(seed, counts, E, world=WORLD, hidden=H, inter=I, top_k=K, quant=quant)


def vllm_expert_map(rank, world):
    """vLLM's map for a linear placement: global id -> local id on this rank, -1 elsewhere."""
    per_rank = E // world
    m = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    m[rank * per_rank : (rank + 1) * per_rank] = torch.arange(per_rank, dtype=torch.int32, device="cuda")
    return m


def scenario_glue(rank, world, quant, replicated):
    counts = [MAX_T] if replicated else [37, 64][:world]
    install_vllm_stand_ins(rank, world, None if replicated else counts)
    from ep_sim import local_experts

    from mok_serve import kernels
    from mok_serve.kernels.cuda.ep import ExpertPlacement
    from mok_serve.vllm import expert_parallel as glue
    from mok_serve.vllm import timing

    glue.configure(MAX_T, replicated_tokens=replicated)
    placement = ExpertPlacement.linear(E, world)
    emap = vllm_expert_map(rank, world)
    op = glue.ep_fused_moe_fp8 if quant == "fp8" else glue.ep_fused_moe
    one_gpu = kernels.fused_moe_fp8 if quant == "fp8" else kernels.fused_moe

    def mine(t, counts=counts):  # this rank's share of a global per-token tensor
        if replicated:
            return t
        start = sum(counts[:rank])
        return t[start : start + counts[rank]]

    def call(x, experts, weights, ids, slot=-1):
        w13, w2, *scales = local_experts(experts, placement, rank)
        return op(mine(x), w13, w2, *scales, mine(weights), mine(ids), emap, slot)

    log = []
    for layer in range(3):  # one workspace serves every layer
        x, experts, weights, ids = layer_inputs(10 * layer + (quant == "fp8"), counts, quant)
        out = call(x, experts, weights, ids)
        assert torch.equal(out, mine(one_gpu(x, *experts, weights, ids))), f"layer {layer} differs from one GPU"
    ws = glue._Workspace.instance
    assert ws.world_size == world and ws.replicated == replicated and ws.quant == quant
    if not replicated:  # the call's rows are laid out by the step's largest count, not by MAX_T
        bound = max(counts)
        for s in range(world):
            start = sum(counts[:s])
            assert torch.equal(ws.all_ids[s * bound : s * bound + counts[s]], ids[start : start + counts[s]])
    log.append(f"{quant} {'replicated' if replicated else 'per-rank'} tokens: 3 layers bitwise OK")

    # A CUDA graph of the op, replayed with new inputs written into its buffers (vLLM's decode graphs).
    x, experts, weights, ids = layer_inputs(100, counts, quant)
    xs, ws_, is_ = mine(x).clone(), mine(weights).clone(), mine(ids).clone()
    w13, w2, *scales = local_experts(experts, placement, rank)
    op(xs, w13, w2, *scales, ws_, is_, emap, -1)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gout = op(xs, w13, w2, *scales, ws_, is_, emap, -1)
    for seed in (101, 102):
        x2, _, wt2, ids2 = layer_inputs(seed, counts, quant)
        xs.copy_(mine(x2))
        ws_.copy_(mine(wt2))
        is_.copy_(mine(ids2))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gout, mine(one_gpu(x2, *experts, wt2, ids2))), f"graph replay {seed} differs"
    log.append("graph: 2 replays bitwise OK")

    # Per-layer timing: the workspace stamps the experts and combine phases between the caller's marks.
    reg = timing._Registry()
    timing.REGISTRY = reg
    timer = timing.TritonLayerTimer(
        0, "model.layers.0.mlp.experts", 0, E, K, (emap >= 0).nonzero().flatten().tolist(), rank, world, "KittensExperts",
        timing.TimingConfig(1, 16), torch.device("cuda"),
    )  # fmt: skip
    reg.layers.append(timer)
    for _ in range(4):
        mids = timing.mark(mine(ids), 0, timing.BEGIN)
        out = op(mine(x), w13, w2, *scales, mine(weights), mids, emap, 0)
        out = timing.mark(out, 0, timing.END)
    torch.cuda.synchronize()
    stats = timer.snapshot()["rank_stats"]
    assert stats["calls"] == 4 and stats["sampled_calls"] == 4
    phases = stats["phases_ms"]
    assert all(phases[p]["mean"] > 0 for p in ("dispatch", "experts", "combine")), phases
    log.append("timing: " + ", ".join(f"{p} {phases[p]['mean'] * 1e3:.1f} us" for p in ("dispatch", "experts", "combine")))
    ws.check_errors()
    return "\n".join(log)


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("replicated", [False, True], ids=["dp", "tp"])
def test_vllm_glue_cuda_ep(quant, replicated):
    rank_runner.run_ranks(functools.partial(scenario_glue, quant=quant, replicated=replicated), WORLD,
                          backend="nccl", timeout=600, join_timeout=30)
