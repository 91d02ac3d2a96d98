"""An instance of several simulated executors with its layers placed or replicated (CoCoServe): what its plan
does to each member's memory, what its operations do, and what a step of it takes.

Memory is the fabric's (services/executor/fabric/member.py, reshape.py), with the same PageLedger arithmetic:
every member keeps a slot's place for every layer in its arena ("all" slots) but fills only those of the
layers placed on it; a KV block of the instance is a page on every member, so the instance has as many blocks
as the member with the fewest pages outside its slots can back (K), numbered by a ledger of its own whose ids
above K are withdrawn; a member's pages neither in a slot nor backing a block are its `spare_pages`. The
leader's scheduler allocates block ids; each member maps them to pages of its own arena.

An operation (replicate, migrate, evict) applies as reshape.lead does: the plan shared/core/plans.reshaped gives,
the block count the members can back afterwards (refused, with nothing changed, below one longest sequence or
when the live blocks cannot move below it), the replicas each request keeps (fabric/replicas.reassign, whose
KV moves say which rows travel), then per member: slots taken back for the layers it gains (the blocks in
them moved out first) and released for those it loses. Its seconds: costs.operation_seconds. A swap (MorphServe's
quantize or restore, which the leader takes for the instance as a whole) goes the same way with the plan's
`with_bits`: every member holding a layer resizes its slot (`swap`), here and in an instance started at TP.

A step, segment by segment (shared/core/plans.segments), as the fabric runs it:
- layers one member computes: their time at their bits over the whole batch on that member (latency model),
  plus a hop there and one back when that member is not the leader;
- replicated layers: the batch split by fabric/replicas.assign_replicas (a request keeps its replica, a new
  one goes to the least loaded), each replica's rows timed on it, the slowest counting (CoCoServe's Eq. 1),
  plus a scatter and a gather of every other replica's rows (Eq. 2's transfers);
- then the rest of a step on the leader (the speed-up profile's overhead line).
"""

from collections.abc import Callable, Iterable, Iterator

from services.tools.simulator import costs
from services.tools.simulator.decode_batch import DecodeBatch
from services.tools.simulator.replica_rows import ReplicaRows
from shared.core.errors import OutOfPagesError
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import PageLedger
from shared.core.plans import FULL_BITS, OperationRefused, Segment, layers_on, reshaped, segments, with_bits
from shared.core.replicas import assign_replicas, reassign
from shared.core.scheduling.phases import Phases
from shared.core.scheduling.scheduler import ScheduledChunk, Scheduler
from shared.messages import EvictArgs, InstancePlan, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs

Operation = ReplicateArgs | MigrateArgs | EvictArgs


class SimulatedRefusal(Exception):
    """A command the simulated executor refuses as the real one would (nothing changed)."""


def resize(instance, outside: dict[str, int], kind: str) -> tuple[int, int]:
    """Give `instance` (SimInstance, or a SimTpInstance started at TP) the blocks its members can back once each
    has `outside` pages outside its slots (reshape.lead's rule): (blocks before, after). SimulatedRefusal, nothing
    changed, below one longest sequence's blocks, or where the live blocks cannot move below the new count."""
    before, after = instance.num_blocks, min(min(outside.values()), instance.capacity)
    if after < instance.min_blocks:
        short = min(outside, key=outside.get)
        raise SimulatedRefusal(f"{kind} refused: no memory: {short} would back only {after} KV blocks, fewer "
                               f"than one sequence of the longest length needs ({instance.min_blocks})")
    if after < before:
        try:
            instance.scheduler.evacuate(set(range(after, before)))
        except OutOfPagesError as exc:
            raise SimulatedRefusal(f"{kind} refused: no memory: the instance would keep {after} of its "
                                   f"{before} KV blocks, but {exc.needed} live blocks would have to move into "
                                   f"{exc.free} free ones") from exc
        instance.ledger.withdraw(range(after, before))
    elif after > before:
        instance.ledger.reinstate(range(before, after))
    return before, after


def refill(instance, plan: InstancePlan, before: int, after: int) -> None:
    """Every member's slots as `plan` places and sizes them, its pages backing the `after` blocks resize kept,
    and the instance serving `plan`."""
    bits = [layer.bits for layer in plan.layers]
    for name, member in instance.members.items():
        member.unmap_blocks(min(after, before))
        member.hold(layers_on(plan, name), bits)
        member.map_blocks(after)
    instance.adopt(plan)


