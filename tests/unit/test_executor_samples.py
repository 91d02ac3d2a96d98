"""What an executor reports for the monitor's SLO windows and the controller's CoCoServe policies: each
finished request's latencies exactly once, the batch cap, the KV pages its running sequences still take,
and how busy its engine thread (or a follower's part of the steps) is.

The service runs on a tiny engine behind the stand-in bus of test_bounded_queues, which here keeps the
telemetry it is sent. The engine prefills in chunks of one block, so that requests are also seen with their
prompt half computed.
"""

import asyncio
import itertools
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.engine.model.decoder import ForwardBatch
from services.executor.fabric import step as wire
from services.executor.fabric.member import InstanceMember
from services.executor.fabric.world import FabricError
from services.executor.service import ExecutorService
from shared import subjects
from shared.config import ExecutorConfig
from shared.core.latency import BusyWindow, FinishedSamples, LatencyWindow
from shared.core.scheduling.growth import pages_growth
from shared.messages import Cancel, ExecutorTelemetry, InstancePlan, LayerPlan, RequestLatency
from shared.sampling import SamplingOptions
from tests.checkpoints import tiny_llama3_engine
from tests.unit.test_admission_guards import hold_engine
from tests.unit.test_bounded_queues import EXEC, StubBus, finished, request, until


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama3_engine(tmp_path_factory.mktemp("tiny") / "model", max_num_seqs=4, max_num_batched_tokens=8)


class ReportingBus(StubBus):
    """The stand-in bus, keeping the telemetry reports."""

    def __init__(self):
        super().__init__()
        self.reports: list[ExecutorTelemetry] = []

    async def publish(self, subject: str, message) -> None:
        if subject == subjects.telemetry(EXEC):
            self.reports.append(message)
            return
        await self.take(subject, message)

    def samples(self) -> list[RequestLatency]:
        return [s for report in self.reports for s in report.requests]


async def serve(engine) -> tuple[ExecutorService, ReportingBus]:
    service = ExecutorService(ExecutorConfig(executor_id=EXEC, engine=engine.config), engine=engine)
    bus = ReportingBus()
    await service.start(bus)
    return service, bus


def test_a_finished_requests_latency_is_reported_once_and_one_without_tokens_never(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        sent = time.time()
        await bus.deliver(subjects.infer(EXEC), request("done", 8))
        await until(lambda: finished(bus, "done"), "the request finishing")
        took = time.time() - sent
        await until(bus.samples, "its latency reported")

        held = hold_engine(service)
        await bus.deliver(subjects.infer(EXEC), request("cut", 50))
        await bus.deliver(subjects.cancel(EXEC), Cancel(request_id="cut"))
        held.set()
        await until(lambda: finished(bus, "cut"), "the cancelled request ending")
        reports = len(bus.reports)
        await until(lambda: len(bus.reports) >= reports + 3, "three more reports")

        [sample] = bus.samples()  # once, however many reports went out since; nothing for "cut"
        assert 0 < sample.ttft_s <= took
        assert 0 < sample.tpot_s < took / 7  # 8 tokens: 7 gaps after the first
        assert service.telemetry().requests == []
        await service.stop(drain_timeout_s=5)

    asyncio.run(scenario())


def test_reports_carry_the_batch_cap_the_pages_still_to_come_and_how_busy_the_engine_is(tiny):
    async def scenario():
        service, bus = await serve(tiny)
        await bus.deliver(subjects.infer(EXEC), request("long", 200))
        await until(lambda: any(r.running and r.pages_growth > 0 and r.busy > 0 for r in bus.reports),
                    "a report of the request running")
        await until(lambda: finished(bus, "long"), "the request finishing")
        await until(lambda: bus.reports[-1].running == 0, "a report after it")
        assert bus.reports[-1].pages_growth == 0
        await until(lambda: bus.reports[-1].busy == 0.0, "an idle second reading as not busy")
        assert {r.max_num_seqs for r in bus.reports} == {tiny.config.max_num_seqs}
        assert all(0.0 <= r.busy <= 1.0 for r in bus.reports)
        await service.stop(drain_timeout_s=5)

    asyncio.run(scenario())


def test_the_finished_samples_are_bounded_keeping_the_newest():
    finished_samples = FinishedSamples(limit=3)
    for i in range(5):
        finished_samples.add(float(i), 0.0)
    assert [s.ttft_s for s in finished_samples.drain()] == [2.0, 3.0, 4.0]
    assert finished_samples.drain() == []


def test_busy_is_the_share_of_the_last_window_inside_spans_a_running_one_included():
    busy = BusyWindow(window_s=1.0)
    busy.begin(now=10.0)
    busy.end(now=10.3)
    busy.begin(now=10.5)
    busy.end(now=10.6)
    assert busy.share(now=11.0) == pytest.approx(0.4)
    assert busy.share(now=11.4) == pytest.approx(0.1)  # the first span has left the window
    busy.begin(now=11.5)  # a long step, still going
    assert busy.share(now=12.0) == pytest.approx(0.5)
    assert busy.share(now=14.0) == 1.0
    busy.end(now=14.0)
    assert busy.share(now=15.5) == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.floats(0.0, 1.5)), max_size=30),
       st.booleans())
