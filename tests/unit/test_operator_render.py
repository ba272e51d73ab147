"""render.py: every example renders to the golden objects, every object passes kubernetes-validate
(1.37, strict), and the rules of docs/kubernetes.md hold: labels, owner references, engine flags
(vLLM PD never gets --disaggregation-mode), etcd discovery, the grace period, Service port ==
container port, the sim mode.

Golden files: tests/fixtures/operator/golden/<example>.yaml is what
``python -m infera.operator render -f deploy/examples/<example>.yaml`` prints. After an intended
change, regenerate them with ``INFERA_UPDATE_GOLDEN=1 pytest tests/unit/test_operator_render.py``
and review the diff.
"""
from __future__ import annotations

import copy
import glob
import json
import os
import re
from typing import Any, Iterator

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from infera.engine.base.launcher import build_launcher_parser
from infera.engine.sglang.adapter import SglangAdapter
from infera.engine.sim import server as sim_server
from infera.engine.sim.launcher import SimAdapter
from infera.engine.vllm.adapter import VllmAdapter
from infera.engine.atom.adapter import AtomAdapter
from infera.gaie.cli import parse_args as parse_epp_args
from infera.operator import __main__ as cli
from infera.operator.render import (KIND_ORDER, SIM_ENGINE_VALUE_FLAGS, SIM_LAUNCHER_BOOL_FLAGS,
                                    SIM_LAUNCHER_VALUE_FLAGS, RenderOptions, drain_seconds, grace_period_seconds,
                                    grafana_dashboard_json, render)
from infera.operator.spec import SpecError
from infera.server.cli import build_parser as build_server_parser
from infera.server.cli import parse_args as parse_server_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "deploy", "examples", "*.yaml")))
UPSTREAM = sorted(glob.glob(os.path.join(ROOT, "tests", "fixtures", "operator", "upstream", "*.yaml")))
GOLDEN_DIR = os.path.join(ROOT, "tests", "fixtures", "operator", "golden")
K8S_VERSION = "1.37.0"
# Kinds kubernetes-validate has no schema for (CRD-defined): checked against LWS_SCHEMA below, and
# their Pod templates strictly as v1 PodTemplates.
KINDS_UNKNOWN_TO_KUBERNETES_VALIDATE = {"LeaderWorkerSet", "InferencePool", "HTTPRoute"}
GAIE_FIXTURES = os.path.join(ROOT, "tests", "fixtures", "gaie")
UID = "5d1c0f7e-1111-4222-8333-944455556666"
ADAPTERS = {"vllm": VllmAdapter, "sglang": SglangAdapter, "atom": AtomAdapter, "sim": SimAdapter}

_TEMPLATE = {"type": "object", "required": ["metadata", "spec"],
             "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}}}
# leaderworkerset.x-k8s.io/v1, the fields the renderer writes (sigs.k8s.io/lws api/v1 types).
LWS_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"}, "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "additionalProperties": False, "required": ["leaderWorkerTemplate"], "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
            "rolloutStrategy": {"type": "object", "additionalProperties": False, "properties": {
                "type": {"enum": ["RollingUpdate"]},
                "rollingUpdateConfiguration": {"type": "object", "additionalProperties": False, "properties": {
                    "maxUnavailable": {"type": ["integer", "string"]},
                    "maxSurge": {"type": ["integer", "string"]}}}}},
            "leaderWorkerTemplate": {"type": "object", "additionalProperties": False, "required": ["workerTemplate"],
                                     "properties": {
                                         "size": {"type": "integer", "minimum": 1},
                                         "restartPolicy": {"enum": ["Default", "RecreateGroupOnPodRestart",
                                                                    "RecreateGroupAfterStart", "None"]},
                                         "leaderTemplate": _TEMPLATE, "workerTemplate": _TEMPLATE}}}}}}


def strict(schema: Any) -> Any:
    """A CRD's openAPIV3Schema as jsonschema, unknown fields refused (kubectl's strict field
    validation; a structural schema would silently prune them) unless the schema preserves them."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (strict(v) if k not in ("properties", "enum", "default", "x-kubernetes-validations", "required")
               else v) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


def crd_schema(file: str) -> dict:
    with open(os.path.join(GAIE_FIXTURES, file), encoding="utf-8") as f:
        return strict(yaml.safe_load(f))


# The upstream CRDs' schemas (tests/fixtures/gaie/README.md: pinned tags).
GAIE_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"): crd_schema("inferencepool-v1.schema.yaml"),
                ("gateway.networking.k8s.io/v1", "HTTPRoute"): crd_schema("httproute-v1.schema.yaml")}


def check_gaie_cel_rules(obj: dict) -> None:
    """The CRDs' CEL rules (x-kubernetes-validations, which jsonschema skips) our objects touch."""
    spec = obj["spec"]
    if obj["kind"] == "InferencePool":
        ref = spec["endpointPickerRef"]
        assert ref.get("kind", "Service") != "Service" or "port" in ref  # port required for a Service
        numbers = [p["number"] for p in spec["targetPorts"]]
        assert len(numbers) == len(set(numbers))  # port number must be unique
    elif obj["kind"] == "HTTPRoute":
        for rule in spec["rules"]:
            for match in rule.get("matches", []):
                path = match.get("path", {})
                if path.get("type") in ("Exact", "PathPrefix"):
                    assert path["value"].startswith("/") and "//" not in path["value"]
            for ref in rule.get("backendRefs", []):
                assert ref.get("group", "") != "" or ref.get("kind", "Service") != "Service" or "port" in ref
            timeouts = rule.get("timeouts", {})
            if "request" in timeouts and "backendRequest" in timeouts and duration_s(timeouts["request"]) != 0:
                assert duration_s(timeouts["backendRequest"]) <= duration_s(timeouts["request"])


