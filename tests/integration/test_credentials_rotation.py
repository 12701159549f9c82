"""Certificate rotation and a CA roll on running nodes, over real QUIC and mutual TLS.

A reload changes what *new* connections present and trust; connections already open keep
theirs. Each test tells which certificate a connection carries from ``node.snapshot()``:
the transport's ``certificate`` (what new connections present) and, per connection,
``own_certificate_serial`` / ``peer_certificate_serial`` (what its handshake exchanged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from velomux_quic.errors import CredentialsError, DialError
from velomux_quic.ids import InstanceId, new_instance_id
from velomux_quic.messenger.registry import Context
from velomux_quic.mux.config import MuxConfig
from velomux_quic.node import Node
from velomux_quic.programs.cli import main
from velomux_quic.security.certs import (
    CertificateAuthority,
    NodeCredentials,
    issue_node_certificate,
)
from velomux_quic.security.rotation import CertificateSummary, summarize_certificate
from velomux_quic.security.testing import issue_expired, with_mismatched_key

StartFrom = Callable[..., Awaitable[Node]]


@pytest.fixture
async def start_from() -> AsyncIterator[StartFrom]:
    """Nodes started from a credentials directory (which a reload reads again)."""
    async with AsyncExitStack() as stack:

        async def start(directory: Path, mux: MuxConfig | None = None) -> Node:
            node = await Node.start(directory, mux=mux)
            stack.push_async_callback(node.close)
            node.register_handler("echo", _echo)
            return node

        yield start


def _echo(ctx: Context) -> bytes:
    return bytes(ctx.payload)


def serial(credentials: NodeCredentials) -> str:
    return f"{credentials.certificate.serial_number:x}"


def current_serial(node: Node) -> str:
    certificate = node.snapshot().transport.certificate
    assert certificate is not None
    return certificate.serial


def metric(node: Node, name: str, default: float | None = None, **labels: str) -> float:
    for family in text_string_to_metric_families(node.metrics_text()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    if default is not None:  # a labelled counter has no sample before its first count
        return default
    raise AssertionError(f"no sample {name}{labels}")


def issue_into(ca: CertificateAuthority, directory: Path, name: str) -> NodeCredentials:
    credentials = issue_node_certificate(ca, new_instance_id(), name=name)
    credentials.save(directory)
    return credentials


def introduce(*nodes: Node) -> None:
    """Every node learns every other's address."""
    for node in nodes:
        for other in nodes:
            if other is not node:
                node.add_peer(other.instance_id, other.address)


def renew(ca: CertificateAuthority, root: Path, name: str) -> int:
    """``velomux certs renew`` of ``root/name`` from ``ca`` (saved under ``root/ca-<serial>``)."""
    ca_dir = root / f"ca-{ca.certificate.serial_number:x}"
    if not ca_dir.exists():
        ca.save(ca_dir)
    return main(["certs", "renew", "--ca", str(ca_dir), "--node-dir", str(root / name)])


async def disconnected(x: Node, y: Node) -> None:
    """Close every connection between x and y, and wait until both sides saw them end.

    A call made before the peer saw its connection close could be failed by that close;
    the nodes expose no event for it, so the snapshots are polled (bounded).
    """
    for one, other in ((x, y), (y, x)):
        one.messenger.transport.disconnect(other.instance_id)

    def between() -> int:
        return sum(
            1
            for one, other in ((x, y), (y, x))
            for c in one.snapshot().transport.connections
            if c.peer == other.instance_id
        )

    async with asyncio.timeout(20):
        while between():
            await asyncio.sleep(0.01)


async def fresh_connections(x: Node, y: Node) -> None:
    """Drop every connection between x and y, then make new ones both ways with calls."""
    await disconnected(x, y)
    async with asyncio.timeout(20):
        assert await x.call(y.instance_id, "echo", b"x to y", timeout=10) == b"x to y"
        assert await y.call(x.instance_id, "echo", b"y to x", timeout=10) == b"y to x"


def presented_to(viewer: Node, peer: InstanceId) -> str | None:
    """What ``peer`` presented on the connection ``viewer`` dialed to it."""
    live = [
        c
        for c in viewer.snapshot().transport.connections
        if c.outbound and c.peer == peer and c.state == "established"
    ]  # a connection just disconnected may still be closing
    assert len(live) == 1, f"{len(live)} live connections from {viewer.instance_id} to {peer}"
    return live[0].peer_certificate_serial


