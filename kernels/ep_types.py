"""Types shared by the two expert-parallel workspaces (``cpu/ep.py``, ``cuda/ep.py``): the protocol
both implement (``EPWorkspace``, whose calls are the op's, ``FusedMoe``, plus the EP keywords), where
each global expert lives, the error a late peer raises, and a call's token bound."""

from dataclasses import dataclass
from typing import Callable, Protocol

import torch

__all__ = ["EPWorkspace", "ExpertPlacement", "FusedMoe", "FusedMoeFp8", "PeerTimeoutError", "call_bound"]


class FusedMoe(Protocol):
    """The op (``kernels.fused_moe`` and each device's implementation: ``cuda.moe.fused_moe_triton``,
    ``cpu.moe.fused_moe_cpu``, ``reference.fused_moe_reference``): the routed experts of one MoE
    layer, ``[T, H]`` in the input dtype; arguments and semantics in ``reference.py``. Device
    implementations may add keyword knobs (``pdl=``, ``one_launch=`` on CUDA, default from
    ``env.py`` at call time)."""

    def __call__(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                 expert_map: torch.Tensor | None = None, activation: str = "silu") -> torch.Tensor: ...


class FusedMoeFp8(Protocol):
    """The FP8 op (``kernels.fused_moe_fp8``): as ``FusedMoe`` with block-scaled FP8 weights and
    their scales (``fp8.py``)."""

    def __call__(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 w13_scale: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                 topk_ids: torch.Tensor, *, expert_map: torch.Tensor | None = None, activation: str = "silu",
                 block_shape: tuple[int, int] = (128, 128)) -> torch.Tensor: ...


class EPWorkspace(Protocol):
    """An expert-parallel workspace (``cpu.ep.SharedMemoryEPWorkspace``,
    ``cuda.ep.SymmetricMemoryEPWorkspace``): one per process group, built collectively with
    ``(group, *, max_tokens_per_rank, hidden_size, top_k, dtype, placement, replicated_tokens=False,
    timeout_s=None)`` (``timeout_s`` default ``MOK_EP_TIMEOUT_S``, read at construction).

    ``fused_moe`` / ``fused_moe_fp8`` take the op's arguments (``FusedMoe`` / ``FusedMoeFp8``) for
    this rank's tokens, with the expert map given by ``placement`` instead of ``expert_map``, and
    return this rank's ``[T, H]`` output, bitwise the one-GPU op on the global inputs. Keywords:
    ``layer`` (named in errors), ``on_phase(name)`` (called on the host as the ``"experts"`` and
    ``"combine"`` phases start), ``max_tokens_across_ranks`` (the call's bound on every rank's
    tokens, the same value on every rank; ``call_bound``). The CUDA workspace adds ``pdl=``. A
    peer that does not reach a step within ``timeout_s`` raises ``PeerTimeoutError``."""

    rank: int
    world_size: int
    max_tokens: int
    replicated: bool

    def fused_moe(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor, *, layer: str = "?",
                  on_phase: Callable[[str], None] | None = None,
                  max_tokens_across_ranks: int | None = None) -> torch.Tensor: ...

    def fused_moe_fp8(self, hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      w13_scale: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, block_shape: tuple[int, int] = (128, 128), layer: str = "?",
                      on_phase: Callable[[str], None] | None = None,
                      max_tokens_across_ranks: int | None = None) -> torch.Tensor: ...

    def close(self) -> None: ...


class PeerTimeoutError(RuntimeError):
    """A peer rank did not reach a step of an expert-parallel call in time."""


@dataclass(frozen=True)
class ExpertPlacement:
    """Where each global expert lives: ``owner[e]`` is its rank, ``local[e]`` its index there."""

    owner: torch.Tensor
    local: torch.Tensor

    @classmethod
    def from_expert_maps(cls, expert_maps: list[torch.Tensor]) -> "ExpertPlacement":
        """From every rank's vLLM-style expert map (global -> local id, -1 where not local)."""
        maps = torch.stack([m.to(torch.int64).cpu() for m in expert_maps])
        owned = maps >= 0
        if not torch.equal(owned.sum(0), torch.ones(maps.shape[1], dtype=torch.int64)):
            missing = (owned.sum(0) != 1).nonzero().flatten().tolist()
            raise ValueError(f"every expert must live on exactly one rank; experts {missing[:8]} do not")
        owner = owned.to(torch.int64).argmax(0)
        return cls(owner=owner.to(torch.int32), local=maps.max(0).values.to(torch.int32))

    @classmethod
    def linear(cls, num_experts: int, world_size: int) -> "ExpertPlacement":
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts do not split evenly over {world_size} ranks")
        per_rank = num_experts // world_size
        e = torch.arange(num_experts, dtype=torch.int32)
        return cls(owner=e // per_rank, local=e % per_rank)

    def expert_map(self, rank: int) -> torch.Tensor:
        return torch.where(self.owner == rank, self.local, -1)


def call_bound(tokens: int, max_tokens_across_ranks: int | None, max_tokens_per_rank: int) -> int:
    """A call's bound on every rank's tokens (default the workspace limit), checked against this
    rank's tokens and the limit; both EP workspaces take it."""
    bound = max_tokens_per_rank if max_tokens_across_ranks is None else max_tokens_across_ranks
    if not tokens <= bound <= max_tokens_per_rank:
        raise ValueError(
            f"max_tokens_across_ranks={bound} must be at least this rank's {tokens} tokens and at most "
            f"the workspace's max_tokens_per_rank={max_tokens_per_rank}"
        )
    return bound
