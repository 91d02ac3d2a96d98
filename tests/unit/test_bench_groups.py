"""`morphling bench-groups` end to end on two real processes: a table, and JSON with a PNG beside it, whose
figures are the slowest member's of each repeat."""

import json
import subprocess
import sys

import pytest


def test_two_members_form_their_group_and_the_figures_are_written(tmp_path):
    run = subprocess.run([sys.executable, "-m", "services.cli", "bench-groups", "--sizes", "2", "--repeats", "2",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "members" in run.stdout and "re-form ms" in run.stdout
    result = json.loads((tmp_path / "fabric_groups.json").read_text())
    (summary,) = result["summary"]
    assert summary["size"] == 2 and len(result["rows"]) == 2
    for part in ("form_s", "first_all_reduce_s", "reform_s"):
        assert 0 < summary[part] < 60
        assert summary[part] == pytest.approx(sum(r[part] for r in result["rows"]) / 2)  # the median of two
    assert (tmp_path / "fabric_groups.png").stat().st_size > 0