async def assert_connects_with(x: Node, y: Node) -> None:
    """New connections between x and y succeed and present each one's current certificate."""
    await fresh_connections(x, y)
    assert presented_to(x, y.instance_id) == current_serial(y)
    assert presented_to(y, x.instance_id) == current_serial(x)


# -- refusals ------------------------------------------------------------------------------


async def test_a_refused_reload_leaves_the_node_on_its_old_credentials(
    ca: CertificateAuthority, other_ca: CertificateAuthority, tmp_path: Path, start_from: StartFrom
) -> None:
    a_creds = issue_into(ca, tmp_path / "a", "a")
    a = await start_from(tmp_path / "a")
    garbled = tmp_path / "garbled"
    a_creds.save(garbled)
    (garbled / "node.key").write_bytes(b"not a key")
    foreign = issue_node_certificate(other_ca, a_creds.instance_id, name="a")
    bad_sets: list[NodeCredentials | Path] = [
        with_mismatched_key(issue_node_certificate(ca, a_creds.instance_id, name="a")),
        issue_node_certificate(ca, new_instance_id(), name="a"),  # another identity
        issue_expired(ca, a_creds.instance_id, name="a"),
        dataclasses.replace(foreign, trust_roots=[ca.certificate]),  # chains to no new root
        garbled,
        tmp_path / "missing",
    ]
    for bad in bad_sets:
        with pytest.raises(CredentialsError, match="keeps its current credentials"):
            a.reload_credentials(bad)
    assert current_serial(a) == serial(a_creds)
    assert metric(a, "velo_transport_credential_reloads_total", outcome="refused") == len(bad_sets)
    assert metric(a, "velo_transport_credential_reloads_total", outcome="ok") == 0
    expiry = metric(a, "velo_transport_certificate_expiry_timestamp_seconds")
    assert expiry == a_creds.certificate.not_valid_after_utc.timestamp()

    # New connections, both directions, still work and present the old certificate.
    issue_into(ca, tmp_path / "c", "c")
    c = await start_from(tmp_path / "c")
    introduce(a, c)
    await assert_connects_with(a, c)
    assert presented_to(c, a.instance_id) == serial(a_creds)


# -- rotation under load -------------------------------------------------------------------

RECORDS = 4_000


def record(seq: int) -> dict[str, object]:
    body = f"token {seq} ".encode() * (1 + seq % 7)
    return {"seq": seq, "body": body, "crc": zlib.crc32(body)}


@pytest.mark.parametrize("mux", [True, False], ids=["mux", "per-stream"])
async def test_a_stream_runs_whole_through_a_reload_and_new_connections_present_the_new_cert(
    ca: CertificateAuthority, tmp_path: Path, start_from: StartFrom, mux: bool
) -> None:
    old = issue_into(ca, tmp_path / "a", "a")
    issue_into(ca, tmp_path / "b", "b")
    options = MuxConfig() if mux else MuxConfig(enabled=False)
    b = await start_from(tmp_path / "b", options)
    a = await start_from(tmp_path / "a", options)
    introduce(a, b)
    anchor = b.create_anchor()
    sender = await a.attach_anchor(anchor.handle)
    assert renew(ca, tmp_path, "a") == 0  # velomux certs renew, into a's running directory
    renewed = NodeCredentials.load(tmp_path / "a")
    assert current_serial(a) == serial(old)  # files changed, nothing reloaded yet
    seen: list[int] = []
    received_at_reload: list[int] = []

    async def produce() -> CertificateSummary:
        summary = None
        for seq in range(RECORDS):
            if seq == RECORDS // 2:  # between two sends, records of the first half in flight
                received_at_reload.append(len(seen))
                summary = a.reload_credentials()  # the directory a was started from
            await sender.send(record(seq))
        await sender.finalize()
        assert summary is not None
        return summary

    async def consume() -> None:
        async for item in anchor:
            assert isinstance(item, dict)
            assert zlib.crc32(item["body"]) == item["crc"], f"record {item['seq']} corrupted"
            seen.append(item["seq"])

    async with asyncio.timeout(60):
        summary, _ = await asyncio.gather(produce(), consume())
    assert received_at_reload[0] < RECORDS // 2, "the reload came while the stream ran"
    assert seen == list(range(RECORDS)), "every record once, in order"
    assert summary.serial == serial(renewed) != serial(old)
    assert summary.not_after == renewed.certificate.not_valid_after_utc
    assert current_serial(a) == serial(renewed)
    # The connection the stream ran on was made before the reload and kept its certificate.
    inbound = b.snapshot().transport.inbound_from(a.instance_id)
    assert [c.peer_certificate_serial for c in inbound] == [serial(old)]
    assert metric(a, "velo_transport_credential_reloads_total", outcome="ok") == 1
    expiry = metric(a, "velo_transport_certificate_expiry_timestamp_seconds")
    assert expiry == renewed.certificate.not_valid_after_utc.timestamp()

    # A new connection presents the new certificate, and b accepts it.
    await assert_connects_with(a, b)
    assert presented_to(b, a.instance_id) == serial(renewed)


