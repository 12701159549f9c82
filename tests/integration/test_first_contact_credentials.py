"""A node's own credentials at first contact: refused at start as at a reload when no peer
would take them, warned about before they expire, and named when a peer refuses them."""

from __future__ import annotations

import dataclasses
import logging
import re
import subprocess
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from tests.integration.test_node_command import CHECKOUT, COMMAND
from velomux_quic import CredentialsError, DialError, Node, NodeCredentials
from velomux_quic.ids import new_instance_id
from velomux_quic.security.certs import CertificateAuthority, issue_node_certificate
from velomux_quic.security.startup import own_certificate_refusal
from velomux_quic.security.testing import (
    issue_expired,
    issue_not_yet_valid,
    with_mismatched_key,
)
from velomux_quic.transport import TransportConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def closing() -> AsyncIterator[list[Node]]:
    """Nodes a test started, closed when it ends."""
    nodes: list[Node] = []
    yield nodes
    for node in nodes:
        await node.close()


def _expiring_in(ca: CertificateAuthority, days: float, name: str = "a") -> NodeCredentials:
    now = datetime.now(UTC)
    return issue_node_certificate(
        ca,
        new_instance_id(),
        name=name,
        not_before=now - timedelta(days=1),
        not_after=now + timedelta(days=days),
    )


async def test_a_node_refuses_to_start_on_an_expired_certificate_naming_file_date_and_fix(
    tmp_path: Path, ca: CertificateAuthority
) -> None:
    expired = issue_expired(ca, new_instance_id(), name="a")
    expired.save(tmp_path / "a")
    with pytest.raises(CredentialsError) as raised:
        await Node.start(tmp_path / "a")
    message = str(raised.value)
    assert str(tmp_path / "a" / "node.pem") in message
    not_after = expired.certificate.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert f"expired on {not_after}" in message
    assert f"velomux certs renew --ca CA_DIR --node-dir {tmp_path / 'a'}" in message


async def test_a_node_refuses_a_certificate_not_yet_valid_and_a_key_not_its_own(
    ca: CertificateAuthority, make_credentials: Callable[..., NodeCredentials]
) -> None:
    with pytest.raises(CredentialsError) as raised:
        await Node.start(issue_not_yet_valid(ca, new_instance_id(), name="a"))
    assert "not valid before" in str(raised.value) and "clock" in str(raised.value)
    with pytest.raises(CredentialsError) as raised:
        await Node.start(with_mismatched_key(make_credentials("a")))
    assert "does not match" in str(raised.value)
    assert "velomux certs issue" in str(raised.value)


