"""A client that stops reading its stream costs the cluster nothing for long: the real system, a raw socket.

The gateway holds at most MORPHLING_STREAM_BUFFER deltas per request (a small number here). A client
that reads one chunk and then stops fills its socket, then the gateway's, then that buffer; the
gateway then cancels the request on its executor, whose pages come back at once, and ends the stream
with a slow_consumer error that the client finds when it reads again. Each token of this request
(n completions, 20 logprobs each) makes a chunk of several hundred bytes, and the client's receive
buffer is kept small, so that the buffers fill within seconds.
"""

import json
import re
import socket
import time

import httpx
import openai
import pytest

from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
BUFFER = 8  # deltas the gateway holds per request
SLOW = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1800, "n": 4, "logprobs": 20, "ignore_eos": True,
        "stream": True}
COUNTER = "morphling_gateway_slow_consumers_total"


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    sys_ = System(tmp_path_factory.mktemp("slow"), gateway_env={"MORPHLING_STREAM_BUFFER": str(BUFFER)}).start()
    yield sys_
    sys_.stop()


class RawStream:
    """A streaming POST over a plain socket, read only when the test says so."""

    def __init__(self, port: int, body: dict):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Before connecting, so that the handshake announces them: a small window, and a small segment size,
        # which keeps the gateway's kernel from growing its send buffer to megabytes (it scales with the MSS,
        # 64 KiB on loopback).
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        self.sock.settimeout(30)
        self.sock.connect(("127.0.0.1", port))
        payload = json.dumps(body).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(payload), payload))
        self.reader = self.sock.makefile("rb", buffering=0)
        status = self.reader.readline()
        assert b" 200 " in status, status + self.reader.read(2000)
        while self.reader.readline() not in (b"\r\n", b""):  # headers
            pass

    def chunk(self) -> bytes:
        """One HTTP chunk of the body (one SSE event, as the gateway writes them); b"" at the end."""
        size = int(self.reader.readline().split(b";")[0], 16)
        data = self.read_exactly(size)
        self.read_exactly(2)  # CRLF
        return data

    def read_exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size:
            more = self.reader.read(size - len(data))
            assert more, "the connection closed mid-chunk"
            data += more
        return data

    def events(self) -> list[str]:
        """Every SSE data field from here to the end of the response."""
        body = b"".join(iter(self.chunk, b"")).decode()
        return re.findall(r"^data: (.*)$", body, flags=re.MULTILINE)

    def close(self) -> None:
        self.sock.close()


def slow_consumers(system: System) -> float:
    metrics = httpx.get(f"{system.url}/metrics", timeout=5).text
    return float(re.search(rf"^{COUNTER} (\S+)$", metrics, flags=re.MULTILINE).group(1))


def wait_for(check, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.2)


def test_a_client_that_stops_reading_is_cut_off_and_its_pages_come_back(system):
    before = slow_consumers(system)
    stream = RawStream(system.port, SLOW)
    try:
        first = json.loads(stream.chunk().decode().removeprefix("data: "))
        assert first["choices"][0]["logprobs"]["top_logprobs"]  # it started, with big chunks
        # The client reads nothing more. The request is cut off long before its 1800 tokens could be
        # generated (about 8 s here, most of it filling the sockets), and its executor is idle with every
        # KV page free again.
        wait_for(lambda: slow_consumers(system) > before, "the gateway cutting the slow client off", 45)
        wait_for(lambda: all(e["running"] == 0 and e["waiting"] == 0 and e["kv"]["pages_used"] == 0
                             for e in system.cluster()["executors"]), "the executor freeing the request's pages", 10)
        assert slow_consumers(system) == before + 1

        events = stream.events()  # the client reads again: what was in flight, then the reason it ended
    finally:
        stream.close()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "slow_consumer" and "did not read" in error["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])


def test_a_client_that_keeps_reading_gets_its_whole_stream(system):
    before = slow_consumers(system)
    client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=48, n=2,
                                            logprobs=20, extra_body={"ignore_eos": True}, stream=True,
                                            stream_options={"include_usage": True}))
    finishes = sorted((c.choices[0].index, c.choices[0].finish_reason) for c in chunks
                      if c.choices and c.choices[0].finish_reason)
    assert finishes == [(0, "length"), (1, "length")]
    assert chunks[-1].usage.completion_tokens == 96
    assert slow_consumers(system) == before
