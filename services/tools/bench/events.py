"""What the controller did during a replay, read back from the system's event stream: its actions (for the
timelines) and how soon it reacted to the first sign of pressure.

The executors publish a `pressure` event when a step preempts, holds the head of the queue for KV pages, or
follows a refusal for a full queue (at most one a second each); the controller's commands are `command`
events, stamped when their answer came, with the seconds the command took (`latency_s`, from sending it to
its answer, a wait for the executor's next step boundary included) and, where the executor reports it, the
seconds of the work itself (`work_s`: a swap's copy). The reaction is
measured from the first pressure event of the replay to the moment the controller decided its first
quantize (the event's time less its latency) and to the moment that quantize was applied (the event's time):
the wake-up this project promises is the former, under one second on this CPU (issue 16).
"""

import asyncio
import sys

from shared import subjects
from shared.bus import Bus, StreamError
from shared.config import EventStreamConfig
from shared.messages import Event

READ_TIMEOUT_S = 20.0


async def _read(nats_url: str, since: float) -> list[Event]:
    bus = await Bus.connect(nats_url, "bench-events")
    try:
        return [e async for e in bus.replay(EventStreamConfig().name, subjects.EVENTS, Event, since)]
    finally:
        await bus.close(timeout=1.0)


def read_events(nats_url: str | None, since: float) -> list[Event]:
    """The events stored from `since` (seconds since the epoch) on; none when there is no bus to ask."""
    if nats_url is None:
        return []
    try:
        return asyncio.run(asyncio.wait_for(_read(nats_url, since), READ_TIMEOUT_S))
    except (StreamError, TimeoutError, OSError) as e:
        print(f"morphling bench: the controller's actions are not shown: {e}", file=sys.stderr)
        return []


def actions(events: list[Event], wall_t0: float) -> list[dict]:
    """The controller's commands, seconds after the replay started (`wall_t0`, epoch seconds), oldest first."""
    out = []
    for e in events:
        if e.kind != "command":
            continue
        d = e.data
        out.append({"t": round(e.time - wall_t0, 3), "decided_t": round(e.time - d.get("latency_s", 0.0) - wall_t0, 3),
                    "executor": d.get("executor"), "kind": d.get("kind"), "args": d.get("args"), "ok": d.get("ok"),
                    "latency_s": d.get("latency_s"), "work_s": (d.get("state") or {}).get("seconds"),
                    "reason": d.get("reason", "")})
    return sorted(out, key=lambda a: a["t"])


def pressure_times(events: list[Event], wall_t0: float) -> list[float]:
    return sorted(round(e.time - wall_t0, 3) for e in events if e.kind == "pressure")


def reaction(events: list[Event], wall_t0: float) -> dict:
    """Seconds from the first pressure event to the first quantize decided and applied (None where either is
    missing), and how many pressure events there were."""
    pressure = pressure_times(events, wall_t0)
    quantizes = [a for a in actions(events, wall_t0) if a["kind"] == "quantize" and a["ok"]]
    first = pressure[0] if pressure else None
    after = [a for a in quantizes if first is not None and a["decided_t"] >= first]
    return {"pressure_events": len(pressure), "first_pressure_s": first,
            "decided_after_s": round(after[0]["decided_t"] - first, 3) if after else None,
            "applied_after_s": round(after[0]["t"] - first, 3) if after else None}
