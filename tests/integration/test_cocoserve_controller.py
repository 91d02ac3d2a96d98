"""CoCoServe's controller on its own, end to end: `morphling up --executors 2 --plan` (every layer of the
default model on exec0, exec1 spare) with `--cocoserve default`, real processes, the official `openai`
client over real HTTP, the controller's audit events read off the bus.

With exec1 idle the controller replicates layers onto it; under a burst that breaks the TTFT SLO it
migrates, then evicts, then cuts the batch, in that order; after the burst the batch cap comes back, the
migrated layers go home and replicas return. Every request of the burst gets all its tokens.
"""

import concurrent.futures
import time

import httpx
import openai
import pytest

from shared.config import PROJECT_ROOT
from tests.integration.test_controller_morphs import EventLog
from tests.integration.test_fabric import DEFAULT_FLAGS, serve

PLAN = PROJECT_ROOT / "deploy/plans/default-spare-exec1.json"
MODEL = "SmolLM2-135M-Instruct"
# Short windows so that a CPU run shows every phase within a minute; the SLOs are the monitor's, with a
# TTFT the burst below breaks for most of its requests and an idle instance meets easily.
FLAGS = ("--executors", "2", "--plan", str(PLAN), "--levers", "replicate", "--cocoserve", "default",
         "--slo-ttft", "1.5",
         "--slo-tpot", "1.0", "--slo-window", "5", *(f"--cocoserve-set={kv}" for kv in (
             "step=8", "enter_windows=3", "leave_windows=5", "up_windows=3", "settle_s=2", "min_dwell_s=4",
             "delta_bs=16")))
BURST_PROMPT = "Write a long story about a lighthouse keeper and the storm that changed everything. " * 4
BURST_TOKENS = 24


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    proc = serve(tmp_path_factory.mktemp("coco-ctl"), "default", DEFAULT_FLAGS, *FLAGS)
    events = EventLog(proc.nats_url())
    yield proc, events
    events.close()
    proc.interrupt(60)


def instance(url: str) -> dict:
    (i,) = httpx.get(f"{url}/v1/cluster", timeout=10).json()["instances"]
    return i


def leader(url: str) -> dict:
    (e,) = [e for e in httpx.get(f"{url}/v1/cluster", timeout=10).json()["executors"] if e["id"] == "exec0"]
    return e


def wait(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := predicate()):
            return got
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s: {what}")


def test_replicate_when_idle_scale_down_under_a_burst_and_everything_back_after(up):
    proc, events = up
    url = proc.url
    # Idle: exec1 takes replicas of every layer it has room for, on the controller's own decision.
    wait(lambda: all(r == 2 for r in instance(url)["replicas"]), 60, "exec1 replicates the model")
    replicate = [e.data for e in events.got if e.data["kind"] == "replicate"]
    assert replicate and all(d["ok"] for d in replicate)
    assert replicate[0]["inputs"]["speedup_after"] > replicate[0]["inputs"]["speedup_before"]
    assert replicate[0]["inputs"]["vacancy"]["exec1"]["rate"] > 0.2
    before_burst = len(events.got)

    # A burst: waves of concurrent requests, until the controller has cut the batch. A cut cap can fill the
    # waiting queue: the gateway then answers 429, which changes nothing, and the client retries as clients do.
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=10, timeout=600)

    def one(_):
        out = client.completions.create(model=MODEL, prompt=BURST_PROMPT, max_tokens=BURST_TOKENS,
                                        temperature=0, extra_body={"ignore_eos": True})
        return out.usage.completion_tokens

    done: list[int] = []
    deadline = time.monotonic() + 150
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        while time.monotonic() < deadline:
            done += list(pool.map(one, range(24)))
            if any(e.data["kind"] == "batch" for e in events.got[before_burst:]):
                break
    burst = [e.data for e in events.got[before_burst:]]
    kinds = [d["kind"] for d in burst]
    assert "batch" in kinds, kinds
    first = {kind: kinds.index(kind) for kind in ("migrate", "evict", "batch")}
    assert first["migrate"] < first["evict"] < first["batch"], kinds
    assert all(d["ok"] for d in burst), burst
    down = [d for d in burst if d["inputs"]["phase"] in ("migrate", "evict", "batch")]  # not steps back
    assert all(d["inputs"]["violation_rate"] > 0.1 for d in down), [(d["kind"], d["inputs"]) for d in down]
    assert done and all(n == BURST_TOKENS for n in done)  # no request lost a token

    # After the burst: the cap, the migrated layers and the replicas all come back.
    wait(lambda: leader(url)["max_num_seqs"] == 64, 90, "the batch cap comes back")
    wait(lambda: all(r == 2 for r in instance(url)["replicas"]), 120, "every layer back on exec0 with a replica")
    after = [e.data["kind"] for e in events.got[before_burst + len(burst):]]
    assert "batch" in after and "migrate" in after and "replicate" in after, after
