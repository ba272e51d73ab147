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