def test_the_windows_kept_sums_agree_with_summing_the_window_each_time(steps, running):
    """BusyWindow and LatencyWindow keep running sums (every telemetry report asks); the share and the mean
    are what summing the window's spans and values afresh gives, as gaps, spans and reads come in any mix."""
    busy, latency = BusyWindow(window_s=1.0), LatencyWindow(window_s=1.0)
    spans, values, now = [], [], 0.0
    for gap, length, read_after in steps:
        start = now + gap
        busy.begin(start)
        busy.end(start + length)
        spans.append((start, start + length))
        latency.record(length, start + length)
        values.append((start + length, length))
        now = start + length
        read_at = now + read_after
        cutoff = read_at - 1.0
        expected = sum(max(0.0, min(end, read_at) - max(begin, cutoff)) for begin, end in spans)
        assert busy.share(read_at) == pytest.approx(min(1.0, expected), abs=1e-9)
        inside = [v for t, v in values if t >= cutoff]
        assert latency.mean(read_at) == pytest.approx(sum(inside) / len(inside) if inside else 0.0, abs=1e-9)
        now = read_at  # the clock only moves on
    if running:
        busy.begin(now)
        expected = sum(max(0.0, min(end, now + 0.5) - max(begin, now - 0.5)) for begin, end in spans) + 0.5
        assert busy.share(now + 0.5) == pytest.approx(min(1.0, expected), abs=1e-9)


@given(st.floats(0.0, 5.0), st.lists(st.floats(0.001, 0.4), max_size=40), st.floats(0.0, 2.0))
def test_spans_back_to_back_are_begin_and_end_at_each_to_the_float(start, lengths, read_after):
    """The simulator's decode runs mark a run's steps at once (BusyWindow.back_to_back)."""
    ends = list(itertools.accumulate(lengths, initial=start))[1:]
    one_by_one, at_once = BusyWindow(window_s=1.0), BusyWindow(window_s=1.0)
    one_by_one.begin(start)
    for end in ends:
        one_by_one.end(end)
        one_by_one.begin(end)
    at_once.begin(start)
    at_once.back_to_back(ends)
    read_at = (ends[-1] if ends else start) + read_after
    assert at_once.share(read_at) == one_by_one.share(read_at)
    assert (list(at_once._spans), at_once._total) == (list(one_by_one._spans), one_by_one._total)


class _Following:
    """The parts of an InstanceMember that follow_one reaches: the leader's steps arrive after a wait, and our part
    of a RUN step takes its time (or fails)."""

    def __init__(self, kinds: list[int], part_s: float = 0.2, fails: bool = False):
        self.kinds, self.part_s, self.fails = kinds, part_s, fails
        self.busy, self.broken, self.dropped = BusyWindow(), False, None
        self.me, self.world = "exec1", self
        self.plan = InstancePlan(id="i0", leader="exec0", members=["exec0", "exec1"], tp=2,
                                 layers=[LayerPlan(placement=["exec0", "exec1"])])

    def share(self, _tensor, _what):
        time.sleep(0.5)
        none = torch.empty(0, dtype=torch.int64)
        return wire.encode(wire.StepPlan(self.kinds.pop(0), batch=ForwardBatch(none, none, none, [], [], none)))

    def execute(self, step):
        time.sleep(self.part_s)
        if self.fails:
            raise RuntimeError("a bug in our part")

    def drop(self, members):  # World.drop: the instance's groups close
        self.dropped = list(members)


def test_a_follower_is_busy_inside_its_part_of_a_step_not_while_waiting_for_the_next():
    member = _Following([wire.RUN])
    assert InstanceMember.follow_one(member) == wire.RUN
    assert 0.2 <= member.busy.share() < 0.6


def test_a_bug_in_a_followers_part_breaks_its_instance_as_a_lost_member_would():
    member = _Following([wire.RUN], part_s=0.0, fails=True)
    with pytest.raises(FabricError, match="exec1's part of the leader's step failed"):
        InstanceMember.follow_one(member)
    assert member.broken and member.dropped == ["exec0", "exec1"]


# --- the pages still to come --------------------------------------------------------------------------

@pytest.mark.parametrize("prompt_len, n, max_tokens", [
    (13, 3, 20),  # forks into three sharing a partly filled block: two copy it
    (16, 2, 9),  # the prompt fills whole blocks: nothing to copy
    (13, 3, 1),  # one token each: nothing written after the prompt
    (5, 1, 30),
    (13, 1, None),  # until the context is full
])
def test_pages_growth_is_what_the_running_sequences_take_before_they_end(tiny, monkeypatch, prompt_len, n,
                                                                        max_tokens):
    engine = tiny
    scheduler = engine.scheduler
    held: list[int] = []  # pages the sequences hold in each step, once it is scheduled

    def holding() -> set[int]:
        return {page for seq in scheduler.running for page in seq.block_table}

    schedule = scheduler.schedule

    def watched():
        out = schedule()
        held.append(len(holding()))
        return out

    monkeypatch.setattr(scheduler, "schedule", watched)
    seed = 7 if n > 1 else None
    engine.add_request("r", list(range(5, 5 + prompt_len)),
                       SamplingOptions(n=n, max_tokens=max_tokens, ignore_eos=True, temperature=1.0, seed=seed))
    preemptions = scheduler.num_preemptions
    predicted: list[tuple[int, int]] = []  # (steps taken, pages held + growth) before each step
    while engine.has_unfinished():
        if scheduler.running:
            predicted.append((len(held), len(holding()) + pages_growth(scheduler.running, scheduler.blocks,
                                                                       engine.max_model_len)))
        engine.step()
    assert scheduler.num_preemptions == preemptions and predicted
    # All of a request's sequences end together, so what they hold at the end is the most they ever hold.
    assert [total for _, total in predicted] == [max(held[taken:]) for taken, _ in predicted]
