"""`morphling events` without a bus: reading --since, and the lines and JSON it prints."""

import json
from datetime import datetime, timedelta, timezone

import pytest

from services.events_cli import format_json, format_line, parse_since, selected
from shared.messages import Event

NOW = 1_750_000_000.0
AT = datetime(2025, 6, 1, 12, 0, 1, 234000).timestamp()  # local time, as the lines print it


@pytest.mark.parametrize("text, ago", [("30s", 30), ("10m", 600), ("2h", 7200), ("7d", 7 * 86400),
                                       ("1.5h", 5400), (" 45s ", 45)])
def test_since_a_duration_counts_back_from_now(text, ago):
    assert parse_since(text, NOW) == NOW - ago


def test_since_an_iso_time_is_local_unless_it_names_its_zone():
    assert parse_since("2025-06-01T12:00:01.234", NOW) == pytest.approx(AT)
    assert parse_since("2025-06-01 12:00", NOW) == pytest.approx(datetime(2025, 6, 1, 12, 0).timestamp())
    utc = datetime(2025, 6, 1, 12, 0, tzinfo=timezone.utc).timestamp()
    assert parse_since("2025-06-01T12:00:00Z", NOW) == utc
    assert parse_since("2025-06-01T14:00:00+02:00", NOW) == utc
    assert parse_since("2025-06-01T12:00:00", NOW) == parse_since("2025-06-01T12:00:00", NOW + 3600)


@pytest.mark.parametrize("text", ["yesterday", "10", "10 minutes", "-5m", "5w", ""])
def test_since_refuses_what_it_cannot_read_and_says_what_it_expects(text):
    with pytest.raises(ValueError, match="expected a duration like 30s, 10m, 2h or 7d, or an ISO time"):
        parse_since(text, NOW)


def command_event(**data) -> Event:
    base = {"executor": "exec0", "kind": "quantize", "seq": 17, "args": {"layers": [0, 1], "bits": 8},
            "reason": "kv 0.93 above 0.90 for 3 windows", "ok": True, "error": None, "state": {"changed": [0, 1]},
            "attempts": 1, "latency_s": 0.0123}
    return Event(kind="command", source="ctl0", time=AT, data=base | data)


def test_a_command_line_shows_what_was_sent_how_it_went_and_why():
    assert format_line(command_event()) == (
        "2025-06-01T12:00:01.234 ctl0        command        exec0 quantize layers=[0,1] bits=8 -> ok in 12 ms; "
        "reason: kv 0.93 above 0.90 for 3 windows")


def test_a_failed_command_shows_its_error_and_a_slow_one_seconds():
    line = format_line(command_event(executor="exec3", kind="ping", args={}, ok=False, latency_s=1.2345,
                                     error="no answer after 3 attempt(s): no responders", reason=""))
    assert line.endswith("command        exec3 ping -> FAILED (no answer after 3 attempt(s): no responders) "
                         "in 1.23 s")


def test_executor_events_name_the_executor_and_other_fields_read_unambiguously():
    down = Event(kind="executor_down", source="monitor", time=AT, data={"executor": "exec1"})
    assert format_line(down) == "2025-06-01T12:00:01.234 monitor     executor_down  exec1"
    rejected = Event(kind="request_rejected", source="gateway-gw0", time=AT,
                     data={"executor": "exec0", "reason": "queue full", "waiting": 256})
    assert format_line(rejected).endswith("gateway-gw0 request_rejected exec0 reason=\"queue full\" waiting=256")
    bare = Event(kind="morph_started", source="ctl0", time=AT)
    assert format_line(bare) == "2025-06-01T12:00:01.234 ctl0        morph_started"


def test_json_lines_carry_the_whole_event():
    event = command_event()
    assert json.loads(format_json(event)) == event.model_dump(mode="json")
    assert "\n" not in format_json(event)


def test_filters_by_kind_and_executor():
    down = Event(kind="executor_down", source="monitor", time=AT, data={"executor": "exec1"})
    started = Event(kind="morph_started", source="ctl0", time=AT)
    assert selected(command_event(), set(), set())
    assert selected(command_event(), {"command", "executor_down"}, set())
    assert not selected(down, {"command"}, set())
    assert selected(down, set(), {"exec1"}) and not selected(command_event(), set(), {"exec1"})
    assert not selected(started, set(), {"exec1"})
    assert selected(down, {"executor_down"}, {"exec0", "exec1"})


def test_times_print_in_local_time_to_the_millisecond():
    later = Event(kind="executor_up", source="monitor", time=AT + timedelta(hours=1).total_seconds() + 0.0004,
                  data={"executor": "e"})
    assert format_line(later).startswith("2025-06-01T13:00:01.234 ")
