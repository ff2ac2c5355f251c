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

Across nodes (``node_size`` ranks per node, fewer than the group: shared memory only inside a
node), two levels. Every rank gathers every rank's top-k ids (a collective over the group) and
computes the same schedule. A rank sends each remote node the rows of its tokens that node needs,
once per node, to its peer of the same local index there (a collective over the ranks of that
local index), which posts them in its segment's inbox for its node to pull. After the experts,
the rank of the same local index on each node gathers the results its node computed for the
other nodes' ranks of that index and sends them back the same way: every (token, k) result
reaches the token's rank, which sums them in k order as on one node, so the output stays bitwise
``fused_moe``'s whatever the number of nodes and ranks. Summing on the computing node first would
send fewer bytes but group the terms by placement, changing the bits with the layout.

One segment per rank serves every layer and call: a rank writes new tokens only after every peer
of its node has finished reading its old ones (they raise COMPUTED after reading), new results
and inbox rows only after every peer of its node has posted the next call (so it has finished
combining the previous one). Every wait is bounded and fails with ``PeerTimeoutError`` naming the
rank and what it awaited (collectives across nodes too).
A call's ``max_tokens_across_ranks`` (which sizes the GPU version's grids; here the schedule is
sized by the posted counts anyway) is posted too and must be the same on every rank.
Flags are aligned int64 stores and loads, ordered after the data they publish on x86-64 (TSO).
"""

import datetime
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

POSTED, COMPUTED, NUM_TOKENS, CALL_BOUND, INBOX = 0, 1, 2, 3, 4
FLAG_SLOTS = 8
ALIGN = 64


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = shared_memory.SharedMemory(name=name)
    # The attaching process must not unlink the owner's segment when it exits.
    resource_tracker.unregister(shm._name, "shared_memory")
    return shm


class _Segment:
    """Typed views into one rank's shared-memory segment."""

    def __init__(self, shm, max_tokens, hidden, top_k, max_rows, inbox_rows, dtype):
        self.shm = shm
        offset = 0

        def view(count, view_dtype):
            nonlocal offset
            if count == 0:  # (torch.frombuffer refuses an empty view)
                return torch.empty(0, dtype=view_dtype)
            t = torch.frombuffer(shm.buf, dtype=view_dtype, count=count, offset=offset)
            offset += -(-count * t.element_size() // ALIGN) * ALIGN
            return t

        self.flags = view(FLAG_SLOTS, torch.int64)
        self.ids = view(max_tokens * top_k, torch.int32).view(max_tokens, top_k)
        self.x = view(max_tokens * hidden, dtype).view(max_tokens, hidden)
        self.y = view(max_rows * hidden, dtype).view(max_rows, hidden)
        self.inbox = view(inbox_rows * hidden, dtype).view(inbox_rows, hidden)  # rows from other nodes

    @staticmethod
    def nbytes(max_tokens, hidden, top_k, max_rows, inbox_rows, dtype):
        size = torch.tensor([], dtype=dtype).element_size()
        parts = [FLAG_SLOTS * 8, max_tokens * top_k * 4, max_tokens * hidden * size, max_rows * hidden * size,
                 inbox_rows * hidden * size]
        return sum(-(-p // ALIGN) * ALIGN for p in parts)

    def release(self):
        # Views must go before the mapping can close.
        self.flags = self.ids = self.x = self.y = self.inbox = None
        self.shm.close()


class SharedMemoryEPWorkspace:
    """Expert-parallel kittens MoE for a CPU process group; allocate once, call for every layer.

    ``group`` is a torch.distributed group (gloo) of this process and its peers; every rank must
    create the workspace with the same limits and then make the same sequence of calls.
    ``node_size``: ranks per node (consecutive ranks; default the whole group), the ranks that share
    memory; more nodes exchange rows through collectives (the module docstring).
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
        node_size: int | None = None,
    ):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.node_size = node_size or self.world_size
        if self.world_size % self.node_size:
            raise ValueError(f"kittens EP: {self.world_size} ranks do not make whole nodes of {self.node_size}")
        self.nodes = self.world_size // self.node_size
        self.node, self.local_index = divmod(self.rank, self.node_size)
        self.max_tokens = max_tokens_per_rank
        self.hidden = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.placement = placement
        self.replicated = replicated_tokens
        self.timeout_s = knob("ep_timeout_s", timeout_s)  # default MOK_EP_TIMEOUT_S, read now (env.py)
        self.epoch = 0
        sources = 1 if replicated_tokens else self.world_size
        inbox_rows = 0 if replicated_tokens else (self.nodes - 1) * max_tokens_per_rank
        shape = (max_tokens_per_rank, hidden_size, top_k, sources * max_tokens_per_rank * top_k, inbox_rows, dtype)

        prefix = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(prefix, group_src=0, group=group)
        names = [f"mok_ep_{prefix[0]}_{r}" for r in range(self.world_size)]
        own = shared_memory.SharedMemory(name=names[self.rank], create=True, size=_Segment.nbytes(*shape))
        self._own = own
        dist.barrier(group=group)
        # Only this node's segments: another node's memory is not mapped (None there).
        self.segments = [
            _Segment(own if r == self.rank else _attach(names[r]), *shape) if self._on_my_node(r) else None
            for r in range(self.world_size)
        ]
        self.segments[self.rank].flags.zero_()
        dist.barrier(group=group)

    def _on_my_node(self, rank: int) -> bool:
        return rank // self.node_size == self.node

    def close(self) -> None:
        if self._own is None:
            return
        for seg in self.segments:
            if seg is not None:
                seg.release()
        self._own.unlink()
        self._own = None

    def _wait_for_peers(self, slot: int, epoch: int, what: str, layer: str) -> None:
        """Until every rank of this node has raised ``slot`` to ``epoch``."""
        deadline = time.monotonic() + self.timeout_s
        for peer, seg in enumerate(self.segments):
            if seg is None:
                continue
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

        # 1. post this rank's tokens; every rank's ids, counts and bounds.
        if not self.replicated:
            me.ids[:tokens] = topk_ids
            me.x[:tokens] = hidden_states
        me.flags[NUM_TOKENS] = tokens
        me.flags[CALL_BOUND] = bound
        me.flags[POSTED] = epoch
        self._wait_for_peers(POSTED, epoch, "post its tokens", layer)
        counts, bounds, posted_ids = self._posted(topk_ids, tokens, bound, layer, epoch)
        for peer, peer_bound in enumerate(bounds):
            if peer_bound != bound:
                raise ValueError(
                    f"kittens EP rank {self.rank}: rank {peer} passed max_tokens_across_ranks="
                    f"{peer_bound}, this rank {bound} (layer {layer}, call {epoch}); every "
                    f"rank must pass the same value"
                )

        # 2. the schedule, identical on every rank: rows in (source rank, token, k) order.
        if self.replicated:
            source_ids, my_source = [topk_ids.to(torch.int32)], 0
        else:
            source_ids = [ids[:count] for ids, count in zip(posted_ids, counts)]
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
        row_node = torch.where(row_owner >= 0, row_owner // self.node_size, -1)

        # 3. pull the rows this rank owns, each (source, token) once, and run its experts; rows of
        # another node's tokens come from this node's inboxes (filled by the exchange).
        owned = row_owner == self.rank
        key = row_source[owned] * (self.max_tokens + 1) + row_token[owned]
        unique_keys, row_of_token = torch.unique_consecutive(key, return_inverse=True)
        pulled_source, pulled_token = unique_keys // (self.max_tokens + 1), unique_keys % (self.max_tokens + 1)
        if self.replicated:
            pulled = hidden_states[pulled_token]
        else:
            # Each other node's source: its tokens this node needs, in token order (the inbox layout).
            needed_here = {s: self._needed(s, self.node, row_source, row_token, row_node)
                           for s in range(self.world_size) if not self._on_my_node(s)}
            if self.nodes > 1:
                self._dispatch_across_nodes(hidden_states, needed_here, row_source, row_token, row_node, layer, epoch)
            pulled = torch.cat([self._source_rows(s, pulled_token[pulled_source == s], needed_here)
                                for s in range(self.world_size)])
        local_expert = self.placement.local[row_expert[owned]].long()
        if on_phase is not None:
            on_phase("experts")
        me.y[: int(owned.sum())] = run_rows(pulled, row_of_token, local_expert)
        if on_phase is not None:
            on_phase("combine")
        me.flags[COMPUTED] = epoch
        self._wait_for_peers(COMPUTED, epoch, "finish its experts", layer)

        # 4. pull this rank's k results from the ranks that computed them (another node's through
        # the exchange); fixed-order fp32 sum.
        mine = row_source == my_source
        owner, position = row_owner[mine], row_position[mine]
        results = torch.zeros(tokens * self.top_k, self.hidden, dtype=self.dtype)
        for r in range(self.world_size):
            if self._on_my_node(r):
                from_r = owner == r
                results[from_r] = self.segments[r].y[position[from_r]]
        if self.nodes > 1:
            self._combine_across_nodes(results, row_source, row_owner, row_position, row_node, mine, layer, epoch)
        self.epoch = epoch
        return combine_topk(results.view(tokens, self.top_k, self.hidden), topk_weights)

    # ------------------------------------------------------------------ across nodes

    def _source_of(self, rank: int) -> int:
        """The schedule's source index of ``rank``'s tokens (one shared source when replicated)."""
        return 0 if self.replicated else rank

    def _posted(self, topk_ids, tokens: int, bound: int, layer: str, epoch: int):
        """Every rank's (token count, bound, ids): from the node's segments on one node, else
        gathered over the group (the ids padded to the workspace's limit)."""
        if self.nodes == 1:
            segs = self.segments
            return ([int(seg.flags[NUM_TOKENS]) for seg in segs], [int(seg.flags[CALL_BOUND]) for seg in segs],
                    [seg.ids for seg in segs])
        words = torch.full((self.max_tokens * self.top_k + 2,), -1, dtype=torch.int32)
        if not self.replicated:
            words[: tokens * self.top_k] = topk_ids.to(torch.int32).flatten()
        words[-2:] = torch.tensor([tokens, bound], dtype=torch.int32)
        gathered = [torch.empty_like(words) for _ in range(self.world_size)]
        self._bounded(dist.all_gather(gathered, words, group=self.group, async_op=True), "gathering top-k ids",
                      layer, epoch)
        return ([int(w[-2]) for w in gathered], [int(w[-1]) for w in gathered],
                [w[:-2].view(self.max_tokens, self.top_k) for w in gathered])

    def _bounded(self, work, what: str, layer: str, epoch: int) -> None:
        """Wait for a collective across nodes as long as for a peer's flag."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise PeerTimeoutError(
                f"kittens EP rank {self.rank}: {what} across nodes did not complete within {self.timeout_s:g} s "
                f"(layer {layer}, call {epoch}): {exc}"
            ) from exc

    def _exchange(self, outgoing: list[torch.Tensor], incoming: list[int], what: str, layer: str,
                  epoch: int) -> list[torch.Tensor]:
        """``outgoing[n]`` (rows of ``hidden``) to node n's rank of this local index, and from each its
        ``incoming[n]`` rows; raw bytes, whatever the dtype. One all-to-all over the whole group with
        nothing to or from the other local indices (a subgroup would need every process of the
        default group to create it)."""
        row_bytes = self.hidden * torch.tensor([], dtype=self.dtype).element_size()
        peer = [r % self.node_size == self.local_index for r in range(self.world_size)]
        send_splits = [outgoing[r // self.node_size].shape[0] * row_bytes if peer[r] else 0 for r in range(self.world_size)]
        recv_splits = [incoming[r // self.node_size] * row_bytes if peer[r] else 0 for r in range(self.world_size)]
        send = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in outgoing])
        recv = torch.empty(sum(recv_splits), dtype=torch.uint8)
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=True)
        self._bounded(work, what, layer, epoch)
        return list(recv.view(self.dtype).view(-1, self.hidden).split(incoming))

    def _needed(self, source: int, node: int, row_source, row_token, row_node) -> torch.Tensor:
        """Tokens of ``source`` that a rank of ``node`` computes a row of, in token order (each once)."""
        return torch.unique(row_token[(row_source == source) & (row_node == node)])

    def _dispatch_across_nodes(self, hidden_states, needed_here, row_source, row_token, row_node, layer: str,
                               epoch: int) -> None:
        """Send each other node the rows of this rank's tokens it needs; post theirs in the inbox."""
        outgoing, incoming = [], []
        for n in range(self.nodes):
            if n == self.node:
                outgoing.append(hidden_states[:0])
                incoming.append(0)
                continue
            outgoing.append(hidden_states[self._needed(self.rank, n, row_source, row_token, row_node)])
            incoming.append(needed_here[n * self.node_size + self.local_index].numel())
        received = self._exchange(outgoing, incoming, "sending token rows", layer, epoch)
        inbox = self.segments[self.rank].inbox
        at = 0
        for rows in received:
            inbox[at : at + rows.shape[0]] = rows
            at += rows.shape[0]
        self.segments[self.rank].flags[INBOX] = epoch
        self._wait_for_peers(INBOX, epoch, "post the rows it received from other nodes", layer)

    def _source_rows(self, source: int, tok: torch.Tensor, needed_here: dict) -> torch.Tensor:
        """Rows ``tok`` of ``source``'s tokens: from its segment on this node, else from the inbox of
        this node's rank of its local index, which holds per other node in order that node's source
        of its index's ``needed_here`` tokens."""
        if self._on_my_node(source):
            return self.segments[source].x[tok]
        index = source % self.node_size
        at = sum(needed_here[n * self.node_size + index].numel()
                 for n in range(source // self.node_size) if n != self.node)
        forwarder = self.node * self.node_size + index
        return self.segments[forwarder].inbox[at + torch.searchsorted(needed_here[source], tok)]

    def _combine_across_nodes(self, results, row_source, row_owner, row_position, row_node, mine,
                              layer: str, epoch: int) -> None:
        """Send each other node's rank of this local index the results this node computed for its
        tokens, in schedule order; place the ones received for this rank's tokens into ``results``."""
        outgoing, incoming = [], []
        for n in range(self.nodes):
            if n == self.node:
                outgoing.append(results[:0])
                incoming.append(0)
                continue
            dest = self._source_of(n * self.node_size + self.local_index)
            rows = (row_source == dest) & (row_node == self.node)
            owners, positions = row_owner[rows], row_position[rows]
            out = torch.empty(int(rows.sum()), self.hidden, dtype=self.dtype)
            for r in range(self.node * self.node_size, (self.node + 1) * self.node_size):
                from_r = owners == r
                out[from_r] = self.segments[r].y[positions[from_r]]
            outgoing.append(out)
            incoming.append(int(((row_source == self._source_of(self.rank)) & (row_node == n)).sum()))
        received = self._exchange(outgoing, incoming, "returning expert results", layer, epoch)
        my_nodes = row_node[mine]
        for n, rows in enumerate(received):
            if n != self.node:
                results[my_nodes == n] = rows
