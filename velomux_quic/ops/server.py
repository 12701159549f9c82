"""The operations endpoints of a node: ``/metrics``, ``/healthz`` and ``/readyz`` over HTTP.

A node serves them when asked (:meth:`velomux_quic.Node.serve_ops`; off by default in the
library). The listener is a deliberately small HTTP/1.1 server on the node's own asyncio
loop, with no dependency beyond prometheus-client: a scraper or a load balancer's probe
needs one GET per connection, so the server reads one request line and its headers
(bounded in size and in time), answers, and closes (``Connection: close``). What a client
can make it hold is bounded: ``max_request_bytes`` of request head, ``read_timeout``
seconds to send it, ``max_connections`` at once (the next is answered 503 and closed).

``/metrics`` is the node's registry through prometheus-client's own exposition and
content negotiation (the text format, or OpenMetrics when the Accept header asks for it),
gzip-compressed when the client accepts gzip. ``/healthz`` says the process is up.
``/readyz`` answers what :class:`~.readiness.PeerReadiness` finds (whether the node can
do its job). Both answer a small JSON body a person can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import CollectorRegistry

from ..errors import ConfigurationError, UsageError
from .config import OpsConfig
from .readiness import ReadinessReport

__all__ = ["OpsServer"]

logger = logging.getLogger(__name__)

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
    505: "HTTP Version Not Supported",
}
_PATHS = ("/metrics", "/healthz", "/readyz")


class _OpsMetrics:
    """The listener's own series, in the node's registry: a metric per failure mode."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "velo_ops_requests_total",
            "Operations-endpoint requests answered, by path and status code",
            ["path", "code"],
            registry=registry,
        )
        self.rejected = Counter(
            "velo_ops_rejected_total",
            "Operations-endpoint connections refused before a path was served, by reason "
            "(timeout, too_large, malformed, busy, version)",
            ["reason"],
            registry=registry,
        )
        self.connections = Gauge(
            "velo_ops_connections",
            "Operations-endpoint connections open now",
            registry=registry,
        )
        self._registry = registry

    def unregister(self) -> None:
        """Remove the series again (a listener that never started leaves none behind)."""
        for collector in (self.requests, self.rejected, self.connections):
            with contextlib.suppress(KeyError):
                self._registry.unregister(collector)


