"""What a benchmark's or a profile's JSON records beside its results: the flags it ran with, the machine and the
date (docs/benchmarks.md quotes each figure with them)."""

import argparse
import os
import platform
from datetime import datetime, timezone
from pathlib import Path


def provenance(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k not in skip},
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
