"""Sending commands to executors: sequence numbers, retries, answers and the audit trail.

The controller and the gateway's admin endpoint both command executors, through this one sender, so
their commands follow the same rules:
- each command carries a sequence number that increases per issuer and starts from the clock, so a
  restarted issuer never reuses one an executor has on record;
- a command that gets no answer is retried with the SAME seq: if the first attempt did arrive and
  only its answer was lost, the executor answers the repeat from its record instead of, say,
  quantizing a second layer;
- bus failures never raise out of `send`: the caller gets CommandResult(ok=False) and decides;
- every command, answered or not, becomes an audit Event on the events subject, with why it was sent
  and, where the issuer gives them, the inputs its decision saw (`"inputs"`).
"""

import asyncio
import logging
import time
from typing import Any

from shared import subjects
from shared.bus import Bus, BusError
from shared.messages import Command, CommandArgs, CommandResult, Event
from shared.telemetry import tracer

log = logging.getLogger(__name__)


class CommandSender:
    def __init__(self, bus: Bus, issuer: str, timeout_s: float, retries: int):
        self.bus = bus
        self.issuer = issuer
        self.timeout_s = timeout_s
        self.retries = max(0, retries)
        # Microseconds since the epoch: a restarted controller starts above every seq it used before
        # unless it sent more than a million commands a second, which it never does.
        self._seq = time.time_ns() // 1000

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    async def send(self, executor: str, args: CommandArgs, reason: str = "",
                   inputs: dict[str, Any] | None = None) -> CommandResult:
        """Deliver one command and return the executor's answer, or a failed result when none came.
        `reason` (why the issuer decided it) and `inputs` (the signals it decided on) go into the audit event."""
        command = Command.of(self.next_seq(), self.issuer, args)
        kind = command.kind
        subject = subjects.command(executor)
        started = time.monotonic()
        errors: list[str] = []
        result: CommandResult | None = None
        attempts = 0
        with tracer(__name__).start_as_current_span(f"command {kind}") as span:
            span.set_attributes({"morphling.executor": executor, "morphling.command.kind": kind,
                                 "morphling.command.seq": command.seq})
            for attempt in range(self.retries + 1):
                attempts = attempt + 1
                if attempt:
                    # "No responders" comes back at once; give a restarting executor a moment.
                    await asyncio.sleep(min(0.05 * 2 ** attempt, self.timeout_s))
                try:
                    reply = await self.bus.request(subject, command, CommandResult, timeout=self.timeout_s)
                except BusError as exc:
                    errors.append(exc.problem)
                    log.info("command %s seq %d to %s: attempt %d failed: %s", kind, command.seq,
                             executor, attempts, exc.problem)
                    continue
                except Exception as exc:  # e.g. connection closed: still a bus failure, not a crash
                    errors.append(f"{type(exc).__name__}: {exc}")
                    log.warning("command %s seq %d to %s: attempt %d failed: %r", kind, command.seq,
                                executor, attempts, exc)
                    continue
                if reply.seq != command.seq or reply.issuer != command.issuer:
                    errors.append(f"answer for {reply.issuer} seq {reply.seq}, not ours")
                    continue
                result = reply
                break
            if result is None:
                causes = "; ".join(dict.fromkeys(errors))  # each cause once, however many attempts it ended
                result = CommandResult(seq=command.seq, issuer=self.issuer, executor=executor, kind=command.kind,
                                       ok=False, error=f"no answer after {attempts} attempt(s): {causes}")
            span.set_attributes({"morphling.command.ok": result.ok, "morphling.command.attempts": attempts})
        latency = time.monotonic() - started
        await self._audit(executor, command, result, attempts, latency, reason, inputs)
        return result

    async def _audit(self, executor: str, command: Command, result: CommandResult, attempts: int,
                     latency: float, reason: str, inputs: dict[str, Any] | None) -> None:
        data = {"executor": executor, "kind": command.kind, "seq": command.seq, "args": command.args,
                "reason": reason, "ok": result.ok, "error": result.error, "state": result.state,
                "attempts": attempts, "latency_s": latency}
        if inputs:  # hand-issued commands (the admin endpoint) decide on no signals
            data["inputs"] = inputs
        event = Event(kind="command", source=self.issuer, time=time.time(), data=data)
        try:
            await self.bus.publish(subjects.EVENTS, event)
        except Exception as exc:  # the audit trail is best effort; the command's outcome stands
            log.warning("could not publish the audit event of seq %d: %r", command.seq, exc)
