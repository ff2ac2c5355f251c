"""Expert parallelism on the CPU: kittens' pull-based dispatch and combine over shared memory.

Each rank of a process group owns some experts (an ``ExpertPlacement``). Per call, entirely
through shared memory, every rank:

1. posts its tokens (hidden rows, top-k ids) in its own segment and raises its POSTED flag;
2. waits for every peer's POSTED flag, reads every rank's top-k ids, and computes the same
   deterministic schedule everywhere: the rows each rank owns, in (source rank, token, k) order;
3. **pulls** the hidden rows of its rows straight from the source ranks' segments, each token
   row once per destination rank, runs its experts on them and writes the results into its own
   segment in schedule order, then raises COMPUTED;
4. waits for every peer's COMPUTED flag and **pulls** its own tokens' k results from the ranks
   that computed them, summing them in fp32 in k order, exactly as ``fused_moe`` does.

Because each row's expert output depends only on that row and the k order of the sum is fixed,
the output is bitwise the same as ``fused_moe`` on one rank with all experts.

With ``replicated_tokens`` every rank holds the same tokens (vLLM's tensor parallel without data
parallel): step 3 reads nothing from peers and each rank computes only its experts' rows.

One segment per rank serves every layer and call: a rank writes new tokens only after every peer
has finished reading its old ones (they raise COMPUTED after reading), and new results only
after every peer has posted the next call (so it has finished combining the previous one).
Every wait is bounded and fails with ``PeerTimeoutError`` naming the rank and what it awaited.
A call's ``max_tokens_across_ranks`` (which sizes the GPU version's grids; here the schedule is
sized by the posted counts anyway) is posted too and must be the same on every rank.
Flags are aligned int64 stores and loads, ordered after the data they publish on x86-64 (TSO).
"""

import time
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch
import torch.distributed as dist

from .moe import combine_topk, expert_rows
from ..fp8 import BLOCK_SHAPE, check_fused_moe_fp8_args, fp8_expert_rows
from ..env import knob
from ..ep_types import ExpertPlacement, PeerTimeoutError, call_bound
from ..reference import check_fused_moe_args

