"""Morphing by hand through the gateway (`POST /v1/cluster/morph`, `morphling morph|status`), end to end.

The controller morphs on its own only under pressure; these tests drive quantize and restore directly
against a real system (nats-server, monitor, controller, executor with the default model, gateway) to
check what the automatic path relies on too: a running stream never notices, restoring gives back
the exact full-precision model, and the KV capacity moves by exactly the pages the executor reports.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from services.admin_cli import index_ranges, layer_runs
from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    sys_ = System(tmp_path_factory.mktemp("morph"), executors=1).start()
    yield sys_
    sys_.stop()


def morph(system, timeout: float = 120, key: str | None = None, **body) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{system.url}/v1/cluster/morph", json=body, headers=headers, timeout=timeout)


def executor(view: dict, name: str = "exec0") -> dict:
    (e,) = [e for e in view["executors"] if e["id"] == name]
    return e


def wait_idle(system, timeout: float = 15) -> dict:
    """The exec0 entry once no request runs and every KV page is free (the monitor lags a little)."""
    deadline = time.time() + timeout
    while True:
        e = executor(system.cluster())
        kv = e["kv"]
        if (not e["running"] and not e["waiting"] and kv["pages_free"] == kv["pages_base"] + kv["pages_extension"]) \
                or time.time() > deadline:
            return e
        time.sleep(0.1)


@pytest.fixture(autouse=True)
def full_precision(system):
    """Every test starts and leaves with every layer at full precision."""
    yield
    layers = executor(system.cluster())["layers"]
    quantized = sum(b < max(layers) for b in layers)
    if quantized:
        assert morph(system, executor="exec0", action="restore", layers=quantized).status_code == 200


@pytest.fixture
def client(system):
    return openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_stream_continues_across_quantize_and_restore(system, client):
    max_tokens = 128
    stream = client.completions.create(model=MODEL, prompt="Write a long story about a lighthouse keeper.",
                                       max_tokens=max_tokens, temperature=0.7, seed=3, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    answers: dict[str, httpx.Response] = {}

    def morph_twice():
        # From a thread, so the stream is read on without pause while the commands are applied.
        answers["quantize"] = morph(system, executor="exec0", action="quantize", layers=8, bits=4)
        answers["restore"] = morph(system, executor="exec0", action="restore", layers=8)

    morpher = threading.Thread(target=morph_twice)
    text, usage = "", None
    for count, chunk in enumerate(stream):
        if count == 3:
            morpher.start()
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage is not None:
            usage = chunk.usage
    morpher.join(timeout=120)
    assert answers["quantize"].status_code == 200, answers["quantize"].text
    assert answers["restore"].status_code == 200, answers["restore"].text
    quantized, restored = answers["quantize"].json(), answers["restore"].json()
    assert quantized["results"][0]["ok"] and restored["results"][0]["ok"]
    order = executor(quantized)["swap_order"]
    assert [quantized["results"][0]["state"]["layers"][i] for i in order[:8]] == [4] * 8
    # Both were applied while the request still ran: the fresh views taken after each show it running.
    assert executor(quantized)["running"] == 1 and executor(restored)["running"] == 1
    assert len(set(executor(restored)["layers"])) == 1
    assert usage is not None and usage.completion_tokens == max_tokens
    assert text.strip()


def test_greedy_output_is_identical_after_quantize_and_restore(system, client):
    messages = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]

    def greedy() -> str:
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
        return reply.choices[0].message.content

    before = greedy()
    r = morph(system, executor="exec0", action="quantize", layers=8, bits=4)
    assert r.status_code == 200 and r.json()["results"][0]["ok"], r.text
    greedy()  # served by the quantized model; its text may differ, and need not be checked
    r = morph(system, executor="exec0", action="restore", layers=8)
    assert r.status_code == 200, r.text
    assert len(set(executor(r.json())["layers"])) == 1
    assert greedy() == before


def test_kv_capacity_grows_by_exactly_the_released_pages(system):
    start = wait_idle(system)
    kv0, full, order = start["kv"], start["layers"][0], start["swap_order"]
    assert kv0["pages_extension"] == 0 and set(start["layers"]) == {full}
    assert sorted(order) == list(range(30)) and order != list(range(30))  # the shipped LIS profile's order

    def bits_in_order(*bits: int) -> list[int]:
        """Layer bits for `bits` given in swap order, the rest at full precision."""
        layers = [full] * 30
        for i, b in zip(order, bits):
            layers[i] = b
        return layers

    released = 0
    # 4 layers to INT8, then 2 to INT4: quantize takes the layers wider than the target in the swap
    # order, so the second step narrows the first two of them from 8 to 4 bits.
    for layers, bits, expect in [(4, 8, bits_in_order(8, 8, 8, 8)), (2, 4, bits_in_order(4, 4, 8, 8))]:
        r = morph(system, executor="exec0", action="quantize", layers=layers, bits=bits)
        assert r.status_code == 200, r.text
        result = r.json()["results"][0]
        assert result["ok"] and result["error"] is None and result["executor"] == "exec0"
        assert result["state"]["pages_released"] > 0 and result["state"]["pages_reclaimed"] == 0
        released += result["state"]["pages_released"]
        view = executor(r.json())  # the answer's view already shows the change
        assert view["layers"] == expect == result["state"]["layers"]
        kv = view["kv"]
        assert kv["pages_extension"] == released
        assert kv["pages_total"] == kv0["pages_total"] and kv["pages_base"] == kv0["pages_base"]
        assert kv["pages_free"] == kv0["pages_free"] + released
    r = morph(system, executor="exec0", action="restore", layers=4)
    assert r.status_code == 200, r.text
    assert r.json()["results"][0]["state"]["pages_reclaimed"] == released
    assert executor(r.json())["kv"] == kv0 and executor(r.json())["layers"] == [full] * 30


@pytest.mark.parametrize("body, param", [
    ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 3}, "bits"),
    ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 8.0}, "bits"),
    ({"executor": "exec0", "action": "quantize", "layers": 2}, "bits"),
    ({"executor": "exec0", "action": "restore", "layers": 2, "bits": 8}, "bits"),
    ({"executor": "exec0", "action": "explode", "layers": 2}, "action"),
    ({"executor": "exec0", "action": "quantize", "layers": 0, "bits": 8}, "layers"),
    ({"executor": "exec0", "action": "quantize", "layers": "2", "bits": 8}, "layers"),
    ({"executor": "exec0", "action": "quantize", "layers": True, "bits": 8}, "layers"),
    ({"executor": "exec0", "action": "quantize", "layers": 10**30, "bits": 8}, "layers"),
    ({"action": "quantize", "layers": 2, "bits": 8}, "executor"),
    ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 8, "force": True}, "force"),
    ([1, 2], None),
])
def test_invalid_bodies_are_400_with_openai_error_json(system, body, param):
    r = httpx.post(f"{system.url}/v1/cluster/morph", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_executor_is_404_and_an_impossible_morph_is_409(system):
    r = morph(system, executor="exec9", action="quantize", layers=1, bits=8)
    assert r.status_code == 404 and r.json()["error"]["code"] == "executor_not_found"
    r = morph(system, executor="*", action="quantize", layers=31, bits=8)  # the model has 30 layers
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "morph_refused" and "exec0" in error["message"]
    r = morph(system, executor="*", action="restore", layers=1)  # nothing is quantized
    assert r.status_code == 409 and r.json()["error"]["code"] == "morph_refused"
    assert len(set(executor(system.cluster())["layers"])) == 1


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def test_cli_status_and_morph(system):
    start = executor(system.cluster())
    full, first = start["layers"][0], sorted(start["swap_order"][:3])
    status = cli("status", "--url", system.url)
    assert status.returncode == 0, status.stderr
    header, row = status.stdout.splitlines()
    assert header.split() == ["EXECUTOR", "ALIVE", "RESTARTS", "RUNNING", "WAITING", "KV_TOTAL", "KV_FREE", "KV_BASE",
                              "KV_EXT", "LAYER_BITS"]
    assert row.split()[:3] == ["exec0", "yes", "0"] and row.endswith(f"{full}x30")

    done = cli("morph", "--url", system.url, "--executor", "*", "--action", "quantize", "--layers", "3", "--bits", "8")
    assert done.returncode == 0, done.stderr
    results, cluster = done.stdout.split("\n\n")
    assert results.splitlines()[1].split()[:4] == ["exec0", "ok", index_ranges(first), "8"]
    assert cluster.strip().endswith(layer_runs([8 if i in first else full for i in range(30)]))

    refused = cli("morph", "--url", system.url, "--executor", "exec0", "--action", "quantize", "--layers", "99",
                  "--bits", "4")
    assert refused.returncode == 1 and "409 morph_refused" in refused.stderr and not refused.stdout

    back = cli("morph", "--url", system.url, "--executor", "exec0", "--action", "restore", "--layers", "3")
    assert back.returncode == 0, back.stderr
    assert back.stdout.strip().endswith(f"{full}x30")
    assert cli("morph", "--url", system.url, "--executor", "exec0", "--action", "quantize", "--layers", "1").returncode == 2


def test_admin_keys_guard_morphing(tmp_path):
    keyed = System(tmp_path, executors=1, gateway_env={"MORPHLING_ADMIN_KEYS": "root", "MORPHLING_API_KEYS": "k"})
    # System.wait_ready reads /v1/cluster without a key, which the keys now refuse: read it with one.
    keyed.cluster = lambda: httpx.get(f"{keyed.url}/v1/cluster", headers={"Authorization": "Bearer root"},
                                      timeout=5).json()
    try:
        keyed.start()
        body = {"executor": "exec0", "action": "quantize", "layers": 1, "bits": 8}
        assert morph(keyed, **body).status_code == 401
        assert morph(keyed, key="k", **body).status_code == 401  # an API key never changes the cluster
        r = morph(keyed, key="root", **body)
        assert r.status_code == 200 and r.json()["results"][0]["ok"], r.text
        # The CLI takes its default key from the environment, like the gateway.
        env = {**os.environ, "MORPHLING_ADMIN_KEYS": "root,other"}
        status = cli("status", "--url", keyed.url, env=env)
        assert status.returncode == 0 and " 8x1 " in status.stdout.splitlines()[1], status
        denied = cli("status", "--url", keyed.url, "--admin-key", "k", env=env)
        assert denied.returncode == 1 and "401 invalid_api_key" in denied.stderr
    finally:
        keyed.stop()
