"""Replacing a running node's credentials: what may change, and what is refused.

A running node may take a new certificate, a new key and new trust roots (a renewal, a
CA roll), but never a new identity: its InstanceId and trust domain are what every peer,
ticket and peer record knows it by, so changing them requires a restart. Everything is
checked here, before the transport swaps anything, so a refused set leaves the node on
the credentials it had; the message says what is wrong and that the old ones stay.

The checks are the ones a peer would apply to this node's certificate (chain, validity,
key usage for both TLS roles, identity), run with the *new* trust roots: a set whose own
certificate would not pass under its own roots cannot be meant, and would at best be
refused by every peer once the CA roll finishes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from ..errors import CredentialsError, PeerVerificationError
from .certs import NodeCredentials
from .verify import PeerVerifier

__all__ = [
    "CertificateSummary",
    "check_replacement",
    "load_replacement",
    "summarize_certificate",
]

_KEPT = "the node keeps its current credentials"


@dataclass(frozen=True, slots=True)
class CertificateSummary:
    """Which certificate is which, without holding the certificate: for snapshots and logs."""

    serial: str
    """The serial number in lower-case hex (as refusal messages and ``openssl x509`` print it)."""
    fingerprint: str
    """SHA-256 of the DER certificate, lower-case hex."""
    subject: str
    issuer: str
    """The issuing CA's subject (RFC 4514), which tells a CA roll's old and new CA apart
    only if their names differ; the fingerprint of the CA is in ``ca.pem``."""
    not_before: datetime
    not_after: datetime


def summarize_certificate(certificate: x509.Certificate) -> CertificateSummary:
    """The :class:`CertificateSummary` of ``certificate``."""
    der = certificate.public_bytes(serialization.Encoding.DER)
    return CertificateSummary(
        serial=f"{certificate.serial_number:x}",
        fingerprint=hashlib.sha256(der).hexdigest(),
        subject=certificate.subject.rfc4514_string(),
        issuer=certificate.issuer.rfc4514_string(),
        not_before=certificate.not_valid_before_utc,
        not_after=certificate.not_valid_after_utc,
    )


def load_replacement(source: NodeCredentials | str | Path) -> NodeCredentials:
    """The credentials ``source`` names, every failure to read them a CredentialsError.

    ``NodeCredentials.load`` already refuses a key that does not belong to its
    certificate and a certificate naming another node than ``node.json``; an unreadable
    file (permissions, a directory where a file should be) is turned into the same error
    here, so a reload never escapes with a bare ``OSError``.
    """
    if isinstance(source, NodeCredentials):
        return source
    try:
        return NodeCredentials.load(source)
    except CredentialsError as exc:
        raise CredentialsError(f"credentials in {source} refused: {exc}; {_KEPT}") from exc
    except (OSError, ValueError, KeyError) as exc:
        raise CredentialsError(
            f"credentials in {source} could not be read ({type(exc).__name__}: {exc}); {_KEPT}"
        ) from exc


def check_replacement(
    current: NodeCredentials, new: NodeCredentials, *, now: datetime | None = None
) -> None:
    """Raise CredentialsError unless ``new`` may replace ``current`` under a running node.

    Refused: a key that does not match the certificate; another InstanceId or trust
    domain; no trust roots; a certificate expired or not yet valid; a certificate that
    does not chain to one of the new trust roots (or fails the node certificate profile).
    ``now`` exists for tests.
    """
    where = f"the new certificate (serial {new.certificate.serial_number:x})"
    if _spki(new.private_key.public_key()) != _spki(new.certificate.public_key()):
        raise CredentialsError(
            f"the new private key does not match {where}: re-issue the pair or restore the "
            f"matching key; {_KEPT}"
        )
    if new.instance_id != current.instance_id:
        raise CredentialsError(
            f"{where} names node {new.instance_id}, but this node is {current.instance_id}: "
            f"an identity cannot change under a running node (restart it for that); {_KEPT}"
        )
    if new.trust_domain != current.trust_domain:
        raise CredentialsError(
            f"{where} is for trust domain {new.trust_domain!r}, but this node belongs to "
            f"{current.trust_domain!r}: a trust domain cannot change under a running node "
            f"(restart it for that); {_KEPT}"
        )
    if not new.trust_roots:
        raise CredentialsError(f"the new credentials hold no trust roots (ca.pem); {_KEPT}")
    try:
        verifier = PeerVerifier(new.trust_roots, new.trust_domain)
        for role in ("client", "server"):
            verifier.verify(
                new.certificate, new.chain, role=role, expected=current.instance_id, now=now
            )
    except PeerVerificationError as exc:
        raise CredentialsError(
            f"{where} would be refused by a peer trusting the new trust roots "
            f"({exc.reason}: {exc}); {_KEPT}"
        ) from exc
    except ValueError as exc:
        raise CredentialsError(f"the new trust roots are unusable ({exc}); {_KEPT}") from exc


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
