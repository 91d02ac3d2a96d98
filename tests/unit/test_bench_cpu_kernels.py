"""`morphling bench-cpu-kernels` end to end on the default model's linears: every candidate at every row count,
set against float32 in the same run, written as JSON and a plot (its speeds are the benchmark's, not asserted)."""

import json

from services.tools.microbench import cpu_kernels


def test_every_candidate_runs_the_models_linears_and_is_set_against_float32(tmp_path, capsys):
    assert cpu_kernels.main(["--rows", "1,32", "--compile-rows", "", "--repeats", "1", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "cpu_kernels.json").read_text())["rows"]
    by = {(r["rows"], r["kernel"]): r for r in rows}
    expected = {"float32", "int8_reference", "int8_served", "int4_reference", "int4_served", "bfloat16", "int8_w8a8"}
    assert {k for m, k in by if m == 32} == expected  # torch's float32-activation int8 kernel only to 16 rows
    assert {k for m, k in by if m == 1} == expected | {"int8pack_fp32"}
    assert all(by[(m, "float32")]["speedup_vs_float32"] == 1.0 for m in (1, 32))
    assert all(r["ms"] > 0 and r["speedup_vs_float32"] > 0 for r in rows)
    assert (tmp_path / "cpu_kernels.png").stat().st_size > 10_000
    assert "int4_served" in capsys.readouterr().out
