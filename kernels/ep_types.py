"""Types shared by the two expert-parallel workspaces (``cpu/ep.py``, ``cuda/ep.py``): where each
global expert lives, the error a late peer raises, and a call's token bound."""

from dataclasses import dataclass

import torch

__all__ = ["ExpertPlacement", "PeerTimeoutError", "call_bound"]


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
