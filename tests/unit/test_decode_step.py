"""A decode step (services/simulator/decode_step.py) against the scheduler's own step on the same state: the same
sequences in the same order, the same chunks, the same pages to the id, the same queue and counters after; and
where it declines, the scheduler's step is one it does not make (a preemption, a prefill, a batch over budget)."""

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.engine.memory.block_manager import BlockManager
from services.executor.engine.memory.ledger import PageLedger
from services.executor.engine.scheduling.scheduler import Scheduler
from services.executor.engine.scheduling.sequence import Sequence, Status
from services.simulator.costs import phases
from services.simulator.decode_step import plan_step
from shared.sampling import SamplingOptions

BLOCK = 4


def sequence(name: str, prompt: int, outputs: int) -> Sequence:
    seq = Sequence(name, 0, [0] * prompt, SamplingOptions(max_tokens=64, ignore_eos=True), 0.0)
    seq.output_ids = [0] * outputs
    return seq


@st.composite
def scheduler_states(draw) -> Scheduler:
    """A scheduler mid-serving: running sequences that decode (one may still be in prefill), some waiting, pages
    from plenty to too few, a token budget and a batch cap that may bind."""
    pages = draw(st.integers(4, 60))
    scheduler = Scheduler(BlockManager(PageLedger(pages), BLOCK), max_num_seqs=draw(st.integers(1, 8)),
                          max_num_batched_tokens=draw(st.integers(1, 40)), max_waiting=16)
    blocks = scheduler.blocks
    for i in range(draw(st.integers(0, 6))):
        prompt, outputs = draw(st.integers(1, 12)), draw(st.integers(0, 6))
        seq = sequence(f"r{i}", prompt, outputs)
        computed = prompt + outputs - 1 if outputs else draw(st.integers(0, prompt - 1))  # outputs: a decode
        if -(-computed // BLOCK) > blocks.ledger.num_free:
            break
        blocks.reserve(seq, computed)
        seq.num_computed, seq.status = computed, Status.RUNNING
        scheduler.running.append(seq)
    for i in range(draw(st.integers(0, 5))):
        scheduler.add(sequence(f"w{i}", draw(st.integers(1, 30)), 0))
    return scheduler


def state(scheduler: Scheduler) -> tuple:
    """What a step leaves: every sequence's place and pages, the queue, the free pages, the counters."""
    seqs = [*scheduler.running, *scheduler.waiting]
    return ([(s.seq_id, s.status, s.num_computed, list(s.block_table)) for s in seqs],
            [s.seq_id for s in scheduler.running], [s.seq_id for s in scheduler.waiting],
            scheduler.blocks.ledger.free_pages(), scheduler.num_preemptions, scheduler.num_admission_blocked)


@settings(max_examples=400, deadline=None)
@given(scheduler=scheduler_states())
def test_a_decode_step_is_the_schedulers_step_or_declines_one_it_would_not_make(scheduler):
    ours, theirs = scheduler, copy.deepcopy(scheduler)
    before = state(ours)
    step, out = plan_step(ours, ours.blocks), theirs.schedule()
    if step is None:
        assert state(ours) == before  # declined: nothing reserved, nobody admitted
        decodes = [c for c in out.chunks if c.length == 1 and c.start >= len(c.seq.prompt_ids)]
        assert (out.preempted or len(decodes) < len(before[1]) or not before[1]
                or any(s.num_uncomputed != 1 or not s.output_ids for s in scheduler.running))
        return
    assert [s.seq_id for s in step.decodes] + [c.seq.seq_id for c in step.admitted.chunks] == [
        c.seq.seq_id for c in out.chunks]
    assert [(s.num_computed, 1) for s in step.decodes] == [(c.start, c.length) for c in out.chunks[:len(step.decodes)]]
    assert [(c.start, c.length) for c in step.admitted.chunks] == [
        (c.start, c.length) for c in out.chunks[len(step.decodes):]]
    assert (len(step.decodes), step.context) == phases(out.chunks)[:2]
    assert not out.preempted
    assert state(ours) == state(theirs)


def test_a_finished_slot_is_taken_by_the_queues_head_beside_the_batchs_decodes():
    """Three decoding, the fourth slot free: the head of the queue is admitted with its whole prompt, and the
    decode whose token opens a block takes the page before it."""
    scheduler = Scheduler(BlockManager(PageLedger(16), BLOCK), max_num_seqs=4, max_num_batched_tokens=32,
                          max_waiting=8)
    for name, prompt in (("a", 3), ("b", 4), ("c", 6)):
        seq = sequence(name, prompt, 1)
        scheduler.blocks.reserve(seq, prompt)
        seq.num_computed, seq.status = prompt, Status.RUNNING
        scheduler.running.append(seq)
    scheduler.add(sequence("d", 9, 0))
    scheduler.add(sequence("e", 2, 0))
    step = plan_step(scheduler, scheduler.blocks)
    assert [s.request_id for s in step.decodes] == ["a", "b", "c"]
    assert [(c.seq.request_id, c.start, c.length) for c in step.admitted.chunks] == [("d", 0, 9)]
    assert step.context == 4 + 5 + 7
    # the ledger hands out its highest free page first: b's token (position 4) opens its second block, page 11,
    # taken before d's three
    assert [s.block_table for s in scheduler.running] == [[15], [14, 11], [13, 12], [10, 9, 8]]
    assert [s.request_id for s in scheduler.waiting] == ["e"]
