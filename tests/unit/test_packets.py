"""The endpoint's own packets, without sockets: long headers, Version Negotiation, Retry,
and the routing of a burst of datagrams to connections."""

from __future__ import annotations

import pytest

from velomux_quic.transport.packets import (
    MIN_INITIAL_DATAGRAM,
    PacketType,
    encode_retry,
    encode_version_negotiation,
    parse_long_header,
    retry_integrity_tag,
    runs_by_connection,
)
from velomux_quic.transport.retry_tokens import TOKEN_LIFETIME, RetryTokens

ODCID = bytes.fromhex("8394c8f03e515708")
"""The original destination connection ID of RFC 9001's and RFC 9369's examples."""
VERSION_2 = 0x6B3343CF


@pytest.mark.parametrize(
    ("version", "packet"),
    [
        # RFC 9001 appendix A.4
        (1, "ff000000010008f067a5502a4262b5746f6b656e04a265ba2eff4d829058fb3f0f2496ba"),
        # RFC 9369 appendix A.4
        (VERSION_2, "cf6b3343cf0008f067a5502a4262b5746f6b656ec8646ce8bfe33952d955543665dcc7b6"),
    ],
)
def test_the_retry_integrity_tag_is_the_rfcs_example(version: int, packet: str) -> None:
    data = bytes.fromhex(packet)
    assert retry_integrity_tag(version, ODCID, data[:-16]) == data[-16:]
    header = parse_long_header(data)
    assert header.packet_type is PacketType.RETRY
    assert header.version == version
    assert header.source_cid == bytes.fromhex("f067a5502a4262b5")
    assert header.token == b"token"


@pytest.mark.parametrize("version", [1, VERSION_2])
def test_an_encoded_retry_reads_back_and_carries_its_tag(version: int) -> None:
    data = encode_retry(version, b"S" * 8, b"D" * 5, ODCID, b"a token")
    header = parse_long_header(data)
    assert header.packet_type is PacketType.RETRY
    assert (header.destination_cid, header.source_cid) == (b"D" * 5, b"S" * 8)
    assert header.token == b"a token"
    assert data[-16:] == retry_integrity_tag(version, ODCID, data[:-16])


def test_a_retry_for_an_unknown_version_is_refused() -> None:
    with pytest.raises(ValueError, match="no Retry integrity key"):
        encode_retry(0x0A0A0A0A, b"S", b"D", ODCID, b"t")


def test_an_initial_yields_its_connection_ids_and_token() -> None:
    # RFC 9001 appendix A.2's client Initial header (token empty, payload 1182 bytes)
    data = bytes.fromhex("c000000001088394c8f03e5157080000449e") + bytes(0x049E)
    assert len(data) >= MIN_INITIAL_DATAGRAM
    header = parse_long_header(data)
    assert header.packet_type is PacketType.INITIAL
    assert (header.version, header.destination_cid, header.source_cid) == (1, ODCID, b"")
    assert header.token == b""
    with_token = (
        bytes.fromhex("c3000000010401020304020a0b") + b"\x05hello" + b"\x41\x00" + bytes(256)
    )
    header = parse_long_header(with_token)
    assert header.token == b"hello"
    assert header.source_cid == b"\x0a\x0b"


