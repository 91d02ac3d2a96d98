"""The controller's command machinery (CommandSender) against a real ExecutorService over a real nats-server.

Ping, drain, bad commands refused with the culprit named, idempotent replays of a seq, the audit
event on the events subject, and the bounded time a command to a missing or silent executor takes to
fail: the unit tests of either side cannot show that sender and executor agree on the wire.
"""

import asyncio
import threading
import time

from services.executor.service import ExecutorService
from shared import subjects
from shared.bus import Bus
from shared.commands import CommandSender
from shared.config import EngineConfig, ExecutorConfig
from shared.messages import Admission, Command, CommandResult, DrainArgs, Event, GenerateRequest, PingArgs, TokenBatch
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3
from tests.nats_server import until_routed


class EventLog:
    def __init__(self):
        self.events: list[Event] = []

    async def on_event(self, incoming) -> None:
        if incoming.message.kind == "command":
            self.events.append(incoming.message)

    async def audit_of(self, seq: int, timeout: float = 5.0) -> Event:
        deadline = time.monotonic() + timeout
        while not (found := [e for e in self.events if e.data["seq"] == seq]):
            assert time.monotonic() < deadline, f"no audit event for seq {seq}; have {self.events}"
            await asyncio.sleep(0.02)
        assert len(found) == 1, f"seq {seq} was audited {len(found)} times"
        return found[0]


