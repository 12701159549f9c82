"""Cluster CA and node certificates: their profile, their files, and the dev cluster."""

from __future__ import annotations

import ipaddress
import json
import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store

from velomux_quic.ids import new_instance_id
from velomux_quic.security import testing
from velomux_quic.security.certs import (
    CertificateAuthority,
    CredentialsError,
    NodeCredentials,
    ensure_dev_cluster,
    issue_node_certificate,
    load_trust_roots,
)
from velomux_quic.security.identity import spiffe_uri


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ext(certificate: x509.Certificate, kind: type[Any]) -> x509.Extension[Any]:
    return certificate.extensions.get_extension_for_class(kind)


def _spki(certificate: x509.Certificate) -> bytes:
    return certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# --- certificate profile ------------------------------------------------------------------


def test_ca_certificate_may_sign_nodes_and_nothing_below_them() -> None:
    ca = CertificateAuthority.create("profile CA", trust_domain="prod.example")
    cert = ca.certificate
    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = _ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.key_cert_sign and ku.value.crl_sign
    assert not ku.value.digital_signature
    assert _ext(cert, x509.SubjectKeyIdentifier).value.digest
    uris = _ext(cert, x509.SubjectAlternativeName).value.get_values_for_type(
        x509.UniformResourceIdentifier
    )
    assert uris == ["spiffe://prod.example"]
    assert cert.subject == cert.issuer


def test_node_certificate_profile(ca: CertificateAuthority) -> None:
    instance = new_instance_id()
    creds = issue_node_certificate(ca, instance, name="node-a")
    cert = creds.certificate
    san = _ext(cert, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        spiffe_uri(instance, ca.trust_domain)
    ]
    assert san.get_values_for_type(x509.DNSName) == ["localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
    ]
    bc = _ext(cert, x509.BasicConstraints)
    assert bc.critical and not bc.value.ca
    ku = _ext(cert, x509.KeyUsage)
    assert ku.critical and ku.value.digital_signature and not ku.value.key_cert_sign
    assert list(_ext(cert, x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    ]
    aki = _ext(cert, x509.AuthorityKeyIdentifier).value
    assert aki.key_identifier == _ext(ca.certificate, x509.SubjectKeyIdentifier).value.digest
    assert _ext(cert, x509.SubjectKeyIdentifier).value.digest
    assert cert.issuer == ca.certificate.subject
    assert creds.trust_roots == [ca.certificate] and creds.chain == []
    assert creds.spiffe_id == spiffe_uri(instance, ca.trust_domain)


def test_given_names_replace_the_localhost_defaults(ca: CertificateAuthority) -> None:
    creds = issue_node_certificate(
        ca, new_instance_id(), name="n", dns_names=["n1.example"], ip_addresses=["10.1.2.3"]
    )
    san = _ext(creds.certificate, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["n1.example"]
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.1.2.3")]


def test_webpki_profile_accepts_a_node_as_client_and_as_server(ca: CertificateAuthority) -> None:
    creds = issue_node_certificate(ca, new_instance_id(), name="n")
    builder = PolicyBuilder().store(Store([ca.certificate]))
    client = builder.build_client_verifier().verify(creds.certificate, [])
    assert client.subjects is not None
    assert x509.UniformResourceIdentifier(creds.spiffe_id) in client.subjects
    for subject in (
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ):
        chain = builder.build_server_verifier(subject).verify(creds.certificate, [])
        assert chain[-1] == ca.certificate


def test_default_expiry_never_outlives_the_ca() -> None:
    short = CertificateAuthority.create(valid_for=timedelta(days=10))
    creds = issue_node_certificate(short, new_instance_id(), name="n")
    assert creds.certificate.not_valid_after_utc == short.certificate.not_valid_after_utc


def test_explicit_dates_are_honoured_and_checked(ca: CertificateAuthority) -> None:
    start = datetime(2020, 1, 1, tzinfo=UTC)
    end = datetime(2020, 2, 1, tzinfo=UTC)
    creds = issue_node_certificate(ca, new_instance_id(), name="n", not_before=start, not_after=end)
    assert creds.certificate.not_valid_before_utc == start
    assert creds.certificate.not_valid_after_utc == end
    with pytest.raises(ValueError, match="later"):
        issue_node_certificate(ca, new_instance_id(), name="n", not_before=end, not_after=start)


def test_a_given_private_key_is_used(ca: CertificateAuthority) -> None:
    first = issue_node_certificate(ca, new_instance_id(), name="n")
    again = issue_node_certificate(ca, first.instance_id, name="n", private_key=first.private_key)
    assert _spki(again.certificate) == _spki(first.certificate)


@pytest.mark.parametrize("bad", ["", "Upper.Case", "a/b", "a:1", "a..b", ".lead"])
def test_ca_refuses_an_invalid_trust_domain(bad: str) -> None:
    with pytest.raises(ValueError, match="trust domain"):
        CertificateAuthority.create(trust_domain=bad)


# --- files --------------------------------------------------------------------------------


def test_key_files_are_created_0600_and_directories_0700(
    ca: CertificateAuthority, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[tuple[str, int, int]] = []
    real_open = os.open

    def spy(path: Any, flags: int, mode: int = 0o777, *args: Any, **kwargs: Any) -> int:
        opened.append((os.fspath(path), flags, mode))
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    old_umask = os.umask(0)  # the modes must not depend on a careful umask
    try:
        ca.save(tmp_path / "ca")
        issue_node_certificate(ca, new_instance_id(), name="n").save(tmp_path / "n")
    finally:
        os.umask(old_umask)

    for key in (tmp_path / "ca" / "ca.key", tmp_path / "n" / "node.key"):
        assert _mode(key) == 0o600
        creations = [(f, m) for p, f, m in opened if f"{key.name}." in Path(p).name]
        assert creations, f"{key} was not created through os.open"
        for flags, mode in creations:
            assert mode == 0o600 and flags & os.O_CREAT and flags & os.O_EXCL
    for public in ("ca/ca.pem", "n/node.pem", "n/ca.pem", "n/node.json"):
        assert _mode(tmp_path / public) == 0o644
    assert _mode(tmp_path / "ca") == 0o700 and _mode(tmp_path / "n") == 0o700
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_an_existing_directory_keeps_its_mode(ca: CertificateAuthority, tmp_path: Path) -> None:
    target = tmp_path / "shared"
    target.mkdir(mode=0o750)
    target.chmod(0o750)
    ca.save(target)
    assert _mode(target) == 0o750


def test_ca_round_trip(tmp_path: Path) -> None:
    ca = CertificateAuthority.create("round trip", trust_domain="rt.example")
    ca.save(tmp_path)
    loaded = CertificateAuthority.load(tmp_path)
    assert loaded.certificate == ca.certificate
    assert loaded.trust_domain == "rt.example"
    assert loaded.private_key.private_numbers() == ca.private_key.private_numbers()


def test_ca_save_refuses_to_replace_a_key(tmp_path: Path) -> None:
    first = CertificateAuthority.create()
    first.save(tmp_path)
    with pytest.raises(FileExistsError):
        CertificateAuthority.create().save(tmp_path)
    assert CertificateAuthority.load(tmp_path).certificate == first.certificate
    second = CertificateAuthority.create()
    second.save(tmp_path, overwrite=True)
    assert CertificateAuthority.load(tmp_path).certificate == second.certificate


def test_ca_load_refuses_a_key_from_another_ca(
    ca: CertificateAuthority, other_ca: CertificateAuthority, tmp_path: Path
) -> None:
    ca.save(tmp_path / "a")
    other_ca.save(tmp_path / "b")
    (tmp_path / "a" / "ca.key").write_bytes((tmp_path / "b" / "ca.key").read_bytes())
    with pytest.raises(CredentialsError, match="does not belong"):
        CertificateAuthority.load(tmp_path / "a")


def test_node_round_trip_keeps_chain_and_every_trust_root(
    ca: CertificateAuthority, other_ca: CertificateAuthority, tmp_path: Path
) -> None:
    creds = issue_node_certificate(ca, new_instance_id(), name="node-a")
    creds = NodeCredentials(
        name=creds.name,
        instance_id=creds.instance_id,
        trust_domain=creds.trust_domain,
        certificate=creds.certificate,
        private_key=creds.private_key,
        chain=[other_ca.certificate],  # any certificate: save/load must keep the order
        trust_roots=[ca.certificate, other_ca.certificate],
    )
    creds.save(tmp_path)
    loaded = NodeCredentials.load(tmp_path)
    assert loaded.name == "node-a"
    assert loaded.instance_id == creds.instance_id
    assert loaded.trust_domain == ca.trust_domain
    assert loaded.certificate == creds.certificate
    assert loaded.chain == [other_ca.certificate]
    assert loaded.trust_roots == [ca.certificate, other_ca.certificate]
    assert loaded.private_key.private_numbers() == creds.private_key.private_numbers()
    meta = json.loads((tmp_path / "node.json").read_text())
    assert meta == {
        "name": "node-a",
        "instance_id": str(creds.instance_id),
        "trust_domain": ca.trust_domain,
    }


def test_node_load_refuses_a_key_that_does_not_match(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    good = issue_node_certificate(ca, new_instance_id(), name="n")
    bad = testing.with_mismatched_key(good)
    assert bad.certificate == good.certificate
    bad.save(tmp_path)
    with pytest.raises(CredentialsError, match="does not match"):
        NodeCredentials.load(tmp_path)


def test_node_load_refuses_metadata_naming_another_node(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    issue_node_certificate(ca, new_instance_id(), name="n").save(tmp_path)
    meta = json.loads((tmp_path / "node.json").read_text())
    meta["instance_id"] = str(new_instance_id())
    (tmp_path / "node.json").write_text(json.dumps(meta))
    with pytest.raises(CredentialsError, match="says"):
        NodeCredentials.load(tmp_path)


@pytest.mark.parametrize("name", ["node.pem", "node.key", "ca.pem"])
def test_node_load_says_which_file_is_missing_and_how_to_make_it(
    ca: CertificateAuthority, tmp_path: Path, name: str
) -> None:
    issue_node_certificate(ca, new_instance_id(), name="n").save(tmp_path)
    (tmp_path / name).unlink()
    with pytest.raises(CredentialsError) as refused:
        NodeCredentials.load(tmp_path)
    message = str(refused.value)
    assert f"{tmp_path / name} is missing" in message and "velomux certs issue" in message
    assert "PEM" not in message  # not "unreadable": the file is not there


def test_node_save_refuses_to_replace_a_key(ca: CertificateAuthority, tmp_path: Path) -> None:
    first = issue_node_certificate(ca, new_instance_id(), name="n")
    first.save(tmp_path)
    with pytest.raises(FileExistsError):
        issue_node_certificate(ca, new_instance_id(), name="n").save(tmp_path)
    assert NodeCredentials.load(tmp_path).instance_id == first.instance_id


def test_load_trust_roots_concatenates_files(
    ca: CertificateAuthority, other_ca: CertificateAuthority, tmp_path: Path
) -> None:
    ca.save(tmp_path / "old")
    other_ca.save(tmp_path / "new")
    roots = load_trust_roots([tmp_path / "old" / "ca.pem", tmp_path / "new" / "ca.pem"])
    assert roots == [ca.certificate, other_ca.certificate]


# --- dev cluster --------------------------------------------------------------------------


def _snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_dev_cluster_is_created_then_left_alone(tmp_path: Path) -> None:
    nodes = ensure_dev_cluster(tmp_path / "dev")
    assert nodes == {"node-a": tmp_path / "dev" / "node-a", "node-b": tmp_path / "dev" / "node-b"}
    ca = CertificateAuthority.load(tmp_path / "dev" / "ca")
    loaded = {name: NodeCredentials.load(path) for name, path in nodes.items()}
    assert loaded["node-a"].instance_id != loaded["node-b"].instance_id
    for creds in loaded.values():
        creds.certificate.verify_directly_issued_by(ca.certificate)
        assert creds.trust_roots == [ca.certificate]
    before = _snapshot(tmp_path / "dev")
    assert ensure_dev_cluster(tmp_path / "dev") == nodes
    assert _snapshot(tmp_path / "dev") == before


def test_dev_cluster_adds_a_node_without_touching_the_others(tmp_path: Path) -> None:
    ensure_dev_cluster(tmp_path, ["a"])
    before = _snapshot(tmp_path)
    ensure_dev_cluster(tmp_path, ["a", "b"])
    after = _snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("b/")} == before
    NodeCredentials.load(tmp_path / "b").certificate.verify_directly_issued_by(
        CertificateAuthority.load(tmp_path / "ca").certificate
    )


def test_dev_cluster_renews_an_expiring_node_and_keeps_its_id(tmp_path: Path) -> None:
    nodes = ensure_dev_cluster(tmp_path, ["a"])
    ca = CertificateAuthority.load(tmp_path / "ca")
    old = NodeCredentials.load(nodes["a"])
    soon = datetime.now(UTC) + timedelta(hours=12)
    issue_node_certificate(ca, old.instance_id, name="a", not_after=soon).save(
        nodes["a"], overwrite=True
    )
    ensure_dev_cluster(tmp_path, ["a"])
    renewed = NodeCredentials.load(nodes["a"])
    assert renewed.instance_id == old.instance_id
    assert renewed.certificate.not_valid_after_utc > soon + timedelta(days=1)
    assert CertificateAuthority.load(tmp_path / "ca").certificate == ca.certificate


def test_dev_cluster_replaces_an_expiring_ca_and_reissues_its_nodes(tmp_path: Path) -> None:
    short = CertificateAuthority.create(valid_for=timedelta(hours=20))
    short.save(tmp_path / "ca")
    issue_node_certificate(short, new_instance_id(), name="a").save(tmp_path / "a")
    ensure_dev_cluster(tmp_path, ["a"])
    ca = CertificateAuthority.load(tmp_path / "ca")
    assert ca.certificate != short.certificate
    node = NodeCredentials.load(tmp_path / "a")
    node.certificate.verify_directly_issued_by(ca.certificate)
    assert node.trust_roots == [ca.certificate]


def test_dev_cluster_repairs_a_node_with_a_mismatched_key(tmp_path: Path) -> None:
    nodes = ensure_dev_cluster(tmp_path, ["a"])
    good = NodeCredentials.load(nodes["a"])
    testing.with_mismatched_key(good).save(nodes["a"], overwrite=True)
    ensure_dev_cluster(tmp_path, ["a"])
    assert NodeCredentials.load(nodes["a"]).instance_id == good.instance_id


def test_dev_cluster_force_remakes_everything(tmp_path: Path) -> None:
    ensure_dev_cluster(tmp_path, ["a"])
    ca = CertificateAuthority.load(tmp_path / "ca")
    key = (tmp_path / "a" / "node.key").read_bytes()
    ensure_dev_cluster(tmp_path, ["a"], force=True)
    assert CertificateAuthority.load(tmp_path / "ca").certificate != ca.certificate
    assert (tmp_path / "a" / "node.key").read_bytes() != key


@pytest.mark.parametrize("names", [["ca"], ["a/b"], [".."], [""], ["a", "a"]])
def test_dev_cluster_refuses_unsafe_names(tmp_path: Path, names: list[str]) -> None:
    with pytest.raises(ValueError):
        ensure_dev_cluster(tmp_path, names)
    assert not (tmp_path / "ca").exists()


# --- refusal-test helpers -----------------------------------------------------------------


def test_self_signed_copy_mimics_everything_but_the_signature(ca: CertificateAuthority) -> None:
    victim = issue_node_certificate(ca, new_instance_id(), name="victim")
    forged = testing.self_signed_copy(victim)
    assert forged.certificate.subject == victim.certificate.subject
    assert forged.certificate.issuer == forged.certificate.subject
    assert (
        _ext(forged.certificate, x509.SubjectAlternativeName).value
        == _ext(victim.certificate, x509.SubjectAlternativeName).value
    )
    forged.certificate.verify_directly_issued_by(forged.certificate)
    mimic = testing.self_signed_copy(victim, mimic_issuer=True)
    assert mimic.certificate.issuer == ca.certificate.subject
    assert _spki(forged.certificate) != _spki(victim.certificate)


def test_usage_and_uri_helpers_change_only_what_they_say(ca: CertificateAuthority) -> None:
    server_only = testing.issue_with_usages(
        ca, new_instance_id(), name="s", extended_key_usages=testing.SERVER_ONLY
    )
    assert list(_ext(server_only.certificate, x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH
    ]
    none = testing.issue_with_usages(ca, new_instance_id(), name="s", extended_key_usages=None)
    with pytest.raises(x509.ExtensionNotFound):
        _ext(none.certificate, x509.ExtendedKeyUsage)
    uris = [f"spiffe://x.example/instance/{new_instance_id()}"]
    odd = testing.issue_with_uris(ca, uris, name="u")
    san = _ext(odd.certificate, x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == uris
