"""The endpoint picker's TLS: a self-signed RSA-2048 certificate made at start and kept in memory.

Envoy's ext_proc cluster talks TLS to it without verifying the certificate (a gateway and its
picker share a namespace; the certificate only encrypts). ``openssl`` makes the key pair in a
private temporary folder that is removed at once (the ``cryptography`` package is not a
dependency here)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile


class TlsError(RuntimeError):
    pass


def self_signed_cert(common_name: str = "infera-epp", days: int = 3650) -> tuple[bytes, bytes]:
    """(private key PEM, certificate PEM), RSA-2048, for ``common_name``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise TlsError("--secure-serving needs the openssl command to make its self-signed certificate; install "
                       "openssl or start with --no-secure-serving")
    folder = tempfile.mkdtemp(prefix="infera-epp-tls-")
    try:
        os.chmod(folder, 0o700)
        key_path, cert_path = os.path.join(folder, "key.pem"), os.path.join(folder, "cert.pem")
        cmd = [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key_path, "-out", cert_path,
               "-days", str(days), "-subj", f"/CN={common_name}",
               "-addext", f"subjectAltName=DNS:{common_name},DNS:localhost,IP:127.0.0.1"]
        done = subprocess.run(cmd, capture_output=True, timeout=60)
        if done.returncode != 0:
            raise TlsError(f"openssl failed to make the self-signed certificate: {done.stderr.decode(errors='replace')}")
        with open(key_path, "rb") as f:
            key = f.read()
        with open(cert_path, "rb") as f:
            cert = f.read()
        return key, cert
    finally:
        shutil.rmtree(folder, ignore_errors=True)
