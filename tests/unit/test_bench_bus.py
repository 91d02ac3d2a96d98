"""`morphling bench-bus` without a bus: the synthetic executors' reports and answers, how executors are spread over
publishing processes, and the figures computed from what the bus showed."""

import random

import pytest

from services.tools.bench import bus_scale
from services.tools.bench.bus_load import BASE_KV_PAGES, DEPTH, SLOT_PAGES, SyntheticExecutor, executor_names, shares
from services.tools.bench.bus_scale import (Snapshot, StateSample, Watch, counter_rate, cpu_percent, seconds_per_count,
                                      summarize)
from shared.bus import decode, encode
from shared.messages import (Command, DrainArgs, ExecutorTelemetry, PingArgs, QuantizeArgs, RestoreArgs)


def executor(name: str = "exec0") -> SyntheticExecutor:
    return SyntheticExecutor(name, random.Random(name))


def command(seq: int, args) -> Command:
    return Command.of(seq, "ctl0", args)


def test_a_report_is_a_valid_telemetry_message_whose_pages_add_up():
    e = executor()
    for now in (0.0, 7.5, 15.0, 31.0):
        report = decode(encode(e.telemetry(now)), ExecutorTelemetry)
        assert report.executor == "exec0" and report.time == now
        assert report.kv.pages_used + report.kv.pages_free == BASE_KV_PAGES + report.kv.pages_extension
        assert report.kv.pages_total == SLOT_PAGES * DEPTH + BASE_KV_PAGES
        assert report.layers == [16] * DEPTH


def test_kv_demand_swings_so_that_an_executor_is_under_pressure_part_of_its_cycle():
    e = executor()
    usage = [e.demand(e.cycle_s * k / 100) for k in range(100)]
    assert max(usage) > 0.9 > 0.3 > min(usage)


def test_quantize_takes_layers_in_swap_order_and_their_freed_pages_become_kv():
    e = executor()
    result = e.answer(command(1, QuantizeArgs(layers=2, bits=8)))
    assert result.ok and result.state == {"changed": [0, 1], "bits": 8}
    report = e.telemetry(0.0)
    assert report.layers[:3] == [8, 8, 16]
    assert report.kv.pages_extension == 2 * SLOT_PAGES // 2
    assert e.answer(command(2, QuantizeArgs(layers=[5], bits=4))).state == {"changed": [5], "bits": 4}


def test_restore_by_count_takes_back_the_most_recently_quantized_first():
    e = executor()
    e.answer(command(1, QuantizeArgs(layers=[3, 1], bits=8)))
    e.answer(command(2, QuantizeArgs(layers=[7], bits=8)))
    result = e.answer(command(3, RestoreArgs(layers=2)))
    assert result.ok and result.state["changed"] == [7, 1]
    assert [i for i, b in enumerate(e.bits) if b != 16] == [3]


def test_a_retried_command_is_answered_from_the_record_not_applied_twice():
    e = executor()
    first = e.answer(command(1, QuantizeArgs(layers=2, bits=8)))
    assert e.answer(command(1, QuantizeArgs(layers=2, bits=8))) == first
    assert sum(b == 8 for b in e.bits) == 2


def test_ping_is_answered_and_what_a_synthetic_executor_cannot_do_is_refused():
    e = executor()
    assert e.answer(command(1, PingArgs())).ok
    refused = e.answer(command(2, DrainArgs()))
    assert not refused.ok and "drain" in refused.error
    bad = e.answer(Command(seq=3, issuer="ctl0", kind="quantize", args={"layers": 1, "bits": 3}))
    assert not bad.ok and bad.error.startswith("refused: args.bits")


@pytest.mark.parametrize("n, per_process, sizes", [(10, 500, [10]), (1000, 500, [500, 500]),
                                                    (1001, 500, [334, 334, 333]), (3, 1, [1, 1, 1])])
