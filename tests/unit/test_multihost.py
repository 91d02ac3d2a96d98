"""The multi-host deployment (deploy/multihost/, docs/deployment.md) agrees with the Compose specification,
the CLI, itself across hosts, and a real two-node NATS cluster.

No Docker engine and no second host here: the compose files are checked as data, and the NATS cluster
config by running two nats-server processes from it on loopback, as two hosts' nodes would run.
"""

import asyncio
import json
import posixpath
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from shared import subjects
from shared.bus import Bus
from shared.config import EventStreamConfig
from shared.messages import Event, ExecutorTelemetry, TokenizeReply, TokenizeRequest
from shared.net import free_port
from tests.nats_server import NatsServer, until_routed
from tests.unit.test_compose import PASSWORDS, ROOT, check_commands, check_follows_the_spec, morphling_services
from tests.unit.test_monitor_aggregate import telemetry

HERE = ROOT / "deploy" / "multihost"
FILES = ("compose.head.yml", "compose.worker.yml")
HEAD_HOST = "10.0.0.1"
ROUTE_PASSWORD = "route-pw"


def load(name: str) -> dict:
    return yaml.safe_load((HERE / name).read_text())


def interpolated(value, env: dict[str, str]):
    """`value` with ${VAR}, ${VAR:-default} and ${VAR:?message} replaced as Compose replaces them from `env`
    (an unset or empty VAR takes the default). A required variable missing from `env` fails the test."""
    def one(match: re.Match) -> str:
        name, op, arg = match.groups()
        if env.get(name):
            return env[name]
        assert op != ":?", f"{name} is required: {arg}"
        return arg if op == ":-" else ""

    if isinstance(value, str):
        return re.sub(r"\$\{(\w+)(?:(:[-?])([^}]*))?\}", one, value)
    if isinstance(value, dict):
        return {k: interpolated(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolated(v, env) for v in value]
    return value


def deployment(workers: list[dict[str, str]], common: dict[str, str]) -> list[tuple[str, dict]]:
    """(host, its compose file as Compose reads it) for the head and each worker, given the settings every host
    shares and each worker's own."""
    hosts = [("head", interpolated(load("compose.head.yml"), common))]
    for i, own in enumerate(workers):
        hosts.append((f"worker{i + 1}", interpolated(load("compose.worker.yml"), {**common, **own})))
    return hosts


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


@pytest.mark.parametrize("name", FILES)
def test_each_hosts_file_follows_the_spec(name):
    check_follows_the_spec(load(name))


@pytest.mark.parametrize("name, roles", [("compose.head.yml", {"gateway", "monitor", "controller", "executor"}),
                                         ("compose.worker.yml", {"gateway", "executor"})])
def test_every_command_is_a_morphling_subcommand(name, roles):
    services = morphling_services(load(name))
    assert {s["command"][0] for s in services.values()} == roles
    check_commands(services)


@pytest.mark.parametrize("name", FILES)
def test_each_service_reaches_its_own_hosts_nats_node(name):
    """An executor on the host's network cannot resolve the service name `nats`, and one on the project's
    network cannot reach the host's loopback: each must use the address that works from where it runs."""
    compose = load(name)
    assert {n: s.get("restart") for n, s in compose["services"].items()} == \
        {n: "unless-stopped" for n in compose["services"]}
    for service_name, service in morphling_services(compose).items():
        host_network = service.get("network_mode") == "host"
        assert host_network == (service["command"][0] == "executor"), service_name
        urls = [option(service["command"], "--nats")]
        urls += [a for a in service.get("healthcheck", {}).get("test", []) if a.startswith("nats://")]
        for url in urls:
            assert url.rpartition("@")[2] == ("127.0.0.1:4222" if host_network else "nats:4222"), service_name
        if host_network:
            assert "ports" not in service, service_name
    # The node's client port is for this host's executors only; its route port is for the other hosts.
    assert compose["services"]["nats"]["ports"] == ["127.0.0.1:4222:4222", "6222:6222"]


@pytest.mark.parametrize("workers, world_size", [
    ([{}], "4"),
    # The worker file's header: a second worker numbers its executors on, and WORLD_SIZE grows on every host.
    ([{}, {"WORKER_RANK_0": "4", "WORKER_RANK_1": "5"}], "6"),
])
def test_the_executors_of_every_host_form_one_world(workers, world_size):
    """The start-time plans need ranks 0..WORLD_SIZE-1 exactly once and one size for all, each executor its
    host's address to advertise its rendezvous at, and distinct executor ids (a peer is known by its id); the
    bus needs distinct gateway ids (each has its own token subject) and JetStream distinct NATS server names."""
    env = {"HEAD_HOST": HEAD_HOST, "WORKER_HOST": "10.0.0.9", "NATS_ROUTES": "[]",
           "NATS_ROUTE_PASSWORD": ROUTE_PASSWORD}
    if world_size != "4":
        env["WORLD_SIZE"] = world_size
    hosts = deployment(workers, env)
    executors = [(host, s) for host, compose in hosts for s in compose["services"].values()
                 if s.get("command", [""])[0] == "executor"]
    ranks = {int(s["environment"]["MORPHLING_RANK"]): host for host, s in executors}
    assert sorted(ranks) == list(range(int(world_size))) and len(ranks) == len(executors)
    assert ranks[0] == "head"
    assert {s["environment"]["MORPHLING_WORLD_SIZE"] for _, s in executors} == {world_size}
    assert {s["environment"]["MORPHLING_ADVERTISE_HOST"]: host == "head" for host, s in executors} == {
        HEAD_HOST: True, "10.0.0.9": False}
    # The instances' shape comes from the same place on every host.
    assert all(s["environment"]["MORPHLING_TP"] is None and s["environment"]["MORPHLING_PLAN"] is None
               and s["environment"]["MORPHLING_INSTANCE_PREFIX"] is None for _, s in executors)
    executor_ids = [option(s["command"], "--id") for _, s in executors]
    gateway_ids = [option(s["command"], "--id") for _, compose in hosts for s in compose["services"].values()
                   if s.get("command", [""])[0] == "gateway"]
    server_names = [compose["services"]["nats"]["environment"]["NATS_SERVER_NAME"] for _, compose in hosts]
    for names in (executor_ids, gateway_ids, server_names):
        assert len(set(names)) == len(names), names
    assert len(gateway_ids) == 2 + len(workers)


@pytest.mark.parametrize("name", FILES)
def test_the_nats_node_finds_the_single_host_config_it_includes(name):
    """nats-cluster.conf includes deploy/nats.conf by a relative path: the container must hold the two files at
    the same relative places as the repository, or the node starts without users."""
    nats = load(name)["services"]["nats"]
    mounts = {}
    for volume in nats["volumes"]:
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            assert (HERE / source).is_file(), source
            mounts[(HERE / source).resolve()] = target
    cluster_conf = HERE / "nats-cluster.conf"
    config = mounts[cluster_conf.resolve()]
    assert nats["command"] == ["--config", config]
    (include,) = re.findall(r"^include\s+(\S+)", cluster_conf.read_text(), re.MULTILINE)
    assert (cluster_conf.parent / include).resolve() == ROOT / "deploy" / "nats.conf"
    assert posixpath.normpath(posixpath.join(posixpath.dirname(config), include)) == \
        mounts[(ROOT / "deploy" / "nats.conf").resolve()]
    # Every variable the config reads is given to the container.
    wanted = set(re.findall(r"\$(NATS_\w+)", cluster_conf.read_text() + (ROOT / "deploy" / "nats.conf").read_text()))
    assert wanted <= set(nats["environment"])


def test_the_load_balancer_streams_from_every_gateway_of_the_head():
    """The gateways stream server-sent events: a buffering proxy would hold tokens back, and a short read
    timeout would cut a long generation off."""
    compose = load("compose.head.yml")
    conf = (HERE / "lb.nginx.conf").read_text()
    lb = compose["services"]["loadbalancer"]
    assert lb["ports"] == ["8000:8000"] and "./lb.nginx.conf:/etc/nginx/nginx.conf:ro" in lb["volumes"]
    upstreams = set(re.findall(r"^\s*server\s+([\w.-]+):(\d+)\b", conf, re.MULTILINE))
    gateways = {name: s for name, s in compose["services"].items() if s.get("command", [""])[0] == "gateway"}
    assert len(gateways) >= 2
    assert upstreams == {(name, option(s["command"], "--port")) for name, s in gateways.items()}
    # Only the load balancer is published: the gateways stay on the project's network.
    assert not any("ports" in s for s in gateways.values())
    assert set(lb["depends_on"]) == set(gateways)
    assert re.search(r"^\s*proxy_buffering\s+off;", conf, re.MULTILINE)
    (read_timeout,) = re.findall(r"^\s*proxy_read_timeout\s+(\d+)s;", conf, re.MULTILINE)
    assert int(read_timeout) >= 600


# --- two nodes of the NATS cluster, from deploy/multihost/nats-cluster.conf --------------------------------


def health(http_port: int) -> tuple[int, str]:
    """What the compose files' health check asks of a node, /healthz (JetStream included): status and error."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as reply:
            return reply.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()).get("error", "")
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def healthy(http_port: int) -> bool:
    return health(http_port)[0] == 200


def peers_of(http_port: int) -> set[str]:
    """The server names a node has routes to (several connections each: nats-server pools them)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/routez", timeout=2) as reply:
        return {route["remote_name"] for route in json.loads(reply.read())["routes"] or []}


class Node:
    """One host's NATS node: nats.conf and nats-cluster.conf copied into `folder` at their relative places, with
    the container's store and route listener moved to this test's own folder and free port."""

    def __init__(self, folder: Path, name: str, route_port: int):
        self.name, self.route_port, self.http_port = name, route_port, free_port()
        (folder / "multihost").mkdir(parents=True)
        single = (ROOT / "deploy" / "nats.conf").read_text()
        cluster = (HERE / "nats-cluster.conf").read_text()
        assert "/data/jetstream" in single and "listen: 0.0.0.0:6222" in cluster
        (folder / "nats.conf").write_text(single.replace("/data/jetstream", str(folder / "js")))
        self.conf = folder / "multihost" / "nats-cluster.conf"
        self.conf.write_text(cluster.replace("listen: 0.0.0.0:6222", f"listen: 127.0.0.1:{route_port}"))
        self.server: NatsServer | None = None

    def start(self, monkeypatch, routes: str, route_password: str = ROUTE_PASSWORD) -> "Node":
        # The server takes its settings from its environment, as in the container.
        for key, value in {**PASSWORDS, "NATS_SERVER_NAME": self.name, "NATS_ROUTES": routes,
                           "NATS_CLUSTER_ADVERTISE": f"127.0.0.1:{self.route_port}",
                           "NATS_ROUTE_PASSWORD": route_password}.items():
            monkeypatch.setenv(key, value)
        self.server = NatsServer(None, "-c", str(self.conf), "-m", str(self.http_port)).start()
        return self

    def url(self, user: str) -> str:
        return f"nats://{user}:{user}-pw@127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        if self.server:
            self.server.stop()


def route_list(*ports: int, password: str = ROUTE_PASSWORD) -> str:
    return "[" + ", ".join(f"nats-route://route:{password}@127.0.0.1:{p}" for p in ports) + "]"


@pytest.fixture
def two_hosts(tmp_path, monkeypatch):
    """The head's node and a worker's, each given the same NATS_ROUTES (both nodes, itself included), as
    docs/deployment.md tells."""
    head = Node(tmp_path / "head", "head", free_port())
    worker = Node(tmp_path / "worker", "worker-2", free_port())
    routes = route_list(head.route_port, worker.route_port)
    try:
        yield head.start(monkeypatch, routes), worker.start(monkeypatch, routes)
    finally:
        worker.stop()
        head.stop()


def until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def test_services_on_different_hosts_nodes_talk_through_the_route(two_hosts):
    """A gateway and the monitor on the head reach an executor on a worker: its telemetry arrives, a request
    gets its reply, and the users' permissions hold across the route (a gateway still cannot forge telemetry)."""
    head, worker = two_hosts

    async def scenario():
        monitor, gateway = [await Bus.connect(head.url(user), user) for user in ("monitor", "gateway")]
        executor = await Bus.connect(worker.url("executor"), "executor")
        heard: list[str] = []

        async def on_telemetry(incoming):
            heard.append(incoming.message.executor)

        async def answer(incoming):
            await incoming.reply(TokenizeReply(executor="exec2", tokens=[1, 2]))

        await executor.subscribe(subjects.tokenize("exec2"), TokenizeRequest, answer)
        await executor.flush()
        # Until the routes are up and the worker's subscription is known on the head.
        await until_routed(gateway, subjects.tokenize("exec2"), timeout=20)
        reply = await gateway.request(subjects.tokenize("exec2"), TokenizeRequest(prompt="hi"), TokenizeReply, 5)

        await monitor.subscribe(subjects.TELEMETRY_ALL, ExecutorTelemetry, on_telemetry)
        await monitor.flush()
        for _ in range(100):  # the monitor's subscription reaches the worker's node a moment later
            await executor.publish(subjects.telemetry("exec2"), telemetry("exec2", time.time()))
            await executor.flush()
            await asyncio.sleep(0.05)
            if heard:
                break
        forger = await Bus.connect(worker.url("gateway"), "gateway")
        await forger.publish(subjects.telemetry("exec9"), telemetry("exec9", time.time()))
        await forger.flush()
        await asyncio.sleep(0.5)
        for bus in (monitor, gateway, executor, forger):
            await bus.close()
        return reply.tokens, set(heard)

    assert asyncio.run(scenario()) == ([1, 2], {"exec2"})


def test_a_node_without_the_route_password_stays_out(two_hosts, tmp_path, monkeypatch):
    """The route port is open to the network: a node that does not know the route password must neither join
    the cluster nor see its traffic."""
    head, worker = two_hosts
    until(lambda: peers_of(head.http_port) == {"worker-2"}, 20, "the head's and the worker's nodes did not route")
    intruder = Node(tmp_path / "intruder", "intruder", free_port())
    intruder.start(monkeypatch, route_list(head.route_port, worker.route_port, password="guessed"),
                   route_password="guessed")

    async def scenario() -> list[str]:
        eavesdropper = await Bus.connect(intruder.url("monitor"), "monitor")
        executor = await Bus.connect(head.url("executor"), "executor")
        heard: list[str] = []

        async def on_telemetry(incoming):
            heard.append(incoming.message.executor)

        await eavesdropper.subscribe(subjects.TELEMETRY_ALL, ExecutorTelemetry, on_telemetry)
        await eavesdropper.flush()
        # Routes are tried at start and again every second: three seconds see several refusals.
        for _ in range(30):
            await executor.publish(subjects.telemetry("exec0"), telemetry("exec0", time.time()))
            await executor.flush()
            # Whom the cluster's own nodes route to (the intruder may list a node for the moment between its
            # greeting and the refusal).
            assert peers_of(head.http_port) == {"worker-2"} and peers_of(worker.http_port) == {"head"}
            await asyncio.sleep(0.1)
        for bus in (eavesdropper, executor):
            await bus.close()
        return heard

    try:
        assert asyncio.run(scenario()) == []
    finally:
        intruder.stop()


def test_a_node_alone_is_not_healthy_until_its_peer_routes(tmp_path, monkeypatch):
    """The compose files start every service after its host's node is healthy; so nothing starts on the head
    before a worker's node joins (docs/deployment.md): a lone node of a two-node cluster elects no JetStream
    meta leader, while a node with no cluster would be healthy at once."""
    head = Node(tmp_path / "head", "head", free_port())
    try:
        head.start(monkeypatch, route_list(head.route_port, free_port()))
        until(lambda: "meta" in health(head.http_port)[1], 10, f"no JetStream meta layer: {health(head.http_port)}")
        deadline = time.monotonic() + 2  # a cluster that can elect, elects within a fraction of a second
        while time.monotonic() < deadline:
            assert not healthy(head.http_port)
            time.sleep(0.2)
    finally:
        head.stop()


def test_the_event_stream_is_kept_for_the_whole_cluster(two_hosts):
    """The monitor on the head creates the events stream; the controller's events published on a worker's
    node are kept, and `morphling events` (the operator user) reads them there. JetStream needs its meta
    group's leader first, which a two-node cluster elects only with both nodes up: the nodes' /healthz (the
    compose health check) says when."""
    head, worker = two_hosts
    until(lambda: healthy(head.http_port) and healthy(worker.http_port), 30, "JetStream did not come up")

    async def scenario():
        stream = EventStreamConfig()
        monitor = await Bus.connect(head.url("monitor"), "monitor")
        controller, operator = [await Bus.connect(worker.url(user), user) for user in ("controller", "operator")]
        assert await monitor.ensure_stream(stream.name, [subjects.EVENTS], stream.max_age_s, stream.max_bytes)
        before = time.time() - 1
        seen: list[str] = []
        for _ in range(50):  # the stream's interest reaches the worker's node a moment after its creation
            await controller.publish(subjects.EVENTS, Event(kind="command", source="ctl0", time=time.time()))
            await controller.flush()
            await asyncio.sleep(0.1)
            seen = [e.source async for e in operator.replay(stream.name, subjects.EVENTS, Event, before)]
            if seen:
                break
        for bus in (monitor, controller, operator):
            await bus.close()
        return seen

    seen = asyncio.run(scenario())
    assert seen and set(seen) == {"ctl0"}
