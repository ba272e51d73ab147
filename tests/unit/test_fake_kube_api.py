"""The fake Kubernetes API server's pieces, in-process: schema validation, patches, optimistic
concurrency, garbage collection, finalizers, graceful Pod deletion, Service cluster IPs, CRDs."""
from __future__ import annotations

import copy
import datetime
import ipaddress
from typing import Any

import pytest
import yaml

from tests.fakes.kube_api import (
    APPLY_PATCH,
    GENERIC_FIELDS,
    JSON_PATCH,
    MERGE_PATCH,
    STRATEGIC_PATCH,
    FakeKubeApi,
    FieldSelectorError,
    KubeError,
    apply_merge,
    apply_schema,
    human_age,
    jsonpath_value,
    parse_field_selector,
    strategic_merge_patch,
)

FIXTURES = "tests/fixtures/kube/app"

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "spec": {
            "type": "object",
            "required": ["size"],
            "properties": {
                "size": {"type": "string", "enum": ["small", "large"]},
                "replicas": {"type": "integer", "minimum": 0, "maximum": 10, "default": 1},
                "name": {"type": "string", "pattern": "^[a-z]+$"},
                "port": {"x-kubernetes-int-or-string": True},
                "note": {"type": "string", "nullable": True},
                "extra": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                "pools": {"type": "array", "maxItems": 2,
                          "items": {"type": "object", "properties": {"role": {"type": "string", "default": "mixed"}}}},
                "services": {"type": "object", "additionalProperties": {
                    "type": "object", "properties": {"replicas": {"type": "integer"}}}},
                "drain": {"type": "object", "default": {},
                          "properties": {"preStopSeconds": {"type": "integer", "default": 15}}},
            },
        },
        "status": {"type": "object", "properties": {"phase": {"type": "string"}}},
    },
}


def widget(spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "example.infera.dev/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": spec}


@pytest.mark.parametrize("spec, message", [
    ({"size": 3}, 'spec.size: Invalid value: "integer": spec.size in body must be of type string: "integer"'),
    ({"size": "huge"}, 'spec.size: Unsupported value: "huge": supported values: "small", "large"'),
    ({}, "spec.size: Required value"),
    ({"size": "small", "replicas": -1}, "spec.replicas: Invalid value: -1: spec.replicas in body should be greater "
                                        "than or equal to 0"),
    ({"size": "small", "replicas": 11}, "spec.replicas: Invalid value: 11: spec.replicas in body should be less than "
                                        "or equal to 10"),
    ({"size": "small", "replicas": True}, 'spec.replicas: Invalid value: "boolean": spec.replicas in body must be of '
                                          'type integer: "boolean"'),
    ({"size": "small", "name": "Ab"}, "spec.name: Invalid value: \"Ab\": spec.name in body should match '^[a-z]+$'"),
    ({"size": "small", "port": [1]}, 'spec.port: Invalid value: "array": spec.port in body must be of type '
                                     'integer-or-string: "array"'),
    ({"size": "small", "pools": [{}, {}, {}]}, "spec.pools: Too many: 3: must have at most 2 items"),
    ({"size": "small", "services": {"api": {"replicas": "2"}}},
     'spec.services.api.replicas: Invalid value: "string": spec.services.api.replicas in body must be of type '
     'integer: "string"'),
    ({"size": "small", "pools": [None]}, 'spec.pools[0]: Invalid value: "null": spec.pools[0] in body must be of '
                                         'type object: "null"'),
])
def test_schema_errors_name_the_field(spec: dict[str, Any], message: str) -> None:
    result = apply_schema(widget(spec), SCHEMA)
    assert [e.message for e in result.errors] == [message]


