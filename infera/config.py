"""CLI helpers shared by every entry point: "flag > env > default" and endpoint parsing."""
from __future__ import annotations

import argparse
import json
import os
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")


def add_flag(
    parser: argparse.ArgumentParser,
    *names: str,
    env: str | None = None,
    default: Any = None,
    environ: Mapping[str, str] | None = None,
    **kwargs: Any,
) -> argparse.Action:
    """Add a flag whose default comes from ``env`` when set, else ``default``.

    argparse runs ``type`` over string defaults, so an env value is validated exactly like a flag.
    """
    environ = os.environ if environ is None else environ
    if env and env in environ:
        default = environ[env]
        if kwargs.get("action") in ("store_true", "store_false", argparse.BooleanOptionalAction):
            default = parse_bool(default)  # argparse does not convert defaults of switches
    choices = getattr(kwargs.get("type"), "choices", None)
    if choices and "metavar" not in kwargs:
        kwargs["metavar"] = "{" + ",".join(choices) + "}"
    helptext = kwargs.pop("help", "")
    if env:
        helptext = f"{helptext} [env {env}]".strip()
    return parser.add_argument(*names, default=default, help=helptext, **kwargs)


def parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {value!r}")


def positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {value!r}")
    return n


def non_negative_int(value: str) -> int:
    n = int(value)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
    return n


def non_negative_float(value: str) -> float:
    x = float(value)
    if x < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {value!r}")
    return x


def positive_float(value: str) -> float:
    x = float(value)
    if x <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {value!r}")
    return x


def etcd_url(value: str) -> str:
    """``host:port``, ``host`` (→ :2379) or ``http(s)://host[:port]`` → base URL without a slash."""
    v = value.strip()
    if "://" in v:
        scheme, rest = v.split("://", 1)
        rest = rest.rstrip("/")
        if scheme not in ("http", "https") or not rest:
            raise argparse.ArgumentTypeError(f"bad etcd endpoint {value!r}: expected http(s)://host[:port]")
        return f"{scheme}://{rest}" if _has_port(rest) else f"{scheme}://{rest}:2379"
    v = v.rstrip("/")
    if not v:
        raise argparse.ArgumentTypeError("empty etcd endpoint")
    return f"http://{v}" if _has_port(v) else f"http://{v}:2379"


def _has_port(hostport: str) -> bool:
    if hostport.startswith("["):  # [v6]:port
        return "]:" in hostport
    return hostport.count(":") == 1 and hostport.rsplit(":", 1)[1].isdigit()


def optional_file(value: str) -> str | None:
    """A file-path flag: surrounding blanks dropped, empty = unset (an empty env variable turns it off)."""
    return value.strip() or None


def readable_file(value: str) -> str | None:
    """argparse type of a credentials or TLS file flag (the NATS ones): unreadable is a usage error at start."""
    if not value.strip():
        return None  # an empty env variable turns it off
    path = os.path.expanduser(value.strip())
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror or exc}") from None
    return path


def etcd_prefix(value: str) -> str:
    v = value.strip()
    if not v:
        raise argparse.ArgumentTypeError("empty etcd prefix")
    return v if v.endswith("/") else v + "/"


def choice_of(*choices: str) -> Callable[[str], str]:
    def conv(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from {', '.join(choices)})")
        return value

    conv.__name__ = "choice"
    conv.choices = choices  # type: ignore[attr-defined]  # shown as the flag's metavar
    return conv


