"""A request's ``cache_salt``: the one the engine is sent, and the one routing folds into its hashes.

vLLM folds a request's ``cache_salt`` into its first block's hash, so the prompt's cached blocks
are apart from the same tokens unsalted or under another salt. A tenant with ``cache_isolation``
in ``--api-keys-file`` gets its own salt on every request (``ApiKey.cache_salt``: an HMAC no other
client can compute; a salt the client sent is folded into it, so the tenant may still partition its
own cache). Any other request keeps the salt its client sent, if any. Either way the salt the
engine gets is left in the routed request's state under ``CACHE_SALT_STATE``, so the kv-aware
policy hashes the prompt from the same salted root (``infera.kv.hashing.salt_root``) and its
predictions stay exact.

The client's own salt is read from the request ``parse_request`` decoded (``parsed.cache_salt``:
its key spelled with escapes or given twice, the value the engine's parser keeps; UNSET when
absent), so finding it costs nothing. The body is forwarded as received, so an isolated tenant's
salt is written into it: spliced in after the opening brace when the client sent no
``cache_salt`` (no re-encoding of a large body), else the body is decoded and encoded again with
the salt replaced (the engine then sees one ``cache_salt``, ours: a duplicate or escaped spelling
of the client's is gone too).
"""

from __future__ import annotations

from typing import Any

import msgspec

from infera.api.errors import ApiError

SALT_FIELD = "cache_salt"
# RoutedRequest.state key: the cache_salt the engine is sent (absent: none)
CACHE_SALT_STATE = "cache_salt"
_QUOTED = b'"' + SALT_FIELD.encode() + b'"'
_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode


def _checked(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, "cache_salt must be a non-empty string", "invalid_request", param=SALT_FIELD)
    return value


def salt_request(body: bytes, key: Any, given: Any = msgspec.UNSET) -> tuple[bytes, str | None]:
    """(the body to forward, the salt the engine gets: None when none). ``key``: the request's
    ``ApiKey`` (None without ``--api-keys-file``); ``given``: the client's ``cache_salt`` as
    ``parse_request`` decoded it (UNSET: absent). ``body`` is a JSON object."""
    if key is None or key.salt_key is None:
        # Not ours to check: the engine answers for a bad one. Only a usable one salts the hashes.
        return body, given if isinstance(given, str) and given else None
    if given is msgspec.UNSET:
        salt = key.cache_salt(None)
        start = body.index(b"{") + 1
        return body[:start] + _QUOTED + b':"' + salt.encode("ascii") + b'",' + body[start:], salt
    salt = key.cache_salt(_checked(given))
    doc = _decode(body)
    doc[SALT_FIELD] = salt
    return _encode(doc), salt


def salt_translated(doc: dict[str, Any], key: Any) -> str | None:
    """The salt of a request the server builds itself (Anthropic's, translated to a chat request):
    written into ``doc`` for an isolated tenant; None otherwise (its API has no ``cache_salt``)."""
    if key is None or key.salt_key is None:
        return None
    salt: str | None = key.cache_salt(None)
    doc[SALT_FIELD] = salt
    return salt
