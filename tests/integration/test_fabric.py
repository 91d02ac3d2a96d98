"""Instances across executors through the whole system: `morphling up --executors N --tp K | --plan FILE`,
real executor processes in one gloo world, the official `openai` client over real HTTP.

Greedy completions of a served instance must be the tokens one executor alone produces (an LLMEngine
over the same checkpoint and settings, which is what a one-executor `up` runs):
- a tiny Llama-style checkpoint with 8 KV heads (written by the test; its FFN width of 200 makes every
  shard padded) as TP2 and TP4;
- the default model as TP2 (3 KV heads: an uneven 2+1 split), with layers 10-19 placed on a second
  executor, and with replicas of layers 0-14 on a second executor serving 8 concurrent prompts.

And a member's death: SIGKILL of a TP2 follower mid-stream ends that stream with an error event, the
leader serves the next request as a TP1 instance of its own, and every executor's pages add up.
"""

import concurrent.futures
import os
import signal
import time

import httpx
import openai
import pytest

from services.executor.engine.engine import LLMEngine
from shared.config import PROJECT_ROOT, EngineConfig, parse_size, served_model_name
from shared.sampling import SamplingOptions
from tests.checkpoints import write_tiny_llama_8kv
from tests.up_process import UpProcess

READY_TIMEOUT_S = 300  # N executors import torch and load the model on 2 cores
STOP_TIMEOUT_S = 60
TINY_FLAGS = ("--memory-budget", "16MiB", "--max-model-len", "1024")
DEFAULT_FLAGS = ("--memory-budget", "1GiB", "--max-model-len", "512")
PROMPTS = ["The history of the city begins", "Once upon a time, a lighthouse keeper", "The recipe calls for",
           "In the year 1990, the band", "Rain fell on the", "Scientists have long argued that",
           "The museum's oldest painting", "After the match, the coach said"]
NEW_TOKENS = 8


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("MORPHLING_API_KEYS", "MORPHLING_ADMIN_KEYS") and not k.startswith("OTEL_")}


def engine_config(model: str, flags: tuple[str, ...]) -> EngineConfig:
    return EngineConfig(model=model, memory_budget=parse_size(flags[1]), max_model_len=int(flags[3]))


