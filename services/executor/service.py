"""The executor process: NATS on one side, the engine on the other (DESIGN.md, "Processes").

This side is thin on purpose. The engine runs in its own thread (worker.py); here the asyncio loop
receives requests, cancels and commands, answers commands and tokenizer requests, publishes
telemetry, and runs the one ordered, bounded outbox (outbox.py) through which everything the engine
thread sends leaves, so that a request's Admission reply is always written before its first TokenBatch.
The process around it (flags, the world, roles) is process.py.
"""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from services.executor.commands import Commands
from services.executor.gateways import GatewayWatch
from services.executor.outbox import Outbox
from services.executor.tokenization import detokenize, tokenize
from services.executor.worker import EngineWorker
from shared import subjects
from shared.bus import BadMessage, Bus, BusError, Incoming, unsubscribe
from shared.config import ExecutorConfig, served_model_name
from shared.core.plans import alone_id
from shared.core.scheduling.phases import LatencyReports
from shared.core.telemetry import Queue, Served, executor_telemetry
from shared.core.tp_scheduler import MAX_TP
from shared.provenance import cpu_model
from shared.messages import (Admission, Cancel, Command, DetokenizeReply, DetokenizeRequest, ErrorInfo, Event,
                             ExecutorTelemetry, GenerateRequest, GpuStats, InstancePlan, KvUnits, TokenizeReply,
                             TokenizeRequest)

if TYPE_CHECKING:  # annotations only
    from services.executor.engine.engine import LLMEngine
    from services.executor.fabric.world import World

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
# The latency profiles shipped for each kind of device, measured for the default model on this project's machines.
# Each names the CPU it was measured on (its JSON's machine.processor), and fits only that one: the Xeon with AMX
# and the EPYC order INT4 and float32 differently past 16 rows. The EPYC's, recorded before machines were named,
# names none and stands where no other fits.
SHIPPED_LATENCY_PROFILES = {"cpu": [RESULTS / "latency_profile_cpu_xeon_amx.json",
                                    RESULTS / "latency_profile_cpu.json"]}


def latency_profile_path(choice: str | None, device: str, layers: object) -> str | None:
    """The latency profile an executor reports its layer seconds from: `choice`'s path; none for None or "none";
    for "auto", the one shipped for its device (shipped_latency_profile), else none (the controller then keeps
    MorphServe's premise that fewer bits are faster)."""
    if choice is None or choice == "none":
        return None
    if choice != "auto":
        return choice
    shipped = shipped_latency_profile(device, layers)
    return str(shipped) if shipped is not None else None


def shipped_latency_profile(device: str, layers: object, processor: str | None = None) -> Path | None:
    """The shipped profile measured on this CPU (`processor`: cpu_model()'s reading) and on layers of this shape,
    else one that names no CPU; None where none fits."""
    from shared.core.planner.latency import FittedLatency, LatencyError

    processor = cpu_model() if processor is None else processor
    records = {path: json.loads(path.read_text())
               for path in SHIPPED_LATENCY_PROFILES.get(device.split(":")[0], []) if path.exists()}
    measured_on = {path: record.get("machine", {}).get("processor", "") for path, record in records.items()}
    fitting = [p for p, on in measured_on.items() if on == processor] + [p for p, on in measured_on.items() if not on]
    for path in fitting:
        try:
            FittedLatency.from_profile(records[path]).check_layers(layers, str(path))
        except LatencyError:
            continue
        return path
    return None


log = logging.getLogger(__name__)

PRESSURE_EVENT_INTERVAL_S = 1.0


async def heartbeat(bus: Bus, executor: str, telemetry: Callable[[], ExecutorTelemetry], interval_s: float,
                    wake: asyncio.Event | None = None) -> None:
    """Publish `telemetry()` every `interval_s` until cancelled: an executor's heartbeat, leader or follower.
    Setting `wake` publishes at once, out of the cycle, since pressure must not wait for the next beat; but once
    between two beats at most. Under overload every step and every refusal raises pressure, and the monitor
    takes only an executor's newest report into a state: more would flood the bus with reports read by no one.
    Pressure that rises after the report out of cycle goes out with the next beat."""
    loop = asyncio.get_running_loop()
    while True:
        if wake is not None:
            wake.clear()  # before the report is built: it carries whatever woke it
        await _publish_telemetry(bus, executor, telemetry)
        if wake is None:
            await asyncio.sleep(interval_s)
            continue
        beat = loop.time() + interval_s
        try:
            await asyncio.wait_for(wake.wait(), interval_s)
        except TimeoutError:
            continue
        wake.clear()
        await _publish_telemetry(bus, executor, telemetry)
        await asyncio.sleep(max(0.0, beat - loop.time()))


