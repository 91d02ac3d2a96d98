"""deploy/k8s, validated offline: every object of `kubectl kustomize deploy/k8s` (where kubectl is on the machine;
else the kustomization's resources as written) against the Kubernetes API's schemas (kubernetes-validate, strict:
an unknown field fails too), and what the deployment promises: NATS as three JetStream nodes with the
repository's own configuration, the gateways behind a Service with an autoscaler, and the executors a scalable set
of GPU pods that join the world as peers, scaled to the count the controller asks for. Nothing here runs a
cluster."""

import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.cli import COMMANDS
from services.executor.process import _parse_args

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
VERSION = "1.32"  # the oldest Kubernetes release still maintained when this was written


def written() -> list[dict]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    docs = [d for name in kustomization["resources"] for d in yaml.safe_load_all((K8S / name).read_text()) if d]
    for d in docs:
        if d["kind"] != "Namespace":
            d["metadata"].setdefault("namespace", kustomization["namespace"])
    return docs


@pytest.fixture(scope="module")
def objects() -> dict[tuple[str, str], dict]:
    docs = written()
    if shutil.which("kubectl"):
        rendered = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
        assert rendered.returncode == 0, rendered.stderr
        docs = [d for d in yaml.safe_load_all(rendered.stdout) if d]
        assert {(d["kind"], d["metadata"]["name"]) for d in docs} == \
            {(d["kind"], d["metadata"]["name"]) for d in written()}
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def test_the_kustomization_names_every_manifest_in_the_folder():
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_every_object_is_valid_against_the_kubernetes_schemas(objects):
    for (kind, name), obj in objects.items():
        kubernetes_validate.validate(obj, VERSION, strict=True)
    # and the validator is not one that passes anything
    broken = objects[("StatefulSet", "executor")] | {"spec": {"replica": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)


def container(obj: dict) -> dict:
    (c,) = obj["spec"]["template"]["spec"]["containers"]
    return c


def test_each_service_runs_a_morphling_subcommand_as_its_own_nats_user(objects):
    for name in ("gateway", "monitor", "controller"):
        args = container(objects[("Deployment", name)])["args"]
        assert args[0] in COMMANDS and re.match(rf"nats://{name}:", args[args.index("--nats") + 1]), args
    args = container(objects[("StatefulSet", "executor")])["args"]
    assert args[0] == "executor" and re.match(r"nats://executor:", args[args.index("--nats") + 1])


def test_the_executors_are_a_scalable_set_of_gpu_peers_scaled_to_what_the_controller_asks(objects):
    executors = objects[("StatefulSet", "executor")]
    c = container(executors)
    # Their flags are the executor's own, with Kubernetes' $(VAR)s standing for values.
    flags = _parse_args([re.sub(r"\$\((\w+)\)", "x", a) for a in c["args"][1:]])
    assert flags.join and flags.device == "cuda" and flags.world_size is None
    env = {e["name"]: e for e in c["env"]}
    assert env["MORPHLING_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["args"][c["args"].index("--id") + 1] == "$(POD_NAME)"  # distinct ids, stable across restarts
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert any(m["mountPath"] == "/models" and m["readOnly"] for m in c["volumeMounts"])
    # SIGTERM lets the requests finish for --drain-timeout, inside the grace period
    assert executors["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > flags.drain_timeout
    hpa = objects[("HorizontalPodAutoscaler", "executor")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "executor"}
    (metric,) = hpa["metrics"]
    assert metric["external"]["metric"]["name"] == "morphling_desired_executors"
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}


def test_the_gateways_sit_behind_a_service_with_an_autoscaler(objects):
    gateway = objects[("Deployment", "gateway")]
    service = objects[("Service", "gateway")]["spec"]
    assert service["selector"] == gateway["spec"]["selector"]["matchLabels"]
    assert service["ports"][0]["port"] == 8000
    args = container(gateway)["args"]
    assert args[args.index("--id") + 1] == "$(POD_NAME)"  # each replica its own token subject
    hpa = objects[("HorizontalPodAutoscaler", "gateway")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "gateway" and hpa["minReplicas"] >= 2


def test_nats_is_three_jetstream_nodes_on_the_repositorys_own_configuration(objects):
    nats = objects[("StatefulSet", "nats")]
    assert nats["spec"]["replicas"] == 3
    assert nats["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    c = container(nats)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    # deploy/multihost/nats-cluster.conf includes ../nats.conf: the same relative places as in the repository
    assert mounts["/etc/nats/nats.conf"]["subPath"] == "nats.conf"
    assert mounts["/etc/nats/multihost/nats-cluster.conf"]["subPath"] == "nats-cluster.conf"
    assert "/data" in mounts
    cluster_conf = (K8S.parent / "multihost" / "nats-cluster.conf").read_text()
    env = {e["name"] for e in c["env"]}
    assert set(re.findall(r"\$(NATS_\w+)", cluster_conf + (K8S.parent / "nats.conf").read_text())) <= env
    assert c["args"] == ["--config", "/etc/nats/multihost/nats-cluster.conf"]