def test_executors_are_spread_evenly_over_as_few_processes_as_the_bound_allows(n, per_process, sizes):
    names = executor_names(n)
    parts = shares(names, per_process)
    assert [len(p) for p in parts] == sizes
    assert sorted(name for part in parts for name in part) == sorted(names)


def test_a_counter_rate_runs_from_the_first_to_the_last_stats_event_inside_the_window():
    stats = [(9.0, {"telemetry": 0}), (10.0, {"telemetry": 100}), (12.0, {"telemetry": 300}),
             (14.0, {"telemetry": 700}), (16.0, {"telemetry": 5000})]
    assert counter_rate(stats, "telemetry", 10.0, 15.0) == pytest.approx(150.0)
    assert counter_rate(stats, "telemetry", 10.0, 11.0) is None  # one event is no rate
    assert counter_rate(stats, "planned", 0.0, 20.0) is None


def test_seconds_per_count_is_the_mean_over_the_window():
    stats = [(1.0, {"plan_s": 1.0, "planned": 10}), (2.0, {"plan_s": 1.5, "planned": 20}),
             (3.0, {"plan_s": 3.0, "planned": 40})]
    assert seconds_per_count(stats, "plan_s", "planned", 0.0, 5.0) == pytest.approx(2.0 / 30)
    assert seconds_per_count(stats[:1] * 2, "plan_s", "planned", 0.0, 5.0) is None


def test_cpu_percent_per_role_and_what_other_work_took():
    before = {"monitor": 1.0, "controller": 2.0, "machine": 10.0}
    after = {"monitor": 2.0, "controller": 2.5, "machine": 14.0}
    assert cpu_percent(before, after, 2.0) == {"monitor": 50.0, "controller": 25.0, "other": 125.0}


def test_the_summary_reads_rates_staleness_and_decisions_off_the_recording():
    watch = Watch({"exec0", "exec1"})
    watch.samples = [StateSample(10.0 + k, 10.0 + k, 2000, [0.05, 0.15], 2) for k in range(4)]
    watch.stats = {"monitor": [(10.5, {"telemetry": 0, "states": 0, "state_s": 0.0}),
                               (13.5, {"telemetry": 60, "states": 15, "state_s": 0.15})],
                   "ctl0": [(10.5, {"states": 0, "planned": 0, "plan_s": 0.0, "plan_max_s": 0.5}),
                            (13.5, {"states": 15, "planned": 12, "plan_s": 0.24, "plan_max_s": 0.04})]}
    watch.commands = [{"ok": True}, {"ok": False}]
    varz = {"in_msgs": 0, "out_msgs": 0, "out_bytes": 0, "slow_consumers": 0}
    begin = Snapshot(10.0, {"monitor": 0.0, "machine": 0.0}, varz, sent=0, missed=0)
    end = Snapshot(14.0, {"monitor": 1.0, "machine": 2.0}, varz | {"in_msgs": 80}, sent=80, missed=1)
    row = summarize(2, 0.1, begin, end, watch)
    assert row["target_msg_s"] == 20 and row["offered_msg_s"] == 20 and row["ingested_msg_s"] == 20
    assert row["staleness_p50_ms"] == pytest.approx(100) and row["staleness_max_ms"] == pytest.approx(150)
    assert row["states_s"] == 1.0 and row["state_bytes"] == 2000 and row["state_build_ms"] == pytest.approx(10)
    assert row["decisions_s"] == 4.0 and row["decision_ms"] == pytest.approx(20)
    assert row["decision_max_ms"] == pytest.approx(40)  # the first event's maximum is of before the window
    assert row["commands_s"] == 0.5 and row["commands_ok"] == 1
    assert row["cpu_pct"] == {"monitor": 25.0, "other": 25.0}
    assert row["nats_in_msg_s"] == 20


@pytest.mark.parametrize("argv", [["--executors", "10,x"], ["--executors", "0"], ["--interval", "0"],
                                  ["--per-process", "0"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        bus_scale.parse_args(argv)
