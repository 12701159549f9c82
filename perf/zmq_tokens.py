"""The ZeroMQ arm of ``perf/tokens.py``: the token workload as a Python engineer would build
it without this library.

pyzmq, PUSH on the engine and PULL on each frontend, over TCP on loopback, authenticated
and encrypted with CURVE both ways: each frontend is a CURVE server with a key pair of its
own (its public key travels in its handoff, as a node's address and identity do), and a
ZAP handler on it admits only the engine's client key (written once per run by
:func:`write_engine_keys`); the engine checks the frontend's server key in the handshake.
That is ZeroMQ's equivalent of the QUIC arms' mutual TLS, with raw keys instead of
certificates.

The data path is the bare arm's packing with ZeroMQ underneath: per pass, every stream's
token (the same 48-byte MessagePack body and clock stamp) goes with the bare arm's 6-byte
header (``bare_tokens.RECORD``) into its frontend's ``bytearray``, and each frontend gets
ONE two-frame multipart message per pass: the pass number, then the records. The frontend
cuts the second frame into per-stream inboxes with the bare arm's ``RecordParser`` and
``Inbox``, so the same readers and the same ``StreamCheck`` run on every arm. The end of
the run is a one-frame ``end`` message.

Memory is bounded as on the other arms: the send high-water mark is set in messages so
that a frontend's queue holds about ``QUEUE_BYTES`` (1 MiB, what one mux lane may queue);
the engine's awaited ``send_multipart`` is the backpressure, and a send that finds the
queue full is counted in ``send_waits``. ZeroMQ gives no per-token delivery signal, so
``finish`` sends the end marker and closing lingers (bounded) until it is written.

zmq is imported here only, so the other arms never load it.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, cast

import zmq
import zmq.asyncio
import zmq.auth
from _harness import BenchFailure
from bare_tokens import RECORD, Inbox, RecordParser, pass_packer, route_streams
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import recv_monitor_message

__all__ = ["QUEUE_BYTES", "TRANSPORT", "ZmqEngine", "ZmqFrontend", "write_engine_keys"]

TRANSPORT = "zmq-push-pull-curve"
"""What the zmq engine reports as its negotiated transport."""

QUEUE_BYTES = 1 << 20
"""About how many bytes of passes one frontend's queue holds before the engine waits."""

END = b"end"
"""The one-frame message that ends a frontend's streams."""

_PASS = struct.Struct("!I")
_HOST = "127.0.0.1"
_LINGER_MS = 5_000
_ENGINE_KEY = "engine"


def write_engine_keys(directory: Path) -> None:
    """Make the engine's CURVE key pair in ``directory`` (``engine.key``, the public half
    every frontend admits, and ``engine.key_secret``)."""
    directory.mkdir(parents=True, exist_ok=True)
    zmq.auth.create_certificates(str(directory), _ENGINE_KEY)


