"""Schema-driven fuzzing of the gateway's published OpenAPI schema against the real running system.

The unit and HTTP tests check the request shapes someone thought of; this module lets schemathesis
generate both schema-valid and deliberately invalid requests for every operation of
`/openapi.json` (the completion bodies are described there from the pydantic request models) and
sends them over real HTTP to a real gateway, nats-server, monitor, controller and executor. Whatever
the input, the gateway must never answer 5xx or crash: bad input is a 400 (or 404 for an unknown
model) with OpenAI's error JSON, good input is served to completion.

It stays bounded in time: the executor gets a 64-token context (so any prompt plus max_tokens over
that is a 400 and a served request stops within ~64 tokens), each operation gets a few dozen
examples, shrinking and the example database are off, and every request has a timeout.

Streaming: `stream: true` bodies are sent as generated. Schemathesis' requests transport reads a
text/event-stream response until the server closes it, stopping at `max-stream-events` events or
`request-timeout` seconds; both are set so a served stream is always read to its end, and a stream
that was cut short (it hung or never ended) fails the test, as does one that does not end with
`data: [DONE]` or that carries an error event.
"""

import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings
from schemathesis.checks import not_a_server_error

from services.gateway.app import create_app
from shared.config import GatewayConfig
from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 8
REQUEST_TIMEOUT_S = 60  # a served request is at most 64 tokens x n; a hang fails instead of blocking
EXAMPLES_PER_OPERATION = 25
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    sys_ = System(tmp_path_factory.mktemp("fuzz"), executors=1,
                  executor_args=("--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
                                 "--max-waiting", "64")).start()
    yield sys_
    sys_.stop()


def published_schema() -> dict:
    """The schema the gateway serves, built the way it builds it (creating the app connects nothing);
    test_fuzzed_schema_is_the_served_one checks that the running gateway serves exactly this."""
    return create_app(GatewayConfig()).openapi()


# Loaded at import rather than from the running system with schemathesis.pytest.from_fixture, because
# from_fixture fails under the installed pytest (9.x has no Node._nodeid, which it rewrites).
schema = schemathesis.openapi.from_dict(published_schema(), config=schemathesis.Config.from_dict(
    {"request-timeout": REQUEST_TIMEOUT_S, "max-stream-events": 100_000}))


def aim_at_served_model(case) -> None:
    """A generated `model` string is practically never the served model, which would make every body a
    404 before it reaches sampling validation or the executor: half of the string models are replaced
    with the real one (chosen from the generated value, so hypothesis stays in control). An n above the
    executor's max-num-seqs must come back as a 400 (its n sequences could never run together)."""
    body = case.body
    if case.path in GENERATION_PATHS and isinstance(body, dict) and isinstance(body.get("model"), str):
        if len(body["model"]) % 2 == 0:
            body["model"] = MODEL


def assert_openai_error(response, case) -> None:
    """Every 4xx carries {"error": {"message", "type", "param", "code"}}, never FastAPI's {"detail": ...}."""
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{case.method} {case.path} -> {response.status_code} with a non-JSON body: "
                    f"{response.text[:300]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, (response.status_code, body)
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and error["message"], body
    assert isinstance(error["type"], str) and error["type"], body
    assert error["param"] is None or isinstance(error["param"], str), body
    assert error["code"] is None or isinstance(error["code"], str), body


def assert_complete_stream(response) -> None:
    assert not response.stream_cut_short, "the event stream did not end within the request timeout"
    events = [block.removeprefix("data: ") for block in response.text.split("\n\n") if block.strip()]
    assert events and events[-1] == "[DONE]", response.text[-300:]
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, f"the stream carried an error event: {chunk}"
        assert chunk["object"] in ("chat.completion.chunk", "text_completion"), chunk


def check_response(case, response) -> None:
    status = response.status_code
    if 400 <= status < 500:
        assert_openai_error(response, case)
    elif status == 200 and case.path in GENERATION_PATHS:
        if "text/event-stream" in response.headers.get("content-type", [""])[0]:
            assert isinstance(case.body, dict) and case.body.get("stream") is True, case.body
            assert_complete_stream(response)
        else:
            body = response.json()
            assert body["choices"] and body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] \
                <= MAX_MODEL_LEN * len(body["choices"]), body


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
          phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
def test_no_server_error_for_any_generated_request(case, system):
    aim_at_served_model(case)
    response = case.call(base_url=system.url, timeout=REQUEST_TIMEOUT_S)
    # The essential check: whatever was sent, no 5xx.
    case.validate_response(response, checks=[not_a_server_error])
    check_response(case, response)


LONE_SURROGATE = '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL


# Bodies the fuzzing found answered with 5xx (500 or 503) before the gateway refused them itself.
@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", LONE_SURROGATE, "messages"),  # not UTF-8 encodable for the bus: was a 500
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**30}, "max_tokens"),  # msgpack overflow
    ("/v1/completions", {"model": MODEL, "prompt": [2**64]}, "prompt"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"x": [[[[[-2**63 - 1]]]]]}}, "chat_template_kwargs"),
    # the executor renders the template with these itself: a duplicate argument was a 503
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"messages": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, None),  # json.loads' RecursionError was a 500
])
def test_found_by_fuzzing_now_400(system, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{system.url}{path}", content=content, headers={"content-type": "application/json"},
                   timeout=REQUEST_TIMEOUT_S)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["param"] == param


def test_fuzzed_schema_is_the_served_one(system):
    served = httpx.get(f"{system.url}/openapi.json", timeout=5).json()
    assert served == published_schema()
    assert {"/v1/completions", "/v1/chat/completions"} <= set(served["paths"])


def test_system_survived_the_fuzzing(system):
    """Runs after the fuzzing (file order): every process alive, no traceback logged, still serving."""
    for name, proc in system.procs.items():
        assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{system.log(name)}"
        assert "Traceback" not in (system.workdir / f"{name}.log").read_text(errors="replace"), system.log(name)
    assert httpx.get(f"{system.url}/ready", timeout=5).status_code == 200
    r = httpx.post(f"{system.url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
