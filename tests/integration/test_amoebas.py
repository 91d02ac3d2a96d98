"""AMOEBAs end to end: `morphling up --executors 2 --memory-budget 470MiB --max-model-len 4096` (each executor
alone holds about a quarter of one sequence of 4096 tokens, a TP2 merge all of it, so it starts), real
processes, the official `openai` client streaming over real HTTP.

Short requests stream on both executors all along. A request of about 1.5x what one executor holds arrives:
the gateway has the two merged into one TP2 instance and the request waits for that, not a 400; it streams
the same greedy text as one engine with room for it. Once it is done the controller splits the instance
back, and the cluster is two TP1 instances again. Every short request, those running across the merge and
across the split among them, streams exactly the text of an undisturbed run."""

import concurrent.futures
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from services.executor.engine.engine import LLMEngine
from services.executor.engine.model.loader import resolve_model_path
from services.executor.engine.model.tokenizer import Tokenizer
from shared.config import EngineConfig, parse_size
from shared.sampling import SamplingOptions
from tests.integration.test_controller_morphs import EventLog
from tests.integration.test_fabric import serve

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--memory-budget", "470MiB", "--max-model-len", "4096")
SHORT_PROMPTS = ["The history of the city begins", "Once upon a time, a lighthouse keeper", "The recipe calls for",
                 "In the year 1990, the band", "Rain fell on the", "Scientists have long argued that"]
SHORT_TOKENS = 24
LONG_TOKENS = 40
TEXT = ("The lighthouse stood on the northern cape for two hundred years, and every keeper wrote down the weather, "
        "the ships that passed and the birds that rested on the gallery rail. ")


def reference(long_prompt: list[int]) -> tuple[list[str], str]:
    """The greedy texts of one engine with room for everything (twice an executor's budget)."""
    engine = LLMEngine(EngineConfig(model="default", memory_budget=2 * parse_size(FLAGS[1]), max_model_len=4096),
                       progress=False)
    short = SamplingOptions(temperature=0.0, max_tokens=SHORT_TOKENS, ignore_eos=True)
    shorts = [c.outputs[0].text for c in engine.generate(SHORT_PROMPTS, short)]
    long_params = SamplingOptions(temperature=0.0, max_tokens=LONG_TOKENS, ignore_eos=True)
    return shorts, engine.generate([long_prompt], long_params)[0].outputs[0].text


def stream(client: openai.OpenAI, prompt, max_tokens: int) -> str:
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def instances(url: str) -> list[dict]:
    return httpx.get(f"{url}/v1/cluster", timeout=10).json()["instances"]


def kv_blocks(url: str) -> dict[str, int]:
    return {e["id"]: e["kv"]["pages_free"] + e["kv"]["pages_used"]
            for e in httpx.get(f"{url}/v1/cluster", timeout=10).json()["executors"]}


def until(predicate, timeout: float = 10.0) -> bool:
    """Whether `predicate` holds within `timeout` (the monitor's view lags the executors a little)."""
    deadline = time.monotonic() + timeout
    while not (ok := predicate()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return ok


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    proc = serve(tmp_path_factory.mktemp("amoebas"), "default", FLAGS, "--executors", "2")
    # `up` is ready once one executor serves; these tests start from both.
    assert until(lambda: [i["tp"] for i in instances(proc.url)] == [1, 1], 120), instances(proc.url)
    events = EventLog(proc.nats_url())
    yield proc, events
    events.close()
    proc.interrupt(60)


def test_a_request_longer_than_an_executor_holds_merges_two_into_tp2_and_they_split_back_after(up):
    proc, events = up
    url = proc.url
    alone = kv_blocks(url)
    assert [i["tp"] for i in instances(url)] == [1, 1]
    tokenizer = Tokenizer.load(resolve_model_path("default"))
    long_prompt = tokenizer.encode(TEXT * 60)[:int(1.5 * min(alone.values()) * 16) - LONG_TOKENS]
    assert len(long_prompt) + LONG_TOKENS > 1.4 * 16 * max(alone.values())  # no executor holds it alone
    want_short, want_long = reference(long_prompt)

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    # The shorts' client retries a 429 as the official client does by default: while the two executors merge,
    # a short may find no queue to take it for a moment.
    short_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=2, timeout=300)
    shorts: list[tuple[int, str, float, float]] = []  # prompt, text, start, end
    stop = threading.Event()

    def short_stream(worker: int) -> None:
        k = worker
        while not stop.is_set():
            started = time.time()
            text = stream(short_client, SHORT_PROMPTS[k % len(SHORT_PROMPTS)], SHORT_TOKENS)
            shorts.append((k % len(SHORT_PROMPTS), text, started, time.time()))
            k += 2

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        workers = [pool.submit(short_stream, w) for w in range(2)]
        time.sleep(3)
        # shorts running on both executors when the long one comes, so that some run across the merge
        assert until(lambda: all(executor(url, e)["running"] for e in ("exec0", "exec1")), 30)
        long_started = time.time()
        got_long = stream(client, long_prompt, LONG_TOKENS)
        long_ended = time.time()
        got = events.wait_for(lambda data: any(d["kind"] == "tp_split" for d in data), timeout=60)
        [split] = [e for e in got if e.data["kind"] == "tp_split"]
        time.sleep(3)  # shorts go on alone again
        stop.set()
        for w in workers:
            w.result(timeout=120)

    merges = [e for e in events.got if e.data["kind"] == "tp_merge"]
    for e in [*merges, split]:
        report = {k: v for k, v in e.data["state"].items() if k != "plan"}
        print(f"{e.data['kind']} on {e.data['executor']}: {e.data['latency_s']:.2f} s, {report}")
    print(f"long request: {len(long_prompt)} prompt tokens, {long_ended - long_started:.1f} s; "
          f"{len(shorts)} short requests; KV blocks alone {alone}")
    assert {e.data["executor"] for e in merges} == {"exec0", "exec1"} and all(e.data["ok"] for e in merges)
    # the less loaded of the two leads the merge (tp_scheduler), so either may: the split goes to the leader
    [leader] = {e.data["args"]["executors"][0] for e in merges}
    assert split.data["ok"] and split.data["executor"] == leader
    assert got_long == want_long
    assert [i["tp"] for i in instances(url)] == [1, 1]
    assert kv_blocks(url) == alone
    assert long_started <= min(e.time for e in merges) <= long_ended <= split.time
    for k, text, _, _ in shorts:
        assert text == want_short[k], SHORT_PROMPTS[k]

    def across(event) -> bool:  # a short request that ran from before the command was sent to after its answer
        return any(start < event.time - event.data["latency_s"] and end > event.time for _, _, start, end in shorts)

    def waited(event) -> bool:  # ... or one the gateway held for it: a draining merge takes no new requests
        return any(start < event.time < end for _, _, start, end in shorts)
    assert any(across(e) for e in merges), "no short request ran across the merge"
    # The split waits for a step boundary: the shorts on the instance may all end in that step, and the next
    # ones then wait at the gateway for the split, which they must live through as well.
    assert across(split) or waited(split), "no short request ran across the split"


