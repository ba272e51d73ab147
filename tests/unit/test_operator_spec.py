"""spec.py: an InferaDeployment is parsed and defaulted, upstream's manifests are accepted unchanged,
and every bad spec is refused with a message that starts with the field's path."""
from __future__ import annotations

import copy
import glob
import os
from typing import Any

import pytest
import yaml

from infera.operator.crd import openapi_schema
from infera.operator.spec import (SERVICE_FIELDS, SPEC_FIELDS, SpecError, parse_deployment)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
UPSTREAM = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "operator", "upstream", "*.yaml")))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "deploy", "examples", "*.yaml")))


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def cr(spec: dict[str, Any], name: str = "fleet", **meta: Any) -> dict:
    return {"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
            "metadata": {"name": name, **meta}, "spec": spec}


def fleet(backend: str = "vllm", **extra: Any) -> dict[str, Any]:
    """A minimal valid spec: a server and one mixed worker pool."""
    return {"backendFramework": backend,
            "services": {"server": {"componentType": "server"},
                         "workers": {"componentType": "worker", "args": ["--model", "m"]}}, **extra}


def pd(backend: str, prefill_args: list[str], decode_args: list[str] | None = None) -> dict[str, Any]:
    return {"backendFramework": backend,
            "services": {"server": {"componentType": "server"},
                         "prefill": {"componentType": "worker", "role": "prefill", "args": prefill_args},
                         "decode": {"componentType": "worker", "role": "decode",
                                    "args": decode_args if decode_args is not None else ["--model", "m"]}}}


@pytest.mark.parametrize("path", UPSTREAM, ids=os.path.basename)
def test_upstream_manifests_are_accepted_unchanged(path: str) -> None:
    raw = load(path)
    before = copy.deepcopy(raw)
    dep = parse_deployment(raw)
    assert raw == before  # parsing never writes into the CR
    assert any(s.is_server for s in dep.services) and any(not s.is_server for s in dep.services)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_examples_parse(path: str) -> None:
    parse_deployment(load(path))


def test_defaults() -> None:
    dep = parse_deployment(cr(fleet("sglang")))
    server, workers = dep.service("server"), dep.service("workers")
    assert (server.replicas, server.port, server.role) == (2, 8000, "mixed")
    assert (workers.replicas, workers.port, workers.role, workers.number_of_nodes) == (1, 30000, "mixed", 1)
    assert workers.resources.gpu_type == "amd.com/gpu"
    assert dep.discovery == "kubernetes" and dep.nats.deploy and dep.nats_deployed and not dep.etcd_deployed
    assert dep.drain.pre_stop_seconds == 15 and dep.drain.drain_timeout_seconds is None
    assert not dep.kvd.enabled and dep.kvd.socket_path == "/var/run/infera-kvd/kvd.sock"
    assert parse_deployment(cr({"services": fleet()["services"]})).backend == "sglang"


def test_etcd_discovery_works_and_atom_defaults_to_it() -> None:
    dep = parse_deployment(cr(fleet("vllm", discoveryBackend="etcd")))  # upstream refused this ⚠
    assert dep.discovery == "etcd" and dep.etcd_deployed and not dep.nats_deployed
    external = parse_deployment(cr(fleet("sglang", discoveryBackend="etcd", etcdEndpoint="http://etcd:2379")))
    assert external.etcd_endpoint == "http://etcd:2379" and not external.etcd_deployed
    atom = parse_deployment(cr(fleet("atom")))
    assert atom.discovery == "etcd" and atom.etcd_deployed


def test_the_known_fields_are_the_schemas() -> None:
    schema = openapi_schema()["properties"]["spec"]
    assert SPEC_FIELDS == set(schema["properties"])
    assert SERVICE_FIELDS == set(schema["properties"]["services"]["additionalProperties"]["properties"])


def _set(spec: dict, dotted: str, value: Any) -> dict:
    spec = copy.deepcopy(spec)
    node = spec
    keys = dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    return spec