async def _publish_telemetry(bus: Bus, executor: str, telemetry: Callable[[], ExecutorTelemetry]) -> None:
    try:
        await bus.publish(subjects.telemetry(executor), telemetry())
    except BusError:  # down: the bus logs that once, and the next heartbeat is what counts
        pass
    except Exception:
        log.exception("executor %s: telemetry failed", executor)


class ExecutorService:
    def __init__(self, config: ExecutorConfig, engine: "LLMEngine | None" = None, plan: InstancePlan | None = None,
                 world: "World | None" = None):
        """`plan`: the instance this executor leads (None: it serves alone, outside any world). `world`: the
        executors' world when it serves alone in one, so that it can merge into a TP instance (AMOEBAs)."""
        if engine is None:
            # Imported here so that a service built around a given engine (the tests) needs no model load.
            from services.executor.engine.engine import LLMEngine

            engine = LLMEngine(config.engine, progress=False)
        self.config = config
        self.engine = engine
        self.id = config.executor_id
        self.instance = uuid.uuid4().hex  # tells the monitor a restart from a stall
        self.alone_plan = plan  # what it serves while its engine leads no instance of several
        self.world = world
        self.broken = asyncio.Event()  # set once the instance it leads loses a member
        self._loop: asyncio.AbstractEventLoop | None = None
        self.model_name = served_model_name(engine.config.model)
        self._served = Served(executor=self.id, instance=self.instance, model=self.model_name,
                              max_model_len=engine.max_model_len, block_size=engine.config.block_size,
                              page_bytes=engine.arena.page_bytes, layer_pages=engine.arena.slot_pages,
                              kv_heads=engine.model_config.num_kv_heads, max_waiting=engine.config.max_waiting)
        self._latency: LatencyReports | None = None  # what it reports of its latency profile, when given one
        profile = latency_profile_path(config.latency_profile, engine.config.device, engine.model_config)
        if profile is not None:
            from shared.core.planner.latency import load_profile  # numpy and scipy: only when asked

            latency = load_profile(profile)
            latency.check_layers(engine.model_config, profile)
            self._latency = LatencyReports(latency, engine.model.full_bits, config.latency_window_s)
            engine.count_steps()
            log.info("executor %s: reporting layer seconds from the latency profile %s", self.id, profile)
        self._commands = Commands(self)
        self._bus: Bus | None = None
        self._outbox = Outbox(self.id, config.outbox_limit, config.flush_timeout_s)
        self._telemetry_task: asyncio.Task | None = None
        self._subs: list = []
        self._read_gpu: Callable[[int], GpuStats | None] | None = None
        self.worker = EngineWorker(engine, self.id, self.model_name, config.latency_window_s,
                                   self._outbox.put, self._outbox.put_nowait, self._publish,
                                   max_queue_wait_s=config.max_queue_wait_s, on_broken=self._on_broken,
                                   on_pressure=self._on_pressure)
        self._gateways = GatewayWatch(self.worker)
        self._pressure = asyncio.Event()
        self._pressure_event_at = 0.0  # when the last pressure event went out (they are rate-limited)
        self._pressure_tasks: set[asyncio.Task] = set()
        self._track_degrees()

    @property
    def draining(self) -> bool:
        return self.worker.draining

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self, bus: Bus) -> None:
        self._bus, self._loop = bus, asyncio.get_running_loop()
        bus.on_outage(self.config.bus_outage_s, self._on_bus_outage)
        self._outbox.start()
        self.worker.start()
        self._subs = [await bus.subscribe(subjects.infer(self.id), GenerateRequest, self._on_infer,
                                          refuse=self._refuse_request),
                      await bus.subscribe(subjects.cancel(self.id), Cancel, self._on_cancel),
                      await bus.subscribe(subjects.command(self.id), Command, self._commands.on_command,
                                          refuse=self._commands.refuse),
                      await bus.subscribe(subjects.tokenize(self.id), TokenizeRequest, self._on_tokenize),
                      await bus.subscribe(subjects.detokenize(self.id), DetokenizeRequest, self._on_detokenize)]
        await self._gateways.start(bus)
        await bus.flush()
        # Telemetry is what makes the gateway route here, so it starts only once every subscription is in.
        self._telemetry_task = asyncio.create_task(self._telemetry(), name=f"{self.id}-telemetry")
        log.info("executor %s serving %s (max_model_len %d)", self.id, self.model_name, self.engine.max_model_len)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish (aborting them after the timeout), shut down."""
        self.worker.draining = True
        if self._bus is None:
            return
        deadline = time.monotonic() + drain_timeout_s
        while self.worker.snapshot.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.worker.snapshot.in_flight:
            log.warning("executor %s: aborting %d requests still in flight after %.1f s", self.id,
                        self.worker.snapshot.in_flight, drain_timeout_s)
        for sub in self._subs:
            await unsubscribe(sub)
        await self._gateways.stop()
        self._outbox.stop_waiting()  # so that join() cannot hang on a stuck bus
        await asyncio.to_thread(self.worker.join)  # aborts what is left; its final deltas are queued
        self._telemetry_task.cancel()
        await asyncio.gather(self._telemetry_task, return_exceptions=True)
        await self._outbox.finish()
        await self._bus.flush()

    # --- bus handlers -------------------------------------------------------------------------
    async def _on_infer(self, incoming: Incoming) -> None:
        self.worker.admit(incoming.message, incoming)

    async def _on_cancel(self, incoming: Incoming) -> None:
        self.worker.cancel(incoming.message.request_id)

    def _on_bus_outage(self, seconds: float) -> None:
        """Nobody can receive the tokens of the requests in flight, and their gateways give up on them
        too: abort them all, so that their pages are free for the requests that come after the reconnect."""
        log.warning("executor %s: the bus has been gone %.1f s; aborting %d requests in flight", self.id, seconds,
                    self.worker.snapshot.in_flight)
        self.worker.abort_all()

    def _on_pressure(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._pressure_rose)

    def _pressure_rose(self) -> None:
        """Telemetry goes out at once (the monitor republishes the state on it, and the controller plans on that);
        an event says so in the audit trail, at most once a second, since a starved step repeats every step."""
        self._pressure.set()
        now = time.time()
        if now - self._pressure_event_at < PRESSURE_EVENT_INTERVAL_S or self._bus is None:
            return
        self._pressure_event_at = now
        stats = self.worker.snapshot.stats
        event = Event(kind="pressure", source=self.id, time=now,
                      data={"executor": self.id, "preemptions": stats.preemptions,
                            "admission_blocked": stats.admission_blocked, "rejected": self.worker.rejected,
                            "waiting": stats.waiting, "pages_free": stats.ledger.pages_kv_free})
        task = asyncio.create_task(self._publish(subjects.EVENTS, event), name=f"{self.id}-pressure")
        self._pressure_tasks.add(task)
        task.add_done_callback(self._pressure_tasks.discard)

    def _on_broken(self, exc: Exception) -> None:
        log.warning("executor %s: instance %s is broken: %s", self.id, self.plan.id if self.plan else "?", exc)
        self._loop.call_soon_threadsafe(self.broken.set)

    def _refuse_request(self, bad: BadMessage) -> Admission | None:
        """An infer request that does not decode (a range rule broken, another schema version) is
        refused by name when it carries a request id, like any invalid request."""
        body = bad.body if isinstance(bad.body, dict) else {}
        if not isinstance(body.get("request_id"), str):
            return None
        return Admission(request_id=body["request_id"], executor=self.id, accepted=False,
                         error=ErrorInfo(type="invalid_request_error", message=bad.problem, param=bad.param))

    async def _on_tokenize(self, incoming: Incoming) -> None:
        # In a thread: a long prompt would hold up the loop's telemetry and token traffic otherwise.
        try:
            reply = await asyncio.to_thread(tokenize, self.engine.tokenizer, self.id, self.engine.max_model_len,
                                            incoming.message)
        except Exception as exc:  # answered, so that the gateway says 500 at once instead of timing out
            log.exception("executor %s: tokenize failed", self.id)
            reply = TokenizeReply(executor=self.id, error=ErrorInfo(type="internal_error", message=repr(exc)))
        await incoming.reply(reply)

    async def _on_detokenize(self, incoming: Incoming) -> None:
        try:
            reply = await asyncio.to_thread(detokenize, self.engine.tokenizer, self.id, incoming.message)
        except Exception as exc:
            log.exception("executor %s: detokenize failed", self.id)
            reply = DetokenizeReply(executor=self.id, error=ErrorInfo(type="internal_error", message=repr(exc)))
        await incoming.reply(reply)

    @property
    def plan(self) -> InstancePlan | None:
        """The plan it serves now: its instance's, which operations change, else the one it was given."""
        if self.worker.tp.following is not None:
            return self.worker.tp.following.plan
        return self.engine.member.plan if self.engine.member is not None else self.alone_plan

    @property
    def instance_id(self) -> str:
        plan = self.plan
        return plan.id if plan is not None else alone_id(self.id)

    # --- sending ------------------------------------------------------------------------------
    async def _publish(self, subject: str, message) -> None:
        await self._bus.publish(subject, message)

    async def _telemetry(self) -> None:
        await heartbeat(self._bus, self.id, self.telemetry, self.config.telemetry_interval_s, self._pressure)

    def _track_degrees(self) -> None:
        """The TP degrees its world can merge it into, as peers come and go."""
        if self.world is not None:
            self.worker.tp.degrees = [k for k in (1, 2, MAX_TP) if k <= len(self.world.names)]

    def telemetry(self) -> ExecutorTelemetry:
        self._track_degrees()
        snap, engine, worker = self.worker.snapshot, self.engine, self.worker
        stats, ledger = snap.stats, snap.stats.ledger
        following = worker.tp.following
        if following is not None:  # its part of the instance: the leader's blocks, its own arena
            ledger = following.snapshot()
        queue = Queue(running=stats.running, waiting=stats.waiting, max_num_seqs=snap.max_num_seqs,
                      preemptions=stats.preemptions, admission_blocked=stats.admission_blocked,
                      rejected=worker.rejected, prompt_tokens=stats.prompt_tokens,
                      generated_tokens=stats.generated_tokens, queue_delay_s=worker.records.queue_delay.mean(),
                      ttft_s=worker.records.ttft.mean(), tpot_s=worker.records.tpot.mean(), departures=snap.departures,
                      pages_growth=snap.pages_growth, longest_blocks=snap.longest_blocks,
                      requests=worker.records.finished.drain())
        leads_instance = engine.member is not None
        return executor_telemetry(
            self._served, snap.taken, ledger, queue, layers=snap.layers, swap_order=engine.swapper.swap_order,
            member_of=self.plan if leads_instance or following is not None else None, plan=self.plan,
            free_pages=engine.arena.ledger.num_free if leads_instance else 0,
            busy=(following.busy if following is not None else worker.busy).share(),
            draining=self.draining, hold_s=max(0.0, worker.tp.hold_until - time.monotonic()) if leads_instance else 0.0,
            world=list(self.world.names) if self.world is not None else [],
            kv_units=[KvUnits(tp=k, units=u) for k, u in snap.kv_units.items()],
            layer_seconds=self._latency.report(snap.steps_load, snap.taken)
            if self._latency is not None and snap.steps_load is not None else {},
            gpu=self._gpu_stats())

    def _gpu_stats(self) -> GpuStats | None:
        device = self.engine.config.device
        if not device.startswith("cuda"):
            return None
        if self._read_gpu is None:
            from services.executor.gpu import read_gpu_stats

            self._read_gpu = read_gpu_stats
        try:
            return self._read_gpu(int(device.partition(":")[2] or 0))
        except Exception:  # a flaky NVML read must not cost the heartbeat
            log.debug("reading GPU stats failed", exc_info=True)
            return None
