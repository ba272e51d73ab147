"""API keys (``--api-keys-file``): who may call the inference API, and which models.

The file is YAML (JSON is valid YAML), usually a Kubernetes Secret mounted as a file::

    keys:
      - sha256: <hex sha256 of the key>   # never the key itself
        tenant: team-a
        models: ["*"]                      # or a list of model names
        requests_per_minute: 600           # each limit optional; absent = unlimited
        tokens_per_minute: 200000
        max_concurrent: 32
        priority: 0                        # higher is served first (the fair queue)
        weight: 1                          # its share of the fair queue within its class (absent: 1)
        cache_isolation: false             # true: a cache_salt of its own (below)
    cache_salt_secret: <random string>     # optional, 16+ characters: see cache isolation below

A client sends its key as ``Authorization: Bearer <key>`` (the OpenAI SDKs) or ``x-api-key: <key>``
(the Anthropic SDK). No key or an unknown one is a 401; a model the key does not allow is a 403;
both in the API's own error shape (the server's error middleware writes Anthropic's for
``/v1/messages``). Without ``--api-keys-file`` nothing is checked.

Keys are looked up by the sha256 of what the client sent. The lookup is a dict probe on that digest
(timing there reveals nothing about a key: finding a digest's neighbours needs preimages), then the
stored digest is compared with ``hmac.compare_digest``. Neither keys nor prompts are ever logged:
errors name the entry's index and field, never its values.

The file is watched (``stat`` every ``poll_s``, off the event loop): a change of its inode, size or
mtime (a Secret update swaps a symlink) reloads it. A file that no longer parses keeps the keys in
force and says why in the log and in ``infera_api_keys_reload_failures_total``.

Limits (``requests_per_minute``, ``tokens_per_minute``, ``max_concurrent``) are per tenant, shared by
its keys and by every replica (infera/server/tenant_limits.py). ``priority`` orders the fair queue
(infera/server/admission.py, with ``--max-inflight-per-worker``) and ``weight`` (per tenant, 1/64 to
64) is the tenant's share of it within its class: a tenant of weight 3 is admitted three times as
often as one of weight 1 while both wait.

``cache_isolation: true`` (per tenant: every key of the tenant states the same) gives the tenant's
requests a ``cache_salt`` the engine folds into its prefix-cache hashes (vLLM), so no other tenant
can hit its cached prefixes, or time them. The salt is ``base64url(HMAC-SHA256(tenant key, client
salt))``: the *tenant key* is ``HMAC-SHA256(cache_salt_secret, tenant)`` when the file has the
optional top-level ``cache_salt_secret`` (16+ characters), else the sha256 of the tenant's own key
digests, which only the servers hold. Either way every replica reading the same file derives the
same salt, and no client can guess another tenant's (a non-isolated tenant may send any
``cache_salt`` of its own: it would need the salt itself). Without the secret a tenant's salt
changes when its keys do (its cached prefixes are then cold once); set the secret to keep salts
across key rotations. A ``cache_salt`` the client sent is folded in, not dropped: the tenant stays
apart from the others, and may still partition its own cache (per end user, say), which an override
would silently undo and a 400 would forbid.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from dataclasses import field as dataclass_field

import yaml
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infera.api.errors import ApiError
from infera.runtime import cancel_and_wait
from infera.server.tenant_limits import TenantLimit

log = logging.getLogger(__name__)

DEFAULT_POLL_S = 2.0
# Tenants become metric label values: a bounded, plain alphabet.
_TENANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent")
KEY_FIELDS = ("sha256", "tenant", "models", "priority", "weight", "cache_isolation", *LIMIT_FIELDS)
MIN_WEIGHT, MAX_WEIGHT = 1 / 64, 64.0
NOT_ENFORCED_FIELDS: tuple[str, ...] = ()  # fields parsed but not acted on: none left
TOP_FIELDS = ("keys", "cache_salt_secret")
MIN_SALT_SECRET_CHARS = 16
_SALT_DOMAIN = b"infera-cache-salt\x00"
ALL_MODELS = "*"
OTHER_TENANT = "other"  # the label of requests without a known tenant in per-tenant series
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="infera"'}


class ApiKeysError(ValueError):
    """The keys file cannot be used; the message names the entry and field, never a value."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    tenant: str
    digest: bytes  # sha256 of the key
    models: frozenset[str] | None  # None: every model
    # the tenant's limits (shared by all its keys and every replica)
    limit: TenantLimit = dataclass_field(default_factory=TenantLimit)
    priority: int = 0  # its class in the fair queue (--max-inflight-per-worker): higher is served first
    weight: float = 1.0  # the tenant's share of the fair queue within its class (per tenant)
    # cache_isolation: the tenant's salt key (see the module doc); None: off. Kept out of repr (a
    # logged key entry must not carry what its tenant's salts are made from).
    salt_key: bytes | None = dataclass_field(default=None, repr=False)

    def allows(self, model: str | None) -> bool:
        return self.models is None or (model is not None and model in self.models)

    @property
    def cache_isolation(self) -> bool:
        return self.salt_key is not None

    def cache_salt(self, client_salt: str | None = None) -> str | None:
        """The ``cache_salt`` this tenant's request goes to the engine with (None: not isolated):
        43 base64url characters, within vLLM's rules for a salt (at most 128, no '/', '@', '\\')."""
        if self.salt_key is None:
            return None
        mac = hmac.new(self.salt_key, (client_salt or "").encode("utf-8", "surrogatepass"), hashlib.sha256)
        return base64.urlsafe_b64encode(mac.digest()).rstrip(b"=").decode("ascii")


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def parse_keys(text: str) -> dict[bytes, ApiKey]:
    """The file's entries by key digest; ``ApiKeysError`` when anything is off."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ApiKeysError(f"not valid YAML{where}") from None
    if (
        not isinstance(doc, dict)
        or "keys" not in doc
        or not set(doc) <= set(TOP_FIELDS)
        or not isinstance(doc["keys"], list)
    ):
        raise ApiKeysError(
            "expected a mapping with exactly one field, 'keys': a list of entries (and optionally 'cache_salt_secret')"
        )
    secret = doc.get("cache_salt_secret")
    if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SALT_SECRET_CHARS):
        raise ApiKeysError(
            f"cache_salt_secret: expected a string of at least {MIN_SALT_SECRET_CHARS} characters "
            "(random, the same for every replica)"
        )
    keys: dict[bytes, ApiKey] = {}
    limits: dict[str, tuple[TenantLimit, int]] = {}  # tenant → its limits, and the entry that set them
    isolated: dict[str, tuple[bool, int]] = {}  # tenant → its cache_isolation, and the entry that set it
    weights: dict[str, tuple[float, int]] = {}  # tenant → its fair-queue weight, and the entry that set it
    for i, entry in enumerate(doc["keys"]):
        where = f"keys[{i}]"
        if not isinstance(entry, dict):
            raise ApiKeysError(f"{where}: expected a mapping")
        for field in entry:
            if field in NOT_ENFORCED_FIELDS:
                raise ApiKeysError(
                    f"{where}.{field}: not enforced by this version; remove the field rather than rely on it"
                )
            if field not in KEY_FIELDS:
                raise ApiKeysError(f"{where}: unknown field {str(field)[:64]!r} (fields: {', '.join(KEY_FIELDS)})")
        sha = entry.get("sha256")
        if not isinstance(sha, str) or not _SHA256_HEX.fullmatch(sha):
            raise ApiKeysError(f"{where}.sha256: expected the key's sha256 as 64 hex digits")
        tenant = entry.get("tenant")
        if not isinstance(tenant, str) or not _TENANT.fullmatch(tenant) or tenant == OTHER_TENANT:
            raise ApiKeysError(
                f"{where}.tenant: expected 1-64 characters of A-Z a-z 0-9 . _ - (starting with a "
                f"letter or digit), not {OTHER_TENANT!r}"
            )
        models = entry.get("models", [ALL_MODELS])
        if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
            raise ApiKeysError(f'{where}.models: expected a non-empty list of model names, or ["*"]')
        for field in LIMIT_FIELDS:
            value = entry.get(field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ApiKeysError(f"{where}.{field}: expected a whole number >= 1 (absent: unlimited)")
        priority = entry.get("priority", 0)
        if isinstance(priority, bool) or not isinstance(priority, int) or not -1000 <= priority <= 1000:
            raise ApiKeysError(f"{where}.priority: expected a whole number from -1000 to 1000 (higher is served first)")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not MIN_WEIGHT <= weight <= MAX_WEIGHT:
            raise ApiKeysError(
                f"{where}.weight: expected a number from 1/64 to 64 (the tenant's share of the fair queue; absent: 1)"
            )
        if weights.setdefault(tenant, (float(weight), i))[0] != float(weight):
            raise ApiKeysError(
                f"{where}: tenant {tenant!r} has another weight in keys[{weights[tenant][1]}]; the "
                "fair queue shares per tenant, so every key of a tenant must state the same"
            )
        limit = TenantLimit(*(entry.get(f) for f in LIMIT_FIELDS))
        if limits.setdefault(tenant, (limit, i))[0] != limit:
            raise ApiKeysError(
                f"{where}: tenant {tenant!r} has other limits in keys[{limits[tenant][1]}]; limits are "
                "per tenant, so every key of a tenant must state the same ones"
            )
        isolation = entry.get("cache_isolation", False)
        if not isinstance(isolation, bool):
            raise ApiKeysError(f"{where}.cache_isolation: expected true or false")
        if isolated.setdefault(tenant, (isolation, i))[0] != isolation:
            raise ApiKeysError(
                f"{where}: tenant {tenant!r} sets another cache_isolation in keys[{isolated[tenant][1]}];"
                " the cache is isolated per tenant, so every key of a tenant must state the same"
            )
        digest = bytes.fromhex(sha)
        if digest in keys:
            raise ApiKeysError(f"{where}.sha256: the same key is listed twice")
        keys[digest] = ApiKey(
            tenant, digest, None if ALL_MODELS in models else frozenset(models), limit, priority, float(weight)
        )
    salt_keys = _salt_keys(keys.values(), secret, {t for t, (on, _) in isolated.items() if on})
    if salt_keys:
        keys = {d: replace(k, salt_key=salt_keys.get(k.tenant)) for d, k in keys.items()}
    return keys


def _salt_keys(entries: Iterable[ApiKey], secret: str | None, tenants: set[str]) -> dict[str, bytes]:
    """Each isolated tenant's salt key: HMAC(secret, tenant), or without a secret the sha256 of the
    tenant's key digests (sorted): secret from every client but the tenant's own keys' holders."""
    if not tenants:
        return {}
    if secret is not None:
        base = secret.encode("utf-8", "surrogatepass")
        return {t: hmac.new(base, _SALT_DOMAIN + t.encode(), hashlib.sha256).digest() for t in tenants}
    digests: dict[str, list[bytes]] = {}
    for k in entries:
        if k.tenant in tenants:
            digests.setdefault(k.tenant, []).append(k.digest)
    return {
        t: hashlib.sha256(_SALT_DOMAIN + t.encode() + b"\x00" + b"".join(sorted(ds))).digest()
        for t, ds in digests.items()
    }


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key a client sent: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    scheme, _, value = headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    key = headers.get("x-api-key", "").strip()
    return key or None