# -- CA roll -------------------------------------------------------------------------------


def trust(node_dir: Path, *argv: str) -> None:
    assert main(["certs", "trust", "--node-dir", str(node_dir), *argv]) == 0


async def assert_refused_both_ways(straggler: Node, node: Node) -> None:
    """``straggler`` (an old-CA certificate) can neither dial ``node`` nor be dialed by it."""
    refusals = metric(node, "velo_transport_peer_refusals_total", 0, reason="untrusted_chain")
    await disconnected(straggler, node)  # connections made before the CA was dropped
    with pytest.raises(DialError) as dialing:
        await asyncio.wait_for(straggler.messenger.transport.connect(node.instance_id), 20)
    assert dialing.value.reason == "refused_by_peer:untrusted_chain"
    with pytest.raises(DialError) as dialed:
        await asyncio.wait_for(node.messenger.transport.connect(straggler.instance_id), 20)
    assert dialed.value.reason == "untrusted_chain"
    after = metric(node, "velo_transport_peer_refusals_total", reason="untrusted_chain")
    assert after == refusals + 2


async def test_a_ca_roll_step_by_step_without_a_restart(
    tmp_path: Path, start_from: StartFrom
) -> None:
    # Both CAs carry the default name, as two runs of `velomux certs init-ca` would: the
    # verifier must tell them apart by signature, not by name.
    old_ca, new_ca = CertificateAuthority.create(), CertificateAuthority.create()
    old_ca.save(tmp_path / "ca-old")
    new_ca.save(tmp_path / "ca-new")
    new_pem, old_pem = str(tmp_path / "ca-new" / "ca.pem"), str(tmp_path / "ca-old" / "ca.pem")
    for name in ("a", "b", "straggler"):
        issue_into(old_ca, tmp_path / name, name)
    a = await start_from(tmp_path / "a")
    b = await start_from(tmp_path / "b")
    straggler = await start_from(tmp_path / "straggler")  # never moves off the old CA
    introduce(a, b, straggler)
    old_a, old_b = current_serial(a), current_serial(b)
    await assert_connects_with(a, b)

    # 1. every node trusts both CAs
    for name, node in (("a", a), ("b", b), ("straggler", straggler)):
        trust(tmp_path / name, "--add", new_pem)
        node.reload_credentials()
        assert [r.fingerprint for r in node.snapshot().transport.trust_roots] == [
            fingerprint(old_ca),
            fingerprint(new_ca),
        ]
    assert (current_serial(a), current_serial(b)) == (old_a, old_b)  # same certificates
    await assert_connects_with(a, b)
    await assert_connects_with(a, straggler)

    # 2. a moves to the new CA; b and the straggler still present old-CA certificates
    assert renew(new_ca, tmp_path, "a") == 0
    a.reload_credentials()
    assert current_serial(a) != old_a
    moved = NodeCredentials.load(tmp_path / "a")
    moved.certificate.verify_directly_issued_by(new_ca.certificate)  # raises if not
    assert current_serial(a) == serial(moved)
    await assert_connects_with(a, b)
    await assert_connects_with(b, straggler)

    # 3. b moves too
    assert renew(new_ca, tmp_path, "b") == 0
    b.reload_credentials()
    assert current_serial(b) == serial(NodeCredentials.load(tmp_path / "b")) != old_b
    await assert_connects_with(a, b)
    await assert_connects_with(a, straggler)

    # 4. a and b drop the old CA: they still reach each other, and the straggler no more
    for name, node in (("a", a), ("b", b)):
        trust(tmp_path / name, "--remove", old_pem)
        node.reload_credentials()
        assert [r.fingerprint for r in node.snapshot().transport.trust_roots] == [
            fingerprint(new_ca)
        ]
    await assert_connects_with(a, b)
    for node in (a, b):
        await assert_refused_both_ways(straggler, node)
    assert metric(a, "velo_transport_credential_reloads_total", outcome="ok") == 3
    assert metric(a, "velo_transport_credential_reloads_total", outcome="refused") == 0


def fingerprint(ca: CertificateAuthority) -> str:
    return summarize_certificate(ca.certificate).fingerprint
