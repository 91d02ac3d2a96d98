"""One step of a batch whose running sequences all decode, walked once a sequence, with the waiting queue's
heads admitted beside it.

At saturation nearly every step admits: a sequence finishes, a waiting one takes its slot, and its prefill rides
with the batch's decodes. Decode runs (decode_run.py) end there, and the scheduler's step walks every decode four
times (its two passes, the cost model's and the step's end): at a thousand executors that per-token work was
most of the simulator's time. When every running sequence decodes one token and the pages its tokens open are
free, the scheduler's first rule preempts nobody and its second finds nothing to do: the step is every running
sequence, the ones whose token opens a block taking a page in the batch's order, then the waiting sequences its
third rule admits (Scheduler.admit, the scheduler's own). That is this step, built in one pass over the batch
and timed from its phases (costs.phased_step_seconds); the executor's finish_step ends its decodes in one more.

Exactly the step the scheduler would make, to the page id and the float: tests/unit/test_decode_step.py holds it
to the scheduler's step on the same state, and tests/unit/test_decode_runs.py replays single steps beside it. As
there, no simulated sequence forks, so no block is shared and a decode's pages are the block its token opens, or
none.
"""

from dataclasses import dataclass

from services.executor.engine.memory.block_manager import BlockManager
from services.executor.engine.scheduling.scheduler import Scheduler, SchedulerOutput
from services.executor.engine.scheduling.sequence import Sequence, Status


@dataclass
class DecodeStep:
    decodes: list[Sequence]  # every running sequence, in the batch's order: one token each
    context: int  # the sum of their contexts, the token of this step included (costs.phases)
    admitted: SchedulerOutput  # the chunks of the waiting sequences admitted into the step

    def phases(self) -> tuple[int, int, list[int]]:
        """costs.phases of the step: its decodes and their contexts, then its admissions, every one a prefill
        chunk (a waiting sequence starts again from its first token)."""
        return len(self.decodes), self.context, [c.length for c in self.admitted.chunks]


def plan_step(scheduler: Scheduler, blocks: BlockManager) -> DecodeStep | None:
    """The scheduler's next step when every running sequence decodes and the pages they open are free, its pages
    reserved and its admissions made; None when the scheduler's own step would differ (a sequence in prefill,
    a batch over the token budget, a preemption), which the caller then takes."""
    running = scheduler.running
    if not running or len(running) > scheduler.max_num_batched_tokens:
        return None
    size, context, opening = blocks.block_size, 0, []
    for seq in running:
        computed, outputs = seq.num_computed, len(seq.output_ids)
        if not outputs or len(seq.prompt_ids) + outputs - computed != 1 or seq.status is not Status.RUNNING:
            return None
        context += computed + 1
        if computed >= len(seq.block_table) * size:
            opening.append(seq)
    if len(opening) > blocks.ledger.num_free:
        return None
    for seq in opening:
        blocks.reserve(seq, seq.num_computed + 1)
    decodes, admitted = list(running), SchedulerOutput()
    scheduler.admit(scheduler.max_num_batched_tokens - len(decodes), admitted, set())
    return DecodeStep(decodes, context, admitted)
