"""The controller asks for capacity, through the whole system: `morphling up --executors 2 --mode off`, real
processes, the official `openai` client, the gateway's /metrics as an autoscaler reads it.

Idle past `idle_s`, it wants one executor fewer. With every request over a TTFT SLO of 1 ms and no lever to pull
(mode off plans nothing), it wants one more once that has lasted `sustain_s`: `morphling_desired_executors`
says so, and nothing starts or stops an executor by itself."""

import re
import time

import httpx
import openai

from tests.integration.test_fabric import clean_env, serve

MODEL = "SmolLM2-135M-Instruct"


def desired(url: str) -> float | None:
    found = re.search(r"^morphling_desired_executors (\S+)$", httpx.get(f"{url}/metrics", timeout=10).text, re.M)
    return float(found.group(1)) if found else None


def until(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not (ok := predicate()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return ok


def test_idle_it_wants_one_fewer_and_failing_with_nothing_to_try_one_more(tmp_path):
    up = serve(tmp_path, "default", ("--memory-budget", "1GiB", "--max-model-len", "512"), "--executors", "2",
               "--mode", "off", "--slo-ttft", "0.001", "--capacity-set", "sustain_s=2", "--capacity-set", "idle_s=3",
               "--capacity-set", "min_requests=1", env=clean_env())
    try:
        assert until(lambda: desired(up.url) == 1.0, 60), f"idle, it never asked for one fewer:\n{up.logs()}"
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0, timeout=60)
        for question in ("What is the capital of France?", "Name a colour.", "Count to three."):
            reply = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0,
                                                   messages=[{"role": "user", "content": question}])
            assert reply.choices[0].message.content
        assert until(lambda: desired(up.url) == 3.0, 60), f"failing, it never asked for one more:\n{up.logs()}"
        executors = httpx.get(f"{up.url}/v1/cluster", timeout=10).json()["executors"]
        assert sorted(e["id"] for e in executors if e["alive"]) == ["exec0", "exec1"]  # it only asks
        assert "desired executors: 3" in (up.log_dir / "controller.log").read_text(errors="replace")
    finally:
        up.interrupt(60)
