"""``velomux certs ...``: make a cluster CA, node certificates, or a throwaway dev cluster.

Every subcommand parser sets ``handler``, a ``Callable[[argparse.Namespace], int]``
returning the exit status, so the top-level ``velomux`` entry point dispatches all its
command groups the same way. Existing private keys are never replaced without
``--force``: overwriting a CA key by a slip of the shell history strands a cluster.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import ipaddress
import re
import secrets
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from cryptography import x509

from velomux_quic import CredentialsError, InstanceId
from velomux_quic.ids import new_instance_id
from velomux_quic.security import (
    CA_CERT_FILE,
    CA_KEY_FILE,
    DEFAULT_TRUST_DOMAIN,
    NODE_CERT_FILE,
    NODE_KEY_FILE,
    NODE_META_FILE,
    TRUST_ROOTS_FILE,
    AnyIPAddress,
    CertificateAuthority,
    NodeCredentials,
    certificates_pem,
    ensure_dev_cluster,
    issue_node_certificate,
    load_trust_roots,
    read_certificates,
    recorded_instance_id,
    summarize_certificate,
    validate_trust_domain,
    write_public,
)

__all__ = ["add_certs_commands"]

Handler = Callable[[argparse.Namespace], int]

_DNS_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*")


def _san(text: str) -> str | AnyIPAddress:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if len(text) > 253 or _DNS_NAME.fullmatch(text) is None:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an IP address nor a DNS name")
    return text.lower()


def _positive_days(text: str) -> int:
    try:
        days = int(text)
    except ValueError:
        days = 0
    if days <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of days, got {text!r}")
    return days


def _trust_domain(text: str) -> str:
    try:
        return validate_trust_domain(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _instance(text: str) -> InstanceId:
    try:
        return InstanceId.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a UUID") from exc


def _names(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated node names, such as a,b")
    return names


class _Refused(Exception):
    """A command declined to act; the message says why and how to proceed."""


def _reporting(command: str) -> Callable[[Handler], Handler]:
    """Turn expected failures into one line on stderr and exit status 2 (a usage or
    configuration error, as every velomux command exits on one), not a traceback."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        def run(args: argparse.Namespace) -> int:
            try:
                return handler(args)
            except (_Refused, CredentialsError, FileExistsError, ValueError) as exc:
                print(f"velomux certs {command}: error: {exc}", file=sys.stderr)
                return 2

        return run

    return wrap


def _refuse_existing_key(path: Path, force: bool) -> None:
    if path.exists() and not force:
        raise _Refused(f"{path} already exists; pass --force to replace it")