@pytest.mark.one_loop
def test_velomux_node_on_an_expired_certificate_exits_2_with_the_same_words(
    tmp_path: Path, ca: CertificateAuthority
) -> None:
    issue_expired(ca, new_instance_id(), name="a").save(tmp_path / "a")
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncredentials = "{tmp_path / "a"}"\n')
    result = subprocess.run(
        [*COMMAND, "--config", str(config), "--ops", "off"],
        capture_output=True, text=True, timeout=30, check=False, cwd=CHECKOUT,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "expired on" in result.stderr and "velomux certs renew" in result.stderr
    assert "event=listening" not in result.stdout


async def test_a_certificate_expiring_within_the_window_is_warned_about_and_gauged(
    ca: CertificateAuthority, closing: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    credentials = _expiring_in(ca, 5)
    with caplog.at_level(logging.WARNING, logger="velomux_quic.node"):
        closing.append(node := await Node.start(credentials))
    events = [r for r in caplog.records if getattr(r, "event", None) == "certificate_expiring"]
    assert [r.fields["which"] for r in events] == ["node"]  # type: ignore[attr-defined]
    assert "velomux certs renew" in events[0].getMessage()
    seconds = re.search(
        r'^velo_node_certificate_expiry_seconds\{which="node"\} (\S+)$',
        node.metrics_text(),
        re.MULTILINE,
    )
    assert seconds is not None
    assert 4 * 86400 < float(seconds.group(1)) <= 5 * 86400
    assert re.search(r'velo_node_certificate_expiry_seconds\{which="ca"\}', node.metrics_text())


async def test_the_expiry_window_is_an_option_and_zero_never_warns(
    ca: CertificateAuthority, closing: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="velomux_quic.node"):
        quiet = TransportConfig(certificate_expiry_warning=0)
        closing.append(await Node.start(_expiring_in(ca, 5), transport=quiet))
        closing.append(
            await Node.start(
                _expiring_in(ca, 30),
                transport=TransportConfig(certificate_expiry_warning=60 * 86400),
            )
        )
    events = [r for r in caplog.records if getattr(r, "event", None) == "certificate_expiring"]
    assert len(events) == 1
    with pytest.raises(ValueError, match="certificate_expiry_warning"):
        TransportConfig(certificate_expiry_warning=-1)


async def test_a_refusal_by_the_peer_says_it_was_our_certificate_and_why(
    ca: CertificateAuthority,
    other_ca: CertificateAuthority,
    make_credentials: Callable[..., NodeCredentials],
    closing: list[Node],
) -> None:
    closing.append(b := await Node.start(make_credentials("b")))
    # a's certificate comes from a CA b does not trust; a trusts b's CA, so only b refuses.
    foreign = issue_node_certificate(other_ca, new_instance_id(), name="a")
    foreign = dataclasses.replace(foreign, trust_roots=[other_ca.certificate, ca.certificate])
    closing.append(a := await Node.start(foreign))
    a.add_peer(b.instance_id, b.address)
    with pytest.raises(DialError) as raised:
        await a.connect(b.instance_id)
    message = str(raised.value)
    assert "refused OUR certificate: untrusted_chain" in message
    assert f"issuer '{other_ca.certificate.subject.rfc4514_string()}'" in message
    assert "velomux certs trust" in message
    # The other way round, the dialer refuses the peer's certificate and says so.
    b.add_peer(a.instance_id, a.address)
    with pytest.raises(DialError) as raised:
        await b.connect(a.instance_id)
    assert "this node refused the peer's certificate" in str(raised.value)


def test_a_peer_refusing_an_expired_certificate_names_its_not_after_and_the_renewal(
    ca: CertificateAuthority,
) -> None:
    expired = issue_expired(ca, new_instance_id(), name="a")
    message = own_certificate_refusal(expired, "expired", "expired")
    not_after = expired.certificate.not_valid_after_utc.strftime("%Y-%m-%d %H:%M:%S UTC")
    assert message.startswith("expired (") and f"not after {not_after}" in message
    assert "velomux certs renew" in message and "reload" in message


async def test_a_reload_onto_a_certificate_expiring_soon_warns_as_a_start_does(
    tmp_path: Path, ca: CertificateAuthority, closing: list[Node], caplog: pytest.LogCaptureFixture
) -> None:
    lasting = _expiring_in(ca, 300)
    lasting.save(tmp_path / "a")
    with caplog.at_level(logging.WARNING, logger="velomux_quic.node"):
        closing.append(node := await Node.start(tmp_path / "a"))
        assert not [r for r in caplog.records if getattr(r, "event", None)]
        now = datetime.now(UTC)
        issue_node_certificate(
            ca, lasting.instance_id, name="a",
            not_before=now - timedelta(days=1), not_after=now + timedelta(days=3),
        ).save(tmp_path / "a", overwrite=True)  # fmt: skip
        node.reload_credentials()
    events = [r for r in caplog.records if getattr(r, "event", None) == "certificate_expiring"]
    assert len(events) == 1 and events[0].fields["which"] == "node"  # type: ignore[attr-defined]
    assert 2 < float(events[0].fields["days_left"]) <= 3  # type: ignore[attr-defined]
