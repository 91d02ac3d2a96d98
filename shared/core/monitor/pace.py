"""How often the monitor publishes the cluster state, given what the last one cost (monitor/service.py).

Each state costs the monitor the judging of the reports held since the last one, building the state and
encoding it: about 100 ms at 1,000 executors and 160 ms at 2,000 on the GPU machine's cores, where its one
process then took in 6,081 of the 9,927 reports a second it was sent (docs/benchmarks.md, "The monitor and
controller at 1,000 executors"). Every millisecond spent on states is one not spent taking reports in, so
publishing is held to at most half of the monitor's time:

- a state of new pressure between two ticks goes out only while a state costs under a quarter of the tick,
  so that the ticks and those states together stay under half;
- beyond half, the tick itself stretches to twice the last state's cost. The ≥ 4 Hz of DESIGN.md holds
  while a state costs up to 125 ms; past that the state goes out less often but is built from fresh reports,
  where a monitor that fell behind published stale ones on time (4.2 s old at the median at 1,000).
"""

from dataclasses import dataclass

PUBLISHING_SHARE = 0.5  # of the monitor's time, at most


@dataclass(frozen=True)
class Pace:
    tick_s: float  # until the next state on the clock
    urgent: bool  # whether a report of new pressure may publish a state before it


def pace(interval_s: float, last_state_s: float) -> Pace:
    """The pace after a state that took `last_state_s` to judge, build and send, the clock set to `interval_s`."""
    tick = max(interval_s, last_state_s / PUBLISHING_SHARE)
    return Pace(tick_s=tick, urgent=2 * last_state_s < PUBLISHING_SHARE * tick)