@_reporting("init-ca")
def _init_ca(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _refuse_existing_key(out / CA_KEY_FILE, args.force)
    ca = CertificateAuthority.create(
        name=args.name or f"velomux cluster CA {secrets.token_hex(4)}",
        trust_domain=args.trust_domain,
        valid_for=_days(args.days),
    )
    ca.save(out, overwrite=args.force)
    print(f"wrote CA certificate {out / CA_CERT_FILE}")
    print(f"wrote CA private key {out / CA_KEY_FILE} (mode 0600; keep it off the nodes)")
    print(f"trust domain {ca.trust_domain}, valid until {ca.not_valid_after:%Y-%m-%d}")
    return 0


@_reporting("issue")
def _issue(args: argparse.Namespace) -> int:
    out = Path(args.out)
    _refuse_existing_key(out / NODE_KEY_FILE, args.force)
    ca = CertificateAuthority.load(args.ca)
    kept = None if args.instance is not None else recorded_instance_id(out)
    instance: InstanceId = args.instance or kept or new_instance_id()
    sans: list[str | AnyIPAddress] = args.san or []
    creds = issue_node_certificate(
        ca,
        instance,
        name=args.name,
        dns_names=[san for san in sans if isinstance(san, str)],
        ip_addresses=[san for san in sans if not isinstance(san, str)],
        valid_for=_days(args.days),
    )
    extra = [root for root in load_trust_roots(args.also_trust) if root not in creds.trust_roots]
    creds = dataclasses.replace(creds, trust_roots=[*creds.trust_roots, *extra])
    creds.save(out, overwrite=args.force)
    for label, filename in (
        ("node certificate", NODE_CERT_FILE),
        ("node private key", NODE_KEY_FILE),
        ("trust roots", TRUST_ROOTS_FILE),
        ("node metadata", NODE_META_FILE),
    ):
        print(f"wrote {label} {out / filename}")
    origin = " (kept from the existing node.json)" if kept is not None else ""
    print(f"instance id {creds.instance_id}{origin}")
    print(
        f"identity {creds.spiffe_id}, valid until {creds.certificate.not_valid_after_utc:%Y-%m-%d}"
    )
    return 0


def _same_identity_sans(creds: NodeCredentials) -> tuple[list[str], list[AnyIPAddress]]:
    """The DNS names and IP addresses of a node's current certificate, to issue them again."""
    try:
        san = creds.certificate.extensions.get_extension_for_class(
            x509.SubjectAlternativeName
        ).value
    except x509.ExtensionNotFound:
        return [], []
    ips = [
        ip
        for ip in san.get_values_for_type(x509.IPAddress)
        if isinstance(ip, ipaddress.IPv4Address | ipaddress.IPv6Address)
    ]
    return san.get_values_for_type(x509.DNSName), ips


@_reporting("renew")
def _renew(args: argparse.Namespace) -> int:
    node_dir = Path(args.node_dir)
    current = NodeCredentials.load(node_dir)
    ca = CertificateAuthority.load(args.ca)
    if ca.trust_domain != current.trust_domain:
        raise _Refused(
            f"the CA in {args.ca} signs for trust domain {ca.trust_domain!r}, but the node in "
            f"{node_dir} belongs to {current.trust_domain!r}; use that cluster's CA"
        )
    dns_names, ip_addresses = _same_identity_sans(current)
    renewed = issue_node_certificate(
        ca,
        current.instance_id,
        name=current.name,
        dns_names=dns_names,
        ip_addresses=ip_addresses,
        valid_for=_days(args.days),
        private_key=current.private_key if args.keep_key else None,
    )
    roots = list(current.trust_roots)
    if ca.certificate not in roots:
        # A node must trust its own issuer, or a reload refuses the renewed certificate.
        roots.append(ca.certificate)
        print(f"added the signing CA to the trust roots in {node_dir / TRUST_ROOTS_FILE}")
    renewed = dataclasses.replace(renewed, trust_roots=roots)
    renewed.save(node_dir, overwrite=True)
    print(f"renewed {node_dir / NODE_CERT_FILE} for {renewed.spiffe_id}")
    print(f"key {'kept' if args.keep_key else 'replaced'}: {node_dir / NODE_KEY_FILE}")
    print(
        f"serial {renewed.certificate.serial_number:x}, valid until "
        f"{renewed.certificate.not_valid_after_utc:%Y-%m-%d %H:%M:%SZ}"
    )
    print("a running node takes it on SIGHUP (velomux node) or node.reload_credentials()")
    return 0


@_reporting("trust")
def _trust(args: argparse.Namespace) -> int:
    node_dir = Path(args.node_dir)
    path = node_dir / TRUST_ROOTS_FILE
    roots = read_certificates(path)
    leaf = read_certificates(node_dir / NODE_CERT_FILE)[0]
    for certificate in load_trust_roots(args.add):
        if certificate not in roots:
            roots.append(certificate)
    removed = load_trust_roots(args.remove)
    roots = [root for root in roots if root not in removed]
    if not roots:
        raise _Refused(f"that would leave {path} with no trust roots; keep at least one CA")
    if not args.force and not any(root.subject == leaf.issuer for root in roots):
        raise _Refused(
            f"no remaining CA is named like the issuer of {node_dir / NODE_CERT_FILE} "
            f"('{leaf.issuer.rfc4514_string()}'): renew the node from a CA you keep first, "
            "or pass --force"
        )
    write_public(path, certificates_pem(roots))
    print(f"wrote {len(roots)} trust root(s) to {path}:")
    for root in roots:
        summary = summarize_certificate(root)
        print(f"  {summary.subject} serial {summary.serial} sha256 {summary.fingerprint}")
    print("a running node takes them on SIGHUP (velomux node) or node.reload_credentials()")
    return 0


@_reporting("dev")
def _dev(args: argparse.Namespace) -> int:
    out = Path(args.out)
    nodes = ensure_dev_cluster(out, args.names, force=args.force)
    print(f"CA {out / 'ca' / CA_CERT_FILE}")
    for name, directory in nodes.items():
        creds = NodeCredentials.load(directory)
        print(f"node {name} {directory} instance id {creds.instance_id}")
    return 0


def _days(days: int) -> timedelta:
    return timedelta(days=days)


def add_certs_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> argparse.ArgumentParser:
    """Add the ``certs`` command group (``init-ca``, ``issue``, ``renew``, ``trust``, ``dev``)."""
    certs = subparsers.add_parser(
        "certs",
        help="make a cluster CA and node certificates",
        description="Make the certificates nodes use to authenticate each other.",
    )
    commands = certs.add_subparsers(dest="certs_command", metavar="COMMAND", required=True)

    init_ca = commands.add_parser(
        "init-ca",
        help="create a cluster CA",
        description="Create a cluster CA: ca.pem (share it) and ca.key (guard it).",
    )
    init_ca.add_argument("--out", required=True, metavar="DIR", help="directory to write")
    init_ca.add_argument(
        "--trust-domain",
        type=_trust_domain,
        default=DEFAULT_TRUST_DOMAIN,
        metavar="TD",
        help="SPIFFE trust domain of the cluster",
    )
    init_ca.add_argument(
        "--name",
        help="the CA's common name (default: 'velomux cluster CA' and a short random id, so "
        "two clusters' CAs differ by name)",
    )
    init_ca.add_argument(
        "--days", type=_positive_days, default=3650, metavar="N", help="validity in days"
    )
    init_ca.add_argument("--force", action="store_true", help="replace an existing CA key")
    init_ca.set_defaults(handler=_init_ca)

    issue = commands.add_parser(
        "issue",
        help="issue a node certificate",
        description="Issue a certificate naming one node, usable to dial and to accept.",
    )
    issue.add_argument("--ca", required=True, metavar="DIR", help="CA directory (init-ca)")
    issue.add_argument("--name", required=True, help="the node's name (certificate CN)")
    issue.add_argument(
        "--instance",
        type=_instance,
        metavar="UUID",
        help="the node's InstanceId (default: the one in --out, else a new random one)",
    )
    issue.add_argument(
        "--san",
        type=_san,
        action="extend",
        nargs="+",
        metavar="DNS_OR_IP",
        help="DNS names and IP addresses (default: localhost 127.0.0.1 ::1)",
    )
    issue.add_argument(
        "--also-trust",
        action="append",
        default=[],
        metavar="PEM",
        help="extra CA certificates for the node's trust roots (CA rotation)",
    )
    issue.add_argument(
        "--days", type=_positive_days, default=365, metavar="N", help="validity in days"
    )
    issue.add_argument("--out", required=True, metavar="DIR", help="node directory to write")
    issue.add_argument("--force", action="store_true", help="replace an existing node key")
    issue.set_defaults(handler=_issue)

    renew = commands.add_parser(
        "renew",
        help="renew a node certificate, keeping its identity",
        description=(
            "Re-issue the certificate in --node-dir from --ca with a new validity: the same "
            "InstanceId, name, DNS and IP names and trust domain, and a new key unless "
            "--keep-key. The signing CA is added to the node's trust roots if missing. A "
            "running node takes it on SIGHUP (velomux node) or node.reload_credentials()."
        ),
    )
    renew.add_argument("--ca", required=True, metavar="DIR", help="CA directory (init-ca)")
    renew.add_argument("--node-dir", required=True, metavar="DIR", help="node directory")
    renew.add_argument(
        "--days", type=_positive_days, default=365, metavar="N", help="validity in days"
    )
    renew.add_argument("--keep-key", action="store_true", help="keep the node's private key")
    renew.set_defaults(handler=_renew)

    trust = commands.add_parser(
        "trust",
        help="add or remove CAs in a node's trust roots (CA roll)",
        description=(
            "Rewrite the trust roots (ca.pem) of --node-dir: --add appends the CA "
            "certificates of PEM files, --remove drops those equal to the ones in PEM files. "
            "Refuses to remove every CA named like the node certificate's issuer (--force "
            "overrides). A running node takes them on SIGHUP or node.reload_credentials()."
        ),
    )
    trust.add_argument("--node-dir", required=True, metavar="DIR", help="node directory")
    trust.add_argument("--add", action="append", default=[], metavar="PEM", help="CA to trust")
    trust.add_argument(
        "--remove", action="append", default=[], metavar="PEM", help="CA to stop trusting"
    )
    trust.add_argument("--force", action="store_true", help="allow dropping the node's own issuer")
    trust.set_defaults(handler=_trust)

    dev = commands.add_parser(
        "dev",
        help="create or refresh a local dev cluster",
        description="Create <out>/ca and one directory per node, reusing valid material.",
    )
    dev.add_argument(
        "--out",
        type=Path,
        default=Path("certs/dev"),
        metavar="DIR",
        help="dev cluster directory, the one velomux demo uses by default",
    )
    dev.add_argument(
        "--names",
        type=_names,
        default=["node-a", "node-b"],
        metavar="A,B",
        help="comma-separated node names (default: node-a,node-b)",
    )
    dev.add_argument("--force", action="store_true", help="remake every key and certificate")
    dev.set_defaults(handler=_dev)
    return certs
