"""Two promises that only hold when the real pieces are wired together over a real nats-server.

1. One trace per HTTP request: the gateway's server span (with its GenAI attributes) and the
   executor's request/queue/prefill/decode spans share a trace id, the executor's spans hang under
   the gateway's span through the W3C trace context carried in NATS headers, and no span carries
   the prompt text. Gateway (uvicorn), executor and monitor run in this process (each on its own
   thread and event loop) so that one in-memory exporter sees every span; the unit tests of each
   side cannot show that the context survives the hop across the bus.
2. The controller's command machinery (CommandSender) against a real ExecutorService: ping, drain,
   bad commands refused with the culprit named, idempotent replays of a seq, the audit event on the events subject, and the
   bounded time a command to a missing or silent executor takes to fail.
"""

import asyncio
import threading
import time

import httpx
import openai
import uvicorn
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.executor.service import ExecutorService
from services.gateway.app import create_app
from services.monitor.service import MonitorService
from shared import subjects
from shared.bus import Bus
from shared.config import EngineConfig, ExecutorConfig, GatewayConfig, MonitorConfig
from shared.commands import CommandSender
from shared.messages import Admission, Command, CommandResult, DrainArgs, Event, GenerateRequest, PingArgs, TokenBatch
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama3
from tests.nats_server import free_port

# A word that appears nowhere but in the prompts, so that finding it in a span means the prompt leaked.
SECRET = "zebracornium"


