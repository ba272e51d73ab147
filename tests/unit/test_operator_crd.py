"""The InferaDeployment CRD: deploy/kubernetes/crd.yaml is crd.py's output, the schema is structural
and complete, and a CR with a misspelt or mistyped field is refused by it, as the API server (with
kubectl's default Strict field validation) refuses it at apply time."""
from __future__ import annotations

import copy
import glob
import os
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from infera.operator import __main__ as cli
from infera.operator.crd import build_crd, crd_yaml, openapi_schema

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CRD_FILE = os.path.join(ROOT, "deploy", "kubernetes", "crd.yaml")
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "deploy", "examples", "*.yaml")))
UPSTREAM = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "operator", "upstream", "*.yaml")))


def closed_schema(node: Any) -> Any:
    """The OpenAPI schema as JSON Schema with the API server's unknown-field semantics: an object
    with ``properties`` and no ``x-kubernetes-preserve-unknown-fields`` admits no other field
    (pruned, and refused under Strict field validation)."""
    if isinstance(node, list):
        return [closed_schema(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed_schema(v) for k, v in node.items() if not k.startswith("x-kubernetes-")}
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    if node.get("x-kubernetes-int-or-string"):
        out.pop("pattern", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string", "pattern": node["pattern"]}] \
            if "pattern" in node else [{"type": "integer"}, {"type": "string"}]
    return out


def validate_cr(cr: dict) -> None:
    jsonschema.validate(cr, closed_schema(openapi_schema()))


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def test_crd_file_is_the_functions_output() -> None:
    with open(CRD_FILE, encoding="utf-8") as f:
        assert f.read() == crd_yaml(), "regenerate: python -m infera.operator crd > deploy/kubernetes/crd.yaml"


def test_cli_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["crd"]) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crd_is_a_valid_kubernetes_object() -> None:
    kubernetes_validate.validate(build_crd(), "1.37.0", strict=True)


def test_names_columns_and_subresources() -> None:
    crd = build_crd()
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "inferadeployments.infera.amd.com"
    assert spec["group"] == "infera.amd.com" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "InferaDeployment" and spec["names"]["shortNames"] == ["idep"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Backend": ".spec.backendFramework", "State": ".status.state", "GAIE": ".status.gaie.ready",
                       "Age": ".metadata.creationTimestamp"}


def _walk(node: Any, path: str = "") -> list[tuple[str, dict]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, child in node.get("properties", {}).items():
            out += _walk(child, f"{path}.{key}")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}.*")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
    return out


def test_schema_is_structural() -> None:
    """Every node has a type (or is int-or-string / keeps unknown fields), no node has both
    properties and additionalProperties, and additionalProperties is never false (forbidden in
    structural schemas: unknown fields are refused by pruning + Strict validation instead)."""
    for path, node in _walk(openapi_schema()):
        if path == "":
            continue
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
            assert node.get("x-kubernetes-preserve-unknown-fields") or path == ".metadata", path


def test_schema_types_every_field_of_section_10() -> None:
    spec = openapi_schema()["properties"]["spec"]
    assert spec["required"] == ["services"]
    assert spec["properties"]["backendFramework"]["enum"] == ["sglang", "vllm", "atom", "sim"]
    assert spec["properties"]["discoveryBackend"]["enum"] == ["kubernetes", "etcd"]
    svc = spec["properties"]["services"]["additionalProperties"]
    assert svc["required"] == ["componentType"]
    assert set(svc["properties"]) == {"componentType", "role", "replicas", "numberOfNodes", "skipReadinessProbe",
                                      "image", "port", "resources", "args", "env", "extraPodSpec", "podLabels"}
    assert svc["properties"]["replicas"]["minimum"] == 0
    assert svc["properties"]["numberOfNodes"]["minimum"] == 1
    assert "default" not in svc["properties"]["replicas"]  # 2 for a server, 1 for a worker: spec.py decides
    assert set(spec["properties"]["gaie"]["properties"]) == {"enabled", "eppImage", "tokenizerPath", "gatewayName",
                                                              "gatewayNamespace", "hostnames", "frontendPort",
                                                              "modelName", "eppReplicas"}
    assert spec["properties"]["gaie"]["properties"]["frontendPort"]["default"] == 8000
    assert spec["properties"]["drain"]["properties"]["preStopSeconds"]["default"] == 15
    status = openapi_schema()["properties"]["status"]["properties"]
    assert status["state"]["enum"] == ["initializing", "pending", "ready", "degraded", "failed"]
    assert set(status["services"]["additionalProperties"]["properties"]) == {"kind", "replicas", "readyReplicas"}
    assert status["conditions"]["items"]["properties"]["type"]["enum"] == ["Ready", "Progressing", "Degraded"]


@pytest.mark.parametrize("path", EXAMPLES + UPSTREAM, ids=os.path.basename)
def test_examples_and_upstream_manifests_pass_the_schema(path: str) -> None:
    validate_cr(load(path))


def _mutate(cr: dict, dotted: str, value: Any) -> dict:
    cr = copy.deepcopy(cr)
    node = cr
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return cr


BAD = [
    ("spec.backendFrameWork", "vllm"),  # misspelt field
    ("spec.services.workers.replica", 3),  # misspelt field
    ("spec.services.workers.resources.gpus", 1),  # misspelt field
    ("spec.nats.deplyo", False),  # misspelt field
    ("spec.drain.preStop", 5),  # misspelt field
    ("spec.backendFramework", "tgi"),  # not an engine
    ("spec.services.workers.role", "both"),  # not a role
    ("spec.services.workers.componentType", "router"),
    ("spec.services.workers.replicas", -1),
    ("spec.services.workers.replicas", "2"),
    ("spec.services.workers.numberOfNodes", 0),
    ("spec.services.workers.port", 70000),
    ("spec.services.workers.args", "--model x"),  # a string, not a list
    ("spec.services.workers.resources.memory", "lots"),
    ("spec.discoveryBackend", "consul"),
]


@pytest.mark.parametrize("dotted,value", BAD, ids=[f"{d}={v!r}" for d, v in BAD])
def test_a_typo_or_bad_value_is_refused_by_the_schema(dotted: str, value: Any) -> None:
    cr = load(os.path.join(ROOT, "deploy", "examples", "sim-mixed.yaml"))
    validate_cr(cr)
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(_mutate(cr, dotted, value))


def test_extra_pod_spec_and_env_sources_keep_unknown_fields() -> None:
    cr = load(os.path.join(ROOT, "deploy", "examples", "sim-mixed.yaml"))
    validate_cr(_mutate(cr, "spec.services.workers.extraPodSpec", {"anything": {"goes": [1]}}))
    validate_cr(_mutate(cr, "spec.envs", [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]))
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(_mutate(cr, "spec.services", {}))  # at least one pool
    with pytest.raises(jsonschema.ValidationError):
        validate_cr(_mutate(cr, "spec.services.workers", {"replicas": 1}))  # componentType required
