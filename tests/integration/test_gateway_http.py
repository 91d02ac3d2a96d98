"""The gateway over real HTTP against a real nats-server, with no executor process.

The test plays the monitor (publishing hand-made ClusterState) and, where a case needs one, a
hand-written responder on infer.<exec> that admits or refuses and publishes token batches: that
isolates the gateway's own behaviour; the whole system is tested elsewhere.
"""

import asyncio
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from services.gateway.app import Gateway, create_app
from shared import subjects
from shared.bus import Bus
from shared.config import GatewayConfig
from shared.messages import (INSTANCE_BROKEN, NOT_STARTED, Admission, Cancel, ClusterState, ErrorInfo, ExecutorState,
                             ExecutorTelemetry, GenerateRequest, KvPages, TokenBatch, TokenDelta)
from tests.nats_server import free_port

MODEL = "tiny-model"


def executor_state(name: str, alive: bool = True, free: int = 50) -> ExecutorState:
    kv = KvPages(pages_total=100, pages_slot=40, pages_free=free, pages_used=60 - free, pages_base=50,
                 pages_extension=10)
    t = ExecutorTelemetry(executor=name, instance="i0", time=time.time(), model=MODEL, max_model_len=2048,
                          block_size=16, page_bytes=4096, kv=kv, layers=[16, 16, 8, 4], swap_order=[], running=1,
                          waiting=2, max_waiting=8, preemptions=0, prompt_tokens=0, generated_tokens=0,
                          queue_delay_s=0.0, ttft_s=0.0, tpot_s=0.0)
    return ExecutorState(executor=name, alive=alive, last_seen=time.time(), kv_usage=0.4, queue_delay_s=0.0,
                         waiting=2.0, telemetry=t)


