"""The operator with ``gaie.enabled`` against the fake API server (tests/fakes/kube_api.py): on a
cluster without the Gateway API Inference Extension and Gateway API CRDs a GAIE fleet is ``failed``
with a message that says which CRDs to install, while a fleet without GAIE is reconciled as usual
(pruning lists the GAIE kinds and skips them when they are not served). Once the CRDs exist (built
from the upstream schemas in tests/fixtures/gaie/, which the fake validates custom resources
against) the next resync applies the InferencePool and HTTPRoute; the EPP's readiness counts
toward the CR's; turning GAIE off prunes the picker, the pool, the route and the sidecars."""
from __future__ import annotations

import os
from typing import Any

import pytest
import yaml

from tests.conftest import wait_for
from tests.fakes.kube_api import FakeKubeApi
from tests.integration.test_operator import (API, KIND, NS, T, api, bare_api, conditions, cr, deployments,  # noqa: F401
                                             make_ready, operator, patch_cr, state, the_cr)

pytestmark = pytest.mark.integration

GAIE_FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "gaie")
GAIE = {"enabled": True, "tokenizerPath": "/models/tok", "gatewayName": "gw", "gatewayNamespace": "gateway-system"}


def upstream_crd(schema_file: str, group: str, kind: str, plural: str) -> dict[str, Any]:
    """A CRD serving ``kind`` v1 with the upstream openAPIV3Schema (what the real CRD installs)."""
    with open(os.path.join(GAIE_FIXTURES, schema_file), encoding="utf-8") as f:
        schema = yaml.safe_load(f)
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                     "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                                   "schema": {"openAPIV3Schema": schema}}]}}


def install_gaie_crds(api: FakeKubeApi) -> None:
    crd_type = api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition")
    api.create_object(crd_type, None, upstream_crd("inferencepool-v1.schema.yaml", "inference.networking.k8s.io",
                                                   "InferencePool", "inferencepools"))
    api.create_object(crd_type, None, upstream_crd("httproute-v1.schema.yaml", "gateway.networking.k8s.io",
                                                   "HTTPRoute", "httproutes"))


def gaie_cr(name: str) -> dict[str, Any]:
    obj = cr(name)
    obj["spec"]["gaie"] = dict(GAIE)
    return obj


async def test_gaie_without_then_with_its_crds_and_turned_off(api: FakeKubeApi, operator):
    api.create_object(api.resource_type(API, KIND), NS, gaie_cr("gw"))
    api.create_object(api.resource_type(API, KIND), NS, cr("plain"))
    await wait_for(lambda: state(api, "gw") == "failed", T, message="failed without the GAIE CRDs")
    message = conditions(the_cr(api, "gw"))["Degraded"]["message"]
    assert "Gateway API Inference Extension" in message and "CRD" in message, message
    await wait_for(lambda: state(api, "plain") == "pending", T, message="a fleet without GAIE is unaffected")

    install_gaie_crds(api)
    await wait_for(lambda: api.get("gateway.networking.k8s.io/v1", "HTTPRoute", "gw-route", NS) is not None, T,
                   message="the InferencePool and HTTPRoute applied once their CRDs exist")
    pool = api.get("inference.networking.k8s.io/v1", "InferencePool", "gw-pool", NS)
    assert pool["spec"]["endpointPickerRef"]["name"] == "gw-epp"
    assert pool["spec"]["appProtocol"] == "http"  # the CRD's default: the schema was applied
    route = api.get("gateway.networking.k8s.io/v1", "HTTPRoute", "gw-route", NS)
    assert route["spec"]["parentRefs"][0]["name"] == "gw"
    await wait_for(lambda: state(api, "gw") == "pending", T, message="pending once applied")
    workers = deployments(api)["gw-pool-a"]["spec"]["template"]
    assert [c["name"] for c in workers["spec"]["containers"]] == ["main", "infera-frontend"]

    uid = the_cr(api, "gw")["metadata"]["uid"]
    make_ready(api, uid)  # every Deployment, the EPP's included, and the NATS StatefulSet
    await wait_for(lambda: state(api, "gw") == "ready", T, message="ready with the picker ready")
    # status.gaie: the picker is ready; no gateway controller has accepted the pool or the route yet,
    # which does not hold the CR's own state.
    await wait_for(lambda: (the_cr(api, "gw")["status"].get("gaie") or {}).get("eppReadyReplicas") == 1, T,
                   message="status.gaie counts the ready picker")
    assert the_cr(api, "gw")["status"]["gaie"] == {
        "eppReplicas": 1, "eppReadyReplicas": 1, "inferencePoolName": "gw-pool", "inferencePoolReady": False,
        "httpRouteName": "gw-route", "httpRouteAccepted": False, "ready": False}
    accepted = {"status": {"parents": [{"parentRef": {"name": "gw"}, "controllerName": "example.com/gateway",
                                        "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted",
                                                        "message": "", "lastTransitionTime": "2026-12-03T00:00:00Z"}]}]}}
    for api_version, kind, name in (("inference.networking.k8s.io/v1", "InferencePool", "gw-pool"),
                                    ("gateway.networking.k8s.io/v1", "HTTPRoute", "gw-route")):
        api.patch_object(api.resource_type(api_version, kind), NS, name, "application/merge-patch+json", accepted,
                         subresource="status")
    await wait_for(lambda: the_cr(api, "gw")["status"]["gaie"].get("ready") is True, T,
                   message="status.gaie ready once the gateway controller accepted the pool and the route")

    patch_cr(api, {"spec": {"gaie": {"enabled": False}}}, name="gw")
    await wait_for(lambda: api.get("inference.networking.k8s.io/v1", "InferencePool", "gw-pool", NS) is None, T,
                   message="the InferencePool pruned")
    await wait_for(lambda: api.get("gateway.networking.k8s.io/v1", "HTTPRoute", "gw-route", NS) is None, T,
                   message="the HTTPRoute pruned")
    await wait_for(lambda: "gw-epp" not in deployments(api), T, message="the EPP pruned")
    await wait_for(lambda: "gaie" not in the_cr(api, "gw")["status"], T, message="status.gaie dropped")
    await wait_for(lambda: [c["name"] for c in deployments(api)["gw-pool-a"]["spec"]["template"]["spec"]["containers"]]
                   == ["main"], T, message="the sidecar gone")
