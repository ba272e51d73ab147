"""Kubernetes discovery, the pure parts: Pod → record decisions, applying events to a fleet, config
loading, error classification; and the fake API server's own selector and merge-patch logic."""
from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from lightkube import ApiError, KubeConfig
from lightkube.models.meta_v1 import Status
from lightkube.resources.core_v1 import Pod

from infera.discovery.fleet import Fleet
from infera.discovery.kubernetes import (
    ANNOTATION,
    KubeConfigError,
    MAX_ERROR_BODY_BYTES,
    KubernetesDiscovery,
    _describe,
    _read_error_body,
    _httpx,
    _retryable,
    _stale_resource_version,
    load_kube_config,
    pod_state,
)
from infera.discovery.record import WorkerRecord, encode_record
from tests.fakes.kube_api import (
    FieldSelectorError,
    fields_match,
    merge_patch,
    parse_field_selector,
    parse_selector,
    selector_matches,
    status_body,
    too_large_status,
)


def record_json(worker_id: str = "10.0.0.1:8000", **fields: Any) -> str:
    record = WorkerRecord(worker_id=worker_id, url=f"http://{worker_id}", model_name="m", **fields)
    return encode_record(record).decode()


def pod(name: str = "p", *, annotation: str | None = None, phase: str | None = "Running",
        deleting: bool = False, labels: dict[str, str] | None = None) -> Pod:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "resourceVersion": "1", "labels": labels or {"app": "w"}}
    if annotation is not None:
        meta["annotations"] = {ANNOTATION: annotation, "other": "x"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod", "metadata": meta}
    if phase is not None:
        body["status"] = {"phase": phase}
    return Pod.from_dict(body)


# -- Pod → record ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, reason, status", [
    (dict(annotation=record_json()), "active", "active"),
    (dict(annotation=record_json(), deleting=True), "draining", "draining"),
    (dict(annotation=record_json(), phase="Pending"), "not-running", None),
    (dict(annotation=record_json(), phase="Succeeded", deleting=True), "not-running", None),
    (dict(annotation=record_json(), phase="Failed"), "not-running", None),
    (dict(annotation=record_json(), phase=None), "not-running", None),  # no status yet
    (dict(annotation=None), "no-annotation", None),
    (dict(annotation=""), "no-annotation", None),
    (dict(annotation="{not json"), "bad-annotation", None),
    (dict(annotation='{"worker_id": "x"}'), "bad-annotation", None),  # url/model_name missing
    (dict(annotation='{"worker_id": "x", "url": "u", "model_name": "m", "engine": "nope"}'), "bad-annotation", None),
    (dict(annotation="[]"), "bad-annotation", None),
])
def test_pod_state(kwargs: dict[str, Any], reason: str, status: str | None) -> None:
    state = pod_state(pod(**kwargs))
    assert state.reason == reason
    if status is None:
        assert state.record is None
    else:
        assert state.record is not None and state.record.status == status
        assert state.record.worker_id == "10.0.0.1:8000"


def test_pod_state_keeps_record_fields_when_draining() -> None:
    state = pod_state(pod(annotation=record_json(disagg_mode="prefill", dp_rank=1, dp_size=2), deleting=True))
    assert state.record is not None
    assert (state.record.disagg_mode, state.record.dp_rank, state.record.status) == ("prefill", 1, "draining")


# -- applying events to a fleet (no server) ----------------------------------------------------------

@pytest.fixture
def discovery() -> KubernetesDiscovery:
    # A config is given so nothing is read from the environment; no client until start().
    return KubernetesDiscovery("app=w", "ns", config=KubeConfig.from_server("http://127.0.0.1:1"))


def ids(fleet: Fleet) -> dict[str, str]:
    return {r.worker_id: r.status for r in fleet.all()}


def test_apply_add_drain_delete(discovery: KubernetesDiscovery) -> None:
    fleet = Fleet()
    discovery._apply(fleet, "ADDED", pod("a", annotation=record_json("w1")))
    assert ids(fleet) == {"w1": "active"}
    discovery._apply(fleet, "MODIFIED", pod("a", annotation=record_json("w1"), deleting=True))
    assert ids(fleet) == {"w1": "draining"} and fleet.active() == ()
    discovery._apply(fleet, "DELETED", pod("a", annotation=record_json("w1"), deleting=True))
    assert ids(fleet) == {}


