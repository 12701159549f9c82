"""Mutual TLS on qh3: client authentication added to its server, peer verification on both sides.

qh3 (2.1) authenticates no client: its TLS server has no state for a client Certificate or
CertificateVerify, writes EncryptedExtensions then Certificate in ``_server_handle_hello``
(RFC 8446 puts a CertificateRequest between them, in the transcript), and, outside its
ALPS path, hashes the client's Finished into the transcript before any client message
arrived ("anticipate client's FINISHED as we don't use client auth"). Its client side
does answer a CertificateRequest. :class:`Qh3VerifyingContext` closes that gap in the
handshake, the way :mod:`.tls` does for aioquic, with the same
:class:`~velomux_quic.security.verify.PeerVerifier`:

* accepting side: the CertificateRequest (empty context, our signature algorithms) is
  written right after EncryptedExtensions and hashed there, so the server's
  CertificateVerify and Finished and the 1-RTT keys cover it; the anticipated client
  Finished is not hashed; the client's Certificate (an empty one is refused,
  ``certificate_required``) and CertificateVerify are read in the handshake epoch, the
  signature over the transcript is checked with ``cryptography`` for the algorithms we
  asked for, then chain, validity, key usage, identity and trust domain; only then is the
  client's Finished checked, against the transcript that includes both messages;
* dialing side: after qh3 checked the server's CertificateVerify signature
  (``verify_mode=CERT_NONE``: qh3's own chain check is off), the verifier checks the
  chain and that the server is the InstanceId we meant to reach.

A refusal raises a TLS alert: the handshake never completes, the 1-RTT receive keys are
never installed, so not one application byte from that peer is decrypted. No session
ticket is issued or accepted (no PSK path, which would skip the certificates).

qh3's private names used here (``_server_handle_hello``, ``_server_handle_finished``,
``_client_handle_certificate_verify``, ``_receive_buffer``, ``_expected_verify_data``,
``_dec_key``, ``_peer_certificate``, ``_peer_certificate_chain``, ``key_schedule`` and the
order in which ``_server_handle_hello`` hashes its messages) are pinned by
``tests/unit/test_qh3_assumptions.py`` against the qh3 range in ``pyproject.toml``.
"""

from __future__ import annotations

import ssl
import struct
from typing import Any, cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa
from qh3 import tls as qtls
from qh3._hazmat import Buffer as QBuffer
from qh3._hazmat import Certificate as QCertificate
from qh3.quic.configuration import QuicConfiguration as Qh3Configuration

from ..ids import InstanceId
from .alerts import ALPN_PROTOCOL, Role, alert_code_of
from .certs import NodeCredentials
from .verify import PeerVerificationError, PeerVerifier

__all__ = [
    "CLIENT_SIGNATURE_ALGORITHMS",
    "Qh3VerifyingContext",
    "install_qh3_peer_verification",
    "make_qh3_configuration",
]

_ENCRYPTED_EXTENSIONS = 8
_CERTIFICATE = 11
_CERTIFICATE_REQUEST = 13
_CERTIFICATE_VERIFY = 15
_FINISHED = 20
_SIGNATURE_ALGORITHMS_EXTENSION = 13
_HANDSHAKE_EPOCH = int(qtls.Epoch.HANDSHAKE)

_ECDSA: dict[int, hashes.HashAlgorithm] = {
    0x0403: hashes.SHA256(),  # ecdsa_secp256r1_sha256
    0x0503: hashes.SHA384(),  # ecdsa_secp384r1_sha384
    0x0603: hashes.SHA512(),  # ecdsa_secp521r1_sha512
}
_RSA_PSS: dict[int, hashes.HashAlgorithm] = {
    0x0804: hashes.SHA256(),  # rsa_pss_rsae_sha256
    0x0805: hashes.SHA384(),
    0x0806: hashes.SHA512(),
}
_ED25519 = 0x0807

CLIENT_SIGNATURE_ALGORITHMS: tuple[int, ...] = (*_ECDSA, *_RSA_PSS, _ED25519)
"""What the CertificateRequest lets a client sign its CertificateVerify with: the TLS 1.3
algorithms ``cryptography`` checks here (no PKCS#1 v1.5, no SHA-1)."""