def _high_water_mark(streams_of_frontend: int) -> int:
    """Messages per queue so that one queue holds about QUEUE_BYTES of passes."""
    record = RECORD.size + 48
    return max(2, QUEUE_BYTES // max(1, streams_of_frontend * record))


class Counts:
    """The engine's or a frontend's counters, named like the bare arm's (no datagrams:
    ZeroMQ runs on TCP, so those are not reported)."""

    def __init__(self) -> None:
        self.send_waits = 0
        self.recv_again = 0
        self.writes = 0
        self.records = 0
        self.bytes = 0

    def snapshot(self) -> dict[str, float]:
        return {
            "send_waits": float(self.send_waits),
            "recv_again": float(self.recv_again),
            "writes": float(self.writes),
            "records": float(self.records),
            "bytes": float(self.bytes),
        }


async def _handshake_done(socket: zmq.asyncio.Socket) -> None:
    """Wait until the socket's CURVE handshake succeeded; a failed one is a BenchFailure."""
    monitor = socket.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        while True:
            event = await recv_monitor_message(monitor)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            endpoint = event["endpoint"].decode(errors="replace")
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise BenchFailure(
                    f"the frontend on {endpoint} refused the engine's CURVE key (ZAP status "
                    f"{int(event['value'])}): the frontends admit only the public key in the "
                    "run's engine key directory"
                )
            raise BenchFailure(
                f"the CURVE handshake with {endpoint} failed ({zmq.Event(event['event']).name}): "
                "the frontend's server key in its handoff does not match the socket"
            )
    finally:
        socket.disable_monitor()
        monitor.close(linger=0)


class ZmqEngine:
    """The engine's end: one PUSH socket per frontend, one message per frontend per pass."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        sockets: list[zmq.asyncio.Socket],
        outboxes: list[bytearray],
        targets: list[bytearray],
        owned: list[int],
    ) -> None:
        self._context = context
        self._sockets = sockets
        self._targets = targets
        self._counts = Counts()
        self._writes = list(zip(sockets, outboxes, owned, strict=True))

    @classmethod
    async def connect(
        cls, keys: Path, handoffs: Sequence[dict[str, Any]], streams: int, timeout: float
    ) -> ZmqEngine:
        """Connect to every frontend named in ``handoffs`` (its port, its CURVE server key
        and the global indices of its streams) and wait for every handshake."""
        public, secret = zmq.auth.load_certificate(str(keys / f"{_ENGINE_KEY}.key_secret"))
        if secret is None:
            raise BenchFailure(f"{keys} has no engine secret key")
        outboxes, targets, owned = route_streams(handoffs, streams)
        context = zmq.asyncio.Context()
        sockets: list[zmq.asyncio.Socket] = []
        try:
            for handoff in handoffs:
                socket = context.socket(zmq.PUSH)
                sockets.append(socket)
                socket.curve_publickey = public
                socket.curve_secretkey = secret
                socket.curve_serverkey = handoff["curve_public"].encode()
                socket.sndhwm = _high_water_mark(len(handoff["indices"]))
                socket.linger = _LINGER_MS
                handshake = asyncio.ensure_future(_handshake_done(socket))
                socket.connect(f"tcp://{_HOST}:{int(handoff['port'])}")
                try:
                    async with asyncio.timeout(timeout):
                        await handshake
                except TimeoutError:
                    raise BenchFailure(
                        f"no CURVE handshake with the frontend on port {handoff['port']} "
                        f"within {timeout:g} s"
                    ) from None
        except BaseException:
            for socket in sockets:
                socket.close(linger=0)
            context.term()
            raise
        return cls(context, sockets, outboxes, targets, owned)

    def counts(self) -> dict[str, float]:
        return self._counts.snapshot()

    def pass_body(self) -> Callable[[int], Awaitable[None]]:
        """One forward pass, packed by the bare arm's ``pass_packer``: one message per
        frontend."""
        return pass_packer(self._targets, self._write_pass)

    async def _write_pass(self, pass_: int) -> None:
        counts = self._counts
        number = _PASS.pack(pass_)
        for socket, outbox, records in self._writes:
            if not cast(int, socket.get(zmq.EVENTS)) & zmq.POLLOUT:
                counts.send_waits += 1
            payload = bytes(outbox)
            outbox.clear()
            await socket.send_multipart((number, payload))
            counts.writes += 1
            counts.records += records
            counts.bytes += len(payload)

    async def finish(self) -> None:
        """Send every frontend the end marker (queued behind the passes, in order)."""
        for socket in self._sockets:
            await socket.send(END)

    async def close(self) -> None:
        """Close every socket, lingering (bounded) until what is queued is written."""
        for socket in self._sockets:
            socket.close()
        await asyncio.to_thread(self._context.term)


class ZmqFrontend:
    """A frontend's PULL socket (a CURVE server admitting only the engine's key) and the
    inbox of each of its streams."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        authenticator: AsyncioAuthenticator,
        socket: zmq.asyncio.Socket,
        public: bytes,
        indices: Sequence[int],
        streams: int,
    ) -> None:
        self._context = context
        self._authenticator = authenticator
        self._socket = socket
        self.curve_public = public.decode()
        self._counts = Counts()
        loop = asyncio.get_running_loop()
        self.inboxes = [Inbox(loop) for _ in indices]
        by_index: list[Inbox | None] = [None] * streams
        for index, inbox in zip(indices, self.inboxes, strict=True):
            by_index[index] = inbox
        self._parser = RecordParser(by_index)
        self._reader = asyncio.ensure_future(self._read())
        self._ended = False

    @classmethod
    async def listen(cls, keys: Path, indices: Sequence[int], streams: int) -> ZmqFrontend:
        """Bind a PULL socket on loopback that admits only the engine's CURVE key."""
        context = zmq.asyncio.Context()
        authenticator = AsyncioAuthenticator(context)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=str(keys))
        public, secret = zmq.curve_keypair()
        socket = context.socket(zmq.PULL)
        socket.curve_server = True
        socket.curve_publickey = public
        socket.curve_secretkey = secret
        socket.rcvhwm = _high_water_mark(len(indices))
        socket.linger = 0
        socket.bind(f"tcp://{_HOST}:0")
        return cls(context, authenticator, socket, public, indices, streams)

    @property
    def port(self) -> int:
        endpoint = cast(bytes, self._socket.get(zmq.LAST_ENDPOINT)).decode()
        return int(endpoint.rsplit(":", 1)[1])

    def counts(self) -> dict[str, float]:
        return self._counts.snapshot()

    async def _read(self) -> None:
        counts = self._counts
        feed = self._parser.feed
        try:
            while True:
                try:
                    frames = await self._socket.recv_multipart()
                except zmq.Again:
                    # pyzmq's asyncio socket can wake on its descriptor and find no
                    # message yet (its edge-triggered FD races the non-blocking read):
                    # nothing was taken, so read again. Counted, not hidden.
                    counts.recv_again += 1
                    continue
                if len(frames) == 1 and frames[0] == END:
                    if self._parser.pending:
                        raise BenchFailure("the stream ended inside a record")
                    self._end(None)
                    return
                if len(frames) != 2 or len(frames[0]) != _PASS.size:
                    raise BenchFailure(f"a message of {len(frames)} frames is not a pass")
                counts.writes += 1
                counts.bytes += len(frames[1])
                feed(frames[1])
        except BenchFailure as failure:
            self._end(failure)
        except zmq.ZMQError as exc:
            self._end(BenchFailure(f"the frontend's socket failed: {exc} (errno {exc.errno})"))
            raise
        except asyncio.CancelledError:
            self._end(BenchFailure("the frontend's socket closed while streams were open"))
            raise

    def _end(self, failure: BenchFailure | None) -> None:
        if self._ended:
            return
        self._ended = True
        for inbox in self.inboxes:
            inbox.end(failure)

    async def close(self) -> None:
        """Stop reading and close the socket, the authenticator and the context."""
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, zmq.ZMQError):
            await self._reader
        self._socket.close(linger=0)
        self._authenticator.stop()
        await asyncio.to_thread(self._context.term)
