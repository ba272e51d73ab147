"""The scaling API's pure parts (infera/server/scaling.py): exact validation of a scale request,
the one merge patch, blocked reasons read from Pod dicts, the snapshot from a CR dict, and the
--enable-scaling-api flag's refusal without an admin token."""
from __future__ import annotations

import json

import pytest

from infera.api.errors import ApiError
from infera.server.cli import parse_args
from infera.server.scaling import (MAX_REPLICAS, build_snapshot, check_service_names, first_blocked_reason,
                                   merge_patch_for, one_line, parse_scale_body, pod_blocked_reason, wanting_more)


def body(obj) -> bytes:
    return json.dumps(obj).encode()


# -- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, expected", [
    (body({"services": {"decode": 3}}), {"decode": 3}),
    (body({"services": {"prefill": 4, "decode": {"replicas": 8}}}), {"prefill": 4, "decode": 8}),
    (body({"services": {"frontend": 1}}), {"frontend": 1}),
    (body({"services": {"decode": MAX_REPLICAS}}), {"decode": MAX_REPLICAS}),
])
def test_valid_bodies(raw, expected):
    assert parse_scale_body(raw) == expected


@pytest.mark.parametrize("raw, param, words", [
    (body({"services": {"decode": True}}), "services.decode", "boolean"),
    (body({"services": {"decode": False}}), "services.decode", "boolean"),
    (body({"services": {"decode": 3.0}}), "services.decode", "fraction"),
    (body({"services": {"decode": 2.5}}), "services.decode", "fraction"),
    (body({"services": {"decode": "3"}}), "services.decode", "string"),
    (body({"services": {"decode": None}}), "services.decode", "null"),
    (body({"services": {"decode": [3]}}), "services.decode", "array"),
    (body({"services": {"decode": 0}}), "services.decode", "zero"),
    (body({"services": {"decode": -1}}), "services.decode", "zero"),
    (body({"services": {"decode": MAX_REPLICAS + 1}}), "services.decode", f"at most {MAX_REPLICAS}"),
    (b'{"services": {"decode": 99999999999999999999999}}', "services.decode", f"at most {MAX_REPLICAS}"),
    (body({"services": {"decode": {"replicas": 2, "x": 1}}}), "services.decode", "only \"replicas\""),
    (body({"services": {"decode": {}}}), "services.decode", "must hold \"replicas\""),
    (body({"services": {"decode": {"replicas": True}}}), "services.decode.replicas", "boolean"),
    (body({"services": {"decode": {"replicas": 0}}}), "services.decode.replicas", "zero"),
    (body({"services": {"decode": {"replicas": "2"}}}), "services.decode.replicas", "string"),
    (body({"services": {}}), "services", "empty"),
    (body({"services": []}), "services", "JSON object"),
    (body({"services": "decode=3"}), "services", "JSON object"),
    (body({}), "services", "JSON object"),
    (body({"services": {"decode": 3}, "dry_run": True}), "dry_run", "unknown field"),
    (body([{"services": {"decode": 3}}]), None, "JSON object"),
    (body("decode"), None, "JSON object"),
    (body(3), None, "JSON object"),
    (b"", None, "JSON object"),
    (b"{not json", None, "malformed JSON"),
    (b"[" * 100_000, None, "deep"),
])
def test_invalid_bodies_are_400_naming_the_field(raw, param, words):
    with pytest.raises(ApiError) as caught:
        parse_scale_body(raw)
    assert caught.value.status == 400
    assert caught.value.param == param
    assert words in caught.value.message


def test_scale_to_zero_is_refused_in_so_many_words():
    with pytest.raises(ApiError) as caught:
        parse_scale_body(body({"services": {"decode": 0}}))
    assert caught.value.code == "scale_to_zero_refused" and "refused" in caught.value.message


def test_unknown_service_names_list_the_existing_ones():
    check_service_names({"decode": 2}, ["decode", "prefill", "frontend"])  # fine
    with pytest.raises(ApiError) as caught:
        check_service_names({"decode": 2, "decoder": 2}, ["prefill", "decode", "frontend"])
    err = caught.value
    assert err.status == 400 and err.code == "unknown_service" and err.param == "services.decoder"
    assert "'decoder'" in err.message and "decode, frontend, prefill" in err.message


