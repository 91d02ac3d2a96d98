"""A batch whose running sequences all decode, stepped with the waiting queue's heads admitted beside it, its
sequences touched only at their own events: a block opened, the last token.

At saturation nearly every step admits: a sequence finishes, a waiting one takes its slot, and its prefill rides
with the batch's decodes. Decode runs (decode_run.py) end there. Each of those steps is one the scheduler would make
in three rules (shared/core/scheduling/scheduler.py): when every running sequence decodes one token and the pages
its tokens open are free, the first preempts nobody and the second finds nothing to do, so the step is every running
sequence, those whose token opens a block taking a page in the batch's order, then the waiting sequences the third
admits (Scheduler.admit, the scheduler's own). At a thousand executors writing each decode's token each step was
most of the simulator's time, yet a decode's step is foreseeable from its place: its token opens a block every
block_size steps, and its last comes at max_tokens. So the batch keeps its steps as a count (`tick`), each sequence
the tick its tokens were last written at, the steps at which each opens a block or ends, and the sum of their
contexts as one number. A step reads those; a sequence's tokens are written (`write`) when it ends and when anything
else is to read it: the executor writes them all before a step the scheduler makes, a command, a cancel or a merge
(executor.py, `release_batch`). With nobody able to join, the batch runs many steps as one event
(decode_run.plan_batch_run), each settled by its own steps here.

A batch is valid while only its own steps change the scheduler: one whose running sequences are not its members
(a prefill still going, a preemption, a merge) declines the step, and the executor writes and drops it. A
simulated sequence never forks, so no block is shared: a decode's pages are the block its token opens, or none,
a fresh page at its table's end whatever its tokens, and the pages its members still take (the telemetry's
pages_growth) are a count kept as they open blocks and end.

Exactly the steps the scheduler would make, to the page id and the float: tests/unit/test_decode_batch.py holds
a batch's steps to the scheduler's on the same state, and tests/unit/test_decode_runs.py replays single steps
beside simulations that take them.
"""

import heapq
from collections.abc import Callable

from services.tools.simulator.replica_rows import ReplicaRows
from shared.core.memory.block_manager import BlockManager
from shared.core.scheduling.growth import pages_growth
from shared.core.scheduling.scheduler import Scheduler, SchedulerOutput
from shared.core.scheduling.sequence import Sequence, Status

Written = Callable[[Sequence, int, float], None]  # (sequence, tokens written, when the last came): its request's