def test_a_version_negotiation_lists_what_we_speak() -> None:
    data = encode_version_negotiation(b"client", b"chosen", [1, VERSION_2])
    assert data[0] & 0x80
    header = parse_long_header(data)
    assert header.packet_type is PacketType.VERSION_NEGOTIATION
    assert (header.destination_cid, header.source_cid) == (b"client", b"chosen")
    assert data[-8:] == (1).to_bytes(4, "big") + VERSION_2.to_bytes(4, "big")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x40" + bytes(20),  # a short header
        bytes.fromhex("c0000000011500"),  # a destination connection ID of 21 bytes
        bytes.fromhex("c00000000108") + b"1234",  # ends inside the connection ID
        bytes.fromhex("800000000100000000"),  # fixed bit clear
        bytes.fromhex("c00000000100000544"),  # ends inside the token length
        bytes.fromhex("c0000000010000000f") + bytes(3),  # payload truncated
        bytes.fromhex("f00000000100") + bytes(5),  # a Retry shorter than its tag
        bytes.fromhex("80000000000000") + b"\x01\x02",  # a partial version listed
    ],
)
def test_malformed_long_headers_are_refused(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_long_header(data)


ADDRESS = ("127.0.0.1", 4433)


def test_a_retry_token_opens_only_for_its_address_and_connection_id() -> None:
    tokens = RetryTokens()
    token = tokens.issue(ADDRESS, ODCID, b"retry-id", now=100.0)
    assert tokens.check(ADDRESS, b"retry-id", token, now=100.5) == ODCID
    with pytest.raises(ValueError):
        tokens.check(("127.0.0.1", 4434), b"retry-id", token, now=100.5)
    with pytest.raises(ValueError):
        tokens.check(("::1", 4433), b"retry-id", token, now=100.5)
    with pytest.raises(ValueError):
        tokens.check(ADDRESS, b"other-id", token, now=100.5)
    with pytest.raises(ValueError):
        RetryTokens().check(ADDRESS, b"retry-id", token, now=100.5)  # another endpoint's key
    with pytest.raises(ValueError):
        tokens.check(ADDRESS, b"retry-id", token[:-1] + bytes((token[-1] ^ 1,)), now=100.5)
    with pytest.raises(ValueError):
        tokens.check(ADDRESS, b"retry-id", b"short", now=100.5)


def test_a_retry_token_expires() -> None:
    tokens = RetryTokens()
    token = tokens.issue(ADDRESS, ODCID, b"retry-id", now=100.0)
    assert tokens.check(ADDRESS, b"retry-id", token, now=100.0 + TOKEN_LIFETIME) == ODCID
    with pytest.raises(ValueError, match="expired"):
        tokens.check(ADDRESS, b"retry-id", token, now=100.1 + TOKEN_LIFETIME)


def short(cid: bytes, body: bytes = b"x") -> bytes:
    return bytes([0x40]) + cid + body


A_CID, A_OTHER_CID, B_CID, UNKNOWN = b"a" * 8, b"A" * 8, b"b" * 8, b"?" * 8
OWNERS = {A_CID: "a", A_OTHER_CID: "a", B_CID: "b"}


def routed(datagrams: list[bytes]) -> list[tuple[str | None, int]]:
    return [(owner, len(run)) for owner, run in runs_by_connection(datagrams, OWNERS, 8)]


def test_a_burst_of_one_connection_is_one_run_in_order() -> None:
    burst = [short(A_CID, bytes([i])) for i in range(12)] + [short(A_OTHER_CID)]
    ((owner, run),) = runs_by_connection(burst, OWNERS, 8)
    assert owner == "a" and run == burst


def test_another_connection_starts_a_run_and_each_stays_in_order() -> None:
    burst = [short(A_CID), short(A_CID), short(B_CID), short(A_CID)]
    assert routed(burst) == [("a", 2), ("b", 1), ("a", 1)]
    assert [d for _, run in runs_by_connection(burst, OWNERS, 8) for d in run] == burst


def test_long_headers_unknown_ids_and_empty_datagrams_go_alone() -> None:
    long_header = bytes([0xC0]) + b"\x00\x00\x00\x01" + b"rest"
    burst = [short(A_CID), long_header, short(A_CID), short(UNKNOWN), b"", short(A_CID)]
    assert routed(burst) == [("a", 1), (None, 1), ("a", 1), (None, 1), (None, 1), ("a", 1)]


def test_an_empty_burst_has_no_runs() -> None:
    assert runs_by_connection([], OWNERS, 8) == []
