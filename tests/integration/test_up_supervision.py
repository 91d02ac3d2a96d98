"""`morphling up` as a supervisor: a child killed under load comes back by itself, and the client of
the request it was serving hears about it instead of hanging or being handed a text with a hole.

One real `morphling up` (embedded nats-server, monitor, controller, one executor with the default
model, gateway) serves the module; each test streams a greedy chat completion through the official
`openai` client and SIGKILLs one child in the middle of it, found by the pid file `up` keeps in its
log directory, then checks that the system serves again before the next test:

- the executor: the stream ends with an SSE error (the gateway may try another executor for only
  1 s, and there is none); `up` restarts the executor, a new request succeeds, and the gateway's
  /metrics counts the restart;
- the gateway, with four long streams: the executor cancels the dead gateway's requests once it hears the
  restarted one (a new incarnation);
- nats-server, back within the bus-outage bound (`up` restarts it after 0.5 s): the stream goes on and
  holds the same text as an undisturbed run;
- nats-server, gone longer than the bound (the test holds its port, so `up`'s restarts fail for a
  while): the stream ends with an SSE error within the bound plus slack; `up` keeps restarting
  nats-server until it is back on the same port, and a new request succeeds.
"""

import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from tests.streams import streams_cut_short
from tests.up_process import UpProcess

MODEL = "SmolLM2-135M-Instruct"
READY_TIMEOUT_S = 180  # the default model loads in ~20 s on an idle 2-core machine
RECOVER_TIMEOUT_S = 180  # a restarted executor loads the model again
STOP_TIMEOUT_S = 60
EXECUTOR_LOST_WITHIN_S = 30  # failover timeout 1 s plus the monitor's dead threshold, with slack
BUS_OUTAGE_S = 5  # a restart (0.5 s) and the clients' reconnect (0.25 s a try) stay well inside it
BUS_LOST_WITHIN_S = 15  # the bus-outage bound plus slack
# Long enough that the outage outlasts the bound, short enough that `up`'s restarts of nats-server
# meanwhile (after 0.5, 1 and 2 s of backoff) stay below its crash-loop limit.
PORT_HELD_S = BUS_OUTAGE_S + 3
MESSAGES = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def up(tmp_path_factory) -> UpProcess:
    # Without keys the gateway takes any; the test's own environment must not switch auth on.
    env = {k: v for k, v in os.environ.items()
           if k not in ("MORPHLING_API_KEYS", "MORPHLING_ADMIN_KEYS") and not k.startswith("OTEL_")}
    up = UpProcess(tmp_path_factory.mktemp("up"), "--failover-timeout", "1", "--bus-outage", str(BUS_OUTAGE_S),
                   env=env)
    try:
        up.wait_ready(READY_TIMEOUT_S)
        yield up
    finally:
        up.interrupt(STOP_TIMEOUT_S)


def stream_and_kill(up: UpProcess, child: str, max_tokens: int, after_kill=lambda: None):
    """Streams a greedy completion and SIGKILLs `child` once text is flowing (then runs `after_kill`):
    the error that ended the stream or None, the seconds from the kill to its end, and the text."""
    stream = client(up.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=max_tokens,
                                                    temperature=0, stream=True, extra_body={"ignore_eos": True})
    text, killed_at, error = "", None, None
    try:
        for chunk in stream:
            text += "".join(c.delta.content or "" for c in chunk.choices)
            if killed_at is None and text:
                os.kill(up.pid(child), signal.SIGKILL)
                killed_at = time.monotonic()
                after_kill()
    except openai.APIError as exc:
        error = exc
    assert killed_at is not None, f"the stream ended before {child} was killed: {error!r}:\n{up.logs()}"
    return error, time.monotonic() - killed_at, text


def assert_stream_error(error: openai.APIError | None, seconds: float, bound: float, up: UpProcess) -> None:
    assert error is not None, f"the stream ended normally although its {bound} s bound passed:\n{up.logs()}"
    # A timeout or a dropped connection is also an APIError; the promise is an error event in the stream.
    assert not isinstance(error, openai.APIConnectionError), f"no error event, the connection failed: {error!r}"
    assert isinstance(error.body, dict) and error.body.get("message"), error.body
    assert seconds < bound, f"the error came {seconds:.1f} s after the kill:\n{up.logs()}"


def wait_serving(up: UpProcess) -> None:
    """Until /ready is 200 and the gateway sees exec0 alive."""
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    with httpx.Client(timeout=5) as http:
        while time.monotonic() < deadline:
            try:
                executors = http.get(f"{up.url}/v1/cluster").json()["executors"]
                if http.get(f"{up.url}/ready").status_code == 200 and any(e["id"] == "exec0" and e["alive"]
                                                                         for e in executors):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise AssertionError(f"the system did not serve again within {RECOVER_TIMEOUT_S} s:\n{up.logs()}")


def assert_answers(up: UpProcess) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client(up.url).chat.completions.create(model=MODEL, temperature=0, max_tokens=8, messages=question)
    assert reply.choices[0].message.content


