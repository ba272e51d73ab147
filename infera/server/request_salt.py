"""A request's ``cache_salt``: the one the engine is sent, and the one routing folds into its hashes.

vLLM folds a request's ``cache_salt`` into its first block's hash, so the prompt's cached blocks
are apart from the same tokens unsalted or under another salt. A tenant with ``cache_isolation``
in ``--api-keys-file`` gets its own salt on every request (``ApiKey.cache_salt``: an HMAC no other
client can compute; a salt the client sent is folded into it, so the tenant may still partition its
own cache). Any other request keeps the salt its client sent, if any. Either way the salt the
engine gets is left in the routed request's state under ``CACHE_SALT_STATE``, so the kv-aware
policy hashes the prompt from the same salted root (``infera.kv.hashing.salt_root``) and its
predictions stay exact.

The body is forwarded as received, so the salt is written into it: spliced in after the opening
brace when the client sent none (no re-encoding of a large body), else the body is decoded and
encoded again with the salt replaced (a client's key given twice, or spelled with escapes, is then
gone too: the engine sees one ``cache_salt``, ours).
"""
from __future__ import annotations

import re
from typing import Any

import msgspec

from infera.api.errors import ApiError

SALT_FIELD = "cache_salt"
# RoutedRequest.state key: the cache_salt the engine is sent (absent: none)
CACHE_SALT_STATE = "cache_salt"
_QUOTED = b'"' + SALT_FIELD.encode() + b'"'
# A \u escape of an ASCII character: how a key could spell cache_salt without its plain bytes (text
# escapes, \u00e9 and the like, do not match: a non-ASCII body costs no decode for it)
_ESCAPED_ASCII = re.compile(rb"\\u00[2-7][0-9A-Fa-f]")


class _SaltOnly(msgspec.Struct):
    cache_salt: Any = None


_salt_of = msgspec.json.Decoder(_SaltOnly).decode
_decode = msgspec.json.decode
_encode = msgspec.json.Encoder().encode


def _maybe_names_salt(body: bytes) -> bool:
    """Whether the body may hold a ``cache_salt`` key: its plain bytes, or an escaped ASCII
    character (a key spelled with one decodes to the same name in the engine's parser). Substring
    scans, then a decode of the one field only for a body that may name it: 50-130 us for a 120 KB
    chat on the loaded 2-core box, about a typed decode's cost (parse_request's own decode could
    carry the field instead: /tmp/s39-requests/salt.md)."""
    return _QUOTED in body or (b"\\u00" in body and _ESCAPED_ASCII.search(body) is not None)


def _checked(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(400, "cache_salt must be a non-empty string", "invalid_request", param=SALT_FIELD)
    return value


def salt_request(body: bytes, key: Any) -> tuple[bytes, str | None]:
    """(the body to forward, the salt the engine gets: None when none). ``key``: the request's
    ``ApiKey`` (None without ``--api-keys-file``). ``body`` is a JSON object (``parse_request``
    accepted it)."""
    if key is None or key.salt_key is None:
        if not _maybe_names_salt(body):
            return body, None
        try:
            given = _salt_of(body).cache_salt
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            return body, None
        # Not ours to check: the engine answers for a bad one. Only a usable one salts the hashes.
        return body, given if isinstance(given, str) and given else None
    if not _maybe_names_salt(body):
        salt = key.cache_salt(None)
        start = body.index(b"{") + 1
        return body[:start] + _QUOTED + b':"' + salt.encode("ascii") + b'",' + body[start:], salt
    doc = _decode(body)
    salt = key.cache_salt(_checked(doc.get(SALT_FIELD)))
    doc[SALT_FIELD] = salt
    return _encode(doc), salt


def salt_translated(doc: dict[str, Any], key: Any) -> str | None:
    """The salt of a request the server builds itself (Anthropic's, translated to a chat request):
    written into ``doc`` for an isolated tenant; None otherwise (its API has no ``cache_salt``)."""
    if key is None or key.salt_key is None:
        return None
    salt = doc[SALT_FIELD] = key.cache_salt(None)
    return salt