class ApiKeys:
    """The keys in force. ``load()`` once at start (raises ``ApiKeysError``), then ``start()``
    watches the file; ``authenticate`` and ``authorize`` are the per-request checks."""

    def __init__(
        self, path: str, *, poll_s: float = DEFAULT_POLL_S, stat: Callable[[str], os.stat_result] = os.stat
    ) -> None:
        self.path = path
        self.poll_s = poll_s
        self._stat = stat
        self._keys: dict[bytes, ApiKey] = {}
        self._version: tuple[int, int, int] | None = None
        self._task: asyncio.Task[None] | None = None
        self.reloads = 0
        self.reload_failures = 0
        self.rejected: dict[str, int] = {"missing": 0, "invalid": 0, "model": 0}
        # (tenant, status class) -> requests: bounded by the file's tenants (+ "other") × 3 classes
        self.requests: dict[tuple[str, str], int] = {}

    @property
    def tenants(self) -> frozenset[str]:
        return frozenset(k.tenant for k in self._keys.values())

    def __len__(self) -> int:
        return len(self._keys)

    def _read(self) -> tuple[tuple[int, int, int], dict[bytes, ApiKey]]:
        st = self._stat(self.path)
        with open(self.path, encoding="utf-8") as f:
            text = f.read()
        return (st.st_ino, st.st_size, st.st_mtime_ns), parse_keys(text)

    def load(self) -> None:
        try:
            self._version, self._keys = self._read()
        except OSError as exc:
            raise ApiKeysError(f"cannot read it: {exc.strerror or exc}") from None

    async def reload_if_changed(self) -> bool:
        """One poll: True when the file changed and its keys are now in force."""
        try:
            st = await asyncio.to_thread(self._stat, self.path)
            if (st.st_ino, st.st_size, st.st_mtime_ns) == self._version:
                return False
            version, keys = await asyncio.to_thread(self._read)
        except (OSError, ApiKeysError) as exc:
            self.reload_failures += 1
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            log.error(
                "--api-keys-file %s: not reloaded, the previous %d key(s) stay in force: %s",
                self.path,
                len(self._keys),
                why,
            )
            return False
        self._version, self._keys = version, keys
        self.reloads += 1
        log.info("--api-keys-file %s reloaded: %d key(s), %d tenant(s)", self.path, len(keys), len(self.tenants))
        return True

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.reload_if_changed()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch(), name="api-keys-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)

    def authenticate(self, headers: Mapping[str, str]) -> ApiKey:
        key = presented_key(headers)
        if key is None:
            self.rejected["missing"] += 1
            raise ApiError(
                401,
                "this server needs an API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                "missing_api_key",
                headers=_CHALLENGE,
            )
        found = self._lookup(key)
        if found is None:
            self.rejected["invalid"] += 1
            raise ApiError(401, "invalid API key", "invalid_api_key", headers=_CHALLENGE)
        return found

    def find(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The valid key presented, or None, counting nothing: the fast path hands a request without
        one to aiohttp's path, whose ``authenticate`` answers and counts the 401."""
        key = presented_key(headers)
        return None if key is None else self._lookup(key)

    def _lookup(self, key: str) -> ApiKey | None:
        digest = key_digest(key)
        found = self._keys.get(digest)
        return found if found is not None and hmac.compare_digest(found.digest, digest) else None

    def authorize(self, key: ApiKey, model: str | None) -> None:
        if not key.allows(model):
            self.rejected["model"] += 1
            raise ApiError(403, f"this API key may not use model {model!r}", "model_not_allowed", param="model")

    def count(self, tenant: str, status: int) -> None:
        key = (self.tenant_label(tenant), "2xx" if status < 400 else "4xx" if status < 500 else "5xx")
        self.requests[key] = self.requests.get(key, 0) + 1

    def tenant_label(self, tenant: str | None) -> str:
        """Per-tenant series are labelled by the file's tenants only; anything else is ``other``."""
        return tenant if tenant is not None and tenant in self.tenants else OTHER_TENANT


class ApiKeysMetrics:
    """A Prometheus collector: keys and tenants in force, reloads, rejections by reason."""

    def __init__(self, keys: ApiKeys) -> None:
        self.keys = keys

    def collect(self) -> Iterator[Metric]:
        k = self.keys
        g = GaugeMetricFamily("infera_api_keys", "API keys in force (--api-keys-file)")
        g.add_metric([], len(k))
        yield g
        c = CounterMetricFamily("infera_api_keys_reloads", "Reloads of --api-keys-file that took effect")
        c.add_metric([], k.reloads)
        yield c
        c = CounterMetricFamily(
            "infera_api_keys_reload_failures",
            "Changes of --api-keys-file that could not be loaded (the previous keys stayed)",
        )
        c.add_metric([], k.reload_failures)
        yield c
        c = CounterMetricFamily("infera_api_key_rejections", "Requests refused for their API key", labels=["reason"])
        for reason, n in k.rejected.items():
            c.add_metric([reason], n)
        yield c
        c = CounterMetricFamily(
            "infera_tenant_requests",
            "Requests answered per tenant of --api-keys-file (a tenant no longer in the file counts as 'other')",
            labels=["tenant", "code"],
        )
        for (tenant, code), n in sorted(k.requests.items()):
            c.add_metric([tenant, code], n)
        yield c
