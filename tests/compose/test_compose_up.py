"""`docker compose up` for real: the repository's docker-compose.yml with a second executor beside the first,
the way its header says to add one, on images made here (images.py).

A chat completion through the gateway's published port; then an executor's container SIGKILLed under four
streams, which go on on the other executor token for token what an undisturbed run gave; compose restarts the
container (restart: unless-stopped) and the executor serves again.
"""

import copy
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.compose import images
from tests.nats_server import free_port
from tests.streams import MODEL, Streams, busiest

PROJECT = "morphling-compose-test"
MORPHLING_SERVICES = ("gateway", "monitor", "controller", "executor-0")


def derived_compose(spec: dict, nats_image: str, port: int) -> dict:
    """docker-compose.yml (`spec`, as PyYAML reads it: anchors and merges resolved) as a CPU host without a registry
    runs it: local images, no GPU reservation, a second executor, the gateway on a free port of loopback."""
    spec = copy.deepcopy(spec)
    # Compose v1 (what Debian packages) knows neither key: -p names the project, and the anchor is merged in.
    del spec["name"], spec["x-morphling"]
    services = spec["services"]
    services["nats"]["image"] = nats_image
    for name in MORPHLING_SERVICES:
        services[name]["image"] = images.MORPHLING
        del services[name]["build"]
    for service in services.values():
        service["volumes"] = [v.replace("./deploy/", f"{images.REPO}/deploy/") for v in service.get("volumes", [])]
    del services["executor-0"]["deploy"]
    second = copy.deepcopy(services["executor-0"])
    second["command"] = [arg.replace("exec0", "exec1") for arg in second["command"]]
    second["healthcheck"]["test"] = [arg.replace("exec0", "exec1") for arg in second["healthcheck"]["test"]]
    second["environment"] |= {"MORPHLING_ADVERTISE_HOST": "executor-1", "MORPHLING_RANK": "1"}
    services["executor-1"] = second
    services["gateway"]["ports"] = [f"127.0.0.1:{port}:8000"]
    return spec


class ComposeSystem:
    """The stack as `docker-compose -p PROJECT` runs it, read as tests/streams.py reads a system."""

    def __init__(self, file: Path, port: int, model_dir: Path):
        self.file = file
        self.url = f"http://127.0.0.1:{port}"
        # Morphing stays off, as in tests/system.py: the streams compare against layers that did not change.
        self.env = os.environ | {"EXECUTOR_DEVICE": "cpu", "MEMORY_BUDGET": "1GiB", "MODEL_DIR": str(model_dir),
                                 "MORPHLING_MODE": "off", "MORPHLING_COCOSERVE": "off"}

    def compose(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["docker-compose", "-f", str(self.file), "-p", PROJECT, *args], env=self.env,
                              check=True, **kwargs)

    def container(self, service: str) -> str:
        return self.compose("ps", "-q", service, capture_output=True, text=True).stdout.strip()

    def inspect(self, service: str, field: str) -> str:
        return subprocess.run(["docker", "inspect", "-f", f"{{{{{field}}}}}", self.container(service)],
                              capture_output=True, text=True, check=True).stdout.strip()

    def cluster(self) -> dict:
        return httpx.get(f"{self.url}/v1/cluster", timeout=5).json()

    def live(self) -> set[str]:
        try:
            return {e["id"] for e in self.cluster()["executors"] if e["alive"]}
        except (httpx.HTTPError, ValueError, KeyError):
            return set()

    def wait_for(self, executors: set[str], timeout: float) -> float:
        started = time.monotonic()
        while not executors <= self.live():
            assert time.monotonic() - started < timeout, f"live after {timeout:.0f} s: {self.live()}"
            time.sleep(1)
        return time.monotonic() - started

    def kill(self, service: str) -> None:
        """SIGKILL the container's first process from the host, as a crash would: `docker kill` would mark the
        container stopped by hand, which compose's restart policy leaves alone."""
        os.kill(int(self.inspect(service, ".State.Pid")), signal.SIGKILL)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    images.ensure_daemon()
    base = images.base_image()
    spec = yaml.safe_load((images.REPO / "docker-compose.yml").read_text())
    nats_image = images.nats_image(spec["services"]["nats"]["image"], base)
    images.morphling_image(base)
    workdir = tmp_path_factory.mktemp("compose")
    (workdir / "models").mkdir()
    file = workdir / "docker-compose.yml"
    port = free_port()
    file.write_text(yaml.safe_dump(derived_compose(spec, nats_image, port), sort_keys=False))
    system = ComposeSystem(file, port, workdir / "models")
    system.compose("down", "-v", "--remove-orphans", capture_output=True)  # what a failed run left
    started = time.monotonic()
    images.say("docker-compose up -d")
    system.compose("up", "-d")
    try:
        system.wait_for({"exec0", "exec1"}, timeout=600)
        images.say(f"both executors live {time.monotonic() - started:.0f} s after `up`")
        yield system
    except BaseException:
        system.compose("logs", "--tail", "60")
        raise
    finally:
        system.compose("down", "-v", "--timeout", "10")


def test_a_chat_completion_through_the_published_port(stack):
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert MODEL in {m.id for m in client.models.list()}
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                           max_tokens=16, temperature=0)
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0


def test_a_killed_executor_container_streams_on_and_compose_restarts_it(stack):
    undisturbed = Streams(stack.url, max_tokens=64).start()
    expected, expected_usage = undisturbed.join(), undisturbed.usage

    streams = Streams(stack.url, max_tokens=64).start()
    streams.wait_for_tokens(3)
    killed = busiest(stack)
    service = f"executor-{killed.removeprefix('exec')}"
    stack.kill(service)
    killed_at = time.monotonic()
    try:
        assert streams.join() == expected
        assert streams.usage == expected_usage
    except BaseException:
        stack.compose("logs", "--tail", "60", "gateway", service)
        raise
    images.say(f"streams finished {time.monotonic() - killed_at:.1f} s after {service} was killed")

    deadline = time.monotonic() + 60
    while int(stack.inspect(service, ".RestartCount")) < 1:
        assert time.monotonic() < deadline, f"compose never restarted {service}"
        time.sleep(1)
    # Found dead by the monitor first (dead_after, 6 s), so that `live` is the restarted one's telemetry.
    while killed in stack.live():
        assert time.monotonic() < deadline, f"{killed} never showed dead"
        time.sleep(0.5)
    back = stack.wait_for({killed}, timeout=600)
    images.say(f"{killed} serving again {time.monotonic() - killed_at:.0f} s after the kill ({back:.0f} s dead)")
    again = Streams(stack.url, max_tokens=64).start()
    assert again.join() == expected
