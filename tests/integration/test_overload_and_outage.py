"""Overload and outage on the whole system as real processes: bodies too large or too deep for the bus,
probes that are not requests, a flood on a loaded machine, and nats-server killed under live streams.

One executor with a short waiting queue and a short bound on the predicted queue wait, and a bus outage
bound of a few seconds on both the gateway and the executor, so that each case is quick.
"""

import asyncio
import concurrent.futures
import queue
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
OUTAGE_S = 2.0


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    sys_ = System(tmp_path_factory.mktemp("overload"), executors=1,
                  executor_args=("--max-num-seqs", "4", "--max-waiting", "4", "--max-queue-wait", "2",
                                 "--bus-outage", str(OUTAGE_S)),
                  gateway_args=("--bus-outage", str(OUTAGE_S))).start()
    yield sys_
    sys_.stop()


def client(system: System, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, **kwargs)


def rejected_total(system: System) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{system.url}/metrics").text.splitlines()
               if line.startswith("morphling_requests_rejected_total{"))


def test_a_body_larger_than_the_bus_carries_is_413_and_the_next_request_works(system):
    c = client(system, timeout=60)
    with pytest.raises(openai.APIStatusError) as err:
        c.completions.create(model=MODEL, prompt="x" * (2 << 20), max_tokens=2)
    assert err.value.status_code == 413
    assert err.value.response.json()["error"]["code"] == "request_too_large"
    answer = c.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert answer.usage.completion_tokens == 2


def test_deeply_nested_chat_template_kwargs_are_400(system):
    deep: dict = {}
    for _ in range(300):
        deep = {"a": deep}
    with pytest.raises(openai.BadRequestError) as err:
        client(system).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_body={"chat_template_kwargs": deep})
    assert err.value.response.json()["error"]["type"] == "invalid_request_error"


def test_ready_polls_are_not_counted_as_rejected_requests(system):
    before = rejected_total(system)
    for _ in range(20):
        assert httpx.get(f"{system.url}/ready").status_code == 200
        assert httpx.get(f"{system.url}/health").status_code == 200
    assert rejected_total(system) == before


def test_a_flood_on_a_loaded_machine_gets_200_or_429_with_retry_after(system):
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, limits=limits) as http:
            async def one(i: int) -> httpx.Response:
                return await http.post(f"{system.url}/v1/completions",
                                       json={"model": MODEL, "prompt": f"Count to {i}:", "max_tokens": 3})
            return await asyncio.gather(*(one(i) for i in range(150)))

    try:
        answers = asyncio.run(flood())
    finally:
        hog.kill()
        hog.wait()
    statuses = [r.status_code for r in answers]
    assert set(statuses) <= {200, 429}, {r.status_code: r.text for r in answers if r.status_code not in (200, 429)}
    assert 200 in statuses and 429 in statuses
    for r in answers:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            assert r.json()["error"]["type"] == "rate_limit_error"


def test_nats_killed_under_live_streams_ends_them_refuses_meanwhile_then_serves_again(system):
    c = client(system, timeout=120)

    started: queue.Queue = queue.Queue()

    def stream(i: int) -> tuple[float, str | None]:
        """When and how the stream ended: the error's code, or "finished"."""
        chunks = iter(c.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True}))
        next(chunks)  # under way
        started.put(i)
        try:
            for _ in chunks:
                pass
        except openai.APIError as exc:
            return time.monotonic(), exc.body.get("code") if isinstance(exc.body, dict) else None
        return time.monotonic(), "finished"

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        streams = [pool.submit(stream, i) for i in range(3)]
        for _ in streams:
            started.get(timeout=120)
        system.kill_nats()
        killed = time.monotonic()
        time.sleep(0.5)
        r = httpx.post(f"{system.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "bus_unavailable"
        assert int(r.headers["retry-after"]) >= 1
        ends = [s.result(timeout=OUTAGE_S + 30) for s in streams]
    assert [code for _, code in ends] == ["bus_unavailable"] * 3
    assert all(at - killed < OUTAGE_S + 5 for at, _ in ends)

    system.nats.start()
    deadline = time.time() + 60
    answer = None
    while answer is None:
        try:
            answer = c.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        except openai.APIError:
            assert time.time() < deadline, "serving never resumed after nats-server came back"
            time.sleep(0.5)
    assert answer.usage.completion_tokens == 4
