"""What keeps an executor from working for nobody: admissions the gateway gave up on never run, the
queue refuses a wait longer than its bound, a bus outage frees every request's pages, and a bus that
refuses sends costs the requests it cut, not the service.

The service runs on the tiny engine behind the stand-in bus of test_bounded_queues; holding the engine
thread with a call makes accepted requests wait there to be added, which is how they meet their cancel.
"""

import asyncio
import threading
import time

import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.commands import morph
from services.executor.service import ExecutorService
from shared import subjects
from shared.bus import BusUnavailable
from shared.config import EngineConfig, ExecutorConfig
from shared.messages import ADMISSION_EXPIRED, NOT_STARTED, Cancel, GenerateRequest, QuantizeArgs, RestoreArgs
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3
from tests.unit.test_bounded_queues import EXEC, GW, TIMEOUT_S, StubBus, finished, request, serve, until
from tests.unit.test_bounded_queues import tiny  # noqa: F401 (the engine fixture, shared)


def hold_engine(service: ExecutorService) -> threading.Event:
    """Keep the engine thread busy until the returned event is set (operations queue meanwhile)."""
    entered, held = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        held.wait(TIMEOUT_S)

    service.worker.call(hold)
    assert entered.wait(TIMEOUT_S), "the engine thread never took the call"
    return held


async def stop(service: ExecutorService, engine) -> None:
    await service.stop(drain_timeout_s=5)
    assert not engine.has_unfinished()
    assert engine.stats().ledger.pages_kv_used == 0


