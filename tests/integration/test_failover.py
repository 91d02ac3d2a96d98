"""Executors that die or stall under in-flight streams, with real processes and the default model.

A SIGKILLed executor's streams go on on another executor, token for token what an undisturbed run
gives; a SIGSTOPped one is only suspect for the seconds it is stopped, and its streams finish on it.
"""

import signal
import threading
import time

import httpx
import openai
import pytest

from tests.system import System

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name three rivers of Europe.", "Write a haiku about the sea.", "What is a prime number?",
           "Describe a cat in two sentences."]


class Streams:
    """Greedy chat streams read in threads: what each client received, chunk by chunk."""

    def __init__(self, url: str, max_tokens: int):
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.max_tokens = max_tokens
        self.chunks: list[list[str]] = [[] for _ in PROMPTS]
        self.usage: list[int | None] = [None] * len(PROMPTS)
        self.errors: list[Exception] = []
        self.threads = [threading.Thread(target=self._read, args=(i,), daemon=True) for i in range(len(PROMPTS))]

    def start(self) -> "Streams":
        for t in self.threads:
            t.start()
        return self

    def _read(self, i: int) -> None:
        try:
            stream = self.client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": PROMPTS[i]}], max_tokens=self.max_tokens,
                temperature=0, stream=True, stream_options={"include_usage": True})
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    self.chunks[i].append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    self.usage[i] = chunk.usage.completion_tokens
        except Exception as exc:  # the assertion below names it
            self.errors.append(exc)

    def wait_for_tokens(self, at_least: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while min(len(c) for c in self.chunks) < at_least:
            assert time.monotonic() < deadline and not self.errors, f"streams stalled: {self.errors}"
            time.sleep(0.05)

    def join(self, timeout: float = 180) -> list[str]:
        for t in self.threads:
            t.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "a stream never ended"
        assert not self.errors, f"a client saw an error: {self.errors}"
        return ["".join(c) for c in self.chunks]


def running_on(system: System) -> dict[str, int]:
    return {e["id"]: e["running"] for e in system.cluster()["executors"]}


def busiest(system: System, timeout: float = 30) -> str:
    """The executor running the most streams, read from a cluster state that shows them running: a state
    published before they were admitted shows none, and the executor it names may hold none."""
    deadline = time.monotonic() + timeout
    while max((running := running_on(system)).values(), default=0) == 0:
        assert time.monotonic() < deadline, f"no stream ever showed running: {running}"
        time.sleep(0.05)
    return max(running.items(), key=lambda kv: kv[1])[0]


def test_streams_of_a_killed_executor_finish_on_the_other_token_for_token(tmp_path):
    system = System(tmp_path, executors=2).start()
    try:
        undisturbed = Streams(system.url, max_tokens=64).start()
        expected = undisturbed.join()
        expected_usage = undisturbed.usage

        streams = Streams(system.url, max_tokens=64).start()
        streams.wait_for_tokens(3)
        killed = busiest(system)
        system.kill(killed)
        assert streams.join() == expected
        assert streams.usage == expected_usage
        moved = [line for line in httpx.get(f"{system.url}/metrics").text.splitlines()
                 if line.startswith("morphling_stream_failovers_total ")]
        assert moved and float(moved[0].split()[1]) >= 1  # some streams did move, and none noticed
        survivor = next(e for e in system.cluster()["executors"] if e["id"] != killed)
        assert survivor["alive"]
    finally:
        system.stop()


def test_a_stalled_executor_is_suspect_not_dead_and_its_streams_finish(tmp_path):
    system = System(tmp_path).start()
    try:
        streams = Streams(system.url, max_tokens=48).start()
        streams.wait_for_tokens(2)
        system.procs["exec0"].send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.0)  # past suspect_after (1 s), well short of dead_after (6 s)
            (e,) = system.cluster()["executors"]
            assert e["alive"] and e["suspect"]
            time.sleep(2.0)
        finally:
            system.procs["exec0"].send_signal(signal.SIGCONT)
        texts = streams.join()
        assert all(texts) and all(streams.usage)  # each ended normally, with its usage chunk
        (e,) = system.cluster()["executors"]
        assert e["alive"] and not e["suspect"] and e["restarts"] == 0
    finally:
        system.stop()


def test_a_killed_executor_with_no_other_ends_its_streams_with_an_error(tmp_path):
    system = System(tmp_path, gateway_args=("--failover-timeout", "1")).start()
    try:
        client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=200, temperature=0, stream=True)
        next(stream)
        started = time.monotonic()
        system.kill("exec0")
        with pytest.raises(openai.APIError, match="no other executor took it over"):
            for _ in stream:
                pass
        # Found gone by the monitor's probe (~suspect_after), then the failover bound, then slack.
        assert time.monotonic() - started < 15
    finally:
        system.stop()