def _certificate_request() -> bytes:
    """A CertificateRequest handshake message: empty context, signature_algorithms only."""
    algorithms = b"".join(struct.pack("!H", a) for a in CLIENT_SIGNATURE_ALGORITHMS)
    extension = struct.pack(
        "!HHH", _SIGNATURE_ALGORITHMS_EXTENSION, len(algorithms) + 2, len(algorithms)
    )
    extensions = extension + algorithms
    body = b"\x00" + struct.pack("!H", len(extensions)) + extensions
    return bytes([_CERTIFICATE_REQUEST]) + len(body).to_bytes(3, "big") + body


CERTIFICATE_REQUEST = _certificate_request()


class PeerRefusedAlert(qtls.Alert):
    """A TLS alert whose text (the CONNECTION_CLOSE reason phrase) is our reason code only;
    the detail stays in this node's log and ``verification_error``."""

    def __init__(self, error: PeerVerificationError) -> None:
        super().__init__(error.reason)
        self.description = qtls.AlertDescription(alert_code_of(error.reason))
        self.reason = error.reason


class _TranscriptTap(qtls.KeySchedule):
    """The server's key schedule while it writes its first flight: it inserts the
    CertificateRequest after EncryptedExtensions and leaves out the anticipated Finished.

    qh3 makes the key schedule inside ``_server_handle_hello``; the context's
    ``key_schedule`` setter switches the new object to this class (same state, one more
    attribute), so every message qh3 pushes passes through :meth:`update_hash` in order.
    """

    velomux_context: Qh3VerifyingContext

    def update_hash(self, data: bytes) -> None:
        context = self.velomux_context
        if context.velomux_stage != "hello" or not data:
            super().update_hash(data)
            return
        kind = data[0]
        if kind == _FINISHED:
            if context.velomux_server_finished:
                context.velomux_anticipation_skipped = True
                return  # the client's Finished: hashed when it arrives, after its certificate
            context.velomux_server_finished = True
        super().update_hash(data)
        if kind == _ENCRYPTED_EXTENSIONS:
            buf = context.velomux_handshake_buf
            assert buf is not None
            buf.push_bytes(CERTIFICATE_REQUEST)
            super().update_hash(CERTIFICATE_REQUEST)
            context.velomux_request_sent = True


