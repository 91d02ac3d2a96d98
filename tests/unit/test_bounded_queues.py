"""The executor's queues stay bounded, and what happens at each bound is what a user would want.

The executor service runs on a real (tiny) engine behind a stand-in bus: the bus only has to hand
messages to the service's handlers and take what it sends, and a gate lets a test play a bus that
stops taking messages. The gateway's per-request bound is tested on the real system in
tests/integration/test_slow_consumer.py; only how it is configured is checked here.
"""

import asyncio
import threading
import time

import pytest
from opentelemetry import context as otel_context

from services.executor.engine.engine import LLMEngine
from services.executor.service import ExecutorService
from shared import subjects
from shared.bus import Incoming, decode
from shared.config import ExecutorConfig, GatewayConfig
from shared.messages import Admission, Cancel, GenerateRequest, TokenBatch, TokenDelta
from shared.sampling import SamplingOptions
from tests.checkpoints import tiny_llama3_engine

EXEC = "exec-b"
GW = "gw-b"
TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama3_engine(tmp_path_factory.mktemp("tiny") / "model", max_num_seqs=2, max_waiting=8)


class _Subscription:
    async def unsubscribe(self) -> None:
        pass


class _Reply:
    """The reply side of a request message: the answer leaves through the bus like any message."""

    def __init__(self, bus: "StubBus"):
        self.bus, self.reply = bus, "_INBOX.test"

    async def respond(self, data: bytes) -> None:
        await self.bus.take("reply", data)


class StubBus:
    """Hands messages to the service's handlers and records what the service sends, in the order it
    leaves. While `gate` is clear the bus takes nothing (telemetry aside), as a stalled connection would."""

    def __init__(self):
        self.handlers = {}
        self.sent: list[tuple[str, object]] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def subscribe(self, subject: str, model, handler, refuse=None) -> _Subscription:
        self.handlers[subject] = handler
        return _Subscription()

    async def flush(self) -> None:
        pass

    def on_outage(self, after_s: float, callback) -> None:
        self.outage = callback  # a test plays the outage by calling it

    async def publish(self, subject: str, message) -> None:
        if subject != subjects.telemetry(EXEC):
            await self.take(subject, message)

    async def take(self, subject: str, message) -> None:
        await self.gate.wait()
        self.sent.append((subject, message))

    async def deliver(self, subject: str, message) -> None:
        await self.handlers[subject](Incoming(subject, message, otel_context.Context(), _Reply(self)))

    def admissions(self) -> dict[str, Admission]:
        found = (decode(data, Admission) for subject, data in self.sent if subject == "reply")
        return {a.request_id: a for a in found}

    def deltas(self, request_id: str) -> list[TokenDelta]:
        return [d for subject, batch in self.sent if isinstance(batch, TokenBatch)
                for d in batch.deltas if d.request_id == request_id]


def request(request_id: str, max_tokens: int, **sampling) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, gateway=GW, prompt="hello world", arrival_time=time.time(),
                           sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True, **sampling))


