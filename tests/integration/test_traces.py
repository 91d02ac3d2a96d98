"""One trace per HTTP request across real processes, as an OpenTelemetry collector receives it.

`morphling up` starts nats-server, gateway, executor, monitor and controller as separate processes,
exactly as a user starts them, with OTEL_EXPORTER_OTLP_ENDPOINT pointing at an OTLP/HTTP receiver in
this test. Two chat completions go through the official openai client, one streamed and one not.
The promises checked:

1. Each request is one trace: the gateway's server span (with its gen_ai.* attributes) and the
   executor's request/queue/prefill/decode spans share a trace id, and the executor's request span
   hangs under a span of the gateway's process. Nothing but the W3C trace context in the NATS
   headers connects the two processes, so this is the promise that the context crosses the bus.
   Two requests make two traces.
2. No span carries the prompt text: recording content is off unless MORPHLING_TRACE_CONTENT=1.
3. A clean stop loses no spans: Ctrl-C (SIGINT) ends `morphling up` with status 0, and every process
   flushes its exporter at exit. To make that visible the exporters' batch delay is set far beyond
   the run, so no span leaves a process on the schedule; whatever the receiver has, it got from the
   flushes at exit. (With a short delay the spans would be exported long before the stop, and a
   process that drops its last batch at exit would go unnoticed.)
"""

import os
from dataclasses import dataclass

import openai
import pytest

from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.up_process import UpProcess