def swap(instance, args: QuantizeArgs | RestoreArgs) -> tuple[dict, float]:
    """MorphServe's swap taken by `instance` as a whole, as the fabric's leader takes it (reshape.next_plan: the
    plan's `with_bits`, counts front to back): every member holding a layer resizes its slot, and the instance
    keeps the blocks they back afterwards (`resize`). (the result's state, the seconds: the members swap their
    pieces side by side, the slowest counting.) SimulatedRefusal, nothing changed, where it cannot."""
    bits = args.bits if isinstance(args, QuantizeArgs) else FULL_BITS
    try:
        plan = with_bits(instance.plan, args.layers, bits)
    except OperationRefused as exc:
        raise SimulatedRefusal(f"{args.kind} refused: {exc}") from exc
    now = [layer.bits for layer in plan.layers]
    changed = [i for i, (was, layer) in enumerate(zip(instance.plan.layers, plan.layers)) if was.bits != layer.bits]
    outside = {name: m.outside_slots(layers_on(plan, name), now) for name, m in instance.members.items()}
    before, after = resize(instance, outside, args.kind)
    refill(instance, plan, before, after)
    kind = "quantize" if isinstance(args, QuantizeArgs) else "restore"
    seconds = max(sum(costs.swap_seconds(m.spec, m.layout, kind, bits) for i in changed if i in m.held)
                  for m in instance.members.values())
    return {"layers": now, "changed": changed, "blocks_before": before, "blocks_after": after}, seconds


