"""The endpoint's own packets on a real socket: Version Negotiation, Retry, malformed."""

from __future__ import annotations

import asyncio
import socket

from tests.conftest import NodeFactory
from tests.polling import poll_until
from velomux_quic.transport.config import TransportConfig
from velomux_quic.transport.packets import (
    MIN_INITIAL_DATAGRAM,
    PacketType,
    parse_long_header,
)

CLIENT_CID = b"client-cid"
CHOSEN_CID = b"chosen-cid-00001"


def initial(version: int, token: bytes = b"", destination: bytes = CHOSEN_CID) -> bytes:
    """A long-header Initial whose protected part is padding: enough for the endpoint."""
    header = (
        bytes((0xC3,))
        + version.to_bytes(4, "big")
        + bytes((len(destination),))
        + destination
        + bytes((len(CLIENT_CID),))
        + CLIENT_CID
        + bytes((len(token),))  # a one-byte length: tokens here are under 64 bytes
        + token
    )
    rest = MIN_INITIAL_DATAGRAM - len(header) - 2
    return header + (0x4000 | rest).to_bytes(2, "big") + bytes(rest)


class Answers(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.received: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        self.received.put_nowait(data)


async def test_an_unknown_version_is_answered_with_the_versions_spoken(
    start_node: NodeFactory,
) -> None:
    node, _ = await start_node("node")
    loop = asyncio.get_running_loop()
    udp, answers = await loop.create_datagram_endpoint(
        Answers, local_addr=("127.0.0.1", 0), family=socket.AF_INET
    )
    try:
        udp.sendto(initial(0x1A2A3A4A), node.address)
        answer = await asyncio.wait_for(answers.received.get(), 5)
        header = parse_long_header(answer)
        assert header.packet_type is PacketType.VERSION_NEGOTIATION
        assert (header.destination_cid, header.source_cid) == (CLIENT_CID, CHOSEN_CID)
        listed = [int.from_bytes(answer[i : i + 4], "big") for i in range(len(answer) - 4, 0, -4)]
        assert 1 in listed

        udp.sendto(bytes((0xC0,)) + bytes(4), node.address)  # ends inside its header
        udp.sendto(initial(1, token=b"not a token of this node"), node.address)
        await poll_until(lambda: node.stats.rejections["invalid_retry_token"] == 1)
        assert node.stats.rejections["malformed_datagram"] == 1
        assert node.snapshot().connections == ()
    finally:
        udp.close()


async def test_past_the_retry_threshold_a_dial_is_answered_with_a_retry(
    start_node: NodeFactory,
) -> None:
    node, _ = await start_node("node", config=TransportConfig(retry_threshold=0))
    loop = asyncio.get_running_loop()
    udp, answers = await loop.create_datagram_endpoint(
        Answers, local_addr=("127.0.0.1", 0), family=socket.AF_INET
    )
    try:
        udp.sendto(initial(1), node.address)
        answer = await asyncio.wait_for(answers.received.get(), 5)
        header = parse_long_header(answer)
        assert header.packet_type is PacketType.RETRY
        assert header.destination_cid == CLIENT_CID
        assert header.token and header.source_cid != CHOSEN_CID
        assert node.stats.rejections["handshake_retry"] == 1
    finally:
        udp.close()
