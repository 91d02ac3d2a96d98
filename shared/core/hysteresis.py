"""Hysteresis for the controller's ladder (DESIGN.md, "The controller's ladder").

Every rung of the ladder reacts to a noisy signal: one slow window must not quantize a layer, and a
brief lull must not restore one only for the next burst to quantize it again, each swap costing a
copy and, on the way back, KV moves. So a rung steps *up* ("enter") after `enter_after` consecutive
pressure windows, steps *down* ("leave") after `leave_after` consecutive calm windows, and never
steps down sooner than `min_dwell_s` after it stepped up (DESIGN.md: "leave after m windows below the
low mark and a minimum dwell").

A window can also be *urgent*: pressure shown by events, not by a level (a preemption, an admission that waits
for KV pages, a refusal for a full queue, counted by the executor). Those are not noise a window could
smooth away: requests are already paying for them. An urgent pressure window steps up at once, whatever
`enter_after` says (issue 16: the first quantize within a second of the first sign of pressure).

The dwell holds only that turn. A burst that follows a restore is met after its own `enter_after`
windows: holding it for the dwell too would leave the burst queueing on the smaller cache for the
whole dwell (measured with `morphling bench`: eleven seconds of rising TTFT after a restore that came
just before a burst), while turning up quickly costs one copy. Direction changes stay bounded: each
round trip up and down takes at least `min_dwell_s`.

The state is a frozen dataclass and `advance` is a pure function of (params, state, window), so a
policy that keeps it can itself stay a pure function of its inputs and be replayed in the
simulator; `Hysteresis` is the small mutable wrapper for callers that just want `update`.
"""

from dataclasses import dataclass, replace
from typing import Literal

Direction = Literal["enter", "leave"]


@dataclass(frozen=True)
class HysteresisParams:
    enter_after: int  # consecutive pressure windows before stepping up
    leave_after: int  # consecutive calm windows before stepping down
    min_dwell_s: float  # no stepping down sooner than this after a step up

    def __post_init__(self) -> None:
        if self.enter_after < 1 or self.leave_after < 1:
            raise ValueError(f"window counts must be at least 1, got enter_after={self.enter_after}, "
                             f"leave_after={self.leave_after}")
        if self.min_dwell_s < 0:
            raise ValueError(f"min_dwell_s must not be negative, got {self.min_dwell_s}")


@dataclass(frozen=True)
class HysteresisState:
    pressure_windows: int = 0
    calm_windows: int = 0
    last_direction: Direction | None = None
    last_change: float | None = None  # time of the last step, either way


def advance(params: HysteresisParams, state: HysteresisState, pressure: bool, calm: bool,
            now: float, urgent: bool = False) -> tuple[Direction | None, HysteresisState]:
    """One window: returns the step to take now (if any) and the next state.

    Pressure wins over calm when a caller reports both, because under-reacting to pressure costs
    requests while a late restore only costs some accuracy for a while. `urgent` (with `pressure`) counts
    as a whole run of pressure windows.
    """
    if pressure:
        windows = max(state.pressure_windows + 1, params.enter_after if urgent else 0)
        state = replace(state, pressure_windows=windows, calm_windows=0)
    elif calm:
        state = replace(state, pressure_windows=0, calm_windows=state.calm_windows + 1)
    else:
        # A window between the marks breaks both runs: "consecutive" means consecutive.
        return None, interrupted(state)

    want: Direction = "enter" if pressure else "leave"
    count = state.pressure_windows if pressure else state.calm_windows
    needed = params.enter_after if pressure else params.leave_after
    if count < needed:
        return None, state
    turning_down = want == "leave" and state.last_direction == "enter"
    if turning_down and state.last_change is not None and now - state.last_change < params.min_dwell_s:
        # Keep the run counting: it fires on the first window after the dwell if it still holds.
        return None, state
    # Both runs restart, so the next step in the same direction needs a full run of its own.
    return want, HysteresisState(last_direction=want, last_change=now)


def interrupted(state: HysteresisState) -> HysteresisState:
    """After a window that breaks both runs (between the marks, or skipped): the time of the last step still
    counts for the dwell. The same state where no run was going, as at most of a fleet's instances at most
    states: nothing is made anew."""
    if state.pressure_windows == 0 and state.calm_windows == 0:
        return state
    return replace(state, pressure_windows=0, calm_windows=0)


class Hysteresis:
    """Mutable convenience around `advance`; `state` can be read out and put back at any time."""

    def __init__(self, enter_after: int, leave_after: int, min_dwell_s: float,
                 state: HysteresisState | None = None):
        self.params = HysteresisParams(enter_after, leave_after, min_dwell_s)
        self.state = state or HysteresisState()

    def update(self, pressure: bool, calm: bool, now: float, urgent: bool = False) -> Direction | None:
        event, self.state = advance(self.params, self.state, pressure, calm, now, urgent)
        return event