def duration_s(value: str) -> float:
    """A Gateway API Duration (GEP-2257: e.g. 1h30m, 500ms) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"([0-9]{1,5})(ms|h|m|s)", value)
    assert "".join(n + u for n, u in parts) == value, value
    return sum(int(n) * units[u] for n, u in parts)


def validate_crd_kind(obj: dict) -> None:
    if obj["kind"] == "LeaderWorkerSet":
        jsonschema.validate(obj, LWS_SCHEMA)
        for i, template in enumerate(pod_templates(obj)):
            as_pod_template = {"apiVersion": "v1", "kind": "PodTemplate",
                               "metadata": {"name": f"{obj['metadata']['name']}-{i}"}, "template": template}
            kubernetes_validate.validate(as_pod_template, K8S_VERSION, strict=True)
        return
    schema = GAIE_SCHEMAS[(obj["apiVersion"], obj["kind"])]
    jsonschema.validate(obj, schema)
    check_gaie_cel_rules(obj)
    # metadata is only {type: object} in a CRD schema: check it as the API server's ObjectMeta
    as_config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]}
    kubernetes_validate.validate(as_config_map, K8S_VERSION, strict=True)


def load(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def with_uid(cr: dict) -> dict:
    cr = copy.deepcopy(cr)
    cr["metadata"]["uid"] = UID
    return cr


def pod_templates(obj: dict) -> list[dict]:
    if obj["kind"] == "LeaderWorkerSet":
        lwt = obj["spec"]["leaderWorkerTemplate"]
        return [lwt["leaderTemplate"], lwt["workerTemplate"]]
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
        return [obj["spec"]["template"]]
    return []


def main_container(template: dict) -> dict:
    (main,) = [c for c in template["spec"]["containers"] if c["name"] == "main"]
    return main


def by_kind_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def every_case() -> Iterator[tuple[str, bool]]:
    for path in EXAMPLES + UPSTREAM:
        for sim in (False, True):
            yield path, sim


CASES = list(every_case())
CASE_IDS = [f"{'upstream-' if p in UPSTREAM else ''}{os.path.basename(p)}{'-sim' if s else ''}" for p, s in CASES]


# --------------------------------------------------------------------------------------------- goldens
@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_golden(path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["render", "-f", path]) == 0
    out = capsys.readouterr().out
    golden = os.path.join(GOLDEN_DIR, os.path.basename(path))
    if os.environ.get("INFERA_UPDATE_GOLDEN") == "1":
        os.makedirs(GOLDEN_DIR, exist_ok=True)
        with open(golden, "w", encoding="utf-8") as f:
            f.write(out)
    with open(golden, encoding="utf-8") as f:
        assert out == f.read(), f"{golden} differs: INFERA_UPDATE_GOLDEN=1 regenerates it (review the diff)"
    assert list(yaml.safe_load_all(out)) == render(load(path))


# --------------------------------------------------------------------------------------------- validity
@pytest.mark.parametrize("api_version,kind", [("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"),
                                              ("inference.networking.k8s.io/v1", "InferencePool"),
                                              ("gateway.networking.k8s.io/v1", "HTTPRoute")])
def test_kubernetes_validate_cannot_know_the_crd_kinds(api_version: str, kind: str) -> None:
    obj = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}, "spec": {}}
    with pytest.raises(SchemaNotFoundError):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_every_object_is_valid_kubernetes(path: str, sim: bool) -> None:
    objects = render(with_uid(load(path)), RenderOptions(sim=sim))
    assert objects
    for obj in objects:
        if obj["kind"] in KINDS_UNKNOWN_TO_KUBERNETES_VALIDATE:
            validate_crd_kind(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_labels_owner_references_and_order(path: str, sim: bool) -> None:
    cr = with_uid(load(path))
    objects = render(cr, RenderOptions(sim=sim))
    assert objects == render(copy.deepcopy(cr), RenderOptions(sim=sim))  # deterministic
    keys = [(KIND_ORDER.index(o["kind"]), o["metadata"]["name"]) for o in objects]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    name = cr["metadata"]["name"]
    for obj in objects:
        meta = obj["metadata"]
        assert meta["namespace"] == cr["metadata"].get("namespace", "default")
        assert {"app.kubernetes.io/managed-by": "infera-operator", "app.kubernetes.io/part-of": "infera",
                "infera.amd.com/deployment": name}.items() <= meta["labels"].items()
        assert meta["ownerReferences"] == [{"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
                                            "name": name, "uid": UID, "controller": True,
                                            "blockOwnerDeletion": True}]
        for template in pod_templates(obj):
            labels = template["metadata"]["labels"]
            assert labels["infera.amd.com/deployment"] == name
            assert labels["infera.amd.com/component"] in ("server", "worker", "nats", "etcd", "kvd", "epp")
            if labels["infera.amd.com/component"] == "worker":
                assert labels["infera.amd.com/role"] in ("mixed", "prefill", "decode")
            if labels["infera.amd.com/component"] in ("server", "worker"):
                assert labels["infera.amd.com/service"] == obj["metadata"]["name"][len(name) + 1:]
                env = {e["name"]: e for e in main_container(template)["env"]}
                assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
                assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
                assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            if obj["kind"] != "LeaderWorkerSet":  # LWS selects its Pods itself
                assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_no_uid_means_no_owner_references() -> None:
    """Rendered offline (GitOps) a CR has no uid: the objects are the user's, owned by nothing."""
    objects = render(load(EXAMPLES[0]))
    assert objects and all("ownerReferences" not in o["metadata"] for o in objects)


# --------------------------------------------------------------------------------------------- flags
def _pools(objects: list[dict]) -> Iterator[tuple[dict, dict, bool]]:
    """(object, pod template, follower) of every server/worker pool."""
    for obj in objects:
        for i, template in enumerate(pod_templates(obj)):
            if template["metadata"]["labels"]["infera.amd.com/component"] in ("server", "worker"):
                yield obj, template, obj["kind"] == "LeaderWorkerSet" and i == 1


@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_every_rendered_flag_exists(path: str, sim: bool) -> None:
    """The server's args parse with infera.server's parser; a worker's Infera flags are all consumed
    by its launcher's parser (none leaks to the engine), and under --sim what reaches the engine
    parses with the simulated engine's parser."""
    cr = load(path)
    backend = "sim" if sim else cr["spec"].get("backendFramework", "sglang")
    objects = render(cr, RenderOptions(sim=sim))
    for obj in objects:  # the GAIE endpoint picker: infera.gaie's parser and its checks
        if obj["kind"] == "Deployment" and obj["metadata"]["labels"].get("infera.amd.com/component") == "epp":
            epp = main_container(obj["spec"]["template"])
            assert epp["command"] == ["python3", "-m", "infera.gaie"]
            parse_epp_args(epp["args"], {})
    for obj, template, _ in _pools(objects):
        main = main_container(template)
        frontend = containers(template).get("infera-frontend")
        if frontend is not None:  # the GAIE sidecar: the server's parser and its checks
            assert frontend["command"] == ["python3", "-m", "infera.server"]
            parse_server_args(frontend["args"], {})
        if template["metadata"]["labels"]["infera.amd.com/component"] == "server":
            assert main["command"] == ["python3", "-m", "infera.server"]
            build_server_parser({}).parse_args(main["args"])
            continue
        assert main["command"] == ["python3", "-m", f"infera.engine.{backend}"]
        parser = build_launcher_parser(ADAPTERS[backend](), "launcher", environ={})
        _, engine_argv = parser.parse_known_args(main["args"])
        assert not any(tok.startswith(("--discovery-backend", "--etcd-endpoint", "--request-transport",
                                       "--kv-event-transport", "--nats-server", "--drain-timeout"))
                       for tok in engine_argv), engine_argv
        if sim:
            sim_server.parse_args(engine_argv)


