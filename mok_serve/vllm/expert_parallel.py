"""Kittens' own dispatch and combine under vLLM expert parallelism.

With ``--moe-backend kittens --enable-expert-parallel`` (and more than one rank), kittens binds
vLLM's ``passthrough`` all-to-all: vLLM then hands each rank's tokens straight to the experts and
skips its own all-reduce, and the experts run a kittens EP workspace over vLLM's EP group: on the
CPU ``SharedMemoryEPWorkspace`` (pull-based dispatch and fixed-order combine over shared memory
between the worker processes), on CUDA ``SymmetricMemoryEPWorkspace`` (the same over torch
symmetric memory and NVLink, Triton kernels, no host synchronisation). Under tensor parallelism
without data parallelism every rank holds the same tokens, so the workspace runs in its
replicated-tokens mode. The workspace is made at the first MoE call (vLLM's profiling run,
before any CUDA graph is captured) and serves every layer.

Nodes: ranks map each other's memory inside a node only. The node layout comes from the ranks'
host names when the workspace is made (any launcher), or from ``MOK_EP_NODE_SIZE`` (ranks per node,
to run a multi-node layout on one host). On the CPU an EP group over several nodes runs the
workspace's two-level exchange (collectives between nodes, kernels/cpu/ep.py); on GPUs it is
refused at start-up with a message saying what to run instead: from vLLM's parallel config in the
API server (data parallel ranks on other nodes, a DP replica across nodes), and again from the
host names, or a layout whose hosts are not whole blocks of consecutive ranks.
"""

import socket


import torch
from vllm.config.kernel import PASSTHROUGH_ALL2ALL_BACKEND
from vllm.distributed import get_ep_group
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.platforms import current_platform

from mok_serve.kernels.cpu.ep import ExpertPlacement, SharedMemoryEPWorkspace
from mok_serve.kernels.env import knob
from mok_serve.vllm import KITTENS, timing

logger = init_logger("vllm.mok_serve")

DEFAULT_ALL2ALL = "allgather_reducescatter"


def kittens_owns_dispatch(parallel_config) -> bool:
    ranks = parallel_config.tensor_parallel_size * parallel_config.data_parallel_size
    on_supported_device = current_platform.is_cpu() or current_platform.is_cuda()
    return on_supported_device and parallel_config.enable_expert_parallel and ranks > 1


def ep_nodes_from_config(parallel_config) -> int:
    """How many nodes vLLM's parallel config puts the EP group on (1 where it says nothing more):
    data parallel ranks spread over ``data_parallel_size / data_parallel_size_local`` node groups,
    and each DP replica over ``nnodes_within_dp`` nodes. With an external load balancer every DP
    rank is launched alone (one local rank, wherever it runs): the host check decides there."""
    dp, dp_local = parallel_config.data_parallel_size, parallel_config.data_parallel_size_local
    external = getattr(parallel_config, "data_parallel_external_lb", False)
    dp_node_groups = dp // dp_local if dp > 1 and 0 < dp_local < dp and not external else 1
    return dp_node_groups * max(1, parallel_config.nnodes_within_dp)


def multi_node_error(nodes: int, ranks: int, how: str) -> str:
    return (
        f"--moe-backend kittens runs GPU expert parallelism inside one node (every EP rank maps every other "
        f"rank's memory; across nodes on CPUs only, so far), but this EP group of {ranks} ranks spans {nodes} "
        f"nodes ({how}). Keep the EP group "
        f"on one node (expert parallelism over one node's GPUs, data parallelism without EP across nodes), "
        f"or serve with --moe-backend auto for vLLM's all-to-all across nodes."
    )


