"""``/dashboard``: the static page (package data, read once) and its access behind ``--admin-token``.

With a token set, the page and ``/v1/fleet`` take either ``Authorization: Bearer <token>`` (curl,
scrapers) or the dashboard cookie. A browser gets the cookie by posting the token in the page's
small form (``POST /dashboard``), which answers with a redirect to the bare ``/dashboard``. The
token is never taken from the URL (``?token=`` would land in access logs and browser history). The
cookie is ``HttpOnly``, ``SameSite=Strict`` and holds ``<expiry>.<HMAC of the expiry keyed by the
token>``, never the token: the server refuses it after its expiry (``--dashboard-session-s``,
default 12 h) whatever the browser does, it opens the dashboard, ``/v1/fleet`` and
``/v1/kv-stats`` only, not ``/v1/admin/*``, and a new token voids it. Being derived from the token
alone, it is valid in every process of a ``--workers N`` server and every replica sharing the token.
"""
from __future__ import annotations

import hashlib
import hmac
import html
import time
from importlib import resources

COOKIE_NAME = "infera_dashboard"
_COOKIE_CONTEXT = b"infera dashboard session v2"
DEFAULT_SESSION_S = 12 * 3600.0  # --dashboard-session-s

# The page pulls nothing from elsewhere and talks only to this server.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; "
                           "frame-ancestors 'none'")


def load_page() -> bytes:
    """The dashboard HTML shipped in the package (read once, at app build)."""
    return resources.files("infera.server").joinpath("dashboard.html").read_bytes()


def session_value(token: str, expires_at: float) -> str:
    """The cookie value for ``token`` valid until ``expires_at`` (unix seconds): proves the token
    was shown without holding it, and carries its own expiry under the same MAC."""
    expiry = str(int(expires_at))
    mac = hmac.new(token.encode("utf-8"), _COOKIE_CONTEXT + b"|" + expiry.encode(), hashlib.sha256).hexdigest()
    return f"{expiry}.{mac}"


def session_valid(cookie: str, token: str, now: float | None = None) -> bool:
    """Whether ``cookie`` was issued for ``token`` and has not expired."""
    expiry, dot, _ = cookie.partition(".")
    if not dot or not expiry.isascii() or not expiry.isdigit() or len(expiry) > 12:
        return False
    if int(expiry) <= (time.time() if now is None else now):
        return False
    return _same(cookie, session_value(token, int(expiry)))


def _same(given: str, expected: str) -> bool:
    # bytes: compare_digest refuses non-ASCII str, and header or form values may hold any character
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode("utf-8"))


def token_matches(given: str | None, token: str) -> bool:
    return given is not None and _same(given.strip(), token)


def authorized(token: str | None, authorization: str | None, cookie: str | None) -> bool:
    """No token set: open. Else a matching Bearer header or dashboard cookie."""
    if not token:
        return True
    scheme, _, given = (authorization or "").partition(" ")
    if scheme.lower() == "bearer" and _same(given.strip(), token):
        return True
    return cookie is not None and session_valid(cookie, token)


def cookie_header(token: str, secure: bool, lifetime_s: float = DEFAULT_SESSION_S, now: float | None = None) -> str:
    """Set-Cookie for a fresh session; Max-Age matches the server-side expiry."""
    expires_at = (time.time() if now is None else now) + lifetime_s
    return (f"{COOKIE_NAME}={session_value(token, expires_at)}; Path=/; Max-Age={int(lifetime_s)}; HttpOnly; "
            "SameSite=Strict" + ("; Secure" if secure else ""))


def login_page(message: str) -> bytes:
    """The 401 page: one field that posts the token to ``/dashboard`` (relative: works behind a
    path prefix)."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Infera dashboard: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><link rel="icon" href="data:,">
<style>body{{font:15px system-ui,sans-serif;background:#11151c;color:#dde3ea;display:flex;justify-content:center;
margin-top:12vh}}form{{background:#1b212b;padding:24px 28px;border-radius:8px;min-width:320px}}
input{{width:100%;box-sizing:border-box;margin:10px 0;padding:8px;background:#0d1117;color:#dde3ea;
border:1px solid #3a4453;border-radius:4px}}button{{padding:7px 16px}}p{{color:#e8a0a0}}</style></head>
<body><form method="post" action="dashboard" id="login">
<h2>Infera dashboard</h2><p id="why">{html.escape(message)}</p>
<label for="token">Admin token (--admin-token / INFERA_ADMIN_TOKEN)</label>
<input type="password" id="token" name="token" autocomplete="current-password" autofocus>
<button type="submit">Open</button></form></body></html>""".encode()