class Qh3VerifyingContext(qtls.Context):
    """qh3's TLS context with client authentication and peer verification.

    Made by :func:`install_qh3_peer_verification` from the context qh3's TLS bridge built
    (qh3 offers no factory for it), before the first handshake message.
    """

    velomux_verifier: PeerVerifier
    velomux_role: Role
    velomux_expected: InstanceId | None
    velomux_peer: InstanceId | None
    velomux_error: PeerVerificationError | None
    velomux_stage: str
    """Accepting side: ``hello``, ``certificate``, ``certificate_verify``, ``finished``,
    ``done``. Dialing side: ``client``."""
    velomux_handshake_buf: Any
    velomux_request_sent: bool
    velomux_server_finished: bool
    velomux_anticipation_skipped: bool
    velomux_peer_chain: list[x509.Certificate]

    @property
    def key_schedule(self) -> Any:
        return self.__dict__.get("_velomux_key_schedule")

    @key_schedule.setter
    def key_schedule(self, schedule: Any) -> None:
        if type(schedule) is qtls.KeySchedule and self.velomux_role == "client":
            schedule.__class__ = _TranscriptTap
            cast(_TranscriptTap, schedule).velomux_context = self
        self.__dict__["_velomux_key_schedule"] = schedule

    def _velomux_refuse(self, reason: str, message: str) -> PeerRefusedAlert:
        error = PeerVerificationError(reason, message)  # type: ignore[arg-type]
        self.velomux_error = error
        return PeerRefusedAlert(error)

    def _velomux_check(self, leaf: x509.Certificate, chain: list[x509.Certificate]) -> None:
        try:
            self.velomux_peer = self.velomux_verifier.verify(
                leaf, chain, role=self.velomux_role, expected=self.velomux_expected
            )
        except PeerVerificationError as exc:
            self.velomux_error = exc
            raise PeerRefusedAlert(exc) from exc

    # accepting side --------------------------------------------------------------------

    def _server_handle_hello(
        self, input_buf: Any, initial_buf: Any, handshake_buf: Any, onertt_buf: Any
    ) -> None:
        self.velomux_stage = "hello"
        self.velomux_handshake_buf = handshake_buf
        try:
            super()._server_handle_hello(input_buf, initial_buf, handshake_buf, onertt_buf)
        finally:
            self.velomux_handshake_buf = None
        if not (self.velomux_request_sent and self.velomux_anticipation_skipped):
            # qh3 wrote its first flight otherwise than pinned (a PSK, or a changed
            # _server_handle_hello): never go on without asking for the certificate.
            raise qtls.AlertInternalError("client authentication could not be requested")
        self.velomux_stage = "certificate"

    def handle_message(
        self, input_data: bytes, output_buf: dict[qtls.Epoch, Any], epoch: int = -1
    ) -> None:
        if self.velomux_stage not in ("certificate", "certificate_verify"):
            super().handle_message(input_data, output_buf, epoch)
            return
        self._receive_buffer += input_data
        while self.velomux_stage in ("certificate", "certificate_verify"):
            pending = self._receive_buffer
            if len(pending) < 4:
                return
            length = 4 + int.from_bytes(pending[1:4], "big")
            if len(pending) < length:
                return
            if epoch >= 0 and epoch != _HANDSHAKE_EPOCH:
                raise qtls.AlertUnexpectedMessage
            message, self._receive_buffer = pending[:length], pending[length:]
            if self.velomux_stage == "certificate":
                self._velomux_client_certificate(message)
            else:
                self._velomux_client_certificate_verify(message)
        rest, self._receive_buffer = self._receive_buffer, b""
        if rest:
            if rest[0] != _FINISHED:
                raise qtls.AlertUnexpectedMessage("expected the client's Finished")
            super().handle_message(rest, output_buf, epoch)

    def _velomux_client_certificate(self, message: bytes) -> None:
        if message[0] != _CERTIFICATE:
            raise self._velomux_refuse(
                "no_certificate",
                "the client answered the certificate request without a Certificate;"
                " mutual TLS is required",
            )
        buf = QBuffer(data=message)
        certificate = qtls.pull_certificate(buf)
        if not buf.eof():
            raise qtls.AlertDecodeError("extra bytes at the end of a handshake message")
        if certificate.request_context != b"":
            raise qtls.AlertIllegalParameter("unexpected certificate_request_context")
        if not certificate.certificates:
            raise self._velomux_refuse(
                "no_certificate", "the client presented no certificate; mutual TLS is required"
            )
        try:
            parsed = [x509.load_der_x509_certificate(der) for der, _ in certificate.certificates]
        except ValueError as exc:
            raise qtls.AlertBadCertificate("the client's certificate does not parse") from exc
        self._peer_certificate = QCertificate(certificate.certificates[0][0])
        self._peer_certificate_chain = [
            QCertificate(der) for der, _ in certificate.certificates[1:]
        ]
        self.velomux_peer_chain = parsed
        self.key_schedule.update_hash(message)
        self.velomux_stage = "certificate_verify"

    def _velomux_client_certificate_verify(self, message: bytes) -> None:
        if message[0] != _CERTIFICATE_VERIFY:
            raise qtls.AlertUnexpectedMessage("expected the client's CertificateVerify")
        buf = QBuffer(data=message)
        verify = qtls.pull_certificate_verify(buf)
        if not buf.eof():
            raise qtls.AlertDecodeError("extra bytes at the end of a handshake message")
        leaf = self.velomux_peer_chain[0]
        signed = self.key_schedule.certificate_verify_data(b"TLS 1.3, client CertificateVerify")
        if not _signature_valid(leaf, verify.algorithm, verify.signature, signed):
            raise self._velomux_refuse(
                "bad_signature",
                "the client's handshake signature does not match the key of the certificate"
                " it presented: it does not hold that certificate's private key",
            )
        self.key_schedule.update_hash(message)
        self._velomux_check(leaf, self.velomux_peer_chain[1:])
        self.velomux_stage = "finished"

    def _server_handle_finished(self, input_buf: Any, output_buf: Any) -> None:
        if self.velomux_stage != "finished":
            raise qtls.AlertUnexpectedMessage("the client's Finished before its certificate")
        # The transcript now holds the client's Certificate and CertificateVerify: what its
        # Finished covers (qh3 computed an expectation without them).
        self._expected_verify_data = self.key_schedule.finished_verify_data(self._dec_key)
        super()._server_handle_finished(input_buf, output_buf)
        self.key_schedule.update_hash(input_buf.data)
        self.velomux_stage = "done"

    # dialing side ----------------------------------------------------------------------

    def _client_handle_certificate_verify(self, input_buf: Any) -> None:
        try:
            super()._client_handle_certificate_verify(input_buf)  # signature only (CERT_NONE)
        except qtls.AlertDecryptError as exc:
            raise self._velomux_refuse(
                "bad_signature",
                f"the server's handshake signature does not match the key of the certificate"
                f" it presented ({exc}): it does not hold that certificate's private key",
            ) from exc
        peer = self._peer_certificate
        assert peer is not None
        leaf = x509.load_der_x509_certificate(peer.public_bytes())
        chain = [
            x509.load_der_x509_certificate(c.public_bytes()) for c in self._peer_certificate_chain
        ]
        self._velomux_check(leaf, chain)


