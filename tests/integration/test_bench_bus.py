"""`morphling bench-bus` end to end at a small scale: a real nats-server, the real monitor and controller processes,
20 synthetic executors for a few seconds; what a user would notice is that the monitor saw every one of them, the
controller planned on its states, and the table and files came out."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_twenty_executors_are_all_seen_by_the_monitor_and_planned_on_by_the_controller(tmp_path):
    done = subprocess.run([sys.executable, "-m", "services.cli", "bench-bus", "--executors", "20", "--duration", "3",
                           "--warmup", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "ingested/s" in done.stdout  # the table
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert row["executors"] == 20 and row["alive_min"] == 20
    # what a loaded machine sustains is the benchmark's figure; here, that both counts are there and agree in kind
    assert 0 < row["offered_msg_s"] <= 200 * 1.05 and 0 < row["ingested_msg_s"] <= row["offered_msg_s"] * 1.05
    assert row["states"] > 0 and row["state_bytes"] > 0
    assert row["decisions_s"] > 0 and row["decision_ms"] is not None
    assert (tmp_path / "bus_scale.png").stat().st_size > 0
