"""CoCoServe's operations by hand, end to end: `morphling up --executors 2 --plan --mode off` with every layer
of the default model on exec0 and exec1 spare, `POST /v1/cluster/morph` through the gateway, the official
`openai` client over real HTTP.

Greedy output of a fixed prompt is the same before and after each replicate, migrate and evict; a stream
that runs through all of them ends with exactly max_tokens tokens; bad bodies are 400, unknown ids 404 and
refusals 409 with the reason, and a refusal changes nothing.
"""

import threading
import time

import httpx
import openai
import pytest

from shared.config import PROJECT_ROOT
from tests.integration.test_fabric import DEFAULT_FLAGS, serve

PLAN = PROJECT_ROOT / "deploy/plans/default-spare-exec1.json"
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The history of the city begins"
STREAM_TOKENS = 96


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    # --mode off: the controller would replicate onto the member these operations leave idle (CI saw it copy
    # layers 15-19 to exec1 between two of them), and this file checks what each operation alone does.
    proc = serve(tmp_path_factory.mktemp("cocoserve"), "default", DEFAULT_FLAGS, "--executors", "2",
                 "--plan", str(PLAN), "--mode", "off")
    yield proc
    proc.interrupt(60)


def morph(up, **body) -> httpx.Response:
    return httpx.post(f"{up.url}/v1/cluster/morph", json=body, timeout=120)


def placements(up) -> list[list[str]]:
    (instance,) = httpx.get(f"{up.url}/v1/cluster", timeout=10).json()["instances"]
    return [layer["placement"] for layer in instance["layers"]]


def greedy(client) -> str:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def test_greedy_output_and_a_running_stream_survive_replicate_migrate_and_evict(up):
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=300)
    expected = greedy(client)
    tokens: list[str] = []
    finish: list[str] = []

    def stream():
        for chunk in client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=STREAM_TOKENS,
                                               temperature=0, stream=True, extra_body={"ignore_eos": True},
                                               stream_options={"include_usage": True}):
            if chunk.choices:
                tokens.append(chunk.choices[0].text)
                if chunk.choices[0].finish_reason:
                    finish.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                finish.append(chunk.usage.completion_tokens)

    running = threading.Thread(target=stream)
    running.start()
    while len(tokens) < 4:
        time.sleep(0.05)
    ops = [dict(action="replicate", instance="i0", layers=[0, 14], to="exec1"),
           dict(action="migrate", instance="i0", layers=[20, 29], **{"from": "exec0"}, to="exec1"),
           dict(action="evict", instance="i0", layers=[5, 14], **{"from": "exec1"})]
    for op in ops:
        r = morph(up, **op)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["ok"]
    running.join(timeout=300)
    assert finish == ["length", STREAM_TOKENS]  # every token, then the usage chunk
    assert placements(up) == [["exec0", "exec1"]] * 5 + [["exec0"]] * 15 + [["exec1"]] * 10
    assert greedy(client) == expected


def test_bad_bodies_unknown_ids_and_refusals_change_nothing(up):
    before = placements(up)
    bad = [(dict(action="replicate", instance="i0", layers=[3, 1], to="exec1"), 400, "layers"),
           (dict(action="replicate", instance="i0", layers=[0, 1]), 400, "to"),
           (dict(action="batch", instance="i0", max_num_seqs=0), 400, "max_num_seqs"),
           (dict(action="replicate", instance="i9", layers=[0, 1], to="exec1"), 404, "instance"),
           (dict(action="migrate", instance="i0", layers=[0, 1], to="exec7", **{"from": "exec0"}), 404, None),
           (dict(action="evict", instance="i0", layers=[16, 17], **{"from": "exec0"}), 409, None),
           (dict(action="replicate", instance="i0", layers=[0, 40], to="exec1"), 409, None)]
    for body, status, param in bad:
        r = morph(up, **body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["message"]
        if param:
            assert error["param"] == param
    assert "last copy" in morph(up, action="evict", instance="i0", layers=[16, 17],
                                **{"from": "exec0"}).json()["error"]["message"]
    assert placements(up) == before


def test_the_batch_cap_moves_and_comes_back(up):
    r = morph(up, action="batch", instance="i0", max_num_seqs=2)
    assert r.status_code == 200, r.text
    (leader,) = [e for e in r.json()["executors"] if e["id"] == "exec0"]
    assert leader["max_num_seqs"] == 2
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=300)
    outs = [None] * 4

    def one(i):
        outs[i] = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}).usage.completion_tokens

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    seen = 0
    while any(t.is_alive() for t in threads):
        executors = httpx.get(f"{up.url}/v1/cluster", timeout=10).json()["executors"]
        (leader,) = [e for e in executors if e["id"] == "exec0"]
        seen = max(seen, leader["running"])
        time.sleep(0.05)
    assert outs == [8] * 4 and seen <= 2
    r = morph(up, action="batch", instance="i0", max_num_seqs=256)
    assert r.status_code == 409 and "between 1 and 64" in r.json()["error"]["message"]  # the configured batch
    r = morph(up, action="batch", instance="i0", max_num_seqs=64)
    assert r.status_code == 200, r.text


def test_the_instance_quantizes_and_restores_as_a_whole(up):
    client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=300)
    expected = greedy(client)
    r = morph(up, executor="exec0", action="quantize", layers=2, bits=8)
    assert r.status_code == 200, r.text
    (instance,) = r.json()["instances"]
    assert [layer["bits"] for layer in instance["layers"]][:2] == [8, 8]  # on every member that holds them
    greedy(client)
    r = morph(up, executor="exec0", action="restore", layers=2)
    assert r.status_code == 200, r.text
    assert all(layer["bits"] == 16 for layer in instance_layers(up))
    assert greedy(client) == expected
    r = morph(up, executor="exec1", action="quantize", layers=2, bits=8)
    assert r.status_code == 409 and "as a whole" in r.json()["error"]["message"]  # a follower sends it on


def instance_layers(up) -> list[dict]:
    (instance,) = httpx.get(f"{up.url}/v1/cluster", timeout=10).json()["instances"]
    return instance["layers"]
