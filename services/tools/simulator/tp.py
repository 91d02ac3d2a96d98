"""AMOEBAs' runtime merge of simulated executors serving alone into one TP instance, and its split back
(services/executor/fabric/transform.py, merge.py), with the running requests keeping their tokens and KV; and
the TP instances `up --tp` starts (`started`), each member's arena laid out as its shard of every layer
(`member_shape`, fabric/shards.py), which swap as a whole (instance.py's `swap`) and do not split.

Memory, as the fabric counts it: a member of a TP-k instance keeps its 1/k of every layer's FFN where it lies,
and the slot pages none of it touches become KV pages (merge.py: one page a layer stays shared by a kept and a
dropped piece); KV is stored by head unit, a page holding one unit per KV head, so a member's units are its
KV pages and those freed times the KV heads (merge.kv_units), and the instance holds
shared/tp_scheduler.capacity blocks: the fewest any member backs with the heads it stores per block. A merge
whose live blocks do not fit is refused by every member alike, with nothing changed.

The merged instance numbers its blocks with a ledger of its own; every sequence of every member moves into the
leader's scheduler with a block table in those ids. The split gives each sequence back to the member it came
from (one that arrived merged to the member with the fewest blocks so far), refused when a member's arena
cannot back them. Seconds: costs.operation_seconds over the model's layers and the KV heads that move.

A step of the merged instance: each layer at 1/k of its time on one executor (its FFN and heads split k ways)
plus two all-reduces of the batch's hidden states (after o_proj and after down_proj), each from the speed-up
profile's all-reduce line (a hop where it has none); then the rest of a step on the leader.
"""

import functools
from collections.abc import Callable
from dataclasses import replace

from services.executor.fabric.shards import ffn_shard, head_shards
from services.tools.simulator import costs
from services.tools.simulator.instance import SimulatedRefusal
from shared.core.memory.block_manager import BlockManager
from shared.core.memory.ledger import PageLedger
from shared.core.planner.memory import weight_bytes
from shared.core.planner.shapes import ModelShape
from shared.core.plans import alone, reshaped
from shared.core.scheduling.scheduler import ScheduledChunk, Scheduler
from shared.core.tp_scheduler import MAX_TP, Member, capacity, world_allows
from shared.messages import InstancePlan, LayerPlan, TpMergeArgs


class SimulatedTpRefusal(SimulatedRefusal):
    """A merge or split every member refuses alike; nothing changed."""


def member_shape(shape: ModelShape, tp: int, rank: int) -> ModelShape:
    """The layers member `rank` of an instance started at TP `tp` holds, as its checkpoint view gives them
    (fabric/shards.py): its query and KV heads and its FFN pieces, padded as the engine pads them."""
    if tp == 1:
        return shape
    heads = head_shards(shape.num_heads, shape.num_kv_heads, tp)[rank]
    real, width = ffn_shard(shape.intermediate_size, tp, rank)
    return replace(shape, num_heads=len(heads.q), num_kv_heads=len(heads.kv), intermediate_size=width * len(real))


def started(plan: InstancePlan, members: dict, laid_out: dict) -> "SimTpInstance":
    """An instance `up --tp` starts, its members (SimExecutor by name) laid out as their shards: as many blocks as
    the member with the fewest free pages backs (fabric/member.py's _agree_on_blocks), which must hold one
    sequence of the longest length. `laid_out`: the fleet's arenas laid out (SimExecutor's `arenas`), and the
    empty ledgers of block ids and members' arenas backing them made before (a thousand-executor fleet starts
    hundreds alike: each is a copy of the first)."""
    blocks = min(member.ledger.num_free for member in members.values())
    leader = members[plan.leader]
    need = leader.sequence_blocks()
    if blocks < need:
        raise ValueError(f"instance {plan.id}: its members back {blocks} KV blocks; one sequence of "
                         f"{leader.max_model_len} tokens needs {need}")
    capacity = min(member.ledger.num_pages for member in members.values())
    if (capacity, blocks) not in laid_out:
        laid_out[capacity, blocks] = PageLedger(capacity)
        laid_out[capacity, blocks].withdraw(range(blocks, capacity))
    for member in members.values():  # before the instance, which keeps their own schedulers for a split
        member.back_first_blocks(blocks, laid_out)
    return SimTpInstance(plan, members, blocks, dict.fromkeys(members, 0), hold_until=0.0, min_blocks=need,
                         ledger=laid_out[capacity, blocks].copy())


def ffn_pages_freed(executor, tp: int) -> int:
    """Slot pages a TP-`tp` cut frees on `executor`: per held layer, the FFN pieces it drops, less the page
    a kept and a dropped piece share."""
    if tp < 2:
        return 0
    return sum(_ffn_pages_freed_per_layer(executor.shape, executor.layer_bits[i], executor.spec.dtype_bytes,
                                          executor.page_bytes, tp) for i in executor.held)


