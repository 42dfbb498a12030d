"""The manifests make the trust model true (docs/security.md): keys come from Secrets, engines refuse to start
without theirs, and NetworkPolicies let only the gateway reach the engines' HTTP port and only engines reach
each other's NIXL side channel. Checked offline on the rendered overlays, with a small evaluator of the
NetworkPolicy rules the manifests use (pod and namespace selectors, named or numbered ports)."""

from __future__ import annotations

import pytest

from tests.test_deploy import OVERLAYS, _deployments, _objects

ENGINE_KEY = ("splitserve-engine-api-key", "api-key")
KV_SECRET = ("splitserve-kv-secret", "kv-side-channel-secret")
STREAM_STATE = ("splitserve-stream-state", "secret")
NAMESPACE = {"kubernetes.io/metadata.name": "splitserve"}


def _containers(dep: dict) -> list[dict]:
    return dep["spec"]["template"]["spec"]["containers"]


def _secret_env(container: dict) -> dict[str, tuple[str, str, bool]]:
    out = {}
    for entry in container.get("env", []):
        ref = entry.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            out[entry["name"]] = (ref["name"], ref["key"], bool(ref.get("optional", False)))
    return out


def _by_component(objects: dict, component: str) -> dict[str, dict]:
    return {n: d for n, d in _deployments(objects).items()
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == component}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_engines_and_gateway_share_a_required_engine_key_from_a_secret(overlay):
    objects = _objects(overlay)
    engines = _by_component(objects, "engine")
    assert engines
    for name, dep in engines.items():
        assert _secret_env(_containers(dep)[0])["VLLM_API_KEY"] == (*ENGINE_KEY, False), name
    (gateway,) = _by_component(objects, "gateway").values()
    assert _secret_env(_containers(gateway)[0])["SPLITSERVE_ENGINE_API_KEY"] == (*ENGINE_KEY, False)
    for name, dep in _deployments(objects).items():  # and no key or secret is written into a manifest
        for container in _containers(dep):
            assert not [a for a in container.get("args", []) if "api-key" in a or "secret" in a.lower()], name
            for entry in container.get("env", []):
                if any(word in entry["name"] for word in ("KEY", "SECRET")):
                    assert "value" not in entry, (name, entry["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_stream_state_is_signed_with_one_required_secret_on_every_render_replica(overlay):
    objects = _objects(overlay)
    for component in ("render", "gateway"):
        for name, dep in _by_component(objects, component).items():
            assert _secret_env(_containers(dep)[0])["SPLITSERVE_STREAM_STATE_SECRET"] == (*STREAM_STATE, False), name


def test_pd_engines_authenticate_their_side_channel_with_one_secret():
    engines = _by_component(_objects("disaggregated"), "engine")
    assert set(engines) == {"splitserve-prefill", "splitserve-decode"}
    for name, dep in engines.items():
        assert _secret_env(_containers(dep)[0])["SPLITSERVE_KV_SECRET"] == (*KV_SECRET, False), name


# ------------------------------------------------------------------------------------- network policy


def _matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "the evaluator knows matchLabels only"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _port_numbers(pod: dict, port) -> set[int]:
    if isinstance(port, int):
        return {port}
    return {p["containerPort"] for c in pod["containers"] for p in c.get("ports", []) if p.get("name") == port}


def allowed(objects: dict, source: dict, source_namespace: dict, target: dict, port: int) -> bool:
    """May a pod with labels ``source`` in a namespace with labels ``source_namespace`` open ``port`` on the
    pod spec ``target`` (its template: labels and spec), under the overlay's NetworkPolicies?"""
    labels, spec = target["metadata"]["labels"], target["spec"]
    policies = [o for (kind, _), o in objects.items() if kind == "NetworkPolicy"
                and "Ingress" in o["spec"]["policyTypes"] and _matches(o["spec"]["podSelector"], labels)]
    if not policies:
        return True  # no policy selects the pod: Kubernetes allows everything
    same_namespace = source_namespace == NAMESPACE
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports is not None and not any(port in _port_numbers(spec, p["port"]) for p in ports):
                continue
            for peer in rule.get("from", []):
                pod_ok = "podSelector" not in peer or _matches(peer["podSelector"], source)
                if "namespaceSelector" in peer:
                    ns_ok = _matches(peer["namespaceSelector"], source_namespace)
                else:
                    ns_ok = same_namespace  # a bare podSelector means the policy's own namespace
                if pod_ok and ns_ok:
                    return True
    return False


def _pod_labels(dep: dict) -> dict:
    return dep["spec"]["template"]["metadata"]["labels"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_gateway_reaches_the_engines_http_port_and_only_engines_their_side_channel(overlay):
    objects = _objects(overlay)
    engines = _by_component(objects, "engine")
    (gateway,) = _by_component(objects, "gateway").values()
    (render,) = _by_component(objects, "render").values()
    stranger = {"app": "something-else"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    for name, engine in engines.items():
        target = engine["spec"]["template"]
        assert allowed(objects, _pod_labels(gateway), NAMESPACE, target, 8000), name
        assert allowed(objects, {}, monitoring, target, 8000), name  # Prometheus scrapes /metrics
        for other in engines.values():
            assert allowed(objects, _pod_labels(other), NAMESPACE, target, 5600), name
            assert allowed(objects, _pod_labels(other), NAMESPACE, target, 40123), name  # UCX's own ports
        for source, namespace in ((_pod_labels(render), NAMESPACE), (stranger, NAMESPACE), (stranger, monitoring),
                                  (_pod_labels(gateway), {"kubernetes.io/metadata.name": "elsewhere"})):
            if namespace is not monitoring:
                assert not allowed(objects, source, namespace, target, 8000), (name, source, namespace)
            assert not allowed(objects, source, namespace, target, 5600), (name, source, namespace)
        assert not allowed(objects, _pod_labels(gateway), NAMESPACE, target, 5600), name
    for entry_point in (gateway, render):  # while clients anywhere still reach the render tier and the gateway
        assert allowed(objects, {"app": "client"}, {"kubernetes.io/metadata.name": "apps"},
                       entry_point["spec"]["template"], 8000)
