"""Scheduler and block manager under random adds, steps, forks, aborts and preemptions.

Whatever happens, no page is leaked or shared wrongly (every page's refcount equals the number of block
tables that hold it), and every admitted request is finished, aborted, or still queued or running.
"""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.core.errors import QueueFullError
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import PageLedger
from shared.core.scheduling.scheduler import Scheduler
from shared.core.scheduling.sequence import Sequence, Status, finish_reason
from shared.errors import InvalidCommandError
from shared.sampling import SamplingOptions

BLOCK = 4
PAGES = 40
SLOT_PAGES = 8


def make_scheduler(**kw) -> Scheduler:
    ledger = PageLedger(PAGES)
    ledger.assign_slot(0, range(0, SLOT_PAGES))
    args = dict(max_num_seqs=6, max_num_batched_tokens=16, max_waiting=5) | kw
    return Scheduler(BlockManager(ledger, BLOCK), **args)


def seq(request_id: str, prompt_len: int, n: int = 1) -> Sequence:
    return Sequence(request_id, 0, list(range(prompt_len)), SamplingOptions(n=n), 0.0, fork_into=n)


def run_step(s: Scheduler, finish_after: int = 1 << 30) -> list[Sequence]:
    """One step without a model: count computed tokens, 'sample' a token for completing chunks."""
    out = s.schedule()
    assert out.num_tokens <= s.max_num_batched_tokens
    done = []
    for chunk in out.chunks:
        chunk.seq.num_computed += chunk.length
        if chunk.completes:
            chunk.seq.output_ids.append(7)
            if len(chunk.seq.output_ids) >= finish_after:
                done.append(chunk.seq)
    for d in done:
        s.remove(d)
    return done


def test_decodes_and_prefill_chunks_share_a_step():
    s = make_scheduler(max_num_batched_tokens=8)
    a, b = seq("a", 3), seq("b", 20)
    s.add(a)
    run_step(s)  # a's whole prompt
    s.add(b)
    out = s.schedule()
    assert [(c.seq.request_id, c.length) for c in out.chunks] == [("a", 1), ("b", 7)]


def test_full_queue_rejects_and_changes_nothing():
    s = make_scheduler(max_waiting=2)
    s.add(seq("a", 3))
    s.add(seq("b", 3))
    with pytest.raises(QueueFullError):
        s.add(seq("c", 3))
    assert [q.request_id for q in s.waiting] == ["a", "b"]


def test_out_of_pages_preempts_the_newest_and_it_comes_back_first():
    s = make_scheduler(max_num_batched_tokens=64)
    free = PAGES - SLOT_PAGES  # 32 pages = 128 tokens
    a, b = seq("a", 60), seq("b", 60)
    s.add(a)
    s.add(b)
    run_step(s)
    while s.num_preemptions == 0:
        run_step(s)
    assert b.status is Status.WAITING and s.waiting[0] is b and b.num_computed == 0 and not b.block_table
    assert s.blocks.ledger.num_free + len(a.block_table) == free


