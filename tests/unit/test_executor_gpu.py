"""GPU stats through a stand-in pynvml, so both paths are checked on machines without a GPU."""

import importlib
import sys
import types

import pytest


class _NVMLError(Exception):
    pass


class _NotSupported(_NVMLError):
    pass


class _InvalidArgument(_NVMLError):
    pass


def _fake_pynvml(devices: int, init_fails: bool = False) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError, m.NVMLError_NotSupported, m.NVMLError_InvalidArgument = _NVMLError, _NotSupported, _InvalidArgument
    m.calls = 0

    def init():
        m.calls += 1
        if init_fails:
            raise _NVMLError("NVML Shared Library Not Found")

    def handle(i):
        if i >= devices:
            raise _InvalidArgument("Invalid Argument")
        return i

    m.nvmlInit = init
    m.nvmlDeviceGetCount = lambda: devices
    m.nvmlSystemGetDriverVersion = lambda: "999.0"
    m.nvmlDeviceGetHandleByIndex = handle
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=3 << 30, total=80 << 30)
    m.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=42)
    return m


@pytest.fixture
def nvml(monkeypatch):
    def load(fake):
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        import services.executor.gpu as module

        return importlib.reload(module)  # fresh module state: nothing tried yet

    yield load
    import services.executor.gpu as module

    monkeypatch.undo()
    importlib.reload(module)


def test_reads_memory_and_utilisation(nvml):
    module = nvml(_fake_pynvml(devices=1))
    stats = module.read_gpu_stats(0)
    assert (stats.memory_used, stats.memory_total, stats.utilization_pct) == (3 << 30, 80 << 30, 42.0)
    assert module.read_gpu_stats(5) is None  # no such GPU: None, not an exception


def test_no_gpu_logs_once_and_stops_trying(nvml, caplog):
    fake = _fake_pynvml(devices=0, init_fails=True)
    module = nvml(fake)
    caplog.set_level("INFO", logger=module.__name__)
    assert [module.read_gpu_stats() for _ in range(100)] == [None] * 100
    assert fake.calls == 1
    assert sum("no NVIDIA GPU" in r.message for r in caplog.records) == 1
