"""The GPU's SM clock, power draw and power-cap state while something is timed.

An H200 runs compute-bound kernels at its 700 W limit, where the SM clock drops well below its top
(loadtest/JOURNAL.md#why-the-compute-bound-end-stays-above-the-floor measured 1100-1600 MHz
against 1980), so a time means more beside the clock it ran at. ``ClockSampler`` reads NVML (the
library behind ``nvidia-smi``, through ctypes: no Python package needed) every few milliseconds in
a background thread; ``summary(t0, t1)`` gives the
median clock and power and the share of samples with the software power cap active between two
``time.monotonic()`` stamps. Without NVML (no driver, CPU machines) it samples nothing and every
summary is ``None``.
"""

from __future__ import annotations

import ctypes
import statistics
import threading
import time
from collections.abc import Callable

# (SM clock MHz, power W, clock event reasons bitmask) of one reading.
Reading = tuple[float, float, int]

_NVML_CLOCK_SM = 1
SW_POWER_CAP = 0x4  # nvmlClocksEventReasonSwPowerCap


def nvml_reader(uuid: str | None = None, index: int = 0) -> Callable[[], Reading] | None:
    """A function reading the GPU with this UUID (as ``torch.cuda.get_device_properties(i).uuid``
    prints it), or without one NVML's GPU ``index`` (no CUDA context needed: a load-test client
    beside a server), through NVML; ``None`` where NVML is not there or does not know the GPU."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    handle = ctypes.c_void_p()
    if lib.nvmlInit_v2() != 0:
        return None
    found = (lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) if uuid is None
             else lib.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}".encode(), ctypes.byref(handle)))
    if found != 0:
        return None
    # Renamed from "throttle" to "clocks event" reasons in newer drivers; same bits.
    reasons_fn = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or lib.nvmlDeviceGetCurrentClocksThrottleReasons
    clock, milliwatts, reasons = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()

    def read() -> Reading:
        lib.nvmlDeviceGetClockInfo(handle, _NVML_CLOCK_SM, ctypes.byref(clock))
        lib.nvmlDeviceGetPowerUsage(handle, ctypes.byref(milliwatts))
        reasons_fn(handle, ctypes.byref(reasons))
        return float(clock.value), milliwatts.value / 1000.0, int(reasons.value)

    return read


class ClockSampler:
    """Samples ``read()`` every ``period_s`` in a daemon thread from construction to ``stop()``."""

    def __init__(self, read: Callable[[], Reading] | None, period_s: float = 0.005):
        self._read = read
        self._period = period_s
        self._samples: list[tuple[float, Reading]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        if read is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-clock-sampler", daemon=True)
            self._thread.start()

    @property
    def available(self) -> bool:
        return self._read is not None

    @classmethod
    def for_cuda_device(cls, index: int = 0) -> ClockSampler:
        import torch

        return cls(nvml_reader(str(torch.cuda.get_device_properties(index).uuid)))

    def _run(self) -> None:
        while not self._stop.is_set():
            sample = (time.monotonic(), self._read())
            with self._lock:
                self._samples.append(sample)
            self._stop.wait(self._period)

    def summary(self, t0: float, t1: float) -> dict | None:
        """Median SM clock (MHz) and power (W), and the share of samples with the software power
        cap active, over the samples taken between ``t0`` and ``t1``; ``None`` without any."""
        with self._lock:
            window = [r for t, r in self._samples if t0 <= t <= t1]
        if not window:
            return None
        return dict(
            sm_mhz=statistics.median(r[0] for r in window),
            power_w=statistics.median(r[1] for r in window),
            power_capped=sum(bool(r[2] & SW_POWER_CAP) for r in window) / len(window),
            samples=len(window),
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def clock_text(clock: dict | None) -> str:
    """A ``ClockSampler.summary`` as ``1410 MHz (cap 92%)``; ``-`` without one."""
    if not clock:
        return "-"
    return f"{clock['sm_mhz']:.0f} MHz (cap {clock['power_capped']:.0%})"