class DecodeBatch:
    def __init__(self, scheduler: Scheduler, blocks: BlockManager, max_model_len: int, written: Written,
                 rows: ReplicaRows | None = None):
        """`rows`: its members counted by replica, told as they join and leave (a CoCoServe instance's, whose
        replicas take a step's rows request by request)."""
        self.scheduler, self.blocks, self.max_model_len, self.written = scheduler, blocks, max_model_len, written
        self.rows = rows
        self.tick = 0  # its steps ended
        self.ended_s = 0.0  # when the last of them ended
        self.marks: dict[Sequence, int] = {}  # member -> the tick its tokens are written up to
        self.places: dict[Sequence, int] = {}  # member -> its place in the batch: the scheduler's running order
        self.joined = 0
        self.offset = 0  # sum of (num_computed - mark): its context before the step at tick t is offset + n * t
        self.opens: dict[int, list[Sequence]] = {}  # tick -> those whose token at that step opens a block
        self.ends: dict[int, list[Sequence]] = {}  # tick -> those whose token at that step is their last
        self.end_ticks: list[int] = []  # the keys of `ends`, a heap: the first is the next step a member ends at
        self.growth = 0  # the pages its members still take before they end (growth.py's pages_growth of them)

    @classmethod
    def of(cls, scheduler: Scheduler, blocks: BlockManager, max_model_len: int, written: Written,
           rows: ReplicaRows | None = None) -> "DecodeBatch | None":
        """The scheduler's running sequences as a batch, or None when one of them is not decoding."""
        # Newest first: a prompt going in over several steps is the newest, asked about at each of them; a batch
        # joined up to it for nothing made a fleet at its edge 6% slower.
        for seq in reversed(scheduler.running):
            if not seq.output_ids or seq.num_uncomputed != 1 or seq.status is not Status.RUNNING:
                return None
        batch = cls(scheduler, blocks, max_model_len, written, rows)
        for seq in scheduler.running:
            batch.join(seq)
        return batch

    def join(self, seq: Sequence) -> None:
        """`seq`, decoding from the next step on, joins at the end of the batch."""
        t = self.tick
        self.marks[seq] = t
        self.places[seq] = self.joined
        self.joined += 1
        self.offset += seq.num_computed - t
        if self.rows is not None:
            self.rows.joined(seq, seq.num_computed - t)
        # The step at tick t writes position num_computed + (t - mark); it opens a block at the table's end.
        self.opens.setdefault(t + len(seq.block_table) * self.blocks.block_size - seq.num_computed, []).append(seq)
        self.growth += self._growth(seq)
        last = min(seq.params.max_tokens - len(seq.output_ids), self.max_model_len - seq.num_tokens)
        end = t + max(1, last) - 1
        if end not in self.ends:
            self.ends[end] = []
            heapq.heappush(self.end_ticks, end)
        self.ends[end].append(seq)

    def decodes_all(self) -> bool:
        """Whether its members are the scheduler's running sequences, within a step's token budget: the scheduler's
        next step decodes every one of them, and is the batch's where its pages are free."""
        n = len(self.marks)
        return 0 < n == len(self.scheduler.running) and n <= self.scheduler.max_num_batched_tokens

    def opening(self, t: int) -> list[Sequence]:
        """The members whose token at the step at tick `t` opens a block (`t` within block_size of `tick`)."""
        return [seq for seq in self.opens.get(t, ()) if seq in self.marks]  # not those ended since

    def step(self) -> tuple[tuple[int, int, list[int]], SchedulerOutput] | None:
        """The scheduler's next step, its pages reserved and its admissions made: (its phases, as costs.phases
        gives them, and the chunks of those admitted, every one a prefill: a waiting sequence starts from its
        first token); None, nothing changed, where the scheduler's step would differ (a running sequence not a
        member, a batch over the token budget, too few free pages: a preemption)."""
        if not self.decodes_all() or len(opening := self.opening(self.tick)) > self.blocks.ledger.num_free:
            return None
        self.open_blocks(opening)
        scheduler, n = self.scheduler, len(self.marks)
        admitted = SchedulerOutput()
        scheduler.admit(scheduler.max_num_batched_tokens - n, admitted, set())
        return (n, self.offset + n * (self.tick + 1), [c.length for c in admitted.chunks]), admitted

    def open_blocks(self, opening: list[Sequence] | None = None) -> None:
        """The step at `tick` begins: each member whose token opens a block takes a page, in the batch's order: a
        fresh page at its table's end, what BlockManager.reserve gives a sequence whose blocks none shares, and
        its tokens left unwritten (reserve would have read them)."""
        t = self.tick
        opening = self.opening(t) if opening is None else opening
        self.opens.pop(t, None)
        if not opening:
            return
        opening.sort(key=self.places.__getitem__)
        self.growth -= len(opening)
        allocate = self.blocks.ledger.allocate
        for seq in opening:
            seq.block_table.append(allocate())
        self.opens.setdefault(t + self.blocks.block_size, []).extend(opening)

    def end_step(self, now: float) -> list[Sequence]:
        """Its step ended at `now`, a token out of every member: those whose last it was, written and out of the
        batch, in its order."""
        t = self.tick
        self.tick, self.ended_s = t + 1, now
        done = self.ends.pop(t, [])
        while self.end_ticks and self.end_ticks[0] <= t:
            heapq.heappop(self.end_ticks)
        done.sort(key=self.places.__getitem__)
        for seq in done:
            self.growth -= self._growth(seq)
            self.write(seq)
            drift = seq.num_computed - self.marks.pop(seq)
            self.offset -= drift
            if self.rows is not None:
                self.rows.left(seq, drift)
            del self.places[seq]
        return done

    def _growth(self, seq: Sequence) -> int:
        """pages_growth of `seq` alone: the members' sum is theirs together, as none shares a block."""
        return pages_growth((seq,), self.blocks, self.max_model_len)

    def write(self, seq: Sequence) -> None:
        """`seq`'s tokens of the steps ended since they were last written, as single steps would have left it."""
        steps = self.tick - self.marks[seq]
        if steps:
            self.marks[seq] = self.tick
            seq.num_computed += steps
            seq.output_ids += [0] * steps
            self.written(seq, steps, self.ended_s)

    def write_all(self) -> list[Sequence]:
        """Every member written: its members, in the batch's order."""
        members = sorted(self.marks, key=self.places.__getitem__)
        for seq in members:
            self.write(seq)
        return members
