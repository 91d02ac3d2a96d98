"""GPU memory and utilisation from NVML, for the executor's telemetry.

Executors report every ~100 ms, on machines with and without NVIDIA GPUs (development runs on CPU).
So a machine without a GPU or driver is detected once, said once in the log, and every later call
returns None at the cost of a flag check instead of retrying a failing library load each time.
NVML is process-wide and its calls are cheap, so handles are kept per device index.
"""

import logging
import threading

from shared.messages import GpuStats

log = logging.getLogger(__name__)

_lock = threading.Lock()
_available: bool | None = None  # None: not tried yet
_handles: dict[int, object] = {}
_bad_indices: set[int] = set()


def _init() -> bool:
    global _available
    with _lock:
        if _available is not None:
            return _available
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("the driver reports no devices")
            _available = True
            log.info("NVML: %d GPU(s), driver %s", count, pynvml.nvmlSystemGetDriverVersion())
        except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, DriverNotLoaded, ...
            _available = False
            log.info("no NVIDIA GPU: GPU memory/utilisation not reported (%s)", exc)
        return _available


def read_gpu_stats(index: int = 0) -> GpuStats | None:
    """Memory used/total (bytes) and utilisation (%) of GPU `index`, or None where there is none."""
    if _available is False or index in _bad_indices or not _init():
        return None
    import pynvml

    try:
        handle = _handles.get(index)
        if handle is None:
            handle = _handles[index] = pynvml.nvmlDeviceGetHandleByIndex(index)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            utilization = float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except pynvml.NVMLError_NotSupported:
            # Some devices (MIG slices, some vGPUs) have no utilisation counter; memory still counts.
            utilization = 0.0
        return GpuStats(memory_used=int(memory.used), memory_total=int(memory.total),
                        utilization_pct=utilization)
    except pynvml.NVMLError_InvalidArgument:
        _bad_indices.add(index)
        log.warning("NVML: no GPU with index %d: GPU memory/utilisation not reported for it", index)
        return None
    except pynvml.NVMLError as exc:
        # Transient (e.g. GPU lost and reset): skip this report, try again next time.
        _handles.pop(index, None)
        log.debug("NVML read of GPU %d failed: %s", index, exc)
        return None
