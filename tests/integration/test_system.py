"""The whole system through the official openai client: real nats-server, real model, real HTTP."""

import asyncio
import time

import httpx
import openai
import pytest

from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
DAYS = "The days of the week are Monday, Tuesday, Wednesday,"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    # a small queue so that a flood meets 429, longer than a burst's share of it so that only routing spreads the
    # burst; two executors so that routing has a choice
    sys_ = System(tmp_path_factory.mktemp("system"), executors=2,
                  executor_args=("--max-waiting", "8", "--max-num-seqs", "4")).start()
    yield sys_
    sys_.stop()


@pytest.fixture
def client(system):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_chat_and_completions(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                          max_tokens=24, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens > 20 and chat.usage.completion_tokens > 0
    assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
    comp = client.completions.create(model=MODEL, prompt=DAYS, max_tokens=6, temperature=0)
    assert comp.choices[0].finish_reason == "length" and comp.usage.completion_tokens == 6
    assert "Thursday" in comp.choices[0].text


def test_streaming_matches_non_streaming_and_reports_usage(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]


def test_stop_strings_seeds_and_n(client):
    free = client.completions.create(model=MODEL, prompt=DAYS, max_tokens=20, temperature=0).choices[0].text
    cut = client.completions.create(model=MODEL, prompt=DAYS, max_tokens=20, temperature=0, stop=["Friday"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == free[:free.index("Friday")]
    seeded = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0,
                                        seed=1234).choices[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    many = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.0, n=3,
                                     seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert len({c.text for c in many.choices}) > 1
    assert many.usage.completion_tokens == 3 * 12


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=5.0), "temperature"),
    (dict(n=0), "n"),
    (dict(top_p=0.0), "top_p"),
    (dict(max_tokens=100_000), "max_tokens"),
    (dict(extra_body={"no_such_field": 1}), None),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
])
def test_invalid_requests_get_400_with_openai_error_json(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", **({"max_tokens": 4} | kwargs))
    body = err.value.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    if param:
        assert body["error"]["param"] == param


def test_unknown_model_is_404_and_bad_json_is_400(system, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.response.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{system.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_tokenize_counts_what_a_request_uses_and_detokenize_reverses_it(system, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    counted = httpx.post(f"{system.url}/tokenize", json={"model": MODEL, "messages": messages}).json()
    assert counted["count"] == len(counted["tokens"]) == chat.usage.prompt_tokens
    assert counted["max_model_len"] == client.models.list().data[0].max_model_len and counted["token_strs"] is None
    comp = client.completions.create(model=MODEL, prompt=DAYS, max_tokens=1, temperature=0)
    ids = httpx.post(f"{system.url}/tokenize", json={"model": MODEL, "prompt": DAYS, "return_token_strs": True}).json()
    assert ids["count"] == comp.usage.prompt_tokens and len(ids["token_strs"]) == ids["count"]
    back = httpx.post(f"{system.url}/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json()
    assert back == {"prompt": DAYS}
    # The same prompt sent as those ids is the same request: the model answers alike.
    again = client.completions.create(model=MODEL, prompt=ids["tokens"], max_tokens=1, temperature=0)
    assert again.choices[0].text == comp.choices[0].text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"model": MODEL}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {"model": MODEL, "prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                   "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": "1 2"}, "tokens")])
def test_tokenizer_routes_refuse_bad_input_with_400(system, path, body, param):
    r = httpx.post(f"{system.url}{path}", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == param


def test_tokenizer_routes_know_only_served_models(system):
    r = httpx.post(f"{system.url}/tokenize", json={"model": "nope", "prompt": "hi"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def kv_all_free(system) -> bool:
    return all(e["kv"]["pages_free"] == e["kv"]["pages_base"] + e["kv"]["pages_extension"]
               for e in system.cluster()["executors"] if e["alive"])


def test_client_disconnect_cancels_on_the_executor(system):
    body = {"model": MODEL, "prompt": "Write a long story about a dragon.", "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{system.url}/v1/completions", json=body, timeout=60) as r:
        # keep reading until the cluster view (the monitor's, a few hundred ms behind) shows the KV in use
        for count, line in enumerate(r.iter_lines()):
            if count % 10 == 0 and not kv_all_free(system):
                break
            assert count < 400, "the request never showed up in the executor's KV"
        assert line.startswith("data: ") or line == ""
    deadline = time.time() + 10
    while time.time() < deadline and not kv_all_free(system):
        time.sleep(0.2)
    assert kv_all_free(system)


def test_flood_meets_429_with_retry_after_and_the_rest_finish(system):
    async def flood():
        client = openai.AsyncOpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=300)
        async def one(i):
            try:
                r = await client.completions.create(model=MODEL, prompt=f"Count to {i}:", max_tokens=24,
                                                    temperature=0)
                return r.choices[0].finish_reason
            except openai.RateLimitError as e:
                assert int(e.response.headers["retry-after"]) >= 1
                assert e.response.json()["error"]["type"]
                return 429
        return await asyncio.gather(*(one(i) for i in range(40)))  # 24 fit: four running, eight waiting, twice

    results = asyncio.run(flood())
    assert 429 in results
    assert all(r in (429, "length", "stop") for r in results)
    deadline = time.time() + 10
    while time.time() < deadline and not kv_all_free(system):
        time.sleep(0.2)
    assert kv_all_free(system)


def test_a_burst_is_spread_over_the_executors_not_sent_to_one(system):
    """Eight requests at once: every one is routed before the first admission is answered, and the executors
    share them. Counted only once admitted, all eight had gone to the executor that looked least loaded (its
    queue holds them). Four each, or five and three where a report that already counts an admission comes before
    its answer, which then counts twice for a moment."""
    async def burst():
        client = openai.AsyncOpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=300)
        tasks = [asyncio.create_task(client.completions.create(
            model=MODEL, prompt=f"Tell story number {i}:", max_tokens=48, temperature=0,
            extra_body={"ignore_eos": True})) for i in range(8)]
        loads = []  # each executor's running and waiting, whenever the cluster view shows all eight
        while not all(t.done() for t in tasks):
            executors = (await asyncio.to_thread(system.cluster))["executors"]
            if sum(e["running"] + e["waiting"] for e in executors) == 8:
                loads.append(sorted(e["running"] + e["waiting"] for e in executors))
            await asyncio.sleep(0.1)
        return [t.result().choices[0].finish_reason for t in tasks], loads

    finished, loads = asyncio.run(burst())
    assert finished == ["length"] * 8
    assert loads and all(load[0] >= 3 for load in loads), loads


def test_cluster_view_and_metrics(system):
    cluster = system.cluster()
    assert len(cluster["executors"]) == 2
    for e in cluster["executors"]:
        assert set(e) >= {"id", "alive", "layers", "kv", "running", "waiting"}
        assert len(e["layers"]) == 30 and set(e["kv"]) >= {"pages_total", "pages_free", "pages_base", "pages_extension"}
    metrics = httpx.get(f"{system.url}/metrics").text
    for name in ("morphling_time_to_first_token_seconds", "morphling_inter_token_latency_seconds",
                 "morphling_e2e_request_latency_seconds", "morphling_requests_rejected_total",
                 "morphling_kv_cache_usage_ratio"):
        assert name in metrics
    assert httpx.get(f"{system.url}/health").status_code == 200