def morph(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/cluster/morph", json=body, timeout=120)


def executor(url: str, name: str) -> dict:
    return next(e for e in httpx.get(f"{url}/v1/cluster", timeout=10).json()["executors"] if e["id"] == name)


def test_merge_and_split_by_hand_out_of_rank_order_refusals_and_cancels_of_requests_the_merge_moved(up):
    proc, _ = up
    url = proc.url
    alone = kv_blocks(url)
    for body, status, param in (({"action": "tp_merge", "executors": ["exec0", "exec0"]}, 400, "executors"),
                                ({"action": "tp_merge", "executors": ["exec0"]}, 400, "executors"),
                                ({"action": "tp_merge", "executors": ["exec0", "exec9"]}, 404, "executor"),
                                ({"action": "tp_merge", "executors": ["exec0", "exec1"], "to": "x"}, 400, "to"),
                                ({"action": "tp_split", "instance": "i0"}, 409, None)):
        r = morph(url, body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param, r.text
    assert [i["tp"] for i in instances(url)] == [1, 1]

    # Two long streams, one on each executor; the merge (exec1 leading: not in rank order) hands exec0's over to
    # exec1, and their clients leave.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    streams = []
    for prompt in SHORT_PROMPTS[:2]:  # the second goes where the first left more KV free, once the view shows it
        streams.append(client.completions.create(model=MODEL, prompt=prompt, max_tokens=400, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
        next(iter(streams[-1]))
        assert until(lambda: sum(executor(url, e)["running"] for e in ("exec0", "exec1")) == len(streams))
    assert {executor(url, e)["running"] for e in ("exec0", "exec1")} == {1}
    cli = subprocess.run([sys.executable, "-m", "services.cli", "morph", "--url", url, "--action", "tp_merge",
                          "--executors", "exec1", "exec0"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    [merged] = instances(url)
    assert merged["id"] == "tp-exec1-exec0" and merged["tp"] == 2 and merged["merged"] is True
    assert merged["leader"] == "exec1"
    assert until(lambda: executor(url, "exec1")["running"] == 2)
    for body in ({"executor": "exec0", "action": "quantize", "layers": 2, "bits": 8},
                 {"executor": "exec1", "action": "quantize", "layers": 2, "bits": 8},
                 {"action": "tp_merge", "executors": ["exec0", "exec1"]},
                 {"action": "batch", "instance": "tp-exec1-exec0", "max_num_seqs": 2}):
        r = morph(url, body)
        assert r.status_code == 409, r.text
    for s in streams:
        s.close()
    assert until(lambda: executor(url, "exec1")["running"] == 0 and executor(url, "exec1")["kv"]["pages_used"] == 0)

    r = morph(url, {"action": "tp_split", "instance": "tp-exec1-exec0"})
    assert r.status_code == 200, r.text
    assert [i["tp"] for i in r.json()["instances"]] == [1, 1]
    assert kv_blocks(url) == alone
    assert morph(url, {"action": "tp_split", "instance": "tp-exec1-exec0"}).status_code == 404
    assert stream(client, SHORT_PROMPTS[0], 4)  # and it serves
