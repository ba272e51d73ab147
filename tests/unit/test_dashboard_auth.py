"""The dashboard's door (infera/server/dashboard.py): Bearer header or session cookie, never the
raw token in the cookie, and the packaged page."""
from __future__ import annotations

import pytest

from infera.server.dashboard import authorized, cookie_header, load_page, login_page, session_value, token_matches

TOKEN = "s3cret"


@pytest.mark.parametrize("authorization, cookie, expected", [
    (f"Bearer {TOKEN}", None, True),
    (f"bearer  {TOKEN} ", None, True),
    (None, session_value(TOKEN), True),
    (None, None, False),
    ("Bearer wrong", None, False),
    (f"Basic {TOKEN}", None, False),
    ("Bearer é\udcff", None, False),  # non-ASCII: refused, not a TypeError
    (None, TOKEN, False),  # the raw token is not the session
    (None, session_value("other"), False),
    (None, "é", False),
])
def test_authorized(authorization, cookie, expected):
    assert authorized(TOKEN, authorization, cookie) is expected


def test_no_token_is_open_and_the_cookie_hides_the_token():
    assert authorized(None, None, None) and authorized("", None, None)
    header = cookie_header(TOKEN, secure=False)
    assert TOKEN not in header and "HttpOnly" in header and "SameSite=Strict" in header and "Secure" not in header
    assert "; Secure" in cookie_header(TOKEN, secure=True)
    assert session_value(TOKEN) != session_value(TOKEN + "x")
    assert token_matches(f" {TOKEN}\n", TOKEN) and not token_matches(None, TOKEN) and not token_matches("", TOKEN)


def test_the_packaged_page_and_the_sign_in_page():
    page = load_page().decode()
    assert page.startswith("<!doctype html>") and 'fetch("v1/fleet"' in page
    assert "<script src" not in page and "<link rel=\"stylesheet\"" not in page  # everything inline
    assert "&lt;b&gt;" in login_page("<b>").decode()  # the message is escaped