def test_sim_flag_lists_are_the_sims() -> None:
    launcher = build_launcher_parser(SimAdapter(), "x", environ={})
    value, boolean = set(), set()
    for action in launcher._actions:
        for opt in action.option_strings:
            if opt not in ("-h", "--help"):
                (boolean if action.nargs == 0 else value).add(opt)
    assert value == SIM_LAUNCHER_VALUE_FLAGS and boolean == SIM_LAUNCHER_BOOL_FLAGS
    engine = {opt for a in sim_server.build_arg_parser()._actions for opt in a.option_strings}
    assert SIM_ENGINE_VALUE_FLAGS <= engine


def _worker_args(objects: list[dict], pool: str) -> list[str]:
    for obj, template, follower in _pools(objects):
        if obj["metadata"]["name"].endswith(f"-{pool}") and not follower:
            return main_container(template)["args"]
    raise KeyError(pool)


def _flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, t in enumerate(args) if t == name] + \
        [t.split("=", 1)[1] for t in args if t.startswith(name + "=")]


def pd_cr(backend: str, **spec: Any) -> dict:
    return {"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment", "metadata": {"name": "f"},
            "spec": {"backendFramework": backend, **spec,
                     "services": {"server": {"componentType": "server"},
                                  "prefill": {"componentType": "worker", "role": "prefill", "args": ["--model", "m"]},
                                  "decode": {"componentType": "worker", "role": "decode", "args": ["--model", "m"]}}}}


@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_vllm_and_sim_pd_never_get_disaggregation_mode(path: str, sim: bool) -> None:
    cr = load(path)
    if not sim and cr["spec"].get("backendFramework", "sglang") == "sglang":
        return
    for _, template, _ in _pools(render(cr, RenderOptions(sim=sim))):
        assert not any(t.startswith("--disaggregation-mode") for t in main_container(template)["args"])


@pytest.mark.parametrize("backend,connector", [("vllm", "NixlConnector"), ("atom", "mooncake"),
                                               ("sim", "NixlConnector")])
def test_pd_role_is_the_kv_transfer_config(backend: str, connector: str) -> None:
    objects = render(pd_cr(backend, discoveryBackend="etcd") if backend == "atom" else pd_cr(backend))
    for pool, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        args = _worker_args(objects, pool)
        assert "--disaggregation-mode" not in args
        (raw,) = _flag(args, "--kv-transfer-config")
        assert json.loads(raw) == {"kv_connector": connector, "kv_role": kv_role}


def test_a_users_kv_transfer_config_keeps_its_connector_and_gets_the_role() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["decode"]["args"] += ["--kv-transfer-config",
                                                 '{"kv_connector":"MoRIIOConnector","kv_role":"kv_both"}']
    args = _worker_args(render(cr), "decode")
    (raw,) = _flag(args, "--kv-transfer-config")
    assert json.loads(raw) == {"kv_connector": "MoRIIOConnector", "kv_role": "kv_consumer"}


def test_sglang_pd_gets_disaggregation_mode_once() -> None:
    cr = pd_cr("sglang")
    cr["spec"]["services"]["decode"]["args"] += ["--disaggregation-mode", "decode"]
    objects = render(cr)
    assert _flag(_worker_args(objects, "prefill"), "--disaggregation-mode") == ["prefill"]
    assert _flag(_worker_args(objects, "decode"), "--disaggregation-mode") == ["decode"]
    assert "--kv-transfer-config" not in _worker_args(objects, "prefill")


@pytest.mark.parametrize("backend", ["vllm", "sglang", "sim"])
def test_etcd_discovery_is_deployed_and_wired(backend: str) -> None:
    cr = pd_cr(backend, discoveryBackend="etcd")
    cr["metadata"]["namespace"] = "ml"
    objects = by_kind_name(render(cr))
    assert ("StatefulSet", "f-etcd") in objects and ("Service", "f-etcd") in objects
    assert ("StatefulSet", "f-nats") not in objects  # no broker: HTTP requests, ZMQ events
    etcd = main_container(objects[("StatefulSet", "f-etcd")]["spec"]["template"])
    assert etcd["command"] == ["etcd"]
    assert _flag(etcd["args"], "--advertise-client-urls") == ["http://f-etcd.ml.svc:2379"]
    assert _flag(etcd["args"], "--data-dir") == ["/var/lib/etcd"]
    assert objects[("StatefulSet", "f-etcd")]["spec"]["volumeClaimTemplates"][0]["spec"]["resources"] == \
        {"requests": {"storage": "1Gi"}}
    for name in ("f-server", "f-prefill", "f-decode"):
        args = main_container(objects[("Deployment", name)]["spec"]["template"])["args"]
        assert _flag(args, "--discovery-backend") == ["etcd"]
        assert _flag(args, "--etcd-endpoint") == ["http://f-etcd.ml.svc:2379"]
        assert _flag(args, "--request-transport") == ["http"] and _flag(args, "--kv-event-transport") == ["zmq"]
        assert "--k8s-label-selector" not in args
    role = objects[("Role", "f-infera")]
    assert role["rules"][0]["verbs"] == ["get", "list", "watch"]  # nobody patches Pods on etcd


def test_an_external_etcd_is_used_not_deployed() -> None:
    objects = by_kind_name(render(pd_cr("vllm", discoveryBackend="etcd", etcdEndpoint="https://etcd.example:2379")))
    assert ("StatefulSet", "f-etcd") not in objects
    args = main_container(objects[("Deployment", "f-prefill")]["spec"]["template"])["args"]
    assert _flag(args, "--etcd-endpoint") == ["https://etcd.example:2379"]


