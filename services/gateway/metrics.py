"""Prometheus metrics of the gateway, in a registry of its own.

A private CollectorRegistry keeps several gateways in one test process from colliding and keeps the
default process collectors of unrelated libraries out of /metrics. Latencies are measured where the
client sees them (the gateway), except inter-token latency, which uses the executor's per-token
timestamps because tokens cross the bus in batches and arrival times would hide the real spacing.

Queue time is defined as arrival at the gateway -> admission accepted by an executor: the time spent
finding an executor with room. The executor's own waiting before its first scheduling is not visible
per request here (the executor reports it as a windowed mean in telemetry).

Instances (DESIGN.md, "Instances across executors") get gauges of their own instead of an `instance` label on the
executor metrics, so that existing queries and dashboards keep their series. A follower's running and waiting are
always 0, so the request gauges need no filtering; its KV pages are as real as its leader's and count in the mean.
"""

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from shared.core.plans import leads
from shared.messages import ClusterState, Event, InstancePlan

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5, 5)


class GatewayMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("morphling_time_to_first_token_seconds",
                              "Arrival at the gateway to the first generated token", buckets=_LATENCY_BUCKETS,
                              registry=r)
        self.itl = Histogram("morphling_inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request (executor timestamps)",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("morphling_e2e_request_latency_seconds",
                             "Arrival at the gateway to the last token", buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("morphling_request_queue_time_seconds",
                               "Arrival at the gateway to admission by an executor", buckets=_LATENCY_BUCKETS,
                               registry=r)
        self.running = Gauge("morphling_requests_running", "Requests running on live executors", registry=r)
        self.waiting = Gauge("morphling_requests_waiting", "Requests waiting on live executors", registry=r)
        self.kv_usage = Gauge("morphling_kv_cache_usage_ratio", "Mean KV cache usage over live executors",
                              registry=r)
        self.rejected = Counter("morphling_requests_rejected", "Requests refused by the gateway", ["reason"],
                                registry=r)
        self.requests = Counter("morphling_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.slow_consumers = Counter("morphling_gateway_slow_consumers",
                                      "Requests cancelled because their client did not read the stream fast enough",
                                      registry=r)
        self.failovers = Counter("morphling_stream_failovers",
                                 "Requests continued on another executor after theirs was lost", registry=r)
        self.desired = Gauge("morphling_desired_executors",
                             "Executors the controller would have (one more while the SLO fails with every lever "
                             "exhausted, one fewer while idle): for an autoscaler", registry=r)
        self._desired_heard = False
        self._restarts: dict[str, int] = {}
        r.register(_RestartsCollector(self._restarts))
        self._instances = _InstancesCollector()
        r.register(self._instances)

    def observe_event(self, event: Event) -> None:
        desired = event.data.get("desired_executors") if event.kind in ("scale", "stats") else None
        if isinstance(desired, int):
            self.desired.set(desired)
            self._desired_heard = True

    def observe_state(self, state: ClusterState) -> None:
        live = [e for e in state.executors if e.alive]
        if not self._desired_heard:  # until the controller says otherwise, what there is
            self.desired.set(len(live))
        self.running.set(sum(e.telemetry.running for e in live))
        self.waiting.set(sum(e.telemetry.waiting for e in live))
        self.kv_usage.set(sum(e.kv_usage for e in live) / len(live) if live else 0.0)
        self._restarts.update({e.executor: e.restarts for e in state.executors})
        self._instances.instances = list(state.instances)
        self._instances.roles = [(e.executor, e.telemetry.plan.id, "leader" if leads(e) else "follower")
                                 for e in live if e.telemetry.plan is not None]

    def observe_token_times(self, previous: float | None, timestamps: list[float]) -> float | None:
        """Record the gaps between consecutive token timestamps; returns the last one seen."""
        for t in timestamps:
            if previous is not None:
                self.itl.observe(max(0.0, t - previous))
            previous = t
        return previous

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RestartsCollector:
    """Executor restarts as the monitor counts them: a counter whose value comes from the cluster state,
    which a prometheus Counter (only ever incremented here) could not follow."""

    def __init__(self, restarts: dict[str, int]):
        self._restarts = restarts

    def collect(self):
        family = CounterMetricFamily("morphling_executor_restarts",
                                     "Times an executor came back as a new process (counted by the monitor)",
                                     labels=["executor"])
        for executor, count in sorted(self._restarts.items()):
            family.add_metric([executor], count)
        yield family


class _InstancesCollector:
    """The instances of the latest cluster state. Rebuilt on each scrape rather than kept in labelled Gauges, so
    that an instance that was dissolved (a TP split, its leader dead) leaves /metrics instead of lingering."""

    def __init__(self):
        self.instances: list[InstancePlan] = []
        self.roles: list[tuple[str, str, str]] = []  # (executor, instance, role) of the live executors in one

    def collect(self):
        members = GaugeMetricFamily("morphling_instance_members", "Executors serving one model copy together",
                                    labels=["instance", "leader"])
        tp = GaugeMetricFamily("morphling_instance_tp", "Tensor-parallel degree of an instance", labels=["instance"])
        for plan in self.instances:
            members.add_metric([plan.id, plan.leader], len(plan.members))
            tp.add_metric([plan.id], plan.tp)
        role = GaugeMetricFamily("morphling_executor_instance",
                                 "1 for each live executor that serves in an instance, with its role there "
                                 "(standalone executors have none)", labels=["executor", "instance", "role"])
        for executor, instance, kind in self.roles:
            role.add_metric([executor, instance, kind], 1)
        yield members
        yield tp
        yield role