def alone(model: str, flags: tuple[str, ...], prompts: list[str]) -> list[str]:
    """What one executor generates for `prompts`, greedily, NEW_TOKENS each."""
    engine = LLMEngine(engine_config(model, flags), progress=False)
    params = SamplingOptions(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [c.outputs[0].text for c in engine.generate(prompts, params)]


def complete(url: str, model: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text


def cluster(url: str) -> dict:
    return httpx.get(f"{url}/v1/cluster", timeout=10).json()


def agreed_cluster(url: str, timeout_s: float = 10.0) -> dict:
    """The cluster once every executor reports all KV blocks free and the same number of them, or as it is at
    the timeout. A keepalive tells a follower the blocks' state after the last step, and the controller may
    reshape an idle instance (CoCoServe's scale-up): the members' reports of a change arrive up to a report
    interval apart."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = cluster(url)
        kv = [e["kv"] for e in state["executors"]]
        settled = all(k["pages_used"] == 0 for k in kv) and len({k["pages_free"] for k in kv}) == 1
        if settled or time.monotonic() > deadline:
            return state
        time.sleep(0.25)


def serve(tmp_path, model: str, flags: tuple[str, ...], *shape: str, env: dict[str, str] | None = None) -> UpProcess:
    up = UpProcess(tmp_path, "--model", model, *flags, *shape, env=clean_env() | (env or {}))
    try:
        up.wait_ready(READY_TIMEOUT_S)
    except BaseException:
        up.interrupt(STOP_TIMEOUT_S)
        raise
    return up


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_llama_8kv(tmp_path_factory.mktemp("tiny8kv")))


@pytest.mark.parametrize("tp, prefix, name", [(2, None, "i0"), (4, "b", "b0")])
def test_a_tp_instance_of_a_tiny_model_generates_what_one_executor_does(tiny, tmp_path, tp, prefix, name):
    """And is named by the world's prefix (MORPHLING_INSTANCE_PREFIX, one per world sharing a bus), else i."""
    expected = alone(tiny, TINY_FLAGS, PROMPTS[:4])
    up = serve(tmp_path, tiny, TINY_FLAGS, "--executors", str(tp), "--tp", str(tp),
               env={"MORPHLING_INSTANCE_PREFIX": prefix} if prefix else None)
    try:
        got = [complete(up.url, served_model_name(tiny), p) for p in PROMPTS[:4]]
        [instance] = cluster(up.url)["instances"]
    finally:
        up.interrupt(STOP_TIMEOUT_S)
    assert got == expected
    members = [f"exec{i}" for i in range(tp)]
    assert (instance["id"], instance["leader"], instance["members"], instance["tp"]) == (name, "exec0", members, tp)
    assert all(layer == {"placement": members, "bits": 16} for layer in instance["layers"])


PLANS = PROJECT_ROOT / "deploy" / "plans"  # the shipped examples, served as a user would


@pytest.mark.parametrize("shape", ["tp2", "layers 10-19 on exec1", "replicas of 0-14 on exec1"])
def test_the_default_model_across_two_executors_generates_what_one_executor_does(tmp_path, shape):
    flags = {"tp2": ("--tp", "2"),
             "layers 10-19 on exec1": ("--plan", str(PLANS / "default-layers-10-19-on-exec1.json")),
             "replicas of 0-14 on exec1": ("--plan", str(PLANS / "default-replicas-0-14-on-exec1.json"))}[shape]
    concurrent_prompts = PROMPTS if shape.startswith("replicas") else PROMPTS[:3]
    expected = alone("default", DEFAULT_FLAGS, concurrent_prompts)
    up = serve(tmp_path, "default", DEFAULT_FLAGS, "--executors", "2", *flags)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(concurrent_prompts)) as pool:
            got = list(pool.map(lambda p: complete(up.url, "SmolLM2-135M-Instruct", p), concurrent_prompts))
        state = agreed_cluster(up.url)
    finally:
        up.interrupt(STOP_TIMEOUT_S)
    assert got == expected
    [instance] = state["instances"]
    assert instance["members"] == ["exec0", "exec1"] and instance["leader"] == "exec0"
    roles = {e["id"]: e["role"] for e in state["executors"]}
    assert roles == {"exec0": "leader", "exec1": "follower"}
    # Both members report the instance's KV blocks, all of them free again.
    kv = {e["id"]: e["kv"] for e in state["executors"]}
    assert kv["exec0"]["pages_used"] == kv["exec1"]["pages_used"] == 0
    assert kv["exec0"]["pages_free"] == kv["exec1"]["pages_free"] > 0


def test_killing_a_tp2_member_mid_stream_ends_the_stream_with_an_error_and_the_leader_serves_alone(tiny, tmp_path):
    up = serve(tmp_path, tiny, TINY_FLAGS, "--executors", "2", "--tp", "2")
    try:
        model = served_model_name(tiny)
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=900, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        received, error = "", None
        try:
            for chunk in stream:
                received += chunk.choices[0].text
                if received and error is None:
                    os.kill(up.pid("exec1"), signal.SIGKILL)
                    error = "killed"
        except openai.APIError as exc:
            error = exc
        # An error event in the stream, not a dropped connection or a timeout.
        assert isinstance(error, openai.APIError) and not isinstance(error, openai.APIConnectionError), error
        assert "lost a member" in error.body["message"], error.body
        assert received  # it was mid-stream

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:  # the leader rebuilds itself as a TP1 instance; up restarts exec1 alone
            state = cluster(up.url)
            ids = sorted(i["id"] for i in state["instances"])
            if "i-exec0" in ids:
                break
            assert time.monotonic() < deadline, f"exec0 never served alone: {state}\n{up.logs()}"
            time.sleep(0.5)
        [alone_now] = [i for i in state["instances"] if i["id"] == "i-exec0"]
        assert (alone_now["members"], alone_now["tp"]) == (["exec0"], 1)
        assert complete(up.url, model, PROMPTS[1]) == alone(tiny, TINY_FLAGS, [PROMPTS[1]])[0]
        time.sleep(1.0)  # a heartbeat after the request finished
        for executor in (e for e in cluster(up.url)["executors"] if e["alive"]):
            kv = executor["kv"]
            assert kv["pages_used"] == 0, executor
            assert kv["pages_free"] + kv["pages_used"] + kv["pages_slot"] == kv["pages_total"], executor
    finally:
        up.interrupt(STOP_TIMEOUT_S)



def test_a_killed_member_rejoins_as_a_peer_and_merges_again(tiny, tmp_path):
    """SIGKILL the follower of a TP2 instance: up restarts it with the same flags, it meets exec0 again (a new
    incarnation, groups formed afresh) and serves alone beside it; a tp_merge of the two then works, and the
    merged instance generates what one executor does."""
    up = serve(tmp_path, tiny, TINY_FLAGS, "--executors", "2", "--tp", "2")
    try:
        model = served_model_name(tiny)
        os.kill(up.pid("exec1"), signal.SIGKILL)
        killed = time.monotonic()
        deadline = killed + READY_TIMEOUT_S
        while True:  # both serve alone: exec0 once its instance broke, exec1 once restarted
            ids = sorted(i["id"] for i in cluster(up.url)["instances"])
            if ids == ["i-exec0", "i-exec1"]:
                break
            assert time.monotonic() < deadline, f"the two never served alone: {ids}\n{up.logs()}"
            time.sleep(0.5)
        back = time.monotonic()
        merged = httpx.post(f"{up.url}/v1/cluster/morph", json={"action": "tp_merge", "executors": ["exec0", "exec1"]},
                            timeout=120)
        assert merged.status_code == 200, merged.text
        assert time.monotonic() - back <= 30, "the merge took longer than the rejoin target"
        [instance] = cluster(up.url)["instances"]
        assert (instance["members"], instance["tp"]) == (["exec0", "exec1"], 2)
        assert complete(up.url, model, PROMPTS[2]) == alone(tiny, TINY_FLAGS, [PROMPTS[2]])[0]
        print(f"exec1 killed; both serving alone {back - killed:.1f} s later; merged in "
              f"{time.monotonic() - back:.1f} s")
    finally:
        up.interrupt(STOP_TIMEOUT_S)
