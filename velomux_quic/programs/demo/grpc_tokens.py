"""The token workload on grpc.aio, as a Python user would wire it: the gRPC arm of
``velomux demo --compare`` and of ``perf/tokens.py``.

grpc.aio, one server-streaming RPC per request on one channel per frontend: the frontend
asks (``Stream(request)`` carrying the stream's index) and the engine, the gRPC server,
streams that request's tokens back. No protobuf code generation: the method is registered
with ``grpc.method_handlers_generic_handler`` and ``grpc.unary_stream_rpc_method_handler``
without serializers, so requests and responses are the raw bytes (identity), and every
response is the same MessagePack token the QUIC arms of the same program send, decoded and
checked the same way by the frontend.

The engine side is the shape of an LLM server on grpc.aio: the decode loop puts each
request's token on that request's ``asyncio.Queue`` and the RPC's handler, an async
generator, yields what its queue holds. The queue is bounded (``QUEUE_TOKENS``) so that the
engine's ``await queue.put`` is the backpressure, as ``await sender.send`` is on the QUIC
arms; the bound is of the order of a QUIC stream's window so neither side waits earlier.

Security: by default both ends use TLS with the same node certificates as the QUIC arms
(``ssl_server_credentials(require_client_auth=True)`` and ``ssl_channel_credentials`` with
the client's certificate): both sides verified against the cluster CA and the traffic
encrypted, like the QUIC arms' mutual TLS. gRPC checks the chain and the server's address
(the certificates carry the 127.0.0.1 IP SAN) but not the SPIFFE identity the QUIC nodes
check. ``insecure=True`` gives plaintext HTTP/2 instead.

grpc is imported here only, so the QUIC processes of the demo and the benchmark never load
it; importing this module needs the ``demo`` (or ``perf``) extra.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import msgpack  # type: ignore[import-untyped]

__all__ = ["METHOD_PATH", "QUEUE_TOKENS", "TokenClient", "TokenServer"]

SERVICE = "velomux.bench.Tokens"
METHOD = "Stream"
METHOD_PATH = f"/{SERVICE}/{METHOD}"

QUEUE_TOKENS = 1024
"""Tokens one request's queue holds before the engine's ``put`` waits: 48 KiB of tokens,
the order of a per-stream QUIC stream's 64 KiB window (the mux lets a slot queue up to
1 MiB). At the benchmark's pass counts no arm's engine waits at max rate unless its
consumer falls that far behind."""

_HOST = "127.0.0.1"


def _read(directory: Path, name: str) -> bytes:
    return (directory / name).read_bytes()


def server_credentials(node: Path) -> grpc.ServerCredentials:
    """TLS for the engine's server, requiring and verifying a client certificate."""
    return grpc.ssl_server_credentials(
        [(_read(node, "node.key"), _read(node, "node.pem"))],
        root_certificates=_read(node, "ca.pem"),
        require_client_auth=True,
    )


def channel_credentials(node: Path) -> grpc.ChannelCredentials:
    """TLS for a frontend's channel, presenting its own certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(node, "ca.pem"),
        private_key=_read(node, "node.key"),
        certificate_chain=_read(node, "node.pem"),
    )


Emit = Callable[[Any], Awaitable[None]]


class TokenServer:
    """The engine's end: a grpc.aio server whose handler streams one request's tokens."""

    def __init__(self, streams: int, queue_tokens: int = QUEUE_TOKENS) -> None:
        self.streams = streams
        self._queue_tokens = queue_tokens
        self._queues: list[asyncio.Queue[bytes | None] | None] = [None] * streams
        self._registered = 0
        self._first_at: float | None = None
        self._all_registered = asyncio.Event()
        self._ended = 0
        self._all_ended = asyncio.Event()
        self._cancelled = 0
        self._server: grpc.aio.Server | None = None

    async def start(self, credentials: Path | None) -> int:
        """Listen on loopback (TLS with ``credentials``' certificates, else plaintext); the
        port."""
        handler = grpc.method_handlers_generic_handler(
            SERVICE, {METHOD: grpc.unary_stream_rpc_method_handler(self._stream)}
        )
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((handler,))
        address = f"{_HOST}:0"
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, server_credentials(credentials))
        await server.start()
        self._server = server
        return int(port)

    async def _stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        """One request: register its queue, then yield its tokens until the end marker."""
        index = int.from_bytes(request, "big") if len(request) == 4 else -1
        if not 0 <= index < self.streams or self._queues[index] is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad stream {index}")
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(self._queue_tokens)
        self._queues[index] = queue
        context.add_done_callback(self._rpc_done)
        if self._first_at is None:
            self._first_at = time.perf_counter()
        self._registered += 1
        if self._registered == self.streams:
            self._all_registered.set()
        while (message := await queue.get()) is not None:
            yield message

    def _rpc_done(self, context: grpc.aio.ServicerContext) -> None:
        if context.cancelled():
            self._cancelled += 1
        self._ended += 1
        if self._ended == self.streams:
            self._all_ended.set()

    async def wait_attached(self, timeout: float) -> float:
        """Wait until every stream's RPC arrived; seconds from the first to the last."""
        try:
            async with asyncio.timeout(timeout):
                await self._all_registered.wait()
        except TimeoutError:
            raise TimeoutError(
                f"{self._registered} of {self.streams} RPCs arrived within {timeout:g} s"
            ) from None
        assert self._first_at is not None
        return time.perf_counter() - self._first_at

    def emitters(self) -> list[Emit]:
        """Per stream, in index order: encode a token item and put it on its queue (waits
        only while the queue is full)."""
        pack = msgpack.packb

        def emitter(queue: asyncio.Queue[bytes | None]) -> Emit:
            put = queue.put

            def emit(item: Any) -> Awaitable[None]:
                return put(pack(item))

            return emit

        return [emitter(queue) for queue in self._queues if queue is not None]

    async def finish(self, timeout: float) -> None:
        """End every stream (the handler returns, gRPC sends an OK status) and wait until
        each RPC is done on the server; any RPC that was cancelled fails the run."""
        async with asyncio.timeout(timeout):
            for queue in self._queues:
                assert queue is not None
                await queue.put(None)
            await self._all_ended.wait()
        if self._cancelled:
            raise RuntimeError(f"{self._cancelled} of {self.streams} RPCs were cancelled")

    async def stop(self, grace: float = 1.0) -> None:
        if self._server is not None:
            await self._server.stop(grace)


class TokenClient:
    """A frontend's end: one channel to the engine, one RPC per request."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.channel = channel
        self._method = channel.unary_stream(METHOD_PATH)

    @classmethod
    async def open(cls, port: int, credentials: Path | None, timeout: float) -> TokenClient:
        """Connect (TLS with ``credentials``' certificates, else plaintext) and wait until
        the channel is ready, so the handshake is not in any measured window."""
        target = f"{_HOST}:{port}"
        if credentials is None:
            channel = grpc.aio.insecure_channel(target)
        else:
            channel = grpc.aio.secure_channel(target, channel_credentials(credentials))
        try:
            async with asyncio.timeout(timeout):
                await channel.channel_ready()
        except BaseException:
            await channel.close()
            raise
        return cls(channel)

    def call(self, index: int) -> grpc.aio.UnaryStreamCall:
        """Start stream ``index``'s RPC (its tokens come back as raw bytes)."""
        return self._method(index.to_bytes(4, "big"))

    async def close(self) -> None:
        await self.channel.close()
