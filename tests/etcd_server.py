"""A real etcd server for tests: one member on free loopback ports, a temporary data directory.

The discovery tests (and any test that runs ``velomux node`` processes against etcd) start
their own server here rather than use one a package may have started on port 2379, so a
run never depends on, or disturbs, anything else on the machine::

    with EtcdServer() as etcd:                  # waits until /health answers
        peers = EtcdPeers([etcd.endpoint], lease_ttl=2)
        ...
        etcd.restart()                          # same data directory and ports
    # the process is killed and the data directory removed

``EtcdServer(tls=EtcdTls.create(directory))`` serves HTTPS with client-certificate
authentication (etcd's ``--client-cert-auth``); the :class:`EtcdTls` holds the CA, the
server's certificate and a client certificate to connect with. The binary is ``etcd`` on
``PATH`` (Debian's ``etcd-server``; ``make etcd`` installs it); :func:`etcd_binary` finds
it and :func:`require_etcd` skips a test with the reason when it is missing.

The pytest fixture :func:`etcd_server` is a started server for one test. A test module
takes it by assignment (``from tests import etcd_server as etcd_fixtures`` then
``etcd_server = etcd_fixtures.etcd_server``: importing the name itself trips ruff's F811
on every test that takes the fixture as a parameter). ``start``, ``stop``,
``restart`` and ``kill`` block (a start waits for health): an async test calls them through
``asyncio.to_thread`` so its nodes keep running meanwhile.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["EtcdServer", "EtcdTls", "etcd_binary", "etcd_server", "require_etcd"]

HEALTH_TIMEOUT = 30.0
"""How long :meth:`EtcdServer.start` waits for ``/health`` (2 shared cores can be slow)."""


def etcd_binary() -> str | None:
    """The ``etcd`` executable on PATH (or ``$VELOMUX_ETCD``), None when there is none."""
    return os.environ.get("VELOMUX_ETCD") or shutil.which("etcd")


def require_etcd() -> str:
    """The ``etcd`` executable, or skip the calling test saying how to get one."""
    binary = etcd_binary()
    if binary is None:
        pytest.skip("etcd is not on PATH: `make etcd` installs Debian's etcd-server")
    return binary


def _free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


@dataclass(frozen=True)
class EtcdTls:
    """The files of a TLS etcd: a CA, the server's certificate, and one client certificate.

    ``create`` makes them (P-256 keys, one day of validity, the server named by
    ``127.0.0.1`` and ``localhost``); a client connects with ``ca``, ``client_cert`` and
    ``client_key``. ``other_ca`` is a second CA that etcd does not trust, for tests of a
    refused client.
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    untrusted_cert: Path
    untrusted_key: Path

    @classmethod
    def create(cls, directory: Path) -> EtcdTls:
        directory.mkdir(parents=True, exist_ok=True)
        now = datetime.datetime.now(datetime.UTC)

        def authority(name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
            key = ec.generate_private_key(ec.SECP256R1())
            subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
            cert = (
                x509.CertificateBuilder()
                .subject_name(subject)
                .issuer_name(subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                .add_extension(
                    x509.KeyUsage(
                        digital_signature=True,
                        content_commitment=False,
                        key_encipherment=False,
                        data_encipherment=False,
                        key_agreement=False,
                        key_cert_sign=True,
                        crl_sign=True,
                        encipher_only=False,
                        decipher_only=False,
                    ),
                    critical=True,
                )
                .sign(key, hashes.SHA256())
            )
            return key, cert

        def leaf(
            issuer: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
            name: str,
            usage: list[x509.ObjectIdentifier],
        ) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
            key = ec.generate_private_key(ec.SECP256R1())
            cert = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(issuer[1].subject)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=1))
                .add_extension(
                    x509.SubjectAlternativeName(
                        [
                            x509.DNSName("localhost"),
                            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        ]
                    ),
                    critical=False,
                )
                .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
                .sign(issuer[0], hashes.SHA256())
            )
            return key, cert

        def save(stem: str, pair: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]) -> None:
            (directory / f"{stem}.pem").write_bytes(
                pair[1].public_bytes(serialization.Encoding.PEM)
            )
            _write_key(directory / f"{stem}.key", pair[0])

        ca = authority("velomux test etcd CA")
        other = authority("an untrusted CA")
        both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        save("ca", ca)
        save("server", leaf(ca, "etcd", both))
        save("client", leaf(ca, "velomux-node", [ExtendedKeyUsageOID.CLIENT_AUTH]))
        save("untrusted", leaf(other, "intruder", [ExtendedKeyUsageOID.CLIENT_AUTH]))
        return cls(
            ca=directory / "ca.pem",
            server_cert=directory / "server.pem",
            server_key=directory / "server.key",
            client_cert=directory / "client.pem",
            client_key=directory / "client.key",
            untrusted_cert=directory / "untrusted.pem",
            untrusted_key=directory / "untrusted.key",
        )