@pytest.mark.parametrize("change", [
    dict(annotation=None), dict(annotation="{bad"), dict(annotation=record_json("w1"), phase="Failed"),
])
def test_apply_removes_when_pod_stops_qualifying(discovery: KubernetesDiscovery, change: dict[str, Any]) -> None:
    fleet = Fleet()
    discovery._apply(fleet, "ADDED", pod("a", annotation=record_json("w1")))
    discovery._apply(fleet, "MODIFIED", pod("a", **change))
    assert ids(fleet) == {}


def test_apply_worker_id_change_removes_old_id(discovery: KubernetesDiscovery) -> None:
    fleet = Fleet()
    discovery._apply(fleet, "ADDED", pod("a", annotation=record_json("w1")))
    discovery._apply(fleet, "MODIFIED", pod("a", annotation=record_json("w2")))
    assert ids(fleet) == {"w2": "active"}


def test_apply_shared_worker_id_survives_one_pod_leaving(discovery: KubernetesDiscovery) -> None:
    fleet = Fleet()
    discovery._apply(fleet, "ADDED", pod("a", annotation=record_json("w1")))
    discovery._apply(fleet, "ADDED", pod("b", annotation=record_json("w1")))
    discovery._apply(fleet, "DELETED", pod("a", annotation=record_json("w1")))
    assert ids(fleet) == {"w1": "active"}
    discovery._apply(fleet, "DELETED", pod("b", annotation=record_json("w1")))
    assert ids(fleet) == {}


def test_bad_annotation_logged_once_per_value(discovery: KubernetesDiscovery, caplog) -> None:
    fleet = Fleet()
    caplog.set_level(logging.WARNING, logger="infera.discovery.kubernetes")
    for _ in range(3):
        discovery._apply(fleet, "MODIFIED", pod("a", annotation="{bad"))
    assert len([r for r in caplog.records if "undecodable" in r.getMessage()]) == 1
    discovery._apply(fleet, "MODIFIED", pod("a", annotation="{worse"))
    assert len([r for r in caplog.records if "undecodable" in r.getMessage()]) == 2
    assert ids(fleet) == {}


# -- config loading and error classification ---------------------------------------------------------

def test_load_kube_config_in_cluster(tmp_path, monkeypatch) -> None:
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("tok")
    (sa / "namespace").write_text("infera")
    (sa / "ca.crt").write_text("")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "ignored"))
    single = load_kube_config(str(sa)).get()
    assert single.cluster.server == "https://10.96.0.1:443"
    assert single.user is not None and single.user.token_file == str(sa / "token")
    assert single.namespace == "infera"


