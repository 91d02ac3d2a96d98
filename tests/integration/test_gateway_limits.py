"""The gateway at its limits, over real HTTP and a real nats-server, with the test playing monitor and
executor (as in test_gateway_http): admissions that time out, bodies the bus cannot carry or that nest
too deep, probes that are not requests, and the bus itself going away and coming back."""

import concurrent.futures
import time

import httpx
import openai
import pytest

from services.gateway.app import BUS_HEADROOM_BYTES
from shared import subjects
from shared.config import GatewayConfig
from shared.messages import Admission, Cancel, ErrorInfo, GenerateRequest
from tests.integration.test_gateway_http import MODEL, Gateways, Peers, assert_error, executor_state, wait_ready


@pytest.fixture
def peers(nats_server):
    p = Peers(nats_server.url)
    yield p
    p.close()


@pytest.fixture
def gateway(nats_server):
    """Start a gateway in this process: (its URL, its Gateway object)."""
    gateways = Gateways(nats_server.url, "gwl")
    yield gateways.start
    gateways.stop()


def silent_executor(peers: Peers, name: str) -> tuple[list[GenerateRequest], list[str]]:
    """An executor that receives admissions and never answers them: (requests seen, cancels seen)."""
    seen: list[GenerateRequest] = []
    cancels: list[str] = []

    async def on_infer(incoming):
        seen.append(incoming.message)

    async def on_cancel(incoming):
        cancels.append(incoming.message.request_id)

    async def subscribe():
        await peers.bus.subscribe(subjects.infer(name), GenerateRequest, on_infer)
        await peers.bus.subscribe(subjects.cancel(name), Cancel, on_cancel)
        await peers.bus.flush()

    peers.run(subscribe())
    return seen, cancels


def admitting(name: str):
    return lambda req: Admission(request_id=req.request_id, executor=name, accepted=True, prompt_tokens=3)


def rejected(base: str) -> dict[str, float]:
    """morphling_requests_rejected_total by reason."""
    out = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("morphling_requests_rejected_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_an_admission_that_times_out_is_a_429_and_the_request_never_runs_later(gateway, peers):
    base, _ = gateway(admission_timeout_s=0.5, retry_after_s=3)
    seen, cancels = silent_executor(peers, "e0")
    peers.state(executor_state("e0"))
    wait_ready(base)
    sent = time.time()
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_error(r, 429, code="admission_timeout")
    assert r.json()["error"]["type"] == "rate_limit_error" and r.headers["retry-after"] == "3"
    # The executor was told when to stop considering it, and then that it is cancelled.
    [request] = seen
    assert sent < request.admit_by <= sent + 0.5 + 0.1
    deadline = time.time() + 5
    while request.request_id not in cancels:
        assert time.time() < deadline, "the timed-out admission was never cancelled"
        time.sleep(0.02)


def test_an_executor_that_refused_for_a_full_queue_is_asked_last_until_it_reports_again(gateway, peers):
    """The state still shows the room a refuser had: without the mark every request until the next state would
    be offered to it first (a round trip on the bus each) and refused again."""
    base, _ = gateway()
    asked: list[str] = []

    def full(req):
        asked.append("e0")
        return Admission(request_id=req.request_id, executor="e0", accepted=False,
                         error=ErrorInfo(type="queue_full", message="the waiting queue is full"))

    def room(req):
        asked.append("e1")
        return admitting("e1")(req)

    peers.responder("e0", full)
    peers.responder("e1", room, tokens=["ok"])
    peers.state(executor_state("e0", free=50), executor_state("e1", free=10))  # e0: the most free KV
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    for _ in range(3):
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices[0].text == "ok"
    assert asked == ["e0", "e1", "e1", "e1"]
    peers.state(executor_state("e0", free=50), executor_state("e1", free=10))  # e0 reports after its refusal
    deadline = time.time() + 5
    while asked[-2:] != ["e0", "e1"]:  # the gateway takes the new state: e0 is asked first again
        assert time.time() < deadline, f"e0 was not asked again after it reported: {asked}"
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)


def test_every_503_says_when_to_retry_and_probes_are_not_counted_as_rejections(gateway, peers):
    base, _ = gateway(retry_after_s=5)
    for _ in range(5):  # no cluster state yet: not ready
        r = httpx.get(f"{base}/ready")
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_error(r, 503, code="no_executor")
    assert r.headers["retry-after"] == "5"
    assert rejected(base) == {"no_executor": 1.0}