def test_schema_accepts_int_or_string_nullable_and_applies_nested_defaults() -> None:
    result = apply_schema(widget({"size": "small", "port": "http", "note": None, "pools": [{}]}), SCHEMA)
    assert result.errors == [] and result.unknown == []
    assert result.value["spec"] == {"size": "small", "port": "http", "note": None, "pools": [{"role": "mixed"}],
                                    "replicas": 1, "drain": {"preStopSeconds": 15}}
    assert apply_schema(widget({"size": "small", "port": 8080}), SCHEMA).errors == []
    # A null where null is not allowed is pruned, then defaulted if the field has a default.
    nulls = apply_schema(widget({"size": "small", "replicas": None, "name": None}), SCHEMA)
    assert nulls.errors == [] and nulls.value["spec"]["replicas"] == 1 and "name" not in nulls.value["spec"]


def test_schema_prunes_unknown_fields_and_reports_them_but_keeps_preserved_ones() -> None:
    obj = widget({"size": "small", "replica": 2, "services": {"x": {"replica": 1}},
                  "extra": {"anything": {"goes": [1]}}})
    obj["metadata"]["labels"] = {"a": "b"}
    result = apply_schema(obj, SCHEMA)
    assert result.errors == []
    assert result.unknown == ["spec.replica", "spec.services.x.replica"]
    assert result.value["spec"]["services"] == {"x": {}}
    assert result.value["spec"]["extra"] == {"anything": {"goes": [1]}}
    assert result.value["metadata"] == {"name": "w", "labels": {"a": "b"}}  # metadata is not the schema's


# -- the server, in-process --------------------------------------------------------------------
def crd_fixture() -> dict[str, Any]:
    with open(f"{FIXTURES}/crd.yaml") as f:
        return yaml.safe_load(f)


