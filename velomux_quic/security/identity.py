"""A node's identity as it appears in its certificate: a SPIFFE ID naming its InstanceId.

The form is ``spiffe://<trust-domain>/instance/<uuid>``. A URI SAN is used (rather than a
URN, or a name in the subject) because aioquic's client-side name check parses every SAN
with ``service_identity`` and fails the handshake on URI forms it cannot read; the SPIFFE
form parses cleanly and is what existing workload-identity tooling expects.

Parsing is deliberately strict: exactly one spelling is accepted for every InstanceId,
so two certificates can never name the same node in different ways, and nothing that
merely resembles an identity (another trust domain, another path, a query, a fragment,
an upper-case or braced UUID) is ever taken for one.
"""

from __future__ import annotations

import re

from ..ids import InstanceId

__all__ = [
    "DEFAULT_TRUST_DOMAIN",
    "SPIFFE_SCHEME",
    "instance_from_spiffe",
    "parse_spiffe",
    "spiffe_uri",
    "trust_domain_uri",
    "validate_trust_domain",
]

DEFAULT_TRUST_DOMAIN = "velomux.local"
SPIFFE_SCHEME = "spiffe"

# SPIFFE ID spec, section 2.1: a trust domain is lower-case letters, digits, dots,
# dashes and underscores; no port, no user info, no percent-encoding.
_TRUST_DOMAIN_RE = re.compile(r"[a-z0-9._-]+")
_MAX_TRUST_DOMAIN = 255
_CANONICAL_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_INSTANCE_URI_RE = re.compile(rf"spiffe://([a-z0-9._-]+)/instance/({_CANONICAL_UUID})")


def validate_trust_domain(trust_domain: str) -> str:
    """Return ``trust_domain`` unchanged if it is a valid SPIFFE trust domain name.

    Checked wherever a trust domain enters the system (CA creation, CLI flags, verifier
    construction), so a typo fails at configuration time rather than as a mysterious
    identity refusal on the first connection.
    """
    if (
        not isinstance(trust_domain, str)
        or not trust_domain
        or len(trust_domain) > _MAX_TRUST_DOMAIN
        or _TRUST_DOMAIN_RE.fullmatch(trust_domain) is None
        or trust_domain.strip(".") != trust_domain
        or ".." in trust_domain
    ):
        raise ValueError(
            f"invalid trust domain {trust_domain!r}: use lower-case letters, digits, "
            "'.', '-' and '_' only, such as 'velomux.local' or 'prod.example.com'"
        )
    return trust_domain


def trust_domain_uri(trust_domain: str) -> str:
    """The SPIFFE ID of a trust domain itself (``spiffe://<td>``), as the CA carries it."""
    return f"{SPIFFE_SCHEME}://{validate_trust_domain(trust_domain)}"


def spiffe_uri(instance: InstanceId, trust_domain: str) -> str:
    """The URI SAN that names ``instance`` inside ``trust_domain``."""
    return f"{trust_domain_uri(trust_domain)}/instance/{instance.uuid}"


def parse_spiffe(uri: str) -> tuple[str, InstanceId]:
    """Split an instance SPIFFE ID into (trust domain, InstanceId), in any trust domain.

    Exists so a verifier can tell "this node belongs to another cluster" apart from
    "this is not one of our identities at all"; both are refusals, but an operator fixes
    them differently. Raises ``ValueError`` for anything but the canonical form.
    """
    match = _INSTANCE_URI_RE.fullmatch(uri) if isinstance(uri, str) else None
    if match is None:
        raise ValueError(
            f"{uri!r} is not a node identity: expected "
            "'spiffe://<trust-domain>/instance/<lower-case uuid>'"
        )
    trust_domain, text = match.groups()
    validate_trust_domain(trust_domain)
    return trust_domain, InstanceId.parse(text)


def instance_from_spiffe(uri: str, trust_domain: str) -> InstanceId:
    """The InstanceId named by ``uri``, which must belong to ``trust_domain``.

    Raises ``ValueError`` on any other form, including a valid identity from another
    trust domain: a certificate from a neighbouring cluster must never pass as ours.
    """
    found_domain, instance = parse_spiffe(uri)
    if found_domain != validate_trust_domain(trust_domain):
        raise ValueError(f"{uri!r} belongs to trust domain {found_domain!r}, not {trust_domain!r}")
    return instance
