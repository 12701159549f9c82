"""The cluster CA and node certificates, made with ``cryptography`` alone.

Keys are ECDSA P-256: aioquic signs with ECDSA_SECP256R1_SHA256 for such a key, a scheme
every TLS 1.3 peer must accept (RFC 8446, section 9.1), and the keys keep handshakes
small. Every certificate is shaped to pass ``cryptography.x509.verification``'s web PKI
profile, which is what :class:`~velomux_quic.security.verify.PeerVerifier` applies to
both sides of a connection.

On-disk layout (see ``docs/security.md``)::

    <ca-dir>/ca.pem     the CA certificate; its URI SAN ``spiffe://<td>`` records the
                        trust domain, so the certificate alone says which cluster it is for
    <ca-dir>/ca.key     its private key, mode 0600
    <node-dir>/node.pem the node certificate, followed by any intermediates
    <node-dir>/node.key its private key, mode 0600
    <node-dir>/ca.pem   the trust roots (one or more CA certificates)
    <node-dir>/node.json {"name", "instance_id", "trust_domain"}
"""

from __future__ import annotations

import ipaddress
import json
import logging
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.types import PublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..ids import InstanceId, new_instance_id
from ._files import (
    CredentialsError,
    certificates_pem,
    directory_lock,
    make_private_dir,
    private_key_pem,
    read_bytes,
    read_certificates,
    read_ec_private_key,
    refuse_overwrite,
    write_private,
    write_public,
)
from .identity import (
    DEFAULT_TRUST_DOMAIN,
    SPIFFE_SCHEME,
    spiffe_uri,
    trust_domain_uri,
    validate_trust_domain,
)

__all__ = [
    "CA_CERT_FILE",
    "CA_KEY_FILE",
    "NODE_CERT_FILE",
    "NODE_EXTENDED_KEY_USAGES",
    "NODE_KEY_FILE",
    "NODE_META_FILE",
    "TRUST_ROOTS_FILE",
    "AnyIPAddress",
    "CertificateAuthority",
    "CredentialsError",
    "NodeCredentials",
    "ca_trust_domain",
    "ensure_dev_cluster",
    "generate_private_key",
    "issue_node_certificate",
    "load_trust_roots",
    "recorded_instance_id",
    "spiffe_uris",
]

_log = logging.getLogger(__name__)

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
NODE_CERT_FILE = "node.pem"
NODE_KEY_FILE = "node.key"
TRUST_ROOTS_FILE = "ca.pem"
NODE_META_FILE = "node.json"

AnyIPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Backdate every certificate a little, so a peer whose clock runs a few minutes behind
# ours does not refuse a certificate we issued a moment ago as "not yet valid".
_CLOCK_SKEW = timedelta(minutes=5)
_DEFAULT_DNS = ("localhost",)
_DEFAULT_IPS = (ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1"))
_RENEW_BEFORE = timedelta(days=1)


def generate_private_key() -> ec.EllipticCurvePrivateKey:
    """A fresh ECDSA P-256 key, the only kind this package issues."""
    return ec.generate_private_key(ec.SECP256R1())


def _now() -> datetime:
    return datetime.now(UTC)


def _key_usage(*, digital_signature: bool = False, cert_sign: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _spki(key: PublicKeyTypes) -> bytes:
    return key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def spiffe_uris(certificate: x509.Certificate) -> list[str]:
    """Every URI SAN of ``certificate`` whose scheme is ``spiffe`` (any case)."""
    try:
        san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    uris = san.value.get_values_for_type(x509.UniformResourceIdentifier)
    return [uri for uri in uris if uri.partition(":")[0].lower() == SPIFFE_SCHEME]


@dataclass(frozen=True)
class CertificateAuthority:
    """The cluster CA: one per cluster, its key kept off the nodes when possible."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    trust_domain: str = DEFAULT_TRUST_DOMAIN

    @classmethod
    def create(
        cls,
        name: str = "velomux cluster CA",
        trust_domain: str = DEFAULT_TRUST_DOMAIN,
        valid_for: timedelta = timedelta(days=3650),
    ) -> CertificateAuthority:
        """A new self-signed CA that may sign node certificates and nothing else.

        ``path_length=0`` forbids intermediate CAs below it, so stealing a node key never
        lets anyone mint further CAs. No URI name constraint is set: cryptography's
        verifier refuses every chain under a CA with URI constraints ("unsupported name
        constraint"), so the trust domain is enforced by the verifier instead.
        """
        validate_trust_domain(trust_domain)
        if not name:
            raise ValueError("a CA needs a non-empty name")
        if valid_for <= timedelta(0):
            raise ValueError("valid_for must be positive")
        key = generate_private_key()
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + valid_for)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(_key_usage(cert_sign=True), critical=True)
            .add_extension(ski, critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski),
                critical=False,
            )
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.UniformResourceIdentifier(trust_domain_uri(trust_domain))]
                ),
                critical=False,
            )
            .sign(key, hashes.SHA256())
        )
        return cls(certificate=certificate, private_key=key, trust_domain=trust_domain)

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``ca.pem`` and ``ca.key`` (0600) into ``directory`` (made 0700 if missing).

        Refuses (``FileExistsError``) to replace an existing ``ca.key`` unless
        ``overwrite``: losing a CA key strands every certificate it signed.
        """
        if ca_trust_domain(self.certificate) != self.trust_domain:
            raise ValueError(
                f"trust_domain {self.trust_domain!r} disagrees with the CA certificate's SAN"
            )
        root = Path(directory)
        make_private_dir(root)
        refuse_overwrite(root / CA_KEY_FILE, overwrite)
        write_private(root / CA_KEY_FILE, private_key_pem(self.private_key))
        write_public(root / CA_CERT_FILE, certificates_pem([self.certificate]))
        return root

    @classmethod
    def load(cls, directory: str | Path) -> CertificateAuthority:
        """Read a CA written by :meth:`save`; the trust domain comes from its URI SAN."""
        root = Path(directory)
        certs = read_certificates(root / CA_CERT_FILE)
        if len(certs) != 1:
            raise CredentialsError(f"{root / CA_CERT_FILE}: expected one certificate")
        certificate = certs[0]
        key = read_ec_private_key(root / CA_KEY_FILE)
        if _spki(key.public_key()) != _spki(certificate.public_key()):
            raise CredentialsError(
                f"{root / CA_KEY_FILE} does not belong to the certificate in "
                f"{root / CA_CERT_FILE}; restore the matching pair"
            )
        try:
            trust_domain = ca_trust_domain(certificate)
        except ValueError as exc:
            raise CredentialsError(f"{root / CA_CERT_FILE}: {exc}") from exc
        return cls(certificate=certificate, private_key=key, trust_domain=trust_domain)

    @property
    def not_valid_after(self) -> datetime:
        return self.certificate.not_valid_after_utc


def ca_trust_domain(certificate: x509.Certificate) -> str:
    """The trust domain a CA certificate records in its ``spiffe://<td>`` URI SAN.

    Kept in the certificate rather than a side file so that the trust roots a node
    carries are self-describing. Raises ``ValueError`` if the SAN is missing or malformed.
    """
    uris = spiffe_uris(certificate)
    prefix = f"{SPIFFE_SCHEME}://"
    if len(uris) != 1 or not uris[0].startswith(prefix):
        raise ValueError(
            "the CA certificate must carry exactly one URI SAN 'spiffe://<trust-domain>' "
            f"naming its trust domain, found {uris}"
        )
    return validate_trust_domain(uris[0][len(prefix) :])


@dataclass(frozen=True)
class NodeCredentials:
    """Everything a node needs for mutual TLS: its certificate and key, and whom to trust.

    ``chain`` holds intermediates sent after the leaf (normally empty: the CA signs nodes
    directly). ``trust_roots`` may hold several CAs, which is how a CA is rotated.
    """

    name: str
    instance_id: InstanceId
    trust_domain: str
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey
    chain: list[x509.Certificate] = field(default_factory=list)
    trust_roots: list[x509.Certificate] = field(default_factory=list)

    @property
    def spiffe_id(self) -> str:
        """The node's identity as its certificate states it: ``spiffe://<domain>/instance/<uuid>``."""
        return spiffe_uri(self.instance_id, self.trust_domain)

    def save(self, directory: str | Path, *, overwrite: bool = False) -> Path:
        """Write ``node.pem``, ``node.key`` (0600), ``ca.pem`` and ``node.json``.

        Refuses (``FileExistsError``) to replace an existing ``node.key`` unless
        ``overwrite``, so re-running an issue command cannot silently change a node's key.
        """
        if not self.trust_roots:
            raise ValueError("credentials without trust roots could never verify a peer")
        root = Path(directory)
        make_private_dir(root)
        refuse_overwrite(root / NODE_KEY_FILE, overwrite)
        meta = {
            "name": self.name,
            "instance_id": str(self.instance_id),
            "trust_domain": self.trust_domain,
        }
        write_private(root / NODE_KEY_FILE, private_key_pem(self.private_key))
        write_public(root / NODE_CERT_FILE, certificates_pem([self.certificate, *self.chain]))
        write_public(root / TRUST_ROOTS_FILE, certificates_pem(self.trust_roots))
        write_public(root / NODE_META_FILE, (json.dumps(meta, indent=2) + "\n").encode())
        return root

    @classmethod
    def load(cls, directory: str | Path) -> NodeCredentials:
        """Read credentials written by :meth:`save`, refusing inconsistent sets.

        Checked here rather than at handshake time: a key that does not match its
        certificate, or a certificate naming another node than ``node.json`` says, would
        otherwise surface as a peer's vague handshake failure on some other host.
        """
        root = Path(directory)
        meta = _read_meta(root / NODE_META_FILE)
        certs = read_certificates(root / NODE_CERT_FILE)
        roots = read_certificates(root / TRUST_ROOTS_FILE)
        key = read_ec_private_key(root / NODE_KEY_FILE)
        leaf = certs[0]
        if _spki(key.public_key()) != _spki(leaf.public_key()):
            raise CredentialsError(
                f"{root / NODE_KEY_FILE} does not match the certificate in "
                f"{root / NODE_CERT_FILE}: the key was replaced or the files come from "
                "different issues; re-issue the node certificate"
            )
        try:
            instance = InstanceId.parse(meta["instance_id"])
            trust_domain = validate_trust_domain(meta["trust_domain"])
        except ValueError as exc:
            raise CredentialsError(f"{root / NODE_META_FILE}: {exc}") from exc
        expected = spiffe_uri(instance, trust_domain)
        found = spiffe_uris(leaf)
        if found != [expected]:
            raise CredentialsError(
                f"{root / NODE_CERT_FILE} names {found or 'no SPIFFE identity'}, but "
                f"{root / NODE_META_FILE} says {expected!r}"
            )
        return cls(
            name=meta["name"],
            instance_id=instance,
            trust_domain=trust_domain,
            certificate=leaf,
            private_key=key,
            chain=certs[1:],
            trust_roots=roots,
        )


def _read_meta(path: Path) -> dict[str, str]:
    try:
        meta = json.loads(read_bytes(path))
    except json.JSONDecodeError as exc:
        raise CredentialsError(f"{path}: not valid JSON ({exc})") from exc
    keys = ("name", "instance_id", "trust_domain")
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), str) for k in keys):
        raise CredentialsError(f"{path}: expected string fields {', '.join(keys)}")
    return {k: meta[k] for k in keys}