class Peers:
    """A Bus on its own event loop thread, so synchronous tests can play monitor and executor."""

    def __init__(self, url: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.bus: Bus = self.run(Bus.connect(url, "test"))
        self.cancels: list[str] = []

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def state(self, *executors: ExecutorState) -> None:
        self.run(self.bus.publish(subjects.STATE, ClusterState(time=time.time(), executors=list(executors))))

    def responder(self, executor: str, admit, tokens: list[str] | None = None, finish: bool = True,
                  lose: int | None = None, error: ErrorInfo | None = None) -> None:
        """Answer infer.<executor> with `admit(request) -> Admission`; if admitted and `tokens` is given,
        stream them as one delta each (continuing a resumed request's count), the last one finished with
        reason stop (unless not `finish`). The delta at position `lose` is lost on the way. With `error`,
        a delta that ends the completion with it follows the tokens."""
        async def on_infer(incoming):
            req: GenerateRequest = incoming.message
            admission = admit(req)
            await incoming.reply(admission)
            if not admission.accepted or tokens is None:
                return
            already = len(req.resume[0].token_ids) if req.resume else 0
            for i, text in enumerate(tokens):
                last = finish and i == len(tokens) - 1
                delta = TokenDelta(request_id=req.request_id, index=0, token_ids=[100 + already + i], text=text,
                                   timestamps=[time.time()], finished=last, finish_reason="stop" if last else None,
                                   prompt_tokens=3, output_tokens=already + i + 1)
                if i == lose:
                    continue
                await self.bus.publish(subjects.tokens(req.gateway), TokenBatch(executor=executor, deltas=[delta]))
                await asyncio.sleep(0.01)
            if error is not None:
                ended = TokenDelta(request_id=req.request_id, index=0, token_ids=[], text="", timestamps=[],
                                   finished=True, finish_reason="error", prompt_tokens=3,
                                   output_tokens=already + len(tokens), error=error)
                await self.bus.publish(subjects.tokens(req.gateway), TokenBatch(executor=executor, deltas=[ended]))

        async def on_cancel(incoming):
            self.cancels.append(incoming.message.request_id)

        async def subscribe():
            await self.bus.subscribe(subjects.infer(executor), GenerateRequest, on_infer)
            await self.bus.subscribe(subjects.cancel(executor), Cancel, on_cancel)
            await self.bus.flush()

        self.run(subscribe())

    def close(self) -> None:
        self.run(self.bus.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def test_bus(nats_server):
    tb = Peers(nats_server.url)
    yield tb
    tb.close()


class Gateways:
    """Gateways served in this process, each on a free port and a thread of its own, ids `<prefix>0`, ..."""

    def __init__(self, nats_url: str, prefix: str):
        self.nats_url, self.prefix = nats_url, prefix
        self.servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def start(self, **overrides) -> tuple[str, Gateway]:
        """Serve one with GatewayConfig `overrides`: its URL and its Gateway object."""
        port = free_port()
        config = GatewayConfig(**({"nats_url": self.nats_url, "host": "127.0.0.1", "port": port,
                                   "gateway_id": f"{self.prefix}{len(self.servers)}"} | overrides))
        app = create_app(config)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        self.servers.append((server, thread))
        deadline = time.time() + 20
        while not server.started:
            assert time.time() < deadline and thread.is_alive(), "gateway did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}", app.state.gateway

    def stop(self) -> None:
        for server, thread in self.servers:
            server.should_exit = True
            thread.join(10)


@pytest.fixture
def start_gateway(nats_server):
    gateways = Gateways(nats_server.url, "gw")
    yield lambda **overrides: gateways.start(**({"admission_timeout_s": 1.0} | overrides))[0]
    gateways.stop()


def wait_ready(base: str) -> None:
    deadline = time.time() + 10
    while httpx.get(f"{base}/ready").status_code != 200:
        assert time.time() < deadline, "gateway never became ready"
        time.sleep(0.02)


def assert_error(response: httpx.Response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["code"] == code
    return body["error"]


def test_health_ready_models_cluster_metrics(start_gateway, test_bus):
    base = start_gateway()
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    assert_error(httpx.get(f"{base}/ready"), 503, code="no_executor")
    assert httpx.get(f"{base}/v1/models").json() == {"object": "list", "data": []}
    test_bus.state(executor_state("e0"), executor_state("e1", alive=False))
    wait_ready(base)
    models = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 2048
    cluster = httpx.get(f"{base}/v1/cluster").json()["executors"]
    assert [(e["id"], e["alive"]) for e in cluster] == [("e0", True), ("e1", False)]
    assert cluster[0]["kv"] == {"pages_total": 100, "pages_slot": 40, "pages_free": 50, "pages_used": 10,
                                "pages_base": 50, "pages_extension": 10}
    assert (cluster[0]["block_size"], cluster[0]["preemptions"]) == (16, 0)
    assert cluster[0]["layers"] == [16, 16, 8, 4] and (cluster[0]["running"], cluster[0]["waiting"]) == (1, 2)
    text = httpx.get(f"{base}/metrics").text
    for name in ("morphling_time_to_first_token_seconds", "morphling_inter_token_latency_seconds",
                 "morphling_e2e_request_latency_seconds", "morphling_request_queue_time_seconds",
                 "morphling_requests_running", "morphling_requests_waiting", "morphling_kv_cache_usage_ratio",
                 "morphling_requests_rejected_total", "morphling_requests_total"):
        assert name in text
    assert "morphling_requests_waiting 2.0" in text


def test_bad_requests_get_400_with_openai_shape(start_gateway, test_bus):
    base = start_gateway()
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    cmpl, chat = f"{base}/v1/completions", f"{base}/v1/chat/completions"
    ok = {"model": MODEL, "prompt": "hi"}
    msgs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert_error(httpx.post(cmpl, json=ok | {"temperature": 2.5}), 400, "temperature")
    assert_error(httpx.post(cmpl, json=ok | {"n": 0}), 400, "n")
    err = assert_error(httpx.post(chat, json=msgs | {"wat": 1}), 400, "wat")
    assert err["message"] == "Unrecognized request argument supplied: wat" and err["type"] == "invalid_request_error"
    assert_error(httpx.post(cmpl, content=b'{"model": ', headers={"content-type": "application/json"}), 400)
    assert_error(httpx.post(cmpl, json=ok | {"logit_bias": {"5": 1.0}}), 400, "logit_bias")
    assert_error(httpx.post(cmpl, json=ok | {"prompt": ["a", "b"]}), 400, "prompt")
    assert_error(httpx.post(chat, json={"model": MODEL}), 400, "messages")
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    assert info.value.body["param"] == "temperature"


def test_unknown_model_404_and_nobody_alive_503(start_gateway, test_bus):
    base = start_gateway()
    body = {"model": MODEL, "prompt": "hi"}
    assert_error(httpx.post(f"{base}/v1/completions", json=body), 503, code="no_executor")
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    assert_error(httpx.post(f"{base}/v1/completions", json=body | {"model": "nope"}), 404, "model", "model_not_found")
    # Alive in the state, but nobody answers on infer.e0: the executor is gone.
    assert_error(httpx.post(f"{base}/v1/completions", json=body), 503, code="no_executor")


def test_auth_and_body_limit(start_gateway, test_bus):
    base = start_gateway(api_keys=("k1",), admin_keys=("root",), max_body_bytes=2000)
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    assert_error(httpx.get(f"{base}/v1/models"), 401, code="invalid_api_key")
    assert_error(httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k2"}), 401, code="invalid_api_key")
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert_error(httpx.get(f"{base}/v1/cluster", headers={"Authorization": "Bearer k1"}), 401, code="invalid_api_key")
    assert httpx.get(f"{base}/v1/cluster", headers={"Authorization": "Bearer root"}).status_code == 200
    assert httpx.get(f"{base}/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/v1", api_key="bad", max_retries=0).models.list()
    auth = {"Authorization": "Bearer k1"}
    big = {"model": MODEL, "prompt": "x" * 5000}
    assert_error(httpx.post(f"{base}/v1/completions", json=big, headers=auth), 413, code="request_too_large")

    def chunked():  # no Content-Length: the streamed size must be checked too
        yield b'{"model": "tiny-model", "prompt": "'
        for _ in range(10):
            yield b"x" * 500
        yield b'"}'

    assert_error(httpx.post(f"{base}/v1/completions", content=chunked(), headers=auth), 413, code="request_too_large")


def test_all_queues_full_gives_429_with_retry_after(start_gateway, test_bus):
    base = start_gateway(retry_after_s=7)
    for name in ("e0", "e1"):
        test_bus.responder(name, lambda req, name=name: Admission(
            request_id=req.request_id, executor=name, accepted=False,
            error=ErrorInfo(message="waiting queue is full (8/8 requests)", type="queue_full")))
    test_bus.state(executor_state("e0"), executor_state("e1", free=10))
    wait_ready(base)
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert_error(r, 429, code="queue_full")
    assert r.headers["retry-after"] == "7"
    assert 'morphling_requests_rejected_total{reason="queue_full"} 1.0' in httpx.get(f"{base}/metrics").text


def test_completion_and_stream_through_a_test_responder(start_gateway, test_bus):
    base = start_gateway()
    test_bus.responder("e0", lambda req: Admission(request_id=req.request_id, executor="e0", accepted=True,
                                                   prompt_tokens=3), tokens=["Hel", "lo", "!"])
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=3)
    assert out.choices[0].text == "Hello!" and out.choices[0].finish_reason == "stop"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (3, 3, 6)
    assert out.id.startswith("cmpl-")
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello!"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
    assert chunks[0].id.startswith("chatcmpl-")


def test_redispatch_when_the_executor_dies_before_the_first_token(start_gateway, test_bus):
    base = start_gateway()
    seen = []

    def silent(req):  # admits, then never produces a token: it is about to die
        seen.append(req.request_id)
        return Admission(request_id=req.request_id, executor="e0", accepted=True, prompt_tokens=3)

    test_bus.responder("e0", silent)
    test_bus.responder("e1", lambda req: Admission(request_id=req.request_id, executor="e1", accepted=True,
                                                   prompt_tokens=3), tokens=["ok"])
    test_bus.state(executor_state("e0", free=90), executor_state("e1", free=10))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    result: dict = {}
    worker = threading.Thread(target=lambda: result.setdefault(
        "out", client.completions.create(model=MODEL, prompt="hi", max_tokens=2)))
    worker.start()
    deadline = time.time() + 5
    while not seen:
        assert time.time() < deadline
        time.sleep(0.02)
    test_bus.state(executor_state("e0", alive=False), executor_state("e1", free=10))
    worker.join(10)
    assert result["out"].choices[0].text == "ok"


def test_a_stream_whose_executor_dies_goes_on_from_the_tokens_sent_on_another(start_gateway, test_bus):
    base = start_gateway()
    resumes = []
    test_bus.responder("e0", lambda req: Admission(request_id=req.request_id, executor="e0", accepted=True,
                                                   prompt_tokens=3), tokens=["a", "b"], finish=False)

    def takes_over(req):
        resumes.append(req.resume)
        return Admission(request_id=req.request_id, executor="e1", accepted=True, prompt_tokens=3)

    test_bus.responder("e1", takes_over, tokens=["c"])
    test_bus.state(executor_state("e0", free=90), executor_state("e1", free=10))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True)
    texts = [next(stream).choices[0].text, next(stream).choices[0].text]
    test_bus.state(executor_state("e0", alive=False), executor_state("e1", free=10))
    texts += [c.choices[0].text for c in stream]
    assert "".join(texts) == "abc"
    (resume,) = resumes
    assert [(r.index, r.token_ids, r.text_chars) for r in resume] == [(0, [100, 101], 2)]
    assert "morphling_stream_failovers_total 1.0" in httpx.get(f"{base}/metrics").text


def test_a_stream_that_lost_tokens_on_the_way_goes_on_from_what_the_client_has(start_gateway, test_bus):
    base = start_gateway()

    def fresh_only(executor):  # takes new requests, refuses to continue one
        return lambda req: Admission(request_id=req.request_id, executor=executor, accepted=not req.resume,
                                     prompt_tokens=3, error=ErrorInfo(type="queue_full", message="full")
                                     if req.resume else None)

    test_bus.responder("e0", fresh_only("e0"), tokens=["a", "b", "c"], lose=1)
    test_bus.responder("e1", lambda req: Admission(request_id=req.request_id, executor="e1", accepted=True,
                                                   prompt_tokens=3), tokens=["b", "c"])
    test_bus.state(executor_state("e0", free=90), executor_state("e1", free=10))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "abc"  # e0's "c" gave the gap away; e1 went on


def test_a_request_that_keeps_losing_tokens_ends_after_three_moves(start_gateway, test_bus):
    base = start_gateway()
    test_bus.responder("e0", lambda req: Admission(request_id=req.request_id, executor="e0", accepted=True,
                                                   prompt_tokens=3), tokens=["a", "b", "c"], lose=1)
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.APIError, match="moved 3 times"):
        list(client.completions.create(model=MODEL, prompt="hi", max_tokens=8, stream=True))


def test_executor_death_mid_stream_is_an_sse_error_and_disconnect_cancels(start_gateway, test_bus):
    base = start_gateway(failover_timeout_s=0.5)  # no other executor: the stream ends once that passes
    test_bus.responder("e0", lambda req: Admission(request_id=req.request_id, executor="e0", accepted=True,
                                                   prompt_tokens=3), tokens=["a", "b"], finish=False)
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        test_bus.state(executor_state("e0", alive=False))
        events = [line for line in lines if line]
    assert events[-1] == "data: [DONE]" and '"code":"executor_lost"' in events[-2]

    test_bus.state(executor_state("e0"))
    wait_ready(base)
    cancels_before = len(test_bus.cancels)
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        next(r.iter_lines())  # a token arrived; now the client walks away mid-stream
    deadline = time.time() + 5
    while len(test_bus.cancels) == cancels_before:
        assert time.time() < deadline, "no Cancel was published after the client disconnected"
        time.sleep(0.02)



BROKEN = ErrorInfo(type="internal_error", message="the instance lost a member while generating",
                   code=INSTANCE_BROKEN)
# An executor that accepted the request, then could not add it (it joined an instance, or a restore took its KV).
NOT_ADDED = ErrorInfo(type="unavailable", message="e0 could not start the request: it joined instance i0",
                      code=NOT_STARTED)


@pytest.mark.parametrize("ended", [BROKEN, NOT_ADDED], ids=["instance_broken", "not_started"])
def test_a_request_whose_instance_broke_before_its_first_token_starts_again_on_another(start_gateway, test_bus,
                                                                                       ended):
    base = start_gateway()
    tried = []

    def breaks_then_rebuilds(req):  # a broken leader refuses requests until it serves again, alone
        tried.append(req.request_id)
        if len(tried) == 1:
            return Admission(request_id=req.request_id, executor="e0", accepted=True, prompt_tokens=3)
        return Admission(request_id=req.request_id, executor="e0", accepted=False,
                         error=ErrorInfo(type="unavailable", message="executor is draining"))

    test_bus.responder("e0", breaks_then_rebuilds, tokens=[], finish=False, error=ended)
    test_bus.responder("e1", lambda req: Admission(request_id=req.request_id, executor="e1", accepted=True,
                                                   prompt_tokens=3), tokens=["ok"])
    test_bus.state(executor_state("e0", free=90), executor_state("e1", free=10))
    wait_ready(base)
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text == "ok"


def test_a_stream_whose_instance_broke_after_tokens_ends_with_an_sse_error(start_gateway, test_bus):
    base = start_gateway()
    test_bus.responder("e0", lambda req: Admission(request_id=req.request_id, executor="e0", accepted=True,
                                                   prompt_tokens=3), tokens=["a"], finish=False, error=BROKEN)
    test_bus.responder("e1", lambda req: Admission(request_id=req.request_id, executor="e1", accepted=True,
                                                   prompt_tokens=3), tokens=["never"])
    test_bus.state(executor_state("e0", free=90), executor_state("e1", free=10))
    wait_ready(base)
    body = {"model": MODEL, "prompt": "hi", "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        events = [line for line in r.iter_lines() if line]
    assert '"text":"a"' in events[0]
    assert events[-1] == "data: [DONE]" and f'"code":"{INSTANCE_BROKEN}"' in events[-2], events
    assert not any("never" in e for e in events)


def test_admin_routes_refuse_api_keys_when_no_admin_key_is_set(start_gateway, test_bus):
    base = start_gateway(api_keys=("k1",))
    test_bus.state(executor_state("e0"))
    wait_ready(base)
    assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert_error(httpx.get(f"{base}/v1/cluster", headers={"Authorization": "Bearer k1"}), 401, code="invalid_api_key")