async def until(check, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        await asyncio.sleep(0.01)


def finished(bus: StubBus, request_id: str) -> bool:
    return any(d.finished for d in bus.deltas(request_id))


async def serve(engine: LLMEngine, **config) -> tuple[ExecutorService, StubBus]:
    service = ExecutorService(ExecutorConfig(executor_id=EXEC, engine=engine.config, **config), engine=engine)
    bus = StubBus()
    await service.start(bus)
    return service, bus


async def stalled(engine: LLMEngine) -> int:
    """Wait until the engine stops producing tokens while it still has work; returns the count so far."""
    before = -1
    deadline = time.monotonic() + TIMEOUT_S
    while (now := engine.stats().generated_tokens) != before:
        assert time.monotonic() < deadline, "the engine never stopped generating"
        before = now
        await asyncio.sleep(0.3)
    assert engine.has_unfinished()
    return now


def test_admissions_beyond_the_bound_are_refused_at_once_and_no_cancel_is_lost(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        entered, held = threading.Event(), threading.Event()

        def hold() -> None:
            entered.set()
            held.wait(TIMEOUT_S)

        service.worker.call(hold)  # the engine thread is busy: what is accepted now waits to be added
        await until(entered.is_set, "the engine thread taking the call")
        for i, max_tokens in enumerate((200, 200, *[8] * 7)):  # one more than the waiting queue's 8
            await bus.deliver(subjects.infer(EXEC), request(f"a{i}", max_tokens))
        await until(lambda: len(bus.admissions()) == 9, "every admission answered while the engine thread is busy")
        assert [a.accepted for a in bus.admissions().values()] == [True] * 8 + [False]
        refused = bus.admissions()["a8"]
        assert refused.error.type == "queue_full" and "8/8" in refused.error.message
        await bus.deliver(subjects.infer(EXEC), request("bad", 8, n=3))  # more than the two it runs at once
        await until(lambda: "bad" in bus.admissions(), "the bad request answered")
        assert bus.admissions()["bad"].error.type == "invalid_request_error"  # told so, full queue or not
        assert tiny.stats().waiting == 0  # none added yet: they count as waiting all the same

        for request_id in ["a0", "a1", "a0", *(f"gone{i}" for i in range(20)), "a1"]:
            await bus.deliver(subjects.cancel(EXEC), Cancel(request_id=request_id))
        held.set()
        accepted = [f"a{i}" for i in range(8)]
        await until(lambda: all(finished(bus, r) for r in accepted), "the admitted requests finishing")
        assert [bus.deltas(r)[-1].finish_reason for r in accepted] == ["abort", "abort"] + ["length"] * 6

        await bus.deliver(subjects.infer(EXEC), request("a9", 8))  # the queue has room again
        await until(lambda: finished(bus, "a9"), "a request admitted after the backlog")
        assert bus.admissions()["a9"].accepted
        await service.stop(drain_timeout_s=5)
        assert tiny.stats().ledger.pages_kv_used == 0

    asyncio.run(scenario())


def test_a_stalled_bus_stalls_generation_then_every_token_leaves_in_order(tiny):
    greedy = dict(temperature=0.0)
    [want] = tiny.generate(["hello world"], SamplingOptions(max_tokens=200, ignore_eos=True, **greedy))

    async def scenario():
        service, bus = await serve(tiny, outbox_limit=4)
        bus.gate.clear()
        before = tiny.stats().generated_tokens
        await bus.deliver(subjects.infer(EXEC), request("o", 200, **greedy))
        generated = await stalled(tiny) - before
        assert generated < 20 and not bus.sent  # held back by a full outbox, not generated ahead
        # Answering an admission never waits for the outbox: the loop that answers is the one that empties it.
        await bus.deliver(subjects.infer(EXEC), request("p", 8, **greedy))

        bus.gate.set()
        await until(lambda: finished(bus, "o") and finished(bus, "p"), "the requests finishing once the bus moves")
        assert bus.sent[0][0] == "reply" and bus.admissions()["o"].accepted  # the admission still goes first
        assert bus.admissions()["p"].accepted
        deltas = bus.deltas("o")
        assert [t for d in deltas for t in d.token_ids] == want.outputs[0].token_ids
        assert [d.output_tokens for d in deltas] == sorted(d.output_tokens for d in deltas)
        assert deltas[-1].finish_reason == "length" and deltas[-1].output_tokens == 200
        await service.stop(drain_timeout_s=5)

    asyncio.run(scenario())


def test_stopping_while_the_engine_waits_on_a_full_outbox_does_not_hang(tiny):
    async def scenario():
        service, bus = await serve(tiny, outbox_limit=4, flush_timeout_s=0.5)
        bus.gate.clear()  # and it never opens again
        await bus.deliver(subjects.infer(EXEC), request("s", 200))
        await stalled(tiny)
        started = time.monotonic()
        try:
            await asyncio.wait_for(service.stop(drain_timeout_s=0.2), TIMEOUT_S)
        finally:
            bus.gate.set()  # had stopping hung, this lets the engine thread end and the test report it
        assert time.monotonic() - started < 5
        assert not tiny.has_unfinished()  # the request was aborted and its pages freed
        assert tiny.stats().ledger.pages_kv_used == 0

    asyncio.run(scenario())


def test_the_gateway_takes_its_stream_buffer_from_the_environment(monkeypatch):
    assert GatewayConfig.from_env().stream_buffer == GatewayConfig.stream_buffer
    monkeypatch.setenv("MORPHLING_STREAM_BUFFER", "8")
    assert GatewayConfig.from_env().stream_buffer == 8
    monkeypatch.setenv("MORPHLING_STREAM_BUFFER", "lots")
    with pytest.raises(ValueError, match="MORPHLING_STREAM_BUFFER .* got 'lots'"):
        GatewayConfig.from_env()
    monkeypatch.setenv("MORPHLING_STREAM_BUFFER", "0")
    with pytest.raises(ValueError, match="stream_buffer must be at least 1"):
        GatewayConfig.from_env()