MODEL = "SmolLM2-135M-Instruct"
GATEWAY = "morphling-gateway"
EXECUTOR = "morphling-executor"
EXECUTOR_SPANS = ("executor.request", "executor.queue", "executor.prefill", "executor.decode")
CHAT_SPAN = "POST /v1/chat/completions"
# A word that appears nowhere but in the prompts, so that finding it in a span means the prompt leaked.
SECRET = "zebracornium"
# The two requests differ in max_tokens only, so that each server span can be matched to its request.
PLAIN_MAX_TOKENS, STREAM_MAX_TOKENS = 8, 9
READY_TIMEOUT_S = 180  # the default model loads in ~20 s on an idle 2-core machine
STOP_TIMEOUT_S = 60  # `morphling up` gives the gateway up to 40 s to drain; nothing is in flight here
# Far longer than the run: the exporters send nothing until the processes flush them at exit. The
# batch size is raised to the queue size so that the gateway's many /ready polls cannot fill a batch.
EXPORT_AT_EXIT_ONLY = {"OTEL_BSP_SCHEDULE_DELAY": "600000", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2048"}


def child_env(endpoint: str) -> dict[str, str]:
    """This environment without any tracing settings of its own, exporting to `endpoint`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "MORPHLING_TRACE_CONTENT"}
    return env | {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint} | EXPORT_AT_EXIT_ONLY


@dataclass
class Run:
    up: UpProcess
    plain: object  # the non-streamed ChatCompletion
    stream_usage: object  # the streamed reply's usage (its last chunk)
    before_stop: list[ReceivedSpan]
    exit_status: int | None
    spans: list[ReceivedSpan]  # everything received, after `morphling up` exited
    refused: list[str]  # why the receiver refused an export, if it did


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Run:
    """One `morphling up`, two chat completions, a Ctrl-C; every span the processes exported."""
    with OtlpReceiver() as receiver:
        up = UpProcess(tmp_path_factory.mktemp("traces"), env=child_env(receiver.endpoint))
        try:
            url = up.wait_ready(READY_TIMEOUT_S)
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            messages = [{"role": "user", "content": f"What colour is a {SECRET}? Answer in one word."}]
            plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=PLAIN_MAX_TOKENS,
                                                   temperature=0)
            chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                         max_tokens=STREAM_MAX_TOKENS, stream=True,
                                                         stream_options={"include_usage": True}))
            assert plain.choices[0].message.content and plain.usage.completion_tokens > 0
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            before_stop = receiver.spans()
        finally:
            status = up.interrupt(STOP_TIMEOUT_S)
        # Every child has exited by now, and an exporter's flush at exit returns once the receiver
        # answered, so nothing is still on its way.
        return Run(up, plain, chunks[-1].usage, before_stop, status, receiver.spans(), receiver.refused)


def server_span(spans: list[ReceivedSpan], max_tokens: int) -> ReceivedSpan:
    found = [s for s in spans if s.service == GATEWAY and s.name == CHAT_SPAN
             and s.attributes.get("gen_ai.request.max_tokens") == max_tokens]
    assert len(found) == 1, f"expected one gateway span {CHAT_SPAN} with max_tokens {max_tokens}, got {found}"
    return found[0]


def assert_one_trace(spans: list[ReceivedSpan], gateway: ReceivedSpan, input_tokens: int, output_tokens: int) -> None:
    """The executor's spans of this request are in the gateway's trace, under the gateway's server span."""
    assert gateway.kind == "SERVER"
    assert gateway.attributes["gen_ai.operation.name"] == "chat"
    assert gateway.attributes["gen_ai.request.model"] == MODEL
    assert gateway.attributes["gen_ai.usage.input_tokens"] == input_tokens
    assert gateway.attributes["gen_ai.usage.output_tokens"] == output_tokens
    assert gateway.attributes["http.response.status_code"] == 200

    in_trace = [s for s in spans if s.trace_id == gateway.trace_id]
    mine = {s.name: s for s in in_trace if s.service == EXECUTOR}
    assert sorted(mine) == sorted(EXECUTOR_SPANS), \
        f"the executor's spans in the gateway's trace {gateway.trace_id}: {sorted(mine)}"
    assert len([s for s in in_trace if s.service == EXECUTOR]) == len(EXECUTOR_SPANS)

    # The executor's root span hangs under a span of the gateway's process, and from there (through
    # whatever spans the gateway may open in between) up to the server span.
    by_id = {s.span_id: s for s in in_trace}
    root = mine["executor.request"]
    assert root.kind == "SERVER"  # the receiving end of the gateway's request over the bus
    parent = by_id.get(root.parent_span_id)
    assert parent is not None and parent.service == GATEWAY, \
        f"executor.request's parent {root.parent_span_id!r} is not a span of the gateway: {parent}"
    chain = [parent]
    while chain[-1].span_id != gateway.span_id:
        above = by_id.get(chain[-1].parent_span_id)
        assert above is not None and above.service == GATEWAY, \
            f"executor.request is not under the server span; its ancestors: {[s.name for s in chain]}"
        chain.append(above)
    for phase in ("executor.queue", "executor.prefill", "executor.decode"):
        assert mine[phase].parent_span_id == root.span_id, f"{phase} is not under executor.request"
    # One host, one clock: the waterfall nests.
    assert gateway.start_ns <= root.start_ns <= root.end_ns <= gateway.end_ns
    assert root.attributes["gen_ai.request.model"] == MODEL
    assert root.attributes["gen_ai.usage.input_tokens"] == input_tokens
    assert root.attributes["gen_ai.usage.output_tokens"] == output_tokens


def test_up_stops_cleanly_and_every_process_flushes_its_spans_at_exit(run):
    assert run.exit_status == 0, f"`morphling up` ended with {run.exit_status} after SIGINT:\n{run.up.logs()}"
    assert not run.refused, f"the receiver refused exports: {run.refused}"
    early = [(s.service, s.name) for s in run.before_stop if s.name in (CHAT_SPAN, *EXECUTOR_SPANS)]
    assert not early, f"spans were exported before the stop, so this run cannot show the flush at exit: {early}"
    lost = {service: sorted(names - {s.name for s in run.spans if s.service == service})
            for service, names in ((GATEWAY, {CHAT_SPAN}), (EXECUTOR, set(EXECUTOR_SPANS)))}
    assert not any(lost.values()), f"spans lost at exit, by process: {lost}"


def test_each_request_is_one_trace_from_the_gateway_through_nats_to_the_executor(run):
    plain = server_span(run.spans, PLAIN_MAX_TOKENS)
    assert_one_trace(run.spans, plain, run.plain.usage.prompt_tokens, run.plain.usage.completion_tokens)
    streamed = server_span(run.spans, STREAM_MAX_TOKENS)
    assert_one_trace(run.spans, streamed, run.stream_usage.prompt_tokens, run.stream_usage.completion_tokens)
    assert plain.trace_id != streamed.trace_id, "two requests ended up in one trace"


def test_no_span_carries_the_prompt(run):
    assert run.spans, "no spans received"
    leaks = [(s.service, s.name, k) for s in run.spans for k, v in s.attributes.items() if SECRET in str(v)]
    assert not leaks, f"the prompt text is recorded in span attributes: {leaks}"
    assert not [s.name for s in run.spans if SECRET in s.name]