def test_one_merge_patch_touches_only_replicas():
    assert merge_patch_for({"prefill": 4, "decode": 8}) == {
        "spec": {"services": {"prefill": {"replicas": 4}, "decode": {"replicas": 8}}}}


# -- blocked reasons ------------------------------------------------------------------------------

def pod(name: str, phase: str = "Pending", created: str = "2026-01-01T00:00:00Z", conditions=(), containers=(),
        init_containers=(), deleting: bool = False) -> dict:
    meta = {"name": name, "creationTimestamp": created}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T01:00:00Z"
    status = {"phase": phase, "conditions": list(conditions)}
    if containers:
        status["containerStatuses"] = list(containers)
    if init_containers:
        status["initContainerStatuses"] = list(init_containers)
    return {"metadata": meta, "status": status}


UNSCHEDULABLE = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/4 nodes are available: 4 Insufficient amd.com/gpu."}


def waiting(reason: str, message: str = "") -> dict:
    return {"name": "main", "ready": False, "state": {"waiting": {"reason": reason, "message": message}}}


@pytest.mark.parametrize("the_pod, expected", [
    (pod("a", conditions=[UNSCHEDULABLE]), "Unschedulable: 0/4 nodes are available: 4 Insufficient amd.com/gpu."),
    (pod("a", conditions=[{**UNSCHEDULABLE, "status": "True"}]), None),  # scheduled: not that
    (pod("a", conditions=[{"type": "Ready", "status": "False", "reason": "ContainersNotReady", "message": "x"}]),
     None),
    (pod("a", containers=[waiting("ImagePullBackOff", 'Back-off pulling image "infera:nope"')]),
     'ImagePullBackOff: Back-off pulling image "infera:nope"'),
    (pod("a", containers=[waiting("ErrImagePull", "not found")]), "ErrImagePull: not found"),
    (pod("a", containers=[waiting("CreateContainerConfigError", 'secret "hf" not found')]),
     'CreateContainerConfigError: secret "hf" not found'),
    (pod("a", phase="Running", containers=[waiting("CrashLoopBackOff", "back-off 5m0s restarting")]),
     "CrashLoopBackOff: back-off 5m0s restarting"),
    (pod("a", containers=[waiting("CrashLoopBackOff")]), "CrashLoopBackOff"),
    (pod("a", containers=[waiting("ContainerCreating")]), None),  # just starting: not blocked
    (pod("a", init_containers=[waiting("ErrImagePull", "init image")], containers=[waiting("PodInitializing")]),
     "ErrImagePull: init image"),
    (pod("a", conditions=[UNSCHEDULABLE], containers=[waiting("ErrImagePull", "x")]),  # scheduling first
     "Unschedulable: 0/4 nodes are available: 4 Insufficient amd.com/gpu."),
    ({"metadata": {"name": "bare"}}, None),
    ({"metadata": {"name": "odd"}, "status": {"conditions": ["junk", None], "containerStatuses": [7]}}, None),
])
def test_pod_blocked_reason(the_pod, expected):
    assert pod_blocked_reason(the_pod) == expected


def test_blocked_reason_is_one_line_of_at_most_300_characters():
    message = "line one\nline two\r\n\ttabbed\x1b[31m red\x00\u202e reversed\u2028sep " + "x" * 1000
    reason = pod_blocked_reason(pod("a", conditions=[{**UNSCHEDULABLE, "message": message}]))
    assert len(reason) == 300 and reason.endswith("…")
    assert reason.startswith("Unschedulable: line one line two tabbed[31m red reversed sep xxx")
    assert all(ch.isprintable() for ch in reason)
    assert one_line("short\n") == "short"


