"""Talking to the Kubernetes API, for :mod:`infera.discovery.kubernetes` (which re-exports these
names): the module's errors, loading the API's configuration (in a Pod, else ``$KUBECONFIG``, else
``~/.kube/config``), and reading the API's failures: the ``Status`` an error carries (also from the
body of an error answer to a watch, which a response hook reads within a bound), whether a
resourceVersion can no longer be watched from (410 Gone, 504 "Too large resource version") and
whether a failure is worth retrying.
"""
from __future__ import annotations

import asyncio
import os
from typing import Any, Union

from lightkube import ApiError, ConfigError, KubeConfig, SingleConfig
from lightkube.core import generic_client as _generic_client
from lightkube.models.meta_v1 import Status

from infera.config import SERVICE_ACCOUNT_DIR

DEFAULT_KUBECONFIG = "~/.kube/config"

# The HTTP library lightkube is built on (httpx2 in lightkube 1.x, httpx before): its transport
# errors are what a broken connection raises.
_httpx = _generic_client.httpx

KubeConfigLike = Union[KubeConfig, SingleConfig]


# --------------------------------------------------------------------------------------------
# Errors and config
# --------------------------------------------------------------------------------------------
class KubernetesError(Exception):
    """Base class for the failures this module raises."""


class KubeConfigError(KubernetesError):
    """No usable API server configuration (neither in a Pod nor a kubeconfig file)."""


class KubernetesRegistrationError(KubernetesError):
    """The worker could not write its record into its own Pod's annotation."""


def load_kube_config(service_account_dir: str = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """In-cluster service-account config inside a Pod, else ``$KUBECONFIG``, else ``~/.kube/config``.

    Same order as lightkube's ``KubeConfig.from_env``, except that ``KUBECONFIG`` may be a
    ``:``-separated list as with kubectl (the first existing file is used; files are not merged).
    """
    try:
        return KubeConfig.from_service_account(service_account_dir)
    except (ConfigError, KeyError):
        # ConfigError: no token/namespace files; KeyError: files present but not inside a Pod
        # (KUBERNETES_SERVICE_HOST/PORT unset).
        pass
    candidates = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p] or [DEFAULT_KUBECONFIG]
    for path in candidates:
        if os.path.isfile(os.path.expanduser(path)):
            try:
                return KubeConfig.from_file(path)
            except Exception as exc:  # bad YAML, missing sections, bad types: all "unusable"
                raise KubeConfigError(f"unusable kubeconfig {path}: {_describe(exc)}") from exc
    raise KubeConfigError(
        f"no Kubernetes API config: not inside a Pod (no service account at {service_account_dir} or "
        f"KUBERNETES_SERVICE_HOST unset) and no kubeconfig file at {', '.join(candidates)}")


def _config(config: KubeConfigLike | None) -> KubeConfigLike:
    return config if config is not None else load_kube_config()


def _api_status(exc: BaseException) -> Status | None:
    """The Kubernetes ``Status`` an error carries: an ``ApiError``'s (a watch ERROR event, an error
    answer lightkube decoded), or the body of an HTTP error answer that was read (see
    :func:`_read_error_body`)."""
    if isinstance(exc, ApiError):
        return exc.status
    if isinstance(exc, _httpx.HTTPStatusError):
        try:
            body = exc.response.json()
        except Exception:  # not read (a stream, a body past the bound), not JSON: no Status to go by
            return None
        if isinstance(body, dict) and body.get("kind") == "Status":
            try:
                return Status.from_dict(body)
            except Exception:
                return None
    return None


def _describe(exc: BaseException) -> str:
    status = _api_status(exc)
    if status is not None:
        code = status.code or _status_code(exc)
        return f"HTTP {code} {status.reason or ''}: {status.message or ''}".strip()
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _status_code(exc: BaseException) -> int | None:
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    if isinstance(exc, _httpx.HTTPStatusError):
        return exc.response.status_code
    return None


TOO_LARGE_CAUSE = "ResourceVersionTooLarge"  # metav1.CauseTypeResourceVersionTooLarge
TOO_LARGE_MESSAGE = "Too large resource version"


def _too_large_resource_version(exc: BaseException) -> bool:
    """kube-apiserver's answer to a watch (or a list) from a resourceVersion newer than it has: a
    504 Timeout ``Status`` whose cause is ``ResourceVersionTooLarge`` (servers before 1.18.6: only
    the cause message or the status message says "Too large resource version"). The same test as
    client-go's reflector (``isTooLargeResourceVersionError``)."""
    status = _api_status(exc)
    if status is None:
        return False
    causes = (status.details.causes or []) if status.details is not None else []
    if any(c.reason == TOO_LARGE_CAUSE for c in causes):
        return True
    if (status.code or _status_code(exc)) != 504:
        return False
    return any(c.message == TOO_LARGE_MESSAGE for c in causes) or TOO_LARGE_MESSAGE in (status.message or "")


def _stale_resource_version(exc: BaseException) -> str | None:
    """Why the watch cannot resume from our resourceVersion ("expired" / "too-large"), or None."""
    if _status_code(exc) == 410:
        return "expired"
    if _too_large_resource_version(exc):
        return "too-large"
    return None


MAX_ERROR_BODY_BYTES = 64 * 1024  # a Status is a few hundred bytes; a longer error body is not one


async def _read_error_body(response: Any) -> None:
    """An httpx response hook: read the body of an error answer before lightkube sees it, up to
    ``MAX_ERROR_BODY_BYTES`` (a hostile or broken server's endless error body is closed, not read on).
    lightkube streams a watch and raises on its status without reading the body, which holds the
    ``Status`` (why: 410 Expired, 504 Too large resource version, 403 Forbidden...)."""
    if response.status_code < 400:
        return
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > MAX_ERROR_BODY_BYTES:
            await response.aclose()
            return
        chunks.append(chunk)
    # what httpx's own aread() leaves behind (a bounded aread): .content and .json() read it, and a
    # later aread() by lightkube (a non-streamed request) returns it instead of re-reading the stream
    response._content = b"".join(chunks)


def _retryable(exc: BaseException) -> bool:
    """Server-side trouble or a broken connection is worth retrying; 4xx (RBAC, no such Pod) is not."""
    code = _status_code(exc)
    if code is not None:
        return code >= 500 or code == 429
    return isinstance(exc, (_httpx.TransportError, OSError, asyncio.TimeoutError))
