"""A decode-only batch advanced many steps at once, to exactly where single steps would have taken it.

At a thousand executors, steps were two thirds of the event loop: one event, one pass of the scheduler and one
of the cost model per step, 25-75 ms of simulated time each. Yet most steps are foreseeable. When every
running sequence decodes and nobody can join (the queue is empty, or the batch is at its cap), the scheduler's
next steps (shared/core/scheduling/scheduler.py, rule 1) are known ahead: the same sequences, one token each, a
fresh page for a sequence whose next token opens a block. That holds until a sequence finishes, or the free
pages run short (the scheduler would preempt). Such a run is planned at once, its steps timed by the cost
model, and it is one event: its end.

The executor advances it lazily (executor.py, `settle`): whatever reads the executor first settles the steps
begun and ended by then, and whatever changes what the next step would schedule (an arrival, a command, a
cancel) cuts the run after the step in flight. Settled, the executor holds what single steps would have left
it, to the page id and the float: tests/unit/test_decode_runs.py replays both side by side.

An instance's leader runs too (CoCoServe's placements and replicas, a TP merge): each step is timed by the
instance's step model with its replicas' assignment, and marks the other members busy for their parts as it
begins. The members step nothing of their own: a request that reaches one is refused (executor.py, `admit`).

A decode batch (decode_batch.py) runs the same way without a walk over its sequences (`plan_batch_run`): it
knows where each member opens a block and ends, so its run is planned from those, its steps settled by the
batch's own (`DecodeBatch.open_blocks`, `end_step`), its tokens written when anything reads its sequences.

Simulated sequences never fork (every request is n=1), so no block is shared and copy-on-write cannot arise:
a decode's pages are the block its next token opens, or none.
"""

import bisect
from collections.abc import Callable
from dataclasses import dataclass

from services.tools.simulator.decode_batch import DecodeBatch
from shared.core.memory.block_manager import BlockManager
from shared.core.scheduling.scheduler import Scheduler
from shared.core.scheduling.sequence import Sequence, Status

MAX_RUN_STEPS = 64  # what a cut may throw away: the steps past it are timed for nothing


@dataclass
class DecodeRun:
    seqs: list[Sequence]  # the batch, in the scheduler's order
    base: list[int]  # each one's num_computed when the run began
    began: float
    ends: list[float]  # each step's end; a step begins where the one before it ended
    parts: list[dict[str, float]]  # in an instance of several executors: each member's computing seconds a step
    pages: list[tuple[int, int]]  # (step, the sequence's index): a decode that opens a block, in allocation order
    batch: DecodeBatch | None = None  # a decode batch's run: its steps are the batch's from `tick` on, no pages here
    tick: int = 0
    started: int = 0  # steps whose pages are reserved and whose busy span has begun
    finished: int = 0  # steps whose tokens are out
    reserved: int = 0  # of `pages`

    def start_of(self, step: int) -> float:
        return self.began if step == 0 else self.ends[step - 1]

    def begun_by(self, now: float) -> int:
        """How many of its steps have begun by `now`."""
        if now < self.began:
            return 0
        return 1 + bisect.bisect_right(self.ends, now, 0, len(self.ends) - 1)

    def cut(self) -> bool:
        """End the run with the step in flight (settled: every earlier one has finished); False when that was its
        last step already."""
        last = self.finished + 1
        if last >= len(self.ends):
            return False
        del self.ends[last:]
        del self.parts[last:]
        self.pages = [(step, i) for step, i in self.pages if step < last]
        return True


def head_joins(scheduler: Scheduler) -> bool:
    """Whether the waiting queue's head fits the batch's cap: the next step admits it where pages allow."""
    waiting = scheduler.waiting
    return bool(waiting) and len(scheduler.running) + waiting[0].fork_into <= scheduler.max_num_seqs


def steady(scheduler: Scheduler) -> bool:
    """Whether the scheduler's next step is every running sequence decoding one token and nothing else: none
    in prefill, none waiting that a free slot would let in, the batch inside the step's token budget."""
    running = scheduler.running
    if not running or len(running) > scheduler.max_num_batched_tokens:
        return False
    if head_joins(scheduler):
        return False
    return all(seq.status is Status.RUNNING and seq.num_uncomputed == 1 and seq.output_ids for seq in running)


def plan_run(scheduler: Scheduler, blocks: BlockManager, max_model_len: int, now: float,
             timing: Callable[[list[Sequence], list[int]], Callable[[int], tuple[float, dict[str, float]]]]
             ) -> DecodeRun | None:
    """The run of decode steps the scheduler would make from `now`, or None when its next step is not one.

    `timing(seqs, base)(step)`: the seconds of the run's step-th step, each sequence at its `base` tokens
    computed plus `step`, and the members' parts of it in an instance (executor.py, `_run_timing`). The run ends
    with the step in which the first sequence finishes, and before the step whose pages are not free.
    """
    if not steady(scheduler):
        return None
    seqs, size = list(scheduler.running), blocks.block_size
    steps = min(MAX_RUN_STEPS, *(min(s.params.max_tokens - len(s.output_ids), max_model_len - s.num_tokens)
                                 for s in seqs))
    # A decode at step i writes position num_computed + i; it takes a page when that opens a block beyond its table.
    pages = sorted((step, i) for i, s in enumerate(seqs)
                   for step in range(len(s.block_table) * size - s.num_computed, steps, size))
    free = blocks.ledger.num_free
    if len(pages) > free:  # the scheduler would preempt in that step: the run stops before it
        steps = pages[free][0]
        pages = [page for page in pages if page[0] < steps]
    if steps < 1:
        return None
    base = [s.num_computed for s in seqs]
    ends, parts = _timed(timing(seqs, base), steps, now)
    return DecodeRun(seqs, base, now, ends, parts, pages)


def _timed(step_seconds: Callable[[int], tuple[float, dict[str, float]]], steps: int, now: float
           ) -> tuple[list[float], list[dict[str, float]]]:
    """A run's `steps` steps from `now`, back to back: each one's end and its members' parts."""
    ends, parts, end = [], [], now
    for step in range(steps):
        seconds, part = step_seconds(step)
        end += seconds
        ends.append(end)
        parts.append(part)
    return ends, parts


def plan_batch_run(batch: DecodeBatch, now: float,
                   timing: Callable[[int, int], Callable[[int], tuple[float, dict[str, float]]]]) -> DecodeRun | None:
    """plan_run for a decode batch (decode_batch.py), from what it keeps of its members rather than a walk over
    them: a member opens a block every block_size steps, at a step within block_size of the batch's, so the pages
    a run's steps take repeat with that period.

    `timing(batch, contexts)(step)`: the seconds of the run's step-th step of `batch` sequences whose contexts
    summed `contexts` at its first, and the members' parts of it in an instance (executor.py, `_batch_timing`)."""
    scheduler = batch.scheduler
    if not batch.decodes_all() or head_joins(scheduler):
        return None
    t, size, n = batch.tick, batch.blocks.block_size, len(batch.marks)
    steps = min(MAX_RUN_STEPS, batch.end_ticks[0] - t + 1)
    free = batch.blocks.ledger.num_free
    if free < n * -(-steps // size):  # else pages for a block each member every block_size steps: they fit
        opening = [len(batch.opening(t + step)) for step in range(min(size, steps))]
        for step in range(steps):
            free -= opening[step % size]
            if free < 0:  # the scheduler would preempt in that step: the run stops before it
                steps = step
                break
    if steps < 1:
        return None
    ends, parts = _timed(timing(n, batch.offset + n * (t + 1)), steps, now)
    return DecodeRun([], [], now, ends, parts, [], batch, t)