def test_admissions_are_answered_while_the_engine_is_busy_and_one_reached_after_its_admit_by_is_refused(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        held = hold_engine(service)  # as a long prefill step or a layer swap would
        late = request("late", 8).model_copy(update={"admit_by": time.time() - 0.1})  # held up on its way
        timely = request("timely", 8).model_copy(update={"admit_by": time.time() + 60})
        await bus.deliver(subjects.infer(EXEC), late)
        await bus.deliver(subjects.infer(EXEC), timely)
        await until(lambda: len(bus.admissions()) == 2, "both admissions answered while the engine thread is held")
        refused = bus.admissions()["late"]
        assert not refused.accepted and refused.error.code == ADMISSION_EXPIRED
        assert bus.admissions()["timely"].accepted
        held.set()
        await until(lambda: finished(bus, "timely"), "the timely request finishing")
        assert bus.deltas("late") == []
        await stop(service, tiny)

    asyncio.run(scenario())


@pytest.fixture
def short_of_kv(tmp_path) -> LLMEngine:
    """A tiny engine whose KV (36 blocks of 8 tokens) holds a longer sequence only with its layers at INT4."""
    config = EngineConfig(model=str(write_tiny_llama3(tmp_path / "model")), memory_budget=1 << 20, block_size=8,
                          max_model_len=512, min_kv_tokens=256)
    return LLMEngine(config, progress=False)


def test_a_request_accepted_before_a_restore_left_too_little_kv_for_it_ends_not_started(short_of_kv):
    engine = short_of_kv
    long = GenerateRequest(request_id="long", gateway=GW, prompt=[5 + k % 50 for k in range(320)],
                           arrival_time=time.time(), sampling=SamplingOptions(max_tokens=8, ignore_eos=True))

    async def scenario():
        service, bus = await serve(engine)
        await asyncio.wrap_future(service.worker.call(lambda: morph(engine, QuantizeArgs(layers=4, bits=4))))
        held = hold_engine(service)
        restored = service.worker.call(lambda: morph(engine, RestoreArgs(layers=4)))  # waits behind the hold
        await bus.deliver(subjects.infer(EXEC), long)
        await until(lambda: "long" in bus.admissions(), "the admission answered")
        assert bus.admissions()["long"].accepted  # its 41 blocks fit the INT4 layers' KV
        held.set()
        await asyncio.wrap_future(restored)
        await until(lambda: finished(bus, "long"), "the request ending")
        [ended] = bus.deltas("long")  # the gateway moves it elsewhere: nothing of it was generated here
        assert ended.finish_reason == "error" and ended.error.code == NOT_STARTED and ended.output_tokens == 0
        assert "KV" in ended.error.message and service.worker.snapshot.in_flight == 0
        await stop(service, engine)

    asyncio.run(scenario())


def test_a_cancel_holds_whether_it_comes_before_the_admission_or_while_it_waits(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        await bus.deliver(subjects.cancel(EXEC), Cancel(request_id="early"))
        await asyncio.sleep(0.2)  # applied, finding nothing to stop
        await bus.deliver(subjects.infer(EXEC), request("early", 50))

        held = hold_engine(service)
        await bus.deliver(subjects.infer(EXEC), request("queued", 50))
        await bus.deliver(subjects.cancel(EXEC), Cancel(request_id="queued"))
        held.set()
        await until(lambda: "early" in bus.admissions() and finished(bus, "queued"), "both answered")
        early = bus.admissions()["early"]
        assert not early.accepted and "cancelled" in early.error.message and bus.deltas("early") == []
        [last] = bus.deltas("queued")  # admitted, then stopped before it generated anything
        assert last.finish_reason == "abort" and last.output_tokens == 0
        await stop(service, tiny)

    asyncio.run(scenario())


def test_a_request_predicted_to_wait_past_the_bound_is_refused_as_queue_full(tiny):
    async def scenario():
        service, bus = await serve(tiny, max_queue_wait_s=0.01)
        for r in ("r0", "r1"):  # two departures from the queue give the executor its rate
            await bus.deliver(subjects.infer(EXEC), request(r, 8))
        await until(lambda: finished(bus, "r0") and finished(bus, "r1"), "the first requests finishing")
        # The rate is departures over the executor's age: finished within milliseconds of its start, the two would
        # read as hundreds a second. The idle engine's snapshots age meanwhile.
        await asyncio.sleep(0.3)
        held = hold_engine(service)
        # The engine runs two sequences at once: the next step starts two requests, which the third waits behind
        # as a queue's head does; the fourth waits behind that one too, at a few per second: > 0.01 s.
        admitted = ("first", "second", "third")
        for r in (*admitted, "fourth"):
            await bus.deliver(subjects.infer(EXEC), request(r, 8))
        held.set()
        await until(lambda: all(finished(bus, r) for r in admitted), "the admitted requests finishing")
        assert all(bus.admissions()[r].accepted for r in admitted)
        fourth = bus.admissions()["fourth"]
        assert not fourth.accepted and fourth.error.type == "queue_full" and "bound" in fourth.error.message
        assert "(1 requests ahead)" in fourth.error.message
        await stop(service, tiny)

    asyncio.run(scenario())


def test_a_bus_outage_aborts_every_request_in_flight_and_frees_their_pages(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        for r in ("a", "b", "c"):
            await bus.deliver(subjects.infer(EXEC), request(r, 200))
        held = hold_engine(service)  # admitted, and not a step taken yet when the outage is declared
        bus.outage(3.0)
        held.set()
        await until(lambda: all(finished(bus, r) for r in "abc"), "every request ending")
        assert all(bus.admissions()[r].accepted for r in "abc")
        assert [bus.deltas(r)[-1].finish_reason for r in "abc"] == ["abort"] * 3
        assert tiny.stats().ledger.pages_kv_used == 0
        await stop(service, tiny)

    asyncio.run(scenario())


class RefusingBus(StubBus):
    """A bus that is down: while `refusing`, every send fails as nats-py's full reconnect buffer does."""

    def __init__(self):
        super().__init__()
        self.refusing = False
        self.heartbeats = 0

    async def publish(self, subject: str, message) -> None:
        if subject == subjects.telemetry(EXEC):
            if self.refusing:
                raise BusUnavailable(subject, "disconnected")
            self.heartbeats += 1
            return
        await self.take(subject, message)

    async def take(self, subject: str, message) -> None:
        if self.refusing:
            raise BusUnavailable(subject, "disconnected")
        await super().take(subject, message)


def test_sends_refused_by_a_down_bus_end_their_requests_and_the_service_carries_on(tiny):
    async def scenario():
        service = ExecutorService(ExecutorConfig(executor_id=EXEC, engine=tiny.config), engine=tiny)
        bus = RefusingBus()
        await service.start(bus)
        bus.refusing = True
        aborted = service.worker.snapshot.stats.aborted
        await bus.deliver(subjects.infer(EXEC), request("cut", 240))
        # Its tokens cannot leave: a stream with a hole is no use, so the request is stopped, not finished.
        await until(lambda: service.worker.snapshot.stats.aborted == aborted + 1, "the cut request stopping")
        await until(lambda: service.worker.snapshot.in_flight == 0, "the cut request's pages freed")
        bus.refusing = False
        beats = bus.heartbeats
        await bus.deliver(subjects.infer(EXEC), request("after", 8))
        await until(lambda: finished(bus, "after"), "a request after the bus came back")
        assert bus.admissions()["after"].accepted and "cut" not in bus.admissions()
        await until(lambda: bus.heartbeats > beats, "telemetry resuming")
        await stop(service, tiny)

    asyncio.run(scenario())