def test_kubernetes_discovery_and_nats_flags() -> None:
    cr = pd_cr("vllm")
    cr["metadata"]["namespace"] = "ml"
    objects = by_kind_name(render(cr))
    server = main_container(objects[("Deployment", "f-server")]["spec"]["template"])
    selector = "infera.amd.com/deployment=f,infera.amd.com/component=worker"
    assert _flag(server["args"], "--k8s-label-selector") == [selector]
    assert {"name": "INFERA_K8S_LABEL_SELECTOR", "value": selector} in server["env"]
    for name in ("f-server", "f-prefill"):
        args = main_container(objects[("Deployment", name)]["spec"]["template"])["args"]
        assert _flag(args, "--discovery-backend") == ["kubernetes"]
        assert _flag(args, "--request-transport") == ["nats"] and _flag(args, "--kv-event-transport") == ["nats"]
        assert _flag(args, "--nats-server") == ["nats://f-nats.ml.svc:4222"]
    nats = objects[("StatefulSet", "f-nats")]
    container = main_container(nats["spec"]["template"])
    assert container["args"] == ["-js", "-sd", "/data/jetstream", "-m", "8222"]
    assert [p["containerPort"] for p in container["ports"]] == [4222, 8222]
    assert [p["port"] for p in objects[("Service", "f-nats")]["spec"]["ports"]] == [4222, 8222]
    assert nats["spec"]["persistentVolumeClaimRetentionPolicy"]["whenDeleted"] == "Delete"
    assert objects[("Role", "f-infera")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": ["infera.amd.com"], "resources": ["inferadeployments"], "resourceNames": ["f"],
         "verbs": ["get", "patch"]}]
    binding = objects[("RoleBinding", "f-infera")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "f-infera", "namespace": "ml"}]
    for name in ("f-server", "f-prefill", "f-decode"):
        assert objects[("Deployment", name)]["spec"]["template"]["spec"]["serviceAccountName"] == "f-infera"


