"""Mutual TLS on aioquic: the hook that makes both sides prove who they are.

aioquic 1.7 does not authenticate clients on its own: a server asks for a client
certificate only through a private, test-only switch, continues when the client sends an
empty Certificate message, and never checks a client's chain against any CA. On the client
side it checks the server's name with service_identity, which cannot express "this must be
node <uuid>". So we run our own :class:`~velomux_quic.security.verify.PeerVerifier` on both
sides, *inside* the handshake:

* accepting side: request a certificate, refuse an empty one (``certificate_required``),
  and verify chain, validity, key usage and the SPIFFE identity right after aioquic has
  checked the CertificateVerify signature (so the client proved it holds the key);
* dialing side: after the server's CertificateVerify signature check, verify the chain and
  that the identity is exactly the InstanceId we meant to reach.

A failure raises a TLS alert, so the handshake never completes: the peer's 1-RTT keys are
never installed and not one application byte of that connection can be decrypted, let alone
reach a handler. Session tickets are never issued or accepted (no PSK, no 0-RTT), so every
connection runs the certificate path.

The hook overrides three private methods of ``aioquic.tls.Context`` and reads or sets
three of its private attributes (``_peer_certificate``, ``_peer_certificate_chain``,
``_request_client_certificate``; see :class:`VerifyingContext`); the aioquic version range
is pinned in ``pyproject.toml`` and ``tests/unit/test_aioquic_assumptions.py`` pins each of
those names, so it fails first if one moves.
"""

from __future__ import annotations

from aioquic import tls
from aioquic._buffer import Buffer  # typed there; aioquic.buffer re-exports it untyped
from aioquic.quic.configuration import QuicConfiguration
from cryptography import x509

from ..ids import InstanceId
from .alerts import ALPN_PROTOCOL, Role, alert_code_of
from .certs import NodeCredentials
from .verify import PeerVerificationError, PeerVerifier

__all__ = [
    "VerifyingContext",
    "install_peer_verification",
    "make_quic_configuration",
    "presented_certificates",
]


class PeerRefusedAlert(tls.Alert):
    """A TLS alert whose text, the CONNECTION_CLOSE reason phrase, is our reason code only.

    The verification message names the CA's subject and serial, this node's clock and its
    trust domain: useful to the operator, who finds it in this node's log and in
    ``verification_error``, but nothing to tell a peer that may not be ours.
    """

    def __init__(self, error: PeerVerificationError) -> None:
        super().__init__(error.reason)
        self.description = tls.AlertDescription(alert_code_of(error.reason))
        self.reason = error.reason


class VerifyingContext(tls.Context):
    """aioquic's TLS context with peer verification, made by :func:`install_peer_verification`.

    The attributes below are set on an existing context whose class is switched to this
    subclass: aioquic builds the context inside ``QuicConnection._initialize`` and offers no
    factory hook, and re-implementing ``_initialize`` would copy far more private code.
    """

    velomux_verifier: PeerVerifier
    velomux_role: Role
    velomux_expected: InstanceId | None
    velomux_peer: InstanceId | None
    velomux_error: PeerVerificationError | None

    def _velomux_check(self) -> None:
        try:
            self.velomux_peer = self.velomux_verifier.verify(
                self._peer_certificate,
                self._peer_certificate_chain,
                role=self.velomux_role,
                expected=self.velomux_expected,
            )
        except PeerVerificationError as exc:
            self.velomux_error = exc
            raise PeerRefusedAlert(exc) from exc

    # accepting side --------------------------------------------------------------------

    def _server_handle_certificate(self, input_buf: Buffer) -> None:
        super()._server_handle_certificate(input_buf)
        if self._peer_certificate is None:
            # RFC 8446 lets a server continue without client authentication; we never do.
            error = PeerVerificationError(
                "no_certificate", "the client presented no certificate; mutual TLS is required"
            )
            self.velomux_error = error
            raise PeerRefusedAlert(error)

    def _signature_refused(self, alert: tls.Alert) -> PeerRefusedAlert:
        """aioquic found the CertificateVerify signature wrong: refuse it as ours, counted."""
        error = PeerVerificationError(
            "bad_signature",
            f"the {self.velomux_role}'s handshake signature does not match the key of the"
            f" certificate it presented ({type(alert).__name__}): it does not hold that"
            " certificate's private key",
        )
        self.velomux_error = error
        return PeerRefusedAlert(error)

    def _server_handle_certificate_verify(self, input_buf: Buffer) -> None:
        try:
            super()._server_handle_certificate_verify(input_buf)  # signature: key possession
        except tls.AlertDecryptError as exc:
            raise self._signature_refused(exc) from exc
        self._velomux_check()

    # dialing side ----------------------------------------------------------------------

    def _client_handle_certificate_verify(self, input_buf: Buffer) -> None:
        try:
            super()._client_handle_certificate_verify(input_buf)  # signature only (CERT_NONE)
        except tls.AlertDecryptError as exc:
            raise self._signature_refused(exc) from exc
        self._velomux_check()


def install_peer_verification(
    context: tls.Context,
    verifier: PeerVerifier,
    *,
    role: Role,
    expected: InstanceId | None = None,
) -> VerifyingContext:
    """Turn a fresh aioquic TLS context into one that verifies its peer.

    ``role`` is the role of the *peer*: a server verifies a ``"client"``, a client a
    ``"server"``. Must run before the first handshake message is handled.
    """
    if context.state not in (
        tls.State.CLIENT_HANDSHAKE_START,
        tls.State.SERVER_EXPECT_CLIENT_HELLO,
    ):
        raise RuntimeError("peer verification must be installed before the handshake starts")
    context.__class__ = VerifyingContext
    assert isinstance(context, VerifyingContext)
    context.velomux_verifier = verifier
    context.velomux_role = role
    context.velomux_expected = expected
    context.velomux_peer = None
    context.velomux_error = None
    if role == "client":
        context._request_client_certificate = True
    return context


def presented_certificates(
    context: object,
) -> tuple[x509.Certificate | None, x509.Certificate | None]:
    """(the certificate this side presents, the peer's once it passed verification).

    Read from the connection's own TLS context, so a connection made before a credentials
    reload reports the certificate it was made with, not the node's current one. Anything
    but a :class:`VerifyingContext` (no handshake yet) gives ``(None, None)``.
    """
    if not isinstance(context, VerifyingContext):
        return None, None
    peer = context._peer_certificate if context.velomux_peer is not None else None
    return context.certificate, peer


def make_quic_configuration(
    credentials: NodeCredentials,
    *,
    is_client: bool,
    max_datagram_size: int,
    idle_timeout: float,
    max_stream_data: int,
    max_data: int,
) -> QuicConfiguration:
    """The aioquic configuration of one side of a node-to-node connection.

    aioquic's own certificate checks are turned off (``verify_mode=CERT_NONE``) because
    :class:`VerifyingContext` performs stronger ones on both sides; no CA is loaded into
    aioquic, so nothing can accidentally fall back to certifi's public roots.
    """
    import ssl

    configuration = QuicConfiguration(
        alpn_protocols=[ALPN_PROTOCOL],
        is_client=is_client,
        max_datagram_size=max_datagram_size,
        idle_timeout=idle_timeout,
        max_stream_data=max_stream_data,
        max_data=max_data,
        verify_mode=ssl.CERT_NONE,
    )
    configuration.certificate = credentials.certificate
    configuration.certificate_chain = list(credentials.chain)
    configuration.private_key = credentials.private_key
    return configuration