def test_load_kube_config_kubeconfig_list(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    conf = tmp_path / "config"
    conf.write_text("clusters: [{name: c, cluster: {server: 'http://127.0.0.1:9'}}]\n"
                    "contexts: [{name: x, context: {cluster: c}}]\ncurrent-context: x\n")
    monkeypatch.setenv("KUBECONFIG", f"{tmp_path / 'missing'}:{conf}")
    assert load_kube_config(str(tmp_path / "no-sa")).get().cluster.server == "http://127.0.0.1:9"


def test_load_kube_config_unusable_file(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    conf = tmp_path / "config"
    conf.write_text("just: [a, list")
    monkeypatch.setenv("KUBECONFIG", str(conf))
    with pytest.raises(KubeConfigError, match="unusable kubeconfig"):
        load_kube_config(str(tmp_path / "no-sa"))


def test_load_kube_config_none(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    with pytest.raises(KubeConfigError, match="no Kubernetes API config"):
        load_kube_config(str(tmp_path / "no-sa"))


@pytest.mark.parametrize("exc, retry", [
    (ApiError(status=Status(code=503, reason="ServiceUnavailable", message="x")), True),
    (ApiError(status=Status(code=429, reason="TooManyRequests", message="x")), True),
    (ApiError(status=Status(code=404, reason="NotFound", message="x")), False),
    (ApiError(status=Status(code=403, reason="Forbidden", message="x")), False),
    (_httpx.ConnectError("refused"), True),
    (_httpx.RemoteProtocolError("eof"), True),
    (ConnectionRefusedError(), True),
    (ValueError("bug"), False),
])
def test_retryable(exc: BaseException, retry: bool) -> None:
    assert _retryable(exc) is retry


def _http_error(body: dict[str, Any] | bytes, code: int) -> _httpx.HTTPStatusError:
    """What lightkube raises for an error answer to a watch request (the body read by the hook)."""
    request = _httpx.Request("GET", "http://k8s/api/v1/namespaces/ns/pods?watch=true")
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    response = _httpx.Response(code, content=content, request=request,
                               headers={"Content-Type": "application/json"})
    return _httpx.HTTPStatusError(f"{code}", request=request, response=response)


_OLD_TOO_LARGE = status_body(504, "Timeout", "Timeout: Too large resource version: 9, current: 5",
                             {"causes": [{"message": "Too large resource version"}]})  # 1.17.0-1.18.5: no cause type
_OLDEST_TOO_LARGE = status_body(504, "Timeout", "Timeout: Too large resource version: 9, current: 5")  # < 1.17


@pytest.mark.parametrize("exc, stale", [
    (ApiError(status=Status.from_dict(too_large_status(9, 5))), "too-large"),  # a watch ERROR event
    (_http_error(too_large_status(9, 5), 504), "too-large"),  # the HTTP 504 itself
    (ApiError(status=Status.from_dict(_OLD_TOO_LARGE)), "too-large"),
    (ApiError(status=Status.from_dict(_OLDEST_TOO_LARGE)), "too-large"),
    (ApiError(status=Status.from_dict(status_body(410, "Expired", "too old resource version: 1 (5)"))), "expired"),
    (_http_error(status_body(410, "Expired", "too old"), 410), "expired"),
    (_http_error(b"", 410), "expired"),
    # A 504 for another reason, or a bare one (a proxy's, no Status), is an ordinary failure.
    (ApiError(status=Status.from_dict(status_body(504, "Timeout", "Timeout: request did not complete"))), None),
    (_http_error(b"<html>gateway timeout</html>", 504), None),
    (ApiError(status=Status.from_dict(status_body(500, "InternalError", "Too large resource version"))), None),
    (_httpx.ConnectError("refused"), None),
])
def test_stale_resource_version(exc: BaseException, stale: str | None) -> None:
    assert _stale_resource_version(exc) == stale


def test_describe_uses_the_status_of_an_http_error_answer() -> None:
    assert _describe(_http_error(too_large_status(9, 5), 504)) == (
        "HTTP 504 Timeout: Timeout: Too large resource version: 9, current: 5")
    forbidden = status_body(403, "Forbidden", 'pods is forbidden: User "x" cannot watch resource "pods"')
    assert _describe(_http_error(forbidden, 403)).startswith('HTTP 403 Forbidden: pods is forbidden')
    assert _describe(_http_error(b"nope", 502)).startswith("HTTPStatusError: ")


# -- the fake API server's own logic -----------------------------------------------------------------

def _pod_dict(phase: str = "Running", name: str = "p", node: str | None = "n1") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"nodeName": node} if node else {},
            "status": {"phase": phase}}


@pytest.mark.parametrize("selector, pod_kw, match", [
    ("", {}, True),
    ("status.phase=Running", {}, True),
    ("status.phase==Running", {"phase": "Pending"}, False),
    ("status.phase!=Running", {"phase": "Pending"}, True),
    ("metadata.name=p,status.phase=Running", {}, True),
    ("metadata.name=p,status.phase=Running", {"name": "q"}, False),
    ("spec.nodeName=", {"node": None}, True),  # unscheduled: an empty nodeName
    ("spec.nodeName!=", {}, True),
    (" metadata.namespace = ns ", {}, True),
])
def test_fake_field_selector(selector: str, pod_kw: dict[str, Any], match: bool) -> None:
    assert fields_match(parse_field_selector(selector), _pod_dict(**pod_kw)) is match


@pytest.mark.parametrize("bad, unsupported", [
    ("spec.restartPolicy=Always", "spec.restartPolicy"),  # a real server has it; the fake does not
    ("status.phase=Running,spec.foo=x", "spec.foo"),
    ("status.phase", None),
    ("status.phase in (Running)", None),
    ("status.phase=Running,", None),
])
def test_fake_field_selector_refuses(bad: str, unsupported: str | None) -> None:
    with pytest.raises(FieldSelectorError) as exc:
        parse_field_selector(bad)
    assert exc.value.unsupported == unsupported
    if unsupported:
        assert str(exc.value) == f"field label not supported: {unsupported}"


@pytest.mark.parametrize("selector, labels, match", [
    ("", {}, True),
    ("app=w", {"app": "w"}, True),
    ("app==w", {"app": "w"}, True),
    ("app=w", {"app": "x"}, False),
    ("app=w", {}, False),
    ("app!=w", {"app": "x"}, True),
    ("app!=w", {}, True),  # != also matches a missing key
    ("app!=w", {"app": "w"}, False),
    ("app in (w, x)", {"app": "x"}, True),
    ("app in (w,x)", {"app": "y"}, False),
    ("app in (w,x)", {}, False),
    ("app notin (w,x)", {"app": "y"}, True),
    ("app notin (w,x)", {}, True),
    ("app", {"app": ""}, True),
    ("app", {"other": "1"}, False),
    ("!app", {"other": "1"}, True),
    ("app=w,tier in (a,b),!old", {"app": "w", "tier": "b"}, True),
    ("app=w,tier in (a,b),!old", {"app": "w", "tier": "b", "old": "1"}, False),
    ("infera.amd.com/deployment=d1", {"infera.amd.com/deployment": "d1"}, True),
    (" app = w , role ", {"app": "w", "role": "p"}, True),
])
def test_fake_selector(selector: str, labels: dict[str, str], match: bool) -> None:
    assert selector_matches(parse_selector(selector), labels) is match


@pytest.mark.parametrize("bad", ["app=w,", "app in (w", "app in ()", "=w", "a b", "app=w)"])
def test_fake_selector_rejects(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_selector(bad)


@pytest.mark.parametrize("target, patch, result", [  # RFC 7386 appendix A, abridged
    ({"a": "b"}, {"a": "c"}, {"a": "c"}),
    ({"a": "b"}, {"b": "c"}, {"a": "b", "b": "c"}),
    ({"a": "b"}, {"a": None}, {}),
    ({"a": "b", "b": "c"}, {"a": None}, {"b": "c"}),
    ({"a": ["b"]}, {"a": "c"}, {"a": "c"}),
    ({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}, {"a": {"b": "d"}}),
    ({"a": [{"b": "c"}]}, {"a": [1]}, {"a": [1]}),
    ({}, {"a": {"bb": {"ccc": None}}}, {"a": {"bb": {}}}),
    ({"a": "foo"}, None, None),
])
def test_fake_merge_patch(target: Any, patch: Any, result: Any) -> None:
    assert merge_patch(target, patch) == result


def test_record_json_roundtrip_in_annotation() -> None:
    raw = record_json("w9", kv_block_size=16)
    assert msgspec.json.decode(raw)["worker_id"] == "w9"
    assert pod_state(pod(annotation=raw)).record.kv_block_size == 16


def test_backend_factories_build_kubernetes_classes() -> None:
    from infera.discovery import make_discovery, make_registration
    from infera.discovery.kubernetes import KubernetesRegistration

    config = KubeConfig.from_server("http://127.0.0.1:1")
    d = make_discovery("kubernetes", k8s_label_selector="app=w", k8s_namespace="ns", config=config)
    assert isinstance(d, KubernetesDiscovery) and (d.label_selector, d.namespace) == ("app=w", "ns")
    r = make_registration("kubernetes", k8s_namespace="ns", k8s_pod_name="p-0", config=config, refresh_s=5)
    assert isinstance(r, KubernetesRegistration) and (r.namespace, r.pod_name, r.refresh_s) == ("ns", "p-0", 5)


# -- the error-body hook: bounded -------------------------------------------------------------------

class _Chunks(_httpx.AsyncByteStream):
    """A streamed body of ``count`` chunks (an error answer that may never end)."""

    def __init__(self, chunk: bytes, count: int) -> None:
        self.chunk, self.count, self.sent, self.closed = chunk, count, 0, False

    async def __aiter__(self):
        while self.sent < self.count:
            self.sent += 1
            yield self.chunk

    async def aclose(self) -> None:
        self.closed = True


def _streamed(code: int, stream: _Chunks) -> Any:
    return _httpx.Response(code, stream=stream, request=_httpx.Request("GET", "http://k8s/api/v1/pods?watch=true"))


async def test_the_error_body_hook_reads_a_status_and_stops_at_its_bound() -> None:
    body = msgspec.json.encode(too_large_status(9, 5))
    small = _streamed(504, _Chunks(body, 1))
    await _read_error_body(small)
    assert _stale_resource_version(_httpx.HTTPStatusError("504", request=small.request, response=small)) == "too-large"
    assert small.json()["code"] == 504  # what lightkube reads afterwards is the same body

    endless = _Chunks(b"x" * 4096, 10**9)
    huge = _streamed(504, endless)
    await _read_error_body(huge)  # returns: it stops reading just past the bound
    assert endless.sent * 4096 <= MAX_ERROR_BODY_BYTES + 4096 and endless.closed
    error = _httpx.HTTPStatusError("504", request=huge.request, response=huge)
    assert _stale_resource_version(error) is None and _describe(error) == "HTTPStatusError: 504"

    ok = _streamed(200, _Chunks(b"{}", 1))
    await _read_error_body(ok)  # a success is never read here: a watch's stream stays lightkube's
    assert ok.stream.sent == 0
