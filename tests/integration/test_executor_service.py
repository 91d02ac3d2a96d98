"""The executor service over a real nats-server, driven through shared.bus exactly as the gateway drives it.

Engines are loaded once per module (the default model takes seconds) and handed to a fresh
ExecutorService per test: a service leaves its engine empty when it stops, so they can be reused.
The tiny checkpoint runs one sequence at a time behind a two-slot waiting queue, which makes a flood
of requests overflow deterministically.
"""

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.service import ExecutorService
from shared import subjects
from shared.bus import Bus, decode
from shared.config import EngineConfig, ExecutorConfig
from shared.core.planner.latency import DECODE_FEATURES, PREFILL_FEATURES, FittedLatency
from shared.messages import (SCHEMA_VERSION, Admission, Cancel, Command, CommandResult, ExecutorTelemetry,
                             GenerateRequest, TokenBatch, TokenDelta)
from shared.sampling import SamplingOptions
from shared.telemetry import tracer
from tests.checkpoints import tiny_llama3_engine

ROOT = Path(__file__).resolve().parents[2]
EXEC = "exec-t"
GW = "gw-t"


@pytest.fixture(scope="module")
def smol():
    return LLMEngine(EngineConfig(memory_budget=700 << 20, max_model_len=2048), progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama3_engine(tmp_path_factory.mktemp("tiny") / "model", max_num_seqs=2, max_waiting=2)


class Gateway:
    """The gateway's side of the protocol: admissions by request/reply, deltas collected per request."""

    def __init__(self, bus: Bus):
        self.bus = bus
        self.deltas: dict[str, list[TokenDelta]] = {}
        self.telemetry: list[ExecutorTelemetry] = []

    async def start(self) -> None:
        async def on_tokens(incoming):
            assert incoming.message.executor == EXEC
            for d in incoming.message.deltas:
                self.deltas.setdefault(d.request_id, []).append(d)

        async def on_telemetry(incoming):
            self.telemetry.append(incoming.message)

        await self.bus.subscribe(subjects.tokens(GW), TokenBatch, on_tokens)
        await self.bus.subscribe(subjects.telemetry(EXEC), ExecutorTelemetry, on_telemetry)
        await self.bus.flush()

    async def admit(self, request_id: str, timeout: float = 10.0, **fields) -> Admission:
        req = GenerateRequest(request_id=request_id, gateway=GW, arrival_time=time.time(), **fields)
        return await self.bus.request(subjects.infer(EXEC), req, Admission, timeout=timeout)

    async def finished(self, request_id: str, n: int = 1, timeout: float = 60.0) -> list[TokenDelta]:
        deadline = time.monotonic() + timeout
        while sum(d.finished for d in self.deltas.get(request_id, [])) < n:
            assert time.monotonic() < deadline, f"{request_id} did not finish: {self.deltas.get(request_id)}"
            await asyncio.sleep(0.02)
        return self.deltas[request_id]

    async def raw_request(self, subject: str, body: dict, reply_model):
        """A request whose body is sent as given, valid or not."""
        reply = await self.bus._nc.request(subject, msgpack.packb(body), timeout=5)
        return decode(reply.data, reply_model)

    async def command(self, seq: int, kind: str, issuer: str = "ctl-t", args: dict | None = None) -> CommandResult:
        return await self.bus.request(subjects.command(EXEC), Command(seq=seq, issuer=issuer, kind=kind,
                                                                      args=args or {}), CommandResult, timeout=5)

    async def telemetry_where(self, check, timeout: float = 5.0) -> ExecutorTelemetry:
        deadline = time.monotonic() + timeout
        while not (self.telemetry and check(self.telemetry[-1])):
            assert time.monotonic() < deadline, f"telemetry never matched; last {self.telemetry[-1:]}"
            await asyncio.sleep(0.02)
        return self.telemetry[-1]


@contextlib.asynccontextmanager
async def serving(url: str, engine: LLMEngine):
    exec_bus = await Bus.connect(url, "executor")
    service = ExecutorService(ExecutorConfig(executor_id=EXEC, nats_url=url, engine=engine.config), engine=engine)
    await service.start(exec_bus)
    gw = Gateway(await Bus.connect(url, "gateway"))
    await gw.start()
    try:
        yield service, gw
    finally:
        await service.stop(drain_timeout_s=5)
        await gw.bus.close()
        await exec_bus.close()
    assert not engine.has_unfinished()


def text_of(deltas: list[TokenDelta], index: int = 0) -> str:
    return "".join(d.text for d in deltas if d.index == index)


def test_generation_matches_the_engine_and_bad_requests_are_refused(nats_server, smol):
    prompt = "The capital of France is"
    [want] = smol.generate([prompt], SamplingOptions(temperature=0, max_tokens=12))

    async def scenario():
        async with serving(nats_server.url, smol) as (service, gw):
            adm = await gw.admit("r1", prompt=prompt, sampling=SamplingOptions(temperature=0, max_tokens=12))
            assert adm.accepted and adm.executor == EXEC and adm.prompt_tokens == want.num_prompt_tokens
            deltas = await gw.finished("r1")
            assert text_of(deltas) == want.outputs[0].text
            assert [t for d in deltas for t in d.token_ids] == want.outputs[0].token_ids
            assert deltas[-1].finish_reason == want.outputs[0].finish_reason
            assert deltas[-1].output_tokens == len(want.outputs[0].token_ids)

            chat = await gw.admit("c1", messages=[{"role": "user", "content": "Say hi."}],
                                  sampling=SamplingOptions(temperature=0, max_tokens=4))
            assert chat.accepted and chat.prompt_tokens > 5  # the template's framing was added
            assert text_of(await gw.finished("c1"))

            # Sent as a client that skips validation would: refused by name, like any invalid request.
            body = GenerateRequest(request_id="bad1", gateway=GW, arrival_time=time.time(), prompt=prompt).model_dump()
            body["sampling"]["temperature"] = 5
            hot = await gw.raw_request(subjects.infer(EXEC), body, Admission)
            assert not hot.accepted and hot.error.type == "invalid_request_error"
            assert hot.error.param == "temperature"
            odd = await gw.raw_request(subjects.infer(EXEC), {"v": SCHEMA_VERSION - 1, "request_id": "old"}, Admission)
            assert not odd.accepted and odd.request_id == "old" and "schema version" in odd.error.message
            long = await gw.admit("bad2", prompt=[1] * 2000, sampling=SamplingOptions(max_tokens=100))
            assert not long.accepted and long.error.type == "invalid_request_error"
            assert long.error.param == "max_tokens" and "maximum context length is 2048" in long.error.message
            empty = await gw.admit("bad3")
            assert not empty.accepted and empty.error.param == "prompt"
            assert "bad1" not in gw.deltas and "bad2" not in gw.deltas

            # telemetry: a heartbeat, over and over, with the ledger's numbers
            await asyncio.sleep(0.3)
            seen = len(gw.telemetry)
            await asyncio.sleep(2.0)
            assert len(gw.telemetry) - seen >= 3
            t = gw.telemetry[-1]
            assert t.model == "SmolLM2-135M-Instruct" and t.max_model_len == 2048 and t.block_size == 16
            assert t.layers == [32] * 30 and t.page_bytes == smol.arena.page_bytes
            assert t.kv.pages_used == 0 and t.kv.pages_free > 0
            assert t.kv.pages_total == t.kv.pages_slot + t.kv.pages_free + t.kv.pages_used
            assert t.kv.pages_base + t.kv.pages_extension == t.kv.pages_free + t.kv.pages_used
            assert t.running == 0 and t.waiting == 0 and t.max_waiting == 256 and not t.draining
            assert t.generated_tokens >= 16 and t.prompt_tokens >= want.num_prompt_tokens
            assert 0 < t.ttft_s < 10 and 0 < t.tpot_s < 5 and 0 <= t.queue_delay_s <= t.ttft_s
            assert t.gpu is None

    asyncio.run(scenario())


def test_cancel_mid_generation_aborts_and_frees_pages(nats_server, smol):
    async def scenario():
        async with serving(nats_server.url, smol) as (service, gw):
            adm = await gw.admit("long", prompt="Once upon a time",
                                 sampling=SamplingOptions(max_tokens=1500, ignore_eos=True, seed=1))
            assert adm.accepted
            busy = await gw.telemetry_where(lambda t: t.kv.pages_used > 0 and t.running == 1)
            assert busy.kv.pages_used > 0
            while len(gw.deltas.get("long", [])) < 3:
                await asyncio.sleep(0.01)
            await gw.bus.publish(subjects.cancel(EXEC), Cancel(request_id="long"))
            deltas = await gw.finished("long", timeout=10)
            assert deltas[-1].finish_reason == "abort" and deltas[-1].finished
            assert 3 <= deltas[-1].output_tokens < 1500
            await gw.telemetry_where(lambda t: t.kv.pages_used == 0 and t.running == 0)
            await gw.bus.publish(subjects.cancel(EXEC), Cancel(request_id="never-existed"))  # ignored
            assert (await gw.command(1, "ping")).ok

    asyncio.run(scenario())


def test_an_admission_is_answered_while_the_engine_prefills_a_long_prompt(nats_server, smol):
    long_prompt = [(7 * k) % 5000 + 100 for k in range(500)]  # one prefill step, most of a second on a CPU
    few = SamplingOptions(max_tokens=4, ignore_eos=True)

    async def scenario():
        async with serving(nats_server.url, smol) as (service, gw):
            generated = smol.stats().generated_tokens
            assert (await gw.admit("long", prompt=long_prompt, sampling=few)).accepted
            while not smol.scheduler.running:  # its prefill step has begun
                await asyncio.sleep(0.001)
            short = await gw.admit("short", prompt="Hello", sampling=few, timeout=5)
            # Answered during that step, not after it: the step's token was not generated yet.
            assert short.accepted and smol.stats().generated_tokens == generated
            for request_id in ("long", "short"):
                assert (await gw.finished(request_id))[-1].output_tokens == 4

    asyncio.run(scenario())


def test_a_flood_overflows_the_waiting_queue(nats_server, tiny):
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            answers = await asyncio.gather(*[
                gw.admit(f"f{i}", prompt="hello world", sampling=SamplingOptions(max_tokens=40, ignore_eos=True))
                for i in range(12)])
            accepted = [a.request_id for a in answers if a.accepted]
            full = [a for a in answers if not a.accepted]
            assert accepted and full and all(a.error.type == "queue_full" for a in full)
            for request_id in accepted:
                assert (await gw.finished(request_id))[-1].output_tokens == 40
            assert not any(a.request_id in gw.deltas for a in full)

    asyncio.run(scenario())


def test_a_flood_of_refusals_reports_pressure_at_once_but_once_between_two_beats(nats_server, tiny):
    """Every refusal of a full queue is new pressure. The first since a beat goes out at once; the rest ride on
    the next beat, so that a flood of refusals does not flood the monitor with reports it reads the newest of."""
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            interval = service.config.telemetry_interval_s
            sampling = SamplingOptions(max_tokens=40, ignore_eos=True)
            await gw.telemetry_where(lambda t: True)
            seen, began, sent, refused = len(gw.telemetry), time.monotonic(), 0, 0
            while time.monotonic() - began < 1.5:
                answers = await asyncio.gather(*[gw.admit(f"o{sent + i}", prompt="hello", sampling=sampling)
                                                 for i in range(4)])
                sent, refused = sent + 4, refused + sum(not a.accepted for a in answers)
            beats = (time.monotonic() - began) / interval + 1
            assert refused > 4 * beats  # pressure rose far more often than reports may go out
            assert len(gw.telemetry) - seen <= 2 * beats + 1
            assert (await gw.telemetry_where(lambda t: t.rejected == refused)).rejected == refused

    asyncio.run(scenario())


def test_every_completion_of_a_cancelled_request_gets_a_final_delta(nats_server, tiny):
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            busy = await gw.admit("busy", prompt="hello", sampling=SamplingOptions(max_tokens=200, ignore_eos=True))
            two = await gw.admit("two", prompt="hello", sampling=SamplingOptions(n=2, max_tokens=5))
            assert busy.accepted and two.accepted
            await gw.bus.publish(subjects.cancel(EXEC), Cancel(request_id="two"))  # still waiting: not forked
            deltas = await gw.finished("two", n=2, timeout=10)
            assert sorted(d.index for d in deltas if d.finished) == [0, 1]
            assert {d.finish_reason for d in deltas} == {"abort"}
            await gw.bus.publish(subjects.cancel(EXEC), Cancel(request_id="busy"))
            await gw.finished("busy")

    asyncio.run(scenario())


def test_commands_ping_drain_idempotence_and_unknown_kinds(nats_server, tiny):
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            ping = await gw.command(1, "ping")
            assert ping.ok and ping.executor == EXEC and ping.state == {"running": 0, "waiting": 0,
                                                                        "draining": False}
            other = await gw.command(2, "teleport")
            assert not other.ok and "unknown command kind 'teleport'" in other.error
            # Not even a Command (no kind): still answered, refused, as long as it says who asks.
            broken = await gw.raw_request(subjects.command(EXEC), {"v": SCHEMA_VERSION, "seq": 7, "issuer": "ctl-t"},
                                          CommandResult)
            assert not broken.ok and broken.seq == 7 and "kind" in broken.error
            bad = await gw.command(4, "quantize", args={"layers": 99, "bits": 8})
            assert not bad.ok and "quantize refused" in bad.error
            quant = await gw.command(5, "quantize", args={"layers": 2, "bits": 8})
            assert quant.ok and quant.state["layers"][:2] == [8, 8] and quant.state["pages_released"] > 0
            await gw.telemetry_where(lambda t: t.layers[:2] == [8, 8]
                                     and t.kv.pages_extension == quant.state["pages_released"])
            back = await gw.command(6, "restore", args={"layers": 2})
            assert back.ok and set(back.state["layers"]) == {32} and back.state["pages_reclaimed"] > 0
            drain = await gw.command(3, "drain")
            assert drain.ok and drain.state == {"in_flight": 0}
            again = await gw.command(1, "ping")  # answered from the record: it still says not draining
            assert again == ping
            assert (await gw.command(1, "ping", issuer="other")).state["draining"] is True
            refused = await gw.admit("late", prompt="hi")
            assert not refused.accepted and refused.error.type == "unavailable"
            await gw.telemetry_where(lambda t: t.draining)

    asyncio.run(scenario())


def test_garbage_logprobs_and_a_failing_step_do_not_stop_the_service(nats_server, tiny):
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            await gw.bus._nc.publish(subjects.infer(EXEC), b"\xc1 garbage", reply="_INBOX.nobody")
            await gw.bus._nc.publish(subjects.infer(EXEC), msgpack.packb({"v": SCHEMA_VERSION, "request_id": 3}))
            adm = await gw.admit("lp", prompt="hello", sampling=SamplingOptions(max_tokens=3, logprobs=2,
                                                                                 temperature=0))
            assert adm.accepted
            deltas = await gw.finished("lp")
            entries = [e for d in deltas for e in (d.logprobs or [])]
            assert [e.token_id for e in entries] == [t for d in deltas for t in d.token_ids]
            assert all(len(e.top) == 2 and e.logprob <= 0 for e in entries)
            assert entries[0].token == tiny.tokenizer.decode([entries[0].token_id], skip_special_tokens=False)

            real_step = tiny.step
            calls = 0

            def flaky_step():
                nonlocal calls
                calls += 1
                if calls == 1:
                    raise RuntimeError("simulated kernel failure")
                return real_step()

            tiny.step = flaky_step
            try:
                assert (await gw.admit("boom", prompt="hello", sampling=SamplingOptions(max_tokens=5))).accepted
                [err] = await gw.finished("boom")
                assert err.finish_reason == "error" and err.error.type == "internal_error"
                assert (await gw.admit("after", prompt="hello", sampling=SamplingOptions(max_tokens=5))).accepted
                assert (await gw.finished("after"))[-1].finish_reason in ("stop", "length")
            finally:
                del tiny.step
            await gw.telemetry_where(lambda t: t.kv.pages_used == 0)

    asyncio.run(scenario())


def test_request_spans_join_the_gateway_trace(nats_server, tiny, spans):
    async def scenario():
        async with serving(nats_server.url, tiny) as (service, gw):
            with tracer("test").start_as_current_span("gateway.request") as parent:
                adm = await gw.admit("traced", prompt="hello", sampling=SamplingOptions(max_tokens=4, temperature=0.5,
                                                                               ignore_eos=True))
            assert adm.accepted
            await gw.finished("traced")
            deadline = time.monotonic() + 5
            while not any(s.name == "executor.request" for s in spans.get_finished_spans()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
            return parent.get_span_context()

    parent_ctx = asyncio.run(scenario())
    mine = {s.name: s for s in spans.get_finished_spans() if s.context.trace_id == parent_ctx.trace_id}
    assert {"executor.request", "executor.queue", "executor.prefill", "executor.decode"} <= set(mine)
    root = mine["executor.request"]
    assert root.parent.span_id == parent_ctx.span_id
    for phase in ("executor.queue", "executor.prefill", "executor.decode"):
        assert mine[phase].parent.span_id == root.context.span_id
        assert root.start_time <= mine[phase].start_time <= mine[phase].end_time <= root.end_time
    assert mine["executor.queue"].end_time <= mine["executor.prefill"].start_time
    attrs = root.attributes
    assert attrs["gen_ai.system"] == "morphling" and attrs["gen_ai.request.model"] == "model"
    assert attrs["gen_ai.request.max_tokens"] == 4 and attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.usage.input_tokens"] > 0
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == ("length",)
    assert not any("hello" in str(v) for v in attrs.values())


DECODE_S = {16: 0.004, 8: 0.006, 4: 0.005}  # a layer's decode at each width, whatever the batch and context
PREFILL_S = 0.01  # a layer's prefill at every width


def write_latency_profile(path: Path, layers: object) -> Path:
    """A `morphling profile --latency` JSON for layers of the shape of `layers` whose decode takes DECODE_S and
    prefill PREFILL_S."""
    shape = {k: getattr(layers, k) for k in ("hidden_size", "intermediate_size", "num_kv_heads")}
    path.write_text(json.dumps(FittedLatency("cpu", shape, {
        "prefill": {b: [PREFILL_S] + [0.0] * (len(PREFILL_FEATURES) - 1) for b in DECODE_S},
        "decode": {b: [s] + [0.0] * (len(DECODE_FEATURES) - 1) for b, s in DECODE_S.items()}}).to_profile()))
    return path


def executor_process(nats_url: str, model: str, *flags: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-c", "import sys; from services.executor.process import main; sys.exit(main(sys.argv[1:]))",
           "--nats", nats_url, "--id", EXEC, "--model", model, "--memory-budget", "4MiB",
           "--block-size", "8", "--max-model-len", "256", *flags]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_main_serves_until_sigterm_then_finishes_in_flight_work(nats_server, tiny, tmp_path):
    profile = write_latency_profile(tmp_path / "latency.json", tiny.model_config)
    proc = executor_process(nats_server.url, tiny.config.model, "--latency-profile", str(profile))

    async def scenario():
        gw = Gateway(await Bus.connect(nats_server.url, "gateway"))
        await gw.start()
        idle = await gw.telemetry_where(lambda t: t.model == "model", timeout=60)
        assert idle.layer_seconds == {}  # no step yet: no load to predict at
        assert (await gw.admit("last", prompt="hello", sampling=SamplingOptions(max_tokens=240, ignore_eos=True))
                ).accepted
        while "last" not in gw.deltas:
            await asyncio.sleep(0.01)
        # Decoding, it reports what its profile predicts of its steps of the last ten seconds, full precision under
        # the bits its layers report: the prompt's prefill step, PREFILL_S a layer, and some decode steps, DECODE_S.
        decoding = await gw.telemetry_where(lambda t: t.running == 1 and set(t.layer_seconds) == {32, 8, 4}
                                            and t.layer_seconds[8] > t.layer_seconds[32])
        assert decoding.layers == [32] * len(decoding.layers)
        steps = (decoding.layer_seconds[8] - decoding.layer_seconds[32]) / (DECODE_S[8] - DECODE_S[16])
        assert steps == pytest.approx(round(steps)) and steps >= 1
        assert decoding.layer_seconds == pytest.approx({32: PREFILL_S + steps * DECODE_S[16],
                                                        8: PREFILL_S + steps * DECODE_S[8],
                                                        4: PREFILL_S + steps * DECODE_S[4]})
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        deltas = await gw.finished("last", timeout=30)  # in flight at SIGTERM: it still completes
        assert deltas[-1].finish_reason == "length" and deltas[-1].output_tokens == 240
        assert deltas[-1].timestamps[-1] > signalled
        await gw.bus.close()

    try:
        asyncio.run(scenario())
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_latency_profile_of_other_layers_is_refused_at_start(nats_server, tiny, tmp_path):
    other = write_latency_profile(tmp_path / "other.json", replace(tiny.model_config, hidden_size=4096))
    proc = executor_process(nats_server.url, tiny.config.model, "--latency-profile", str(other))
    try:
        assert proc.wait(timeout=60) == 1
        assert "other.json was measured for layers of {'hidden_size': 4096" in proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

