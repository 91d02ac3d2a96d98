"""How many executors the cluster wants (issue 54). The controller creates no machines: it says how many it would
have, and an autoscaler (a Kubernetes HPA, KEDA) reads that as the gateway's `morphling_desired_executors`.

One more than are live once the SLO has failed for `sustain_s` while the levers planned nothing (every lever is
exhausted: nothing left to quantize, replicate or merge that would help); one fewer, never below `minimum`,
once every live executor has been idle for `idle_s`; else as many as are live."""

from dataclasses import dataclass, field, fields

from shared.messages import ClusterState


@dataclass(frozen=True)
class CapacitySettings:
    violation_rate: float = 0.1  # an executor's SLO window failing more than this share of its requests fails
    min_requests: int = 5  # ... over at least this many requests
    sustain_s: float = 30.0
    idle_s: float = 300.0
    minimum: int = 1


def capacity_settings(**overrides) -> CapacitySettings:
    """The defaults with `overrides` by name (the controller's --capacity-set); ValueError names a bad one."""
    known = {f.name for f in fields(CapacitySettings)}
    if unknown := sorted(set(overrides) - known):
        raise ValueError(f"unknown capacity setting(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    settings = CapacitySettings(**overrides)
    numbers = [getattr(settings, f.name) for f in fields(CapacitySettings)]
    if any(isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in numbers):
        raise ValueError(f"capacity settings are non-negative numbers, got {settings}")
    return settings


@dataclass
class CapacityAdvice:
    settings: CapacitySettings = field(default_factory=CapacitySettings)
    failing_since: float | None = None  # the SLO failing with nothing planned, since
    idle_since: float | None = None

    def desired(self, state: ClusterState, planned: int) -> int:
        """The executors wanted after `state`, on which the policies planned `planned` commands."""
        s, now = self.settings, state.time
        live = [e for e in state.executors if e.alive]
        failing = any(e.slo.requests >= s.min_requests and e.slo.violation_rate > s.violation_rate for e in live)
        exhausted = failing and not planned
        self.failing_since = (now if self.failing_since is None else self.failing_since) if exhausted else None
        idle = bool(live) and all(e.telemetry.running == 0 and e.telemetry.waiting == 0 for e in live)
        self.idle_since = (now if self.idle_since is None else self.idle_since) if idle else None
        if self.failing_since is not None and now - self.failing_since >= s.sustain_s:
            return len(live) + 1
        if self.idle_since is not None and now - self.idle_since >= s.idle_s:
            return max(s.minimum, len(live) - 1)
        return len(live)

    def reason(self, state: ClusterState, desired: int) -> str:
        live = sum(e.alive for e in state.executors)
        if desired > live:
            return (f"the SLO has failed for {self.settings.sustain_s:g} s with every lever exhausted: one more "
                    f"executor than the {live} live")
        if desired < live:
            return f"every executor has been idle for {self.settings.idle_s:g} s: one fewer than the {live} live"
        return f"the {live} live executors"
