"""Per-layer MoE timing and expert load, collected inside vLLM's workers.

``KittensFusedMoEMethod`` (which vLLM uses for every unquantized MoE layer once the plugin is
loaded, whichever ``--moe-backend``) registers each layer here and stamps up to four points
of each call::

    0 BEGIN          after top-k routing, before prepare/dispatch   (also counts top-k ids)
    1 EXPERTS_BEGIN  every row has arrived, the expert GEMMs start  (kittens EP only)
    2 EXPERTS_END    this rank's experts are done, combine starts   (kittens EP only)
    3 END            after finalize/combine

so a sampled call gives ``total = t3 - t0`` and, under kittens expert parallelism,
``dispatch = t1 - t0``, ``experts = t2 - t1``, ``combine = t3 - t2``. Only there are the phases
separable: on one rank kittens is one fused op, and the stock backends' prepare/finalize are
vLLM's (no-ops without EP). Points 1 and 2 are stamped inside the EP op, by the workspace's
``on_phase`` hook (:func:`phase_marker`), not by :func:`mark`.

CPU: vLLM compiles the model with Dynamo + Inductor and traces into the MoE method, so
:func:`mark` is an opaque C++ op (``mok_serve_cpu::moe_timer``, ``kernels/cpu/cpu_timer.cpp``) that
returns a copy of the tensor it is given; the caller threads the copy into the rest of the
layer (top-k ids into the experts, the output to the layer's consumers), so Inductor cannot move
a timer away from the work it brackets. It writes the same buffer as the CUDA kernel below, in
C++: a stamp costs a few microseconds, where a Python op cost tens (measured on the 2-core VM,
server/README.md). Clock: ``std::chrono::steady_clock``.

CUDA: no host synchronisation and CUDA-graph safe. Each mark is one tiny Triton program that
reads ``%globaltimer`` and writes it into a per-layer device buffer (call counter, ring of
sampled timestamps, cumulative histograms); top-k ids are counted with ``index_add_``. Python
does not run on graph replays, so sampling is decided on the device from the call counter.
The buffers are read (one device-to-host copy) only by the stats RPC.

Configuration comes from ``VllmConfig.additional_config["kittens_timing"]`` (``mok-serve`` sets
it from ``--kittens-timing`` / ``--kittens-timing-window``; being part of the config hash it
keeps timed and untimed compiled graphs apart in vLLM's compile cache)::

    {"sample_every": N, "window": W}   # N = 0: off (the MoE path is exactly the stock one)

The API server reads the stats with ``collective_rpc("kittens_layer_stats")`` (every rank)
through :class:`KittensWorkerExtension` (``--worker-extension-cls``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from mok_serve.kernels.cpu import moe as cpu_moe

logger = logging.getLogger("vllm.mok_serve")

CONFIG_KEY = "kittens_timing"
DEFAULT_SAMPLE_EVERY = 1
DEFAULT_WINDOW = 1024
BEGIN, EXPERTS_BEGIN, EXPERTS_END, END = 0, 1, 2, 3
PHASES = ("total", "dispatch", "experts", "combine")
# Histogram bucket upper bounds, seconds (Prometheus `le`), then +Inf.
BUCKETS_S = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 1e-1, 2.5e-1, 1.0,
)  # fmt: skip
BUCKETS_NS = tuple(int(round(b * 1e9)) for b in BUCKETS_S)
NB = len(BUCKETS_S) + 1  # with +Inf
NBP = 16  # bucket bounds padded to a power of two for the Triton kernel (2**62 past the last)


@dataclass(frozen=True)
class TimingConfig:
    sample_every: int = 0
    window: int = DEFAULT_WINDOW

    @property
    def enabled(self) -> bool:
        return self.sample_every > 0


def config_from_vllm(vllm_config=None) -> TimingConfig:
    if vllm_config is None:
        from vllm.config import get_current_vllm_config_or_none

        vllm_config = get_current_vllm_config_or_none()
    extra = getattr(vllm_config, "additional_config", None) if vllm_config is not None else None
    raw = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if not raw:
        return TimingConfig()
    sample_every = int(raw.get("sample_every", DEFAULT_SAMPLE_EVERY))
    window = int(raw.get("window", DEFAULT_WINDOW))
    if sample_every < 0 or window < 1:
        raise ValueError(f"{CONFIG_KEY}: sample_every must be >= 0 and window >= 1, got {raw}")
    return TimingConfig(sample_every, window)


def _summary_ms(values_ns) -> dict | None:
    import numpy as np

    if len(values_ns) == 0:
        return None
    a = np.asarray(values_ns, dtype=np.float64) / 1e6
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        "mean": float(a.mean()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(a.max()),
        "samples": int(a.size),
    }


class LayerTimer:
    """One MoE layer on one rank. ``window`` state is cleared by reset; ``total_*`` and the
    histograms are cumulative (Prometheus counters never go down).

    Stamps live in one int64 buffer on the layer's device, written by the CUDA timer kernel
    (``kernels/cuda/timer.py``) or the C++ CPU op (``kernels/cpu/cpu_timer.cpp``): ``[0]`` calls, ``[1]``
    tokens, then ``W x 4`` stamps from ``RING``, then ``4 x NB`` histogram counts from ``hist_off``,
    then 4 sums (ns) from ``sums_off``. The sampling decision, the ring index and the buckets come
    from the call counter in the buffer, so no Python runs per call."""

    RING = 8

    def __init__(self, slot, name, index, num_experts, top_k, local_experts, ep_rank, ep_size,
                 experts_class, config: TimingConfig, device: torch.device):  # fmt: skip
        self.slot, self.name, self.index = slot, name, index
        self.num_experts, self.top_k = num_experts, top_k
        self.local_experts, self.ep_rank, self.ep_size = local_experts, ep_rank, ep_size
        self.experts_class = experts_class
        self.config = config
        self.device = device
        self.window_started = time.time()
        self.counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.base_calls = self.base_tokens = 0
        self.base_counts = [0] * num_experts
        W = config.window
        self.hist_off = self.RING + 4 * W
        self.sums_off = self.hist_off + 4 * NB
        self.buf = torch.zeros(self.sums_off + 4, dtype=torch.int64, device=device)
        self.bounds = torch.tensor(list(BUCKETS_NS) + [2**62] * (NBP - len(BUCKETS_NS)), dtype=torch.int64, device=device)

    def mark(self, t: torch.Tensor | None, point: int) -> None:
        """Stamp ``point`` now (eagerly; compiled models call :func:`mark`). ``t``: the top-k ids
        at BEGIN, else unused (None)."""
        raise NotImplementedError

    def read(self) -> dict:
        buf = self.buf.cpu().tolist()
        W = self.config.window
        ring = [buf[self.RING + 4 * i : self.RING + 4 * i + 4] for i in range(W)]
        samples = [s for s in ring if s[0] and s[3] >= s[0]]
        hist = {}
        for j, p in enumerate(PHASES):
            hist[p] = {
                "buckets": buf[self.hist_off + j * NB : self.hist_off + (j + 1) * NB],
                "sum_ns": buf[self.sums_off + j],
            }
        return {"calls": buf[0], "tokens": buf[1], "samples": samples, "histograms": hist}

    def clear_window(self) -> None:
        self.buf[: self.hist_off].zero_()

    def snapshot(self) -> dict:
        state = self.read()
        counts = self.counts.tolist()
        samples = state["samples"]  # list of (t0, t1, t2, t3) ns; t1/t2 0 when absent
        total = [s[3] - s[0] for s in samples]
        phases = None
        phased = [s for s in samples if s[1] and s[2]]
        if phased:
            phases = {
                "dispatch": _summary_ms([s[1] - s[0] for s in phased]),
                "experts": _summary_ms([s[2] - s[1] for s in phased]),
                "combine": _summary_ms([s[3] - s[2] for s in phased]),
            }
        nonzero_mean = sum(counts) / len(counts) if counts else 0
        local = self.local_experts
        return {
            "rank_stats": {
                "ep_rank": self.ep_rank,
                "ep_size": self.ep_size,
                "experts_class": self.experts_class,
                "local_experts": local,
                "calls": state["calls"],
                "tokens": state["tokens"],
                "sampled_calls": len(samples),
                "latency_ms": _summary_ms(total),
                "phases_ms": phases,
                "expert_tokens": counts,
                "local_expert_tokens": sum(counts[e] for e in local),
                "imbalance": (max(counts) / nonzero_mean) if nonzero_mean > 0 else None,
            },
            "cumulative": {
                "calls": self.base_calls + state["calls"],
                "tokens": self.base_tokens + state["tokens"],
                "expert_tokens": [b + c for b, c in zip(self.base_counts, counts)],
                "histograms": state["histograms"],  # phase -> {"buckets": [NB counts], "sum_ns": int}
            },
        }

    def restart(self) -> None:
        """Forget every call so far, window and cumulative counters alike: called once when the
        server starts serving, so that neither ``/v1/kittens/layers`` nor ``/metrics`` counts vLLM's
        start-up calls (memory profiling, warm-up, CUDA-graph capture)."""
        self.buf.zero_()
        self.counts.zero_()
        self.base_calls = self.base_tokens = 0
        self.base_counts = [0] * self.num_experts
        self.window_started = time.time()

    def reset(self) -> None:
        """Start a new window; the cumulative counters (Prometheus) keep counting."""
        state = self.read()
        counts = self.counts.tolist()
        self.base_calls += state["calls"]
        self.base_tokens += state["tokens"]
        self.base_counts = [b + c for b, c in zip(self.base_counts, counts)]
        self.counts.zero_()
        self.clear_window()
        self.window_started = time.time()


class CpuLayerTimer(LayerTimer):
    """Host clock (``steady_clock``), stamped by the C++ op ``mok_serve_cpu::moe_timer``
    (``kernels/cpu/cpu_timer.cpp``), which also counts the top-k ids at BEGIN. Registered with the op
    under the layer's slot; needs kittens' CPU extension (``kernels.cpu.moe.available()``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.config
        torch.ops.mok_serve_cpu.timer_register(
            self.slot, self.buf, self.bounds, self.counts, cfg.sample_every, cfg.window,
            self.RING, self.hist_off, self.sums_off,
        )  # fmt: skip

    def mark(self, t: torch.Tensor | None, point: int) -> None:
        torch.ops.mok_serve_cpu.moe_timer(_NO_IDS if t is None else t, self.slot, point)


_NO_IDS = torch.empty(0, dtype=torch.int64)


class TritonLayerTimer(LayerTimer):
    """Device-side timestamps (``%globaltimer``) written by a tiny Triton kernel; top-k ids are
    counted with ``index_add_``. ``use_globaltimer=False`` (the Triton interpreter on a CPU)
    stamps the host clock instead."""

    def __init__(self, *args, use_globaltimer: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        from mok_serve.kernels.cuda.timer import launch_moe_timer

        self._launch = launch_moe_timer
        self.use_globaltimer = use_globaltimer

    def mark(self, t: torch.Tensor | None, point: int) -> None:
        if point == BEGIN:
            # Unrouted slots (-1) and any id out of range count nothing (and index nothing).
            ids = t.reshape(-1).to(torch.int64)
            valid = (ids >= 0) & (ids < self.num_experts)
            self.counts.index_add_(0, ids.clamp(0, self.num_experts - 1), valid.to(torch.int64))
        cfg = self.config
        self._launch(
            self.buf, self.bounds, point, t.shape[0] if point == BEGIN else 0, cfg.sample_every, cfg.window,
            ring=self.RING, hist=self.hist_off, sums=self.sums_off, nb=NB, nbp=NBP,
            use_globaltimer=self.use_globaltimer,
        )


class _Registry:
    def __init__(self):
        self.layers: list[LayerTimer] = []
        self.by_name: dict[str, LayerTimer] = {}
        self.config = TimingConfig()
        self.backend = None

    def register(self, layer, config: TimingConfig, backend: str, experts_class: str) -> int | None:
        name = layer.layer_name
        if name in self.by_name:
            return self.by_name[name].slot
        from vllm.model_executor.models.utils import extract_layer_index

        try:
            index = extract_layer_index(name)
        except Exception:
            index = len(self.layers)
        pcfg = layer.moe_config.moe_parallel_config
        num_experts = int(layer.global_num_experts)
        expert_map = layer.expert_map
        if expert_map is None:
            local = list(range(num_experts))
        else:
            local = [e for e, v in enumerate(expert_map.tolist()) if v >= 0]
        device = layer.w13_weight.device
        cls = TritonLayerTimer if device.type == "cuda" else CpuLayerTimer
        if cls is CpuLayerTimer and not cpu_moe.available():
            logger.warning("kittens: per-layer timing is off: it needs kittens' CPU extension, which did not build")
            return None
        timer = cls(
            len(self.layers), name, index, num_experts, int(layer.moe_config.experts_per_token), local,
            int(pcfg.ep_rank), int(pcfg.ep_size), experts_class, config, device,
        )  # fmt: skip
        self.layers.append(timer)
        self.by_name[name] = timer
        self.config = config
        self.backend = backend
        return timer.slot


REGISTRY = _Registry()


def register_layer(layer, config: TimingConfig, backend: str, experts_class: str) -> int | None:
    """The layer's timer slot, or None when timing cannot run (the CPU extension did not build)."""
    return REGISTRY.register(layer, config, backend, experts_class)


def mark(t: torch.Tensor, slot: int, point: int) -> torch.Tensor:
    """Time stamp ``point`` of layer ``slot``; use the returned tensor in place of ``t``.

    On CUDA this launches the timer kernel and returns ``t`` itself (stream order is enough);
    on the CPU it is the C++ op ``mok_serve_cpu::moe_timer``, opaque to the compiler, which
    returns a copy the caller must use.
    """
    if t.is_cuda:
        REGISTRY.layers[slot].mark(t, point)
        return t
    return torch.ops.mok_serve_cpu.moe_timer(t, slot, point)


_PHASE_POINTS = {"experts": EXPERTS_BEGIN, "combine": EXPERTS_END}


def phase_marker(slot: int):
    """The ``on_phase`` hook of the EP workspaces for layer ``slot`` (None when ``slot`` < 0).
    It runs inside the EP custom op, where a compiler cannot reorder it, so it stamps directly."""
    if slot < 0:
        return None
    timer = REGISTRY.layers[slot]
    return lambda phase: timer.mark(None, _PHASE_POINTS[phase])


def snapshot(rank_info: dict) -> dict:
    """This rank's stats, plain Python (msgpack-able) for ``collective_rpc``."""
    return {
        **rank_info,
        "backend": REGISTRY.backend,
        "timing": {"enabled": REGISTRY.config.enabled, "sample_every": REGISTRY.config.sample_every,
                   "window_calls": REGISTRY.config.window},  # fmt: skip
        "clock": "cuda %globaltimer" if any(isinstance(t, TritonLayerTimer) for t in REGISTRY.layers)
        else "host steady_clock",
        "window_started": min((t.window_started for t in REGISTRY.layers), default=time.time()),
        "now": time.time(),
        "layers": [
            {"index": t.index, "name": t.name, "num_experts": t.num_experts, "top_k": t.top_k, **t.snapshot()}
            for t in REGISTRY.layers
        ],
    }


def reset() -> int:
    for t in REGISTRY.layers:
        t.reset()
    return len(REGISTRY.layers)


def restart() -> int:
    for t in REGISTRY.layers:
        t.restart()
    return len(REGISTRY.layers)


class KittensWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls``); the API server calls these
    methods on every rank with ``engine_client.collective_rpc``."""

    def _kittens_rank_info(self) -> dict:
        info = {"rank": int(getattr(self, "rank", 0)), "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "pid": _pid()}
        try:
            from vllm.distributed import parallel_state as ps

            info["tp_rank"] = ps.get_tensor_model_parallel_rank()
            info["tp_size"] = ps.get_tensor_model_parallel_world_size()
            info["dp_rank"] = ps.get_dp_group().rank_in_group
        except Exception:
            pass
        return info

    def _kittens_graph_limit(self) -> int | None:
        """The most tokens a step can have and still replay a CUDA graph (larger steps run
        eagerly); None without CUDA graphs."""
        config = getattr(self, "vllm_config", None)
        compilation = getattr(config, "compilation_config", None)
        mode = getattr(compilation, "cudagraph_mode", None)
        if compilation is None or mode is None or getattr(mode, "name", "NONE") == "NONE":
            return None
        return compilation.max_cudagraph_capture_size

    def kittens_layer_stats(self) -> dict:
        return {**snapshot(self._kittens_rank_info()), "max_cudagraph_capture_size": self._kittens_graph_limit()}

    def kittens_layer_reset(self) -> int:
        return reset()

    def kittens_layer_restart(self) -> int:
        return restart()


def _pid() -> int:
    import os

    return os.getpid()
