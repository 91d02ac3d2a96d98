"""Faults: an executor killed mid-flight, the last executor gone and back, nats-server restarted."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from tests.system import System

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    # one sequence at a time per executor, so that requests queue behind the running one
    sys_ = System(tmp_path_factory.mktemp("faults"), executors=2, executor_args=("--max-num-seqs", "1")).start()
    yield sys_
    sys_.stop()


async def stream_one(url: str, i: int) -> str:
    """'finished', 'error' (an SSE error event), never a hang: the whole call is bounded."""
    body = {"model": MODEL, "prompt": f"Story number {i}:", "max_tokens": 60, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=180) as http:
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            outcome = None
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    return outcome or "unterminated"
                event = json.loads(data)
                if "error" in event:
                    outcome = "error"
                elif event["choices"] and event["choices"][0].get("finish_reason"):
                    outcome = "finished"
    return outcome or "cut"


def test_killed_executor_requeues_waiting_requests_and_errors_streaming_ones(system):
    async def waiting_on_exec0() -> int:
        # until exec0 reports requests queued behind its running one (the router spreads the six)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            view = {e["id"]: e for e in (await asyncio.to_thread(system.cluster))["executors"]}
            if view.get("exec0", {}).get("waiting", 0) >= 1 and view["exec0"]["running"] == 1:
                return view["exec0"]["waiting"]
            await asyncio.sleep(0.1)
        raise AssertionError(f"exec0 never had a request waiting: {view}")

    async def scenario():
        tasks = [asyncio.create_task(stream_one(system.url, i)) for i in range(6)]
        waiting = await waiting_on_exec0()
        await asyncio.to_thread(system.kill, "exec0")
        return waiting, await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    waiting, outcomes = asyncio.run(scenario())
    assert set(outcomes) <= {"finished", "error"}, outcomes
    assert outcomes.count("error") <= 1  # only exec0's one running request was already streaming
    # exec0 stays dead until the end of this test, so the requests waiting on it finished on exec1: requeued
    assert outcomes.count("finished") >= 5 and waiting >= 1
    assert {e["id"]: e["alive"] for e in system.cluster()["executors"]}.get("exec0") is not True
    system.start_executor(0)
    system.wait_ready(240)


def test_ready_follows_the_last_executor(system):
    system.kill("exec0")
    system.kill("exec1")
    deadline = time.time() + 10
    while time.time() < deadline and httpx.get(f"{system.url}/ready").status_code != 503:
        time.sleep(0.2)
    assert httpx.get(f"{system.url}/ready").status_code == 503
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert err.value.status_code == 503
    system.start_executor(1)
    system.wait_ready(240, executors=1)
    assert httpx.get(f"{system.url}/ready").status_code == 200


def test_services_reconnect_after_nats_restarts(system):
    system.nats.restart()
    deadline = time.time() + 60
    answer = None
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=60)
    while time.time() < deadline and answer is None:
        try:
            answer = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        except openai.APIError:
            time.sleep(0.5)
    assert answer is not None and answer.usage.completion_tokens == 4
