"""What a benchmark's or a profile's JSON records beside its results: the flags it ran with, the machine and the
date (docs/benchmarks.md quotes each figure with them)."""

import argparse
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def provenance(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip},
            "machine": {"platform": platform.platform(), "processor": platform.processor() or cpu_model(),
                        "cpus": os.cpu_count()},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name and the matrix units it has (AMX), which `platform.processor()` leaves empty on Linux:
    the project's CPU machine has been an AMD EPYC and an Intel Xeon with AMX, whose low-bit and bfloat16 linears
    differ several-fold."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    amx = sorted(f for f in flags if f.startswith("amx"))
    return f"{name} ({', '.join(amx)})" if amx else name
