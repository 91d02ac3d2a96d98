"""The controller's ladder: quantizing first under pressure, CoCoServe's scale-down once it is exhausted, and
the reverse when pressure ends (CoCoServe's steps back, then the restores), on one instance of two members."""

from shared.core.plans import FULL_BITS, with_bits
from shared.core.policies import ladder
from shared.core.policies.morph import settings_for_mode
from shared.messages import QuantizeArgs, RestoreArgs
from tests.unit.test_cocoserve_policy import CALM, FAST, VIOLATING, FakeInstance, instance_plan

LAYERS = 8
MORPH = settings_for_mode("default", LAYERS, enter_windows=2, leave_windows=3, min_dwell_s=1.0)
SWAPS = ("quantize", "restore")


class Instance(FakeInstance):
    """FakeInstance whose layers also change bits, reported as an instance's leader reports them."""

    def apply(self, commands):
        for c in commands:
            if isinstance(c.args, (QuantizeArgs, RestoreArgs)):
                bits = c.args.bits if isinstance(c.args, QuantizeArgs) else FULL_BITS
                self.plan = with_bits(self.plan, c.args.layers, bits)
            else:
                super().apply([c])

    def state(self, now, rate, requests=10):
        state = super().state(now, rate, requests)
        for es in state.executors:
            es.telemetry.layers = [layer.bits for layer in self.plan.layers]
        return state


def drive(instance: Instance, memory: ladder.LadderMemory, windows: int, rate: float, used: float, start: float,
          levers=ladder.LEVERS):
    """(the commands of `windows` windows at SLO violation rate `rate`, KV `used` of the leader's blocks)."""
    log, now = [], start
    for _ in range(windows):
        now += 0.2
        instance.used = round(used * instance.blocks())
        commands, memory = ladder.plan(instance.state(now, rate), memory, MORPH, FAST, levers=levers)
        instance.apply(commands)
        log += [c.args.kind for c in commands]
    return log, memory, now


def test_quantizing_comes_first_and_steps_back_come_before_restores():
    instance = Instance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    down, memory, now = drive(instance, ladder.LadderMemory(), 300, VIOLATING, 1.0, 0.0)
    coco = [i for i, kind in enumerate(down) if kind not in SWAPS]
    assert "quantize" in down and coco, down
    assert all(kind == "quantize" for kind in down[:coco[0]]), down  # not one CoCoServe step before
    assert "migrate" in down and "batch" in down
    assert not any(kind in SWAPS for kind in down[coco[0]:]), down  # the swap ladder was at its top

    back, memory, _ = drive(instance, memory, 600, CALM, 0.05, now)
    assert "restore" in back and "batch" in back, back
    first_restore = back.index("restore")
    assert all(kind not in SWAPS for kind in back[:first_restore])
    assert not any(kind in ("batch", "migrate") for kind in back[first_restore:]), back  # they came back first
    assert all(layer.bits == FULL_BITS for layer in instance.plan.layers)
    assert instance.cap == 16 and all(layer.placement[0] == "exec0" for layer in instance.plan.layers)


def test_violations_without_memory_pressure_go_straight_to_cocoserve():
    instance = Instance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    down, _, _ = drive(instance, ladder.LadderMemory(), 100, VIOLATING, 0.2, 0.0)
    assert down and "quantize" not in down and down[0] == "migrate", down


def test_the_levers_limit_the_ladder_to_their_rungs():
    quantize_only = Instance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    down, _, _ = drive(quantize_only, ladder.LadderMemory(), 300, VIOLATING, 1.0, 0.0, levers=("quantize",))
    assert "quantize" in down and set(down) <= set(SWAPS), down
    replicate_only = Instance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    down, _, _ = drive(replicate_only, ladder.LadderMemory(), 300, VIOLATING, 1.0, 0.0, levers=("replicate", "tp"))
    assert "migrate" in down and not set(down) & set(SWAPS), down
    idle = Instance(instance_plan(["exec0", "exec1"], [["exec0"]] * LAYERS))
    assert drive(idle, ladder.LadderMemory(), 300, VIOLATING, 1.0, 0.0, levers=())[0] == []