def test_a_head_held_for_pages_counts_as_blocked_and_one_held_for_a_slot_does_not():
    s = make_scheduler(max_num_batched_tokens=256)
    a = seq("a", (PAGES - SLOT_PAGES) * BLOCK - 1)  # its prompt and first token take every free page
    s.add(a)
    run_step(s)
    s.add(seq("b", 8))
    run_step(s)
    assert s.num_admission_blocked == 1 and [q.request_id for q in s.waiting] == ["b"]
    full = make_scheduler(max_num_seqs=1)
    full.add(seq("c", 3))
    run_step(full)
    full.add(seq("d", 3))
    run_step(full)
    assert full.num_admission_blocked == 0 and len(full.waiting) == 1


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.s = make_scheduler()
        self.live: dict[str, list[Sequence]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.rejected: set[str] = set()
        self.count = 0

    @rule(prompt_len=st.integers(1, 40), n=st.integers(1, 3))
    def add(self, prompt_len, n):
        rid = f"r{self.count}"
        self.count += 1
        try:
            self.s.add(seq(rid, prompt_len, n))
        except QueueFullError:
            self.rejected.add(rid)
            return
        self.live[rid] = [self.s.waiting[-1]]

    @rule(max_new=st.integers(1, 12))
    def step(self, max_new):
        out = self.s.schedule()
        for chunk in out.chunks:
            chunk.seq.num_computed += chunk.length
        for chunk in out.chunks:
            parent = chunk.seq
            if not chunk.completes or parent.status is not Status.RUNNING:
                continue
            family = [parent]
            for i in range(1, parent.fork_into):  # the engine's fork: share every prompt page
                child = Sequence(parent.request_id, i, parent.prompt_ids, parent.params, 0.0,
                                 num_computed=parent.num_computed)
                self.s.blocks.fork(parent, child)
                self.s.add_running(child)
                family.append(child)
            if parent.fork_into > 1:
                parent.fork_into = 1
                self.live[parent.request_id] = family
            for member in family:
                member.output_ids.append(5)
                if len(member.output_ids) >= max_new:
                    self.s.remove(member)
            if all(m.status is Status.FINISHED for m in self.live[parent.request_id]):
                del self.live[parent.request_id]
                self.finished.add(parent.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        for member in self.live.pop(rid):
            if member.status is not Status.FINISHED:
                self.s.remove(member)
        self.aborted.add(rid)

    @precondition(lambda self: self.s.running)
    @rule(data=st.data())
    def preempt(self, data):
        self.s.preempt(data.draw(st.sampled_from(self.s.running)))

    @invariant()
    def pages_are_accounted_for(self):
        ledger = self.s.blocks.ledger
        ledger.check_consistency()
        holders: dict[int, int] = {}
        for family in self.live.values():
            for member in family:
                if member.status is not Status.FINISHED:
                    for page in member.block_table:
                        holders[page] = holders.get(page, 0) + 1
        assert all(page >= SLOT_PAGES for page in holders)
        assert all(ledger.refcount(p) == n for p, n in holders.items())
        assert ledger.snapshot().pages_kv_used == len(holders)
        for member in self.s.running:
            assert len(member.block_table) * BLOCK >= member.num_computed

    @invariant()
    def every_request_is_somewhere(self):
        queued = {q.request_id for q in self.s.waiting} | {r.request_id for r in self.s.running}
        assert queued == set(self.live)
        assert not (set(self.live) & (self.finished | self.aborted | self.rejected))
        assert len(self.live) + len(self.finished) + len(self.aborted) + len(self.rejected) == self.count


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


@given(st.integers(1, 64), st.lists(st.integers(-2, 80), max_size=8))
def test_a_batch_cap_moves_within_the_configured_batch_and_a_refused_one_changes_nothing(configured, caps):
    sched = make_scheduler(max_num_seqs=configured)
    for cap in caps:
        before = sched.max_num_seqs
        if 1 <= cap <= configured:
            assert sched.cap_batch(cap) == before and sched.max_num_seqs == cap
        else:
            with pytest.raises(InvalidCommandError, match=f"between 1 and {configured}"):
                sched.cap_batch(cap)
            assert sched.max_num_seqs == before


@pytest.mark.parametrize("token, output, max_tokens, ignore_eos, expected", [
    (2, [5, 2], None, False, ("stop", None)),  # the end-of-sequence token
    (2, [5, 2], 2, True, ("length", None)),  # ignored, and max_tokens reached
    (7, [7], None, False, ("stop", 7)),  # a stop token, named as the stop reason
    (9, [9], None, False, ("stop", "END")),  # the text completed a stop string
    (4, [4, 4, 4], 3, False, ("length", None)),
    (4, [4], None, False, (None, None)),
])
def test_a_sequence_finishes_as_openai_names_it(token, output, max_tokens, ignore_eos, expected):
    params = SamplingOptions(max_tokens=max_tokens, ignore_eos=ignore_eos, stop_token_ids=[7])
    seq = Sequence("r", 0, [1, 1], params, 0.0, output_ids=output)
    asked = []

    def stop_string(t: int) -> str | None:
        asked.append(t)
        return "END" if t == 9 else None

    assert finish_reason(token, stop_string, seq, (2,), max_model_len=64) == expected
    assert asked == ([] if expected[1] == 7 or expected == ("stop", None) else [token])
