"""Greedy chat streams against a running system, and where they run: what the failover tests compare.

A system is anything with `.url` (the gateway's) and `.cluster()` (its GET /v1/cluster): the processes of
tests/system.py or the containers of tests/compose.
"""

import threading
import time
from typing import Protocol

import openai

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["Name three rivers of Europe.", "Write a haiku about the sea.", "What is a prime number?",
           "Describe a cat in two sentences."]


class Served(Protocol):
    url: str

    def cluster(self) -> dict: ...


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


def running_on(system: Served) -> dict[str, int]:
    return {e["id"]: e["running"] for e in system.cluster()["executors"]}


def busiest(system: Served, timeout: float = 30) -> str:
    """The executor running the most streams, read from a cluster state that shows them running: a state
    published before they were admitted shows none, and the executor it names may hold none."""
    deadline = time.monotonic() + timeout
    while max((running := running_on(system)).values(), default=0) == 0:
        assert time.monotonic() < deadline, f"no stream ever showed running: {running}"
        time.sleep(0.05)
    return max(running.items(), key=lambda kv: kv[1])[0]


def streams_cut_short(url: str, messages: list[dict], timeout: float, count: int = 4) -> list[threading.Thread]:
    """`count` long greedy chats (1,500 tokens, ignore_eos) started in threads, for a test that kills the gateway
    they stream from: each ends quietly when it goes."""
    def read() -> None:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=timeout)
        try:
            for _ in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1500, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}):
                pass
        except openai.APIError:  # the gateway it streamed from is killed
            pass

    threads = [threading.Thread(target=read, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads
