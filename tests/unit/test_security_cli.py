"""``velomux certs``: init-ca, issue and dev, run through ``main`` into a temporary directory."""

from __future__ import annotations

import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509

from velomux_quic.ids import new_instance_id
from velomux_quic.programs.cli import main
from velomux_quic.security.certs import CertificateAuthority, NodeCredentials
from velomux_quic.security.verify import PeerVerifier


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _sans(creds: NodeCredentials) -> x509.SubjectAlternativeName:
    ext = creds.certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    return ext.value


@pytest.fixture
def ca_dir(tmp_path: Path) -> Path:
    assert main(["certs", "init-ca", "--out", str(tmp_path / "ca")]) == 0
    return tmp_path / "ca"


def test_init_ca_writes_the_ca_and_says_where(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ca"
    argv = ["certs", "init-ca", "--out", str(out), "--trust-domain", "prod.example"]
    assert main([*argv, "--name", "Prod CA", "--days", "30"]) == 0
    printed = capsys.readouterr().out
    assert str(out / "ca.pem") in printed and str(out / "ca.key") in printed
    assert "prod.example" in printed
    ca = CertificateAuthority.load(out)
    assert ca.trust_domain == "prod.example"
    assert ca.certificate.subject.rfc4514_string() == "CN=Prod CA"
    lifetime = ca.certificate.not_valid_after_utc - ca.certificate.not_valid_before_utc
    assert 29 < lifetime.days <= 30
    assert _mode(out / "ca.key") == 0o600


def test_init_ca_refuses_to_replace_a_key_without_force(
    ca_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key = (ca_dir / "ca.key").read_bytes()
    capsys.readouterr()
    assert main(["certs", "init-ca", "--out", str(ca_dir)]) == 2
    assert "--force" in capsys.readouterr().err
    assert (ca_dir / "ca.key").read_bytes() == key
    assert main(["certs", "init-ca", "--out", str(ca_dir), "--force"]) == 0
    assert (ca_dir / "ca.key").read_bytes() != key


def test_init_ca_rejects_a_bad_trust_domain(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["certs", "init-ca", "--out", str(tmp_path), "--trust-domain", "Bad Domain"])
    assert caught.value.code == 2
    assert not (tmp_path / "ca.key").exists()


def test_issue_writes_a_node_the_ca_vouches_for(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "node-a"
    instance = new_instance_id()
    capsys.readouterr()
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "node-a", "--out", str(out)]
    argv += ["--instance", str(instance).upper(), "--san", "a.example", "10.0.0.7"]
    assert main([*argv, "--san", "::1", "--days", "7"]) == 0
    printed = capsys.readouterr().out
    for name in ("node.pem", "node.key", "ca.pem", "node.json"):
        assert str(out / name) in printed
    assert str(instance) in printed
    creds = NodeCredentials.load(out)
    assert creds.instance_id == instance and creds.name == "node-a"
    san = _sans(creds)
    assert san.get_values_for_type(x509.DNSName) == ["a.example"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.0.0.7"),
        ipaddress.ip_address("::1"),
    ]
    lifetime = creds.certificate.not_valid_after_utc - creds.certificate.not_valid_before_utc
    assert 6 < lifetime.days <= 7
    assert _mode(out / "node.key") == 0o600
    ca = CertificateAuthority.load(ca_dir)
    verifier = PeerVerifier(creds.trust_roots, ca.trust_domain)
    assert verifier.verify(creds.certificate, [], role="client") == instance


def test_issue_defaults_to_a_new_instance_and_localhost_names(ca_dir: Path, tmp_path: Path) -> None:
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "n"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert main([*argv, "--out", str(tmp_path / "two")]) == 0
    one, two = NodeCredentials.load(tmp_path / "one"), NodeCredentials.load(tmp_path / "two")
    assert one.instance_id != two.instance_id
    assert _sans(one).get_values_for_type(x509.DNSName) == ["localhost"]


def test_issue_refuses_to_replace_a_key_and_force_keeps_the_identity(
    ca_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "n"
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "n", "--out", str(out)]
    assert main(argv) == 0
    first = NodeCredentials.load(out)
    key = (out / "node.key").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    assert "--force" in capsys.readouterr().err
    assert (out / "node.key").read_bytes() == key
    assert main([*argv, "--force"]) == 0
    renewed = NodeCredentials.load(out)
    assert renewed.instance_id == first.instance_id
    assert (out / "node.key").read_bytes() != key
    assert "kept" in capsys.readouterr().out


def test_issue_can_trust_an_additional_ca(ca_dir: Path, tmp_path: Path) -> None:
    assert main(["certs", "init-ca", "--out", str(tmp_path / "new-ca")]) == 0
    out = tmp_path / "n"
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "n", "--out", str(out)]
    assert main([*argv, "--also-trust", str(tmp_path / "new-ca" / "ca.pem")]) == 0
    roots = NodeCredentials.load(out).trust_roots
    assert roots == [
        CertificateAuthority.load(ca_dir).certificate,
        CertificateAuthority.load(tmp_path / "new-ca").certificate,
    ]


def test_issue_reports_a_missing_ca(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["certs", "issue", "--ca", str(tmp_path / "nope"), "--name", "n"]
    assert main([*argv, "--out", str(tmp_path / "n")]) == 2
    assert "missing" in capsys.readouterr().err
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize(
    "extra",
    [["--san", "not a name"], ["--instance", "not-a-uuid"], ["--days", "0"], ["--days", "x"]],
)
def test_issue_rejects_bad_arguments(ca_dir: Path, tmp_path: Path, extra: list[str]) -> None:
    argv = ["certs", "issue", "--ca", str(ca_dir), "--name", "n", "--out", str(tmp_path / "n")]
    with pytest.raises(SystemExit) as caught:
        main([*argv, *extra])
    assert caught.value.code == 2
    assert not (tmp_path / "n").exists()


def test_dev_creates_a_cluster_and_is_idempotent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "dev"
    assert main(["certs", "dev", "--out", str(out), "--names", "x, y"]) == 0
    printed = capsys.readouterr().out
    nodes = {name: NodeCredentials.load(out / name) for name in ("x", "y")}
    for name, creds in nodes.items():
        assert str(out / name) in printed and str(creds.instance_id) in printed
    keys = {name: (out / name / "node.key").read_bytes() for name in nodes}
    assert main(["certs", "dev", "--out", str(out), "--names", "x,y"]) == 0
    assert {name: (out / name / "node.key").read_bytes() for name in nodes} == keys
    assert main(["certs", "dev", "--out", str(out), "--names", "x,y", "--force"]) == 0
    assert (out / "x" / "node.key").read_bytes() != keys["x"]
    assert NodeCredentials.load(out / "x").instance_id == nodes["x"].instance_id


def test_dev_defaults_to_node_a_and_node_b(tmp_path: Path) -> None:
    assert main(["certs", "dev", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["ca", "node-a", "node-b"]


def test_dev_reports_a_bad_node_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["certs", "dev", "--out", str(tmp_path), "--names", "ca"]) == 2
    assert "invalid node name" in capsys.readouterr().err


def test_certs_without_a_command_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["certs"])
    assert caught.value.code == 2
