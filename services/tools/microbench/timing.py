"""What the GPU benchmark's sections share (gpu.py, swaps.py, kernels.py): timing that includes
the device's queued work, the copy bandwidth every fraction is of, tables, and random prompts."""

from __future__ import annotations

import gc
import importlib.metadata
import platform
import statistics
import time

import torch

COPY_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}
COPY_ITERS = {"cuda": 20, "cpu": 8}
COPY_CONVENTION = ("copy GB/s counts the bytes read plus the bytes written by a device-to-device copy; a decode "
                   "step's roofline is the bytes it must read (decoder weights at their bits, LM head, embedding "
                   "rows, the KV of every sequence's context) divided by that bandwidth; fraction = roofline step "
                   "time / measured step time")



class Clock:
    """Host wall time that includes the device's queued work: on CUDA every reading synchronizes first."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def device_ms(fn) -> float:
    """Median milliseconds of one call of `fn` on CUDA, after warm-up."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    for _ in range(10):
        fn()
    times = []
    for _ in range(50):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> dict:
    nbytes, iters = COPY_BYTES[device.type], COPY_ITERS[device.type]
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return dict(bytes=nbytes, iterations=iters, median_ms=median * 1e3, best_ms=min(times) * 1e3,
                gbs=2 * nbytes / median / 1e9, convention=COPY_CONVENTION)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for row in cells:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), flush=True)


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: torch.device) -> dict:
    info = dict(platform=platform.platform(), processor=platform.processor(), python=platform.python_version(),
                torch=torch.__version__, cuda=torch.version.cuda, triton=_version("triton"),
                transformers=_version("transformers"), cpu_threads=torch.get_num_threads())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= dict(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     compute_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count)
    return info


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()
