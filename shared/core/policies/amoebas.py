"""AMOEBAs' split (§3.3): a TP instance the gateway merged for long requests splits back into executors serving
alone once nothing it runs needs it merged and `split_free_fraction` of its KV is free (the gateway stops
sending it new requests from the moment nothing needs it merged). Splitting takes the KV home first, then
refills the FFN shards from the host variants; running requests keep their tokens (fabric/transform.py).

The merges themselves are the gateway's (services/gateway/tp_merges.py): a request waits for one only there.
"""

from shared.core.policies.interface import PlannedCommand
from shared.core.tp_scheduler import capacity, instances_from, split_due
from shared.messages import ClusterState, TpSplitArgs


def splits(state: ClusterState, split_free_fraction: float) -> list[PlannedCommand]:
    """Pure: a split for every merged instance that nothing needs merged any more."""
    if not any(e.telemetry.plan is not None and e.telemetry.plan.merged for e in state.executors):
        return []  # most states have no merge, and reading every instance of a thousand executors costs
    planned = []
    holds = {e.executor: e.telemetry.merge_hold_s for e in state.executors}
    for instance in instances_from(state, None, split_free_fraction):
        leader = instance.members[0].executor
        if not instance.merged or holds.get(leader, 0.0) > 0:
            continue
        if split_due(instance, split_free_fraction) != "split":
            continue
        total = instance.blocks_free + instance.blocks_used
        alone = min(capacity((m,), instance.kv_heads) for m in instance.members)
        planned.append(PlannedCommand(
            leader, TpSplitArgs(instance=instance.id),
            f"AMOEBAs: its longest sequence takes {instance.longest} KV blocks, which each member holds alone "
            f"({alone}), and {instance.blocks_free} of its {total} blocks are free",
            {"longest_blocks": instance.longest, "alone_blocks": alone, "blocks_free": instance.blocks_free,
             "blocks": total}))
    return planned