def json_object(value: str) -> dict:
    """argparse ``type`` for a JSON-object flag."""
    try:
        obj = json.loads(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def json_config(build: Callable[[dict], T]) -> Callable[[str], T]:
    """argparse ``type`` for a JSON-object flag turned into a config by ``build`` (whose
    TypeError/ValueError becomes the flag's error message)."""
    def conv(value: str) -> T:
        obj = json_object(value)
        try:
            return build(obj)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = "JSON"
    return conv


def port_number(value: str) -> int:
    n = int(value)
    if not 0 <= n <= 65535:
        raise argparse.ArgumentTypeError(f"not a port number: {value!r}")
    return n


# -- deployment planes -------------------------------------------------------------------------------
DISCOVERY_CHOICES = ("etcd", "kubernetes")
REQUEST_TRANSPORTS = ("http", "nats")
KV_EVENT_TRANSPORTS = ("zmq", "nats")
DEFAULT_NATS_SERVER = "nats://127.0.0.1:4222"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


def in_kubernetes(environ: Mapping[str, str] | None = None) -> bool:
    """Inside a Pod: the kubelet sets KUBERNETES_SERVICE_HOST in every container."""
    environ = os.environ if environ is None else environ
    return bool(environ.get("KUBERNETES_SERVICE_HOST"))


def default_plane(environ: Mapping[str, str] | None = None) -> tuple[str, str, str]:
    """(discovery, request transport, KV-event transport) when no flag or env names them: the
    production plane inside a Pod, the no-broker dev plane elsewhere."""
    if in_kubernetes(environ):
        return "kubernetes", "nats", "nats"
    return "etcd", "http", "zmq"


def default_k8s_namespace(environ: Mapping[str, str] | None = None, sa_dir: str = SERVICE_ACCOUNT_DIR) -> str:
    """POD_NAMESPACE, else the Pod's service-account namespace, else ``default``."""
    environ = os.environ if environ is None else environ
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"]
    try:
        with open(os.path.join(sa_dir, "namespace")) as f:
            ns = f.read().strip()
            if ns:
                return ns
    except OSError:
        pass
    return "default"


def add_plane_flags(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Discovery, transports and NATS flags shared by the server and every worker launcher."""
    environ = os.environ if environ is None else environ
    discovery, request_transport, kv_transport = default_plane(environ)
    f = lambda *a, **k: add_flag(parser, *a, environ=environ, **k)  # noqa: E731
    f("--discovery-backend", env="INFERA_DISCOVERY_BACKEND", default=discovery, type=choice_of(*DISCOVERY_CHOICES),
      help="where worker records live (default: kubernetes inside a Pod, else etcd)")
    f("--etcd-endpoint", env="INFERA_ETCD_ENDPOINT", default=None, type=etcd_url,
      help="host:port, host (→ :2379) or http(s)://host:port")
    f("--etcd-prefix", env="INFERA_ETCD_PREFIX", default="/infera/workers/", type=etcd_prefix,
      help="key prefix of worker records")
    f("--fleet-key-file", env="INFERA_FLEET_KEY_FILE", default=None, type=optional_file,
      help="file holding the fleet's shared secret (>= 16 bytes, e.g. `openssl rand -hex 32`): workers sign "
           "their records with it (HMAC-SHA256), servers ignore records it did not sign, so writing to etcd or "
           "to a Pod's annotations is not enough to receive traffic (default: off, records are trusted). "
           "Several comma-separated files: the first signs, every one is accepted (key rotation)")
    # etcd credentials and TLS (infera/discovery/etcd.py EtcdAuth), checked at start. The password is
    # never a flag (argv is readable by every local user): INFERA_ETCD_PASSWORD or a file.
    f("--etcd-user", env="INFERA_ETCD_USER", default=None, type=optional_file,
      help="etcd user (etcd authentication); its password from --etcd-password-file or the INFERA_ETCD_PASSWORD "
           "env variable")
    f("--etcd-password-file", env="INFERA_ETCD_PASSWORD_FILE", default=None, type=optional_file,
      help="file holding the etcd user's password (else INFERA_ETCD_PASSWORD)")
    f("--etcd-cacert", env="INFERA_ETCD_CACERT", default=None, type=optional_file,
      help="CA bundle (PEM) that verifies etcd's certificate on an https:// endpoint (default: the system CAs)")
    f("--etcd-cert", env="INFERA_ETCD_CERT", default=None, type=optional_file,
      help="client certificate (PEM) for etcd's --client-cert-auth; with --etcd-key")
    f("--etcd-key", env="INFERA_ETCD_KEY", default=None, type=optional_file,
      help="private key (PEM) of --etcd-cert")
    f("--k8s-namespace", env="INFERA_K8S_NAMESPACE", default=default_k8s_namespace(environ),
      help="namespace of the worker Pods (default: POD_NAMESPACE, the service account's, else default)")
    f("--request-transport", env="INFERA_REQUEST_TRANSPORT", default=request_transport,
      type=choice_of(*REQUEST_TRANSPORTS),
      help="how requests reach workers (default: nats inside a Pod, else http)")
    f("--kv-event-transport", env="INFERA_KV_EVENT_TRANSPORT", default=kv_transport,
      type=choice_of(*KV_EVENT_TRANSPORTS),
      help="how KV events reach routers (default: nats inside a Pod, else zmq)")
    f("--nats-server", env="NATS_SERVER", default=DEFAULT_NATS_SERVER,
      help="NATS URL(s), comma-separated (requests, KV events and replica sync on the NATS plane)")
    # NATS credentials and TLS (infera/transport/nats_auth.py); a file that cannot be read is a usage error
    # at start. Secrets never come as flags (argv is readable by every local user): files or env only.
    f("--nats-user", env="INFERA_NATS_USER", default=None,
      help="NATS user; its password from --nats-password-file or the INFERA_NATS_PASSWORD env variable")
    f("--nats-password-file", env="INFERA_NATS_PASSWORD_FILE", default=None, type=readable_file,
      help="file holding the NATS password (else INFERA_NATS_PASSWORD)")
    f("--nats-token-file", env="INFERA_NATS_TOKEN_FILE", default=None, type=readable_file,
      help="file holding a NATS auth token (else INFERA_NATS_TOKEN)")
    f("--nats-creds", env="INFERA_NATS_CREDS", default=None, type=readable_file,
      help="NATS JWT .creds file (user JWT + NKey seed; needs the nkeys package)")
    f("--nats-nkey-seed", env="INFERA_NATS_NKEY_SEED", default=None, type=readable_file,
      help="file holding a NATS NKey user seed (SU...; needs the nkeys package)")
    f("--nats-tls-ca", env="INFERA_NATS_TLS_CA", default=None, type=readable_file,
      help="CA bundle (PEM) that verifies the NATS server; turns TLS on")
    f("--nats-tls-cert", env="INFERA_NATS_TLS_CERT", default=None, type=readable_file,
      help="client certificate (PEM) for NATS TLS; with --nats-tls-key")
    f("--nats-tls-key", env="INFERA_NATS_TLS_KEY", default=None, type=readable_file,
      help="client certificate's private key (PEM) for NATS TLS")
    f("--nats-req-idle-timeout", env="INFERA_NATS_REQ_IDLE_TIMEOUT", default=900.0, type=non_negative_float,
      help="NATS requests: longest wait for the next reply chunk before 504 and a cancel (0 = forever)")
    f("--nats-req-max-duration", env="INFERA_NATS_REQ_MAX_DURATION", default=0.0, type=non_negative_float,
      help="NATS requests: hard cap on one request's total time (0 = off)")
    f("--nats-req-max-pending", env="INFERA_NATS_REQ_MAX_PENDING", default=0, type=non_negative_int,
      help="NATS requests: most requests in flight per worker; more get 429 with Retry-After and fail "
           "over to another worker (0 = off)")