def node_size_of(hosts: list[str], forced: int = 0, *, multi_node: bool) -> int:
    """Ranks per node of an EP group whose host names are ``hosts`` in rank order: ``forced``
    (``MOK_EP_NODE_SIZE``, a layout simulated on one host) where set, else the ranks of one host.
    Raises ``RuntimeError`` (``multi_node_error``) for more than one node unless ``multi_node``
    (the transport has a two-level exchange), and for nodes that are not equal blocks of
    consecutive ranks."""
    ranks, distinct = len(hosts), list(dict.fromkeys(hosts))
    if forced:
        size, how = forced, f"MOK_EP_NODE_SIZE={forced}"
        if ranks % size:
            raise RuntimeError(f"kittens EP: MOK_EP_NODE_SIZE={size} does not divide the EP group's {ranks} ranks")
    else:
        size, how = ranks // len(distinct), "hosts " + ", ".join(distinct)
        blocks = [hosts[i : i + size] for i in range(0, ranks, size)]
        if ranks % len(distinct) or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
            raise RuntimeError(f"kittens EP: the EP group's ranks must be equal blocks of consecutive ranks per host; "
                               f"got {hosts}")
    if size < ranks and not multi_node:
        raise RuntimeError(multi_node_error(ranks // size, ranks, how))
    return size


def bind_all2all_backend(moe_backend: str, parallel_config, stock_bind) -> None:
    """``vllm.config.kernel.bind_passthrough_all2all_backend`` with kittens added."""
    if moe_backend != KITTENS:
        stock_bind(moe_backend, parallel_config)
        return
    if not kittens_owns_dispatch(parallel_config):
        return
    a2a = parallel_config.all2all_backend
    if a2a not in (DEFAULT_ALL2ALL, PASSTHROUGH_ALL2ALL_BACKEND):
        raise ValueError(
            f"--moe-backend kittens dispatches and combines itself under expert parallelism and "
            f"cannot be paired with --all2all-backend {a2a}; leave --all2all-backend unset."
        )
    if parallel_config.enable_eplb:
        # The placement is exchanged once, at the first call; EPLB moves experts at run time.
        raise ValueError("--moe-backend kittens does not support --enable-eplb yet")
    nodes = ep_nodes_from_config(parallel_config)
    if nodes > 1 and not current_platform.is_cpu():  # (the CPU workspace exchanges rows between nodes)
        ranks = parallel_config.tensor_parallel_size * parallel_config.data_parallel_size
        raise ValueError(multi_node_error(
            nodes, ranks, f"--data-parallel-size {parallel_config.data_parallel_size} with "
            f"{parallel_config.data_parallel_size_local} local, --nnodes {parallel_config.nnodes}"))
    parallel_config.all2all_backend = PASSTHROUGH_ALL2ALL_BACKEND


class _Workspace:
    """One workspace per worker process, made at the first MoE call and shared by every layer."""

    instance = None
    max_tokens: int = 0
    replicated: bool = False


def configure(max_tokens_per_rank: int, replicated_tokens: bool) -> None:
    _Workspace.max_tokens = max(_Workspace.max_tokens, max_tokens_per_rank)
    _Workspace.replicated = replicated_tokens


def _workspace(hidden_states, topk_ids, expert_map, quant: str | None = None):
    """``quant="fp8"`` for block-FP8 experts: every MoE layer of a model is quantized alike, so the
    first call decides (the CUDA workspace sizes its segment for e4m3 rows and their scales)."""
    ws = _Workspace.instance
    if ws is None:
        group = get_ep_group()
        hosts = [None] * group.world_size
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=group.cpu_group)
        node_size = node_size_of(hosts, knob("ep_node_size"), multi_node=not hidden_states.is_cuda)
        maps = [torch.empty_like(expert_map, device="cpu") for _ in range(group.world_size)]
        torch.distributed.all_gather(maps, expert_map.cpu().contiguous(), group=group.cpu_group)
        extra = {}
        if hidden_states.is_cuda:
            from mok_serve.kernels.cuda.ep import SymmetricMemoryEPWorkspace as workspace_cls

            process_group, transport = group.device_group, "symmetric memory"
            extra["quant"] = quant
        else:
            # The CPU workspace moves activation rows and serves both kinds of experts.
            workspace_cls, process_group, transport = SharedMemoryEPWorkspace, group.cpu_group, "shared memory"
            extra["node_size"] = node_size
            if node_size < group.world_size:
                transport = f"shared memory in nodes of {node_size} rank{'s' if node_size > 1 else ''}, collectives between them"
        ws = workspace_cls(
            process_group,
            **extra,
            max_tokens_per_rank=_Workspace.max_tokens,
            hidden_size=hidden_states.shape[1],
            top_k=topk_ids.shape[1],
            dtype=hidden_states.dtype,
            placement=ExpertPlacement.from_expert_maps(maps),
            replicated_tokens=_Workspace.replicated,
        )
        _Workspace.instance = ws
        logger.info(
            "kittens EP: rank %d of %d dispatches and combines over %s (%s tokens)",
            ws.rank, ws.world_size, transport, "replicated" if ws.replicated else "per-rank",
        )
    return ws


def _max_tokens_across_ranks(ws) -> int | None:
    """The most tokens any EP rank holds in this step, the same number on every rank: under data
    parallelism vLLM's forward context has every DP rank's count (sequence parallelism only splits
    them further). It sizes the CUDA call's grids by the step instead of by the workspace limit.
    None (the workspace limit) without data parallelism: replicated tokens bound themselves."""
    if ws.replicated or not is_forward_context_available():
        return None
    dp = get_forward_context().dp_metadata
    if dp is None:
        return None
    return min(int(dp.num_tokens_across_dp_cpu.max()), ws.max_tokens)


@torch.library.custom_op("mok_serve::ep_fused_moe", mutates_args=())
def ep_fused_moe(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor,
    timing_slot: int = -1,
) -> torch.Tensor:
    """``timing_slot``: the layer's slot in ``timing`` (-1: not timed); its dispatch, experts and
    combine phases are stamped inside the workspace, the only place they are separable."""
    ws = _workspace(hidden_states, topk_ids, expert_map)
    return ws.fused_moe(hidden_states, w13, w2, topk_weights, topk_ids, on_phase=timing.phase_marker(timing_slot),
                        max_tokens_across_ranks=_max_tokens_across_ranks(ws))


@ep_fused_moe.register_fake
def _ep_fused_moe_shape(hidden_states, w13, w2, topk_weights, topk_ids, expert_map, timing_slot=-1):
    return torch.empty_like(hidden_states)


@torch.library.custom_op("mok_serve::ep_fused_moe_fp8", mutates_args=())
def ep_fused_moe_fp8(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor,
    timing_slot: int = -1,
) -> torch.Tensor:
    ws = _workspace(hidden_states, topk_ids, expert_map, quant="fp8")
    return ws.fused_moe_fp8(
        hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, on_phase=timing.phase_marker(timing_slot),
        max_tokens_across_ranks=_max_tokens_across_ranks(ws),
    )


@ep_fused_moe_fp8.register_fake
def _ep_fused_moe_fp8_shape(hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, expert_map,
                            timing_slot=-1):  # fmt: skip
    return torch.empty_like(hidden_states)
