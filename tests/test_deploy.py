"""The Kubernetes manifests render for every overlay and every object is valid offline."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.kustomize_lite import render

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
OVERLAYS = ["collocated", "disaggregated"]
KUBE_VERSION = "1.30.0"


def _key(obj: dict) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def _objects(overlay: str) -> dict[tuple[str, str], dict]:
    return {_key(o): o for o in render(K8S / "overlays" / overlay)}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_lite_renderer_matches_kubectl_kustomize(overlay):
    out = subprocess.run(
        ["kubectl", "kustomize", str(K8S / "overlays" / overlay)], check=True, capture_output=True, text=True
    ).stdout
    theirs = {_key(o): o for o in yaml.safe_load_all(out) if o}
    assert theirs == _objects(overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_kubernetes_schema(overlay):
    objects = _objects(overlay)
    assert objects
    for obj in objects.values():
        kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)


def _deployments(objects):
    return {name: o for (kind, name), o in objects.items() if kind == "Deployment"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_is_probed_on_health_and_runs_as_non_root(overlay):
    for name, dep in _deployments(_objects(overlay)).items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for container in pod["containers"]:
            for probe in ("readinessProbe", "livenessProbe"):
                assert container[probe]["httpGet"]["path"] == "/health", (name, probe)
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true", name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_selectors_of_services_pdbs_and_hpas_point_at_real_pods(overlay):
    objects = _objects(overlay)
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in _deployments(objects).values()]

    def matches(selector):
        return any(all(labels.get(k) == v for k, v in selector.items()) for labels in pod_labels)

    for (kind, name), obj in objects.items():
        if kind == "Service":
            assert matches(obj["spec"]["selector"]), name
        if kind == "PodDisruptionBudget":
            assert matches(obj["spec"]["selector"]["matchLabels"]), name
        if kind == "HorizontalPodAutoscaler":
            assert ("Deployment", obj["spec"]["scaleTargetRef"]["name"]) in objects, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_request_gpus_and_spread_across_nodes(overlay):
    engines = {n: d for n, d in _deployments(_objects(overlay)).items() if "render" not in n and "gateway" not in n}
    assert engines
    for name, dep in engines.items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1", name
        assert pod["affinity"]["podAntiAffinity"], name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_engine_urls_name_services_of_the_overlay(overlay):
    objects = _objects(overlay)
    args = objects[("Deployment", "splitserve-gateway")]["spec"]["template"]["spec"]["containers"][0]["args"]
    urls = [a.split("=", 1)[1] for a in args if a.startswith(("--engine=", "--prefill=", "--decode="))]
    assert urls
    for url in urls:
        host = url.split("//", 1)[1].split(":", 1)[0]
        assert ("Service", host) in objects, url


def _flag_seconds(container: dict, flag: str) -> float | None:
    for arg in container.get("args", []):
        if arg.startswith(flag + "="):
            return float(arg.split("=", 1)[1])
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_server_keeps_serving_until_endpoints_drop_and_drains_within_the_grace_period(overlay):
    """A preStop wait lets endpoint removal spread before the SIGTERM; the wait plus the server's own drain must
    end before Kubernetes kills the pod."""
    for name, dep in _deployments(_objects(overlay)).items():
        pod = dep["spec"]["template"]["spec"]
        for container in pod["containers"]:
            command = container["lifecycle"]["preStop"]["exec"]["command"]
            assert command[0] == "sleep", (name, command)
            wait = float(command[1])
            assert wait >= 3, (name, wait)
            drain = _flag_seconds(container, "--shutdown-grace-seconds")
            assert drain is not None, name
            assert wait + drain < pod["terminationGracePeriodSeconds"], (name, wait, drain)
