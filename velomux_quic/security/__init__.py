"""Mutual TLS for node-to-node connections: the cluster CA, node certificates, identity.

Identity comes from the certificate, never from anything a peer says later: a node's
certificate carries its InstanceId as ``spiffe://<trust-domain>/instance/<uuid>``, and
:class:`PeerVerifier` turns a verified certificate into that InstanceId on both sides of
every connection. Nothing here imports aioquic; the hook that runs the verifier inside
aioquic's handshake lives in ``security.tls``.

What this package exports is the certificate toolkit the ``velomux certs`` commands and
the probe are built on (a CA, issuing and reading node credentials and their files,
summarising and verifying a certificate); the rest of its modules are the transport's.
"""

from ._files import certificates_pem, read_certificates, write_public
from .certs import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    NODE_CERT_FILE,
    NODE_KEY_FILE,
    NODE_META_FILE,
    TRUST_ROOTS_FILE,
    AnyIPAddress,
    CertificateAuthority,
    NodeCredentials,
    ensure_dev_cluster,
    generate_private_key,
    issue_node_certificate,
    load_trust_roots,
    recorded_instance_id,
    spiffe_uris,
)
from .identity import (
    DEFAULT_TRUST_DOMAIN,
    instance_from_spiffe,
    parse_spiffe,
    spiffe_uri,
    validate_trust_domain,
)
from .rotation import CertificateSummary, summarize_certificate
from .verify import PeerRole, PeerVerifier

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "DEFAULT_TRUST_DOMAIN",
    "NODE_CERT_FILE",
    "NODE_KEY_FILE",
    "NODE_META_FILE",
    "TRUST_ROOTS_FILE",
    "AnyIPAddress",
    "CertificateAuthority",
    "CertificateSummary",
    "NodeCredentials",
    "PeerRole",
    "PeerVerifier",
    "certificates_pem",
    "ensure_dev_cluster",
    "generate_private_key",
    "instance_from_spiffe",
    "issue_node_certificate",
    "load_trust_roots",
    "parse_spiffe",
    "read_certificates",
    "recorded_instance_id",
    "spiffe_uri",
    "spiffe_uris",
    "summarize_certificate",
    "validate_trust_domain",
    "write_public",
]
