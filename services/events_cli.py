"""`morphling events`: what the controller and the monitor decided, and why, from the event stream.

Every command the controller or a gateway's admin endpoint sends becomes an audit event with the reason
it was decided for (shared/commands.py); the monitor adds executor_up and executor_down. Where the NATS
server runs JetStream, the monitor has a stream keep them (EventStreamConfig); this reads it from --since
on, one line per event (EXAMPLE), and exits once it has caught up, or with --follow waits for more.
"""

import argparse
import asyncio
import json
import logging
import re
import sys
import time
from datetime import datetime

from shared import subjects
from shared.bus import Bus, BusError, JetStreamOff, NoSuchStream, StreamError, stop_on_signals
from shared.config import EventStreamConfig
from shared.messages import Event

PROG = "morphling events"
DEFAULT_NATS = "nats://127.0.0.1:4222"
EXAMPLE = """\
lines look like:
  2025-06-01T12:00:01.234 ctl0        command        exec0 quantize layers=[0,1] bits=8 -> ok in 12 ms; reason: kv 0.93
  2025-06-01T12:00:03.500 monitor     executor_down  exec1

Times are the sender's, local, to the millisecond; --since counts by when the server stored an event."""
CONNECT_TIMEOUT_S = 3.0  # a CLI that cannot reach NATS says so at once instead of retrying like a service
CLOSE_TIMEOUT_S = 1.0  # a reader has nothing in flight worth waiting for at exit

_DURATION = re.compile(r"(\d+(?:\.\d*)?)([smhd])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now: float) -> float:
    """'30s', '10m', '2h', '7d' before `now`, or an ISO time (local unless it names its zone), as
    seconds since the epoch."""
    text = text.strip()
    duration = _DURATION.fullmatch(text)
    if duration:
        return now - float(duration[1]) * _SECONDS[duration[2]]
    try:
        return datetime.fromisoformat(text).timestamp()  # a naive time is taken as local
    except ValueError:
        raise ValueError(f"cannot read --since {text!r}: expected a duration like 30s, 10m, 2h or 7d, or an ISO "
                         "time like 2025-06-01T12:00:00") from None


def local_time(t: float) -> str:
    return datetime.fromtimestamp(t).isoformat(timespec="milliseconds")


def compact(value: object) -> str:
    """A value as short as it reads unambiguously: bare words bare, anything else as compact JSON."""
    if isinstance(value, str) and value and not any(c.isspace() for c in value):
        return value
    return json.dumps(value, separators=(",", ":"))


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def command_details(data: dict) -> str:
    """`exec0 quantize layers=[0,1] bits=8 -> ok in 12 ms; reason: ...` from a command's audit event."""
    args = " ".join(f"{k}={compact(v)}" for k, v in (data.get("args") or {}).items())
    text = " ".join(p for p in (data.get("executor", "?"), data.get("kind", "?"), args) if p)
    text += " -> ok" if data.get("ok") else f" -> FAILED ({data.get('error') or 'no error given'})"
    if "latency_s" in data:
        text += f" in {duration(data['latency_s'])}"
    if data.get("reason"):
        text += f"; reason: {data['reason']}"
    return text


def other_details(data: dict) -> str:
    """The executor first, then every other field as key=value."""
    fields = [f"{k}={compact(v)}" for k, v in data.items() if k != "executor"]
    return " ".join([data["executor"], *fields] if "executor" in data else fields)


def format_line(event: Event) -> str:
    details = command_details(event.data) if event.kind == "command" else other_details(event.data)
    return f"{local_time(event.time)} {event.source:<11} {event.kind:<14} {details}".rstrip()


def format_json(event: Event) -> str:
    return json.dumps(event.model_dump(mode="json"), separators=(",", ":"))


def selected(event: Event, kinds: set[str], executors: set[str]) -> bool:
    return (not kinds or event.kind in kinds) and (not executors or event.data.get("executor") in executors)


def _names(text: str) -> set[str]:
    return {name.strip() for name in text.split(",") if name.strip()}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="what the controller and the monitor decided, and "
                                     "why, from the event stream", epilog=EXAMPLE,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nats", default=DEFAULT_NATS, help="NATS server URL (default %(default)s)")
    parser.add_argument("--since", default="1h",
                        help="from this long ago (30s, 10m, 2h, 7d) or this ISO time on (default %(default)s)")
    parser.add_argument("--kind", type=_names, default=set(),
                        help="only these kinds, comma-separated: command, executor_up, executor_down, ...")
    parser.add_argument("--executor", type=_names, default=set(), help="only events about these executors")
    parser.add_argument("--json", action="store_true", help="one JSON object per event instead of a line")
    parser.add_argument("--follow", action="store_true", help="keep printing new events until interrupted")
    return parser


async def _connect(url: str) -> Bus | None:
    bus_log = logging.getLogger("shared.bus")
    level = bus_log.level
    # The bus warns of every failed attempt, as a service waiting for its server should; a user gets one line.
    bus_log.setLevel(logging.ERROR)
    try:
        return await Bus.connect(url, "morphling-events", first_attempt_timeout=CONNECT_TIMEOUT_S)
    except BusError:
        print(f"{PROG}: no NATS server reachable at {url} within {CONNECT_TIMEOUT_S:.0f} s", file=sys.stderr)
        return None
    finally:
        bus_log.setLevel(level)


async def _print_events(args: argparse.Namespace, since: float) -> int:
    bus = await _connect(args.nats)
    if bus is None:
        return 1
    stream = EventStreamConfig().name
    shown = 0

    async def show() -> None:
        nonlocal shown
        async for event in bus.replay(stream, subjects.EVENTS, Event, since, follow=args.follow):
            if selected(event, args.kind, args.executor):
                print(format_json(event) if args.json else format_line(event), flush=True)
                shown += 1

    # Ctrl-C (how --follow ends) stops the reading at once, rather than interrupting it wherever it is.
    stop = stop_on_signals()
    reading = asyncio.create_task(show())
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not reading.done():
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            return 0
        reading.result()
    except JetStreamOff:
        print(f"{PROG}: events are not kept: the NATS server at {args.nats} runs without JetStream. Start it with "
              "-js (morphling up does) or give its configuration a jetstream block, then restart the monitor: it "
              "creates the stream", file=sys.stderr)
        return 1
    except NoSuchStream:
        print(f"{PROG}: events are not kept: the NATS server at {args.nats} has JetStream but no stream {stream}. "
              "The monitor creates it when it starts: start or restart it against this server", file=sys.stderr)
        return 1
    except StreamError as exc:
        print(f"{PROG}: cannot read the events: {exc}", file=sys.stderr)
        return 1
    finally:
        await bus.close(timeout=CLOSE_TIMEOUT_S)
    if not shown:
        print(f"{PROG}: no matching events since {local_time(since)}", file=sys.stderr)
    return 0


def main(argv: list[str]) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        since = parse_since(args.since, time.time())
    except ValueError as exc:
        parser.error(str(exc))
    try:
        return asyncio.run(_print_events(args, since))
    except KeyboardInterrupt:  # Ctrl-C while still connecting
        return 0
