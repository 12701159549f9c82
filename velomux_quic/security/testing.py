"""Deliberately bad credentials, for tests of the refusal paths. Never use them otherwise.

Each helper changes exactly one property of an otherwise good node certificate (built by
the same code as real ones), so a test that expects a refusal fails for the reason it
names and not for some incidental defect. They return :class:`NodeCredentials` so a
transport test can start a node with them as easily as with real ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from ..ids import InstanceId, new_instance_id
from .certs import (
    NODE_EXTENDED_KEY_USAGES,
    CertificateAuthority,
    NodeCredentials,
    generate_private_key,
    issue_node_certificate,
)
from .certs import _sign_leaf as sign_leaf

__all__ = [
    "CLIENT_ONLY",
    "SERVER_ONLY",
    "issue_expired",
    "issue_not_yet_valid",
    "issue_with_uris",
    "issue_with_usages",
    "self_signed_copy",
    "with_mismatched_key",
]

SERVER_ONLY = (ExtendedKeyUsageOID.SERVER_AUTH,)
CLIENT_ONLY = (ExtendedKeyUsageOID.CLIENT_AUTH,)


def _sans(certificate: x509.Certificate) -> list[x509.GeneralName]:
    ext = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return list(ext.value)


def _like(
    ca: CertificateAuthority,
    name: str,
    instance: InstanceId,
    *,
    names: Sequence[x509.GeneralName] | None = None,
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    extended_key_usages: Sequence[x509.ObjectIdentifier] | None = NODE_EXTENDED_KEY_USAGES,
    digital_signature: bool = True,
) -> NodeCredentials:
    good = issue_node_certificate(ca, instance, name=name)
    key = good.private_key
    now = datetime.now(UTC)
    certificate = sign_leaf(
        subject=good.certificate.subject,
        public_key=key.public_key(),
        issuer_name=ca.certificate.subject,
        issuer_public_key=ca.private_key.public_key(),
        signing_key=ca.private_key,
        names=_sans(good.certificate) if names is None else names,
        not_before=not_before or now - timedelta(minutes=5),
        not_after=not_after or now + timedelta(days=30),
        extended_key_usages=extended_key_usages,
        digital_signature=digital_signature,
    )
    return dataclasses.replace(good, certificate=certificate)


def self_signed_copy(victim: NodeCredentials, *, mimic_issuer: bool = False) -> NodeCredentials:
    """A forgery: the victim's subject, SANs and usages on a certificate it signed itself.

    With ``mimic_issuer`` the forgery also claims the victim's issuer name, so a verifier
    finds the real CA by name and must notice that the signature does not match. The
    forger keeps the victim's trust roots, so it can still dial and verify real nodes.
    """
    key = generate_private_key()
    certificate = victim.certificate
    ku = certificate.extensions.get_extension_for_class(x509.KeyUsage).value
    eku = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    forged = sign_leaf(
        subject=certificate.subject,
        public_key=key.public_key(),
        issuer_name=certificate.issuer if mimic_issuer else certificate.subject,
        issuer_public_key=key.public_key(),
        signing_key=key,
        names=_sans(certificate),
        not_before=certificate.not_valid_before_utc,
        not_after=certificate.not_valid_after_utc,
        extended_key_usages=list(eku),
        digital_signature=ku.digital_signature,
    )
    return dataclasses.replace(victim, certificate=forged, private_key=key, chain=[])


def issue_expired(
    ca: CertificateAuthority,
    instance: InstanceId,
    *,
    name: str,
    now: datetime | None = None,
) -> NodeCredentials:
    """Signed by the real CA, valid for a month that ended a day before ``now``."""
    now = now or datetime.now(UTC)
    return issue_node_certificate(
        ca,
        instance,
        name=name,
        not_before=now - timedelta(days=31),
        not_after=now - timedelta(days=1),
    )


def issue_not_yet_valid(
    ca: CertificateAuthority,
    instance: InstanceId,
    *,
    name: str,
    now: datetime | None = None,
) -> NodeCredentials:
    """Signed by the real CA, valid only from a day after ``now``."""
    now = now or datetime.now(UTC)
    return issue_node_certificate(
        ca,
        instance,
        name=name,
        not_before=now + timedelta(days=1),
        not_after=now + timedelta(days=30),
    )


def issue_with_usages(
    ca: CertificateAuthority,
    instance: InstanceId,
    *,
    name: str,
    extended_key_usages: Sequence[x509.ObjectIdentifier] | None,
    digital_signature: bool = True,
) -> NodeCredentials:
    """Signed by the real CA with the given EKUs (``None``: no EKU extension at all).

    ``SERVER_ONLY`` makes a certificate that must be refused when it dials;
    ``CLIENT_ONLY`` one that must be refused when it is dialed.
    """
    return _like(
        ca,
        name,
        instance,
        extended_key_usages=extended_key_usages,
        digital_signature=digital_signature,
    )


def issue_with_uris(
    ca: CertificateAuthority,
    uris: Sequence[str],
    *,
    name: str,
    instance: InstanceId | None = None,
) -> NodeCredentials:
    """Signed by the real CA, with exactly these URI SANs (plus ``localhost``).

    For identities the verifier must refuse although the chain is fine: two SPIFFE IDs,
    a foreign trust domain, a malformed path, none at all. ``instance`` only fills the
    returned dataclass; the certificate says whatever ``uris`` say.
    """
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(uri) for uri in uris]
    names.append(x509.DNSName("localhost"))
    return _like(ca, name, instance or new_instance_id(), names=names)


def with_mismatched_key(credentials: NodeCredentials) -> NodeCredentials:
    """The same certificate paired with a key that does not belong to it.

    Built by constructing the dataclass directly: :meth:`NodeCredentials.load` would
    refuse exactly this, which is the point of having it for tests.
    """
    return dataclasses.replace(credentials, private_key=generate_private_key())
