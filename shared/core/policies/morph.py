"""The first rung of the controller's ladder: MorphServe's quantized layer swapping (DESIGN.md).

Under pressure the policy quantizes the next `step` decoder layers in the swap order, so that the
executor turns the freed slot tails into KV pages; when pressure is over it restores them, most
recently quantized first. The ladder, for swap order o and bits_order (8, 4):

    o[0]→8, o[1]→8, ... until max_layers are quantized, then o[0]→4, o[1]→4, ...

and down again in exactly the reverse order (a restore always returns a layer to full precision).

Where each executor stands on the ladder is read from its telemetry (`layers`, bits per layer),
never from what this policy believes it sent: the controller drops plans for busy executors and
commands can fail, so only the executor knows. What telemetry cannot tell is kept in `MorphMemory`,
passed in and returned by the pure `plan`: the hysteresis runs per executor and the pages one
quantized layer freed (learned from `pages_extension`), which says how many pages a restore takes
back. `make_policy` wraps `plan` in the controller's Policy signature and keeps the memory in a
closure; the controller's history is not replayed because the memory is that history, condensed.

Pressure, calm and the release test are written out in docs/controller.md ("The quantize rung's marks"), and
when a queue is this rung's to answer ("When fewer bits are slower"): KV short is answered by the pages it frees;
a queue with KV to spare only where the executor's latency profile says fewer bits are faster (`step_for`).

Every leader morphs its instance: an executor alone swaps its own layers, the leader of an instance of
several executors has every member that holds a layer swap it (services/executor/fabric/reshape.py), and its
telemetry reports the plan's bits. How this rung and CoCoServe's share an instance is ladder.py's.
"""

import functools
import math
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType

from shared.config import ControllerConfig
from shared.core.hysteresis import HysteresisParams, HysteresisState, advance, interrupted
from shared.core.plans import leads
from shared.core.policies.interface import PlannedCommand, Policy, updated
from shared.messages import ClusterState, ExecutorState, ExecutorTelemetry, QuantizeArgs, RestoreArgs, pressure_since

MODES = ("off", "accuracy", "default", "performance")
QUANT_BITS = (8, 4)
REFERENCE_DEPTH = 32  # the presets' step and max_layers are for a 32-layer model


def is_quantized(bits: int) -> bool:
    return bits <= 8  # full precision reports 16 or 32


