"""`farm serve` over TLS, and a node's refusal of plain http to a remote host."""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.fixtures.farm import ROOT, free_port

pytestmark = pytest.mark.integration


def self_signed(dir_: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "farm.test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = dir_ / "cert.pem", dir_ / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_the_api_serves_tls_and_a_node_verifies_its_certificate(tmp_path: Path) -> None:
    from farm.node.client import FarmClient

    cert, key = self_signed(tmp_path)
    port = free_port()
    env = {**os.environ, "FARM_HOME": str(tmp_path / "home"), "FARM_AUTH": "false",
           "BROKER_URL": "memory://", "DATABASE_URL": f"sqlite:///{tmp_path / 'farm.db'}",
           "BLOB_STORE_URL": (tmp_path / "blobs").as_uri(), "FARM_TLS_CERT": str(cert),
           "FARM_TLS_KEY": str(key)}
    subprocess.run([sys.executable, "-m", "farm.app.cli", "db", "upgrade"], env=env, cwd=ROOT,
                   check=True, capture_output=True, timeout=120)
    log = open(tmp_path / "api.log", "wb")  # noqa: SIM115 - the child holds it
    api = subprocess.Popen([sys.executable, "-m", "farm.app.cli", "serve", "--host",
                            "127.0.0.1", "--port", str(port)], env=env, cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    url = f"https://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                ctx = ssl.create_default_context(cafile=str(cert))
                if httpx.get(f"{url}/healthz", verify=ctx, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or api.poll() is not None:
                    raise AssertionError((tmp_path / "api.log").read_text()[-3000:]) from None
                time.sleep(0.3)
        # Plain http to the TLS port does not get an answer.
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).raise_for_status()
        # A node that trusts the CA talks to it; one that does not, refuses it.
        os.environ["FARM_CA_BUNDLE"] = str(cert)
        from farm.core.settings import get_settings

        get_settings.cache_clear()
        try:
            with FarmClient(url, "", retries=0) as client:
                assert client.health()["status"] == "ok"
        finally:
            del os.environ["FARM_CA_BUNDLE"]
            get_settings.cache_clear()
        from farm.node.errors import FarmUnavailable

        with FarmClient(url, "", retries=0) as client, pytest.raises(FarmUnavailable):
            client.health()
    finally:
        api.terminate()
        api.wait(timeout=20)
        log.close()


def test_a_node_refuses_plain_http_to_a_remote_host() -> None:
    from farm.node.client import FarmClient
    from farm.node.errors import FarmError

    with pytest.raises(FarmError, match=r"refusing plain http to 10\.0\.0\.7"):
        FarmClient("http://10.0.0.7:8000", "t")
    with pytest.raises(FarmError, match="refusing plain http"):
        FarmClient("http://farm.example.net", "t")
    # loopback, https and an explicit opt-in are fine (nothing is sent yet)
    FarmClient("http://127.0.0.1:8000", "t").close()
    FarmClient("http://localhost:8000", "t").close()
    FarmClient("https://farm.example.net", "t").close()
    FarmClient("http://10.0.0.7:8000", "t", allow_http=True).close()
