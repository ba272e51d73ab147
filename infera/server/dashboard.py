"""``/dashboard``: the static page (package data, read once) and its access behind ``--admin-token``.

With a token set, the page and ``/v1/fleet`` take either ``Authorization: Bearer <token>`` (curl,
scrapers) or the dashboard cookie. A browser gets the cookie by posting the token in the page's
small form (``POST /dashboard``), or once from ``/dashboard?token=<token>`` (handy for a link; the
query string shows in access logs and browser history, the form does not); either answers with a
redirect to the bare ``/dashboard``. The cookie is ``HttpOnly``, ``SameSite=Strict``, lives for the
browser session and holds an HMAC of the token, never the token: it opens the dashboard and
``/v1/fleet`` only, not ``/v1/admin/*``, and a new token voids it.
"""
from __future__ import annotations

import hashlib
import hmac
import html
from importlib import resources

COOKIE_NAME = "infera_dashboard"
_COOKIE_CONTEXT = b"infera dashboard session v1"

# The page pulls nothing from elsewhere and talks only to this server.
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                           "connect-src 'self'; img-src 'self' data:; form-action 'self'; base-uri 'none'; "
                           "frame-ancestors 'none'")


def load_page() -> bytes:
    """The dashboard HTML shipped in the package (read once, at app build)."""
    return resources.files("infera.server").joinpath("dashboard.html").read_bytes()


def session_value(token: str) -> str:
    """The cookie value for ``token``: proves the token was shown without holding it."""
    return hmac.new(token.encode("utf-8"), _COOKIE_CONTEXT, hashlib.sha256).hexdigest()


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
    return cookie is not None and _same(cookie, session_value(token))


def cookie_header(token: str, secure: bool) -> str:
    return (f"{COOKIE_NAME}={session_value(token)}; Path=/; HttpOnly; SameSite=Strict"
            + ("; Secure" if secure else ""))


def login_page(message: str) -> bytes:
    """The 401 page: one field that posts the token to ``/dashboard`` (relative: works behind a
    path prefix)."""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Infera dashboard: sign in</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font:15px system-ui,sans-serif;background:#11151c;color:#dde3ea;display:flex;justify-content:center;
margin-top:12vh}}form{{background:#1b212b;padding:24px 28px;border-radius:8px;min-width:320px}}
input{{width:100%;box-sizing:border-box;margin:10px 0;padding:8px;background:#0d1117;color:#dde3ea;
border:1px solid #3a4453;border-radius:4px}}button{{padding:7px 16px}}p{{color:#e8a0a0}}</style></head>
<body><form method="post" action="dashboard" id="login">
<h2>Infera dashboard</h2><p id="why">{html.escape(message)}</p>
<label for="token">Admin token (--admin-token / INFERA_ADMIN_TOKEN)</label>
<input type="password" id="token" name="token" autocomplete="current-password" autofocus>
<button type="submit">Open</button></form></body></html>""".encode()
