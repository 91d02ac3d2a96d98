"""Executors and gateways that die or stall under in-flight streams, with real processes and the default model.

A SIGKILLed executor's streams go on on another executor, token for token what an undisturbed run
gives; a SIGSTOPped one is only suspect for the seconds it is stopped, and its streams finish on it. A
gateway killed for good has its requests cancelled on the executor.
"""

import signal
import time

import httpx
import openai
import pytest

from tests.nats_server import free_port
from tests.streams import MODEL, PROMPTS, Streams, busiest, streams_cut_short
from tests.system import System


def test_streams_of_a_killed_executor_finish_on_the_other_token_for_token(tmp_path):
    system = System(tmp_path, executors=2).start()
    try:
        undisturbed = Streams(system.url, max_tokens=64).start()
        expected = undisturbed.join()
        expected_usage = undisturbed.usage

        streams = Streams(system.url, max_tokens=64).start()
        streams.wait_for_tokens(3)
        killed = busiest(system)
        system.kill(killed)
        assert streams.join() == expected
        assert streams.usage == expected_usage
        moved = [line for line in httpx.get(f"{system.url}/metrics").text.splitlines()
                 if line.startswith("morphling_stream_failovers_total ")]
        assert moved and float(moved[0].split()[1]) >= 1  # some streams did move, and none noticed
        survivor = next(e for e in system.cluster()["executors"] if e["id"] != killed)
        assert survivor["alive"]
    finally:
        system.stop()


def test_a_stalled_executor_is_suspect_not_dead_and_its_streams_finish(tmp_path):
    system = System(tmp_path).start()
    try:
        streams = Streams(system.url, max_tokens=48).start()
        streams.wait_for_tokens(2)
        system.procs["exec0"].send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.0)  # past suspect_after (1 s), well short of dead_after (6 s)
            (e,) = system.cluster()["executors"]
            assert e["alive"] and e["suspect"]
            time.sleep(2.0)
        finally:
            system.procs["exec0"].send_signal(signal.SIGCONT)
        texts = streams.join()
        assert all(texts) and all(streams.usage)  # each ended normally, with its usage chunk
        (e,) = system.cluster()["executors"]
        assert e["alive"] and not e["suspect"] and e["restarts"] == 0
    finally:
        system.stop()


def test_a_killed_executor_with_no_other_ends_its_streams_with_an_error(tmp_path):
    system = System(tmp_path, gateway_args=("--failover-timeout", "1")).start()
    try:
        client = openai.OpenAI(base_url=f"{system.url}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                                max_tokens=200, temperature=0, stream=True)
        next(stream)
        started = time.monotonic()
        system.kill("exec0")
        with pytest.raises(openai.APIError, match="no other executor took it over"):
            for _ in stream:
                pass
        # Found gone by the monitor's probe (~suspect_after), then the failover bound, then slack.
        assert time.monotonic() - started < 15
    finally:
        system.stop()


def test_the_requests_of_a_gateway_killed_for_good_stop_running_on_the_executor(tmp_path):
    """Two gateways, as behind a load balancer; one SIGKILLed under four long streams, and nothing restarts it: the
    monitor finds it silent for dead_after (6 s) and says it is gone, and the executor cancels its requests instead
    of running them for nobody to their last token (about 200 s here). The other gateway serves on."""
    system = System(tmp_path).start()
    try:
        other = f"http://127.0.0.1:{free_port()}"
        system.spawn("gateway-b", "gateway", "--nats", system.nats.url, "--host", "127.0.0.1",
                     "--port", other.rsplit(":", 1)[1], "--id", "gw-b")
        deadline = time.monotonic() + 60
        while True:  # ready: it has a cluster state with the executor in it
            try:
                if httpx.get(f"{other}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:  # not listening yet
                pass
            assert time.monotonic() < deadline, f"gw-b never got ready:\n{system.log('gateway-b')}"
            time.sleep(0.2)

        def running() -> int:
            return httpx.get(f"{other}/v1/cluster", timeout=5).json()["executors"][0]["running"]

        streams_cut_short(system.url, [{"role": "user", "content": PROMPTS[0]}], timeout=300)
        deadline = time.monotonic() + 60
        while running() < 4:
            assert time.monotonic() < deadline, f"the four streams never ran together:\n{system.log('exec0')}"
            time.sleep(0.3)
        system.kill("gateway")
        killed = time.monotonic()
        while running():
            assert time.monotonic() - killed < 30, f"the dead gateway's requests still run:\n{system.log('exec0')}"
            time.sleep(0.3)
        print(f"the dead gateway's requests cancelled {time.monotonic() - killed:.1f} s after the kill")
        assert "gateway gw0 is gone: cancelling its 4 requests" in system.log("exec0")
        assert "gateway gw0 is silent for 6 s: gone" in system.log("monitor")
        client = openai.OpenAI(base_url=f"{other}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].message.content
    finally:
        system.stop()
