"""Expert parallelism on CUDA GPUs: kittens' pull-based dispatch and combine over symmetric memory.

``SymmetricMemoryEPWorkspace`` has the constructor and ``fused_moe`` API of the CPU version
(``cpu.ep.SharedMemoryEPWorkspace``) and the same algorithm, but every step is a Triton kernel on
the current stream and no step synchronises with the host. Each rank (one GPU) owns one
symmetric-memory segment (``torch.distributed._symmetric_memory``), mapped into every peer, and
the kernels take int64 tables of the peers' segment addresses.

Segment of rank ``r`` (``S`` sources = world size, or 1 with ``replicated_tokens``):

- ``flags[slot, p]`` int32, written by rank ``p`` (a system-scope release store into ``r``'s
  segment), polled by ``r`` locally with acquire loads; slots ``POSTED`` and ``COMPUTED``; the
  value is the call's epoch (a device counter, so CUDA-graph replays advance it too; flags only
  grow, so nothing is ever reset);
- ``n`` (tokens posted) and the call's bound ``B``, ``ids [maxT, K]`` int32 and ``x [maxT, H]``:
  this rank's tokens;
- ``y [S * maxT * K, H]``: expert outputs this rank computed, row ``(s * B + t) * K + k``
  (pull return: the home rank reads them);
- ``ret [maxT * K, H]``: the results of this rank's own tokens, row ``t * K + k`` (push return:
  the owners write them).

``B`` (``max_tokens_across_ranks``, at most ``maxT``) bounds every rank's tokens in this call and is
the same on every rank; the call's grids, the schedule's scan and the row layout below are sized
by it, so a decode step on a workspace sized for prefills does not pay for ``maxT`` tokens.

One call, on rank ``me`` (launches in stream order; epoch ``e``):

1. ``post``: copy ``hidden_states`` and ``topk_ids`` (as int32) into the segment, store ``n`` and ``B``.
2. ``sync(POSTED)``: ``e = epoch + 1``; release-store ``e`` into every peer's ``flags[POSTED, me]``,
   then wait (bounded) until every peer's ``flags[POSTED, p] >= e``.
3. ``gather``: read every source's ``n`` and top-k ids from its segment into ``all_ids
   [S * B, K]`` (``-1`` past ``n``; a source that posted another ``B`` is an error), and **pull**
   each source token row that has at least one local expert, once, from the source's ``x`` into
   ``xl [S * B, H]`` (unless GEMM1 pulls).
4. ``schedule``: ``cuda.moe``'s prefix-sum schedule over ``all_ids`` with this rank's expert map:
   per local expert, its rows in (source rank, token, k) order; positions by prefix sums only.
5. ``gemm1`` / ``gemm2``: ``cuda.moe``'s grouped GEMM tiles (same block sizes rule, BLOCK_K per
   shape, no split-K). With ``pull_in_gemm1`` (bf16, opt-in: ``MOK_EP_PULL_IN_GEMM1=1`` until it
   is measured on 2 GPUs, loadtest/JOURNAL.md#rows-pulled-inside-gemm1-at-ep2-445621b-2026-11-30)
   GEMM1 (``ep_gemm1_pull_kernel``) pulls the rows itself, each needed row once, from the source's
   ``x`` into ``xl``: chunks of ``PULL_BT`` tokens
   are claimed from a queue, copied and flagged ready (an epoch per chunk, release at GPU scope),
   and each tile starts once the chunks of its rows are ready (acquire, bounded wait), so tiles
   compute while other chunks are still crossing NVLink. Tiles keep the one-GPU expert-major
   order (a token-major order, tried, lets early tiles start sooner but reads every expert's
   weights once per tier: 16-25% slower at 8192 tokens on one H200). GEMM2 writes row
   ``(s, t, k)`` to ``y`` (pull return) or, with ``return_mode="push"``, straight into ``ret`` of
   rank ``s`` at ``t * K + k`` (remote stores in the epilogue).
6. ``sync(COMPUTED)``: release-store ``e`` into every peer's ``flags[COMPUTED, me]``; wait for all.
7. ``combine``: ``out[t] = sum_k w[t, k] * y_k`` in fp32 in k order, where ``y_k`` is pulled from
   the owner of expert ``ids[t, k]`` (its ``y`` row ``(me * B + t) * K + k``) or read from the
   local ``ret`` (push). Same arithmetic as ``cuda.moe``'s combine, so the output is bitwise that
   of one-GPU ``fused_moe`` on the global inputs (each row's GEMM result depends only on the row).

Why buffers can be reused without a trailing barrier: a rank overwrites ``x``/``ids``/``n`` in call
``e + 1`` only after it saw every peer's ``COMPUTED(e)``, which peers raise after pulling (step 3
precedes step 6). ``y`` (and a peer's ``ret``) are overwritten in call ``e + 1``'s GEMM2 only after
every peer's ``POSTED(e + 1)``, which a peer raises after its combine of call ``e``. So back-to-back
calls and layers share one segment safely with two flag waits per call.

Across nodes (``node_size`` ranks per node, fewer than the group): symmetric memory over the node's
ranks only, collectives between nodes (kernels/DESIGN.md, across nodes). ``exchange_ids`` gathers
every rank's count, bound and ids over the group before ``sync(POSTED)``; ``exchange_rows`` sends the
rank's ``T`` rows to its peers of the same local index on the other nodes, into their inboxes, and
``sync(INBOX)`` tells the node they are there; the gather pulls another node's source from the inbox
of this node's rank of its local index. After ``sync(COMPUTED)``, ``collect`` gathers every (token, k)
result this node computed for each other node's rank of this local index, ``exchange_results``
returns them, and the combine reads a far owner's results there, in the same k order: the output
stays bitwise one GPU's whatever the node layout. Ordering across calls: an inbox is overwritten only
after every rank of the node posted the next call (so it finished pulling), as ``x`` is.

Bounded waits and errors: every wait gives up after ``timeout_s`` (``%globaltimer`` on the GPU; a
spin count under the interpreter), records (what, peer, epoch) in a device error word, and every
later wait returns at once (outputs are then garbage; discard the workspace). The error surfaces as
``PeerTimeoutError`` naming this rank, the peer and what it awaited, **without a per-call host
sync**: each eager call copies the error word into pinned host memory asynchronously, and the next
call (or ``check_errors()``, which synchronises) raises it. With ``MOK_EP_SYNC_CHECK=1`` (or
``sync_check=True``) every call synchronises and raises at once (debug mode). Under CUDA-graph
replay only ``check_errors()`` reports.

Not done (see loadtest/JOURNAL.md#not-done--next and kernels/DESIGN.md#open-items): the in-GEMM1
pull is not the default yet and FP8 rows are always pulled before GEMM1; GEMM2 and the return do
not overlap.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from .. import bad_ids
from ..env import knob
from ..ep_types import ExpertPlacement, PeerTimeoutError, call_bound
from ..fp8 import BLOCK_SHAPE, FP8_DTYPE, check_fused_moe_fp8_args
from ..reference import check_fused_moe_args
from .configs import combine_block, fp8_split_max_tokens, pick_configs, pick_configs_fp8
from .ep_kernels import (
    BOUND, COMPUTED, INBOX, NUM_SLOTS, POSTED, ROWS, ep_collect_kernel, ep_combine_kernel, ep_fp8_gemm2_push_kernel,
    ep_gather_kernel, ep_gemm1_pull_kernel, ep_gemm2_push_kernel, ep_post_kernel, ep_sync_kernel,
)
from .fp8_tiles import GROUP
from .launch import interpreting, pdl_launch
from .moe import _moe_schedule_zero_kernel, launch_gemm1, launch_gemm2, launch_schedule
from .moe_fp8 import QROWS, launch_fp8_gemm1, launch_fp8_gemm2, quantize_programs, split_group_tickets

__all__ = ["ExpertPlacement", "PeerTimeoutError", "SymmetricMemoryEPWorkspace"]

PULL_BT = 16  # tokens per pulled chunk (one claim and one ready flag each)
ST_EPOCH, ST_ERR, ST_ERR_PEER, ST_ERR_EPOCH, ST_WAIT = 0, 1, 2, 3, 4  # state words: ep_kernels.py
STATE_WORDS = 8
ALIGN = 256
WHAT = {POSTED: "post its tokens", COMPUTED: "finish its experts",
        INBOX: "post the token rows it received from other nodes", ROWS: "deliver its token rows to the expert GEMMs"}


# ----------------------------------------------------------------------------------------------
# Workspace
# ----------------------------------------------------------------------------------------------


def _run_stages(stages, on_phase):
    """Run one call's launch steps; the expert GEMMs are the "experts" phase, what follows them
    (waiting for every rank's results, the combine) the "combine" phase."""
    out = None
    for stage in stages:
        if on_phase is not None and stage.__name__ == "gemms":
            on_phase("experts")
        out = stage()
        if on_phase is not None and stage.__name__ == "gemms":
            on_phase("combine")
    return out


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Layout:
    """Byte offsets of the regions of one segment (identical on every rank). ``peers``: the ranks
    that map each other's segments (a node). ``fp8``: ``x`` holds e4m3 rows (1 byte per element)
    and ``xs`` their fp32 scales, one per 128 columns. The ids follow the two count words, so
    ``n``, bound and ids are one run of words (what the exchange across nodes gathers). With
    ``nodes`` > 1 and tokens per rank, the inbox: the rows of the other nodes' ranks of this local
    index, ``max_tokens`` per node in node order (a call's bound ``T`` packs them by ``T``)."""

    def __init__(self, peers, sources, max_tokens, hidden, top_k, elem, fp8=False, nodes=1):
        x_row = hidden * (1 if fp8 else elem)
        s_row = triton.cdiv(hidden, GROUP) * 4 if fp8 else 0
        inbox_rows = (nodes - 1) * max_tokens if sources > 1 else 0
        self.flags = 0
        self.n = _up(NUM_SLOTS * peers * 4)
        self.ids = self.n + 8
        self.x = _up(self.ids + max_tokens * top_k * 4)
        self.xs = self.x + _up(max_tokens * x_row)
        self.y = self.xs + _up(max_tokens * s_row)
        self.ret = self.y + _up(sources * max_tokens * top_k * hidden * elem)
        self.inbox = self.ret + _up(max_tokens * top_k * hidden * elem)
        self.inbox_s = self.inbox + _up(inbox_rows * x_row)
        self.total = self.inbox_s + _up(inbox_rows * s_row)


class _Collectives:
    """The exchange between nodes: torch.distributed collectives over the EP group (NCCL on GPUs),
    ordered on the current stream like the kernels, no host synchronisation. A peer that never
    joins is bounded by the group's own timeout (its watchdog), not by ``timeout_s``."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        dist.all_gather_into_tensor(out, inp, group=self.group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> None:
        dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group)


class SymmetricMemoryEPWorkspace:
    """Expert-parallel kittens MoE for a group of GPUs; allocate once, call for every layer.

    ``group`` is a torch.distributed process group (NCCL) with one GPU per rank (the current CUDA
    device); every rank creates the workspace with the same limits and makes the same sequence of
    ``fused_moe`` calls (token counts may differ, 0 to ``max_tokens_per_rank``). ``placement`` says
    which rank owns each global expert; ``w13``/``w2`` passed to ``fused_moe`` are this rank's
    local experts in local-id order. ``replicated_tokens``: every rank holds the same tokens (TP
    without DP); nothing is pulled and results always return by pull.

    ``return_mode``: ``"pull"`` (the home rank reads its k results from the owners) or ``"push"``
    (owners write them into the home rank's segment from GEMM2's epilogue); both give bitwise the
    same output. ``pull_in_gemm1=True`` (bf16) pulls the token rows inside GEMM1, whose tiles start
    as their rows arrive, instead of in the ``gather`` kernel before GEMM1 (the default until the
    overlap is measured on 2 GPUs; FP8 workspaces always gather first). ``timeout_s`` bounds every wait (see the module docstring for how a timeout is
    reported). The call is CUDA-graph capturable (fixed token count per graph).

    ``quant="fp8"``: a workspace for block-scaled FP8 experts, called through ``fused_moe_fp8``
    (``fused_moe`` is for ``quant=None``). Token rows are posted and pulled as e4m3 with their
    1 x 128 group scales (half the bytes of bf16); results return and combine in ``dtype``.

    ``node_size``: ranks per node (consecutive ranks; default the whole group), the ranks that map
    each other's memory; ``node_group`` is their process group (symmetric memory is made over it),
    and ``group`` carries the collectives between nodes.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        *,
        max_tokens_per_rank: int,
        hidden_size: int,
        top_k: int,
        dtype: torch.dtype,
        placement: ExpertPlacement,
        replicated_tokens: bool = False,
        timeout_s: float | None = None,
        return_mode: str | None = None,
        pull_in_gemm1: bool | None = None,
        sync_check: bool | None = None,
        quant: str | None = None,
        node_size: int | None = None,
        node_group: dist.ProcessGroup | None = None,
        _simulated: tuple[int, list[torch.Tensor]] | None = None,
        _exchange=None,
        _max_spins: int | None = None,
    ):
        # Knobs left at None are read from the environment now (env.py).
        timeout_s = knob("ep_timeout_s", timeout_s)
        return_mode = knob("ep_return_mode", return_mode)
        pull_in_gemm1 = knob("ep_pull_in_gemm1", pull_in_gemm1)
        sync_check = knob("ep_sync_check", sync_check)
        if return_mode not in ("pull", "push"):
            raise ValueError(f"return_mode must be 'pull' or 'push', got {return_mode!r}")
        if quant not in (None, "fp8"):
            raise ValueError(f"quant must be None or 'fp8', got {quant!r}")
        self.quant = quant
        fp8 = quant == "fp8"
        self.group = group
        self.simulated = _simulated is not None
        if _simulated is not None:
            # Interpreter tests: ranks simulated in one process, segments are plain tensors.
            self.rank, segments = _simulated
            self.world_size = len(segments)
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self.node_size = node_size or self.world_size
        if self.world_size % self.node_size:
            raise ValueError(f"kittens EP: {self.world_size} ranks do not make whole nodes of {self.node_size}")
        self.nodes = self.world_size // self.node_size
        self.node, self.local_index = divmod(self.rank, self.node_size)
        if self.nodes > 1 and (pull_in_gemm1 or (return_mode == "push" and not replicated_tokens)):
            raise ValueError(
                "kittens EP across nodes pulls the token rows before GEMM1 and returns results by pull "
                f"(pull_in_gemm1={pull_in_gemm1}, return_mode={return_mode!r} run inside one node only)"
            )
        self.max_tokens = max_tokens_per_rank
        self.hidden = hidden_size
        self.top_k = top_k
        self.dtype = dtype
        self.placement = placement
        self.replicated = replicated_tokens
        self.timeout_s = timeout_s
        self.return_mode = "pull" if replicated_tokens else return_mode
        self.pull_in_gemm1 = pull_in_gemm1
        self.sync_check = sync_check
        self.interpret = interpreting()
        self.max_spins = _max_spins if _max_spins is not None else (2**62 if not self.interpret else 10_000)
        # GEMM1's wait for pulled rows counts polls (each at least an L2 round trip, ~0.5 us).
        self.max_polls = min(self.max_spins, int(timeout_s * 2e6))
        self.sources = 1 if replicated_tokens else self.world_size
        elem = torch.tensor([], dtype=dtype).element_size()
        self.layout = lay = _Layout(
            self.node_size, self.sources, max_tokens_per_rank, hidden_size, top_k, elem, fp8=fp8, nodes=self.nodes
        )

        # ptrs: every rank's segment address, 0 for another node's (not mapped).
        if _simulated is not None:
            self.device = segments[self.rank].device
            self.buffer = segments[self.rank]
            ptrs = [int(s.data_ptr()) if self._on_my_node(r) else 0 for r, s in enumerate(segments)]
            self._handle = None
        else:
            import torch.distributed._symmetric_memory as symm_mem

            if self.nodes > 1 and node_group is None:
                raise ValueError("kittens EP across nodes needs node_group: the process group of this node's ranks")
            self.device = torch.device("cuda", torch.cuda.current_device())
            name = (node_group if self.nodes > 1 else group or dist.group.WORLD).group_name
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # deprecated (a no-op) in newer torch
                    try:
                        symm_mem.enable_symm_mem_for_group(name)
                    except Exception:  # noqa: BLE001
                        pass
            self.buffer = symm_mem.empty(lay.total, dtype=torch.uint8, device=self.device)
            self._handle = symm_mem.rendezvous(self.buffer, name)
            ptrs = [0] * self.world_size
            ptrs[self.node * self.node_size : (self.node + 1) * self.node_size] = map(int, self._handle.buffer_ptrs)
        if len(self.buffer) < lay.total:
            raise ValueError(f"segment of {len(self.buffer)} bytes, need {lay.total}")

        def table(offset):
            return torch.tensor([p + offset if p else 0 for p in ptrs], dtype=torch.int64, device=self.device)

        def view(offset, count, vdtype):
            nbytes = count * torch.tensor([], dtype=vdtype).element_size()
            return self.buffer[offset : offset + nbytes].view(vdtype)

        S, T, K, H = self.sources, max_tokens_per_rank, top_k, hidden_size
        G = triton.cdiv(H, GROUP)
        x_dtype = FP8_DTYPE if fp8 else dtype
        self.flags = view(lay.flags, NUM_SLOTS * self.node_size, torch.int32)
        self.seg_n = view(lay.n, 2, torch.int32)  # tokens posted, the call's bound (max_tokens_across_ranks)
        self.seg_ids = view(lay.ids, T * K, torch.int32)
        self.seg_words = view(lay.n, 2 + T * K, torch.int32)  # both, as one run
        self.seg_x = view(lay.x, T * H, x_dtype)
        self.seg_xs = view(lay.xs, T * G, torch.float32) if fp8 else None
        self.seg_y = view(lay.y, S * T * K * H, dtype)
        self.seg_ret = view(lay.ret, T * K * H, dtype)
        first = self.node * self.node_size
        self.flag_tab = table(lay.flags)[first : first + self.node_size]  # the node's ranks signal each other
        if replicated_tokens:
            me = ptrs[self.rank]
            self.n_tab = torch.tensor([me + lay.n], dtype=torch.int64, device=self.device)
            self.ids_tab = torch.tensor([me + lay.ids], dtype=torch.int64, device=self.device)
            self.x_tab = torch.tensor([me + lay.x], dtype=torch.int64, device=self.device)
            self.xs_tab = torch.tensor([me + lay.xs], dtype=torch.int64, device=self.device)
        else:
            self.n_tab, self.ids_tab, self.x_tab, self.xs_tab = table(lay.n), table(lay.ids), table(lay.x), table(lay.xs)
        self.y_tab = table(lay.y)
        self.ret_tab = table(lay.ret)
        # Across nodes: the other nodes' rows (inbox), every rank's posted words, this node's results
        # for the other nodes' ranks of this local index and theirs for this rank (``res_*``).
        far = self.nodes - 1
        self.inbox_tab, self.inbox_s_tab = table(lay.inbox), table(lay.inbox_s)
        self.seg_inbox = view(lay.inbox, lay.inbox_s - lay.inbox, torch.uint8)
        self.seg_inbox_s = view(lay.inbox_s, (lay.total - lay.inbox_s) // 4, torch.float32)
        self.words = torch.empty(self.world_size * (2 + T * K) if far and not replicated_tokens else 1,
                                 dtype=torch.int32, device=self.device)
        self.res_send = torch.empty(far * T * K * H, dtype=dtype, device=self.device) if far else None
        self.res_recv = torch.empty(far * T * K * H, dtype=dtype, device=self.device) if far else None
        self.exchange = _exchange if _exchange is not None or not far else _Collectives(group)

        self.expert_map = placement.expert_map(self.rank).to(torch.int32).to(self.device)
        self.owner = placement.owner.to(torch.int32).to(self.device)
        self.num_global = int(placement.owner.numel())
        self.state = torch.zeros(STATE_WORDS, dtype=torch.int64, device=self.device)
        pin = self.device.type == "cuda"
        self._err_host = torch.zeros(STATE_WORDS, dtype=torch.int64, pin_memory=pin)
        self.all_ids = torch.empty(S * T, K, dtype=torch.int32, device=self.device)
        # GEMM1's pull (bf16): a ready flag (epoch) per chunk of PULL_BT tokens, and its queue head.
        self.ready = torch.zeros(S * triton.cdiv(T, PULL_BT), dtype=torch.int32, device=self.device)
        self.queue = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.xl = torch.empty(S * T, H, dtype=x_dtype, device=self.device)
        self.xsl = torch.empty(S * T, G, dtype=torch.float32, device=self.device) if fp8 else None
        self.counts = self.sorted_rows = self.act = self.act_s = self.act_h = self.tickets = None
        self.epoch = 0  # host mirror of eager calls, for naming the layer in errors
        self._layers: dict[int, str] = {}

        self.flags.zero_()
        self.seg_n.zero_()
        if _simulated is None:
            torch.cuda.synchronize(self.device)
            dist.barrier(group=group)

    # ------------------------------------------------------------------ errors

    def _raise_if_error(self, words) -> None:
        code = int(words[ST_ERR])
        if code:
            slot, peer, epoch = code - 1, int(words[ST_ERR_PEER]), int(words[ST_ERR_EPOCH])
            if slot < NUM_SLOTS:  # a flag wait names the peer by its index in this node
                peer += self.node * self.node_size
            layer = self._layers.get(epoch, "?")
            if slot == BOUND:
                raise ValueError(
                    f"kittens EP rank {self.rank}: rank {peer} passed another max_tokens_across_ranks than this "
                    f"rank (layer {layer}, call {epoch}); every rank must pass the same value; the workspace "
                    f"is unusable now"
                )
            raise PeerTimeoutError(
                f"kittens EP rank {self.rank}: rank {peer} did not {WHAT.get(slot, 'answer')} within "
                f"{self.timeout_s:g} s (layer {layer}, call {epoch}); the workspace is unusable now"
            )

    def check_errors(self) -> None:
        """Synchronise and raise ``PeerTimeoutError`` if any wait of any earlier call timed out
        (``ValueError`` if the ranks passed different ``max_tokens_across_ranks``)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._raise_if_error(self.state.cpu())

    def wait_ns(self) -> tuple[int, int]:
        """Device time (ns) the last call spent in its POSTED and COMPUTED waits (synchronises)."""
        s = self.state.cpu()
        return int(s[ST_WAIT + POSTED]), int(s[ST_WAIT + COMPUTED])

    def _on_my_node(self, rank: int) -> bool:
        return rank // self.node_size == self.node

    def _far_splits(self, size: int) -> list[int]:
        """Split sizes of an exchange between this rank and its peers of the same local index on
        the other nodes: ``size`` to and from each of them, nothing to the rest."""
        return [size if r % self.node_size == self.local_index and not self._on_my_node(r) else 0
                for r in range(self.world_size)]

    def close(self) -> None:
        self.buffer = self._handle = None
        self.seg_x = self.seg_xs = self.seg_y = self.seg_ret = self.seg_ids = self.seg_n = self.flags = None

    # ------------------------------------------------------------------ the call

    def _ensure_rows(self, inter: int, num_local: int) -> None:
        rows = self.sources * self.max_tokens * self.top_k
        if self.act is None or self.act.shape[1] != inter or self.counts.numel() != max(num_local, 1):
            self.counts = torch.empty(max(num_local, 1), dtype=torch.int32, device=self.device)
            self.sorted_rows = torch.empty(rows, dtype=torch.int32, device=self.device)
            if self.quant == "fp8":
                self.act = torch.empty(rows, inter, dtype=FP8_DTYPE, device=self.device)
                self.act_s = torch.empty(rows, triton.cdiv(inter, GROUP), dtype=torch.float32, device=self.device)
                # GEMM1's split column tiles (BLOCK_N < 128), picked for calls of at most
                # fp8_split_max_tokens: the group parts and the tickets the schedule launch zeroes
                # per call, sized for those calls' rows only.
                split_rows = self.sources * min(self.max_tokens, fp8_split_max_tokens(self.top_k, num_local)) * self.top_k
                self.act_h = torch.empty(split_rows, inter, dtype=self.dtype, device=self.device)
                self.tickets = torch.empty(split_group_tickets(split_rows, inter), dtype=torch.int32, device=self.device)
            else:
                self.act = torch.empty(rows, inter, dtype=self.dtype, device=self.device)

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
        pdl: bool | None = None,
    ) -> torch.Tensor:
        """This rank's tokens through the experts of every rank: ``[T, H]``, as ``fused_moe``.
        ``on_phase(name)``, if given, is called (on the host, between launches) as the
        ``"experts"`` and ``"combine"`` phases start: per-layer timing launches its stamps there.

        ``max_tokens_across_ranks``: the most tokens any rank passes in this call, the same value on
        every rank (vLLM knows it under data parallelism); grids and the schedule's scan are sized by
        it instead of by ``max_tokens_per_rank``, which is what keeps decode calls on a workspace
        made for long prefills cheap. Default ``max_tokens_per_rank``; with replicated tokens every
        rank holds this call's tokens, which is then the bound. Ranks that pass different values
        get an error from ``check_errors`` (or the next call). ``pdl``: programmatic dependent
        launch, as ``fused_moe_triton``'s (default ``MOK_PDL``, read now)."""
        stages = self.stages(hidden_states, w13, w2, topk_weights, topk_ids, layer=layer,
                             max_tokens_across_ranks=max_tokens_across_ranks, pdl=pdl)
        return _run_stages(stages, on_phase)

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
        layer: str = "?",
        block_shape=BLOCK_SHAPE,
        on_phase=None,
        max_tokens_across_ranks: int | None = None,
        pdl: bool | None = None,
    ) -> torch.Tensor:
        """As ``fused_moe`` with block-scaled FP8 experts (``quant="fp8"`` workspaces): bitwise the
        output of one-GPU ``fused_moe_fp8`` on the global inputs."""
        stages = self.stages(hidden_states, w13, w2, topk_weights, topk_ids, layer=layer,
                             scales=(w13_scale, w2_scale), block_shape=block_shape,
                             max_tokens_across_ranks=max_tokens_across_ranks, pdl=pdl)
        return _run_stages(stages, on_phase)

    def stages(self, hidden_states, w13, w2, topk_weights, topk_ids, *, layer: str = "?", scales=None,
               block_shape=BLOCK_SHAPE, max_tokens_across_ranks: int | None = None, pdl: bool | None = None):
        """The call as a list of launch steps (``fused_moe`` runs them in order; the interpreter
        tests run step i on every simulated rank before step i + 1). The last returns the output.
        ``scales``: ``(w13_scale, w2_scale)`` of FP8 experts (``fused_moe_fp8``)."""
        self._raise_if_error(self._err_host)
        bad_ids.raise_if_reported(self.device)
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        expert_map = self.expert_map
        fp8 = scales is not None
        if fp8 != (self.quant == "fp8"):
            raise ValueError(
                f"kittens EP workspace built with quant={self.quant!r}: call "
                f"{'fused_moe_fp8' if self.quant == 'fp8' else 'fused_moe'} (and the matching weights)"
            )
        if fp8:
            scale_bn, scale_bk = check_fused_moe_fp8_args(
                hidden_states, w13, w2, *scales, topk_weights, topk_ids, expert_map, "silu", block_shape,
                check_values=self.sync_check and not capturing,
            )
            if scale_bk != GROUP:
                raise ValueError(f"the Triton FP8 kernels need a K block of {GROUP} (block_shape[1]), got {scale_bk}")
        else:
            check_fused_moe_args(
                hidden_states, w13, w2, topk_weights, topk_ids, expert_map, "silu",
                check_values=self.sync_check and not capturing,
            )
        tokens = hidden_states.shape[0]
        if tokens > self.max_tokens or hidden_states.shape[1] != self.hidden or topk_ids.shape[1] != self.top_k:
            raise ValueError(
                f"kittens EP workspace holds up to {self.max_tokens} tokens of hidden size {self.hidden} "
                f"with top-{self.top_k}; got {tuple(hidden_states.shape)} with top-{topk_ids.shape[1]}"
            )
        if hidden_states.dtype != self.dtype:
            raise ValueError(f"kittens EP workspace is for {self.dtype}, got {hidden_states.dtype}")
        bound = call_bound(tokens, max_tokens_across_ranks, self.max_tokens)
        if not capturing:
            self.epoch += 1
            self._layers[self.epoch] = layer
            self._layers.pop(self.epoch - 64, None)

        # T: the call's bound on any source's tokens, the row layout of all_ids, xl, y and ret.
        S, T, K, H = self.sources, max(1, tokens if self.replicated else bound), self.top_k, self.hidden
        num_local, two_i, _ = w13.shape
        inter = two_i // 2
        self._ensure_rows(inter, num_local)
        rows = S * T * K
        dev = self.device
        interpret = self.interpret
        use_timer = not interpret
        timeout_ns = int(self.timeout_s * 1e9)
        k_pad = max(2, triton.next_power_of_2(K))
        out = torch.empty((tokens, H), dtype=self.dtype, device=dev)
        pdl_on = knob("pdl", pdl)
        pdl = pdl_launch(out, pdl_on)
        push = self.return_mode == "push"
        gemm1_pulls = self.pull_in_gemm1 and not fp8
        far = self.nodes - 1  # other nodes
        rows_cross = far > 0 and not self.replicated  # token rows cross nodes (not with replicated tokens)

        def post():
            bt = 4
            id_programs = max(triton.cdiv(tokens, bt), 1)
            ep_post_kernel[(id_programs + (quantize_programs(tokens, H) if fp8 else 0),)](
                hidden_states, topk_ids, self.seg_x, self.seg_xs if fp8 else self.seg_x, self.seg_ids, self.seg_n,
                tokens, T, H, id_programs,
                hidden_states.stride(0), hidden_states.stride(1), topk_ids.stride(0), topk_ids.stride(1),
                TOPK=K, K_PAD=k_pad, BT=bt, BLOCK_H=min(1024, triton.next_power_of_2(H)), COPY_X=not fp8,
                QUANT=fp8, QROWS=QROWS, RNE_FIX=interpret, num_warps=4, **pdl,
            )

        def sync(slot, signal=True, wait=True):
            def run():
                ep_sync_kernel[(1,)](
                    self.flags, self.flag_tab, self.state, slot, self.local_index, self.node_size,
                    timeout_ns, self.max_spins, BUMP_EPOCH=slot == POSTED and signal, USE_TIMER=use_timer,
                    SIGNAL=signal, WAIT=wait, num_warps=1, **pdl,
                )
            return run

        copy_block_h = min(1024, triton.next_power_of_2(H))

        def gather():
            bt = 4
            G = triton.cdiv(H, GROUP)
            ep_gather_kernel[(S, triton.cdiv(T, bt), 1 if gemm1_pulls else triton.cdiv(H, copy_block_h))](
                self.n_tab, self.ids_tab, self.x_tab, self.xs_tab if fp8 else self.x_tab, self.all_ids,
                self.xl.view(torch.uint8) if fp8 else self.xl, self.xsl if fp8 else self.xl, expert_map, self.queue,
                self.state, self.words, self.inbox_tab, self.inbox_s_tab,
                T, H, G, self.num_global, num_local, self.node_size, self.node,
                TOPK=K, K_PAD=k_pad, BT=bt, BLOCK_H=copy_block_h, COPY_ROWS=not gemm1_pulls,
                SCALES=fp8, BLOCK_G=max(16, triton.next_power_of_2(G)) if fp8 else 16, ACROSS_NODES=rows_cross,
                num_warps=4, **pdl,
            )

        def exchange_ids():  # every rank's count, bound and ids, to every rank
            self.exchange.all_gather(self.words[: self.world_size * (2 + T * K)], self.seg_words[: 2 + T * K])

        def exchange_rows():  # this rank's T rows (and FP8 scales) to each other node's rank of its index
            parts = [(self.seg_x.view(torch.uint8), self.seg_inbox, H * self.seg_x.element_size())]
            if fp8:
                parts.append((self.seg_xs, self.seg_inbox_s, triton.cdiv(H, GROUP)))
            for seg, inbox, row in parts:
                send = seg[: T * row]
                splits = self._far_splits(T * row)  # the same sizes both ways
                self.exchange.all_to_all(inbox[: far * T * row], send.repeat(far) if far > 1 else send, splits, splits)

        picker = pick_configs_fp8 if fp8 else pick_configs
        g1, g2 = picker(T, K, max(num_local, 1), H, inter)  # by T, the bound rows are laid out for
        split = fp8 and g1.get("BLOCK_N", GROUP) != GROUP  # FP8 GEMM1 programs share groups: zero their tickets

        def schedule():
            if num_local == 0:
                return
            zero = dict(kernel=_moe_schedule_zero_kernel, extra_programs=1,
                        extra_args=(self.tickets, split_group_tickets(rows, inter))) if split else {}
            launch_schedule(self.all_ids[: S * T], expert_map, self.counts, self.sorted_rows, num_local, self.num_global,
                            pdl=pdl_on, **zero)
        ret_args = dict(kernel=ep_fp8_gemm2_push_kernel if fp8 else ep_gemm2_push_kernel,
                        extra_args=(self.ret_tab, self.rank, T * K), ELEM_BYTES=self.seg_ret.element_size())

        def gemms():
            if num_local == 0 or inter == 0:
                return
            y, push_args = (self.seg_ret, ret_args) if push else (self.seg_y, {})
            if fp8:
                w13_scale, w2_scale = scales
                launch_fp8_gemm1(
                    self.xl, self.xsl, w13, w13_scale, self.act, self.act_s, self.sorted_rows, self.counts,
                    rows, K, g1, act_h=self.act_h, tickets=self.tickets, in_dtype=self.dtype, scale_bn=scale_bn,
                    interpret=interpret, pdl=pdl_on,
                )
                launch_fp8_gemm2(
                    self.act, self.act_s, w2, w2_scale, y, self.sorted_rows, self.counts, rows, g2,
                    scale_bn=scale_bn, interpret=interpret, pdl=pdl_on, **push_args,
                )
            else:
                pull = {}
                if gemm1_pulls:  # GEMM1 pulls its rows and starts each tile as they arrive
                    pull_args = (self.x_tab, self.all_ids, expert_map, self.ready, self.queue, self.state,
                                 S, T, self.num_global, S * triton.cdiv(T, PULL_BT), self.max_polls)
                    pull = dict(kernel=ep_gemm1_pull_kernel, extra_args=pull_args,
                                K_PAD=k_pad, BT=PULL_BT, BLOCK_H=copy_block_h)
                launch_gemm1(self.xl, w13, self.act, self.sorted_rows, self.counts, rows, K, g1, interpret=interpret,
                             pdl=pdl_on, **pull)
                launch_gemm2(self.act, w2, y, self.sorted_rows, self.counts, rows, g2, interpret=interpret, pdl=pdl_on, **push_args)

        def collect():  # this node's results for each other node's rank of this local index
            block_h = combine_block(H)
            ep_collect_kernel[(far * T, triton.cdiv(H, block_h))](
                self.y_tab, self.all_ids, self.owner, self.res_send, T, H, self.num_global, self.node_size,
                self.node, self.local_index, TOPK=K, REPLICATED=self.replicated, BLOCK_H=block_h, num_warps=4, **pdl,
            )

        def exchange_results():
            n = far * T * K * H
            splits = self._far_splits(T * K * H)
            self.exchange.all_to_all(self.res_recv[:n], self.res_send[:n], splits, splits)

        def combine():
            if tokens:
                block_h = combine_block(H)
                src_row0 = 0 if (self.replicated or push) else self.rank * T * K
                ep_combine_kernel[(tokens, triton.cdiv(H, block_h))](
                    self.y_tab, self.seg_ret, out, topk_ids, topk_weights, self.owner,
                    self.res_recv if far else self.seg_ret, H, self.num_global, src_row0, self.node_size, self.node,
                    T * K, topk_ids.stride(0), topk_ids.stride(1), topk_weights.stride(0), topk_weights.stride(1),
                    out.stride(0),
                    TOPK=K, PULL=not push, ACROSS_NODES=far > 0, BLOCK_H=block_h, RNE_FIX=interpret, num_warps=4,
                    **pdl,
                )
            if not capturing and dev.type == "cuda":
                self._err_host.copy_(self.state, non_blocking=True)
            if self.sync_check:
                self.check_errors()
            elif dev.type != "cuda":
                self._err_host.copy_(self.state)
            return out

        def flag(slot):  # simulated ranks: signal and wait as separate steps, so the ranks can interleave
            return [sync(slot, wait=False), sync(slot, signal=False)] if self.simulated else [sync(slot)]

        if not far:
            return [post, *flag(POSTED), gather, schedule, gemms, *flag(COMPUTED), combine]
        dispatch = [] if self.replicated else [exchange_ids]
        posted = [] if self.replicated else [exchange_rows, *flag(INBOX)]
        return [post, *dispatch, *flag(POSTED), *posted, gather, schedule, gemms, *flag(COMPUTED), collect,
                exchange_results, combine]
