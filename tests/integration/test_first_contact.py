"""The mistakes a new user makes first, each answered at the call that made it by a typed
VelomuxError whose message names the fix (and, for the commands, by one line and exit 2).
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import StartNode
from tests.integration.test_node_command import CHECKOUT, COMMAND
from velomux_quic import (
    AttachRefused,
    CallPeerNotRegistered,
    ConfigurationError,
    CredentialsError,
    InstanceId,
    NodeConfig,
    NodeCredentials,
    PeerGone,
    PeerNotRegistered,
    UnaryTimeout,
    UsageError,
    open_node,
)
from velomux_quic.config import PeerEntry
from velomux_quic.node import Node
from velomux_quic.programs.probe import ProbeOptions, probe
from velomux_quic.programs.sink import INFO_HANDLER
from velomux_quic.transport import TransportConfig

pytestmark = pytest.mark.timeout(60)

UUID_TEXT = "123e4567-e89b-42d3-a456-426614174000"


def _taken_udp_port() -> tuple[socket.socket, int]:
    holder = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    holder.bind(("127.0.0.1", 0))
    return holder, int(holder.getsockname()[1])


def _free_udp_port() -> int:
    holder, port = _taken_udp_port()
    holder.close()
    return port


async def test_a_udp_port_already_taken_is_a_configuration_error_naming_it(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    holder, port = _taken_udp_port()
    with holder, pytest.raises(ConfigurationError) as raised:
        await Node.start(make_credentials("a"), port=port)
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message and "another port" in message


@pytest.mark.one_loop
def test_velomux_node_on_a_taken_port_prints_one_line_and_exits_2(
    tmp_path: Path, make_credentials: Callable[..., NodeCredentials]
) -> None:
    make_credentials("a").save(tmp_path / "a")
    holder, port = _taken_udp_port()
    config = tmp_path / "node.toml"
    config.write_text(f'[node]\ncredentials = "{tmp_path / "a"}"\nport = {port}\n')
    with holder:
        result = subprocess.run(
            [*COMMAND, "--config", str(config), "--ops", "off"],
            capture_output=True, text=True, timeout=30, check=False, cwd=CHECKOUT,
        )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "another port" in lines[0]


async def test_a_credentials_path_that_is_a_file_names_the_directory_wanted(
    tmp_path: Path,
) -> None:
    a_file = tmp_path / "node.pem"
    a_file.write_text("not a directory")
    with pytest.raises(CredentialsError) as raised:
        await Node.start(a_file)
    message = str(raised.value)
    assert "is a file, not a credentials directory" in message and "node.json" in message


def test_an_instance_id_made_from_text_names_parse() -> None:
    with pytest.raises(ConfigurationError) as raised:
        InstanceId(UUID_TEXT)  # type: ignore[arg-type]
    assert f"InstanceId.parse('{UUID_TEXT}')" in str(raised.value)
    assert str(InstanceId.parse(UUID_TEXT)) == UUID_TEXT


async def test_add_peer_takes_the_host_port_text_toml_uses(start_nodes: StartNode) -> None:
    node = await start_nodes("a")
    peer = InstanceId.parse(UUID_TEXT)
    node.add_peer(peer, "127.0.0.1:7000", "b")
    assert [r.address for r in node.snapshot().peers if r.instance_id == peer] == [
        ("127.0.0.1", 7000)
    ]
    node.add_peer(peer, "[::1]:7001")
    assert node.messenger.peers.get(peer).address == ("::1", 7001)  # type: ignore[union-attr]
    for wrong in ("127.0.0.1", "127.0.0.1:http", ("127.0.0.1", 0)):
        with pytest.raises(ConfigurationError) as raised:
            node.add_peer(peer, wrong)  # type: ignore[arg-type]
        assert "host:port" in str(raised.value) or "port must be" in str(raised.value)
    with pytest.raises(ConfigurationError) as raised:
        node.add_peer(UUID_TEXT, "127.0.0.1:7000")  # type: ignore[arg-type]
    assert "InstanceId.parse" in str(raised.value)


async def test_open_node_used_without_async_with_says_how(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    opened = open_node(make_credentials("a"))
    with pytest.raises(UsageError) as raised:
        opened.create_anchor()  # type: ignore[attr-defined]
    assert "async with open_node(" in str(raised.value)
    with pytest.raises(UsageError) as raised:
        await opened  # type: ignore[misc]
    assert "await Node.start(" in str(raised.value)
    async with opened as node:  # the same object still opens a node
        assert node.address[1] > 0


async def test_a_node_used_from_another_thread_raises_usage_error(
    start_nodes: StartNode,
) -> None:
    node = await start_nodes("a")
    caught: list[BaseException] = []

    def elsewhere() -> None:
        try:
            node.create_anchor()
        except BaseException as error:
            caught.append(error)
        try:
            asyncio.run(node.call(node.instance_id, "x", timeout=1))
        except BaseException as error:
            caught.append(error)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    await asyncio.get_running_loop().run_in_executor(None, thread.join)
    assert [type(error) for error in caught] == [UsageError, UsageError]
    assert all("run_coroutine_threadsafe" in str(error) for error in caught)
    # The documented handoff works.
    future = asyncio.run_coroutine_threadsafe(asyncio.sleep(0, "ok"), node.loop)
    assert await asyncio.wrap_future(future) == "ok"


@pytest.mark.timeout(60)
def test_a_node_awaited_on_another_loop_of_its_thread_raises_usage_error(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    """The node's thread, but not the node's loop (it is not running): refused, not run."""
    own, other = asyncio.new_event_loop(), asyncio.new_event_loop()
    try:
        node = own.run_until_complete(Node.start(make_credentials("a")))
        try:
            with pytest.raises(UsageError) as raised:
                other.run_until_complete(node.call(node.instance_id, "x", timeout=1))
            assert "another event loop" in str(raised.value)
            # On its own loop the same call passes the check and fails further on (this
            # node is not its own peer).
            with pytest.raises(CallPeerNotRegistered):
                own.run_until_complete(node.call(node.instance_id, "x", timeout=1))
        finally:
            own.run_until_complete(node.close())
    finally:
        other.close()
        own.close()


async def test_a_peer_at_a_wrong_address_names_the_address_tried(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    node = await start_nodes("a", transport=TransportConfig(handshake_timeout=0.5))
    wrong = _free_udp_port()  # nobody listens there
    peer = make_credentials("b").instance_id
    node.add_peer(peer, ("127.0.0.1", wrong))
    with pytest.raises(PeerGone) as raised:
        await node.call(peer, "anything", timeout=10)
    assert f"127.0.0.1:{wrong}" in str(raised.value)


async def test_a_probe_with_a_running_nodes_configuration_names_the_cause(
    tmp_path: Path, start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    shared = make_credentials("a")
    shared.save(tmp_path / "a")
    running = await Node.start(shared)  # the node whose configuration is reused
    try:
        target = await start_nodes("b", peers=[running.record])  # knows a's real address
        target.register_handler(INFO_HANDLER, lambda ctx: b"{}")
        peers = (PeerEntry(str(target.instance_id), f"127.0.0.1:{target.address[1]}"),)
        options = ProbeOptions(streams=1, duration=None, records=1, timeout=1.0)
        # The same port as the running node.
        same_port = NodeConfig(credentials=str(tmp_path / "a"), port=running.address[1])
        with pytest.raises(ConfigurationError) as raised:
            await probe(same_port, str(target.instance_id), options)
        assert "port = 0" in str(raised.value) and "credentials of its own" in str(raised.value)
        # Another port: the target's answers go to the running node.
        other_port = NodeConfig(credentials=str(tmp_path / "a"), port=0, peers=peers)
        with pytest.raises(ConfigurationError) as raised:
            await probe(other_port, str(target.instance_id), options)
        assert "credentials of its own" in str(raised.value)
        assert str(shared.instance_id) in str(raised.value)
    finally:
        await running.close()


def test_instance_id_parse_of_any_text_is_a_configuration_error_showing_the_form() -> None:
    for wrong in ("some text", "{" + UUID_TEXT + "}", UUID_TEXT.replace("-", "")):
        with pytest.raises(ConfigurationError) as raised:
            InstanceId.parse(wrong)
        assert "hyphenated UUID" in str(raised.value) and "node.json" in str(raised.value)
        assert isinstance(raised.value, ValueError)  # what callers caught before


async def test_open_node_under_a_plain_with_says_async_with(
    make_credentials: Callable[..., NodeCredentials],
) -> None:
    with pytest.raises(UsageError) as raised, open_node(make_credentials("a")):  # type: ignore[attr-defined]
        pass
    assert "async with open_node(" in str(raised.value)


async def test_a_call_to_an_unregistered_peer_raises_call_peer_not_registered_naming_the_fix(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    node = await start_nodes("a")
    stranger = make_credentials("b").instance_id
    with pytest.raises(CallPeerNotRegistered) as raised:
        await node.call(stranger, "anything", timeout=5)
    assert isinstance(raised.value, PeerGone)  # what a call raised before
    assert isinstance(raised.value.__cause__, PeerNotRegistered)  # the transport's refusal
    message = str(raised.value)
    assert f"node.add_peer(InstanceId.parse('{stranger}'), 'host:port')" in message
    assert "discovery" in message
    with pytest.raises(PeerNotRegistered) as raised:
        await node.send_message(stranger, "anything")
    assert "add_peer" in str(raised.value)


async def test_an_attach_to_a_peer_at_a_wrong_address_fails_after_one_handshake_naming_it(
    start_nodes: StartNode, make_credentials: Callable[..., NodeCredentials]
) -> None:
    consumer = await start_nodes("b")
    anchor = consumer.create_anchor()
    producer = await start_nodes("a", transport=TransportConfig(handshake_timeout=0.5))
    wrong = _free_udp_port()  # nobody listens there
    producer.add_peer(consumer.instance_id, ("127.0.0.1", wrong))
    with pytest.raises(AttachRefused) as raised:
        await producer.attach_anchor(anchor.handle)
    message = str(raised.value)
    assert f"127.0.0.1:{wrong}" in message and "_anchor_attach" not in message
    assert "add_peer" in message
    # The failed handshake ends the attach: no resend that would wait out attach_timeout.
    assert not isinstance(raised.value.__cause__, UnaryTimeout), message
    anchor.cancel()