GAIE_ON = {"enabled": True, "tokenizerPath": "/models/tok", "gatewayName": "gw"}

BAD: list[tuple[str, dict[str, Any], str]] = [
    ("replicas < 0", _set(fleet(), "services.workers.replicas", -1), "spec.services.workers.replicas: must be >= 0"),
    ("replicas bool", _set(fleet(), "services.workers.replicas", True), "spec.services.workers.replicas: must be an integer"),
    ("typo in a pool", _set(fleet(), "services.workers.replica", 2), "spec.services.workers.replica: unknown field"),
    ("typo in spec", _set(fleet(), "backendFrameWork", "vllm"), "spec.backendFrameWork: unknown field"),
    ("typo in resources", _set(fleet(), "services.workers.resources.gpus", 1),
     "spec.services.workers.resources.gpus: unknown field"),
    ("typo in nats", _set(fleet(), "nats.deplyo", False), "spec.nats.deplyo: unknown field"),
    ("unknown backend", _set(fleet(), "backendFramework", "tgi"), "spec.backendFramework: must be one of"),
    ("unknown role", _set(fleet(), "services.workers.role", "both"), "spec.services.workers.role: must be one of"),
    ("no componentType", _set(fleet(), "services.workers", {"replicas": 1}),
     "spec.services.workers.componentType: required"),
    ("nodes 0", _set(fleet(), "services.workers.numberOfNodes", 0), "spec.services.workers.numberOfNodes: must be >= 1"),
    ("port", _set(fleet(), "services.server.port", 0), "spec.services.server.port: must be >= 1"),
    ("args not strings", _set(fleet(), "services.workers.args", ["--max-num-seqs", 8]),
     "spec.services.workers.args[1]: must be a string"),
    ("env value not a string", _set(fleet(), "envs", [{"name": "A", "value": 1}]), "spec.envs[0].value: must be a string"),
    ("env without name", _set(fleet(), "services.workers.env", [{"value": "x"}]), "spec.services.workers.env[0].name"),
    ("bad quantity", _set(fleet(), "services.workers.resources.memory", "lots"),
     "spec.services.workers.resources.memory: must be a Kubernetes quantity"),
    ("no services", {"backendFramework": "vllm"}, "spec.services: required"),
    ("no server", _set(fleet(), "services.server.componentType", "worker"), "spec.services: needs a pool with componentType: server"),
    ("no worker", {"services": {"server": {"componentType": "server"}}}, "spec.services: needs at least one pool with componentType: worker"),
    ("server with a role", _set(fleet(), "services.server.role", "prefill"), "spec.services.server.role: a server has no PD role"),
    ("multi-node server", _set(fleet(), "services.server.numberOfNodes", 2), "spec.services.server.numberOfNodes"),
    ("prefill without decode", _set(fleet(), "services.workers.role", "prefill"), "spec.services: PD needs a decode pool"),
    ("decode without prefill", _set(fleet(), "services.workers.role", "decode"), "spec.services: PD needs a prefill pool"),
    ("vLLM with --disaggregation-mode", pd("vllm", ["--model", "m", "--disaggregation-mode", "prefill"]),
     "spec.services.prefill.args: vllm has no --disaggregation-mode"),
    ("vLLM with --disaggregation-mode=", pd("vllm", ["--model", "m"], ["--model", "m", "--disaggregation-mode=decode"]),
     "spec.services.decode.args: vllm has no --disaggregation-mode"),
    ("vLLM kv_role contradicts the role", pd("vllm", ["--kv-transfer-config", '{"kv_role":"kv_consumer"}']),
     "spec.services.prefill.args: --kv-transfer-config kv_role 'kv_consumer' disagrees with role 'prefill'"),
    ("kv config not JSON", pd("vllm", ["--kv-transfer-config", "{nixl}"]), "spec.services.prefill.args: --kv-transfer-config is not JSON"),
    ("SGLang mode contradicts the role", pd("sglang", ["--disaggregation-mode", "decode"]),
     "spec.services.prefill.args: --disaggregation-mode decode disagrees with role 'prefill'"),
    ("atom on kubernetes", fleet("atom", discoveryBackend="kubernetes"), "spec.discoveryBackend: atom registers in etcd only"),
    ("atom multi-node", _set(fleet("atom"), "services.workers.numberOfNodes", 2), "spec.services.workers.numberOfNodes: ATOM"),
    ("etcdEndpoint with kubernetes", fleet(etcdEndpoint="http://e:2379"), "spec.etcdEndpoint: only used with discoveryBackend: etcd"),
    ("GAIE without tokenizerPath", fleet(gaie={"enabled": True, "gatewayName": "g"}),
     "spec.gaie.tokenizerPath: required with gaie.enabled"),
    ("GAIE without gatewayName", fleet(gaie={"enabled": True, "tokenizerPath": "t"}),
     "spec.gaie.gatewayName: required with gaie.enabled"),
    ("GAIE empty tokenizerPath", fleet(gaie={"enabled": True, "tokenizerPath": "", "gatewayName": "g"}),
     "spec.gaie.tokenizerPath: must not be empty"),
    ("GAIE gatewayName not a name", fleet(gaie={"enabled": True, "tokenizerPath": "t", "gatewayName": "My GW"}),
     "spec.gaie.gatewayName: must be an object name"),
    ("GAIE gatewayNamespace not a name", fleet(gaie={**GAIE_ON, "gatewayNamespace": "Gw_NS"}),
     "spec.gaie.gatewayNamespace: must be a namespace name"),
    ("GAIE hostname with a port", fleet(gaie={**GAIE_ON, "hostnames": ["ok.example", "llm.example:443"]}),
     "spec.gaie.hostnames[1]: must be a lowercase DNS name"),
    ("GAIE too many hostnames", fleet(gaie={**GAIE_ON, "hostnames": [f"h{i}.example" for i in range(17)]}),
     "spec.gaie.hostnames: at most 16"),
    ("GAIE frontendPort is a worker's port", _set(fleet(gaie={**GAIE_ON, "frontendPort": 9000}),
                                                  "services.workers.port", 9000),
     "spec.gaie.frontendPort: 9000 is also spec.services.workers.port"),
    ("GAIE frontendPort out of range", fleet(gaie={**GAIE_ON, "frontendPort": 70000}),
     "spec.gaie.frontendPort: must be <= 65535"),
    ("GAIE negative eppReplicas", fleet(gaie={**GAIE_ON, "eppReplicas": -1}), "spec.gaie.eppReplicas: must be >= 0"),
    ("GAIE and a pool named epp", _set(fleet(gaie=GAIE_ON), "services.epp", {"componentType": "worker"}),
     "spec.services.epp: with gaie.enabled"),
    ("typo in gaie", fleet(gaie={**GAIE_ON, "gatewayname": "g"}), "spec.gaie.gatewayname: unknown field"),
    ("reserved pool name", _set(fleet(), "services.nats", {"componentType": "worker"}), "spec.services.nats: 'nats' names"),
    ("pool name not DNS", _set(fleet(), "services.Decode_1", {"componentType": "worker"}), "spec.services.Decode_1: a pool name"),
    ("reserved label", _set(fleet(), "services.workers.podLabels", {"infera.amd.com/role": "x"}),
     "spec.services.workers.podLabels.infera.amd.com/role: the operator owns"),
    ("bad label value", _set(fleet(), "services.workers.podLabels", {"team": "a b"}), "spec.services.workers.podLabels.team"),
    ("negative preStop", fleet(drain={"preStopSeconds": -1}), "spec.drain.preStopSeconds: must be >= 0"),
    ("relative kvd dir", fleet(kvd={"enabled": True, "socketDir": "run/kvd"}), "spec.kvd.socketDir: must be an absolute path"),
    ("kvd with atom", fleet("atom", kvd={"enabled": True}), "spec.kvd.enabled: ATOM has no kvd connector"),
]


