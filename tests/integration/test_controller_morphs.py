"""The morphing controller and the static baselines, end to end on the real system.

MorphServe's claim is about a whole loop, not a function: a burst fills the KV cache, the monitor
sees it, the controller quantizes layers, the executor turns the freed slot tails into KV pages
while requests keep running, and after the burst every layer comes back to full precision. The
unit tests check each piece; only this test checks that the pieces agree on the bus (telemetry
read by the policy, commands the executor accepts, audit events) and that no request is lost on
the way. So it runs real processes, the default model, and an arena cut so small that a burst
of a dozen requests saturates it.

Only the calm run before each restore is shortened (5 windows, one second, instead of 25), so that
giving back 15 layers four at a time fits in a test; marks, steps and the 20 s dwell are the
performance preset's own. A shorter dwell makes the policy turn round in mid-burst: it restores as
soon as the KV in use fits, and the running sequences grow back into the pages it took.
"""

import asyncio
import threading
import time

import httpx
import openai
import pytest

from shared import subjects
from shared.bus import Bus
from shared.messages import Event
from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
PAGE_BYTES = 737_280  # one KV block of the default model in float32: 16 tokens × 30 layers × K and V
SLOT_PAGES = 600  # its 30 decoder layers at full precision
KV_PAGES = 48  # besides the slots: room for ~4 of the burst's sequences at once
BURST = 12
MAX_TOKENS = 150
RESTORE_WITHIN_S = 90.0

SMALL_ARENA = ("--memory-budget", str((SLOT_PAGES + KV_PAGES) * PAGE_BYTES), "--max-model-len", "512")


class ClusterWatch:
    """Polls /v1/cluster in a thread, so that the samples keep coming while the burst's client
    coroutines keep the event loop busy."""

    def __init__(self, url: str, interval_s: float = 0.25):
        self.url, self.interval_s = url, interval_s
        self.samples: list[tuple[float, list[int], int]] = []  # (monotonic time, layer bits, pages_extension)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ClusterWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                try:
                    (e,) = client.get(f"{self.url}/v1/cluster").json()["executors"]
                    self.samples.append((time.monotonic(), e["layers"], e["kv"]["pages_extension"]))
                except (httpx.HTTPError, ValueError, KeyError):
                    pass  # a slow answer under load is a missing sample, not a failure
                self._stop.wait(self.interval_s)

    def first(self, predicate, after: float = 0.0) -> float | None:
        return next((t for t, layers, ext in self.samples if t >= after and predicate(layers, ext)), None)


async def _stream_one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None, int | None]:
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Tell story number {i} about a lighthouse."}],
        max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, finish, tokens = [], None, None
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), finish, tokens


async def _burst(url: str) -> list:
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600) as client:
        return await asyncio.gather(*(_stream_one(client, i) for i in range(BURST)), return_exceptions=True)


@pytest.fixture
def morphing(tmp_path):
    system = System(tmp_path, executor_args=SMALL_ARENA, controller_args=(
        "--mode", "performance", "--morph-set", "leave_windows=5")).start()
    yield system
    system.stop()


