"""Replacing a running node's credentials: each refusal, and ``certs renew`` / ``certs trust``.

The checks run on data alone (no socket); the integration tests show that a refused set
leaves the node dialing and accepting with its old credentials.
"""

from __future__ import annotations

import dataclasses
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography import x509

from velomux_quic.errors import ConfigurationError, CredentialsError
from velomux_quic.ids import new_instance_id
from velomux_quic.programs.cli import main
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.security.rotation import (
    check_replacement,
    load_replacement,
    summarize_certificate,
)
from velomux_quic.security.testing import (
    SERVER_ONLY,
    issue_expired,
    issue_not_yet_valid,
    issue_with_usages,
    with_mismatched_key,
)

KEPT = "the node keeps its current credentials"


@pytest.fixture
def current(ca: CertificateAuthority) -> NodeCredentials:
    return issue_node_certificate(ca, new_instance_id(), name="node")


def renewed(ca: CertificateAuthority, current: NodeCredentials) -> NodeCredentials:
    return issue_node_certificate(ca, current.instance_id, name=current.name)


def test_a_renewal_with_the_same_identity_is_accepted(
    ca: CertificateAuthority, current: NodeCredentials
) -> None:
    new = renewed(ca, current)
    check_replacement(current, new)
    assert new.certificate.serial_number != current.certificate.serial_number


def test_a_new_ca_is_accepted_when_the_new_roots_trust_it(
    ca: CertificateAuthority, other_ca: CertificateAuthority, current: NodeCredentials
) -> None:
    # other_ca has the default trust domain too: a CA roll within one cluster.
    new = issue_node_certificate(other_ca, current.instance_id, name=current.name)
    check_replacement(
        current, dataclasses.replace(new, trust_roots=[ca.certificate, new.trust_roots[0]])
    )


Refusal = Callable[[CertificateAuthority, CertificateAuthority, NodeCredentials], NodeCredentials]