def test_command_sender_against_a_real_executor(nats_server, tmp_path):
    path = write_tiny_llama3(tmp_path / "m")
    service = ExecutorService(ExecutorConfig(
        executor_id="exec-cmd", nats_url=nats_server.url,
        engine=EngineConfig(model=str(path), memory_budget=4 << 20, block_size=8, max_model_len=256)))
    engine = service.engine
    # On demand the engine thread runs a few steps and is then held inside the next one, so that a
    # request is reliably in flight when the drain arrives (the tiny model finishes in milliseconds).
    gate = threading.Event()
    allowed: list[int | None] = [None]  # steps left before holding; None: never hold
    real_step = engine.step

    def gated_step():
        if allowed[0] is not None:
            if allowed[0] <= 0:
                gate.wait(20)
            else:
                allowed[0] -= 1
        return real_step()

    engine.step = gated_step

    async def scenario():
        exec_bus = await Bus.connect(nats_server.url, "executor-exec-cmd")
        ctl_bus = await Bus.connect(nats_server.url, "controller")
        watch_bus = await Bus.connect(nats_server.url, "watcher")
        await service.start(exec_bus)
        log = EventLog()
        deltas = []

        async def on_tokens(incoming):
            deltas.extend(incoming.message.deltas)

        await watch_bus.subscribe(subjects.EVENTS, Event, log.on_event)
        await watch_bus.subscribe(subjects.tokens("gw-cmd"), TokenBatch, on_tokens)
        await watch_bus.flush()
        sender = CommandSender(ctl_bus, "ctl-test", timeout_s=1.0, retries=2)

        async def infer(request_id: str, max_tokens: int) -> Admission:
            req = GenerateRequest(request_id=request_id, gateway="gw-cmd", arrival_time=time.time(), prompt="hello",
                                  sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
            return await watch_bus.request(subjects.infer("exec-cmd"), req, Admission, timeout=5)

        try:
            sent = time.monotonic()
            ping = await sender.send("exec-cmd", PingArgs(), "a test pings")
            round_trip = time.monotonic() - sent
            assert ping.ok and ping.executor == "exec-cmd" and ping.kind == "ping" and ping.error is None
            assert ping.state == {"running": 0, "waiting": 0, "draining": False}
            audit = await log.audit_of(ping.seq)
            assert audit.source == "ctl-test"
            assert audit.data | {"latency_s": 0} == {"executor": "exec-cmd", "kind": "ping", "seq": ping.seq,
                                                     "args": {}, "reason": "a test pings", "ok": True,
                                                     "error": None, "state": ping.state, "attempts": 1,
                                                     "latency_s": 0}
            assert 0 < audit.data["latency_s"] <= round_trip  # the sender's own measure of this send

            # Bad commands are answered, refused, with the culprit named; they change nothing.
            for seq, kind, args, culprit in ((1, "teleport", {"layer": 0}, "unknown command kind 'teleport'"),
                                             (6, "replicate", {"layers": [0, 1], "to": "x"}, "args.instance"),
                                             (7, "evict", {"instance": "i-exec-cmd", "layers": [2, 1],
                                                           "from": "x"}, "layers must be [a, b]"),
                                             (8, "replicate", {"instance": "i-exec-cmd", "layers": [0, 0],
                                                               "to": "x"}, "serves alone"),
                                             (9, "batch", {"instance": "i0", "max_num_seqs": 2},
                                              "leads instance 'i-exec-cmd', not 'i0'"),
                                             (2, "quantize", {"layers": 1, "bits": 5}, "args.bits"),
                                             (3, "quantize", {"layers": 1}, "args.bits"),
                                             (4, "restore", {"layers": True}, "args.layers"),
                                             (5, "ping", {"now": 1}, "args.now")):
                bad = await ctl_bus.request(subjects.command("exec-cmd"), Command(seq=seq, issuer="fuzz", kind=kind,
                                                                                   args=args), CommandResult, timeout=5)
                assert not bad.ok and bad.kind == kind and culprit in bad.error, bad.error
            assert engine.model.layer_bits == [engine.model.full_bits] * len(engine.model.layer_bits)
            assert (await sender.send("exec-cmd", PingArgs())).ok  # bad commands did not hurt the executor

            # One request held in flight, then drain: the executor records 1 in flight and refuses new work.
            allowed[0] = 3  # prefill and two decode steps, then hold
            assert (await infer("busy", max_tokens=20)).accepted
            deadline = time.monotonic() + 10
            while not (service.worker.snapshot.in_flight == 1 and deltas):
                assert time.monotonic() < deadline, "the request never got going"
                await asyncio.sleep(0.01)
            drain = await sender.send("exec-cmd", DrainArgs())
            assert drain.ok and drain.state == {"in_flight": 1} and service.draining
            refused = await infer("late", max_tokens=4)
            assert not refused.accepted and refused.error.type == "unavailable"
            allowed[0] = None
            gate.set()
            deadline = time.monotonic() + 10
            while not any(d.finished for d in deltas):  # draining lets in-flight work finish
                assert time.monotonic() < deadline, "the in-flight request did not finish while draining"
                await asyncio.sleep(0.01)
            assert [d for d in deltas if d.finished][0].output_tokens == 20
            while service.worker.snapshot.in_flight:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

            # The same seq again is answered from the record, not re-run: the recorded drain still says
            # 1 in flight and the recorded ping still says not draining; a fresh seq sees today's state.
            again = await ctl_bus.request(subjects.command("exec-cmd"),
                                          Command(seq=drain.seq, issuer="ctl-test", kind="drain"),
                                          CommandResult, timeout=5)
            assert again == drain
            old_ping = await ctl_bus.request(subjects.command("exec-cmd"),
                                             Command(seq=ping.seq, issuer="ctl-test", kind="ping"),
                                             CommandResult, timeout=5)
            assert old_ping == ping
            fresh = await sender.send("exec-cmd", DrainArgs())
            assert fresh.ok and fresh.seq > drain.seq and fresh.state == {"in_flight": 0}
            assert (await sender.send("exec-cmd", PingArgs())).state["draining"] is True

            # Nobody listens: every attempt fails at once ("no responders"), the sender gives up.
            started = time.monotonic()
            ghost = await sender.send("exec-nobody", PingArgs())
            elapsed = time.monotonic() - started
            assert not ghost.ok and ghost.executor == "exec-nobody"
            assert "no answer after 3 attempt(s)" in ghost.error and "no responders" in ghost.error
            assert elapsed < 1.0 * 3 + 1.0
            assert (await log.audit_of(ghost.seq)).data["attempts"] == 3

            # Someone listens but never answers: three timeouts, then ok=False, within the bound.
            heard: list[int] = []

            async def silent(incoming):
                heard.append(incoming.message.seq)

            await watch_bus.subscribe(subjects.command("exec-silent"), Command, silent)
            await watch_bus.flush()
            await until_routed(ctl_bus, subjects.command("exec-silent"))
            started = time.monotonic()
            mute = await sender.send("exec-silent", DrainArgs())
            elapsed = time.monotonic() - started
            assert not mute.ok and "no reply within 1.0 s" in mute.error
            deadline = time.monotonic() + 10  # the watcher's callback may trail the sender's last timeout
            while len(heard) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert heard == [mute.seq] * 3  # each retry carries the same seq
            assert elapsed >= 3.0  # it waited out each of its three timeouts; `heard` shows there was no fourth
        finally:
            allowed[0] = None
            gate.set()
            await service.stop(drain_timeout_s=5)
            for bus in (watch_bus, ctl_bus, exec_bus):
                await bus.close()

    try:
        asyncio.run(scenario())
    finally:
        del engine.step
    assert not engine.has_unfinished()