def test_bodies_the_bus_cannot_carry_are_413_and_leave_nothing_behind(gateway, peers):
    base, gw = gateway()
    peers.responder("e0", admitting("e0"), tokens=["ok"])
    peers.state(executor_state("e0"))
    wait_ready(base)
    # NATS's default max_payload (1 MiB) is below the configured 4 MiB: the bus sets the limit.
    assert gw.max_body_bytes == gw.bus.max_payload - BUS_HEADROOM_BYTES < gw.config.max_body_bytes
    big = {"model": MODEL, "prompt": "x" * (2 << 20)}
    assert_error(httpx.post(f"{base}/v1/completions", json=big), 413, code="request_too_large")

    # Under the limit as JSON, but MessagePack spends 9 bytes on each 4-byte "0.5,": over max_payload on the bus.
    floats = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
              "chat_template_kwargs": {"weights": [0.5] * (gw.max_body_bytes // 5)}}
    r = httpx.post(f"{base}/v1/chat/completions", json=floats, timeout=30)
    assert_error(r, 413, code="request_too_large")
    assert gw.dispatcher._queues == {}  # no admission left waiting for tokens that never come

    ok = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"


def test_bodies_nested_too_deep_are_400(gateway, peers):
    base, _ = gateway()
    peers.responder("e0", admitting("e0"), tokens=["ok"])
    peers.state(executor_state("e0"))
    wait_ready(base)

    def nested(depth: int) -> dict:
        value: dict = {}
        for _ in range(depth):
            value = {"a": value}
        return value

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{base}/v1/chat/completions", json=chat | {"chat_template_kwargs": nested(300)})
    assert "64 levels" in assert_error(r, 400)["message"]
    fine = httpx.post(f"{base}/v1/chat/completions", json=chat | {"chat_template_kwargs": nested(50)})
    assert fine.status_code == 200, fine.text


def test_a_bus_outage_ends_what_is_in_flight_refuses_new_requests_then_serving_resumes(gateway, peers, nats_server):
    outage_s = 1.0
    base, _ = gateway(bus_outage_s=outage_s, retry_after_s=2)
    peers.responder("e0", admitting("e0"), tokens=["a", "b"], finish=False)  # never finishes
    peers.state(executor_state("e0"))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.completions.create(model=MODEL, prompt="hi", stream=True)
    first = next(iter(stream))
    assert first.choices[0].text == "a"
    pool = concurrent.futures.ThreadPoolExecutor(1)
    waiting = pool.submit(httpx.post, f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"}, timeout=30)
    time.sleep(0.3)  # admitted, waiting for tokens

    nats_server.proc.kill()
    killed = time.monotonic()
    time.sleep(0.2)
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_error(r, 503, code="bus_unavailable")
    # at once, not after the bound: the request admitted before the kill is still waiting for its tokens
    assert r.headers["retry-after"] == "2" and not waiting.done()

    with pytest.raises(openai.APIError) as err:
        for _ in stream:
            pass
    assert err.value.body["code"] == "bus_unavailable"
    r = waiting.result(timeout=10)
    assert_error(r, 503, code="bus_unavailable")
    assert r.headers["retry-after"] == "2"
    assert time.monotonic() - killed < outage_s + 4
    pool.shutdown()

    nats_server.start()
    peers.responder("e1", admitting("e1"), tokens=["back"])
    deadline = time.time() + 20
    while True:
        peers.state(executor_state("e1"))  # the monitor's state, fresh after the reconnect
        answer = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
        if answer.status_code == 200:
            break
        assert time.time() < deadline, f"serving never resumed: {answer.status_code} {answer.text}"
        time.sleep(0.2)
    assert answer.json()["choices"][0]["text"] == "back"


def test_the_outage_bound_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("MORPHLING_BUS_OUTAGE_S", "7.5")
    assert GatewayConfig.from_env().bus_outage_s == 7.5
    monkeypatch.setenv("MORPHLING_BUS_OUTAGE_S", "soon")
    with pytest.raises(ValueError, match="MORPHLING_BUS_OUTAGE_S"):
        GatewayConfig.from_env()