@dataclass(frozen=True)
class MorphSettings:
    mode: str = "default"
    kv_high: float = 0.90  # smoothed used / total KV pages
    kv_low: float = 0.75  # of the capacity left after the next restore
    queue_delay_high_s: float = 1.0
    queue_delay_low_s: float = 0.25
    enter_windows: int = 3  # k: consecutive pressure windows (cluster states) per quantize step
    leave_windows: int = 10  # m: consecutive calm windows per restore step
    min_dwell_s: float = 10.0  # no restore sooner than this after a quantize
    step: int = 2  # layers per command
    max_layers: int = 8  # layers quantized at most, counting every quantized layer
    bits_order: tuple[int, ...] = (8, 4)
    release_margin: float = 0.10  # headroom the KV in use must keep after a restore
    swap_order: tuple[int, ...] | None = None  # overrides the executor's own (its LIS profile); None: the executor's

    def __post_init__(self) -> None:
        if self.swap_order is not None:  # lists come from JSON and CLIs; keep the dataclass hashable
            object.__setattr__(self, "swap_order", tuple(int(i) for i in self.swap_order))
        object.__setattr__(self, "bits_order", tuple(int(b) for b in self.bits_order))
        problems = []
        if self.mode not in MODES:
            problems.append(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not 0 <= self.kv_low < self.kv_high:
            problems.append(f"need 0 <= kv_low < kv_high, got {self.kv_low} and {self.kv_high}")
        if not 0 <= self.queue_delay_low_s < self.queue_delay_high_s:
            problems.append(f"need 0 <= queue_delay_low_s < queue_delay_high_s, got "
                            f"{self.queue_delay_low_s} and {self.queue_delay_high_s}")
        if self.step < 1 or self.max_layers < 0:
            problems.append(f"need step >= 1 and max_layers >= 0, got {self.step} and {self.max_layers}")
        if (not self.bits_order or any(b not in QUANT_BITS for b in self.bits_order)
                or list(self.bits_order) != sorted(set(self.bits_order), reverse=True)):
            problems.append(f"bits_order must be (8, 4), (8,) or (4,), got {self.bits_order}")
        if self.release_margin < 0:
            problems.append(f"release_margin must not be negative, got {self.release_margin}")
        if problems:
            raise ValueError("; ".join(problems))
        HysteresisParams(self.enter_windows, self.leave_windows, self.min_dwell_s)  # validates

    @functools.cached_property  # asked for every executor at every state
    def hysteresis(self) -> HysteresisParams:
        return HysteresisParams(self.enter_windows, self.leave_windows, self.min_dwell_s)


# Accuracy gives up the least precision and gives it back soonest; performance reacts fastest,
# goes deepest and holds on longest. step and max_layers are for REFERENCE_DEPTH layers.
_PRESETS: dict[str, dict] = {
    "accuracy": dict(kv_high=0.95, kv_low=0.80, queue_delay_high_s=2.0, queue_delay_low_s=0.5,
                     enter_windows=5, leave_windows=5, min_dwell_s=5.0, step=1, max_layers=4,
                     bits_order=(8,), release_margin=0.15),
    "default": dict(),
    "performance": dict(kv_high=0.80, kv_low=0.65, queue_delay_high_s=0.5, queue_delay_low_s=0.1,
                        enter_windows=2, leave_windows=25, min_dwell_s=20.0, step=4, max_layers=16,
                        bits_order=(8, 4), release_margin=0.05),
}


def _scale(n: int, num_layers: int) -> int:
    return min(num_layers, max(1, math.floor(n * num_layers / REFERENCE_DEPTH + 0.5)))


def settings_for_mode(mode: str, num_layers: int, **overrides) -> MorphSettings:
    """The preset of `mode` for a model of `num_layers` decoder layers, then `overrides` by name."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    preset = dict(_PRESETS.get(mode, {}))
    base = MorphSettings(**preset)
    scaled = replace(base, mode=mode, step=_scale(base.step, num_layers),
                     max_layers=_scale(base.max_layers, num_layers))
    unknown = set(overrides) - {f.name for f in fields(MorphSettings)}
    if unknown:
        raise ValueError(f"unknown morph setting(s): {', '.join(sorted(unknown))}")
    return replace(scaled, **overrides)


def settings_for_config(config: ControllerConfig, num_layers: int) -> MorphSettings:
    return settings_for_mode(config.morph_mode, num_layers, **dict(config.morph_overrides))


# --- the ladder, read from telemetry -------------------------------------------------------------
def swap_order(settings: MorphSettings, num_layers: int, reported: list[int] | None = None) -> list[int]:
    """The settings' order if given, else the one the executor reports (its LIS profile), else front to back."""
    order = settings.swap_order if settings.swap_order is not None else (reported or range(num_layers))
    return list(_valid_order(tuple(order), num_layers))


@functools.lru_cache(maxsize=256)
def _valid_order(order: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    # Asked of every executor at every state, of the few orders a fleet reports: a thousand executors'
    # plans spent a tenth of their time here.
    seen: set[int] = set()
    return tuple(i for i in order if 0 <= i < num_layers and not (i in seen or seen.add(i)))


def next_quantize(layers: list[int], settings: MorphSettings, reported: list[int] | None = None
                  ) -> tuple[list[int], int] | None:
    """The next step up: (layers, bits), or None at the top of the ladder."""
    step = _next_quantize(tuple(layers), settings, None if reported is None else tuple(reported))
    return None if step is None else (list(step[0]), step[1])


def next_restore(layers: list[int], settings: MorphSettings, reported: list[int] | None = None) -> list[int]:
    """The next step down: the most recently quantized layers on the ladder (layers outside the
    swap order are not this policy's and stay as they are)."""
    return list(_next_restore(tuple(layers), settings, None if reported is None else tuple(reported)))


# Both are asked of every executor at every state, of the few layer mixes a fleet holds: at a thousand
# executors, walking their layers each time was two thirds of the ladder's decision.
@functools.lru_cache(maxsize=4096)
def _next_quantize(layers: tuple[int, ...], settings: MorphSettings, reported: tuple[int, ...] | None
                   ) -> tuple[tuple[int, ...], int] | None:
    order = swap_order(settings, len(layers), reported)
    room = settings.max_layers - sum(1 for b in layers if is_quantized(b))
    fresh = [i for i in order if not is_quantized(layers[i])][:max(0, min(settings.step, room))]
    if fresh:
        return tuple(fresh), settings.bits_order[0]
    for bits in settings.bits_order[1:]:
        deeper = [i for i in order if bits < layers[i] <= 8][:settings.step]
        if deeper:
            return tuple(deeper), bits
    return None


@functools.lru_cache(maxsize=4096)
def _next_restore(layers: tuple[int, ...], settings: MorphSettings, reported: tuple[int, ...] | None
                  ) -> tuple[int, ...]:
    order = swap_order(settings, len(layers), reported)

    def rung(pos: int) -> int:
        tier = max(0, sum(1 for b in settings.bits_order if layers[order[pos]] <= b) - 1)
        return tier * len(order) + pos

    ranked = sorted((p for p, i in enumerate(order) if is_quantized(layers[i])), key=rung, reverse=True)
    return tuple(order[p] for p in ranked[:settings.step])


# --- memory --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExecutorMemory:
    hysteresis: HysteresisState = HysteresisState()
    freed_pages: dict[int, float] = field(default_factory=dict)  # bits -> KV pages one layer freed
    # (process instance, pressure_events, rejected) of the last report planned on: growth since is urgent
    # pressure, the refusals' part of it only where quantizing is faster.
    pressure_seen: tuple[str, int, int] = ("", 0, 0)


@dataclass(frozen=True)
class MorphMemory:
    """Everything `plan` needs beyond the current state. Never mutated: `plan` returns a new one."""
    executors: dict[str, ExecutorMemory] = field(default_factory=dict)


def learn_freed_pages(known: dict[int, float], layers: list[int], pages_extension: int) -> dict[int, float]:
    """pages_extension = Σ over quantized layers of the pages each freed; with one width unknown
    that is one equation in one unknown (layers of one model free the same pages at one width)."""
    counts = quantized_counts(tuple(layers))
    if len(counts) == 1:
        (bits, n), = counts.items()
        return known | {bits: pages_extension / n}
    unknown = [b for b in counts if b not in known]
    if len(unknown) == 1:
        rest = pages_extension - sum(known[b] * n for b, n in counts.items() if b != unknown[0])
        if rest >= 0:
            return known | {unknown[0]: rest / counts[unknown[0]]}
    return known


@functools.lru_cache(maxsize=4096)
def quantized_counts(layers: tuple[int, ...]) -> Mapping[int, int]:
    """Quantized layers by bits (0 for bits none is at), read-only: one mapping serves every executor alike."""
    return MappingProxyType(Counter(b for b in layers if is_quantized(b)))


def pages_taken_back(known: dict[int, float], layers: list[int], pages_extension: int,
                     restore: list[int]) -> int:
    """KV pages the restore of `restore` takes back; an unknown width is bounded from above by the
    whole extension shared among its layers, so that a guess errs towards keeping the KV."""
    counts = quantized_counts(tuple(layers))
    total = sum(known.get(layers[i], pages_extension / counts[layers[i]]) for i in restore)
    return min(pages_extension, math.ceil(total - 1e-9))


# --- the policy ----------------------------------------------------------------------------------
def short_of_kv(es: ExecutorState, settings: MorphSettings) -> bool:
    """Pressure the pages a quantize frees answer: KV usage at the mark, or requests waiting that the free KV
    would not hold one sequence of."""
    t = es.telemetry
    return es.kv_usage >= settings.kv_high or (t.waiting > 0 and t.kv.pages_free * t.block_size < t.max_model_len)


def queued(es: ExecutorState, settings: MorphSettings) -> bool:
    """Requests waiting long, or about to: a queue full, the mean wait at the mark, or the wait the queue predicts
    for a request joining it now at the mark (its length over the rate requests left it lately), which a burst
    raises at its first report while the mean still counts the waits from before it."""
    t = es.telemetry
    mark = settings.queue_delay_high_s
    predicted = t.predicted_wait_s is not None and t.predicted_wait_s >= mark
    return t.waiting > 0 and (t.waiting >= t.max_waiting or es.queue_delay_s >= mark or predicted)


def faster(t: ExecutorTelemetry, step: tuple[list[int], int] | None) -> bool:
    """Whether the quantize `step` (next_quantize's) makes the executor's steps faster at its recent load, as its
    latency profile predicts; with no profile for the widths involved, MorphServe's premise that it does."""
    seconds = t.layer_seconds
    if step is None or not seconds:
        return True
    layers, bits = step
    if bits not in seconds or any(t.layers[i] not in seconds for i in layers):
        return True
    return sum(seconds[bits] - seconds[t.layers[i]] for i in layers) < 0


def step_for(es: ExecutorState, settings: MorphSettings) -> tuple[list[int], int] | None:
    """The quantize step this rung would take now: next_quantize's, except for a queue with KV to spare where
    that step's bits are slower and deeper bits of the ladder are faster: then the same layers at the first such."""
    step = next_quantize(es.telemetry.layers, settings, es.telemetry.swap_order)
    if step is None or short_of_kv(es, settings) or faster(es.telemetry, step):
        return step
    layers, bits = step
    deeper = [b for b in settings.bits_order if b < bits and faster(es.telemetry, (layers, b))]
    return (layers, deeper[0]) if deeper else step


def under_pressure(es: ExecutorState, settings: MorphSettings, step: tuple[list[int], int] | None = None) -> bool:
    """Pressure this rung answers with `step`: KV short, or a queue that fewer bits would serve faster."""
    return short_of_kv(es, settings) or (queued(es, settings) and faster(es.telemetry, step))


def release_ok(es: ExecutorState, settings: MorphSettings, taken_back: int) -> bool:
    t = es.telemetry
    capacity = t.kv.pages_free + t.kv.pages_used
    after = capacity - taken_back
    return (t.waiting == 0 and es.queue_delay_s <= settings.queue_delay_low_s and after > 0
            and (t.kv.pages_used + t.pages_growth) * (1 + settings.release_margin) <= after
            and es.kv_usage * capacity + t.pages_growth <= settings.kv_low * after)


def urgent(es: ExecutorState, memory: ExecutorMemory, step: tuple[list[int], int] | None = None) -> bool:
    """Whether the executor counted pressure events (preemptions, admissions waiting for KV, refusals) since
    the report last planned on: hard evidence, acted on at once (hysteresis.advance's `urgent`). Refusals (a
    full queue) count only where `step` is faster."""
    t = es.telemetry
    instance, events, refusals = memory.pressure_seen
    new = t.pressure_since(instance, events)
    if new <= 0 or faster(t, step):
        return new > 0
    return new - pressure_since(t.rejected, t.instance, instance, refusals) > 0


def will_quantize(es: ExecutorState, settings: MorphSettings, memory: ExecutorMemory | None = None) -> bool:
    """Whether this rung takes the pressure it sees now: under pressure, with a layer left to quantize."""
    if settings.mode == "off":
        return False
    short, waiting = short_of_kv(es, settings), queued(es, settings)
    events = memory is not None and urgent(es, memory)
    if not (short or waiting or events):
        return False  # the ladder asks it of every leader at every state, and most are neither on nor pressed
    step = step_for(es, settings)
    if step is None:
        return False
    if short or (faster(es.telemetry, step) and (waiting or events)):
        return True
    return events and urgent(es, memory, step)  # slower quantized: only the KV's events


def load_summary(es: ExecutorState, settings: MorphSettings) -> str:
    """The signals the marks are compared with, for the audit trail."""
    t = es.telemetry
    predicted = "unknown" if t.predicted_wait_s is None else f"{t.predicted_wait_s:.2f} s"
    return (f"KV {es.kv_usage:.0%} used (marks {settings.kv_low:.0%}/{settings.kv_high:.0%}), queue delay "
            f"{es.queue_delay_s:.2f} s (marks {settings.queue_delay_low_s:g}/{settings.queue_delay_high_s:g} s), "
            f"{t.waiting} waiting, predicted wait {predicted}, {t.kv.pages_free} KV pages free, "
            f"{t.pages_growth} still to be taken")


def load_inputs(es: ExecutorState, taken_back: int) -> dict:
    """The same signals by name, for the audit event's inputs."""
    t = es.telemetry
    return {"kv_usage": es.kv_usage, "queue_delay_s": es.queue_delay_s, "waiting": t.waiting,
            "predicted_wait_s": t.predicted_wait_s,
            "pressure_events": t.pressure_events,
            "pages_free": t.kv.pages_free, "pages_used": t.kv.pages_used, "pages_growth": t.pages_growth,
            "pages_extension": t.kv.pages_extension, "pages_taken_back": taken_back}


SettingsSource = MorphSettings | Callable[[int], MorphSettings]


def _plan_executor(es: ExecutorState, memory: ExecutorMemory, settings: MorphSettings, now: float,
                   hold_restore: bool = False) -> tuple[list[PlannedCommand], ExecutorMemory]:
    t = es.telemetry
    freed = learn_freed_pages(memory.freed_pages, t.layers, t.kv.pages_extension)
    seen = (t.instance, t.pressure_events, t.rejected)
    if not es.alive or t.draining:
        skipped = interrupted(memory.hysteresis)  # a skipped window
        return [], updated(memory, hysteresis=skipped, freed_pages=freed, pressure_seen=seen)
    up = step_for(es, settings)
    down = [] if hold_restore else next_restore(t.layers, settings, t.swap_order)
    # Only windows in which a step is possible count, so a step the hysteresis grants is always
    # one the policy takes: its dwell clock then measures real commands.
    events = up is not None and urgent(es, memory, up)
    pressure = up is not None and (under_pressure(es, settings, up) or events)
    taken_back = pages_taken_back(freed, t.layers, t.kv.pages_extension, down) if down else 0
    calm = bool(down) and release_ok(es, settings, taken_back)
    event, hysteresis = advance(settings.hysteresis, memory.hysteresis, pressure, calm, now, urgent=events)
    commands = []
    if event == "enter" and up is not None:
        held = (f"{t.preemptions} preemptions, {t.admission_blocked} admissions held for KV and {t.rejected} "
                f"refusals so far, more since the last state" if events else f"for {settings.enter_windows} windows")
        why = f"pressure {held}: {load_summary(es, settings)}"
        commands.append(PlannedCommand(es.executor, QuantizeArgs(layers=up[0], bits=up[1]), why,
                                       load_inputs(es, 0)))
    elif event == "leave":
        why = f"calm for {settings.leave_windows} windows: {load_summary(es, settings)}"
        commands.append(PlannedCommand(es.executor, RestoreArgs(layers=down), why, load_inputs(es, taken_back)))
    return commands, updated(memory, hysteresis=hysteresis, freed_pages=freed, pressure_seen=seen)


def plan(state: ClusterState, memory: MorphMemory, settings: SettingsSource,
         hold_restore: Collection[str] = ()) -> tuple[list[PlannedCommand], MorphMemory]:
    """Pure: the commands for `state` and the memory for the next one. `settings` is one
    MorphSettings for every executor or a function of an executor's depth; the leaders in
    `hold_restore` restore nothing now (a costlier rung has steps back to take first)."""
    commands: list[PlannedCommand] = []
    executors: dict[str, ExecutorMemory] = {}
    for es in state.executors:
        plan = es.telemetry.plan
        if not leads(es) or (plan is not None and plan.merged):
            continue  # a TP merge keeps its bits until it splits (AMOEBAs: policies/amoebas.py)
        if plan is not None and plan.slots == "placed":
            # A SplitQuant plan's bits are the planner's choice, not a quantize of this rung's: a restore would
            # undo the plan (CoCoServe leaves such an instance alone too, cocoserve_algorithms.instances).
            continue
        s = settings(len(es.telemetry.layers)) if callable(settings) else settings
        previous = memory.executors.get(es.executor, ExecutorMemory())
        if s.mode == "off":
            executors[es.executor] = previous
            continue
        planned, executors[es.executor] = _plan_executor(es, previous, s, state.time, es.executor in hold_restore)
        commands.extend(planned)
    # Executors gone from the state are forgotten: one that comes back starts from its telemetry.
    return commands, MorphMemory(executors)


def make_policy(settings: SettingsSource | None = None) -> Policy:
    """The controller-facing policy; None reads the mode and overrides from ControllerConfig."""
    memory = MorphMemory()

    def morph_policy(state: ClusterState, history: list[ClusterState],
                     config: ControllerConfig) -> list[PlannedCommand]:
        nonlocal memory
        # Asked of every executor: built once per model depth a plan, not a thousand times.
        source = settings if settings is not None else functools.cache(lambda n: settings_for_config(config, n))
        commands, memory = plan(state, memory, source)
        return commands

    return morph_policy