class EtcdServer:
    """One etcd member on loopback, started by :meth:`start` (or ``with``), gone after.

    The client and peer ports are picked free at construction and kept across
    :meth:`restart`, so clients reconnect to the same endpoint; the data directory is
    kept across restarts too (leases and keys survive, as on a real member) and removed
    by :meth:`close`. ``endpoint`` is ``127.0.0.1:<port>``, what ``EtcdPeers`` takes.
    etcd's own log goes to ``log_path`` in the data directory's parent, which
    :meth:`log_tail` reads for an assertion message.
    """

    def __init__(
        self,
        *,
        tls: EtcdTls | None = None,
        binary: str | None = None,
        host: str = "127.0.0.1",
        namespace: str | None = None,
    ) -> None:
        self.binary = binary or require_etcd()
        self.tls = tls
        self.host = host
        """The address it listens on (loopback, or an address inside ``namespace``)."""
        self.namespace = namespace
        """A network namespace to run in (``ip netns exec``), for multi-host tests."""
        self.client_port = _free_tcp_port()
        self.peer_port = _free_tcp_port()
        while self.peer_port == self.client_port:
            self.peer_port = _free_tcp_port()
        self._root = Path(tempfile.mkdtemp(prefix="velomux-etcd-"))
        self.data_dir = self._root / "data"
        self.log_path = self._root / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client listener."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        peer_url = f"http://{self.host}:{self.peer_port}"
        command = [
            *self._netns(),
            self.binary,
            "--name",
            "velomux-test",
            "--data-dir",
            str(self.data_dir),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"velomux-test={peer_url}",
            "--initial-cluster-state",
            "new",
            "--logger",
            "zap",
            "--log-level",
            "warn",
        ]
        if self.tls is not None:
            command += [
                "--cert-file",
                str(self.tls.server_cert),
                "--key-file",
                str(self.tls.server_key),
                "--trusted-ca-file",
                str(self.tls.ca),
                "--client-cert-auth",
            ]
        return command

    def start(self) -> None:
        """Start the member and wait (bounded) until it answers ``/health``."""
        if self.running:
            return
        log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        finally:
            log.close()
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while not self.healthy():
            if not self.running:
                raise RuntimeError(f"etcd exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"etcd not healthy within {HEALTH_TIMEOUT} s:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _netns(self) -> list[str]:
        return [] if self.namespace is None else ["ip", "netns", "exec", self.namespace]

    def healthy(self) -> bool:
        """Whether ``/health`` answers ``{"health": "true"}`` now."""
        if self.namespace is not None:  # asked from inside the namespace, plaintext only
            check = (
                "import json,sys,urllib.request;"
                f"body=json.loads(urllib.request.urlopen('{self.client_url}/health',timeout=1).read());"
                "sys.exit(0 if body.get('health')=='true' else 1)"
            )
            result = subprocess.run(
                [*self._netns(), sys.executable, "-c", check], capture_output=True, timeout=10
            )
            return result.returncode == 0
        context: ssl.SSLContext | None = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        try:
            with urllib.request.urlopen(
                f"{self.client_url}/health", timeout=1.0, context=context
            ) as response:
                body = json.loads(response.read())
        except (OSError, ValueError, urllib.error.URLError):
            return False
        return isinstance(body, dict) and body.get("health") == "true"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s: the member goes, its data directory stays."""
        process = self._process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        self._process = None

    def kill(self) -> None:
        """SIGKILL the member at once (a crash); its data directory stays."""
        process = self._process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        self._process = None

    def wipe(self) -> None:
        """Remove the data directory of a stopped member: its next start is an empty etcd
        at the same endpoint (a member that lost its disk)."""
        if self.running:
            raise RuntimeError("stop etcd before wiping its data")
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self) -> None:
        """Stop and start again on the same ports and data directory."""
        self.stop()
        self.start()

    def close(self) -> None:
        """Kill the member and remove its files. Idempotent."""
        self.kill()
        shutil.rmtree(self._root, ignore_errors=True)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> EtcdServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A running etcd member for one test (skipped when there is no etcd), gone after it."""
    require_etcd()
    with EtcdServer() as server:
        yield server