class LoopThread:
    """An asyncio event loop on its own thread, for the services that share the process with uvicorn."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="services-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "the services' event loop did not stop"
        self.loop.close()


def wait_for(check, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return value


def request_spans(exporter: InMemorySpanExporter, path: str):
    """(gateway server span, {name: executor span}, every span) of the one request since `exporter` was cleared."""
    names = ("executor.request", "executor.queue", "executor.prefill", "executor.decode")

    def complete():
        done = exporter.get_finished_spans()
        gateway = [s for s in done if s.name == f"POST {path}"]
        executor = {s.name: s for s in done if s.name in names}
        return (gateway[0], executor, done) if len(gateway) == 1 and set(executor) == set(names) else None

    return wait_for(complete, f"the gateway's and the executor's spans of POST {path}")


def assert_one_trace(gateway, mine: dict, every: tuple, model: str, input_tokens: int, output_tokens: int) -> None:
    assert gateway.kind == trace.SpanKind.SERVER
    attrs = gateway.attributes
    assert attrs["gen_ai.request.model"] == model and attrs["gen_ai.request.max_tokens"] == 8
    assert attrs["gen_ai.usage.input_tokens"] == input_tokens
    assert attrs["gen_ai.usage.output_tokens"] == output_tokens
    assert attrs["http.response.status_code"] == 200

    trace_ids = {name: hex(s.context.trace_id) for name, s in mine.items()}
    assert set(trace_ids.values()) == {hex(gateway.context.trace_id)}, \
        f"the executor's spans are not in the gateway's trace {gateway.context.trace_id:#x}: {trace_ids}"
    # The executor's root span hangs under the gateway's server span (possibly through spans between).
    by_id = {s.context.span_id: s for s in every if s.context.trace_id == gateway.context.trace_id}
    root = mine["executor.request"]
    chain, span = [], root
    while span.parent is not None and span.context.span_id != gateway.context.span_id:
        span = by_id.get(span.parent.span_id)
        assert span is not None, f"executor.request's parent chain {chain} leaves the trace before the gateway"
        chain.append(span.name)
    assert span.context.span_id == gateway.context.span_id, f"executor.request is not under the gateway: {chain}"
    for phase in ("executor.queue", "executor.prefill", "executor.decode"):
        assert mine[phase].parent.span_id == root.context.span_id
        assert mine[phase].context.trace_id == gateway.context.trace_id
    assert gateway.start_time <= root.start_time <= root.end_time <= gateway.end_time
    assert root.attributes["gen_ai.request.model"] == model
    assert root.attributes["gen_ai.usage.input_tokens"] == input_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == output_tokens


def test_one_trace_from_http_to_the_executors_decode_span(nats_server, spans):
    services = LoopThread()
    executor = ExecutorService(ExecutorConfig(
        executor_id="exec-tr", nats_url=nats_server.url,
        engine=EngineConfig(memory_budget=700 << 20, max_model_len=1024)))
    monitor = MonitorService(MonitorConfig(nats_url=nats_server.url))
    buses: list[Bus] = []

    async def start_services():
        buses.append(await Bus.connect(nats_server.url, "executor-exec-tr"))
        buses.append(await Bus.connect(nats_server.url, "monitor"))
        await executor.start(buses[0])
        await monitor.start(buses[1])

    async def stop_services():
        await executor.stop(drain_timeout_s=5)
        await monitor.stop()
        for bus in buses:
            await bus.close()

    port = free_port()
    config = GatewayConfig(nats_url=nats_server.url, host="127.0.0.1", port=port, gateway_id="gw-tr")
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    gateway_thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    base = f"http://127.0.0.1:{port}"
    try:
        services.run(start_services())
        gateway_thread.start()
        wait_for(lambda: server.started or not gateway_thread.is_alive(), "uvicorn to start", 20)
        assert server.started, "the gateway did not start"
        wait_for(lambda: httpx.get(f"{base}/ready").status_code == 200, "/ready to answer 200", 20)

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        [model] = [m.id for m in client.models.list().data]
        assert model == "SmolLM2-135M-Instruct"
        messages = [{"role": "user", "content": f"What colour is a {SECRET}? Answer in one word."}]

        spans.clear()
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        gateway, mine, every = request_spans(spans, "/v1/chat/completions")
        assert_one_trace(gateway, mine, every, model, reply.usage.prompt_tokens, reply.usage.completion_tokens)
        first_trace = gateway.context.trace_id
        every_span = list(spans.get_finished_spans())

        spans.clear()
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert text == reply.choices[0].message.content  # greedy: the same answer both ways
        assert usage.completion_tokens == reply.usage.completion_tokens
        gateway, mine, every = request_spans(spans, "/v1/chat/completions")
        assert_one_trace(gateway, mine, every, model, usage.prompt_tokens, usage.completion_tokens)
        assert gateway.context.trace_id != first_trace, "two requests ended up in one trace"
        every_span += spans.get_finished_spans()

        leaks = [(s.name, k) for s in every_span for k, v in (s.attributes or {}).items() if SECRET in str(v)]
        assert not leaks, f"the prompt text is recorded in span attributes: {leaks}"
    finally:
        server.should_exit = True
        gateway_thread.join(15)
        try:
            services.run(stop_services())
        finally:
            services.close()
    assert not gateway_thread.is_alive(), "the gateway did not shut down"
    assert not executor.engine.has_unfinished()


class EventLog:
    def __init__(self):
        self.events: list[Event] = []

    async def on_event(self, incoming) -> None:
        if incoming.message.kind == "command":
            self.events.append(incoming.message)

    async def audit_of(self, seq: int, timeout: float = 5.0) -> Event:
        deadline = time.monotonic() + timeout
        while not (found := [e for e in self.events if e.data["seq"] == seq]):
            assert time.monotonic() < deadline, f"no audit event for seq {seq}; have {self.events}"
            await asyncio.sleep(0.02)
        assert len(found) == 1, f"seq {seq} was audited {len(found)} times"
        return found[0]


def test_command_sender_against_a_real_executor(nats_server, tmp_path):
    path = write_tiny_llama3(tmp_path / "m")
    service = ExecutorService(ExecutorConfig(
        executor_id="exec-cmd", nats_url=nats_server.url,
        engine=EngineConfig(model=str(path), memory_budget=4 << 20, block_size=8, max_model_len=256)))
    engine = service.engine
    # On demand the engine thread runs a few steps and is then held inside the next one, so that a
    # request is reliably in flight when the drain arrives (the tiny model finishes in milliseconds).
    gate = threading.Event()
    allowed: list[int | None] = [None]  # steps left before holding; None: never hold
    real_step = engine.step

    def gated_step():
        if allowed[0] is not None:
            if allowed[0] <= 0:
                gate.wait(20)
            else:
                allowed[0] -= 1
        return real_step()

    engine.step = gated_step

    async def scenario():
        exec_bus = await Bus.connect(nats_server.url, "executor-exec-cmd")
        ctl_bus = await Bus.connect(nats_server.url, "controller")
        watch_bus = await Bus.connect(nats_server.url, "watcher")
        await service.start(exec_bus)
        log = EventLog()
        deltas = []

        async def on_tokens(incoming):
            deltas.extend(incoming.message.deltas)

        await watch_bus.subscribe(subjects.EVENTS, Event, log.on_event)
        await watch_bus.subscribe(subjects.tokens("gw-cmd"), TokenBatch, on_tokens)
        await watch_bus.flush()
        sender = CommandSender(ctl_bus, "ctl-test", timeout_s=1.0, retries=2)

        async def infer(request_id: str, max_tokens: int) -> Admission:
            req = GenerateRequest(request_id=request_id, gateway="gw-cmd", arrival_time=time.time(), prompt="hello",
                                  sampling=SamplingOptions(max_tokens=max_tokens, ignore_eos=True))
            return await watch_bus.request(subjects.infer("exec-cmd"), req, Admission, timeout=5)

        try:
            ping = await sender.send("exec-cmd", PingArgs(), "a test pings")
            assert ping.ok and ping.executor == "exec-cmd" and ping.kind == "ping" and ping.error is None
            assert ping.state == {"running": 0, "waiting": 0, "draining": False}
            audit = await log.audit_of(ping.seq)
            assert audit.source == "ctl-test"
            assert audit.data | {"latency_s": 0} == {"executor": "exec-cmd", "kind": "ping", "seq": ping.seq,
                                                     "args": {}, "reason": "a test pings", "ok": True,
                                                     "error": None, "state": ping.state, "attempts": 1,
                                                     "latency_s": 0}
            assert 0 < audit.data["latency_s"] < 1.0

            # Bad commands are answered, refused, with the culprit named; they change nothing.
            for seq, kind, args, culprit in ((1, "replicate", {"layer": 0}, "unknown command kind 'replicate'"),
                                             (2, "quantize", {"layers": 1, "bits": 5}, "args.bits"),
                                             (3, "quantize", {"layers": 1}, "args.bits"),
                                             (4, "restore", {"layers": True}, "args.layers"),
                                             (5, "ping", {"now": 1}, "args.now")):
                bad = await ctl_bus.request(subjects.command("exec-cmd"), Command(seq=seq, issuer="fuzz", kind=kind,
                                                                                   args=args), CommandResult, timeout=5)
                assert not bad.ok and bad.kind == kind and culprit in bad.error, bad.error
            assert engine.model.layer_bits == [engine.model.full_bits] * len(engine.model.layer_bits)
            assert (await sender.send("exec-cmd", PingArgs())).ok  # bad commands did not hurt the executor

            # One request held in flight, then drain: the executor records 1 in flight and refuses new work.
            allowed[0] = 3  # prefill and two decode steps, then hold
            assert (await infer("busy", max_tokens=20)).accepted
            deadline = time.monotonic() + 10
            while not (service.worker.snapshot.in_flight == 1 and deltas):
                assert time.monotonic() < deadline, "the request never got going"
                await asyncio.sleep(0.01)
            drain = await sender.send("exec-cmd", DrainArgs())
            assert drain.ok and drain.state == {"in_flight": 1} and service.draining
            refused = await infer("late", max_tokens=4)
            assert not refused.accepted and refused.error.type == "unavailable"
            allowed[0] = None
            gate.set()
            deadline = time.monotonic() + 10
            while not any(d.finished for d in deltas):  # draining lets in-flight work finish
                assert time.monotonic() < deadline, "the in-flight request did not finish while draining"
                await asyncio.sleep(0.01)
            assert [d for d in deltas if d.finished][0].output_tokens == 20
            while service.worker.snapshot.in_flight:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

            # The same seq again is answered from the record, not re-run: the recorded drain still says
            # 1 in flight and the recorded ping still says not draining; a fresh seq sees today's state.
            again = await ctl_bus.request(subjects.command("exec-cmd"),
                                          Command(seq=drain.seq, issuer="ctl-test", kind="drain"),
                                          CommandResult, timeout=5)
            assert again == drain
            old_ping = await ctl_bus.request(subjects.command("exec-cmd"),
                                             Command(seq=ping.seq, issuer="ctl-test", kind="ping"),
                                             CommandResult, timeout=5)
            assert old_ping == ping
            fresh = await sender.send("exec-cmd", DrainArgs())
            assert fresh.ok and fresh.seq > drain.seq and fresh.state == {"in_flight": 0}
            assert (await sender.send("exec-cmd", PingArgs())).state["draining"] is True

            # Nobody listens: every attempt fails at once ("no responders"), the sender gives up.
            started = time.monotonic()
            ghost = await sender.send("exec-nobody", PingArgs())
            elapsed = time.monotonic() - started
            assert not ghost.ok and ghost.executor == "exec-nobody"
            assert "no answer after 3 attempt(s)" in ghost.error and "no responders" in ghost.error
            assert elapsed < 1.0 * 3 + 1.0
            assert (await log.audit_of(ghost.seq)).data["attempts"] == 3

            # Someone listens but never answers: three timeouts, then ok=False, within the bound.
            heard: list[int] = []

            async def silent(incoming):
                heard.append(incoming.message.seq)

            await watch_bus.subscribe(subjects.command("exec-silent"), Command, silent)
            await watch_bus.flush()
            started = time.monotonic()
            mute = await sender.send("exec-silent", DrainArgs())
            elapsed = time.monotonic() - started
            assert not mute.ok and "no reply within 1.0 s" in mute.error
            for _ in range(40):  # the watcher's callback may trail the sender's last timeout a little
                if len(heard) >= 3:
                    break
                await asyncio.sleep(0.05)
            assert heard == [mute.seq] * 3  # each retry carries the same seq
            assert 3.0 <= elapsed < 1.0 * 3 + 1.0
        finally:
            allowed[0] = None
            gate.set()
            await service.stop(drain_timeout_s=5)
            for bus in (watch_bus, ctl_bus, exec_bus):
                await bus.close()

    try:
        asyncio.run(scenario())
    finally:
        del engine.step
    assert not engine.has_unfinished()
