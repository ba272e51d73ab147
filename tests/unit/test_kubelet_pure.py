"""Pure parts of the local test cluster (tests/fakes/kubelet.py) and its DNS hook."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fakes import kubelet as kl
from tests.fakes.pod_sitecustomize import sitecustomize as dns


def _template(image: str = "busybox", args: list[str] | None = None) -> dict:
    return {"metadata": {"labels": {"app": "x"}},
            "spec": {"containers": [{"name": "main", "image": image, "args": args or ["a"]}]}}


def test_template_hash_is_stable_and_changes_with_the_template():
    h = kl.template_hash(_template())
    assert h == kl.template_hash(json.loads(json.dumps(_template())))  # key order, copies: same hash
    assert len(h) == 10 and set(h) <= set(kl.SAFE_ALPHABET)
    assert kl.template_hash(_template(args=["b"])) != h
    # Same in another interpreter (no per-process hash seed involved).
    code = ("import json; from tests.fakes import kubelet as kl; print(kl.template_hash(json.loads(%r)))"
            % json.dumps(_template()))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=kl.REPO_ROOT, env={**os.environ, "PYTHONHASHSEED": "123"}).stdout.strip()
    assert out == h


def test_field_ref_values():
    pod = {"metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "web"},
                        "annotations": {"a/b": "c"}},
           "spec": {"nodeName": "local-node", "serviceAccountName": "sa"}}
    assert kl.field_ref_value(pod, "metadata.name") == "p"
    assert kl.field_ref_value(pod, "metadata.namespace") == "ns"
    assert kl.field_ref_value(pod, "status.podIP", pod_ip="127.0.10.3") == "127.0.10.3"
    assert kl.field_ref_value(pod, "spec.nodeName") == "local-node"
    assert kl.field_ref_value(pod, "metadata.labels['app']") == "web"
    assert kl.field_ref_value(pod, "metadata.annotations['a/b']") == "c"
    assert kl.field_ref_value(pod, "metadata.labels['missing']") == ""
    with pytest.raises(ValueError, match="spec.bogus"):
        kl.field_ref_value(pod, "spec.bogus")


def test_expand_vars_as_kubernetes():
    env = {"POD_IP": "127.0.10.2", "PORT": "8000"}
    assert kl.expand_vars("--host=$(POD_IP):$(PORT)", env) == "--host=127.0.10.2:8000"
    assert kl.expand_vars("$(UNDEFINED)", env) == "$(UNDEFINED)"
    assert kl.expand_vars("$$(POD_IP)", env) == "$(POD_IP)"


def test_rewrite_value_binds_the_pod_ip_and_maps_mount_paths():
    mounts = [("/data", "/w/pvc/data-0"), ("/data/cache", "/w/cache"), ("/etc/nats", "/w/cfg")]
    rw = lambda v: kl.rewrite_value(v, "127.0.10.7", mounts)
    assert rw("0.0.0.0") == "127.0.10.7"
    assert rw("--host=0.0.0.0") == "--host=127.0.10.7"
    assert rw("http://0.0.0.0:2379") == "http://127.0.10.7:2379"
    assert rw("--store_dir=/data/js") == "--store_dir=/w/pvc/data-0/js"
    assert rw("/data/cache/x") == "/w/cache/x"  # the longest mount path wins
    assert rw("/data") == "/w/pvc/data-0"
    assert rw("/database") == "/database"  # not a path under /data
    assert rw("/opt/data") == "/opt/data"
    assert rw("-c /etc/nats/nats.conf") == "-c /w/cfg/nats.conf"
    assert rw("127.0.0.1") == "127.0.0.1"


def test_container_argv_and_image_table():
    images = kl.default_images()
    argv = kl.container_argv({"command": ["python3", "-m", "x"], "args": ["--y"]}, images)
    assert argv == ["python3", "-m", "x", "--y"]
    assert kl.container_argv({"name": "n", "image": "nats:2.10"}, images) == ["nats-server"]
    assert kl.container_argv({"name": "n", "image": "docker.io/library/nats:2.10-alpine", "args": ["-js"]},
                             images) == ["nats-server", "-js"]
    assert kl.container_argv({"name": "e", "image": "quay.io/coreos/etcd:v3.5.17", "args": ["--name", "e"]},
                             images) == ["etcd", "--name", "e"]
    with pytest.raises(ValueError, match="registry.example/infera:1.*no local mapping"):
        kl.container_argv({"name": "main", "image": "registry.example/infera:1"}, images)
    assert kl.image_repository("localhost:5000/team/img:tag@sha256:abc") == "localhost:5000/team/img"
    assert kl.image_repository("localhost:5000/img") == "localhost:5000/img"
    assert kl.resolve_program("python3") == sys.executable
    assert kl.resolve_program("/usr/local/bin/python3.11") == sys.executable


def test_probe_thresholds():
    timing = kl.ProbeTiming.from_probe({"periodSeconds": 10, "initialDelaySeconds": 30, "failureThreshold": 2,
                                        "successThreshold": 2, "timeoutSeconds": 3}, cap=0.5)
    assert (timing.period, timing.initial_delay, timing.timeout) == (0.5, 0.5, 3.0)
    assert kl.ProbeTiming.from_probe({}) == kl.ProbeTiming(0.0, 10.0, 1.0, 1, 3)
    readiness = kl.ProbeState(timing)
    assert readiness.record(True) is False  # one success of two
    assert readiness.record(True) is True
    assert readiness.record(False) is True  # one failure of two
    assert readiness.record(True) is True
    assert readiness.record(False) is True
    assert readiness.record(False) is False
    liveness = kl.ProbeState(kl.ProbeTiming(failure_threshold=3), initial=True)
    assert [liveness.record(False) for _ in range(3)] == [True, True, False]


def test_restart_backoff_doubles_to_the_cap():
    assert [kl.restart_delay(n) for n in range(7)] == [10, 20, 40, 80, 160, 300, 300]
    assert kl.restart_delay(0, base=0.5, cap=2) == 0.5 and kl.restart_delay(5, base=0.5, cap=2) == 2


def test_lws_names_and_leader_address():
    assert kl.lws_pod_names("w", 2, 3) == [("w-0", 0, 0), ("w-0-1", 0, 1), ("w-0-2", 0, 2),
                                           ("w-1", 1, 0), ("w-1-1", 1, 1), ("w-1-2", 1, 2)]
    assert kl.lws_pod_names("w", 1, 1) == [("w-0", 0, 0)]
    assert kl.lws_leader_address("w", 1, "ns") == "w-1.w.ns"


def test_pod_ips_stay_out_of_service_and_host_addresses():
    ips = [kl.allocate_ip(i) for i in range(600)]
    assert ips[0] == "127.0.10.1" and len(set(ips)) == 600
    for ip in ips:
        octets = [int(x) for x in ip.split(".")]
        assert octets[:2] == [127, 0] and 10 <= octets[2] < 200 and 1 <= octets[3] <= 254
    with pytest.raises(ValueError):
        kl.allocate_ip(190 * 254)


def test_int_or_percent_and_selectors():
    assert kl.int_or_percent("25%", 3, round_up=True, default=1) == 1
    assert kl.int_or_percent("25%", 3, round_up=False, default=0) == 0
    assert kl.int_or_percent(2, 3, round_up=True, default=1) == 2
    assert kl.int_or_percent(None, 3, round_up=True, default=1) == 1
    sel = {"matchLabels": {"app": "a"}, "matchExpressions": [{"key": "tier", "operator": "In", "values": ["x"]}]}
    assert kl.label_selector_matches(sel, {"app": "a", "tier": "x"})
    assert not kl.label_selector_matches(sel, {"app": "a", "tier": "y"})
    assert not kl.selector_matches({}, {"app": "a"})
    assert kl.selector_matches({"app": "a"}, {"app": "a", "b": "c"})


def test_dns_search_path_and_lookup():
    records = {"web.ns.svc.cluster.local": ["127.0.200.4"], "lws-0.lws.ns.svc.cluster.local": ["127.0.10.9"]}
    for name in ("web", "web.ns", "web.ns.svc", "web.ns.svc.cluster.local", "WEB.ns.svc.cluster.local."):
        assert dns.lookup(records, name, "ns") == ["127.0.200.4"], name
    assert dns.lookup(records, "web", "other") is None  # a short name is looked up in the Pod's namespace
    assert dns.lookup(records, "web.ns", "other") == ["127.0.200.4"]
    assert dns.lookup(records, "lws-0.lws.ns", "ns") == ["127.0.10.9"]
    assert dns.lookup(records, "example.com", "ns") is None


def test_dns_hook_in_a_child_interpreter(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"records": {"web.ns.svc.cluster.local": ["127.0.200.9"]}}))
    code = ("import socket; print(socket.gethostbyname('web')); "
            "print(socket.getaddrinfo('web.ns.svc', 80, type=socket.SOCK_STREAM)[0][4][0]); "
            "print(socket.gethostbyname('localhost'))")
    env = {**os.environ, "PYTHONPATH": str(kl.SITECUSTOMIZE_DIR), dns.HOSTS_ENV: str(hosts), dns.NAMESPACE_ENV: "ns"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["127.0.200.9", "127.0.200.9", "127.0.0.1"]


def test_hosts_file_rereads_on_change(tmp_path):
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"records": {"a.ns.svc.cluster.local": ["127.0.200.1"]}}))
    hosts = dns.HostsFile(str(path))
    assert hosts.records() == {"a.ns.svc.cluster.local": ["127.0.200.1"]}
    tmp = tmp_path / "hosts.tmp"
    tmp.write_text(json.dumps({"records": {"b.ns.svc.cluster.local": ["127.0.200.2"]}}))
    os.replace(tmp, path)
    assert hosts.records() == {"b.ns.svc.cluster.local": ["127.0.200.2"]}


def test_pod_from_template_adds_env_labels_owner_and_node():
    template = {"metadata": {"labels": {"app": "w"}},
                "spec": {"containers": [{"name": "main", "env": [{"name": "LWS_WORKER_INDEX", "value": "stale"},
                                                                  {"name": "X", "value": "1"}]}]}}
    owner = {"uid": "u", "name": "o", "kind": "LeaderWorkerSet"}
    pod = kl.pod_from_template(template, name="w-0-1", namespace="ns", owner=owner, labels={"g": "0"},
                               env=[{"name": "LWS_WORKER_INDEX", "value": "1"}])
    assert pod["metadata"]["labels"] == {"app": "w", "g": "0"}
    assert pod["metadata"]["ownerReferences"] == [owner]
    assert pod["spec"]["nodeName"] == kl.NODE_NAME
    assert pod["spec"]["containers"][0]["env"] == [{"name": "LWS_WORKER_INDEX", "value": "1"},
                                                   {"name": "X", "value": "1"}]
    assert template["spec"]["containers"][0]["env"][0]["value"] == "stale"  # the template is not changed


def test_nats_and_etcd_bind_to_the_pod_ip():
    ip = "127.0.10.4"
    assert kl.bind_to_pod_ip(["nats-server", "-js", "-m", "8222"], ip) == ["nats-server", "-js", "-m", "8222", "-a", ip]
    assert kl.bind_to_pod_ip(["/x/nats-server", "--addr=127.0.0.5"], ip) == ["/x/nats-server", "--addr=127.0.0.5"]
    assert kl.bind_to_pod_ip(["etcd", "--data-dir", "/d"], ip) == [
        "etcd", "--data-dir", "/d", "--listen-client-urls", f"http://{ip}:2379", "--advertise-client-urls",
        f"http://{ip}:2379", "--listen-peer-urls", f"http://{ip}:2380"]
    argv = ["etcd", f"--listen-client-urls=http://{ip}:2379", "--advertise-client-urls", "http://e:2379"]
    assert kl.bind_to_pod_ip(argv, ip)[-2:] == ["--listen-peer-urls", f"http://{ip}:2380"]
    assert kl.bind_to_pod_ip(["python3", "-m", "x"], ip) == ["python3", "-m", "x"]


def test_dns_hook_covers_uvloop(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps({"records": {"web.ns.svc.cluster.local": ["127.0.0.1"]}}))
    code = """
