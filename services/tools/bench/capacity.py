"""The baseline's capacity: the request rate at which its P95 TTFT crosses the SLO at steady load.

Steady load is a Poisson process at a fixed rate whose request lengths are drawn from the trace's own
(prompt, output) pairs, so it asks for the same work per request as the replayed windows, only
without the bursts. Each probe plays it at one rate and reports the P95 TTFT and the failures.

The rule a reader can check against the probes in a report:

- a probe meets the SLO when its P95 TTFT is at most the SLO and no request failed;
- the capacity is interpolated linearly in rate between the highest rate that meets the SLO and the
  next higher probe, at the rate where their P95s' straight line equals the SLO; if that next probe
  has no P95 or had failures, there is nothing to interpolate and the capacity is the meeting rate;
- with no probe above the highest meeting rate, the capacity is that rate (a lower bound);
- with no probe meeting the SLO there is no capacity (`crossing` gives None).

The search walks geometrically from a start rate, up by `factor` while probes meet the SLO and down
while they miss, until a meeting and a missing probe bracket the crossing; one more probe at the
bracket's geometric mean halves it (in log rate) before interpolating. P95 TTFT grows convexly with
the rate as a queue fills, so the straight line lies above the curve between two probes and the
interpolated capacity errs low, by at most the width of the final bracket.
"""

import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.tools.bench.trace import TraceRequest, TraceRow, scale_lengths


class CapacityError(ValueError):
    """Arguments that leave no capacity to measure: non-positive rates, a search that cannot move."""


def steady_load(rows: list[TraceRow], rate_rps: float, duration_s: float, len_scale: float, max_len: int,
                seed: int) -> list[TraceRequest]:
    """Poisson arrivals at rate_rps over [0, duration_s), each with a (prompt, output) pair drawn from
    the trace's rows, scaled as the replay scales them; the same seed gives the same load."""
    if rate_rps <= 0 or duration_s <= 0 or len_scale <= 0:
        raise CapacityError(f"rate, duration and length scale must be positive, got {rate_rps}, {duration_s} "
                            f"and {len_scale}")
    if max_len < 2:
        raise CapacityError(f"max_len must leave room for a prompt and an output token, got {max_len}")
    if not rows:
        raise CapacityError("no trace rows to draw request lengths from")
    pairs = [(r.prompt_tokens, r.output_tokens) for r in rows]
    rng = random.Random(seed)
    requests = []
    t = rng.expovariate(rate_rps)
    while t < duration_s:
        prompt, output = scale_lengths(*rng.choice(pairs), len_scale, max_len)
        requests.append(TraceRequest(t, prompt, output))
        t += rng.expovariate(rate_rps)
    return requests


@dataclass(frozen=True)
class Probe:
    rate_rps: float  # the steady load's rate
    ttft_p95_s: float | None  # None when no request got a first token
    failed: int
    requests: int

    def meets(self, slo_s: float) -> bool:
        # A failure fails the probe whatever the P95: a request that errored was not served in time.
        return self.ttft_p95_s is not None and self.ttft_p95_s <= slo_s and self.failed == 0


def crossing(probes: list[Probe], slo_s: float) -> float | None:
    """The capacity the probes show for slo_s, by the rule in the module docstring."""
    if slo_s <= 0:
        raise CapacityError(f"the SLO must be positive, got {slo_s}")
    meeting = [p for p in probes if p.meets(slo_s)]
    if not meeting:
        return None
    best = max(meeting, key=lambda p: p.rate_rps)
    above = [p for p in probes if p.rate_rps > best.rate_rps]
    if not above:
        return best.rate_rps
    miss = min(above, key=lambda p: p.rate_rps)
    if miss.ttft_p95_s is None or miss.failed:
        return best.rate_rps
    # miss.ttft_p95_s > slo_s >= best.ttft_p95_s here, so the line rises and crosses the SLO between them.
    fraction = (slo_s - best.ttft_p95_s) / (miss.ttft_p95_s - best.ttft_p95_s)
    return best.rate_rps + fraction * (miss.rate_rps - best.rate_rps)


def _to_stderr(line: str) -> None:
    print(line, file=sys.stderr)


def _req_s(rate: float) -> str:
    return f"{rate:.3g} req/s"


def _describe(probe: Probe, slo_s: float, what: str, rate_text: Callable[[float], str]) -> str:
    p95 = "none" if probe.ttft_p95_s is None else f"{probe.ttft_p95_s:.3f} s"
    verdict = "meets" if probe.meets(slo_s) else "misses"
    return (f"{what} at {rate_text(probe.rate_rps)}: TTFT p95 {p95}, {probe.failed} of {probe.requests} "
            f"failed: {verdict} the {slo_s:g} s SLO")


def search(measure: Callable[[float], Probe], start_rps: float, slo_s: float, factor: float = 1.5,
           max_probes: int = 6, progress: Callable[[str], None] = _to_stderr, what: str = "capacity probe",
           rate_text: Callable[[float], str] = _req_s) -> tuple[float, list[Probe]]:
    """The capacity found by probing `measure` (rate -> Probe), and every probe sorted by rate; `what` and
    `rate_text` name a probe and its rate in the progress lines.

    max_probes bounds all probes, the bisection included, since each one is a run of the system.
    If no probe meets the SLO the lowest rate probed is returned, and `progress` says so: the caller
    still gets a rate to scale the trace by, marked in the log as an upper bound at best."""
    if start_rps <= 0 or slo_s <= 0:
        raise CapacityError(f"start rate and SLO must be positive, got {start_rps} and {slo_s}")
    if factor <= 1:
        raise CapacityError(f"the search factor must exceed 1 to move, got {factor}")
    if max_probes < 2:
        raise CapacityError(f"a bracket needs at least 2 probes, got max_probes={max_probes}")
    probes: list[Probe] = []

    def probe(rate: float) -> Probe:
        result = measure(rate)
        probes.append(result)
        progress(_describe(result, slo_s, what, rate_text))
        return result

    first = probe(start_rps)
    going_up = first.meets(slo_s)
    rate = start_rps
    bracket: tuple[float, float] | None = None  # (meeting rate, missing rate)
    while len(probes) < max_probes:
        last_rate = rate
        rate = rate * factor if going_up else rate / factor
        # The walk keeps one direction until the verdict flips, so the flip brackets the crossing.
        if probe(rate).meets(slo_s) != going_up:
            bracket = (last_rate, rate) if going_up else (rate, last_rate)
            break
    if bracket and len(probes) < max_probes:
        probe(math.sqrt(bracket[0] * bracket[1]))

    probes.sort(key=lambda p: p.rate_rps)
    capacity = crossing(probes, slo_s)
    if capacity is None:
        capacity = probes[0].rate_rps
        progress(f"capacity: no probe met the {slo_s:g} s SLO; using the lowest rate probed, "
                 f"{rate_text(capacity)}")
    elif bracket is None:
        progress(f"capacity: no probe missed the {slo_s:g} s SLO; {rate_text(capacity)} is a lower bound")
    else:
        progress(f"capacity: {rate_text(capacity)}")
    return capacity, probes