@pytest.mark.parametrize("spec,message", [(s, m) for _, s, m in BAD], ids=[b[0] for b in BAD])
def test_a_bad_spec_names_its_field(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_deployment(cr(spec))
    assert str(info.value).startswith(message), str(info.value)


@pytest.mark.parametrize("meta,message", [
    ({"name": "Fleet"}, "metadata.name: must be a DNS label"),
    ({"name": "1fleet"}, "metadata.name: must be a DNS label"),
    ({"name": "f" * 48}, "metadata.name: at most 47 characters"),
    ({"name": "fleet", "namespace": "Bad_NS"}, "metadata.namespace: must be a DNS label"),
])
def test_bad_metadata(meta: dict, message: str) -> None:
    raw = cr(fleet())
    raw["metadata"] = meta
    with pytest.raises(SpecError) as info:
        parse_deployment(raw)
    assert str(info.value).startswith(message), str(info.value)


def test_wrong_kind_and_version_are_refused() -> None:
    with pytest.raises(SpecError, match="^kind: must be InferaDeployment"):
        parse_deployment({**cr(fleet()), "kind": "Deployment"})
    with pytest.raises(SpecError, match="^apiVersion: must be infera.amd.com/v1alpha1"):
        parse_deployment({**cr(fleet()), "apiVersion": "infera.amd.com/v1"})


def test_accepted_pd_forms() -> None:
    """kv_both or no kv_role in a vLLM pool's config: the role is rendered in; SGLang's own mode
    flag is fine when it agrees; an ATOM config with its role passes."""
    parse_deployment(cr(pd("vllm", ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
                           ["--kv-transfer-config={\"kv_connector\":\"NixlConnector\"}"])))
    parse_deployment(cr(pd("sglang", ["--disaggregation-mode", "prefill"], ["--disaggregation-mode=decode"])))
    parse_deployment(cr(pd("atom", ["--kv-transfer-config", '{"kv_connector":"mooncake","kv_role":"kv_producer"}'])))


def test_gaie_fields_are_accepted_when_off() -> None:
    dep = parse_deployment(cr(fleet(gaie={"enabled": False, "eppImage": "e", "tokenizerPath": "t", "gatewayName": "g",
                                          "gatewayNamespace": "gw", "hostnames": ["a.example"], "frontendPort": 8000,
                                          "modelName": "m"})))
    assert not dep.gaie.enabled


def test_gaie_enabled_is_parsed_with_defaults() -> None:
    dep = parse_deployment(cr(fleet(gaie=GAIE_ON)))
    assert dep.gaie.enabled and dep.gaie.tokenizer_path == "/models/tok" and dep.gaie.gateway_name == "gw"
    assert (dep.gaie.frontend_port, dep.gaie.epp_replicas, dep.gaie.gateway_namespace, dep.gaie.hostnames) == \
        (8000, 1, None, ())
    full = parse_deployment(cr(fleet(gaie={**GAIE_ON, "eppImage": "e:1", "gatewayNamespace": "gw-system",
                                           "hostnames": ["*.example.com", "llm.example.com"], "frontendPort": 8100,
                                           "modelName": "m", "eppReplicas": 2})))
    assert (full.gaie.epp_image, full.gaie.gateway_namespace, full.gaie.hostnames, full.gaie.frontend_port,
            full.gaie.model_name, full.gaie.epp_replicas) == \
        ("e:1", "gw-system", ("*.example.com", "llm.example.com"), 8100, "m", 2)
    # a pool named epp is fine without GAIE (no <name>-epp of the picker to collide with)
    parse_deployment(cr(_set(fleet(), "services.epp", {"componentType": "worker", "args": ["--model", "m"]})))