def _subject_alt_names(
    instance: InstanceId,
    trust_domain: str,
    dns_names: Iterable[str],
    ip_addresses: Iterable[str | AnyIPAddress],
) -> list[x509.GeneralName]:
    dns = list(dns_names)
    ips = [ipaddress.ip_address(ip) for ip in ip_addresses]
    if not dns and not ips:
        dns, ips = list(_DEFAULT_DNS), list(_DEFAULT_IPS)
    names: list[x509.GeneralName] = [
        x509.UniformResourceIdentifier(spiffe_uri(instance, trust_domain))
    ]
    names += [x509.DNSName(name) for name in dns]
    names += [x509.IPAddress(ip) for ip in ips]
    return names


def _sign_leaf(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer_name: x509.Name,
    issuer_public_key: ec.EllipticCurvePublicKey,
    signing_key: ec.EllipticCurvePrivateKey,
    names: Sequence[x509.GeneralName],
    not_before: datetime,
    not_after: datetime,
    extended_key_usages: Sequence[x509.ObjectIdentifier] | None,
    digital_signature: bool = True,
) -> x509.Certificate:
    """Build and sign a leaf; the one place leaf extensions are chosen.

    Parametrised beyond what :func:`issue_node_certificate` needs so the refusal tests
    (``security.testing``) build their bad certificates through the same code and differ
    from a good one only in the property under test.
    """
    if not_after <= not_before:
        raise ValueError("not_after must be later than not_before")
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=digital_signature), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_public_key),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
    )
    if extended_key_usages is not None:
        builder = builder.add_extension(
            x509.ExtendedKeyUsage(list(extended_key_usages)), critical=False
        )
    return builder.sign(signing_key, hashes.SHA256())


NODE_EXTENDED_KEY_USAGES = (ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH)
"""Both, because every node dials (client) and accepts (server) connections."""


def issue_node_certificate(
    ca: CertificateAuthority,
    instance: InstanceId,
    *,
    name: str,
    dns_names: Iterable[str] = (),
    ip_addresses: Iterable[str | AnyIPAddress] = (),
    not_before: datetime | None = None,
    not_after: datetime | None = None,
    valid_for: timedelta = timedelta(days=365),
    private_key: ec.EllipticCurvePrivateKey | None = None,
) -> NodeCredentials:
    """Sign a certificate naming ``instance``, usable as both TLS client and server.

    With no DNS or IP names given, the certificate covers ``localhost``, 127.0.0.1 and
    ::1, enough for nodes on one host. The default expiry is capped at the CA's, since a
    certificate outliving its issuer would fail verification anyway, only later and more
    confusingly. Explicit dates are honoured as given (the tests need expired ones).
    """
    if not name:
        raise ValueError("a node certificate needs a non-empty name")
    key = private_key if private_key is not None else generate_private_key()
    now = _now()
    start = not_before if not_before is not None else now - _CLOCK_SKEW
    end = not_after if not_after is not None else min(now + valid_for, ca.not_valid_after)
    certificate = _sign_leaf(
        subject=x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]),
        public_key=key.public_key(),
        issuer_name=ca.certificate.subject,
        issuer_public_key=ca.private_key.public_key(),
        signing_key=ca.private_key,
        names=_subject_alt_names(instance, ca.trust_domain, dns_names, ip_addresses),
        not_before=start,
        not_after=end,
        extended_key_usages=NODE_EXTENDED_KEY_USAGES,
    )
    return NodeCredentials(
        name=name,
        instance_id=instance,
        trust_domain=ca.trust_domain,
        certificate=certificate,
        private_key=key,
        chain=[],
        trust_roots=[ca.certificate],
    )


