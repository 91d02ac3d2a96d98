"""The controller's ladder (DESIGN.md, "The controller's ladder"): MorphServe's swaps (morph.py) and
CoCoServe's operations (cocoserve.py) as one policy, cheapest first, each rung with its own hysteresis.

Both rungs read their own signals: morph.py the KV and the queue (memory pressure), cocoserve.py the SLO
violation rate. On an instance both can act on, they are ordered, not merged:
- under pressure, quantizing comes first: while morph.py takes the pressure it sees (under pressure, with a
  layer left to quantize), CoCoServe's scale-down waits; it acts when quantizing is exhausted, or when the
  violations come with no memory pressure quantizing would answer;
- when pressure ends, the reverse: while CoCoServe has steps back to take (a cut batch cap, migrated
  layers), restores wait;
- replicating onto idle capacity (CoCoServe's scale-up) is the last rung and needs neither.
Each rung keeps its own memory; this module only decides, from the state and those memories, which rung may
move an instance this window. Pure like the rungs: `plan` returns the next memory.
"""

from dataclasses import dataclass, field

from services.controller.policies import cocoserve, cocoserve_algorithms, morph
from services.controller.policies.interface import PlannedCommand, Policy
from shared.config import ControllerConfig
from shared.messages import ClusterState
from shared.plans import leads
from shared.speedup import DEFAULT_PROFILE, SpeedupProfile


@dataclass(frozen=True)
class LadderMemory:
    swaps: morph.MorphMemory = field(default_factory=morph.MorphMemory)
    operations: cocoserve.CocoMemory = field(default_factory=cocoserve.CocoMemory)


def plan(state: ClusterState, memory: LadderMemory, morph_settings: morph.SettingsSource,
         coco_settings: cocoserve_algorithms.CocoSettings, profile: SpeedupProfile = DEFAULT_PROFILE
         ) -> tuple[list[PlannedCommand], LadderMemory]:
    def settings_of(es) -> morph.MorphSettings:
        n = len(es.telemetry.layers)
        return morph_settings(n) if callable(morph_settings) else morph_settings

    quantizing = {es.executor for es in state.executors
                  if es.alive and leads(es) and morph.will_quantize(es, settings_of(es))}
    stepping_back = cocoserve.stepping_back(state, memory.operations)
    coco_commands, coco_memory = cocoserve.plan(state, memory.operations, coco_settings, profile, quantizing)
    morph_commands, morph_memory = morph.plan(state, memory.swaps, morph_settings, stepping_back)
    return morph_commands + coco_commands, LadderMemory(morph_memory, coco_memory)


def make_policy(profile: SpeedupProfile | None = None) -> Policy:
    """The controller-facing policy: modes and overrides are read from ControllerConfig at each window."""
    memory = LadderMemory()
    costs = profile or DEFAULT_PROFILE

    def ladder_policy(state: ClusterState, history: list[ClusterState],
                      config: ControllerConfig) -> list[PlannedCommand]:
        nonlocal memory
        commands, memory = plan(state, memory, lambda n: morph.settings_for_config(config, n),
                                cocoserve_algorithms.settings_for_config(config), costs)
        return commands

    return ladder_policy