import asyncio, socket, uvloop
async def main():
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo("web.ns.svc", port, type=socket.SOCK_STREAM)
    reader, writer = await asyncio.open_connection("web", port)
    print(type(loop).__module__, infos[0][4][0], writer.get_extra_info("peername")[0])
    writer.close()
    server.close()
uvloop.run(main())
"""
    env = {**os.environ, "PYTHONPATH": str(kl.SITECUSTOMIZE_DIR), dns.HOSTS_ENV: str(hosts), dns.NAMESPACE_ENV: "ns"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["uvloop", "127.0.0.1", "127.0.0.1"]


def test_service_ip_from_the_api_else_a_local_one(tmp_path):
    kubelet = kl.LocalKubelet("http://127.0.0.1:1", None, tmp_path)
    given = {"metadata": {"name": "a", "uid": "1"}, "spec": {"clusterIP": "127.0.200.7"}}
    headless = {"metadata": {"name": "b", "uid": "2"}, "spec": {"clusterIP": "None"}}
    missing = {"metadata": {"name": "c", "uid": "3"}, "spec": {}}
    other = {"metadata": {"name": "d", "uid": "4"}, "spec": {}}
    assert kubelet.service_ip(given) == "127.0.200.7"
    assert kubelet.service_ip(headless) is None
    assert kubelet.service_ip(missing) == "127.0.255.1" == kubelet.service_ip(missing)
    assert kubelet.service_ip(other) == "127.0.255.2"


def _plan(new, old, replicas, surge=1, unavailable=0):
    """plan_rollout over (name, ready, created) tuples; returns (create, deleted names)."""
    create, delete = kl.plan_rollout(new, old, replicas, surge, unavailable, lambda p: p[1], lambda p: p[2])
    return create, [p[0] for p in delete]


def test_rollout_surges_one_and_keeps_every_replica_ready():
    old = [("o1", True, 1), ("o2", True, 2), ("o3", True, 3)]
    assert _plan([], old, 3) == (1, [])  # surge one new Pod first, delete nothing yet
    assert _plan([("n1", False, 4)], old, 3) == (0, [])  # the new one is not ready: wait
    assert _plan([("n1", True, 4)], old, 3) == (0, ["o3"])  # ready: one old goes, newest first
    assert _plan([("n1", True, 4)], old[:2], 3) == (1, [])  # then the next new Pod
    assert _plan([("n1", True, 4), ("n2", True, 5), ("n3", True, 6)], [], 3) == (0, [])


def test_rollout_with_max_unavailable_and_unready_old_pods():
    old = [("o1", True, 1), ("o2", True, 2), ("o3", True, 3)]
    # maxSurge 0 / maxUnavailable 1: one old Pod goes before any new one exists.
    assert _plan([], old, 3, surge=0, unavailable=1) == (0, ["o3"])
    assert _plan([], old[:2], 3, surge=0, unavailable=1) == (1, [])
    # An unready old Pod goes at once, whatever the budget.
    assert _plan([("n1", False, 4)], [("o1", True, 1), ("o2", False, 2), ("o3", True, 3)], 3) == (0, ["o2"])


def test_scale_without_rollout():
    assert _plan([("a", True, 1)], [], 3) == (2, [])
    # Down: unready first, then newest.
    assert _plan([("a", True, 1), ("b", False, 2), ("c", True, 3), ("d", True, 4)], [], 2) == (0, ["b", "d"])