POSTED, COMPUTED, NUM_TOKENS, CALL_BOUND = 0, 1, 2, 3
FLAG_SLOTS = 8
ALIGN = 64


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    # The attaching process must not unlink the owner's segment when it exits.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class _Segment:
    """Typed views into one rank's shared-memory segment."""

    def __init__(self, shm, max_tokens, hidden, top_k, max_rows, dtype):
        self.shm = shm
        offset = 0

        def view(count, view_dtype):
            nonlocal offset
            t = torch.frombuffer(shm.buf, dtype=view_dtype, count=count, offset=offset)
            offset += -(-count * t.element_size() // ALIGN) * ALIGN
            return t

        self.flags = view(FLAG_SLOTS, torch.int64)
        self.ids = view(max_tokens * top_k, torch.int32).view(max_tokens, top_k)
        self.x = view(max_tokens * hidden, dtype).view(max_tokens, hidden)
        self.y = view(max_rows * hidden, dtype).view(max_rows, hidden)

    @staticmethod
    def nbytes(max_tokens, hidden, top_k, max_rows, dtype):
        size = torch.tensor([], dtype=dtype).element_size()
        parts = [FLAG_SLOTS * 8, max_tokens * top_k * 4, max_tokens * hidden * size, max_rows * hidden * size]
        return sum(-(-p // ALIGN) * ALIGN for p in parts)

    def release(self):
        # Views must go before the mapping can close.
        self.flags = self.ids = self.x = self.y = None
        self.shm.close()


class SharedMemoryEPWorkspace:
    """Expert-parallel kittens MoE for a CPU process group; allocate once, call for every layer.

    ``group`` is a torch.distributed group (gloo) of this process and its peers; every rank must
    create the workspace with the same limits and then make the same sequence of calls.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        max_tokens_per_rank: int,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
        placement: ExpertPlacement,
        replicated_tokens: bool = False,
        timeout_s: float | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_tokens = max_tokens_per_rank
        self.hidden = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.placement = placement
        self.replicated = replicated_tokens
        self.timeout_s = knob("ep_timeout_s", timeout_s)  # default MOK_EP_TIMEOUT_S, read now (env.py)
        self.epoch = 0
        sources = 1 if replicated_tokens else self.world_size
        shape = (max_tokens_per_rank, hidden_size, top_k, sources * max_tokens_per_rank * top_k, dtype)

        prefix = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(prefix, group_src=0, group=group)
        names = [f"mok_ep_{prefix[0]}_{r}" for r in range(self.world_size)]
        own = shared_memory.SharedMemory(name=names[self.rank], create=True, size=_Segment.nbytes(*shape))
        self._own = own
        dist.barrier(group=group)
        self.segments = [
            _Segment(own if r == self.rank else _attach(names[r]), *shape) for r in range(self.world_size)
        ]
        self.segments[self.rank].flags.zero_()
        dist.barrier(group=group)

    def close(self) -> None:
        if self._own is None:
            return
        for seg in self.segments:
            seg.release()
        self._own.unlink()
        self._own = None

    def _wait_for_peers(self, slot: int, epoch: int, what: str, layer: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        for peer, seg in enumerate(self.segments):
            spins = 0
            while int(seg.flags[slot]) < epoch:
                spins += 1
                if spins > 64:
                    time.sleep(20e-6)
                    if time.monotonic() > deadline:
                        raise PeerTimeoutError(
                            f"kittens EP rank {self.rank}: rank {peer} did not {what} within "
                            f"{self.timeout_s:g} s (layer {layer}, call {epoch})"
                        )

    def fused_moe(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        layer: str = "?",
        on_phase=None,
        max_tokens_across_ranks: int | None = None,
    ) -> torch.Tensor:
        """This rank's tokens through the experts of every rank: ``[T, H]``, as ``fused_moe``.
        ``on_phase(name)``, if given, is called as the ``"experts"`` and ``"combine"`` phases
        start (after dispatch has pulled every row, after this rank's experts): per-layer timing.
        ``max_tokens_across_ranks``: as for ``SymmetricMemoryEPWorkspace.fused_moe`` (checked: at
        least this rank's tokens, at most the workspace limit, the same on every rank)."""
        check_fused_moe_args(
            hidden_states, w13, w2, topk_weights, topk_ids, self.placement.expert_map(self.rank), "silu"
        )

        def run_rows(x, row_token, row_expert):
            return expert_rows(x, row_token, row_expert, w13, w2)

        return self._call(hidden_states, topk_weights, topk_ids, run_rows, layer, on_phase, max_tokens_across_ranks)

    def fused_moe_fp8(
        self,
        hidden_states: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        w13_scale: torch.Tensor,
        w2_scale: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        *,
        block_shape=BLOCK_SHAPE,
        layer: str = "?",
        on_phase=None,
        max_tokens_across_ranks: int | None = None,
    ) -> torch.Tensor:
        """``fused_moe`` with block-scaled FP8 experts, as ``fused_moe_fp8``. Token rows travel in the
        activation dtype and are quantized (per token, so exactly as on one rank) where they run."""
        block = check_fused_moe_fp8_args(
            hidden_states, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
            self.placement.expert_map(self.rank), "silu", block_shape,
        )  # fmt: skip

        def run_rows(x, row_token, row_expert):
            return fp8_expert_rows(x, row_token, row_expert, w13, w2, w13_scale, w2_scale, block)

        return self._call(hidden_states, topk_weights, topk_ids, run_rows, layer, on_phase, max_tokens_across_ranks)

    def _call(self, hidden_states, topk_weights, topk_ids, run_rows, layer: str, on_phase,
              max_tokens_across_ranks: int | None) -> torch.Tensor:
        tokens = hidden_states.shape[0]
        if tokens > self.max_tokens or hidden_states.shape[1] != self.hidden or topk_ids.shape[1] != self.top_k:
            raise ValueError(
                f"kittens EP workspace holds up to {self.max_tokens} tokens of hidden size {self.hidden} "
                f"with top-{self.top_k}; got {tuple(hidden_states.shape)} with top-{topk_ids.shape[1]}"
            )
        if hidden_states.dtype != self.dtype:
            raise ValueError(f"kittens EP workspace is for {self.dtype}, got {hidden_states.dtype}")
        bound = call_bound(tokens, max_tokens_across_ranks, self.max_tokens)
        epoch = self.epoch + 1
        me = self.segments[self.rank]

        # 1. post this rank's tokens.
        if not self.replicated:
            me.ids[:tokens] = topk_ids
            me.x[:tokens] = hidden_states
        me.flags[NUM_TOKENS] = tokens
        me.flags[CALL_BOUND] = bound
        me.flags[POSTED] = epoch
        self._wait_for_peers(POSTED, epoch, "post its tokens", layer)
        for peer, seg in enumerate(self.segments):
            if int(seg.flags[CALL_BOUND]) != bound:
                raise ValueError(
                    f"kittens EP rank {self.rank}: rank {peer} passed max_tokens_across_ranks="
                    f"{int(seg.flags[CALL_BOUND])}, this rank {bound} (layer {layer}, call {epoch}); every "
                    f"rank must pass the same value"
                )

        # 2. the schedule, identical on every rank: rows in (source rank, token, k) order.
        if self.replicated:
            source_ids, my_source = [topk_ids.to(torch.int32)], 0
        else:
            source_ids = [seg.ids[: int(seg.flags[NUM_TOKENS])].clone() for seg in self.segments]
            my_source = self.rank
        row_source = torch.cat([torch.full((ids.numel(),), s) for s, ids in enumerate(source_ids)])
        row_token = torch.cat([torch.arange(ids.numel()) // self.top_k for ids in source_ids])
        row_expert = torch.cat([ids.flatten().long() for ids in source_ids])
        # Unrouted rows (id -1) belong to no rank: nobody computes them and they combine as zero.
        row_owner = torch.where(row_expert >= 0, self.placement.owner[row_expert.clamp(min=0)].long(), -1)
        row_position = torch.empty_like(row_owner)
        for r in range(self.world_size):
            mine = row_owner == r
            row_position[mine] = torch.arange(int(mine.sum()))

        # 3. pull the rows this rank owns, each (source, token) once, and run its experts.
        owned = row_owner == self.rank
        key = row_source[owned] * (self.max_tokens + 1) + row_token[owned]
        unique_keys, row_of_token = torch.unique_consecutive(key, return_inverse=True)
        pulled_source, pulled_token = unique_keys // (self.max_tokens + 1), unique_keys % (self.max_tokens + 1)
        if self.replicated:
            pulled = hidden_states[pulled_token]
        else:
            pulled = torch.cat(
                [self.segments[s].x[pulled_token[pulled_source == s]] for s in range(self.world_size)]
            )
        local_expert = self.placement.local[row_expert[owned]].long()
        if on_phase is not None:
            on_phase("experts")
        me.y[: int(owned.sum())] = run_rows(pulled, row_of_token, local_expert)
        if on_phase is not None:
            on_phase("combine")
        me.flags[COMPUTED] = epoch
        self._wait_for_peers(COMPUTED, epoch, "finish its experts", layer)

        # 4. pull this rank's k results from the ranks that computed them; fixed-order fp32 sum.
        mine = row_source == my_source
        owner, position = row_owner[mine], row_position[mine]
        results = torch.zeros(tokens * self.top_k, self.hidden, dtype=self.dtype)
        for r in range(self.world_size):
            from_r = owner == r
            results[from_r] = self.segments[r].y[position[from_r]]
        self.epoch = epoch
        return combine_topk(results.view(tokens, self.top_k, self.hidden), topk_weights)