class _BadRequest(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _Request:
    method: str
    path: str
    headers: dict[str, str]


class OpsServer:
    """The HTTP listener of one node's operations endpoints (see the module docstring).

    Build it with the node's registry and a readiness evaluation, :meth:`start` it on
    an address, :meth:`close` it with the node: close stops listening, ends every
    connection still open and leaves no task behind.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: Callable[[], Awaitable[ReadinessReport]],
        *,
        config: OpsConfig | None = None,
        identity: dict[str, Any] | None = None,
    ) -> None:
        self._registry = registry
        self._readiness = readiness
        self.config = config or OpsConfig()
        self._identity = dict(identity or {})
        self._metrics = _OpsMetrics(registry)
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._active = 0
        self._closing = False
        self._started_at = time.monotonic()
        self._address: tuple[str, int] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The (host, port) the listener is bound to."""
        if self._address is None:
            raise UsageError("the operations listener is not started")
        return self._address

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on ``host:port`` (port 0: any free port) and return the bound address.

        Raises :class:`~velomux_quic.errors.ConfigurationError` when the address cannot
        be bound (in use, not local), naming it.
        """
        if self._server is not None:
            raise UsageError("the operations listener is already started")
        try:
            self._server = await asyncio.start_server(
                self._accept, host, port, limit=self.config.max_request_bytes
            )
        except OSError as error:
            self._metrics.unregister()
            raise ConfigurationError(
                f"cannot listen for operations endpoints on {host}:{port}: {error}; "
                "choose a free local address"
            ) from error
        sockname = self._server.sockets[0].getsockname()
        self._address = (str(sockname[0]), int(sockname[1]))
        self._started_at = time.monotonic()
        return self._address

    async def close(self) -> None:
        """Stop listening and end every open connection; closing twice is harmless."""
        self._closing = True
        server, self._server = self._server, None
        if server is not None:
            server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    # -- one connection --------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        busy = self._active >= self.config.max_connections
        self._active += 0 if busy else 1
        self._metrics.connections.inc()
        try:
            if busy:
                self._metrics.rejected.labels("busy").inc()
                await self._finish(
                    reader, writer, 503, {"error": "too many connections; retry later"}
                )
            else:
                await self._serve(reader, writer)
        except asyncio.CancelledError:
            writer.close()
            if not self._closing:
                raise
            # close() ended this connection: finish quietly (asyncio logs a cancelled
            # connection task as an error on 3.11).
        except Exception:
            logger.warning("operations endpoint failed", exc_info=True)
            writer.close()
        finally:
            self._active -= 0 if busy else 1
            self._metrics.connections.dec()
            self._tasks.discard(task)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.config.read_timeout):
                head = await reader.readuntil(b"\r\n\r\n")
            request = _parse(head)
        except TimeoutError:
            self._metrics.rejected.labels("timeout").inc()
            await self._finish(reader, writer, 408, {"error": "request head not received in time"})
            return
        except asyncio.LimitOverrunError:
            self._metrics.rejected.labels("too_large").inc()
            limit = self.config.max_request_bytes
            await self._finish(
                reader, writer, 431, {"error": f"request head larger than {limit} bytes"}
            )
            return
        except asyncio.IncompleteReadError:
            self._metrics.rejected.labels("malformed").inc()
            writer.close()
            await _closed(writer)
            return
        except _BadRequest as bad:
            self._metrics.rejected.labels(bad.reason).inc()
            await self._finish(reader, writer, bad.code, {"error": str(bad)})
            return
        code, body, content_type, extra = await self._answer(request)
        self._metrics.requests.labels(
            request.path if request.path in _PATHS else "other", str(code)
        ).inc()
        await self._write(
            reader, writer, code, body, content_type, extra, head_only=request.method == "HEAD"
        )

    async def _answer(self, request: _Request) -> tuple[int, bytes, str, dict[str, str]]:
        if request.path not in _PATHS:
            return _json(404, {"error": f"no such path {request.path!r}", "paths": list(_PATHS)})
        if request.method not in ("GET", "HEAD"):
            code, body, kind, _ = _json(405, {"error": f"{request.method} not allowed; use GET"})
            return code, body, kind, {"Allow": "GET, HEAD"}
        if request.path == "/metrics":
            encoder, content_type = choose_encoder(request.headers.get("accept", ""))
            output = encoder(self._registry)
            encoding: dict[str, str] = {}
            if "gzip" in request.headers.get("accept-encoding", ""):
                output = gzip.compress(output, compresslevel=1)
                encoding["Content-Encoding"] = "gzip"
            return 200, output, content_type, encoding
        if request.path == "/healthz":
            return _json(
                200,
                {
                    "status": "up",
                    "uptime_seconds": round(time.monotonic() - self._started_at, 3),
                    **self._identity,
                },
            )
        report = await self._readiness()
        return _json(200 if report.ready else 503, {**report.to_json(), **self._identity})

    async def _finish(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        code: int,
        body: dict[str, Any],
    ) -> None:
        status, payload, kind, extra = _json(code, body)
        await self._write(reader, writer, status, payload, kind, extra, head_only=False)

    async def _write(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        code: int,
        body: bytes,
        content_type: str,
        extra: dict[str, str],
        *,
        head_only: bool,
    ) -> None:
        lines = [
            f"HTTP/1.1 {code} {_REASONS.get(code, 'Unknown')}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in extra.items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        try:
            async with asyncio.timeout(self.config.read_timeout):
                await writer.drain()
        except (TimeoutError, ConnectionError):
            self._metrics.rejected.labels("timeout").inc()
        finally:
            await _linger(writer, reader)
            writer.close()
            await _closed(writer)


async def _linger(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> None:
    """Half-close and read what the client still sends, briefly, before closing: closing
    with unread bytes makes the kernel answer RST, and a client then loses the response
    (a 503 or 431 sent before its request was read). Bounded: 64 KiB, half a second."""
    if writer.is_closing():
        return
    with contextlib.suppress(ConnectionError, TimeoutError, OSError, RuntimeError):
        if writer.can_write_eof():
            writer.write_eof()
        async with asyncio.timeout(0.5):
            for _ in range(16):
                if not await reader.read(4096):
                    break


async def _closed(writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, TimeoutError):
        async with asyncio.timeout(1.0):
            await writer.wait_closed()


def _json(code: int, body: dict[str, Any]) -> tuple[int, bytes, str, dict[str, str]]:
    return code, (json.dumps(body, indent=2) + "\n").encode(), "application/json", {}


def _parse(head: bytes) -> _Request:
    """A strict parse of an HTTP/1.x request line and headers (no body is read)."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError as error:
        raise _BadRequest(400, "malformed", "request head is not ASCII") from error
    lines = text[:-4].split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1].startswith("/"):
        raise _BadRequest(400, "malformed", "malformed request line; send 'GET /metrics HTTP/1.1'")
    method, target, version = parts
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _BadRequest(505, "version", f"{version!r} is not supported; use HTTP/1.1")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or " " in name:
            raise _BadRequest(400, "malformed", f"malformed header line {line[:40]!r}")
        headers[name.lower()] = value.strip()
    return _Request(method=method, path=target.split("?", 1)[0], headers=headers)