class SimInstance:
    """A TP1 instance of several members (`members`: SimExecutor by name, the plan's leader among them)."""

    def __init__(self, plan: InstancePlan, members: dict):
        self.plan, self.members = plan, members
        self.parts = _parts(plan)
        self.leader = members[plan.leader]
        for name, member in members.items():
            member.hold(layers_on(plan, name), [layer.bits for layer in plan.layers])
        self.capacity = min(m.ledger.num_pages for m in members.values())
        self.min_blocks = self.leader.sequence_blocks()
        blocks = min(self.capacity, *(m.outside_slots() for m in members.values()))
        if blocks < self.min_blocks:
            raise ValueError(f"instance {plan.id}: its members back {blocks} KV blocks, fewer than one sequence of "
                             f"{self.leader.max_model_len} tokens needs ({self.min_blocks})")
        self.ledger = PageLedger(self.capacity)
        self.ledger.withdraw(range(blocks, self.capacity))
        self.blocks = BlockManager(self.ledger, self.leader.limits.block_size)
        limits = self.leader.limits
        self.scheduler = Scheduler(self.blocks, limits.max_num_seqs, limits.max_num_batched_tokens, limits.max_waiting)
        self.sticky: dict[int, dict[str, str]] = {}  # replicated segment -> request id -> replica
        self.joined: set[str] = set()  # members that joined at run time: they leave holding no layer (joins.py)
        for member in members.values():
            member.map_blocks(blocks)
            member.join(self)

    @property
    def num_blocks(self) -> int:
        return self.ledger.num_present

    # --- operations -------------------------------------------------------------------------------
    def reshape(self, op: Operation) -> tuple[dict, float]:
        """Apply `op` between two steps: (the result's state, its seconds). SimulatedRefusal, nothing changed,
        where reshape.lead refuses."""
        try:
            plan = reshaped(self.plan, op)
        except OperationRefused as exc:
            raise SimulatedRefusal(f"{op.kind} refused: {exc}") from exc
        outside = {name: m.outside_slots(layers_on(plan, name)) for name, m in self.members.items()}
        before, after = resize(self, outside, op.kind)
        held = {}
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.block_table:
                held.setdefault(seq.request_id, set()).update(seq.block_table)
        self.sticky, moves = reassign(segments(self.plan), segments(plan), self.sticky, held)
        copied = [(i, name) for i, (was, now) in enumerate(zip(self.plan.layers, plan.layers))
                  for name in now.placement if name not in was.placement]
        refill(self, plan, before, after)
        shape, leader = self.leader.shape, self.leader
        row_bytes = leader.page_bytes // shape.num_layers  # one layer's KV of one block
        nbytes = (sum(leader.slot_pages[plan.layers[i].bits] for i, _ in copied) * leader.page_bytes
                  + sum(len(m.layers) * len(m.blocks) for m in moves) * row_bytes)
        seconds = costs.operation_seconds(leader.spec, op.kind, len(op.span), nbytes)
        return ({"plan": plan.model_dump(), "blocks_before": before, "blocks_after": after,
                 "layers_copied": len(copied), "kv_rows_moved": sum(len(m.layers) * len(m.blocks) for m in moves),
                 "bytes_moved": nbytes}, seconds)

    def adopt(self, plan: InstancePlan) -> None:
        """Serve `plan` from the next step on."""
        self.plan, self.parts = plan, _parts(plan)
        for member in self.members.values():
            member.plan = plan

    def freed_pages(self, member: str) -> int:
        """Slot pages a TP merge's FFN cut freed on `member`: none in a TP1 instance."""
        return 0

    def forget(self, request_id: str) -> None:
        """A request that ended needs no replica any more."""
        for sticky in self.sticky.values():
            sticky.pop(request_id, None)

    # --- a step -----------------------------------------------------------------------------------
    def step_seconds(self, chunks: list[ScheduledChunk]) -> tuple[float, dict[str, float]]:
        """(the step's seconds, each member's computing seconds in it)."""
        def shares() -> Iterator[dict[str, Phases]]:
            whole = costs.phases(chunks)
            for index, (segment, _) in enumerate(self.parts):
                if len(segment.placement) == 1:
                    yield {segment.placement[0]: whole}
                    continue
                owner = self._assigned(index, segment, [(c.seq.request_id, c.length) for c in chunks])
                rows: dict[str, list[ScheduledChunk]] = {m: [] for m in segment.placement}
                for c in chunks:
                    rows[owner[c.seq.request_id]].append(c)
                yield {m: costs.phases(mine) for m, mine in rows.items()}
        return self._step(shares(), sum(c.length for c in chunks))

    def replica_rows(self) -> ReplicaRows:
        """A decode batch's members counted by replica (replica_rows.py), for batch_step_seconds and
        batch_run_timing: none counted where no segment is replicated."""
        return ReplicaRows(self.parts, self.sticky)

    def batch_step_seconds(self, batch: DecodeBatch, phases: Phases, admitted: list[ScheduledChunk]
                           ) -> tuple[float, dict[str, float]]:
        """step_seconds of a decode batch's step, `phases` its own (decode_batch.py) with `admitted` beside its
        decodes: a segment on one member computes all of them; a replicated one's replicas their decodes, counted
        by the batch (ReplicaRows), and the admitted chunks the fabric's rule gives them."""
        tick, counted = batch.tick, batch.rows.counts

        def shares() -> Iterator[dict[str, Phases]]:
            for index, (segment, _) in enumerate(self.parts):
                if len(segment.placement) == 1:
                    yield {segment.placement[0]: phases}
                    continue
                counts = counted[index]
                owner = self._assigned(index, segment, [(c.seq.request_id, c.length) for c in admitted],
                                       {m: decodes for m, (decodes, _) in counts.items()})
                prefills: dict[str, list[int]] = {m: [] for m in segment.placement}
                for c in admitted:
                    prefills[owner[c.seq.request_id]].append(c.length)
                yield {m: (decodes, drift + decodes * (tick + 1), prefills[m])
                       for m, (decodes, drift) in counts.items()}
        return self._step(shares(), phases[0] + sum(phases[2]))

    def _assigned(self, index: int, segment: Segment, rows: list[tuple[str, int]], load: dict[str, int] | None = None
                  ) -> dict[str, str]:
        """The replica of each of `rows` ((request id, tokens)) in replicated segment `index` (assign_replicas,
        `load` its replicas' other rows), kept for the request's later steps."""
        sticky = self.sticky.setdefault(index, {})
        owner = assign_replicas(rows, segment.placement, sticky, load)
        sticky.update(owner)
        return owner

    def _step(self, shares: Iterable[dict[str, Phases]], tokens: int) -> tuple[float, dict[str, float]]:
        """A step of `tokens` whose segments' members compute the rows `shares` gives each of them, segment by
        segment (their phases, costs.phases): (its seconds, each member's computing seconds in it)."""
        leader, spec = self.plan.leader, self.leader.spec
        shape, dtype_bytes = self.leader.shape, spec.dtype_bytes
        busy = dict.fromkeys(self.members, 0.0)
        seconds = 0.0
        for (_, bits), owners in zip(self.parts, shares):
            longest = 0.0
            for name, phased in owners.items():
                compute = sum(layers * costs.phase_seconds(self.members[name].spec, b, *phased) for b, layers in bits)
                busy[name] += compute
                rows = phased[0] + sum(phased[2])
                travel = (2 * costs.hop_seconds(spec, costs.hidden_bytes(shape, dtype_bytes, rows))
                          if name != leader and rows else 0.0)
                longest = max(longest, compute + travel)
            seconds += longest
        seconds += spec.overhead.at(tokens)
        busy[leader] = seconds
        return seconds, busy

    def batch_run_timing(self, batch: DecodeBatch, contexts: int) -> Callable[[int], tuple[float, dict[str, float]]]:
        """decode_timing of a decode batch's run from its tick, its decodes' contexts summing `contexts` at its first
        step: a segment on one member decodes all of them; a replicated one's replicas their decodes, counted by
        the batch (ReplicaRows)."""
        tick, n = batch.tick, len(batch.marks)
        shares = [[(m, decodes, drift + decodes * tick) for m, (decodes, drift) in batch.rows.counts[index].items()]
                  if len(segment.placement) > 1 else [(segment.placement[0], n, contexts - n)]
                  for index, (segment, _) in enumerate(self.parts)]
        return self._decode_steps(shares, n)

    def decode_timing(self, seqs: list, base: list[int]) -> Callable[[int], tuple[float, dict[str, float]]]:
        """step_seconds of a decode run's step-th step (decode_run.py), each of `seqs` at its `base` tokens
        computed plus `step`: the same sums in the same order, to the float, without building each step's chunks.
        A run's sequences keep their replicas (assign_replicas), so who computes which rows is settled at its first
        step, as step_seconds settles it."""
        ids = [seq.request_id for seq in seqs]
        shares = []
        for index, (segment, bits) in enumerate(self.parts):
            if len(segment.placement) == 1:
                owners = {segment.placement[0]: range(len(seqs))}
            else:
                owner = self._assigned(index, segment, [(request_id, 1) for request_id in ids])
                owners = {m: [k for k, request_id in enumerate(ids) if owner[request_id] == m]
                          for m in segment.placement}
            shares.append([(name, len(mine), sum(base[k] for k in mine)) for name, mine in owners.items()])
        return self._decode_steps(shares, len(seqs))

    def _decode_steps(self, shares: list[list[tuple[str, int, int]]], decodes: int
                      ) -> Callable[[int], tuple[float, dict[str, float]]]:
        """The step-th decode step's timing, `shares` saying for every segment who decodes how many of the `decodes`
        and their tokens computed before the run, summed."""
        spec, leader, shape = self.leader.spec, self.plan.leader, self.leader.shape
        hops: dict[int, float] = {}
        parts = []  # per segment, per member: (name, batch, base tokens summed, (layers, decode line) by bits, hops)
        for (_, bits), share in zip(self.parts, shares):
            row = []
            for name, batch, base_tokens in share:
                if name != leader and batch and batch not in hops:
                    hops[batch] = costs.hop_seconds(spec, costs.hidden_bytes(shape, spec.dtype_bytes, batch))
                travel = 2 * hops[batch] if name != leader and batch else 0.0
                latency = self.members[name].spec.latency
                lines = [(layers, latency.decode_line(b, batch)) for b, layers in bits] if batch else []
                row.append((name, batch, base_tokens, lines, travel))
            parts.append(row)
        overhead = spec.overhead.at(decodes)

        def timing(step: int) -> tuple[float, dict[str, float]]:
            busy = dict.fromkeys(self.members, 0.0)
            seconds = 0.0
            for row in parts:
                longest = 0.0
                for name, batch, base_tokens, lines, travel in row:
                    if batch:
                        context = int((base_tokens + batch * (step + 1)) / batch)
                        compute = sum(layers * decode(context) for layers, decode in lines)
                    else:
                        compute = 0.0
                    busy[name] += compute
                    longest = max(longest, compute + travel)
                seconds += longest
            seconds += overhead
            busy[leader] = seconds
            return seconds, busy
        return timing


def _parts(plan: InstancePlan) -> list[tuple[Segment, tuple[tuple[int, int], ...]]]:
    """The plan's segments, each with its layers counted by bits: every step is timed over them."""
    return [(segment, costs.bits_count([plan.layers[i].bits for i in range(segment.start, segment.stop)]))
            for segment in segments(plan)]
