"""The dashboard's door (infera/server/dashboard.py): Bearer header or session cookie, never the
raw token in the cookie, a cookie the server refuses after its expiry, and the packaged page."""
from __future__ import annotations

import time

import pytest

from infera.server.dashboard import (authorized, cookie_header, load_page, login_page, session_valid, session_value,
                                     token_matches)

TOKEN = "s3cret"
LATER = time.time() + 3600


@pytest.mark.parametrize("authorization, cookie, expected", [
    (f"Bearer {TOKEN}", None, True),
    (f"bearer  {TOKEN} ", None, True),
    (None, session_value(TOKEN, LATER), True),
    (None, session_value(TOKEN, time.time() - 1), False),  # expired: refused whatever the browser kept
    (None, session_value(TOKEN, LATER).replace(str(int(LATER)), str(int(LATER) + 999)), False),  # forged expiry
    (None, "99999999999." + "0" * 64, False),
    (None, "", False),
    (None, None, False),
    ("Bearer wrong", None, False),
    (f"Basic {TOKEN}", None, False),
    ("Bearer é\udcff", None, False),  # non-ASCII: refused, not a TypeError
    (None, TOKEN, False),  # the raw token is not the session
    (None, session_value("other", LATER), False),
    (None, "é", False),
])
def test_authorized(authorization, cookie, expected):
    assert authorized(TOKEN, authorization, cookie) is expected


def test_no_token_is_open_and_the_cookie_hides_the_token():
    assert authorized(None, None, None) and authorized("", None, None)
    header = cookie_header(TOKEN, secure=False)
    assert TOKEN not in header and "HttpOnly" in header and "SameSite=Strict" in header and "Secure" not in header
    assert "; Secure" in cookie_header(TOKEN, secure=True)
    assert session_value(TOKEN, LATER) != session_value(TOKEN + "x", LATER)
    assert "Max-Age=43200" in header  # 12 h by default, and the server holds it to that


def test_the_session_expires_server_side():
    header = cookie_header(TOKEN, secure=False, lifetime_s=60, now=1_000_000)
    value = header.split(";")[0].split("=", 1)[1]
    assert "Max-Age=60" in header
    assert session_valid(value, TOKEN, now=1_000_059) and not session_valid(value, TOKEN, now=1_000_060)
    assert not session_valid(value, TOKEN + "x", now=1_000_000)
    assert token_matches(f" {TOKEN}\n", TOKEN) and not token_matches(None, TOKEN) and not token_matches("", TOKEN)


def test_the_packaged_page_and_the_sign_in_page():
    page = load_page().decode()
    assert page.startswith("<!doctype html>") and 'fetch("v1/fleet"' in page
    assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page  # everything inline
    assert "&lt;b&gt;" in login_page("<b>").decode()  # the message is escaped