def _fresh(certificate: x509.Certificate, now: datetime) -> bool:
    return certificate.not_valid_after_utc - now > _RENEW_BEFORE


def _usable_ca(directory: Path, trust_domain: str, now: datetime) -> CertificateAuthority | None:
    try:
        ca = CertificateAuthority.load(directory)
    except (CredentialsError, OSError):
        return None
    if ca.trust_domain != trust_domain or not _fresh(ca.certificate, now):
        return None
    return ca


def _usable_node(
    directory: Path, name: str, ca: CertificateAuthority, now: datetime
) -> NodeCredentials | None:
    try:
        creds = NodeCredentials.load(directory)
        creds.certificate.verify_directly_issued_by(ca.certificate)
    except (OSError, ValueError, TypeError, InvalidSignature):
        return None
    if (
        creds.name != name
        or creds.trust_domain != ca.trust_domain
        or ca.certificate not in creds.trust_roots
        or not _fresh(creds.certificate, now)
    ):
        return None
    return creds


def recorded_instance_id(directory: str | Path) -> InstanceId | None:
    """The InstanceId a node directory's ``node.json`` records, or None; used on re-issue.

    Peers and configs refer to a node by InstanceId; renewing a certificate
    must not turn the node into a stranger.
    """
    try:
        return InstanceId.parse(_read_meta(Path(directory) / NODE_META_FILE)["instance_id"])
    except (CredentialsError, OSError, ValueError):
        return None


def _check_node_names(names: Sequence[str]) -> None:
    for name in names:
        if (
            not name
            or name in (".", "..", "ca")
            or not all(c.isalnum() or c in "._-" for c in name)
            or not name.isascii()
        ):
            raise ValueError(
                f"invalid node name {name!r}: use letters, digits, '.', '-' and '_' "
                "(and not 'ca', which holds the CA)"
            )
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate node names in {list(names)}")


def ensure_dev_cluster(
    directory: str | Path,
    names: Sequence[str] = ("node-a", "node-b"),
    *,
    trust_domain: str = DEFAULT_TRUST_DOMAIN,
    force: bool = False,
) -> dict[str, Path]:
    """Make sure ``<directory>/ca`` and ``<directory>/<name>`` hold usable dev credentials.

    Idempotent, so ``make demo`` and test fixtures can call it every time: material that
    loads, is consistent and stays valid for more than a day is kept; anything missing,
    broken, expiring, or signed by a CA other than the current one is (re)made. ``force``
    remakes everything. A re-issued node keeps the InstanceId its directory recorded, so
    peers that know it by id still do. Returns name -> node directory, in ``names`` order.
    """
    names = list(names)
    _check_node_names(names)
    validate_trust_domain(trust_domain)
    root = Path(directory)
    make_private_dir(root)
    with directory_lock(root):
        now = _now()
        ca_dir = root / "ca"
        ca = None if force else _usable_ca(ca_dir, trust_domain, now)
        if ca is None:
            # A short unique id in the name: refusals and `openssl x509` tell this dev
            # cluster's CA from another's by name, not only by serial.
            ca = CertificateAuthority.create(
                f"velomux dev CA {secrets.token_hex(4)}", trust_domain=trust_domain
            )
            ca.save(ca_dir, overwrite=True)
            _log.info("created dev cluster CA in %s", ca_dir)
        result: dict[str, Path] = {}
        for name in names:
            node_dir = root / name
            if force or _usable_node(node_dir, name, ca, now) is None:
                instance = recorded_instance_id(node_dir) or new_instance_id()
                issue_node_certificate(ca, instance, name=name).save(node_dir, overwrite=True)
                _log.info("issued dev certificate for %s (%s) in %s", name, instance, node_dir)
            result[name] = node_dir
        return result


def load_trust_roots(paths: Iterable[str | Path]) -> list[x509.Certificate]:
    """Concatenate the CA certificates of several PEM files (old and new CA in rotation)."""
    roots: list[x509.Certificate] = []
    for path in paths:
        roots += read_certificates(Path(path))
    return roots
