"""Continuous batching: which sequences run this step and how many of their tokens.

Policy, in order, under one per-step token budget:
1. every running sequence that decodes (one token), oldest first; when a page is missing, the newest
   running sequence not yet in this step is preempted (recompute: its pages are freed and it waits at
   the front of the queue), and as a last resort the sequence itself;
2. running sequences still in prefill get chunks of what budget and free pages allow, oldest first;
3. waiting sequences are admitted first-come-first-served while a slot, budget and pages remain;
   admission never preempts, never skips the head of the queue, and pauses in a step that preempted.
"""

from collections import deque
from dataclasses import dataclass, field

from shared.core.errors import QueueFullError
from shared.core.memory.block_manager import BlockManager
from shared.core.scheduling.sequence import Sequence, Status
from shared.errors import InvalidCommandError


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    length: int

    @property
    def completes(self) -> bool:
        """The chunk reaches the sequence's last token, so this step samples its next one."""
        return self.start + self.length == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)  # decodes first, then prefill chunks
    copies: list[tuple[int, int]] = field(default_factory=list)  # page copies to run before the step
    fresh_pages: list[int] = field(default_factory=list)  # newly allocated pages, to zero before the step
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.length for c in self.chunks)


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_waiting: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.configured_max_num_seqs = max_num_seqs  # the batch the engine was sized for: no cap goes beyond it
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_admission_blocked = 0  # steps in which the head of the queue waited for KV pages alone

    def cap_batch(self, cap: int) -> int:
        """Run at most `cap` sequences at once from now on (the running ones go on); returns the cap before.
        InvalidCommandError, changing nothing, outside 1 to the configured batch."""
        if not 1 <= cap <= self.configured_max_num_seqs:
            raise InvalidCommandError(f"max_num_seqs must be between 1 and {self.configured_max_num_seqs} (the "
                                      f"engine's configured batch), got {cap}", "args.max_num_seqs")
        before, self.max_num_seqs = self.max_num_seqs, cap
        return before

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(len(self.waiting), self.max_waiting)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running parent joins the batch directly."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take `seq` out of the scheduler (finished, aborted or expired) and free its pages."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED

    def evacuate(self, pages: set[int]) -> dict[int, int]:
        """Move every sequence's live KV out of `pages` (see BlockManager.evacuate)."""
        return self.blocks.evacuate(pages, [*self.running, *self.waiting])

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        in_step: set[int] = set()

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.in_prefill:
                continue
            if self._make_room(seq, seq.num_tokens, in_step, out):
                self._take(seq, 1, out, in_step)
                budget -= 1

        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.seq_id in in_step:
                continue
            length = min(seq.num_uncomputed, budget, self._fit(seq, in_step, out))
            if length > 0:
                self._take(seq, length, out, in_step)
                budget -= length

        self.admit(budget, out, in_step)
        return out

    def admit(self, budget: int, out: SchedulerOutput, in_step: set[int]) -> None:
        """Rule 3: admit waiting sequences into the step `out` while a slot, `budget` tokens and pages remain."""
        # a step that had to preempt is short of pages: admitting now would only preempt again next step
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if len(self.running) + seq.fork_into > self.max_num_seqs:
                break
            length = min(seq.num_uncomputed, budget, self.blocks.tokens_that_fit(seq))
            if length <= 0:
                self.num_admission_blocked += 1  # a slot and budget wait, the pages do not: memory pressure
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._take(seq, length, out, in_step)
            budget -= length

    def _take(self, seq: Sequence, length: int, out: SchedulerOutput, in_step: set[int]) -> None:
        copies, fresh = self.blocks.reserve(seq, seq.num_computed + length)
        out.copies += copies
        out.fresh_pages += fresh
        out.chunks.append(ScheduledChunk(seq, seq.num_computed, length))
        in_step.add(seq.seq_id)

    def _make_room(self, seq: Sequence, upto: int, in_step: set[int], out: SchedulerOutput) -> bool:
        """Preempt newer sequences until `seq` can write up to `upto`; False if `seq` itself had to go."""
        while self.blocks.pages_needed(seq, upto) > self.blocks.ledger.num_free:
            victim = self._newest_not_in(in_step)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _fit(self, seq: Sequence, in_step: set[int], out: SchedulerOutput) -> int:
        """Tokens of a prefilling `seq` that fit; with none, newer sequences make way for it."""
        while (fit := self.blocks.tokens_that_fit(seq)) == 0:
            victim = self._newest_not_in(in_step)
            if victim is seq:
                return 0  # nothing newer to take from: wait for running sequences to finish
            self._preempt(victim, out)
        return fit

    def _newest_not_in(self, in_step: set[int]) -> Sequence:
        for seq in reversed(self.running):
            if seq.seq_id not in in_step:
                return seq
        raise AssertionError("the sequence being scheduled is running and not yet in the step")

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.preempt(seq)
        out.preempted.append(seq)

    def preempt(self, seq: Sequence) -> None:
        """Recompute later: free a running sequence's pages and put it at the front of the queue."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
