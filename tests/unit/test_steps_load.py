"""What an executor reports of its latency profile: its steps' phases summed, and a layer's seconds over them."""

import pytest

from shared.core.planner.latency import DECODE_FEATURES, PREFILL_FEATURES, FittedLatency
from shared.core.scheduling.phases import LatencyReports, StepsLoad

SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_kv_heads": 2}


def profile(decode: dict[int, list[float]], prefill: dict[int, list[float]]) -> FittedLatency:
    return FittedLatency("cpu", SHAPE, {"decode": decode, "prefill": prefill})


def test_the_steps_between_two_counts_are_their_difference_each_phase_as_steps_of_its_mean_and_so_reported():
    # decode: 1 ms + 0.01 ms a sequence; prefill: 2 ms + 0.001 ms a prompt token (INT8 twice that, INT4 three times)
    decode = {b: [0.001 * k, 0.00001 * k, 0.0, 0.0] for b, k in ((16, 1), (8, 2), (4, 3))}
    prefill = {b: [0.002 * k, 0.0, 0.000001 * k, 0.0, 0.0] for b, k in ((16, 1), (8, 2), (4, 3))}
    assert all(len(c) == len(DECODE_FEATURES) for c in decode.values())
    assert all(len(c) == len(PREFILL_FEATURES) for c in prefill.values())
    latency = profile(decode, prefill)
    load = StepsLoad()
    load.add(10, 1000, [])  # ten decodes
    reported = StepsLoad(**vars(load))
    load.add(4, 400, [100, 300])  # four decodes and two prompts
    load.add(8, 800, [], steps=3)  # a decode run of three steps of eight
    recent = load.since(reported)
    assert recent == StepsLoad(decode_steps=4, decodes=28, context=2800, prefill_steps=1, chunks=2, tokens=400)
    # decodes: 4 steps of 7 sequences; prefill: 1 step of 2 prompts of 200 tokens
    full = 4 * (0.001 + 7 * 0.00001) + (0.002 + 200 * 0.000001)
    assert recent.widths_seconds(latency, full_bits=32) == pytest.approx({32: full, 8: 2 * full, 4: 3 * full})
    assert StepsLoad().widths_seconds(latency, full_bits=16) == {}  # no steps: nothing to say

    # A report says what the steps of the last ten seconds took: those since the last report at or before their start.
    reports = LatencyReports(latency, full_bits=32, window_s=10.0)
    assert reports.report(StepsLoad(), 0.0) == {}  # no step yet
    assert reports.report(load, 1.0) == pytest.approx(load.widths_seconds(latency, 32))  # every step from the start
    at_one = StepsLoad(**vars(load))
    load.add(0, 0, [50])
    assert reports.report(load, 10.5) == pytest.approx(load.widths_seconds(latency, 32))  # 0.0 is the window's start
    one_prompt = StepsLoad(prefill_steps=1, chunks=1, tokens=50)
    assert reports.report(load, 11.0) == pytest.approx(one_prompt.widths_seconds(latency, 32))  # from 1.0's count
    assert reports.report(load, 11.2) == pytest.approx(one_prompt.widths_seconds(latency, 32))  # no step since
    assert load.since(at_one) == one_prompt
    assert reports.report(load, 21.0) == {}  # none over the last ten seconds
