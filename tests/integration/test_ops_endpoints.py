"""The operations endpoints over real HTTP on loopback: /metrics, /healthz, /readyz.

A raw asyncio client speaks to the listener, so each test sees exactly the bytes a
scraper or a probe would, malformed requests and slow clients included.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
from collections.abc import Callable

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from velomux_quic import (
    ConfigurationError,
    Node,
    NodeCredentials,
    OpsConfig,
    UsageError,
    open_node,
)

MakeCredentials = Callable[..., NodeCredentials]
Response = tuple[int, dict[str, str], bytes]


async def request(
    address: tuple[str, int],
    path: str,
    *,
    method: str = "GET",
    headers: dict[str, str] | None = None,
    raw: bytes | None = None,
) -> Response:
    """One HTTP/1.1 request on a new connection; the status, headers and body read to EOF."""
    reader, writer = await asyncio.open_connection(*address)
    try:
        if raw is None:
            lines = [f"{method} {path} HTTP/1.1", f"Host: {address[0]}"]
            lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
            raw = ("\r\n".join(lines) + "\r\n\r\n").encode()
        writer.write(raw)
        await writer.drain()
        async with asyncio.timeout(10):
            return parse_response(await reader.read())
    finally:
        writer.close()
        await writer.wait_closed()


def parse_response(data: bytes) -> Response:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, code, _ = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    assert headers["connection"] == "close"
    return int(code), headers, body


async def stream_some(producer: Node, consumer: Node, count: int = 32) -> None:
    """Stream ``count`` tokens, read after the last send: ``count`` must fit the credit window."""
    anchor = consumer.create_anchor()
    sender = await producer.attach_anchor(anchor.handle)
    for token in range(count):
        await sender.send(token)
    await sender.finalize()
    assert [item async for item in anchor] == list(range(count))


async def test_metrics_parse_and_include_the_mux_series_after_a_stream(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        address = await a.serve_ops()
        assert a.ops_address == address
        await stream_some(a, b)
        code, headers, body = await request(address, "/metrics")
        assert code == 200
        assert headers["content-type"].startswith("text/plain")
        assert int(headers["content-length"]) == len(body)
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        batches = families["velo_streaming_mux_batches"]
        assert sum(sample.value for sample in batches.samples) > 0
        head_code, head_headers, head_body = await request(address, "/metrics", method="HEAD")
        assert head_code == 200 and head_body == b""
        assert int(head_headers["content-length"]) > 0


async def test_metrics_negotiate_openmetrics_and_gzip(make_credentials: MakeCredentials) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops()
        code, headers, body = await request(
            address,
            "/metrics",
            headers={"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"},
        )
        assert code == 200
        assert headers["content-type"].startswith("application/openmetrics-text")
        assert body.endswith(b"# EOF\n")
        names = {family.name for family in openmetrics_families(body.decode())}
        assert "velo_ops_requests" in names
        code, headers, body = await request(
            address, "/metrics", headers={"Accept-Encoding": "gzip, deflate"}
        )
        assert code == 200 and headers["content-encoding"] == "gzip"
        text = gzip.decompress(body).decode()
        assert any(f.name == "velo_ops_requests" for f in text_string_to_metric_families(text))


async def test_healthz_says_the_process_is_up(make_credentials: MakeCredentials) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops()
        code, headers, body = await request(address, "/healthz")
        assert code == 200 and headers["content-type"] == "application/json"
        answer = json.loads(body)
        assert answer["status"] == "up"
        assert answer["instance_id"] == str(a.instance_id)


async def test_readyz_is_503_naming_the_peer_then_200_once_it_is_reachable(
    make_credentials: MakeCredentials,
) -> None:
    b_credentials = make_credentials("b")
    first_b = await Node.start(b_credentials)
    b_record, b_port = first_b.record, first_b.address[1]
    await first_b.close()  # b is configured but down
    async with open_node(make_credentials("a"), peers=[b_record]) as a:
        address = await a.serve_ops(config=OpsConfig(readiness_timeout=0.5))
        code, _, body = await request(address, "/readyz")
        assert code == 503
        answer = json.loads(body)
        assert answer["status"] == "not ready"
        assert answer["not_ready"] == [f"peer {b_record.instance_id}"]
        assert answer["checks"]["endpoint"] == "ok"
        async with open_node(b_credentials, port=b_port):
            for _ in range(20):  # each round is one bounded health check, not a sleep
                code, _, body = await request(address, "/readyz")
                if code == 200:
                    break
            assert code == 200, body
            answer = json.loads(body)
            assert answer["status"] == "ready" and answer["not_ready"] == []
            assert answer["checks"]["peers"] == {str(b_record.instance_id): "ok"}


async def test_unknown_paths_are_404_and_other_methods_405(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops()
        code, _, body = await request(address, "/nope")
        assert code == 404 and "/metrics" in json.loads(body)["paths"]
        code, headers, _ = await request(address, "/metrics", method="POST")
        assert code == 405 and headers["allow"] == "GET, HEAD"
        code, _, _ = await request(address, "/", raw=b"GARBAGE\r\n\r\n")
        assert code == 400
        code, _, _ = await request(address, "/", raw=b"GET /metrics HTTP/2.0\r\n\r\n")
        assert code == 505


async def test_an_oversized_request_head_is_refused_with_431(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops(config=OpsConfig(max_request_bytes=1024))
        huge = b"GET /metrics HTTP/1.1\r\nX-Filler: " + b"x" * 4096 + b"\r\n\r\n"
        code, _, _ = await request(address, "/", raw=huge)
        assert code == 431
        families = {f.name: f for f in text_string_to_metric_families(a.metrics_text())}
        rejected = {s.labels["reason"]: s.value for s in families["velo_ops_rejected"].samples}
        assert rejected.get("too_large") == 1


async def test_a_slow_client_times_out_without_holding_up_a_scrape(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops(config=OpsConfig(read_timeout=0.5))
        reader, writer = await asyncio.open_connection(*address)
        try:
            writer.write(b"GET /metr")  # and never the rest
            await writer.drain()
            code, _, _ = await request(address, "/metrics")
            assert code == 200  # served while the slow client still holds its connection
            async with asyncio.timeout(10):
                code, _, body = parse_response(await reader.read())
            assert code == 408 and "in time" in json.loads(body)["error"]
        finally:
            writer.close()
            await writer.wait_closed()
        families = {f.name: f for f in text_string_to_metric_families(a.metrics_text())}
        rejected = {s.labels["reason"]: s.value for s in families["velo_ops_rejected"].samples}
        assert rejected.get("timeout") == 1


async def test_connections_beyond_the_bound_are_answered_503(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("a")) as a:
        address = await a.serve_ops(config=OpsConfig(max_connections=1, read_timeout=5))
        reader, writer = await asyncio.open_connection(*address)
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\n")  # holds the one slot
            await writer.drain()
            for _ in range(50):  # until the listener has accepted the holder
                if _gauge(a, "velo_ops_connections") >= 1:
                    break
                await asyncio.sleep(0.01)
            code, _, body = await request(address, "/healthz")
            assert code == 503 and "too many" in json.loads(body)["error"]
            writer.write(b"\r\n")
            await writer.drain()
            async with asyncio.timeout(10):
                code, _, _ = parse_response(await reader.read())
            assert code == 200
        finally:
            writer.close()
            await writer.wait_closed()


def _gauge(node: Node, name: str) -> float:
    for family in text_string_to_metric_families(node.metrics_text()):
        if family.name == name:
            return sum(sample.value for sample in family.samples)
    return 0.0


async def test_closing_the_node_closes_the_listener_and_its_connections(
    make_credentials: MakeCredentials,
) -> None:
    before = asyncio.all_tasks()
    node = await Node.start(make_credentials("a"))
    try:
        address = await node.serve_ops()
        reader, writer = await asyncio.open_connection(*address)
        writer.write(b"GET /metrics HTTP/1.1\r\n")  # a connection left open
        await writer.drain()
        with pytest.raises(UsageError):
            await node.serve_ops()
    finally:
        await node.close()
    # The held connection was ended: EOF, or a reset for its unread bytes.
    async with asyncio.timeout(10):
        with contextlib.suppress(ConnectionResetError):
            assert await reader.read() == b""
        writer.close()
        with contextlib.suppress(ConnectionResetError):
            await writer.wait_closed()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection(*address)
    left = {task for task in asyncio.all_tasks() - before if task is not asyncio.current_task()}
    assert not left, left
    with pytest.raises(UsageError):
        await node.serve_ops()


async def test_an_address_in_use_is_a_configuration_error(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("a")) as a, open_node(make_credentials("b")) as b:
        host, port = await a.serve_ops()
        with pytest.raises(ConfigurationError, match="choose a free local address"):
            await b.serve_ops(host, port)
        assert b.ops_address is None
        assert await b.serve_ops() != (host, port)  # the refused attempt left nothing behind
    with pytest.raises(ConfigurationError, match="max_connections"):
        OpsConfig(max_connections=0)
