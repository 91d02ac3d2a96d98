"""Where the real data lives: $MORPHLING_DATA, else ../shared/data beside the checkout."""

import os
from pathlib import Path


def data_dir() -> Path:
    return Path(os.environ.get("MORPHLING_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
