"""Launch configurations chosen by timing them on the GPU that runs them.

A low-bit linear's best tiles, K split and warps depend on the GPU, on the weight's shape and on the rows of
the batch, and a table written for one GPU is wrong for the next (issue 15 measured our fixed tiles at
0.22-0.73x of cuBLAS on an H100). So the first time a kernel meets a (shape, rows) key it times a few
candidate configurations on the device, keeps the fastest, and records it in a small JSON file per GPU model,
from which the next process starts tuned. Rows are keyed by their power of two, so a prefill of any length
costs at most one tuning per bucket. `morphling_kernels/tuned/` ships the files of the GPUs lent to this project: a
fresh machine of such a model starts from them (its own file wins where both have a key), since tuning an
engine's start cold took an H100 over six minutes.

Timing needs the device outside a CUDA graph capture. Decode graphs run every piece once eagerly before they
capture it (services/executor/engine/graphs.py), which is when a decode key is first met; a key first met
inside a capture takes its first candidate and is tuned at its next eager call. Off CUDA (the interpreter)
the first candidate is taken untimed, and so it is with MORPHLING_TUNING=0.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import TypeVar

import torch

Config = TypeVar("Config", bound=tuple)

WARMUP, REPEATS = 2, 10
SHIPPED = Path(__file__).parent / "tuned"
_chosen: dict[str, tuple] = {}  # what this process launches: tuned here, or saved and still a candidate
_saved: dict[str, tuple] = {}  # what the cache files hold
_loaded: set[str] = set()  # the cache files read


def cache_file(device: torch.device) -> Path:
    root = Path(os.environ.get("MORPHLING_TUNING_CACHE", Path.home() / ".cache" / "morphling" / "tuning"))
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", torch.cuda.get_device_name(device))
    return root / f"{name}.json"


def choose(kernel: str, key: Hashable, candidates: Callable[[], Sequence[Config]],
           launch: Callable[[Config], object], device: torch.device) -> Config:
    """The fastest of `candidates()` for `kernel` at `key`, `launch(config)` running the kernel once with it
    (it may be launched again: its output must be a function of its inputs). Every linear of every prefill
    asks, so a key decided before is answered from memory alone."""
    name = f"{kernel}{key}"
    chosen = _chosen.get(name)
    if chosen is not None:
        return chosen
    options = candidates()
    if device.type != "cuda" or os.environ.get("MORPHLING_TUNING") == "0" or len(options) == 1:
        return options[0]
    path = cache_file(device)
    if str(path) not in _loaded:
        _loaded.add(str(path))
        _saved.update(saved_choices(path))
    if _saved.get(name) in options:
        _chosen[name] = _saved[name]
        return _chosen[name]
    if torch.cuda.is_current_stream_capturing():
        return options[0]
    _chosen[name] = _saved[name] = min(options, key=lambda c: _time(launch, c))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(_saved, indent=1, sort_keys=True))
    tmp.replace(path)  # processes tuning at once each write a whole file
    return _chosen[name]


def saved_choices(path: Path) -> dict[str, tuple]:
    """What was tuned before on the GPU model whose file `path` is: the shipped file, then `path` over it."""
    saved: dict[str, tuple] = {}
    for source in (SHIPPED / path.name, path):
        if source.exists():
            saved.update({k: tuple(v) for k, v in json.loads(source.read_text()).items()})
    return saved


def _time(launch: Callable[[Config], object], config: Config) -> float:
    """Mean seconds of one launch with `config`, after warm-up (its compile included there); inf when the
    configuration cannot run on this device (too many registers or too much shared memory)."""
    try:
        for _ in range(WARMUP):
            launch(config)
    except Exception as exc:  # Triton's OutOfResources and compile errors have no common public base
        if "OutOfResources" in type(exc).__name__ or "out of resource" in str(exc).lower():
            return float("inf")
        raise
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        launch(config)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / REPEATS / 1e3


def rows_bucket(m: int) -> int:
    """The power of two at or above `m`: rows of one bucket share a tuned configuration."""
    return 1 << max(0, m - 1).bit_length()
