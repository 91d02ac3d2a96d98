"""Executors added to and removed from a running deployment: a plain `morphling up`, then `morphling scale`, real
processes, nats-server, the official `openai` client.

`scale --executors 2` while two streams run: exec1 joins the world as a peer of exec0 (its log names it), is
serving within the target's 30 s of its model load, and takes requests; the two merge into a TP2 instance by hand
and split back, serving the same greedy text. `scale --executors 1` with streams on exec1: it is drained and
stopped once they are done, and every stream holds the greedy text of an undisturbed run; `up` does not restart
it."""

import concurrent.futures
import subprocess
import sys
import time

import httpx
import openai

from tests.integration.test_fabric import clean_env, cluster, serve

MODEL = "SmolLM2-135M-Instruct"
FLAGS = ("--memory-budget", "1GiB", "--max-model-len", "512")
PROMPTS = ["The history of the city begins", "Once upon a time, a lighthouse keeper", "The recipe calls for",
           "In the year 1990, the band", "Rain fell on the", "Scientists have long argued that"]
TOKENS = 48


def complete(url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def scale(up, executors: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", "scale", "--executors", str(executors),
                           "--nats", up.nats_url()], capture_output=True, text=True, timeout=600)


def running(url: str) -> dict[str, int]:
    return {e["id"]: e["running"] for e in cluster(url)["executors"] if e["alive"]}


def morph(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/cluster/morph", json=body, timeout=120)


def test_an_executor_added_while_streams_run_serves_and_one_removed_with_streams_loses_none(tmp_path):
    up = serve(tmp_path, "default", FLAGS, "--mode", "off", env=clean_env())
    try:
        expected = {p: complete(up.url, p) for p in PROMPTS}
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            during = [pool.submit(complete, up.url, p) for p in PROMPTS[:2]]
            started = time.monotonic()
            added = scale(up, 2)
            assert added.returncode == 0, added.stderr + up.logs()
            assert "added exec1" in added.stdout, added.stdout
            print(f"scale to 2: {added.stdout.strip()} ({time.monotonic() - started:.1f} s with the model load)")
            assert [f.result(timeout=300) for f in during] == [expected[p] for p in PROMPTS[:2]]

            merged = morph(up.url, {"action": "tp_merge", "executors": ["exec0", "exec1"]})
            assert merged.status_code == 200, merged.text + up.logs()
            assert [i["tp"] for i in merged.json()["instances"]] == [2]
            assert complete(up.url, PROMPTS[0]) == expected[PROMPTS[0]]
            instance = merged.json()["instances"][0]["id"]
            split = morph(up.url, {"action": "tp_split", "instance": instance})
            assert split.status_code == 200, split.text + up.logs()
            assert [i["tp"] for i in split.json()["instances"]] == [1, 1]

            seen = set()
            streams = [pool.submit(complete, up.url, p) for p in PROMPTS]
            deadline = time.monotonic() + 60
            while "exec1" not in seen and time.monotonic() < deadline:
                seen |= {e for e, n in running(up.url).items() if n}
                time.sleep(0.2)
            assert "exec1" in seen, f"exec1 took no request: {running(up.url)}\n{up.logs()}"
            removed = scale(up, 1)  # exec1 runs requests now: they finish first
            assert removed.returncode == 0, removed.stderr + up.logs()
            assert "removed exec1" in removed.stdout, removed.stdout
            assert [f.result(timeout=300) for f in streams] == [expected[p] for p in PROMPTS]
        assert "exec1 stopped for good" in up.console()
        time.sleep(3)
        assert "exec1 restarted" not in up.console()
        log = (up.log_dir / "exec1.log").read_text(errors="replace")
        assert "peer exec0" in log  # met over the bus
        assert complete(up.url, PROMPTS[0]) == expected[PROMPTS[0]]
    finally:
        up.interrupt(60)