def _mismatched_key(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    return with_mismatched_key(renewed(ca, c))


def _other_instance(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    return issue_node_certificate(ca, new_instance_id(), name=c.name)


def _other_trust_domain(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    foreign = CertificateAuthority.create(trust_domain="elsewhere.example")
    return issue_node_certificate(foreign, c.instance_id, name=c.name)


def _expired(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    return issue_expired(ca, c.instance_id, name=c.name)


def _not_yet_valid(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    return issue_not_yet_valid(ca, c.instance_id, name=c.name)


def _untrusted(
    ca: CertificateAuthority, other: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    # Issued by another CA, but the new trust roots still hold only the old one.
    new = issue_node_certificate(other, c.instance_id, name=c.name)
    return dataclasses.replace(new, trust_roots=[ca.certificate])


def _server_only(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    new = issue_with_usages(ca, c.instance_id, name=c.name, extended_key_usages=SERVER_ONLY)
    return new


def _no_roots(
    ca: CertificateAuthority, _o: CertificateAuthority, c: NodeCredentials
) -> NodeCredentials:
    return dataclasses.replace(renewed(ca, c), trust_roots=[])


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (_mismatched_key, "does not match"),
        (_other_instance, "restart it for that"),
        (_other_trust_domain, "trust domain 'elsewhere.example'"),
        (_expired, "expired"),
        (_not_yet_valid, "not_yet_valid"),
        (_untrusted, "untrusted_chain"),
        (_server_only, "bad_key_usage"),
        (_no_roots, "no trust roots"),
    ],
    ids=lambda value: getattr(value, "__name__", "").strip("_") or None,
)
def test_each_bad_set_is_refused_saying_why_and_that_the_old_one_stays(
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    current: NodeCredentials,
    make: Refusal,
    words: str,
) -> None:
    with pytest.raises(CredentialsError) as refused:
        check_replacement(current, make(ca, other_ca, current))
    assert isinstance(refused.value, ConfigurationError)
    assert words in str(refused.value)
    assert KEPT in str(refused.value)


def test_a_missing_or_garbled_directory_is_a_credentials_error(
    tmp_path: Path, current: NodeCredentials
) -> None:
    with pytest.raises(CredentialsError, match=KEPT) as missing:
        load_replacement(tmp_path / "nowhere")
    assert "missing" in str(missing.value)
    current.save(tmp_path / "node")
    (tmp_path / "node" / "node.pem").write_bytes(b"-----BEGIN CERTIFICATE-----\nnot one\n")
    with pytest.raises(CredentialsError, match="no readable PEM certificate"):
        load_replacement(tmp_path / "node")


def test_an_unreadable_file_is_a_credentials_error_not_an_os_error(
    tmp_path: Path, current: NodeCredentials
) -> None:
    current.save(tmp_path / "node")
    key = tmp_path / "node" / "node.key"
    key.unlink()
    key.mkdir()  # unreadable as a file, whoever runs the test (root reads a mode-0 file)
    with pytest.raises(CredentialsError, match="could not be read"):
        load_replacement(tmp_path / "node")


def test_the_summary_names_the_certificate(current: NodeCredentials) -> None:
    summary = summarize_certificate(current.certificate)
    assert summary.serial == f"{current.certificate.serial_number:x}"
    assert len(summary.fingerprint) == 64
    assert summary.not_after == current.certificate.not_valid_after_utc
    assert summary.subject == "CN=node"


# -- velomux certs renew / trust -----------------------------------------------------------


def _cli(*argv: str) -> int:
    return main(["certs", *argv])


@pytest.fixture
def cluster(tmp_path: Path) -> tuple[Path, Path]:
    ca_dir, node_dir = tmp_path / "ca", tmp_path / "node-a"
    assert _cli("init-ca", "--out", str(ca_dir)) == 0
    argv = ["--ca", str(ca_dir), "--name", "node-a", "--out", str(node_dir)]
    assert _cli("issue", *argv, "--san", "node-a.example", "10.0.0.11", "--days", "30") == 0
    return ca_dir, node_dir


def _names(creds: NodeCredentials) -> list[x509.GeneralName]:
    return list(
        creds.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    )


def test_renew_keeps_the_identity_and_replaces_the_key(
    cluster: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    ca_dir, node_dir = cluster
    before = NodeCredentials.load(node_dir)
    assert _cli("renew", "--ca", str(ca_dir), "--node-dir", str(node_dir), "--days", "90") == 0
    after = NodeCredentials.load(node_dir)
    check_replacement(before, after)  # what a running node would accept
    assert (after.instance_id, after.name, after.trust_domain) == (
        before.instance_id,
        before.name,
        before.trust_domain,
    )
    assert _names(after) == _names(before)
    assert after.certificate.serial_number != before.certificate.serial_number
    assert after.private_key.private_numbers() != before.private_key.private_numbers()
    lifetime = after.certificate.not_valid_after_utc - after.certificate.not_valid_before_utc
    assert 89 < lifetime.days <= 90
    assert stat.S_IMODE((node_dir / "node.key").stat().st_mode) == 0o600
    assert f"{after.certificate.serial_number:x}" in capsys.readouterr().out


def test_renew_keep_key_keeps_the_key(cluster: tuple[Path, Path]) -> None:
    ca_dir, node_dir = cluster
    before = NodeCredentials.load(node_dir)
    assert _cli("renew", "--ca", str(ca_dir), "--node-dir", str(node_dir), "--keep-key") == 0
    after = NodeCredentials.load(node_dir)
    assert after.private_key.private_numbers() == before.private_key.private_numbers()
    assert after.certificate.serial_number != before.certificate.serial_number


def test_renew_refuses_a_ca_of_another_trust_domain(
    cluster: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _ca_dir, node_dir = cluster
    foreign = tmp_path / "foreign"
    assert _cli("init-ca", "--out", str(foreign), "--trust-domain", "elsewhere.example") == 0
    before = (node_dir / "node.pem").read_bytes()
    assert _cli("renew", "--ca", str(foreign), "--node-dir", str(node_dir)) == 2
    assert "elsewhere.example" in capsys.readouterr().err
    assert (node_dir / "node.pem").read_bytes() == before


def test_renew_from_a_new_ca_adds_it_to_the_trust_roots(
    cluster: tuple[Path, Path], tmp_path: Path
) -> None:
    ca_dir, node_dir = cluster
    new_ca = tmp_path / "ca-new"
    assert _cli("init-ca", "--out", str(new_ca)) == 0
    before = NodeCredentials.load(node_dir)
    assert _cli("renew", "--ca", str(new_ca), "--node-dir", str(node_dir)) == 0
    after = NodeCredentials.load(node_dir)
    old_root = CertificateAuthority.load(ca_dir).certificate
    new_root = CertificateAuthority.load(new_ca).certificate
    assert after.trust_roots == [old_root, new_root]
    check_replacement(before, after)


def test_trust_adds_and_removes_cas_and_guards_the_issuer(
    cluster: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ca_dir, node_dir = cluster
    other = tmp_path / "other"
    assert _cli("init-ca", "--out", str(other), "--name", "other CA") == 0
    old_pem, new_pem = str(ca_dir / "ca.pem"), str(other / "ca.pem")
    assert _cli("trust", "--node-dir", str(node_dir), "--add", new_pem) == 0
    assert len(NodeCredentials.load(node_dir).trust_roots) == 2
    assert _cli("trust", "--node-dir", str(node_dir), "--add", new_pem) == 0  # idempotent
    assert len(NodeCredentials.load(node_dir).trust_roots) == 2
    capsys.readouterr()
    # Dropping the CA that issued the node's own certificate would strand it.
    assert _cli("trust", "--node-dir", str(node_dir), "--remove", old_pem) == 2
    assert "issuer" in capsys.readouterr().err
    assert len(NodeCredentials.load(node_dir).trust_roots) == 2
    assert _cli("trust", "--node-dir", str(node_dir), "--remove", new_pem) == 0
    roots = NodeCredentials.load(node_dir).trust_roots
    assert roots == [CertificateAuthority.load(ca_dir).certificate]
    assert _cli("trust", "--node-dir", str(node_dir), "--remove", old_pem, "--force") == 2
    assert "no trust roots" in capsys.readouterr().err
