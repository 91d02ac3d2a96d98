"""The commands a simulated executor takes between two steps, as the executor service takes them
(services/executor/commands.py): refused alike, changing nothing, and costing what the cost model says a swap
costs. Mixed into SimExecutor (executor.py).
"""

from services.tools.simulator import costs, joins
from services.tools.simulator.instance import SimulatedRefusal, swap
from shared.core.errors import OutOfPagesError
from shared.core.planner.memory import FULL_BITS
from shared.core.plans import alone_id
from shared.core.roles import refusal, role_of
from shared.core.slots import SwapRefused, next_layers, resize_slots
from shared.errors import InvalidCommandError
from shared.messages import (BatchArgs, CommandArgs, EvictArgs, MigrateArgs, QuantizeArgs, ReplicateArgs, RestoreArgs,
                             TpSplitArgs)


class SimCommands:
    def apply(self, args: CommandArgs) -> tuple[dict, float]:
        """Apply a command between two steps: (the result's state, the seconds it took). Refuses with
        SimulatedRefusal, changing nothing, as the executor would (services/executor/service.py)."""
        self.release_batch()  # its tokens were of the layers' bits until now, and the sequences may move
        plan = self.group.plan if self.group is not None else None
        role = role_of(in_instance=plan is not None, leads=plan is None or plan.leader == self.id,
                       merged=plan is not None and plan.merged)
        if (why := refusal(role, args.kind, self.id, plan.id if plan else None, plan.leader if plan else None)):
            raise SimulatedRefusal(f"{args.kind} refused: {why}")
        if isinstance(args, TpSplitArgs):
            if plan.id != args.instance:
                raise SimulatedRefusal(f"tp_split refused: {self.id} leads instance {plan.id!r}, not {args.instance!r}")
            return self.group.split()
        if isinstance(args, (ReplicateArgs, MigrateArgs, EvictArgs, BatchArgs)):
            return self._instance_command(args)
        if self.group is not None and isinstance(args, (QuantizeArgs, RestoreArgs)):
            return swap(self.group, args)
        if isinstance(args, QuantizeArgs):
            layers = self._next_layers(args.layers, args.bits)
            bits, kind = args.bits, "quantize"
        elif isinstance(args, RestoreArgs):
            layers = self._next_layers(args.layers, FULL_BITS)
            bits, kind = FULL_BITS, "restore"
        else:
            raise SimulatedRefusal(f"{args.kind} refused: {self.id} takes no {args.kind} here")
        self.set_bits(layers, bits)
        return ({"layers": list(self.layer_bits), "changed": layers},
                len(layers) * costs.swap_seconds(self.spec, self.layout, kind, bits))

    def _instance_command(self, args: ReplicateArgs | MigrateArgs | EvictArgs | BatchArgs) -> tuple[dict, float]:
        instance = self.group.plan.id if self.group is not None else (self.plan.id if self.plan else alone_id(self.id))
        if args.instance != instance:
            raise SimulatedRefusal(f"{args.kind} refused: {self.id} leads instance {instance!r}, not {args.instance!r}")
        if isinstance(args, BatchArgs):
            try:
                before = self.scheduler.cap_batch(args.max_num_seqs)
            except InvalidCommandError as exc:
                raise SimulatedRefusal(f"batch refused: {exc}") from exc
            return {"max_num_seqs": args.max_num_seqs, "max_num_seqs_before": before}, 0.0
        if self.group is None:
            raise SimulatedRefusal(f"{args.kind} refused: instance {instance} has one member: nowhere to move "
                                   f"layers to")
        group = self.group
        state, seconds = group.reshape(args)
        if left := joins.part(group):
            state = {**state, "left": left, "plan": group.plan.model_dump()}
        return state, seconds

    def _next_layers(self, layers: int | list[int], bits: int) -> list[int]:
        if isinstance(layers, list):
            return layers
        try:
            return next_layers(self.swap_order, self.layer_bits, FULL_BITS, layers, bits)
        except SwapRefused as exc:
            raise SimulatedRefusal(str(exc)) from exc

    def set_bits(self, layers: list[int], bits: int) -> None:
        """As LayerSwapper.set_bits, without weights: take slot pages back (moving live KV out first), or release
        them."""
        def write(layer: int) -> None:
            self.layer_bits[layer] = bits

        changes = {i: (self._slot(i), self.slot_pages[self.layer_bits[i]], self.slot_pages[bits]) for i in layers}
        try:
            resize_slots(self.ledger, changes, self.scheduler.evacuate, write)
        except OutOfPagesError as exc:
            raise SimulatedRefusal(f"restore refused: {exc.needed} live KV blocks need moving out of the "
                                   f"layers' slots, but only {exc.free} free KV pages are elsewhere") from exc

    def _slot(self, layer: int) -> range:
        size = self.slot_pages[FULL_BITS]
        return range(layer * size, (layer + 1) * size)