@functools.cache
def _ffn_pages_freed_per_layer(shape: ModelShape, bits: int, dtype_bytes: int, page_bytes: int, tp: int) -> int:
    # Every telemetry report asks (merge.kv_units at each TP degree): weighing a layer each time was most of
    # a thousand-executor simulation.
    ffn_share = 3 * shape.hidden_size * shape.intermediate_size / shape.layer_params
    dropped = weight_bytes(shape, bits, dtype_bytes) * ffn_share * (tp - 1) / tp
    return max(0, int(dropped // page_bytes) - 1)


class SimTpInstance:
    def __init__(self, plan: InstancePlan, members: dict, blocks: int, freed: dict[str, int], hold_until: float,
                 min_blocks: int = 0, ledger: PageLedger | None = None):
        """An instance `started` has its block ids' `ledger`, whose ids above `blocks` are withdrawn till a swap
        frees the slot pages to back them, and `min_blocks`, the fewest a swap may leave it; a merge has `blocks`
        for good."""
        self.plan, self.members, self.leader = plan, members, members[plan.leader]
        self.freed = freed
        self.ledger = ledger or PageLedger(blocks)
        self.capacity, self.min_blocks = self.ledger.num_pages, min_blocks
        self.blocks = BlockManager(self.ledger, self.leader.limits.block_size)
        limits = self.leader.limits
        self.scheduler = Scheduler(self.blocks, self.leader.scheduler.max_num_seqs, limits.max_num_batched_tokens,
                                   limits.max_waiting)
        self.alone = {name: (m.scheduler, m.blocks) for name, m in members.items()}
        self.origin: dict[str, str] = {}  # request id -> the member it came from
        for name, member in members.items():
            for seq in member.scheduler.running:
                self._adopt(seq, member.blocks, self.blocks)
                self.scheduler.running.append(seq)
                self.origin[seq.request_id] = name
            for seq in member.scheduler.waiting:
                self._adopt(seq, member.blocks, self.blocks)
                self.scheduler.waiting.append(seq)
                self.origin[seq.request_id] = name
            member.scheduler.running.clear()
            member.scheduler.waiting.clear()
            if member is not self.leader:
                self.leader.requests.update(member.requests)
                member.requests.clear()
                member.longest = self.leader.longest = None
        self.scheduler.waiting = type(self.scheduler.waiting)(sorted(self.scheduler.waiting,
                                                                     key=lambda s: s.arrival_time))
        for member in members.values():
            member.join(self)
        self.leader.hold_until = hold_until

    @property
    def num_blocks(self) -> int:
        return self.ledger.num_present

    @staticmethod
    def _adopt(seq, source: BlockManager, target: BlockManager) -> None:
        """Give `seq` the same number of blocks in `target`, freeing those it had in `source`."""
        count = len(seq.block_table)
        source.free(seq)
        seq.block_table = target.ledger.allocate_many(count)

    def freed_pages(self, member: str) -> int:
        return self.freed[member]

    def adopt(self, plan: InstancePlan) -> None:
        """Serve `plan` from the next step on (its layers' bits after a swap)."""
        self.plan = plan
        for member in self.members.values():
            member.plan = plan

    def forget(self, request_id: str) -> None:
        self.origin.pop(request_id, None)

    def reshape(self, op) -> tuple[dict, float]:
        reshaped(self.plan, op)  # refuses a TP instance's layer operations (OperationRefused)
        raise AssertionError("shared.core.plans.reshaped accepted an operation on a TP instance")

    def step_seconds(self, chunks: list[ScheduledChunk]) -> tuple[float, dict[str, float]]:
        return self.phased_step_seconds(*costs.phases(chunks))

    def phased_step_seconds(self, decodes: int, context: int, prefills: list[int]) -> tuple[float, dict[str, float]]:
        """step_seconds of a step given as its phases (costs.phases): a decode batch's (decode_batch.py)."""
        spec, k, tokens = self.leader.spec, self.plan.tp, decodes + sum(prefills)
        reduce = costs.all_reduce_seconds(spec, costs.hidden_bytes(self.leader.shape, spec.dtype_bytes, tokens))
        seconds = sum(layers * (costs.phase_seconds(spec, bits, decodes, context, prefills) / k + 2 * reduce)
                      for bits, layers in costs.bits_count([layer.bits for layer in self.plan.layers]))
        seconds += spec.overhead.at(tokens)
        return seconds, dict.fromkeys(self.members, seconds)

    def replica_rows(self) -> None:
        """None: every member computes its share of every row, so that a step's phases time it."""
        return None

    def batch_step_seconds(self, batch, phases: tuple[int, int, list[int]], admitted: list
                           ) -> tuple[float, dict[str, float]]:
        """step_seconds of a decode batch's step, given as its phases (decode_batch.py)."""
        return self.phased_step_seconds(*phases)

    def batch_run_timing(self, batch, contexts: int) -> Callable[[int], tuple[float, dict[str, float]]]:
        """batch_timing of a decode batch's run whose decodes' contexts summed `contexts` at its first step."""
        return self.batch_timing(len(batch.marks), contexts)

    def decode_timing(self, seqs: list, base: list[int]) -> Callable[[int], tuple[float, dict[str, float]]]:
        """step_seconds of a decode run's step-th step (decode_run.py), each of `seqs` at its `base` tokens computed
        plus `step`."""
        return self.batch_timing(len(seqs), sum(base) + len(seqs))

    def batch_timing(self, batch: int, contexts: int) -> Callable[[int], tuple[float, dict[str, float]]]:
        """step_seconds of a decode run's step-th step of `batch` sequences whose contexts summed `contexts` at its
        first: the same sums in the same order, to the float, by the mean context alone (building each step's
        chunks was most of a thousand-executor 70B fleet's steps)."""
        spec, k = self.leader.spec, self.plan.tp
        reduce = costs.all_reduce_seconds(spec, costs.hidden_bytes(self.leader.shape, spec.dtype_bytes, batch))
        lines = [(layers, spec.latency.decode_line(bits, batch))
                 for bits, layers in costs.bits_count([layer.bits for layer in self.plan.layers])]
        overhead = spec.overhead.at(batch)

        def timing(step: int) -> tuple[float, dict[str, float]]:
            context = int((contexts + batch * step) / batch)
            seconds = sum(layers * (decode(context) / k + 2 * reduce) for layers, decode in lines)
            seconds += overhead
            return seconds, dict.fromkeys(self.members, seconds)
        return timing

    # --- the split --------------------------------------------------------------------------------
    def split(self) -> tuple[dict, float]:
        """Back to executors serving alone; SimulatedTpRefusal, nothing changed, where a member cannot back the
        KV it takes back."""
        homes: dict[str, list] = {name: [] for name in self.members}
        load = dict.fromkeys(self.members, 0)
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            home = self.origin.get(seq.request_id) or min(self.members, key=lambda m: (load[m], m))
            homes[home].append(seq)
            load[home] += len(seq.block_table)
        for name, seqs in homes.items():
            free = self.alone[name][1].ledger.num_free
            if load[name] > free:
                raise SimulatedTpRefusal(f"tp_split refused: {name} would take back {load[name]} KV blocks and has "
                                         f"{free} free pages")
        moved = sum(load[name] for name in self.members if name != self.plan.leader)
        running = set(map(id, self.scheduler.running))
        for name, member in self.members.items():
            scheduler, blocks = self.alone[name]
            for seq in homes[name]:
                self._adopt(seq, self.blocks, blocks)
                (scheduler.running if id(seq) in running else scheduler.waiting).append(seq)
                if member is not self.leader:
                    member.requests[seq.request_id] = self.leader.requests.pop(seq.request_id)
                    member.longest = self.leader.longest = None
            member.scheduler, member.blocks = scheduler, blocks
            member.group, member.plan = None, alone(name, len(self.plan.layers), self.plan.layers[0].bits)
            member.hold_until = 0.0
        nbytes = moved * self.leader.page_bytes
        seconds = costs.operation_seconds(self.leader.spec, "tp_split", len(self.plan.layers), nbytes)
        return {"plan": None, "blocks_kept": {n: load[n] for n in self.members}}, seconds


def merge(members: dict, args: TpMergeArgs, now: float) -> tuple[SimTpInstance, dict, float]:
    """Merge `members` (SimExecutor by name, in args.executors order) as every one of them takes the command:
    (the instance, the result's state, the seconds). SimulatedTpRefusal, nothing changed, where they refuse."""
    names = list(args.executors)
    for name in names:
        member = members[name]
        if member.group is not None:
            raise SimulatedTpRefusal(f"tp_merge refused: {name} is already in instance {member.group.plan.id}: only "
                                     f"executors serving alone merge")
        if len(member.world) < 2:
            raise SimulatedTpRefusal(f"tp_merge refused: {name} is in no world of executors: it has nobody to merge "
                                     f"with")
        if len(set(names)) != len(names) or len(names) not in (2, MAX_TP) or not world_allows(member.world, names):
            raise SimulatedTpRefusal(f"tp_merge refused: executors {names} cannot form one instance in this world "
                                     f"({member.world})")
    tp = len(names)
    leader = members[names[0]]
    for name in names:  # the sequences move to the leader's instance
        members[name].release_batch()
    units = tuple(Member(n, {u.tp: u.units for u in members[n].kv_units()}) for n in names)
    blocks = capacity(units, leader.shape.num_kv_heads)
    live = sum(members[n].ledger.snapshot().pages_kv_used for n in names)
    if live > blocks:
        raise SimulatedTpRefusal(f"tp_merge refused: the members' {live} live KV blocks do not fit the {blocks} "
                                 f"blocks of the merged instance")
    plan = InstancePlan(id=args.instance, leader=names[0], members=names, tp=tp, merged=True,
                        layers=[LayerPlan(placement=names, bits=b) for b in leader.layer_bits])
    freed = {n: ffn_pages_freed(members[n], tp) for n in names}
    instance = SimTpInstance(plan, {n: members[n] for n in names}, blocks, freed, now + args.hold_s)
    nbytes = live * leader.page_bytes * (tp - 1) / tp  # the heads each member no longer stores
    seconds = costs.operation_seconds(leader.spec, "tp_merge", len(plan.layers), nbytes)
    return instance, {"plan": plan.model_dump(), "blocks": blocks, "live_blocks": live}, seconds
