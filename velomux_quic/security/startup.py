"""A node's own credentials, checked before it starts: the checks a reload applies too.

A node started on a certificate every peer refuses (expired, not yet valid, or with a key
that is not its own) would run, listen and fail every dial with a peer's terse refusal on
some other host. It is refused here instead, with the file, the dates and the fix, the
way :func:`~velomux_quic.security.rotation.check_replacement` refuses such a set at a
reload, so start and reload agree.

It also says which certificates expire soon (the node's own and the CAs it trusts), for
the warning a node logs when it starts or reloads and the gauge operators alert on.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes

from ..errors import CredentialsError
from .certs import NODE_CERT_FILE, NODE_KEY_FILE, NodeCredentials

__all__ = [
    "Expiring",
    "check_own_credentials",
    "expiring_certificates",
    "own_certificate_refusal",
    "utc_text",
]

_RENEW = (
    "renew it with 'velomux certs renew --ca CA_DIR --node-dir {directory}' ('velomux certs "
    "dev --out DIR' re-issues a dev cluster's expired certificates), then start again"
)


def utc_text(moment: datetime) -> str:
    """A date as messages and events print it: ``2026-12-05 00:10:09 UTC``."""
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def check_own_credentials(
    credentials: NodeCredentials, source: Path | None, *, now: datetime | None = None
) -> None:
    """Raise :class:`~velomux_quic.errors.CredentialsError` unless a node may start on
    ``credentials``: its key must match its certificate, and the certificate must be
    valid now. ``source`` is the directory they were read from (None: built in code),
    named in the message; ``now`` exists for tests."""
    now = now or datetime.now(UTC)
    certificate = credentials.certificate
    where = (
        f"{source / NODE_CERT_FILE}" if source is not None else "the node certificate given"
    ) + f" (serial {certificate.serial_number:x}, node {credentials.name!r})"
    directory = str(source) if source is not None else "NODE_DIR"
    if _spki(credentials.private_key.public_key()) != _spki(certificate.public_key()):
        key = f"{source / NODE_KEY_FILE}" if source is not None else "the private key given"
        raise CredentialsError(
            f"{key} does not match {where}: restore the matching key, or issue a new pair "
            f"with 'velomux certs issue --ca CA_DIR --name {credentials.name} --out {directory} "
            "--force'"
        )
    not_after = certificate.not_valid_after_utc
    not_before = certificate.not_valid_before_utc
    if now > not_after:
        raise CredentialsError(
            f"{where} expired on {utc_text(not_after)} (not after); every peer would refuse "
            f"it: {_RENEW.format(directory=directory)}"
        )
    if now < not_before:
        raise CredentialsError(
            f"{where} is not valid before {utc_text(not_before)} (it is {utc_text(now)} "
            "here); every peer would refuse it: check this host's clock (NTP), or wait until "
            "then, or issue one valid now with 'velomux certs renew'"
        )


def own_certificate_refusal(
    credentials: NodeCredentials, reason: str | None, phrase: str, *, now: datetime | None = None
) -> str:
    """Why a peer refused this node's certificate, in words, with the fix: the peer sends
    only a reason code (``expired``, ``untrusted_chain``, ...), so the dates and the issuer
    said here are read from the certificate this node presented."""
    now = now or datetime.now(UTC)
    certificate = credentials.certificate
    ours = (
        f"serial {certificate.serial_number:x}, issuer "
        f"'{certificate.issuer.rfc4514_string()}', not after "
        f"{utc_text(certificate.not_valid_after_utc)}"
    )
    if reason == "expired":
        return (
            f"expired ({ours}): renew it (velomux certs renew) and reload it (SIGHUP, or "
            "node.reload_credentials())"
        )
    if reason == "not_yet_valid":
        return (
            f"not yet valid ({ours}; valid from "
            f"{utc_text(certificate.not_valid_before_utc)}, it is {utc_text(now)} here): "
            "check the clocks of both hosts"
        )
    if reason == "untrusted_chain":
        return (
            f"untrusted_chain ({ours}): the peer trusts none of the CAs that signed it; "
            "give the peer this node's CA ('velomux certs trust --node-dir PEER_DIR --add "
            "ca.pem') or issue this node's certificate from the peer's CA"
        )
    return f"{reason or phrase} ({ours})"


@dataclass(frozen=True, slots=True)
class Expiring:
    """One certificate a node relies on and when it expires."""

    which: str
    """``node`` (its own certificate) or ``ca`` (a trust root)."""
    subject: str
    not_after: datetime
    seconds_left: float
    """Negative once it has expired."""


def expiring_certificates(
    credentials: NodeCredentials, *, now: datetime | None = None
) -> list[Expiring]:
    """The node's certificate and each of its trust roots, soonest expiry first."""
    now = now or datetime.now(UTC)
    found = [_expiring("node", credentials.certificate, now)]
    found.extend(_expiring("ca", root, now) for root in credentials.trust_roots)
    return sorted(found, key=lambda each: each.seconds_left)


def _expiring(which: str, certificate: x509.Certificate, now: datetime) -> Expiring:
    not_after = certificate.not_valid_after_utc
    return Expiring(
        which=which,
        subject=certificate.subject.rfc4514_string(),
        not_after=not_after,
        seconds_left=(not_after - now).total_seconds(),
    )


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