def _signature_valid(
    certificate: x509.Certificate, algorithm: int, signature: bytes, data: bytes
) -> bool:
    """A TLS 1.3 CertificateVerify signature, checked with ``cryptography`` for the
    algorithms of :data:`CLIENT_SIGNATURE_ALGORITHMS` (others are refused)."""
    key = certificate.public_key()
    try:
        if algorithm in _ECDSA and isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(_ECDSA[algorithm]))
        elif algorithm in _RSA_PSS and isinstance(key, rsa.RSAPublicKey):
            digest = _RSA_PSS[algorithm]
            key.verify(
                signature,
                data,
                padding.PSS(mgf=padding.MGF1(digest), salt_length=digest.digest_size),
                digest,
            )
        elif algorithm == _ED25519 and isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            return False
    except InvalidSignature:
        return False
    return True


def install_qh3_peer_verification(
    context: qtls.Context,
    verifier: PeerVerifier,
    *,
    role: Role,
    expected: InstanceId | None = None,
) -> Qh3VerifyingContext:
    """Turn a fresh qh3 TLS context into one that verifies its peer (and, as a server,
    asks for the client's certificate). ``role`` is the role of the *peer*."""
    if context.state not in (
        qtls.State.CLIENT_HANDSHAKE_START,
        qtls.State.SERVER_EXPECT_CLIENT_HELLO,
    ):
        raise RuntimeError("peer verification must be installed before the handshake starts")
    if context.get_session_ticket_cb is not None or context.new_session_ticket_cb is not None:
        raise RuntimeError("session tickets would skip the certificates: none may be set")
    schedule = context.key_schedule
    context.__class__ = Qh3VerifyingContext
    assert isinstance(context, Qh3VerifyingContext)
    context.velomux_verifier = verifier
    context.velomux_role = role
    context.velomux_expected = expected
    context.velomux_peer = None
    context.velomux_error = None
    context.velomux_stage = "client" if role == "server" else "start"
    context.velomux_handshake_buf = None
    context.velomux_request_sent = False
    context.velomux_server_finished = False
    context.velomux_anticipation_skipped = False
    context.velomux_peer_chain = []
    context.key_schedule = schedule
    return context


def make_qh3_configuration(
    credentials: NodeCredentials,
    *,
    is_client: bool,
    max_datagram_size: int,
    idle_timeout: float,
    max_stream_data: int,
    max_data: int,
) -> Qh3Configuration:
    """The qh3 configuration of one side of a node-to-node connection.

    qh3's own certificate checks are off (``verify_mode=CERT_NONE``, no CA loaded) because
    :class:`Qh3VerifyingContext` performs the project's on both sides; its own path MTU
    probing is off (the transport plans datagram sizes itself).
    """
    configuration = Qh3Configuration(
        alpn_protocols=[ALPN_PROTOCOL],
        is_client=is_client,
        max_datagram_size=max_datagram_size,
        probe_datagram_size=False,
        idle_timeout=idle_timeout,
        max_stream_data=max_stream_data,
        max_data=max_data,
        verify_mode=ssl.CERT_NONE,
        verify_hostname=False,
        # aioquic's initial RTT: qh3's own (333 ms, RFC 9002's default for the open
        # Internet) paces a new connection's first flight at a tenth of the speed across a
        # cluster's network, and the two engines should start alike.
        initial_rtt=0.1,
    )
    configuration.certificate = QCertificate(
        credentials.certificate.public_bytes(serialization.Encoding.DER)
    )
    configuration.certificate_chain = [
        QCertificate(c.public_bytes(serialization.Encoding.DER)) for c in credentials.chain
    ]
    configuration.private_key = qtls.load_pem_private_key(
        credentials.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return configuration
