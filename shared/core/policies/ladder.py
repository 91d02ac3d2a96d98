"""The controller's ladder (DESIGN.md, "The controller's ladder"): every lever as one policy on one stream of
cluster states, cheapest first, each rung with its own hysteresis.

The rungs, and the lever (`--levers`) each belongs to:
- quantize: MorphServe's layer swaps (morph.py), on every leader, read from KV usage, queueing delay and the
  executor's pressure events (a preemption, an admission held for KV pages, a refusal), the last acted on
  at once;
- replicate: CoCoServe's scale-down (migrate, evict, cut the batch) and scale-up (replicate onto idle
  members) on instances of several executors (cocoserve.py), read from the SLO violation rate and vacancy;
- tp: AMOEBAs. The merge for a request longer than any instance holds is the gateway's, where the request
  waits (services/gateway/tp_merges.py; `--levers` without tp turns its merges off); the split once
  nothing needs the merge is this policy's (amoebas.py).

Why this order (docs/controller.md has the measured costs): a quantize of one layer costs one slot copy and
frees KV at once (tens of milliseconds here) but some quality; a CoCoServe operation costs no quality but
moves weights and KV between executors and needs an idle peer; a TP merge costs no quality either but
slows every step of the merged instance (0.48x the tokens of two executors alone on this CPU), so it is
kept for the one thing nothing else can do, a request that fits no executor. On an instance more than one
rung could move, they are ordered, not merged:
- under pressure, quantizing comes first: while morph.py takes the pressure it sees (under pressure, with a
  layer left to quantize), CoCoServe's scale-down waits; it acts when quantizing is exhausted, or when the
  violations come with no memory pressure quantizing would answer;
- when pressure ends, the reverse, most expensive first: a merged instance splits before its layers are
  restored (morph.py leaves merged instances alone), and while CoCoServe has steps back to take (a cut batch
  cap, migrated layers), restores wait;
- replicating onto idle capacity (CoCoServe's scale-up) is the last rung and needs neither.
Each rung keeps its own memory; this module only decides, from the state and those memories, which rung may
move an instance this window. Pure like the rungs: `plan` returns the next memory.
"""

import functools
from dataclasses import dataclass, field, replace

from shared.config import LEVERS, ControllerConfig
from shared.core.plans import leads
from shared.core.policies import amoebas, cocoserve, cocoserve_algorithms, morph
from shared.core.policies.interface import PlannedCommand, Policy
from shared.core.speedup import DEFAULT_PROFILE, SpeedupProfile
from shared.messages import ClusterState

NO_SWAPS = morph.MorphSettings(mode="off")


@dataclass(frozen=True)
class LadderMemory:
    swaps: morph.MorphMemory = field(default_factory=morph.MorphMemory)
    operations: cocoserve.CocoMemory = field(default_factory=cocoserve.CocoMemory)


def plan(state: ClusterState, memory: LadderMemory, morph_settings: morph.SettingsSource,
         coco_settings: cocoserve_algorithms.CocoSettings, profile: SpeedupProfile = DEFAULT_PROFILE,
         levers: tuple[str, ...] = LEVERS, split_free_fraction: float | None = 0.5
         ) -> tuple[list[PlannedCommand], LadderMemory]:
    """`split_free_fraction` None: no splits, whatever `levers` says (`--amoebas off`)."""
    if "quantize" not in levers:
        morph_settings = NO_SWAPS
    if "replicate" not in levers:
        coco_settings = replace(coco_settings, mode="off")

    def settings_of(es) -> morph.MorphSettings:
        n = len(es.telemetry.layers)
        return morph_settings(n) if callable(morph_settings) else morph_settings

    quantizing = {es.executor for es in state.executors
                  if es.alive and leads(es) and morph.will_quantize(
                      es, settings_of(es), memory.swaps.executors.get(es.executor, morph.ExecutorMemory()))}
    stepping_back = cocoserve.stepping_back(state, memory.operations)
    splits = amoebas.splits(state, split_free_fraction) if "tp" in levers and split_free_fraction else []
    coco_commands, coco_memory = cocoserve.plan(state, memory.operations, coco_settings, profile, quantizing)
    morph_commands, morph_memory = morph.plan(state, memory.swaps, morph_settings, stepping_back)
    return splits + morph_commands + coco_commands, LadderMemory(morph_memory, coco_memory)


def policies_for(config: ControllerConfig, profile: SpeedupProfile | None = None) -> list[Policy]:
    """The controller's policies: the ladder when a lever `config` allows is on, else none (the process runs
    anyway, so that deployments and the audit trail keep one shape whether or not anything morphs)."""
    active = {"quantize": config.morph_mode != "off", "replicate": config.cocoserve_mode != "off",
              "tp": config.amoebas}
    return [make_policy(profile)] if any(active[lever] for lever in config.levers) else []


def make_policy(profile: SpeedupProfile | None = None) -> Policy:
    """The controller-facing policy: modes, levers and overrides are read from ControllerConfig at each window."""
    memory = LadderMemory()
    costs = profile or DEFAULT_PROFILE

    def ladder_policy(state: ClusterState, history: list[ClusterState],
                      config: ControllerConfig) -> list[PlannedCommand]:
        nonlocal memory
        # Asked of every executor, twice: at a thousand executors, building them each time was a third of a plan.
        settings = functools.cache(lambda num_layers: morph.settings_for_config(config, num_layers))
        commands, memory = plan(state, memory, settings,
                                cocoserve_algorithms.settings_for_config(config), costs, config.levers,
                                config.split_free_fraction if config.amoebas else None)
        return commands

    return ladder_policy