def wait_log(up: UpProcess, child: str, after: str, text: str) -> None:
    """Until `text` is in `child`'s log after the line containing `after` (`up`'s restart marker)."""
    deadline = time.monotonic() + RECOVER_TIMEOUT_S
    while text not in (up.log_dir / f"{child}.log").read_text(errors="replace").rpartition(after)[2]:
        assert time.monotonic() < deadline, f"{child} never logged {text!r} after {after!r}:\n{up.logs()}"
        time.sleep(0.3)


def test_the_ready_output_names_the_url_to_export_and_says_auth_is_off(up):
    assert f"export MORPHLING_URL={up.url}\n" in up.stdout
    assert "authentication is off" in up.console() and "MORPHLING_API_KEYS=" in up.console()


def test_a_killed_executor_ends_its_stream_with_an_error_and_comes_back(up):
    first_pid = up.pid("exec0")
    error, seconds, text = stream_and_kill(up, "exec0", max_tokens=200)
    assert_stream_error(error, seconds, EXECUTOR_LOST_WITHIN_S, up)
    assert text  # what came before the kill stays delivered

    up.wait_console("exec0 restarted (restart 1", timeout=30)
    assert "exec0 was killed by SIGKILL; restart 1 in" in up.console()
    assert up.pid("exec0") != first_pid
    # The new process, not a stale view of the old one, must be what serves.
    wait_log(up, "exec0", "restart 1:", "serving")
    wait_serving(up)
    assert_answers(up)

    expected = 'morphling_executor_restarts_total{executor="exec0"} 1.0'
    deadline = time.monotonic() + 10
    while expected not in (metrics := httpx.get(f"{up.url}/metrics", timeout=5).text):
        assert time.monotonic() < deadline, \
            f"{expected!r} not in /metrics:\n" + "\n".join(m for m in metrics.splitlines() if "restart" in m)
        time.sleep(0.5)


def test_a_killed_gateways_requests_stop_running_on_the_executor(up):
    """SIGKILL the gateway with four long streams on the executor: `up` restarts it, and the executor, hearing
    a new incarnation, cancels the dead one's requests instead of running them for nobody to
    their last token (about 200 s here)."""
    def running() -> int:
        return next(e["running"] for e in httpx.get(f"{up.url}/v1/cluster", timeout=5).json()["executors"]
                    if e["id"] == "exec0")

    streams = streams_cut_short(up.url, MESSAGES, timeout=60)
    deadline = time.monotonic() + 60
    while running() < 4:
        assert time.monotonic() < deadline, f"the four streams never ran together:\n{up.logs()}"
        time.sleep(0.3)
    os.kill(up.pid("gateway"), signal.SIGKILL)
    killed = time.monotonic()
    up.wait_console("gateway restarted (restart 1", timeout=30)
    wait_serving(up)
    while running():
        assert time.monotonic() - killed < 30, f"the dead gateway's requests still run:\n{up.logs()}"
        time.sleep(0.3)
    assert "is gone: cancelling its 4 requests" in (up.log_dir / "exec0.log").read_text(errors="replace")
    for t in streams:
        t.join(timeout=10)
    assert_answers(up)


def test_a_nats_server_back_within_the_outage_bound_loses_no_text(up):
    undisturbed = client(up.url).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0,
                                                         extra_body={"ignore_eos": True}).choices[0].message.content
    restarts = up.console().count("nats-server restarted")
    error, _, text = stream_and_kill(up, "nats-server", max_tokens=60)
    up.wait_console(f"nats-server restarted (restart {restarts + 1}", timeout=30)
    assert error is None, f"the bus came back within the bound, yet the stream ended: {error}\n{up.logs()}"
    assert text == undisturbed, "the stream went on after the bus came back, but text was lost on the way"
    wait_serving(up)
    assert_answers(up)


def test_a_nats_outage_beyond_the_bound_ends_streams_with_an_error_and_the_bus_comes_back(up):
    bus_port = int(up.nats_url().rsplit(":", 1)[1])
    holder = socket.socket()

    def hold_port() -> None:
        # Listening on nats-server's port makes each restart of it fail until the port is let go.
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 0.4  # `up` restarts it after 0.5 s
        while True:
            try:  # the killed server may not have let go of the port yet
                holder.bind(("127.0.0.1", bus_port))
                break
            except OSError:
                assert time.monotonic() < deadline, "the killed nats-server kept its port"
                time.sleep(0.01)
        holder.listen()
        threading.Timer(PORT_HELD_S, holder.close).start()

    try:
        error, seconds, _ = stream_and_kill(up, "nats-server", max_tokens=200, after_kill=hold_port)
        assert_stream_error(error, seconds, BUS_LOST_WITHIN_S, up)
    finally:
        holder.close()
    up.wait_console("nats-server exited with status 1", timeout=30)
    # Back on the same port: clients, which reconnect to the address they know, find it again.
    wait_log(up, "nats-server", "morphling up", f"Listening for client connections on 127.0.0.1:{bus_port}")
    wait_serving(up)
    assert_answers(up)


def test_up_stops_cleanly_and_keeps_the_logs(up):
    assert up.interrupt(STOP_TIMEOUT_S) == 0, f"`morphling up` did not stop cleanly after Ctrl-C:\n{up.logs()}"
    assert f"logs kept in {up.log_dir}" in up.console()
    assert {p.name for p in up.log_dir.glob("*.log")} >= {"exec0.log", "gateway.log", "nats-server.log"}
    assert not list(up.log_dir.glob("*.pid"))