def test_first_blocked_reason_prefers_the_oldest_pending_pod():
    pods = [
        pod("running-ok", phase="Running", created="2026-01-01T00:00:00Z"),
        pod("crashing", phase="Running", created="2026-01-01T00:00:01Z",
            containers=[waiting("CrashLoopBackOff", "restarting")]),
        pod("pending-new", created="2026-01-01T00:00:09Z", conditions=[{**UNSCHEDULABLE, "message": "newer"}]),
        pod("pending-old", created="2026-01-01T00:00:05Z", conditions=[{**UNSCHEDULABLE, "message": "older"}]),
        pod("pending-gone", created="2026-01-01T00:00:00Z", deleting=True,
            conditions=[{**UNSCHEDULABLE, "message": "deleting"}]),
    ]
    assert first_blocked_reason(pods) == "Unschedulable: older"
    assert first_blocked_reason([p for p in pods if p["status"]["phase"] == "Running"]) == \
        "CrashLoopBackOff: restarting"
    assert first_blocked_reason([pod("starting", containers=[waiting("ContainerCreating")])]) is None
    assert first_blocked_reason([]) is None


# -- snapshot -------------------------------------------------------------------------------------

CR = {
    "apiVersion": "infera.amd.com/v1alpha1", "kind": "InferaDeployment",
    "metadata": {"name": "demo", "namespace": "infera"},
    "spec": {"backendFramework": "vllm", "services": {
        "frontend": {"componentType": "server"},  # the operator's default for a server: 2
        "prefill": {"componentType": "worker", "role": "prefill", "replicas": 2},
        "decode": {"componentType": "worker", "role": "decode", "replicas": 3, "numberOfNodes": 2},
        "mixed": {"componentType": "worker"},  # replicas and role defaulted
    }},
    "status": {"state": "pending", "services": {
        "frontend": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
        "prefill": {"kind": "Deployment", "replicas": 2, "readyReplicas": 2},
        "decode": {"kind": "LeaderWorkerSet", "replicas": 3, "readyReplicas": 2},
    }},
}


def test_snapshot_from_a_cr():
    blocked = {"decode": "Unschedulable: no GPUs", "prefill": "ignored: prefill is not short", "mixed": None}
    assert wanting_more(CR) == ["decode", "mixed"]
    assert build_snapshot(CR, "infera", blocked) == {
        "deployment": "demo", "namespace": "infera", "state": "pending",
        "services": {
            "frontend": {"role": "mixed", "replicas": 2, "current_replicas": 2, "ready_replicas": 2,
                         "nodes_per_replica": 1},
            "prefill": {"role": "prefill", "replicas": 2, "current_replicas": 2, "ready_replicas": 2,
                        "nodes_per_replica": 1},
            "decode": {"role": "decode", "replicas": 3, "current_replicas": 3, "ready_replicas": 2,
                       "nodes_per_replica": 2, "blocked": "Unschedulable: no GPUs"},
            "mixed": {"role": "mixed", "replicas": 1, "current_replicas": 0, "ready_replicas": 0,
                      "nodes_per_replica": 1},
        }}


def test_snapshot_of_a_cr_without_status():
    cr = {"metadata": {"name": "fresh"}, "spec": {"services": {"w": {"componentType": "worker", "replicas": 3},
                                                               "s": {"componentType": "server"}}}}
    snap = build_snapshot(cr, "ns")
    assert snap["state"] == "unknown"
    assert snap["services"]["w"] == {"role": "mixed", "replicas": 3, "current_replicas": 0, "ready_replicas": 0,
                                     "nodes_per_replica": 1}
    assert snap["services"]["s"]["replicas"] == 2
    assert wanting_more(cr) == ["w", "s"]


# -- the flag -------------------------------------------------------------------------------------

PLANE = ["--discovery-backend", "etcd", "--etcd-endpoint", "127.0.0.1:2379"]


def test_flag_needs_the_admin_token(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--enable-scaling-api", *PLANE], environ={})
    err = capsys.readouterr().err
    assert "--enable-scaling-api" in err and "needs --admin-token" in err
    args = parse_args(PLANE, environ={"INFERA_ENABLE_SCALING_API": "1", "INFERA_ADMIN_TOKEN": "t",
                                      "POD_NAME": "srv-0", "POD_NAMESPACE": "infera"})
    assert (args.enable_scaling_api, args.k8s_pod_name, args.k8s_namespace) == (True, "srv-0", "infera")
    assert parse_args(PLANE, environ={}).enable_scaling_api is False