def test_nats_storage_and_no_nats() -> None:
    cr = pd_cr("vllm", nats={"storageSize": "20Gi", "storageClassName": "fast", "image": "nats:2.11"})
    nats = by_kind_name(render(cr))[("StatefulSet", "f-nats")]
    claim = nats["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["resources"]["requests"]["storage"] == "20Gi" and claim["storageClassName"] == "fast"
    assert main_container(nats["spec"]["template"])["image"] == "nats:2.11"
    objects = by_kind_name(render(pd_cr("vllm", nats={"deploy": False})))
    assert ("StatefulSet", "f-nats") not in objects and ("Service", "f-nats") not in objects
    args = main_container(objects[("Deployment", "f-prefill")]["spec"]["template"])["args"]
    assert _flag(args, "--request-transport") == ["http"] and "--nats-server" not in args


def test_an_external_nats_is_used_not_deployed() -> None:
    cr = pd_cr("vllm", nats={"deploy": False},
               envs=[{"name": "NATS_SERVER", "valueFrom": {"secretKeyRef": {"name": "nats", "key": "url"}}}])
    objects = by_kind_name(render(cr))
    assert ("StatefulSet", "f-nats") not in objects
    for name in ("f-server", "f-prefill"):
        main = main_container(objects[("Deployment", name)]["spec"]["template"])
        assert _flag(main["args"], "--request-transport") == ["nats"] and "--nats-server" not in main["args"]
        assert any(e["name"] == "NATS_SERVER" for e in main["env"])


def test_a_bad_drain_env_names_the_pool() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["decode"]["env"] = [{"name": "INFERA_DRAIN_TIMEOUT", "value": "soon"}]
    with pytest.raises(SpecError, match=r"^spec.services.decode: --drain-timeout / INFERA_DRAIN_TIMEOUT: not a number"):
        render(cr)


def test_user_args_come_last() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["prefill"]["args"] = ["--model", "m", "--request-transport", "http"]
    args = _worker_args(render(cr), "prefill")
    assert args[-4:] == ["--model", "m", "--request-transport", "http"]


# --------------------------------------------------------------------------------------------- drain budget
@pytest.mark.parametrize("args,pool_env,spec_envs,drain_field,pre_stop,expected", [
    ([], [], [], None, 15, 120),  # default drain 30: 15 + 30 + 50 = 95 -> raised to 120
    (["--drain-timeout", "100"], [], [], None, 15, 165),
    (["--drain-timeout=100"], [], [], None, 15, 165),
    (["--drain-timeout", "10", "--drain-timeout", "200"], [], [], None, 15, 265),  # the last one wins
    (["--drain-timeout", "55.5"], [], [], None, 15, 121),  # rounded up
    ([], [{"name": "INFERA_DRAIN_TIMEOUT", "value": "90"}], [], None, 15, 155),
    ([], [], [{"name": "INFERA_DRAIN_TIMEOUT", "value": "80"}], None, 15, 145),
    ([], [{"name": "INFERA_DRAIN_TIMEOUT", "value": "90"}], [{"name": "INFERA_DRAIN_TIMEOUT", "value": "80"}],
     None, 15, 155),  # the pool's env wins
    ([], [], [], 300, 15, 365),  # spec.drain.drainTimeoutSeconds
    (["--drain-timeout", "100"], [], [], 300, 15, 165),  # the pool's flag wins (it comes last)
    ([], [{"name": "INFERA_DRAIN_TIMEOUT", "value": "90"}], [], 300, 15, 365),  # the rendered flag beats env
    ([], [], [], 10, 2, 120),  # only ever raised
    (["--drain-timeout", "0"], [], [], None, 0, 120),
    ([], [], [], None, 100, 180),
])
def test_grace_period(args: list[str], pool_env: list, spec_envs: list, drain_field: int | None, pre_stop: int,
                      expected: int) -> None:
    drain: dict[str, int] = {"preStopSeconds": pre_stop}
    if drain_field is not None:
        drain["drainTimeoutSeconds"] = drain_field
    cr = {"apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment", "metadata": {"name": "g"},
          "spec": {"backendFramework": "vllm", "drain": drain, "envs": spec_envs,
                   "services": {"server": {"componentType": "server"},
                                "w": {"componentType": "worker", "args": ["--model", "m", *args], "env": pool_env}}}}
    template = by_kind_name(render(cr))[("Deployment", "g-w")]["spec"]["template"]
    assert template["spec"]["terminationGracePeriodSeconds"] == expected
    main = main_container(template)
    if pre_stop:
        assert main["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    else:
        assert "lifecycle" not in main


def test_grace_formula_and_bad_drain() -> None:
    assert grace_period_seconds(15, 30) == 120 and grace_period_seconds(15, 60) == 125
    assert drain_seconds(["--drain-timeout=7"]) == 7
    with pytest.raises(SpecError, match="not a number"):
        drain_seconds([], ({"name": "INFERA_DRAIN_TIMEOUT", "value": "soon"},))


# --------------------------------------------------------------------------------------------- pools
@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_service_port_is_the_container_port(path: str, sim: bool) -> None:
    objects = by_kind_name(render(load(path), RenderOptions(sim=sim)))
    services = [o for (kind, _), o in objects.items() if kind == "Service"]
    assert services
    for svc in services:
        (workload,) = [o for (kind, name), o in objects.items()
                       if name == svc["metadata"]["name"] and kind in ("Deployment", "StatefulSet")]
        container = main_container(workload["spec"]["template"])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in svc["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"]  # port-forward svc/<x> P:P just works
        assert svc["spec"]["selector"].items() <= workload["spec"]["template"]["metadata"]["labels"].items()


def test_server_pool_custom_port_spread_and_pdb() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["server"]["port"] = 9000
    objects = by_kind_name(render(cr))
    dep = objects[("Deployment", "f-server")]
    assert dep["spec"]["replicas"] == 2
    main = main_container(dep["spec"]["template"])
    assert main["ports"][0]["containerPort"] == 9000 and _flag(main["args"], "--port") == ["9000"]
    assert objects[("Service", "f-server")]["spec"]["ports"][0]["port"] == 9000
    (spread,) = dep["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname" and spread["whenUnsatisfiable"] == "ScheduleAnyway"
    pdb = objects[("PodDisruptionBudget", "f-server")]
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


def test_probes_cover_a_long_cold_start() -> None:
    objects = by_kind_name(render(pd_cr("vllm")))
    for name in ("f-server", "f-prefill"):
        main = main_container(objects[("Deployment", name)]["spec"]["template"])
        startup = main["startupProbe"]
        assert startup["httpGet"] == {"path": "/health", "port": "http"}
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
        assert main["readinessProbe"]["httpGet"]["path"] == "/health"
        assert main["livenessProbe"]["httpGet"]["path"] == "/health"


def test_skip_readiness_probe() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["decode"]["skipReadinessProbe"] = True
    objects = by_kind_name(render(cr))
    main = main_container(objects[("Deployment", "f-decode")]["spec"]["template"])
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(main)
    assert "readinessProbe" in main_container(objects[("Deployment", "f-prefill")]["spec"]["template"])


def test_resources_shared_memory_gpu_and_sim() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["prefill"]["resources"] = {"gpu": 8, "cpu": "16", "memory": "256Gi",
                                                      "sharedMemory": "64Gi"}
    cr["spec"]["services"]["decode"]["resources"] = {"gpu": 1, "gpuType": "nvidia.com/gpu"}
    for sim in (False, True):
        objects = by_kind_name(render(cr, RenderOptions(sim=sim)))
        template = objects[("Deployment", "f-prefill")]["spec"]["template"]
        main = main_container(template)
        limits = {"memory": "256Gi"} if sim else {"memory": "256Gi", "amd.com/gpu": 8}
        assert main["resources"] == {"requests": {"cpu": "16", "memory": "256Gi"}, "limits": limits}
        assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in template["spec"]["volumes"]
        assert {"name": "shm", "mountPath": "/dev/shm"} in main["volumeMounts"]
        decode = main_container(objects[("Deployment", "f-decode")]["spec"]["template"])
        assert decode.get("resources", {}) == ({} if sim else {"limits": {"nvidia.com/gpu": 1}})


def test_extra_pod_spec_is_merged() -> None:
    cr = load(os.path.join(ROOT, "tests", "fixtures", "operator", "upstream", "sglang-mixed.yaml"))
    cr["spec"]["services"]["worker"]["extraPodSpec"]["containers"] += [
        {"name": "main", "resources": {"limits": {"cpu": "1"}}, "env": [{"name": "EXTRA", "value": "1"}]},
        {"name": "sidecar", "image": "busybox", "command": ["sleep", "infinity"]}]
    template = by_kind_name(render(cr))[("Deployment", "qwen-worker")]["spec"]["template"]
    spec = template["spec"]
    assert spec["nodeSelector"] == {"amd.com/gpu.product-name": "AMD_Instinct_MI300X"}
    assert spec["tolerations"][0]["key"] == "amd.com/gpu"
    assert {v["name"] for v in spec["volumes"]} == {"models", "shm"}
    main = main_container(template)
    assert {"name": "models", "mountPath": "/models"} in main["volumeMounts"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in main["volumeMounts"]
    assert main["resources"]["limits"] == {"memory": "128Gi", "amd.com/gpu": 1}  # extraPodSpec resources ignored
    assert {"name": "EXTRA", "value": "1"} in main["env"] and main["env"][0]["name"] == "POD_NAME"
    assert [c["name"] for c in spec["containers"]] == ["main", "sidecar"]
    assert template["metadata"]["labels"]["team"] == "inference"  # podLabels


def test_extra_pod_spec_template_form_and_infera_container_name() -> None:
    cr = pd_cr("sglang")
    cr["spec"]["services"]["decode"]["extraPodSpec"] = {
        "metadata": {"annotations": {"a": "b"}, "labels": {"infera.amd.com/role": "hijack", "x": "y"}},
        "spec": {"hostIPC": True, "containers": [{"name": "infera", "securityContext": {"privileged": True}}]}}
    template = by_kind_name(render(cr))[("Deployment", "f-decode")]["spec"]["template"]
    assert template["metadata"]["annotations"] == {"a": "b"}
    assert template["metadata"]["labels"]["x"] == "y"
    assert template["metadata"]["labels"]["infera.amd.com/role"] == "decode"  # ours win
    assert template["spec"]["hostIPC"] is True
    assert main_container(template)["securityContext"] == {"privileged": True}
    assert len(template["spec"]["containers"]) == 1


def test_env_merge_order() -> None:
    cr = pd_cr("vllm", envs=[{"name": "A", "value": "spec"}, {"name": "B", "value": "spec"}])
    cr["spec"]["services"]["prefill"]["env"] = [{"name": "B", "value": "pool"}]
    env = main_container(by_kind_name(render(cr))[("Deployment", "f-prefill")]["spec"]["template"])["env"]
    assert [e["name"] for e in env] == ["POD_NAME", "POD_NAMESPACE", "POD_IP", "A", "B"]
    assert env[3]["value"] == "spec" and env[4]["value"] == "pool"


def test_images() -> None:
    cr = pd_cr("vllm")
    objects = by_kind_name(render(cr))
    assert main_container(objects[("Deployment", "f-server")]["spec"]["template"])["image"] == RenderOptions().infera_image
    assert main_container(objects[("Deployment", "f-prefill")]["spec"]["template"])["image"] == RenderOptions().vllm_image
    cr["spec"]["image"] = "reg/all:1"
    cr["spec"]["services"]["decode"]["image"] = "reg/decode:2"
    objects = by_kind_name(render(cr, RenderOptions(sim=True, infera_image="reg/infera:3")))
    assert main_container(objects[("Deployment", "f-server")]["spec"]["template"])["image"] == "reg/all:1"
    assert main_container(objects[("Deployment", "f-decode")]["spec"]["template"])["image"] == "reg/infera:3"
    objects = by_kind_name(render(cr))
    assert main_container(objects[("Deployment", "f-decode")]["spec"]["template"])["image"] == "reg/decode:2"
    assert main_container(objects[("Deployment", "f-prefill")]["spec"]["template"])["image"] == "reg/all:1"


# --------------------------------------------------------------------------------------------- multi-node
@pytest.mark.parametrize("backend", ["sglang", "vllm"])
def test_multinode_renders_a_leader_worker_set(backend: str) -> None:
    cr = pd_cr(backend)
    cr["spec"]["services"]["decode"].update(numberOfNodes=2, replicas=3)
    objects = by_kind_name(render(cr))
    assert ("Deployment", "f-decode") not in objects
    lws = objects[("LeaderWorkerSet", "f-decode")]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    lwt = lws["spec"]["leaderWorkerTemplate"]
    assert lwt["size"] == 2
    leader, follower = main_container(lwt["leaderTemplate"]), main_container(lwt["workerTemplate"])
    assert "readinessProbe" in leader and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(follower)
    assert _flag(leader["args"], "--node-rank") == ["$(LWS_WORKER_INDEX)"]
    assert _flag(leader["args"], "--nnodes") == ["2"]
    if backend == "sglang":
        assert _flag(leader["args"], "--dist-init-addr") == ["$(LWS_LEADER_ADDRESS):20000"]
        assert leader["args"] == follower["args"]
    else:
        assert _flag(leader["args"], "--master-addr") == ["$(LWS_LEADER_ADDRESS)"]
        assert _flag(leader["args"], "--distributed-executor-backend") == ["mp"]
        assert "--headless" in follower["args"] and "--headless" not in leader["args"]
    for template in (lwt["leaderTemplate"], lwt["workerTemplate"]):
        assert template["metadata"]["labels"]["infera.amd.com/role"] == "decode"


def test_multinode_flags_the_user_gave_are_kept() -> None:
    cr = pd_cr("sglang")
    cr["spec"]["services"]["decode"].update(numberOfNodes=2, args=["--model", "m", "--dist-init-addr", "x:1"])
    lwt = by_kind_name(render(cr))[("LeaderWorkerSet", "f-decode")]["spec"]["leaderWorkerTemplate"]
    assert _flag(main_container(lwt["leaderTemplate"])["args"], "--dist-init-addr") == ["x:1"]


# --------------------------------------------------------------------------------------------- kvd, dashboard
def test_kvd_daemonset_shares_its_socket() -> None:
    cr = pd_cr("vllm", kvd={"enabled": True, "args": ["--max-bytes", "64G"], "socketDir": "/run/kvd"})
    objects = by_kind_name(render(cr))
    ds = objects[("DaemonSet", "f-kvd")]
    main = main_container(ds["spec"]["template"])
    assert main["command"] == ["python3", "-m", "infera.kvd"]
    assert main["args"] == ["--socket", "/run/kvd/kvd.sock", "--max-bytes", "64G"]
    assert ds["spec"]["template"]["spec"]["volumes"][0]["hostPath"] == {"path": "/run/kvd", "type": "DirectoryOrCreate"}
    prefill = objects[("Deployment", "f-prefill")]["spec"]["template"]
    assert _flag(main_container(prefill)["args"], "--kvd-socket") == ["/run/kvd/kvd.sock"]
    assert {"name": "kvd-socket", "mountPath": "/run/kvd"} in main_container(prefill)["volumeMounts"]
    assert "--kvd-socket" not in main_container(objects[("Deployment", "f-decode")]["spec"]["template"])["args"]
    cr["spec"]["backendFramework"] = "sglang"
    args = main_container(by_kind_name(render(cr))[("Deployment", "f-prefill")]["spec"]["template"])["args"]
    assert _flag(args, "--infera-kvd-socket") == ["/run/kvd/kvd.sock"]


def test_dashboard_configmap_is_the_repositorys() -> None:
    with open(os.path.join(ROOT, "deploy", "grafana", "infera.json"), encoding="utf-8") as f:
        repo = f.read()
    assert grafana_dashboard_json() == repo, "copy deploy/grafana/infera.json to infera/operator/grafana_dashboard.json"
    cm = by_kind_name(render(pd_cr("vllm")))[("ConfigMap", "f-grafana-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["infera.json"]) == json.loads(repo)


# --------------------------------------------------------------------------------------------- sim mode
def test_sim_mode_runs_the_sim_with_the_users_model() -> None:
    cr = load(os.path.join(ROOT, "deploy", "examples", "sglang-pd-dp-attention.yaml"))
    objects = by_kind_name(render(cr, RenderOptions(sim=True)))
    decode = main_container(objects[("Deployment", "dsr1-decode")]["spec"]["template"])
    assert decode["command"] == ["python3", "-m", "infera.engine.sim"]
    assert decode["image"] == RenderOptions().infera_image
    assert _flag(decode["args"], "--model") == ["deepseek-ai/DeepSeek-R1"]
    assert _flag(decode["args"], "--block-size") == ["64"]  # SGLang's --page-size
    assert "--tp-size" not in decode["args"] and "--enable-dp-attention" not in decode["args"]
    assert json.loads(_flag(decode["args"], "--kv-transfer-config")[0])["kv_role"] == "kv_consumer"
    # the rest unchanged: the same objects as without --sim
    assert set(objects) == set(by_kind_name(render(cr)))


def test_sim_mode_needs_a_model() -> None:
    cr = pd_cr("vllm")
    cr["spec"]["services"]["prefill"]["args"] = ["--tensor-parallel-size", "8"]
    render(cr)
    with pytest.raises(SpecError, match=r"^spec.services.prefill.args: the sim needs the model"):
        render(cr, RenderOptions(sim=True))


# --------------------------------------------------------------------------------------------- namespace, CLI
def test_namespace_resolution() -> None:
    cr = pd_cr("vllm")
    assert {o["metadata"]["namespace"] for o in render(cr)} == {"default"}
    assert {o["metadata"]["namespace"] for o in render(cr, RenderOptions(namespace="ml"))} == {"ml"}
    cr["metadata"]["namespace"] = "a"
    with pytest.raises(SpecError, match="^metadata.namespace"):
        render(cr, RenderOptions(namespace="b"))


def test_cli_render(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    path = os.path.join(ROOT, "deploy", "examples", "vllm-pd-nixl.yaml")
    assert cli.main(["render", "-f", path, "--sim"]) == 0
    assert list(yaml.safe_load_all(capsys.readouterr().out)) == render(load(path), RenderOptions(sim=True))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(pd_cr("vllm") | {"spec": {"services": {"s": {"componentType": "server",
                                                                                  "replicas": -1}}}}))
    assert cli.main(["render", "-f", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err == "render: spec.services.s.replicas: must be >= 0\n"
    assert cli.main(["render", "-f", str(tmp_path / "missing.yaml")]) == 2
    assert capsys.readouterr().err.startswith("render: ")
    two = tmp_path / "two.yaml"
    two.write_text("a: 1\n---\nb: 2\n")
    assert cli.main(["render", "-f", str(two)]) == 2
    assert "expected one InferaDeployment document, found 2" in capsys.readouterr().err
    plain = tmp_path / "ns.yaml"
    plain.write_text(yaml.safe_dump(pd_cr("vllm")))
    assert cli.main(["render", "-f", str(plain), "-n", "team"]) == 0
    assert {d["metadata"]["namespace"] for d in yaml.safe_load_all(capsys.readouterr().out)} == {"team"}


def test_cli_run_dispatches_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    seen: list[list[str]] = []
    fake = types.ModuleType("infera.operator.controller")
    fake.main = lambda argv: seen.append(list(argv)) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "infera.operator.controller", fake)
    import infera.operator

    monkeypatch.setattr(infera.operator, "controller", fake, raising=False)
    assert cli.main(["run", "--sim-engines", "--namespace", "x"]) == 0
    assert seen == [["--sim-engines", "--namespace", "x"]]
    assert cli.main(["nonsense"]) == 2


# --------------------------------------------------------------------------------------------- GAIE
GAIE_EXAMPLE = os.path.join(ROOT, "deploy", "examples", "gaie-vllm.yaml")
GAIE_ON = {"enabled": True, "tokenizerPath": "/models/tok", "gatewayName": "gw"}


def containers(template: dict) -> dict[str, dict]:
    return {c["name"]: c for c in template["spec"]["containers"]}


def test_the_gaie_schemas_are_strict() -> None:
    """The validator refuses what a real API server (strict field validation) would: the pre-GA
    InferencePool field, an unknown HTTPRoute field, a targetPort out of range."""
    pool = by_kind_name(render(load(GAIE_EXAMPLE)))[("InferencePool", "gaie-pool")]
    route = by_kind_name(render(load(GAIE_EXAMPLE)))[("HTTPRoute", "gaie-route")]
    validate_crd_kind(pool)
    validate_crd_kind(route)
    for bad in (_with(pool, ["spec", "targetPortNumber"], 8000), _with(pool, ["spec", "targetPorts"], [{"number": 0}]),
                _with(pool, ["spec", "endpointPickerRef", "failureMode"], "FailSometimes"),
                _with(route, ["spec", "rules", 0, "timeout"], "0s"),
                _with(route, ["spec", "rules", 0, "timeouts", "request"], "forever")):
        with pytest.raises(jsonschema.ValidationError):
            validate_crd_kind(bad)


def _with(obj: dict, path: list, value: Any) -> dict:
    obj = copy.deepcopy(obj)
    node = obj
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return obj


def test_gaie_objects_are_wired_to_each_other() -> None:
    """EPP Deployment/Service, InferencePool and HTTPRoute name each other; the pool selects exactly
    the Pods that run the sidecar, on the sidecar's port, which is the EPP's destination port."""
    cr = with_uid(load(GAIE_EXAMPLE))
    objects = render(cr)
    by = by_kind_name(objects)
    epp = by[("Deployment", "gaie-epp")]
    epp_svc = by[("Service", "gaie-epp")]
    pool = by[("InferencePool", "gaie-pool")]
    route = by[("HTTPRoute", "gaie-route")]
    main = main_container(epp["spec"]["template"])
    assert main["command"] == ["python3", "-m", "infera.gaie"]
    assert main["image"] == RenderOptions().infera_image
    assert epp["spec"]["template"]["spec"]["serviceAccountName"] == "gaie-infera"  # Pods get/list/watch
    for probe in ("readinessProbe", "livenessProbe"):
        assert main[probe]["grpc"] == {"port": 9003, "service": "inference-extension"}
    assert _flag(main["args"], "--grpc-port") == ["9002"] and _flag(main["args"], "--grpc-health-port") == ["9003"]
    assert _flag(main["args"], "--router-tokenizer-path") == ["meta-llama/Llama-3.1-8B-Instruct"]
    assert {(p["name"], p["port"]) for p in epp_svc["spec"]["ports"]} == {("grpc", 9002), ("grpc-health", 9003)}
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    ref = pool["spec"]["endpointPickerRef"]
    assert (ref["kind"], ref["name"], ref["port"]["number"], ref["failureMode"]) == ("Service", "gaie-epp", 9002,
                                                                                     "FailClose")
    (target,) = pool["spec"]["targetPorts"]
    assert _flag(main["args"], "--destination-port") == [str(target["number"])]
    selector = pool["spec"]["selector"]["matchLabels"]
    selected = [(obj["metadata"]["name"], template) for obj in objects for template in pod_templates(obj)
                if selector.items() <= template["metadata"]["labels"].items()]
    assert sorted(n for n, _ in selected) == ["gaie-decode", "gaie-prefill"]
    for _, template in selected:
        frontend = containers(template)["infera-frontend"]
        assert frontend["ports"] == [{"name": "frontend", "containerPort": target["number"], "protocol": "TCP"}]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "gaie-pool"}]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert duration_s(rule["timeouts"]["request"]) == 0  # no gateway timeout on a long stream
    assert route["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway",
                                            "name": "inference-gateway", "namespace": "gateway-system"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]


@pytest.mark.parametrize("path,sim", CASES, ids=CASE_IDS)
def test_the_sidecar_is_there_only_with_gaie(path: str, sim: bool) -> None:
    cr = load(path)
    gaie = bool((cr["spec"].get("gaie") or {}).get("enabled"))
    objects = render(cr, RenderOptions(sim=sim))
    kinds = {o["kind"] for o in objects}
    assert ({"InferencePool", "HTTPRoute"} <= kinds) == gaie
    assert (("Deployment", f"{cr['metadata']['name']}-epp") in by_kind_name(objects)) == gaie
    for obj, template, follower in _pools(objects):
        worker = template["metadata"]["labels"]["infera.amd.com/component"] == "worker"
        has_sidecar = "infera-frontend" in containers(template)
        assert has_sidecar == (gaie and worker and not follower), obj["metadata"]["name"]
        assert ("infera.amd.com/gaie-frontend" in template["metadata"]["labels"]) == has_sidecar


def test_the_sidecar_routes_as_the_epp_says_over_the_fleets_plane() -> None:
    objects = render(load(GAIE_EXAMPLE))
    by = by_kind_name(objects)
    template = by[("Deployment", "gaie-decode")]["spec"]["template"]
    frontend = containers(template)["infera-frontend"]
    args = frontend["args"]
    assert frontend["command"] == ["python3", "-m", "infera.server"]
    assert frontend["image"] == RenderOptions().infera_image  # the server's image, not vLLM's
    assert _flag(args, "--router-mode") == ["direct"] and _flag(args, "--port") == ["8000"]
    assert _flag(args, "--request-transport") == ["nats"]
    assert _flag(args, "--nats-server") == ["nats://gaie-nats.infera.svc:4222"]
    assert _flag(args, "--k8s-label-selector") == ["infera.amd.com/deployment=gaie,infera.amd.com/component=worker"]
    assert frontend["readinessProbe"]["httpGet"] == {"path": "/health", "port": "frontend"}
    # it outlives the worker's preStop and drain, inside the grace period
    stay = int(frontend["lifecycle"]["preStop"]["exec"]["command"][1])
    main_stay = int(main_container(template)["lifecycle"]["preStop"]["exec"]["command"][1])
    assert stay == main_stay + DEFAULT_DRAIN
    assert stay < template["spec"]["terminationGracePeriodSeconds"]
    epp_args = main_container(by[("Deployment", "gaie-epp")]["spec"]["template"])["args"]
    assert _flag(epp_args, "--kv-event-transport") == ["nats"]
    assert _flag(epp_args, "--nats-server") == ["nats://gaie-nats.infera.svc:4222"]
    assert _flag(epp_args, "--k8s-label-selector") == _flag(args, "--k8s-label-selector")
    epp = parse_epp_args(epp_args, {})
    assert (epp.grpc_port, epp.grpc_health_port, epp.destination_port, epp.secure_serving) == (9002, 9003, 8000, True)
    assert epp.replica_sync == "nats"  # EPP replicas share in-flight state, as server replicas do


DEFAULT_DRAIN = 30


def test_gaie_without_nats_is_http_and_zmq() -> None:
    cr = pd_cr("vllm", nats={"deploy": False}, gaie=GAIE_ON)
    by = by_kind_name(render(cr))
    frontend = containers(by[("Deployment", "f-decode")]["spec"]["template"])["infera-frontend"]
    assert _flag(frontend["args"], "--request-transport") == ["http"]
    assert not _flag(frontend["args"], "--nats-server")
    epp_args = main_container(by[("Deployment", "f-epp")]["spec"]["template"])["args"]
    assert _flag(epp_args, "--kv-event-transport") == ["zmq"] and not _flag(epp_args, "--nats-server")
    assert _flag(epp_args, "--request-transport") == ["http"]  # in a Pod the default would be NATS
    assert parse_epp_args(epp_args, {}).replica_sync == "off"
    parse_server_args(frontend["args"], {})


def test_gaie_with_etcd_discovery() -> None:
    cr = pd_cr("vllm", discoveryBackend="etcd", gaie=GAIE_ON)
    by = by_kind_name(render(cr))
    for args in (containers(by[("Deployment", "f-prefill")]["spec"]["template"])["infera-frontend"]["args"],
                 main_container(by[("Deployment", "f-epp")]["spec"]["template"])["args"]):
        assert _flag(args, "--discovery-backend") == ["etcd"]
        assert _flag(args, "--etcd-endpoint") == ["http://f-etcd.default.svc:2379"]
        assert not _flag(args, "--k8s-label-selector")
    parse_epp_args(main_container(by[("Deployment", "f-epp")]["spec"]["template"])["args"], {})


def test_gaie_options_images_port_replicas_and_a_multinode_pool() -> None:
    cr = pd_cr("vllm", image="registry/infera-vllm:1",
               gaie={**GAIE_ON, "eppImage": "registry/epp:2", "frontendPort": 8100, "eppReplicas": 3})
    cr["spec"]["services"]["decode"]["numberOfNodes"] = 2
    cr["spec"]["services"]["server"]["image"] = "registry/infera:3"
    objects = render(with_uid(cr))
    by = by_kind_name(objects)
    epp = by[("Deployment", "f-epp")]
    assert epp["spec"]["replicas"] == 3
    assert main_container(epp["spec"]["template"])["image"] == "registry/epp:2"
    assert _flag(main_container(epp["spec"]["template"])["args"], "--destination-port") == ["8100"]
    assert by[("InferencePool", "f-pool")]["spec"]["targetPorts"] == [{"number": 8100}]
    assert "namespace" not in by[("HTTPRoute", "f-route")]["spec"]["parentRefs"][0]  # the route's own
    assert "hostnames" not in by[("HTTPRoute", "f-route")]["spec"]
    lws = by[("LeaderWorkerSet", "f-decode")]["spec"]["leaderWorkerTemplate"]
    leader = containers(lws["leaderTemplate"])
    assert leader["infera-frontend"]["image"] == "registry/infera:3"
    assert leader["infera-frontend"]["ports"][0]["containerPort"] == 8100
    assert "infera-frontend" not in containers(lws["workerTemplate"])  # followers serve nothing
    for obj in objects:
        if obj["kind"] in KINDS_UNKNOWN_TO_KUBERNETES_VALIDATE:
            validate_crd_kind(obj)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_gaie_spec_errors_reach_render() -> None:
    with pytest.raises(SpecError, match=r"^spec\.gaie\.tokenizerPath: required"):
        render(pd_cr("vllm", gaie={"enabled": True, "gatewayName": "gw"}))
    with pytest.raises(SpecError, match=r"^spec\.gaie\.gatewayName: required"):
        render(pd_cr("vllm", gaie={"enabled": True, "tokenizerPath": "t"}))


def test_the_epp_outlasts_the_streams_it_carries() -> None:
    """Full-duplex ext_proc streams last as long as the response: a stopping picker leaves the
    Service first (preStop) and may take as long as the slowest worker pool's grace period."""
    cr = pd_cr("vllm", gaie=GAIE_ON, drain={"preStopSeconds": 7})
    cr["spec"]["services"]["decode"]["args"] += ["--drain-timeout", "400"]
    by = by_kind_name(render(cr))
    epp = by[("Deployment", "f-epp")]["spec"]["template"]
    graces = [by[("Deployment", f"f-{pool}")]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
              for pool in ("prefill", "decode")]
    assert graces == [120, 7 + 400 + 50]
    assert epp["spec"]["terminationGracePeriodSeconds"] == max(graces)
    assert main_container(epp)["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
