"""Deciding whether a peer's certificate proves it is a node of this cluster, and which one.

One verifier serves both sides of a connection. The accepting side calls it with
``role="client"`` (the peer dialed us) and learns who dialed; the dialing side calls it
with ``role="server"`` and ``expected=`` the InstanceId it meant to reach.

Why the client verifier of ``cryptography.x509.verification`` is used for both roles:
the server verifier insists on a DNS name or IP address to match, but a node's identity
is its SPIFFE URI, and the address we dialed proves nothing about who answered. The
client verifier does the same chain building, signature, validity, basic-constraints and
web PKI extension checks without a name, but enforces the clientAuth EKU itself. So the
leaf's keyUsage/EKU validators are replaced with permissive ones through
``ExtensionPolicy`` (cryptography 45+), and this module checks the usage for the actual
role afterwards, where it can also report *why* a certificate was refused. The CA policy
gets a role-aware EKU validator for the same reason: a CA restricted to serverAuth must
still be able to vouch for a server.

Checks run in an order chosen for the precision of the refusal: no certificate, then
validity dates (so an expired certificate is reported as expired, not as untrusted),
then the chain, then key usage, then identity, then the expected InstanceId.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Literal, get_args

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import (
    Criticality,
    ExtensionPolicy,
    Policy,
    PolicyBuilder,
    Store,
    VerificationError,
)

from ..errors import PeerVerificationError, RefusalReason
from ..ids import InstanceId
from .identity import SPIFFE_SCHEME, parse_spiffe, validate_trust_domain

__all__ = ["PeerRole", "PeerVerificationError", "PeerVerifier", "RefusalReason"]

PeerRole = Literal["client", "server"]

_REASONS: frozenset[str] = frozenset(get_args(RefusalReason))
_ROLE_EKU = {"client": ExtendedKeyUsageOID.CLIENT_AUTH, "server": ExtendedKeyUsageOID.SERVER_AUTH}
_PEER_WORDS = {"client": "the connecting peer", "server": "the dialed peer"}
_RENEW_LEAF = "issue it a new certificate with 'velomux certs issue'"
_RENEW_CA = "create a new CA ('velomux certs init-ca') and re-issue every node certificate"


def _utc(now: datetime | None) -> datetime:
    if now is None:
        return datetime.now(UTC)
    return now.replace(tzinfo=UTC) if now.tzinfo is None else now.astimezone(UTC)


def _describe(certificate: x509.Certificate) -> str:
    return f"'{certificate.subject.rfc4514_string()}' (serial {certificate.serial_number:x})"


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%SZ")


_EkuValidator = Callable[[Policy, x509.Certificate, x509.ExtendedKeyUsage | None], None]


def _ca_eku_validator(role: PeerRole) -> _EkuValidator:
    wanted = _ROLE_EKU[role]

    def validate(
        _policy: Policy, certificate: x509.Certificate, eku: x509.ExtendedKeyUsage | None
    ) -> None:
        if eku is None or wanted in eku or ExtendedKeyUsageOID.ANY_EXTENDED_KEY_USAGE in eku:
            return
        raise ValueError(
            f"CA certificate {_describe(certificate)} may not vouch for a TLS {role} "
            "(its extendedKeyUsage excludes it)"
        )

    return validate


class PeerVerifier:
    """Verifies peer certificates against a fixed set of trust roots and a trust domain.

    Built once per node and shared by all its connections: the trust store is made here,
    and each :meth:`verify` only builds a small policy object around it (the validation
    time differs per call, and cryptography fixes it when the verifier is built).
    """

    __slots__ = ("_policies", "_roots", "_store", "_trust_domain")

    def __init__(self, trust_roots: Sequence[x509.Certificate], trust_domain: str) -> None:
        roots = list(trust_roots)
        if not roots:
            raise ValueError("a PeerVerifier needs at least one trust root (the cluster CA)")
        self._roots = tuple(roots)
        self._trust_domain = validate_trust_domain(trust_domain)
        self._store = Store(roots)
        leaf_policy = (
            ExtensionPolicy.webpki_defaults_ee()
            .may_be_present(x509.KeyUsage, Criticality.AGNOSTIC, None)
            .may_be_present(x509.ExtendedKeyUsage, Criticality.AGNOSTIC, None)
        )
        self._policies: dict[str, tuple[ExtensionPolicy, ExtensionPolicy]] = {
            role: (
                ExtensionPolicy.webpki_defaults_ca().may_be_present(
                    x509.ExtendedKeyUsage, Criticality.AGNOSTIC, _ca_eku_validator(role)
                ),
                leaf_policy,
            )
            for role in get_args(PeerRole)
        }

    @property
    def trust_domain(self) -> str:
        return self._trust_domain

    @property
    def trust_roots(self) -> tuple[x509.Certificate, ...]:
        return self._roots

    def verify(
        self,
        leaf: x509.Certificate | None,
        intermediates: Sequence[x509.Certificate],
        *,
        role: PeerRole,
        expected: InstanceId | None = None,
        now: datetime | None = None,
    ) -> InstanceId:
        """Return the InstanceId ``leaf`` proves, or raise :class:`PeerVerificationError`.

        ``role`` is the role of the *peer* being verified: ``"client"`` on the accepting
        side, ``"server"`` on the dialing side. ``now`` exists for tests.
        """
        if role not in self._policies:
            raise ValueError(f"role must be 'client' or 'server', got {role!r}")
        peer = _PEER_WORDS[role]
        if leaf is None:
            raise PeerVerificationError(
                "no_certificate",
                f"{peer} presented no certificate; every node must present the certificate "
                "its cluster CA issued to it",
            )
        when = _utc(now)
        chain = list(intermediates)
        self._check_dates(leaf, chain, when, peer)
        self._check_chain(leaf, chain, when, role, peer)
        _check_usage(leaf, role, peer)
        instance = self._identity(leaf, peer)
        if expected is not None and instance != expected:
            raise PeerVerificationError(
                "identity_mismatch",
                f"{peer} is node {instance}, not {expected} as expected: the address may "
                "now belong to another node, or the peer list is out of date",
            )
        return instance

    def _check_dates(
        self, leaf: x509.Certificate, chain: list[x509.Certificate], when: datetime, peer: str
    ) -> None:
        _check_validity(leaf, when, f"{peer}'s certificate {_describe(leaf)}", _RENEW_LEAF)
        for certificate in chain:
            what = f"intermediate CA {_describe(certificate)} sent by {peer}"
            _check_validity(certificate, when, what, "renew that intermediate CA")

    def _check_chain(
        self,
        leaf: x509.Certificate,
        chain: list[x509.Certificate],
        when: datetime,
        role: PeerRole,
        peer: str,
    ) -> None:
        ca_policy, ee_policy = self._policies[role]
        verifier = (
            PolicyBuilder()
            .store(self._store)
            .time(when)
            .extension_policies(ca_policy=ca_policy, ee_policy=ee_policy)
            .build_client_verifier()
        )
        try:
            verifier.verify(leaf, chain)
        except VerificationError as exc:
            self._explain_root_dates(leaf, chain, when)
            # Only the wording depends on cryptography's message, never the reason.
            hint = (
                "it was not issued by a CA this node trusts (another cluster's CA, or forged)"
                if "candidates exhausted" in str(exc)
                else "the chain breaks the certificate profile"
            )
            roots = ", ".join(_describe(root) for root in self._roots)
            raise PeerVerificationError(
                "untrusted_chain",
                f"{peer}'s certificate {_describe(leaf)}, issuer "
                f"'{leaf.issuer.rfc4514_string()}', was refused: {hint}. Trusted CAs: "
                f"{roots}. Detail: {exc}",
            ) from exc

    def _explain_root_dates(
        self, leaf: x509.Certificate, chain: list[x509.Certificate], when: datetime
    ) -> None:
        """Report an out-of-date cluster CA as such, not as an untrusted chain.

        Only reached once the chain has failed, so the happy path never pays for it. A
        root counts only if it is the named issuer and no valid root of that name exists.
        """
        issuer = (chain[-1] if chain else leaf).issuer
        candidates = [root for root in self._roots if root.subject == issuer]
        if not candidates or any(_valid_at(root, when) for root in candidates):
            return
        for root in candidates:
            what = f"this node's trusted cluster CA {_describe(root)}"
            _check_validity(root, when, what, _RENEW_CA)

    def _identity(self, leaf: x509.Certificate, peer: str) -> InstanceId:
        try:
            san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            san = x509.SubjectAlternativeName([])
        uris = [
            uri
            for uri in san.get_values_for_type(x509.UniformResourceIdentifier)
            if uri.partition(":")[0].lower() == SPIFFE_SCHEME
        ]
        if len(uris) != 1:
            found = "none" if not uris else ", ".join(uris)
            raise PeerVerificationError(
                "bad_identity",
                f"{peer}'s certificate {_describe(leaf)} must name exactly one node with a "
                f"URI SAN 'spiffe://{self._trust_domain}/instance/<uuid>'; found {found}",
            )
        try:
            trust_domain, instance = parse_spiffe(uris[0])
        except ValueError as exc:
            raise PeerVerificationError(
                "bad_identity", f"{peer}'s certificate {_describe(leaf)}: {exc}"
            ) from exc
        if trust_domain != self._trust_domain:
            raise PeerVerificationError(
                "bad_identity",
                f"{peer}'s certificate {_describe(leaf)} names a node of trust domain "
                f"{trust_domain!r}, but this cluster is {self._trust_domain!r}",
            )
        return instance


def _valid_at(certificate: x509.Certificate, when: datetime) -> bool:
    return certificate.not_valid_before_utc <= when <= certificate.not_valid_after_utc


def _check_validity(certificate: x509.Certificate, when: datetime, what: str, remedy: str) -> None:
    if when < certificate.not_valid_before_utc:
        raise PeerVerificationError(
            "not_yet_valid",
            f"{what} is not valid until {_stamp(certificate.not_valid_before_utc)} (it is "
            f"now {_stamp(when)}): check the clocks of both hosts",
        )
    if when > certificate.not_valid_after_utc:
        raise PeerVerificationError(
            "expired",
            f"{what} expired at {_stamp(certificate.not_valid_after_utc)} (it is now "
            f"{_stamp(when)}): {remedy}",
        )


def _check_usage(leaf: x509.Certificate, role: PeerRole, peer: str) -> None:
    """Key usage as the SPIFFE X.509-SVID profile and TLS 1.3 require for this role.

    digitalSignature is what a TLS 1.3 CertificateVerify exercises; keyCertSign or
    cRLSign on a leaf would let a node key pass as a CA; the EKU must name the role the
    peer is acting in, so a server-only certificate cannot be used to dial.
    """
    what = f"{peer}'s certificate {_describe(leaf)}"
    try:
        usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        raise PeerVerificationError(
            "bad_key_usage", f"{what} has no keyUsage extension (digitalSignature is required)"
        ) from None
    if not usage.digital_signature:
        raise PeerVerificationError(
            "bad_key_usage", f"{what} does not allow digitalSignature in its keyUsage"
        )
    if usage.key_cert_sign or usage.crl_sign:
        raise PeerVerificationError(
            "bad_key_usage", f"{what} is a node certificate but allows signing certificates"
        )
    wanted = _ROLE_EKU[role]
    try:
        eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        raise PeerVerificationError(
            "bad_key_usage",
            f"{what} has no extendedKeyUsage; a node certificate needs serverAuth and clientAuth",
        ) from None
    if wanted not in eku:
        raise PeerVerificationError(
            "bad_key_usage",
            f"{what} may not act as a TLS {role}: its extendedKeyUsage lacks "
            f"{'clientAuth' if role == 'client' else 'serverAuth'}; re-issue it with both",
        )
