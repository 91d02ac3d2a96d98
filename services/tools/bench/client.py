"""The load generator of `morphling bench`: open-loop replay of a trace against a gateway's HTTP API.

Every request is started at its scheduled arrival time by its own task, whatever happened to the
ones before it (open loop: a slow server gets more concurrent requests, as in production, instead of
a client that politely waits). A request is one streaming `/v1/completions` call with the prompt as
token ids, so that it is exactly as long as the trace says, `max_tokens` set to the trace's output
and `ignore_eos`, so that it generates exactly that many. The client records when it sent the
request, the time of every streamed chunk, the tokens it was served and any error; it decides nothing
from them.

The tokens come from `"logprobs": 0`: every streamed completions chunk then carries
`choices[0]["logprobs"]` = {"tokens": [...], "token_logprobs": [...], "top_logprobs": [...],
"text_offset": [...]} for the tokens of that engine step, each token as its own text decoded alone
(special tokens kept). They are read from there, not from `text`, because the gateway holds text
back (half a UTF-8 character, a possible stop string) but never a token's logprob entry: a chunk
whose `text` is "" still has its token. Token ids are not in OpenAI's completions format, so two
tokens compare by their text (bench.agreement says what that implies).

While the trace plays, `poll_cluster` samples `GET /v1/cluster` for the executors' KV pages, layer
bits and preemptions: the timeline that the metrics and plots put beside the requests.
"""

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from services.tools.bench.prompts import PromptPool
from services.tools.bench.trace import TraceRequest

CLUSTER_POLL_S = 0.25


@dataclass
class RequestRecord:
    index: int
    scheduled_s: float  # arrival in the schedule, seconds after the replay started
    prompt_tokens: int
    output_tokens: int  # asked for
    sent_s: float | None = None  # when the request left the client
    chunk_s: list[float] = field(default_factory=list)  # arrival of every streamed token chunk
    completion_tokens: int = 0  # as reported by the server's usage
    done_s: float | None = None
    error: str | None = None
    tokens: list[str] = field(default_factory=list)  # the generated tokens, each as its own text
    token_logprobs: list[float] = field(default_factory=list)  # the served model's log-prob of each

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_s is not None

    @property
    def e2e_s(self) -> float | None:
        return self.done_s - self.sent_s if self.ok else None

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_s[0] - self.sent_s if self.chunk_s and self.sent_s is not None else None


@dataclass
class ClusterSample:
    time_s: float  # seconds after the replay started
    executors: list[dict]  # the live executors of GET /v1/cluster, as it answered


def served_model(client: httpx.Client, url: str) -> str:
    """The model the gateway serves (the first of /v1/models)."""
    response = client.get(f"{url}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def tokenize(client: httpx.Client, url: str, model: str, text: str) -> list[int]:
    """`text` in the served model's token ids, without the special tokens a prompt would get in front."""
    response = client.post(f"{url}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": False})
    response.raise_for_status()
    return response.json()["tokens"]


def tokenized_prompts(client: httpx.Client, url: str, model: str, seed: int, texts: list[str],
                      requests: list[TraceRequest]) -> list[list[int]]:
    """A real prompt of exactly the trace's length for every request, in the served model's own token
    ids: the served system's /tokenize does the encoding, so the bench needs no model of its own."""
    pool = PromptPool(texts, lambda text: tokenize(client, url, model, text), seed)
    return [pool.take(r.prompt_tokens) for r in requests]


def request_body(model: str, req: TraceRequest, prompt: list[int]) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": req.output_tokens, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}


def read_chunk(chunk: dict, record: RequestRecord, now: float) -> None:
    """Record one parsed SSE chunk of the stream, arrived `now` seconds after the replay started; an
    error chunk sets `record.error`, which ends the stream."""
    if "error" in chunk:
        record.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
        return
    if chunk.get("usage"):
        record.completion_tokens = chunk["usage"]["completion_tokens"]
    if chunk.get("choices"):  # one per engine step, even when its text is held back (half a character)
        record.chunk_s.append(now)
        logprobs = chunk["choices"][0]["logprobs"]
        record.tokens += logprobs["tokens"]
        record.token_logprobs += logprobs["token_logprobs"]


async def _stream(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord, t0: float) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            text = (await response.aread()).decode("utf-8", "replace")
            try:
                message = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = text[:200]
            record.error = f"HTTP {response.status_code}: {message}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            read_chunk(json.loads(payload), record, time.monotonic() - t0)
            if record.error:
                return
    if record.completion_tokens != record.output_tokens:
        record.error = f"generated {record.completion_tokens} of the {record.output_tokens} tokens asked for"
    else:
        record.done_s = time.monotonic() - t0


async def send_one(client: httpx.AsyncClient, url: str, body: dict, record: RequestRecord, t0: float) -> None:
    record.sent_s = time.monotonic() - t0
    try:
        await _stream(client, url, body, record, t0)
    # ValueError: a chunk that is not JSON; KeyError, TypeError: a chunk of another shape (logprobs null)
    except (httpx.HTTPError, httpx.StreamError, ValueError, KeyError, TypeError) as e:
        record.error = f"{type(e).__name__}: {e}"


async def poll_cluster(client: httpx.AsyncClient, url: str, samples: list[ClusterSample], t0: float,
                       on_sample: Callable[[ClusterSample], None] | None = None) -> None:
    """Until cancelled, append a sample of the live executors every CLUSTER_POLL_S."""
    while True:
        try:
            response = await client.get(f"{url}/v1/cluster", timeout=5.0)
            if response.status_code == 200:
                live = [e for e in response.json()["executors"] if e["alive"]]
                sample = ClusterSample(time.monotonic() - t0, live)
                samples.append(sample)
                if on_sample:
                    on_sample(sample)
        except (httpx.HTTPError, ValueError, KeyError):
            pass  # a missed sample leaves a gap in the timeline, nothing worse
        await asyncio.sleep(CLUSTER_POLL_S)


async def replay(url: str, model: str, requests: list[TraceRequest], prompts: list[list[int]],
                 drain_timeout_s: float, api_key: str | None = None,
                 on_done: Callable[[RequestRecord], None] | None = None,
                 on_sample: Callable[[ClusterSample], None] | None = None
                 ) -> tuple[list[RequestRecord], list[ClusterSample], float]:
    """Play `requests` (with `prompts[i]` for request i) open loop; returns every request's record,
    the cluster timeline and the seconds the replay took. Requests still running `drain_timeout_s`
    after the last arrival are cancelled and recorded as failed, so none goes missing."""
    records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(requests)]
    samples: list[ClusterSample] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit: an open-loop client must never queue a request behind its own connections.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(10.0, read=None)  # the drain timeout bounds a stream, not a read timeout
    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=headers) as client:
        t0 = time.monotonic()
        poller = asyncio.create_task(poll_cluster(client, url, samples, t0, on_sample))
        tasks = []

        for record, req, prompt in zip(records, requests, prompts):
            delay = t0 + req.arrival_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(send_one(client, url, request_body(model, req, prompt), record, t0))
            if on_done:
                task.add_done_callback(lambda _, r=record: on_done(r))
            tasks.append(task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for record in records:
            if record.done_s is None and record.error is None:
                record.error = f"unfinished {drain_timeout_s:g} s after the last arrival (drain timeout)"
        elapsed = time.monotonic() - t0
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
    return records, samples, elapsed
