"""Mutual TLS for node-to-node connections: the cluster CA, node certificates, identity.

Identity comes from the certificate, never from anything a peer says later: a node's
certificate carries its InstanceId as ``spiffe://<trust-domain>/instance/<uuid>``, and
:class:`PeerVerifier` turns a verified certificate into that InstanceId on both sides of
every connection. Nothing here imports aioquic; the hook that runs the verifier inside
aioquic's handshake lives in ``security.tls``.
"""

from velomux_quic.security.certs import (
    CertificateAuthority,
    CredentialsError,
    NodeCredentials,
    ensure_dev_cluster,
    generate_private_key,
    issue_node_certificate,
    load_trust_roots,
)
from velomux_quic.security.identity import (
    DEFAULT_TRUST_DOMAIN,
    instance_from_spiffe,
    parse_spiffe,
    spiffe_uri,
    validate_trust_domain,
)
from velomux_quic.security.verify import (
    PeerRole,
    PeerVerificationError,
    PeerVerifier,
    RefusalReason,
)

__all__ = [
    "DEFAULT_TRUST_DOMAIN",
    "CertificateAuthority",
    "CredentialsError",
    "NodeCredentials",
    "PeerRole",
    "PeerVerificationError",
    "PeerVerifier",
    "RefusalReason",
    "ensure_dev_cluster",
    "generate_private_key",
    "instance_from_spiffe",
    "issue_node_certificate",
    "load_trust_roots",
    "parse_spiffe",
    "spiffe_uri",
    "validate_trust_domain",
]
