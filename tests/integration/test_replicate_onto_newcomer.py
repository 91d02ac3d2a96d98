"""CoCoServe onto the other executor of a plain deployment: `morphling up --executors 2 --mode off`, real processes,
nats-server, the official `openai` client over real HTTP.

With streams on both executors, `replicate` of every layer of exec0's instance onto exec1 (which serves alone)
succeeds: exec1 joins the instance, its streams go on at exec0, and exec1 computes a share of the batch. Every
stream, and greedy output afterwards, is what an undisturbed run gives. Evicting exec1's replicas leaves it
outside the instance, serving alone with its whole model again. SIGKILLed and restarted by `up`, it joins an
instance again; SIGKILLed while it holds replicas, it breaks only that instance, whose leader serves alone again.
"""

import concurrent.futures
import os
import signal
import time

import openai

from tests.integration.test_fabric import clean_env, cluster, serve
from tests.integration.test_scale import FLAGS, MODEL, complete, morph
from tests.integration.test_scale import PROMPTS as SCALE_PROMPTS

PROMPTS = SCALE_PROMPTS[:4]
LAYERS = 30


def instance_of(url: str, leader: str) -> dict:
    return next(i for i in cluster(url)["instances"] if i["leader"] == leader)


def wait_for(condition, timeout_s: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}\n{logs()}"
        time.sleep(0.2)


def test_replicate_onto_the_other_executor_of_a_plain_deployment_joins_it_and_evict_leaves_it_alone(tmp_path):
    up = serve(tmp_path, "default", FLAGS, "--executors", "2", "--mode", "off", env=clean_env())
    try:
        expected = {p: complete(up.url, p) for p in PROMPTS}
        i0 = instance_of(up.url, "exec0")["id"]
        replicate = {"action": "replicate", "instance": i0, "layers": [0, LAYERS - 1], "to": "exec1"}
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(complete, up.url, p) for p in PROMPTS]
            wait_for(lambda: all(e["running"] for e in cluster(up.url)["executors"]), 60,
                     "both executors should run streams", up.logs)
            started = time.monotonic()
            r = morph(up.url, replicate)
            assert r.status_code == 200, r.text + up.logs()
            print(f"replicate onto exec1, serving alone: {time.monotonic() - started:.1f} s")
            (leader, joined) = r.json()["results"]
            assert leader["ok"] and joined["ok"] and joined["executor"] == "exec1", r.json()["results"]
            assert leader["state"]["joined"] == "exec1" and leader["state"]["layers_copied"] == LAYERS
            instances = r.json()["instances"]
            assert [(i["members"], i["replicas"]) for i in instances] == [(["exec0", "exec1"], [2] * LAYERS)]
            assert [f.result(timeout=300) for f in streams] == [expected[p] for p in PROMPTS]
            assert [f.result(timeout=300) for f in [pool.submit(complete, up.url, p) for p in PROMPTS]] == \
                [expected[p] for p in PROMPTS]
        log = (up.log_dir / "exec1.log").read_text(errors="replace")
        assert "joined instance" in log and "holding no layer yet" in log

        evict = {"action": "evict", "instance": i0, "layers": [0, LAYERS - 1], "from": "exec1"}
        r = morph(up.url, evict)
        assert r.status_code == 200, r.text + up.logs()
        assert r.json()["results"][0]["state"]["left"] == ["exec1"]
        wait_for(lambda: sorted(len(i["members"]) for i in cluster(up.url)["instances"]) == [1, 1], 10,
                 "exec0 and exec1 should serve alone again", up.logs)
        assert "left instance" in (up.log_dir / "exec1.log").read_text(errors="replace")
        seen: set[str] = set()
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(complete, up.url, p) for p in PROMPTS]
            while not all(f.done() for f in streams):
                seen |= {e["id"] for e in cluster(up.url)["executors"] if e["running"]}
                time.sleep(0.2)
            assert [f.result() for f in streams] == [expected[p] for p in PROMPTS]
        assert "exec1" in seen, "exec1 took no request after it left the instance"

        os.kill(up.pid("exec1"), signal.SIGKILL)
        killed = time.monotonic()
        up.wait_console("exec1 restarted", 60)
        wait_for(lambda: any(e["id"] == "exec1" and e["alive"] and e["restarts"] >= 1
                             for e in cluster(up.url)["executors"]), 120, "exec1 should serve again", up.logs)
        r = morph(up.url, {**replicate, "layers": [0, 9]})
        assert r.status_code == 200, r.text + up.logs()
        print(f"restarted exec1 joined an instance again {time.monotonic() - killed:.1f} s after its SIGKILL")
        assert complete(up.url, PROMPTS[0]) == expected[PROMPTS[0]]

        # A newcomer that dies holding replicas breaks only that instance, as any member does: the stream ends
        # with an error event, and exec0 serves alone again with the same text.
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=400, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        error = None
        try:
            for chunk in stream:
                if chunk.choices[0].text and error is None:
                    os.kill(up.pid("exec1"), signal.SIGKILL)
                    error = "killed"
        except openai.APIError as exc:
            error = exc
        assert isinstance(error, openai.APIError) and "lost a member" in error.body["message"], error
        wait_for(lambda: any(i["members"] == ["exec0"] for i in cluster(up.url)["instances"]), 120,
                 "exec0 should serve alone after its newcomer died", up.logs)
        assert complete(up.url, PROMPTS[0]) == expected[PROMPTS[0]]
    finally:
        up.interrupt(60)