@pytest.fixture
def api() -> FakeKubeApi:
    api = FakeKubeApi(namespace="demo")
    api.create_object(api.resource_type("apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, crd_fixture())
    return api


def kind(api: FakeKubeApi, api_version: str, name: str):
    return api.resource_type(api_version, name)


def events(api: FakeKubeApi, since: int = 0) -> list[tuple[str, str, str]]:
    return [(e.type, e.key[1], e.obj["metadata"]["name"]) for e in api.history if e.rv > since]


def test_custom_resource_strict_unknown_field_is_400_warn_prunes_with_a_warning(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    body = {"metadata": {"name": "w"}, "spec": {"size": "small", "services": {"x": {"replica": 2}}}}
    with pytest.raises(KubeError) as caught:
        api.create_object(widgets, "demo", body, field_validation="Strict")
    assert caught.value.code == 400
    assert caught.value.status["message"] == ('Widget in version "v1" cannot be handled as a Widget: strict decoding '
                                              'error: unknown field "spec.services.x.replica"')
    warnings: list[str] = []
    created = api.create_object(widgets, "demo", body, field_validation="Warn", warnings=warnings)
    assert warnings == ['unknown field "spec.services.x.replica"']
    assert created["spec"] == {"size": "small", "services": {"x": {}}, "replicas": 1}


def test_strict_refuses_unknown_fields_of_builtin_kinds_too(api: FakeKubeApi) -> None:
    deployments = kind(api, "apps/v1", "Deployment")
    body = {"metadata": {"name": "d"}, "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
        "metadata": {"labels": {"a": "b"}},
        "spec": {"containers": [{"name": "main", "image": "x", "imagePullPolicyy": "Always"}], "nodeSelektor": {}}}}}
    with pytest.raises(KubeError) as caught:
        api.create_object(deployments, "demo", body, field_validation="Strict")
    assert caught.value.code == 400
    assert caught.value.status["message"] == (
        'Deployment in version "v1" cannot be handled as a Deployment: strict decoding error: unknown field '
        '"spec.template.spec.containers[0].imagePullPolicyy", unknown field "spec.template.spec.nodeSelektor"')
    valid = copy.deepcopy(body)
    del valid["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"]
    del valid["spec"]["template"]["spec"]["nodeSelektor"]
    assert api.create_object(deployments, "demo", valid, field_validation="Strict")["spec"]["replicas"] == 1
    body["metadata"]["name"] = "lenient"
    assert api.create_object(deployments, "demo", body, field_validation="Warn")  # stored as given


def test_custom_resource_invalid_is_422_with_causes(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    with pytest.raises(KubeError) as caught:
        api.create_object(widgets, "demo", {"metadata": {"name": "w"}, "spec": {"size": "huge", "replicas": "2"}})
    status = caught.value.status
    assert status["code"] == 422 and status["reason"] == "Invalid"
    assert status["message"].startswith('Widget.example.infera.dev "w" is invalid: [')
    assert {c["field"] for c in status["details"]["causes"]} == {"spec.size", "spec.replicas"}


def test_crd_registers_and_unregisters_its_kind_and_deleting_it_deletes_its_resources(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    assert widgets.short_names == ("wdg",) and widgets.status and widgets.scale is not None
    api.create_object(widgets, "demo", {"metadata": {"name": "w"}, "spec": {"size": "small"}})
    crd = api.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", "widgets.example.infera.dev")
    assert {c["type"]: c["status"] for c in crd["status"]["conditions"]}["Established"] == "True"
    mark = api.rv
    api.delete_object(kind(api, "apiextensions.k8s.io/v1", "CustomResourceDefinition"), None,
                      "widgets.example.infera.dev")
    assert ("DELETED", "widgets", "w") in events(api, mark)
    with pytest.raises(KeyError):
        api.resource_type("example.infera.dev/v1", "Widget")


def test_crd_that_cannot_be_served_is_422_naming_the_field(api: FakeKubeApi) -> None:
    crd = crd_fixture()
    crd["metadata"]["name"] = "gadgets.example.infera.dev"
    with pytest.raises(KubeError) as caught:
        api.create_object(kind(api, "apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, crd)
    assert caught.value.code == 422 and "metadata.name" in caught.value.status["message"]


def test_status_subresource_and_generation(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    created = api.create_object(widgets, "demo", {"metadata": {"name": "w"}, "spec": {"size": "small"},
                                                  "status": {"phase": "dropped"}})
    assert "status" not in created and created["metadata"]["generation"] == 1
    after_status, _ = api.patch_object(widgets, "demo", "w", MERGE_PATCH,
                                       {"spec": {"size": "large"}, "status": {"phase": "Ready"}}, subresource="status")
    assert after_status["status"] == {"phase": "Ready"} and after_status["spec"]["size"] == "small"
    assert after_status["metadata"]["generation"] == 1  # status changes never move generation
    labelled, _ = api.patch_object(widgets, "demo", "w", MERGE_PATCH, {"metadata": {"labels": {"a": "b"}}})
    assert labelled["metadata"]["generation"] == 1  # nor metadata changes
    changed, _ = api.patch_object(widgets, "demo", "w", MERGE_PATCH, {"spec": {"size": "large"},
                                                                      "status": {"phase": "ignored"}})
    assert changed["metadata"]["generation"] == 2 and changed["status"] == {"phase": "Ready"}


def test_a_change_that_changes_nothing_keeps_the_resource_version_and_emits_nothing(api: FakeKubeApi) -> None:
    cms = kind(api, "v1", "ConfigMap")
    created = api.create_object(cms, "demo", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    mark = api.rv
    same, _ = api.patch_object(cms, "demo", "c", MERGE_PATCH, {"data": {"a": "1"}})
    same_again, _ = api.patch_object(cms, "demo", "c", STRATEGIC_PATCH, {"data": {"a": "1"}})
    assert same["metadata"]["resourceVersion"] == same_again["metadata"]["resourceVersion"] \
        == created["metadata"]["resourceVersion"]
    assert api.rv == mark and events(api, mark) == []


def test_stale_resource_version_is_409_conflict(api: FakeKubeApi) -> None:
    cms = kind(api, "v1", "ConfigMap")
    created = api.create_object(cms, "demo", {"metadata": {"name": "c"}, "data": {"a": "1"}})
    api.patch_object(cms, "demo", "c", MERGE_PATCH, {"data": {"a": "2"}})
    stale = copy.deepcopy(created)
    stale["data"] = {"a": "3"}
    for attempt in (lambda: api.update_object(cms, "demo", "c", stale),
                    lambda: api.patch_object(cms, "demo", "c", MERGE_PATCH,
                                             {"metadata": {"resourceVersion": created["metadata"]["resourceVersion"]},
                                              "data": {"a": "3"}}),
                    lambda: api.patch_object(cms, "demo", "c", JSON_PATCH,
                                             [{"op": "replace", "path": "/metadata/resourceVersion",
                                               "value": created["metadata"]["resourceVersion"]}])):
        with pytest.raises(KubeError) as caught:
            attempt()
        assert caught.value.code == 409 and caught.value.status["reason"] == "Conflict"
        assert 'configmaps "c": the object has been modified' in caught.value.status["message"]
    assert api.get("v1", "ConfigMap", "c", "demo")["data"] == {"a": "2"}
    fresh = api.get("v1", "ConfigMap", "c", "demo")
    fresh["data"] = {"a": "4"}
    assert api.update_object(cms, "demo", "c", fresh)["data"] == {"a": "4"}


def test_create_conflicts_generate_name_and_json_patch(api: FakeKubeApi) -> None:
    cms = kind(api, "v1", "ConfigMap")
    api.create_object(cms, "demo", {"metadata": {"name": "c"}})
    with pytest.raises(KubeError) as caught:
        api.create_object(cms, "demo", {"metadata": {"name": "c"}})
    assert caught.value.code == 409 and caught.value.status["reason"] == "AlreadyExists"
    generated = api.create_object(cms, "demo", {"metadata": {"generateName": "job-"}})
    assert generated["metadata"]["name"].startswith("job-") and len(generated["metadata"]["name"]) == 9
    patched, _ = api.patch_object(cms, "demo", "c", JSON_PATCH, [{"op": "add", "path": "/data", "value": {"k": "v"}}])
    assert patched["data"] == {"k": "v"}
    with pytest.raises(KubeError) as caught:
        api.patch_object(cms, "demo", "c", JSON_PATCH, [{"op": "test", "path": "/data/k", "value": "other"}])
    assert caught.value.code == 422
    with pytest.raises(KubeError) as caught:
        api.patch_object(kind(api, "example.infera.dev/v1", "Widget"), "demo", "c", STRATEGIC_PATCH, {})
    assert caught.value.code == 404


def test_strategic_merge_merges_containers_env_and_ports_by_key() -> None:
    live = {"spec": {"containers": [
        {"name": "main", "image": "a:1", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
         "ports": [{"containerPort": 80, "name": "http"}]},
        {"name": "sidecar", "image": "s:1"}],
        "volumes": [{"name": "v1", "emptyDir": {}}]}}
    patch = {"spec": {"containers": [
        {"name": "main", "image": "a:2", "env": [{"name": "B", "value": "3"}, {"name": "A", "$patch": "delete"}],
         "ports": [{"containerPort": 81}]},
        {"name": "new", "image": "n:1"}],
        "$setElementOrder/containers": [{"name": "new"}, {"name": "main"}, {"name": "sidecar"}],
        "volumes": [{"name": "v2", "emptyDir": {}}]}}
    merged = strategic_merge_patch(live, patch)
    containers = merged["spec"]["containers"]
    assert [c["name"] for c in containers] == ["new", "main", "sidecar"]
    assert containers[1]["image"] == "a:2" and containers[2]["image"] == "s:1"
    assert containers[1]["env"] == [{"name": "B", "value": "3"}]
    assert containers[1]["ports"] == [{"containerPort": 80, "name": "http"}, {"containerPort": 81}]
    assert [v["name"] for v in merged["spec"]["volumes"]] == ["v1", "v2"]
    assert "$setElementOrder/containers" not in merged["spec"]
    retained = strategic_merge_patch({"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1}}},
                                     {"strategy": {"type": "Recreate", "$retainKeys": ["type"]}})
    assert retained == {"strategy": {"type": "Recreate"}}
    assert strategic_merge_patch({"args": ["a", "b"]}, {"args": ["c"]}) == {"args": ["c"]}  # atomic list


def test_server_side_apply_creates_merges_by_name_and_is_idempotent(api: FakeKubeApi) -> None:
    deployments = kind(api, "apps/v1", "Deployment")
    config = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "labels": {"a": "b"}},
              "spec": {"replicas": 2, "selector": {"matchLabels": {"a": "b"}}, "template": {
                  "metadata": {"labels": {"a": "b"}},
                  "spec": {"containers": [{"name": "main", "image": "x:1"}]}}}}
    with pytest.raises(KubeError) as caught:
        api.patch_object(deployments, "demo", "d", APPLY_PATCH, config)
    assert caught.value.code == 400 and "fieldManager" in caught.value.status["message"]
    created, was_created = api.patch_object(deployments, "demo", "d", APPLY_PATCH, config, field_manager="op")
    assert was_created and created["metadata"]["generation"] == 1
    mark = api.rv
    again, was_created = api.patch_object(deployments, "demo", "d", APPLY_PATCH, config, field_manager="op")
    assert not was_created and again["metadata"]["resourceVersion"] == created["metadata"]["resourceVersion"]
    assert events(api, mark) == []  # an idempotent apply rolls nothing
    api.patch_object(deployments, "demo", "d", MERGE_PATCH, {"spec": {"template": {"spec": {"containers": [
        {"name": "main", "image": "x:1"}, {"name": "sidecar", "image": "s:1"}]}}}})
    changed = copy.deepcopy(config)
    changed["spec"]["template"]["spec"]["containers"][0]["image"] = "x:2"
    result, _ = api.patch_object(deployments, "demo", "d", APPLY_PATCH, changed, field_manager="op")
    assert [(c["name"], c["image"]) for c in result["spec"]["template"]["spec"]["containers"]] == [
        ("main", "x:2"), ("sidecar", "s:1")]
    assert result["metadata"]["generation"] == 3
    assert apply_merge({"a": [{"name": "x", "v": 1}]}, {"a": [{"name": "y"}]}) == {"a": [{"name": "x", "v": 1},
                                                                                         {"name": "y"}]}


def test_server_side_apply_removes_what_the_same_manager_applied_before_and_leaves_out_now(api: FakeKubeApi) -> None:
    deployments = kind(api, "apps/v1", "Deployment")

    def config(env: list[str], labels: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"name": "d", "labels": labels}, "spec": {"template": {"spec": {"containers": [
            {"name": "main", "image": "x:1", "env": [{"name": e, "value": "1"} for e in env]}]}}}}

    api.patch_object(deployments, "demo", "d", APPLY_PATCH, config(["A", "B"], {"a": "1", "b": "1"}),
                     field_manager="op")
    api.patch_object(deployments, "demo", "d", MERGE_PATCH, {"metadata": {"labels": {"other": "x"}}})
    result, _ = api.patch_object(deployments, "demo", "d", APPLY_PATCH, config(["A"], {"a": "1"}), field_manager="op")
    assert result["metadata"]["labels"] == {"a": "1", "other": "x"}  # another writer's label stays
    assert result["spec"]["template"]["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]
    assert result["spec"]["replicas"] == 1  # a default nobody applied stays
    result, _ = api.patch_object(deployments, "demo", "d", APPLY_PATCH, config(["C"], {"a": "1"}),
                                 field_manager="someone-else")
    assert [e["name"] for e in result["spec"]["template"]["spec"]["containers"][0]["env"]] == ["A", "C"]


def owned(name: str, owner: dict[str, Any], **extra: Any) -> dict[str, Any]:
    meta = owner["metadata"]
    ref = {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
           "controller": True, "blockOwnerDeletion": True}
    return {"metadata": {"name": name, "ownerReferences": [ref]}, **extra}


def test_garbage_collection_cascades_through_owners_and_orphan_keeps_dependents(api: FakeKubeApi) -> None:
    deployments, replicasets, pods = (kind(api, "apps/v1", "Deployment"), kind(api, "apps/v1", "ReplicaSet"),
                                      kind(api, "v1", "Pod"))
    deployment = api.create_object(deployments, "demo", {"metadata": {"name": "d"}, "spec": {}})
    replicaset = api.create_object(replicasets, "demo", owned("d-1", deployment, spec={}))
    api.create_object(pods, "demo", owned("d-1-a", replicaset, spec={}))
    api.create_object(pods, "other", owned("elsewhere", replicaset, spec={}))  # another namespace: not a dependent
    mark = api.rv
    api.delete_object(deployments, "demo", "d")
    assert set(events(api, mark)) == {("DELETED", "deployments", "d"), ("DELETED", "replicasets", "d-1"),
                                      ("DELETED", "pods", "d-1-a")}
    assert api.get("v1", "Pod", "elsewhere", "other") is not None
    deployment = api.create_object(deployments, "demo", {"metadata": {"name": "d"}, "spec": {}})
    api.create_object(replicasets, "demo", owned("d-2", deployment, spec={}))
    api.delete_object(deployments, "demo", "d", propagation="Orphan")
    orphan = api.get("apps/v1", "ReplicaSet", "d-2", "demo")
    assert orphan is not None and "ownerReferences" not in orphan["metadata"]


def test_an_object_whose_owner_is_gone_is_collected(api: FakeKubeApi) -> None:
    cms = kind(api, "v1", "ConfigMap")
    owner = api.create_object(cms, "demo", {"metadata": {"name": "owner"}})
    api.delete_object(cms, "demo", "owner")
    mark = api.rv
    created = api.create_object(cms, "demo", owned("late", owner))
    assert created["metadata"]["name"] == "late"  # the create itself succeeds...
    assert events(api, mark) == [("ADDED", "configmaps", "late"), ("DELETED", "configmaps", "late")]  # ...then GC


def test_finalizers_hold_deletion_until_the_last_one_is_removed(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    api.create_object(widgets, "demo", {"metadata": {"name": "w", "finalizers": ["example.infera.dev/cleanup"]},
                                        "spec": {"size": "small"}})
    deleting = api.delete_object(widgets, "demo", "w")
    assert deleting["metadata"]["deletionTimestamp"] and deleting["metadata"]["deletionGracePeriodSeconds"] == 0
    again = api.delete_object(widgets, "demo", "w")  # a second delete changes nothing
    assert again["metadata"]["resourceVersion"] == deleting["metadata"]["resourceVersion"]
    api.patch_object(widgets, "demo", "w", MERGE_PATCH, {"status": {"phase": "x"}}, subresource="status")
    assert api.get("example.infera.dev/v1", "Widget", "w", "demo") is not None
    mark = api.rv
    api.patch_object(widgets, "demo", "w", MERGE_PATCH, {"metadata": {"finalizers": None}})
    assert events(api, mark) == [("MODIFIED", "widgets", "w"), ("DELETED", "widgets", "w")]
    assert api.get("example.infera.dev/v1", "Widget", "w", "demo") is None


def test_graceful_pod_deletion(api: FakeKubeApi) -> None:
    pods = kind(api, "v1", "Pod")
    api.create_object(pods, "demo", {"metadata": {"name": "bound"},
                                     "spec": {"nodeName": "local", "terminationGracePeriodSeconds": 120}})
    api.create_object(pods, "demo", {"metadata": {"name": "unbound"}, "spec": {}})
    api.create_object(pods, "demo", {"metadata": {"name": "forced"}, "spec": {"nodeName": "local"}})
    mark = api.rv
    deleting = api.delete_object(pods, "demo", "bound")
    assert deleting["metadata"]["deletionGracePeriodSeconds"] == 120 and deleting["metadata"]["deletionTimestamp"]
    shorter = api.delete_object(pods, "demo", "bound", grace_period_s=5)
    assert shorter["metadata"]["deletionGracePeriodSeconds"] == 5
    api.patch_object(pods, "demo", "bound", MERGE_PATCH, {"status": {"phase": "Succeeded"}}, subresource="status")
    assert api.get_pod("bound", "demo") is not None  # status writes during the grace period keep it
    api.delete_object(pods, "demo", "bound", grace_period_s=0)  # the kubelet's final delete
    api.delete_object(pods, "demo", "unbound")
    api.delete_object(pods, "demo", "forced", grace_period_s=0)
    assert events(api, mark) == [("MODIFIED", "pods", "bound"), ("MODIFIED", "pods", "bound"),
                                 ("MODIFIED", "pods", "bound"), ("DELETED", "pods", "bound"),
                                 ("DELETED", "pods", "unbound"), ("DELETED", "pods", "forced")]
    api.add_pod("helper", namespace="demo")  # the test helpers' two steps still work
    assert api.begin_graceful_delete("helper")["metadata"]["deletionTimestamp"]
    api.finish_delete("helper")
    assert api.get_pod("helper") is None


def test_services_get_loopback_cluster_ips_and_port_defaults() -> None:
    api = FakeKubeApi(service_ip_start="127.0.200.1")
    services = kind(api, "v1", "Service")
    first = api.create_object(services, "default", {"metadata": {"name": "a"}, "spec": {"ports": [{"port": 80}]}})
    second = api.create_object(services, "default", {"metadata": {"name": "b"}, "spec": {}})
    headless = api.create_object(services, "default", {"metadata": {"name": "h"}, "spec": {"clusterIP": "None"}})
    given = api.create_object(services, "default", {"metadata": {"name": "g"}, "spec": {"clusterIP": "127.0.200.3"}})
    assert (first["spec"]["clusterIP"], second["spec"]["clusterIP"]) == ("127.0.200.1", "127.0.200.2")
    assert first["spec"]["clusterIPs"] == ["127.0.200.1"]
    assert headless["spec"]["clusterIP"] == "None" and given["spec"]["clusterIP"] == "127.0.200.3"
    assert first["spec"]["ports"] == [{"port": 80, "protocol": "TCP", "targetPort": 80}]
    third = api.create_object(services, "default", {"metadata": {"name": "c"}, "spec": {}})
    assert third["spec"]["clusterIP"] == "127.0.200.4"  # skips the one given
    low, high = ipaddress.IPv4Address("127.0.200.0"), ipaddress.IPv4Address("127.0.254.255")
    starts = {FakeKubeApi().service_ip_start for _ in range(20)}
    assert all(low <= start <= high for start in starts) and len(starts) > 1  # side-by-side runs do not collide
    wraps = FakeKubeApi(service_ip_start="127.0.254.254")
    ips = [api_ip(wraps, name) for name in ("x", "y")]
    assert ips == ["127.0.254.254", "127.0.200.1"]  # wraps around, skipping .255 and .0
    replaced = api.update_object(services, "default", "a",
                                 {"metadata": {"name": "a"}, "spec": {"ports": [{"port": 81}]}})
    assert replaced["spec"]["clusterIP"] == "127.0.200.1"  # kept across updates


def api_ip(api: FakeKubeApi, name: str) -> str:
    created = api.create_object(kind(api, "v1", "Service"), "default", {"metadata": {"name": name}, "spec": {}})
    return created["spec"]["clusterIP"]


def test_scale_subresource_reads_the_declared_paths(api: FakeKubeApi) -> None:
    widgets = kind(api, "example.infera.dev/v1", "Widget")
    created = api.create_object(widgets, "demo", {"metadata": {"name": "w"}, "spec": {"size": "small",
                                                                                      "replicas": 3}})
    scale = api.scale_of(widgets, created)
    assert scale["spec"] == {"replicas": 3} and scale["status"] == {"replicas": 0}
    deployments = kind(api, "apps/v1", "Deployment")
    deployment = api.create_object(deployments, "demo", {"metadata": {"name": "d"},
                                                         "spec": {"selector": {"matchLabels": {"app": "d"}}}})
    assert deployment["spec"]["replicas"] == 1  # defaulted
    assert api.scale_of(deployments, deployment)["status"]["selector"] == "app=d"


def test_field_selectors_for_every_kind() -> None:
    assert parse_field_selector("metadata.name=a", GENERIC_FIELDS)
    with pytest.raises(FieldSelectorError) as caught:
        parse_field_selector("spec.nodeName=x", GENERIC_FIELDS)
    assert caught.value.unsupported == "spec.nodeName"
    api = FakeKubeApi()
    cms = kind(api, "v1", "ConfigMap")
    for name in ("a", "b"):
        api.create_object(cms, "default", {"metadata": {"name": name, "labels": {"n": name}}})
    assert [o["metadata"]["name"] for o in api.list("v1", "ConfigMap", label_selector="n!=a")] == ["b"]


def test_printer_column_paths_and_ages() -> None:
    obj = {"status": {"conditions": [{"type": "A", "status": "False"}, {"type": "Ready", "status": "True"}],
                      "pools": [{"n": 1}]}}
    assert jsonpath_value(obj, '.status.conditions[?(@.type=="Ready")].status') == "True"
    assert jsonpath_value(obj, ".status.pools[0].n") == 1
    assert jsonpath_value(obj, "{.status.pools[1].n}") is None
    assert jsonpath_value(obj, ".status.pools[*].n") is None  # not supported: an empty cell, never an error
    now = datetime.datetime(2026, 1, 10, 12, 0, 0, tzinfo=datetime.timezone.utc)
    for seconds, shown in ((5, "5s"), (119, "119s"), (150, "2m30s"), (3600, "60m"), (4 * 3600 + 60, "4h1m"),
                           (30 * 3600, "30h"), (3 * 86400 + 3600, "3d1h"), (100 * 86400, "100d")):
        then = (now - datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
        assert human_age(then, now) == shown


def test_dry_run_stores_nothing_and_apply_with_a_stale_resource_version_conflicts(api: FakeKubeApi) -> None:
    cms = kind(api, "v1", "ConfigMap")
    mark = api.rv
    assert api.create_object(cms, "demo", {"metadata": {"name": "c"}}, dry_run=True)["metadata"]["name"] == "c"
    assert api.get("v1", "ConfigMap", "c", "demo") is None and api.rv == mark
    created, _ = api.patch_object(cms, "demo", "c", APPLY_PATCH, {"metadata": {"name": "c"}, "data": {"a": "1"}},
                                  field_manager="op")
    api.patch_object(cms, "demo", "c", MERGE_PATCH, {"data": {"b": "2"}})
    stale = {"metadata": {"name": "c", "resourceVersion": created["metadata"]["resourceVersion"]}, "data": {"a": "3"}}
    with pytest.raises(KubeError) as caught:
        api.patch_object(cms, "demo", "c", APPLY_PATCH, stale, field_manager="op")
    assert caught.value.code == 409


def test_every_served_version_of_a_crd_shares_the_objects() -> None:
    api = FakeKubeApi()
    crd = crd_fixture()
    v1 = crd["spec"]["versions"][0]
    crd["spec"]["versions"] = [{**copy.deepcopy(v1), "name": "v1beta1", "storage": False}, v1]
    api.create_object(kind(api, "apiextensions.k8s.io/v1", "CustomResourceDefinition"), None, crd)
    beta = kind(api, "example.infera.dev/v1beta1", "Widget")
    api.create_object(beta, "default", {"metadata": {"name": "w"}, "spec": {"size": "small"}})
    assert api.get("example.infera.dev/v1", "Widget", "w")["apiVersion"] == "example.infera.dev/v1"
    assert api.get("example.infera.dev/v1beta1", "Widget", "w")["apiVersion"] == "example.infera.dev/v1beta1"
