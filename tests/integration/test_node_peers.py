"""What a program reads and does about a node's peers through the public surface alone.

The programs (``velomux node``, ``velomux probe``) are built on these: the peer registry and
the discovery backend a node holds, where it dials a peer, dialing now and learning the
outcome, asking discovery for an unknown peer, the credentials it presents, and a peer
added again at a new address. Everything is imported from the package root.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.polling import poll_until
from velomux_quic import (
    DialError,
    DirectoryPeers,
    InstanceId,
    NodeCredentials,
    PeerNotRegistered,
    PeerRecord,
    open_node,
)
from velomux_quic.ids import new_instance_id

MakeCredentials = Callable[..., NodeCredentials]


async def test_connect_dials_now_and_says_why_a_dial_failed(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        assert a.snapshot().transport.to(b.instance_id) is None  # sends dial lazily
        await a.connect(b.instance_id)
        connection = a.snapshot().transport.to(b.instance_id)
        assert connection is not None and connection.state == "established"
        assert connection.peer_certificate_serial == f"{b.credentials.certificate.serial_number:x}"

        with pytest.raises(PeerNotRegistered):
            await a.connect(new_instance_id())  # no address, and no discovery to ask

        impostor = new_instance_id()  # b answers at this address, with its own certificate
        a.add_peer(impostor, b.address)
        with pytest.raises(DialError) as refused:
            await a.connect(impostor)
        assert refused.value.reason == "identity_mismatch"


async def test_the_peers_are_readable_and_every_change_is_heard(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("b")) as b, open_node(make_credentials("a")) as a:
        assert a.discovery is None  # static peers only
        heard: list[tuple[InstanceId, bool]] = []
        unsubscribe = a.peers.subscribe(
            lambda record, instance_id: heard.append((instance_id, record is not None))
        )
        a.add_peer(b.instance_id, b.address, "b")
        record = a.peers.get(b.instance_id)
        assert record is not None and (record.address, record.name) == (b.address, "b")
        assert a.peer_address(b.instance_id) == b.address
        a.remove_peer(b.instance_id)
        assert a.peers.get(b.instance_id) is None
        assert a.peer_address(b.instance_id) is None
        unsubscribe()
        a.add_peer(b.instance_id, b.address)
        assert heard == [(b.instance_id, True), (b.instance_id, False)]


async def test_a_peer_that_dialed_in_has_the_address_it_came_from(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        assert b.peer_address(a.instance_id) is None  # b was told nothing of a
        await a.connect(b.instance_id)
        # One UDP socket per node dials and listens: the verified connection's source is
        # where a listens, so b can answer without being told.
        await b.connect(a.instance_id)
        assert b.peer_address(a.instance_id) == a.address
        assert b.peers.get(a.instance_id) is None  # learned, not registered


async def test_resolve_peer_asks_discovery_and_keeps_what_it_answers(
    make_credentials: MakeCredentials, tmp_path: Path
) -> None:
    directory = tmp_path / "peers"
    async with open_node(
        make_credentials("probe"), discovery=DirectoryPeers(directory), publish=False
    ) as probe:
        assert isinstance(probe.discovery, DirectoryPeers)
        assert probe.discovery.directory == directory
        # b publishes after the probe read the directory: only asking finds it.
        async with open_node(make_credentials("b"), discovery=DirectoryPeers(directory)) as b:
            assert probe.peers.get(b.instance_id) is None
            assert not await probe.resolve_peer(new_instance_id())
            assert await probe.resolve_peer(b.instance_id)
            record = probe.peers.get(b.instance_id)
            assert record is not None and record.address == b.address
            # publish=False: the probe is not listed where b would look for it.
            assert b.discovery is not None
            assert await b.discovery.lookup(probe.instance_id) is None


async def test_the_credentials_are_those_new_connections_present(
    make_credentials: MakeCredentials,
) -> None:
    credentials = make_credentials("a")
    async with open_node(credentials) as a:
        assert a.credentials is credentials
        presented = a.snapshot().transport.certificate
        assert presented is not None
        assert presented.serial == f"{a.credentials.certificate.serial_number:x}"
        assert a.credentials.instance_id == a.instance_id


async def test_a_peer_added_at_a_new_address_is_dialed_there(
    make_credentials: MakeCredentials,
) -> None:
    """A peer that restarted elsewhere: the connection to the old address leads nowhere, so
    adding the peer at its new address closes it and the next dial goes to the new one."""
    credentials_b = make_credentials("b")
    async with (
        open_node(credentials_b) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        await a.connect(b.instance_id)
        before = a.snapshot().transport.to(b.instance_id)
        assert before is not None and before.state == "established"
        # b "restarts" at another address: a second process with b's credentials.
        async with open_node(credentials_b) as moved:
            assert moved.address != b.address
            a.add_peer(b.instance_id, moved.address)
            old = a.snapshot().transport.to(b.instance_id)
            assert old is None or old.state != "established"  # the old connection is cut
            await a.connect(b.instance_id)
            record = a.peers.get(b.instance_id)
            assert record is not None and record.address == moved.address
            # The peer at the new address took the handshake: it is the one connected.
            assert any(c.peer == a.instance_id for c in moved.snapshot().transport.connections)


@pytest.mark.timeout(60)
async def test_a_call_queued_on_the_dial_to_a_moved_peer_outlives_the_old_connection(
    make_credentials: MakeCredentials,
) -> None:
    """A peer moved: the connection to its old address closes, and its closing period may
    end while the dial to the new address is still in its handshake (under load, a
    handshake takes longer than that period). A call queued on that dial is the new
    address's to answer: the old connection ending must not fail it with PeerGone."""
    credentials_b = make_credentials("b")
    async with (
        open_node(credentials_b) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        b.register_handler("who", lambda ctx: b"old")
        assert await a.call(b.instance_id, "who", b"", timeout=10) == b"old"
        # The new address: a socket that answers nothing yet, so the dial stays in its
        # handshake (no ICMP error either) until a node with b's credentials opens there.
        holding = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            holding.bind(("127.0.0.1", 0))
            port = holding.getsockname()[1]
            a.add_peer(b.instance_id, ("127.0.0.1", port))
            call = asyncio.create_task(a.call(b.instance_id, "who", b"", timeout=30))

            def only_the_dial_is_left() -> bool:
                to_b = [
                    c.state
                    for c in a.snapshot().transport.connections
                    if c.peer == b.instance_id and c.outbound
                ]
                return call.done() or to_b == ["handshaking"]

            await poll_until(only_the_dial_is_left, "the old connection ends", timeout=20)
            assert not call.done(), call.exception()
        finally:
            holding.close()
        async with open_node(credentials_b, host="127.0.0.1", port=port) as moved:
            moved.register_handler("who", lambda ctx: b"moved")
            assert await call == b"moved"


async def test_adding_a_known_peer_at_the_same_address_keeps_its_connection(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        await a.connect(b.instance_id)
        a.add_peer(b.instance_id, b.address, "renamed")
        connection = a.snapshot().transport.to(b.instance_id)
        assert connection is not None and connection.state == "established"
        assert isinstance(a.peers.get(b.instance_id), PeerRecord)