# `morphing` before `morphling_events`: fixtures stop in reverse order, so the event log closes its
# connection while the nats-server it talks to still runs.
def test_a_burst_quantizes_layers_and_the_lull_restores_them(morphing, morphling_events):
    system = morphing
    (start,) = system.cluster()["executors"]
    full = max(start["layers"])
    assert set(start["layers"]) == {full} and start["kv"]["pages_extension"] == 0
    assert start["kv"]["pages_base"] <= KV_PAGES + 1  # the arena is as small as the test means it

    events = morphling_events(system.nats.url)
    with ClusterWatch(system.url) as watch:
        burst_start = time.monotonic()
        results = asyncio.run(_burst(system.url))
        burst_end = time.monotonic()
        restored = None
        while time.monotonic() - burst_end < RESTORE_WITHIN_S:
            (e,) = system.cluster()["executors"]
            if set(e["layers"]) == {full} and e["kv"]["pages_extension"] == 0:
                restored = time.monotonic()
                break
            time.sleep(0.25)

    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, f"requests failed during the morphing: {failures!r}\n{system.log('exec0')}"
    for text, finish, tokens in results:
        assert finish == "length" and tokens == MAX_TOKENS and text

    quantized_at = watch.first(lambda layers, ext: min(layers) < full and ext > 0, after=burst_start)
    assert quantized_at is not None and quantized_at < burst_end, \
        f"no quantized layers seen during the burst\n{system.log('controller')}\n{system.log('exec0')}"
    assert restored is not None, (f"layers not back to full precision {RESTORE_WITHIN_S:.0f} s after the burst: "
                                  f"{system.cluster()}\n{system.log('controller')}")
    deepest = max(sum(b < full for b in layers) for _, layers, _ in watch.samples)
    print(f"\nburst of {BURST}x{MAX_TOKENS} tokens: {burst_end - burst_start:.1f} s; first quantized layers seen "
          f"at +{quantized_at - burst_start:.1f} s; at most {deepest} layers quantized and "
          f"{max(x for _, _, x in watch.samples)} pages gained; all at full precision "
          f"{restored - burst_end:.1f} s after the burst")

    # The audit of the last restore may arrive a moment after the telemetry that showed it.
    commands = [e.data for e in events.wait_for(_every_quantized_layer_restored)]
    refused = [d for d in commands if not d["ok"] or d["executor"] != "exec0"]
    assert not refused, f"{refused}\n{system.log('controller')}\n{system.log('exec0')}"
    kinds = [d["kind"] for d in commands]
    assert kinds[0] == "quantize" and kinds[-1] == "restore", kinds
    assert _every_quantized_layer_restored(commands), commands
    # The controller climbs the executor's own LIS order and says why it acted.
    first = commands[0]["args"]["layers"]
    assert first == start["swap_order"][:len(first)], (first, start["swap_order"])
    # A quantize comes after a run of windows or at once on pressure events; either way the reason has the load.
    assert all(("windows: KV" in d["reason"] or "more since the last state: KV" in d["reason"]) for d in commands), \
        [d["reason"] for d in commands]
    wall_start = time.time() - (time.monotonic() - burst_start)
    print("commands (s after the burst began):",
          [(round(e.time - wall_start, 1), e.data["kind"], e.data["args"], f"{e.data['latency_s']:.2f} s")
           for e in events.got])


def _every_quantized_layer_restored(commands: list[dict]) -> bool:
    quantized = {i for d in commands if d["kind"] == "quantize" for i in d["args"]["layers"]}
    restored = {i for d in commands if d["kind"] == "restore" for i in d["args"]["layers"]}
    return bool(quantized) and quantized <= restored


class EventLog:
    """The command audit events of one run, collected by a Bus in its own thread and event loop."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.got: list[Event] = []
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "could not subscribe to the events subject"

    async def _run(self) -> None:
        self._loop, self._done = asyncio.get_running_loop(), asyncio.Event()
        bus = await Bus.connect(self.nats_url, "test-events")

        async def on_event(incoming) -> None:
            if incoming.message.kind == "command":
                with self._lock:
                    self.got.append(incoming.message)

        await bus.subscribe(subjects.EVENTS, Event, on_event)
        await bus.flush()
        self._ready.set()
        await self._done.wait()
        await bus.close()

    def wait_for(self, predicate, timeout: float = 30.0) -> list[Event]:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                got = list(self.got)
            if predicate([e.data for e in got]) or time.monotonic() > deadline:
                return got
            time.sleep(0.1)

    def close(self) -> None:
        if self._loop is not None and self._done is not None:
            self._loop.call_soon_threadsafe(self._done.set)
        self._thread.join(timeout=10)


@pytest.fixture
def morphling_events():
    logs: list[EventLog] = []

    def open_log(nats_url: str) -> EventLog:
        logs.append(EventLog(nats_url))
        return logs[-1]

    yield open_log
    for log in logs:
        log.close()


def test_static_int8_baseline_serves_with_every_layer_quantized(tmp_path):
    system = System(tmp_path, executor_args=(*SMALL_ARENA, "--static-bits", "8")).start()
    try:
        (e,) = system.cluster()["executors"]
        assert set(e["layers"]) == {8}
        # Every slot's tail is KV now: far more than the base pages.
        assert e["kv"]["pages_extension"] > e["kv"]["pages_base"] > 0
        assert "static INT8: 30 layers quantized" in system.log("exec0")
        client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=120)
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                              max_tokens=16, temperature=0)
        assert chat.choices[0].message.content.strip()
        assert chat.usage.completion_tokens > 0
    finally:
        system.stop()
