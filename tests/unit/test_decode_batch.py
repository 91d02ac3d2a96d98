"""A decode batch (services/tools/simulator/decode_batch.py) against the scheduler's own steps on the same state, step
after step: the same chunks, the same pages to the id, the same queue, counters and finished sequences; each
sequence's tokens, once written, those single steps gave it; and where it declines, nothing changed and the
scheduler's step is one it does not make (a preemption, a prefill, a batch over budget)."""

import copy
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from services.tools.simulator.costs import phases
from services.tools.simulator.decode_batch import DecodeBatch
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import PageLedger
from shared.core.scheduling.scheduler import Scheduler
from shared.core.scheduling.sequence import Sequence, Status
from shared.sampling import SamplingOptions

BLOCK = 4
MAX_MODEL_LEN = 40


def sequence(name: str, prompt: int, outputs: int, max_tokens: int) -> Sequence:
    seq = Sequence(name, 0, [0] * prompt, SamplingOptions(max_tokens=max_tokens, ignore_eos=True), 0.0)
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
        seq = sequence(f"r{i}", prompt, outputs, outputs + draw(st.integers(1, 12)))
        computed = prompt + outputs - 1 if outputs else draw(st.integers(0, prompt - 1))  # outputs: a decode
        if -(-computed // BLOCK) > blocks.ledger.num_free:
            break
        blocks.reserve(seq, computed)
        seq.num_computed, seq.status = computed, Status.RUNNING
        scheduler.running.append(seq)
    for i in range(draw(st.integers(0, 5))):
        scheduler.add(sequence(f"w{i}", draw(st.integers(1, 30)), 0, draw(st.integers(1, 12))))
    return scheduler


def tables(scheduler: Scheduler) -> tuple:
    """What a step leaves that a batch keeps up to date: places, pages, the queue, the free pages, the counters."""
    return ([(s.seq_id, s.status, list(s.block_table)) for s in (*scheduler.running, *scheduler.waiting)],
            [s.seq_id for s in scheduler.running], [s.seq_id for s in scheduler.waiting],
            scheduler.blocks.ledger.free_pages(), scheduler.num_preemptions, scheduler.num_admission_blocked)


def state(scheduler: Scheduler) -> tuple:
    """All of it, every sequence's tokens too."""
    seqs = [*scheduler.running, *scheduler.waiting]
    return tables(scheduler), [(s.seq_id, s.num_computed, len(s.output_ids)) for s in seqs]


def finishes(seq: Sequence) -> bool:
    return len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= MAX_MODEL_LEN


def end_chunks(scheduler: Scheduler, chunks, batch: DecodeBatch | None = None, tokens: Counter | None = None
               ) -> list[str]:
    """A step's chunks done as the executor does them: a token where one completes its sequence (counted in
    `tokens`), which ends or (beside a batch) joins it; the names of those that ended."""
    ended = []
    for chunk in chunks:
        seq = chunk.seq
        seq.num_computed += chunk.length
        if seq.num_computed != seq.num_tokens:
            continue
        seq.output_ids.append(0)
        if tokens is not None:
            tokens[seq.request_id] += 1
        if finishes(seq):
            scheduler.remove(seq)
            ended.append(seq.request_id)
        elif batch is not None:
            batch.join(seq)
    return ended


@settings(max_examples=400, deadline=None)
@given(scheduler=scheduler_states(), steps=st.integers(1, 12))
def test_a_batch_steps_as_the_scheduler_does_until_it_declines_a_step_it_would_not_make(scheduler, steps):
    ours, theirs = scheduler, copy.deepcopy(scheduler)
    seqs = {s.request_id: (s, len(s.output_ids)) for s in (*ours.running, *ours.waiting)}
    written, eager = Counter(), Counter()
    batch = DecodeBatch.of(ours, ours.blocks, MAX_MODEL_LEN, lambda seq, n, _: written.update({seq.request_id: n}))
    if batch is None:
        assert any(s.num_uncomputed != 1 or not s.output_ids for s in ours.running)
        return
    declined = False
    for _ in range(steps):
        before = state(theirs)
        planned, out = batch.step(), theirs.schedule()
        if planned is None:
            batch.write_all()
            assert state(ours) == before  # declined: nothing reserved, nobody admitted
            decodes = [c for c in out.chunks if c.length == 1 and c.start >= len(c.seq.prompt_ids)]
            assert (out.preempted or len(decodes) < len(before[0][1]) or not before[0][1]
                    or any(s.num_uncomputed != 1 or not s.output_ids for s in theirs.running))
            declined = True
            break
        (n, context, prefills), admitted = planned
        assert (n, context, prefills) == phases(out.chunks)
        assert [(c.seq.seq_id, c.start, c.length) for c in admitted.chunks] == [
            (c.seq.seq_id, c.start, c.length) for c in out.chunks[n:]]
        assert not out.preempted and tables(ours) == tables(theirs)
        ended = []
        for seq in batch.end_step(0.0):
            ours.remove(seq)
            ended.append(seq.request_id)
        ended += end_chunks(ours, admitted.chunks, batch, eager)
        assert ended == end_chunks(theirs, out.chunks)
        assert tables(ours) == tables(theirs)
    batch.write_all()
    assert declined or state(ours) == state(theirs)
    # every token a decode took in the batch was recorded once, when it was written
    assert {name: len(seq.output_ids) - outputs - eager[name] for name, (seq, outputs) in seqs.items()} == {
        name: written[name] for name in seqs}


def test_a_finished_slot_is_taken_by_the_queues_head_beside_the_batchs_decodes():
    """Three decoding, the fourth slot free: the head of the queue is admitted with its whole prompt, and the
    decode whose token opens a block takes the page before it."""
    scheduler = Scheduler(BlockManager(PageLedger(16), BLOCK), max_num_seqs=4, max_num_batched_tokens=32,
                          max_waiting=8)
    for name, prompt in (("a", 3), ("b", 4), ("c", 6)):
        seq = sequence(name, prompt, 1, 8)
        scheduler.blocks.reserve(seq, prompt)
        seq.num_computed, seq.status = prompt, Status.RUNNING
        scheduler.running.append(seq)
    scheduler.add(sequence("d", 9, 0, 8))
    scheduler.add(sequence("e", 2, 0, 8))
    batch = DecodeBatch.of(scheduler, scheduler.blocks, MAX_MODEL_LEN, lambda *_: None)
    (decodes, context, prefills), admitted = batch.step()
    assert (decodes, context, prefills) == (3, 4 + 5 + 7, [9])
    assert [(c.seq.request_id, c.start, c.length) for c in admitted.chunks] == [("d", 0, 9)]
    # the ledger hands out its highest free page first: b's token (position 4) opens its second block, page 11,
    # taken before d's three
    assert [s.block_table for s in scheduler.running] == [[15], [14, 11], [13, 12], [10, 9, 8]]
    assert [s.request_id for s in scheduler.waiting] == ["e"]
