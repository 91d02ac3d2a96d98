"""CoCoServe onto an executor serving alone, on the controller's own decision: `morphling up --executors 2
--levers replicate --cocoserve default`, real processes, nats-server, the official `openai` client over real HTTP,
the controller's audit events read off the bus.

One stream runs on one executor while the other has nothing to do: the controller recruits the idle one (the
leader's replicate and the newcomer's join, side by side), which then computes a share of the stream's rows. A
second request arrives: the recruit goes back to serving alone at once, its replicas evicted. Both streams are
token for token what one engine gives.
"""

import concurrent.futures
import time

import openai

from services.executor.engine.engine import LLMEngine
from shared.config import EngineConfig, parse_size
from shared.sampling import SamplingOptions
from tests.integration.test_controller_morphs import EventLog
from tests.integration.test_fabric import clean_env, cluster, serve
from tests.integration.test_replicate_onto_newcomer import wait_for
from tests.integration.test_scale import MODEL

FLAGS = ("--memory-budget", "1GiB", "--max-model-len", "512")
SHAPE = ("--executors", "2", "--levers", "replicate", "--cocoserve", "default", "--cocoserve-set=min_dwell_s=60")
LONG, SHORT = ("Once upon a time, a lighthouse keeper", 160), ("The recipe calls for", 32)


def reference() -> dict[str, str]:
    """One engine's greedy texts, of the same budget: what each executor serving alone gives."""
    engine = LLMEngine(EngineConfig(model="default", memory_budget=parse_size(FLAGS[1]), max_model_len=512),
                       progress=False)
    return {prompt: engine.generate([prompt], SamplingOptions(temperature=0.0, max_tokens=n, ignore_eos=True))[0]
            .outputs[0].text for prompt, n in (LONG, SHORT)}


def stream(url: str, prompt: str, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def members(url: str) -> list[list[str]]:
    return sorted(i["members"] for i in cluster(url)["instances"])


def test_an_idle_executor_is_recruited_for_a_lone_stream_and_goes_back_when_a_second_request_arrives(tmp_path):
    expected = reference()
    up = serve(tmp_path, "default", FLAGS, *SHAPE, env=clean_env())
    events = EventLog(up.nats_url())
    try:
        wait_for(lambda: members(up.url) == [["exec0"], ["exec1"]], 120, "both executors should serve alone", up.logs)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(stream, up.url, *LONG)
            wait_for(lambda: len(members(up.url)) == 1, 60, "the idle executor should be recruited", up.logs)
            recruited = time.monotonic()
            second = pool.submit(stream, up.url, *SHORT)
            wait_for(lambda: len(members(up.url)) == 2, 30, "the recruit should serve alone again", up.logs)
            print(f"recruit went back {time.monotonic() - recruited:.1f} s after the second request was sent")
            assert first.result(timeout=300) == expected[LONG[0]]
            assert second.result(timeout=300) == expected[SHORT[0]]
            assert not first.exception() and not second.exception()
        by_kind: dict[str, list[dict]] = {}
        for e in events.got:
            by_kind.setdefault(e.data["kind"], []).append(e.data)
        [join] = by_kind["join"]
        [replicate] = [d for d in by_kind["replicate"] if d["inputs"].get("phase") == "recruit"]
        assert join["ok"] and replicate["ok"], (join, replicate)
        assert replicate["args"]["to"] == join["executor"] and join["args"]["leader"] == replicate["executor"]
        assert replicate["state"]["joined"] == join["executor"]
        assert replicate["inputs"]["speedup_after"] > replicate["inputs"]["speedup_before"]
        releases = [d for d in by_kind["evict"] if d["inputs"].get("phase") == "release"]
        assert releases and all(d["ok"] for d in releases), by_kind["evict"]
        assert releases[0]["inputs"]["released_for"] == "work arrived"
        assert releases[-1]["state"]["left"] == [join["executor"]]
    finally:
        events.close()
        up.interrupt(60)
