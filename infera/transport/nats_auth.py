"""NATS credentials and TLS for every NATS client of a process (server and workers alike), and
the redaction that keeps them out of logs and error messages.

Where credentials come from (``flag > env > default``, flags in ``infera.config.add_plane_flags``):

- user/password: ``--nats-user`` with ``--nats-password-file`` (else the ``INFERA_NATS_PASSWORD``
  env variable); a token: ``--nats-token-file`` (else ``INFERA_NATS_TOKEN``). Secrets are never
  flags: a process's argv is readable by every local user.
- a NATS JWT ``.creds`` file (``--nats-creds``) or an NKey seed file (``--nats-nkey-seed``): the
  server's nonce is signed with the seed (needs the ``nkeys`` package).
- TLS: ``--nats-tls-ca`` (verify the server with this CA), ``--nats-tls-cert`` + ``--nats-tls-key``
  (a client certificate, for servers that verify clients). Any of them turns TLS on.
- credentials in the URL (``nats://user:pass@host``, ``nats://token@host``) still work, and win.

Nothing here is logged: ``redact_url`` / ``redact`` show a URL with its user info as ``***``.
"""
from __future__ import annotations

import argparse
import base64
import os
import re
import ssl
from dataclasses import dataclass, field
from typing import Mapping

PASSWORD_ENV = "INFERA_NATS_PASSWORD"
TOKEN_ENV = "INFERA_NATS_TOKEN"

_USERINFO = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s,'\"]+@")


def redact_url(url: str) -> str:
    """``nats://user:pass@host:4222`` → ``nats://***@host:4222`` (a token URL likewise)."""
    url = url.strip()
    if "@" not in url:
        return url
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    netloc, slash, path = rest.partition("/")
    if "@" not in netloc:
        return url
    host = netloc.rpartition("@")[2]
    return f"{scheme}{sep}***@{host}{slash}{path}"


def redact_servers(servers: str | list[str]) -> str:
    """A comma-separated server list (or a list of URLs) for a log line or an error message."""
    urls = servers.split(",") if isinstance(servers, str) else servers
    return ",".join(redact_url(u) for u in urls if u.strip())


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Any text (an exception's message) with URL user info and the given secrets replaced."""
    text = _USERINFO.sub(r"\g<scheme>***@", text)
    for secret in secrets:
        if secret and len(secret) >= 3:
            text = text.replace(secret, "***")
    return text


def _read_secret(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            value = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the NATS {what} file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if not value:
        raise ValueError(f"the NATS {what} file {path} is empty")
    return value


def _creds_block(text: str, kind: str) -> str | None:
    """The body of a ``-----BEGIN <kind>-----`` block of a .creds file."""
    m = re.search(r"-{3,}BEGIN " + kind + r"-{3,}\s*\n\s*(\S+)\s*\n\s*-{3,}END " + kind + r"-{3,}", text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class NatsAuth:
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.password is not None and not self.user:
            raise ValueError("a NATS password needs a user (--nats-user / INFERA_NATS_USER)")
        if self.user and self.password is None:
            raise ValueError(f"--nats-user needs a password: --nats-password-file or {PASSWORD_ENV}")
        if self.user and self.token:
            raise ValueError("give NATS either a user/password or a token, not both")
        if self.creds_file and self.nkey_seed_file:
            raise ValueError("give NATS either --nats-creds or --nats-nkey-seed, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        for path, what in ((self.creds_file, "creds"), (self.nkey_seed_file, "nkey seed"), (self.tls_ca, "TLS CA"),
                           (self.tls_cert, "TLS certificate"), (self.tls_key, "TLS key")):
            if path:
                try:
                    with open(path, "rb"):
                        pass
                except OSError as exc:
                    raise ValueError(f"cannot read the NATS {what} file {path}: {exc.strerror or exc}") from None
        if self.creds_file:
            text = _read_secret(self.creds_file, "creds")
            if _creds_block(text, "NATS USER JWT") is None or _creds_block(text, "USER NKEY SEED") is None:
                raise ValueError(f"the NATS creds file {self.creds_file} holds no user JWT and seed")
        if self.nkey_seed_file:
            _read_secret(self.nkey_seed_file, "nkey seed")
        if self.tls_enabled:
            self.ssl_context()  # a bad CA/cert/key is an error at start, not at every connect

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> "NatsAuth":
        """From the plane flags (``infera.config.add_plane_flags``); a password or token file
        flag wins over its env variable. Raises ``ValueError`` with a message for the user."""
        environ = os.environ if environ is None else environ
        g = lambda name: getattr(args, name, None) or None  # noqa: E731
        password = token = None
        if g("nats_password_file"):
            password = _read_secret(args.nats_password_file, "password")
        elif environ.get(PASSWORD_ENV):
            password = environ[PASSWORD_ENV]
        if g("nats_token_file"):
            token = _read_secret(args.nats_token_file, "token")
        elif environ.get(TOKEN_ENV):
            token = environ[TOKEN_ENV]
        return cls(user=g("nats_user"), password=password, token=token, creds_file=g("nats_creds"),
                   nkey_seed_file=g("nats_nkey_seed"), tls_ca=g("nats_tls_ca"), tls_cert=g("nats_tls_cert"),
                   tls_key=g("nats_tls_key"))

    # -- what the clients use ------------------------------------------------------------------
    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_ca or self.tls_cert)

    @property
    def secrets(self) -> tuple[str, ...]:
        return tuple(s for s in (self.password, self.token) if s)

    def ssl_context(self) -> ssl.SSLContext:
        try:
            ctx = ssl.create_default_context(cafile=self.tls_ca) if self.tls_ca else ssl.create_default_context()
            if self.tls_cert:
                ctx.load_cert_chain(self.tls_cert, self.tls_key)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"NATS TLS files (--nats-tls-ca/--nats-tls-cert/--nats-tls-key): {exc}") from None
        return ctx

    def nats_py_options(self) -> dict:
        """Keyword arguments of nats-py's ``Client.connect``."""
        opts: dict = {}
        if self.user:
            opts.update(user=self.user, password=self.password)
        if self.token:
            opts["token"] = self.token
        if self.creds_file:
            opts["user_credentials"] = self.creds_file
        if self.nkey_seed_file:
            opts["nkeys_seed"] = self.nkey_seed_file
        if self.tls_enabled:
            opts["tls"] = self.ssl_context()
        return opts

    def sign_nonce(self, nonce: str) -> dict:
        """The CONNECT fields that answer the server's nonce with the creds or NKey seed
        (``jwt``/``nkey`` and ``sig``); {} when neither is set."""
        if not (self.creds_file or self.nkey_seed_file):
            return {}
        try:
            import nkeys
        except ImportError:
            raise ValueError("--nats-creds / --nats-nkey-seed need the nkeys package: pip install nkeys") from None
        fields: dict = {}
        if self.creds_file:
            text = _read_secret(self.creds_file, "creds")
            jwt, seed = _creds_block(text, "NATS USER JWT"), _creds_block(text, "USER NKEY SEED")
            if jwt is None or seed is None:
                raise ValueError(f"the NATS creds file {self.creds_file} holds no user JWT and seed")
            fields["jwt"] = jwt
        else:
            seed = _read_secret(self.nkey_seed_file, "nkey seed")
        kp = nkeys.from_seed(bytearray(seed.encode()))
        try:
            if not self.creds_file:
                fields["nkey"] = kp.public_key.decode()
            fields["sig"] = base64.urlsafe_b64encode(kp.sign(nonce.encode())).decode().rstrip("=")
        finally:
            kp.wipe()
        return fields
