"""The node as a user holds it: opened with ``async with``, requests, tickets, snapshots.

Everything here is imported from the package root, as a user program would.
"""

from __future__ import annotations

import asyncio
import gc
import os
import warnings
from collections.abc import Callable

import pytest

from velomux_quic import (
    Context,
    HandlerExists,
    HandlerFailed,
    MuxConfig,
    Node,
    NodeCredentials,
    NodeSnapshot,
    PeerRegistry,
    StreamAnchorHandle,
    StreamCancelled,
    StreamOpenTicket,
    TicketError,
    UnknownHandler,
    VelomuxError,
    open_node,
)

MakeCredentials = Callable[..., NodeCredentials]


async def test_open_node_starts_a_node_for_the_block_and_closes_it_after(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("b")) as b:
        assert isinstance(b, Node)
        async with Node.open(make_credentials("a"), peers=[b.record]) as a:
            anchor = b.create_anchor()
            sender = await a.attach_anchor(anchor.handle)
            await sender.send({"token": 1})
            await sender.finalize()
            assert [item async for item in anchor] == [{"token": 1}]
        late = b.create_anchor()
        with pytest.raises(VelomuxError):  # the closed node refuses
            await a.attach_anchor(late.handle)
    await b.close()  # closing again is harmless


async def test_open_node_starts_nothing_until_the_block_is_entered(
    make_credentials: MakeCredentials,
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opening = open_node(make_credentials("never"))
        del opening
        gc.collect()
    # No start coroutine was made, so none is left unawaited (and no port was bound).
    assert [w for w in caught if issubclass(w.category, RuntimeWarning)] == []


async def test_peers_take_records_or_a_registry_and_record_says_where_a_node_listens(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("b"), name="engine-1") as b:
        record = b.record
        assert (record.instance_id, record.address, record.name) == (
            b.instance_id,
            b.address,
            "engine-1",
        )
        shared = PeerRegistry([record])
        async with open_node(make_credentials("a"), peers=shared) as a:
            assert [p.instance_id for p in shared] == [b.instance_id]
            anchor = b.create_anchor()
            sender = await a.attach_anchor(anchor.handle)
            await sender.finalize()
            assert [item async for item in anchor] == []


async def test_a_request_carries_a_ticket_and_the_engine_answers_with_a_stream(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("engine")) as engine,
        open_node(make_credentials("frontend"), peers=[engine.record]) as frontend,
    ):
        engine.add_peer(frontend.instance_id, frontend.address)
        seen: list[tuple[object, str]] = []

        async def generate(ctx: Context) -> bytes:
            seen.append((ctx.sender, ctx.handler))
            handle_hex, ticket_hex = bytes(ctx.payload).decode().split()
            handle = StreamAnchorHandle(int(handle_hex, 16))
            sender = await engine.open_anchor_stream(
                handle, StreamOpenTicket.decode(bytes.fromhex(ticket_hex))
            )
            for index in range(5):
                await sender.send(index)
            await sender.finalize()
            return b"done"

        engine.register_handler("generate", generate, dispatch="spawn")
        anchor = frontend.create_anchor()
        ticket = frontend.prebind_anchor(anchor.handle)
        payload = f"{anchor.handle.value:x} {ticket.encode().hex()}".encode()

        async def read() -> list[object]:
            return [item async for item in anchor]

        reply, items = await asyncio.wait_for(
            asyncio.gather(frontend.call(engine.instance_id, "generate", payload), read()), 30
        )
        assert (reply, items) == (b"done", [0, 1, 2, 3, 4])
        assert seen == [(frontend.instance_id, "generate")]


async def test_fire_and_forget_reaches_a_sync_handler_and_a_failing_one_is_reported(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
    ):
        arrived = asyncio.Event()
        payloads: list[bytes] = []

        def note(ctx: Context) -> None:
            payloads.append(bytes(ctx.payload))
            arrived.set()

        def broken(ctx: Context) -> bytes:
            raise RuntimeError("no model loaded")

        b.register_handler("note", note)
        b.register_handler("broken", broken)
        await a.send_message(b.instance_id, "note", b"hello")
        await asyncio.wait_for(arrived.wait(), 20)
        assert payloads == [b"hello"]
        with pytest.raises(HandlerFailed) as failed:
            await a.call(b.instance_id, "broken", timeout=20)
        assert "no model loaded" in failed.value.remote_message
        with pytest.raises(UnknownHandler):
            await a.call(b.instance_id, "missing", timeout=20)


async def test_handler_names_are_unique_and_underscore_names_are_reserved(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("b")) as b:
        b.register_handler("ping", lambda ctx: b"pong")
        with pytest.raises(HandlerExists):
            b.register_handler("ping", lambda ctx: b"again")
        with pytest.raises(HandlerExists, match="reserved"):
            b.register_handler("_anchor_attach", lambda ctx: None)


async def test_prebind_raises_a_ticket_error_that_says_what_to_do(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("plain"), mux=MuxConfig(enabled=False)) as plain,
    ):
        anchor = b.create_anchor()
        b.prebind_anchor(anchor.handle)
        with pytest.raises(TicketError, match="already pre-bound: hand out the ticket"):
            b.prebind_anchor(anchor.handle)
        with pytest.raises(TicketError, match="attach_mpsc_anchor"):
            b.prebind_anchor(b.create_mpsc_anchor(max_senders=2).handle)
        with pytest.raises(TicketError, match="mux enabled, or let the producer attach_anchor"):
            plain.prebind_anchor(plain.create_anchor().handle)


async def test_snapshot_reports_the_node_and_each_of_its_layers(
    make_credentials: MakeCredentials,
) -> None:
    async with (
        open_node(make_credentials("b")) as b,
        open_node(make_credentials("a"), peers=[b.record]) as a,
        open_node(make_credentials("plain"), mux=MuxConfig(enabled=False)) as plain,
    ):
        anchor = b.create_anchor()
        sender = await a.attach_anchor(anchor.handle)
        await sender.send("first")
        assert await anchor.next(timeout=20) == "first"
        snapshot = a.snapshot()
        assert isinstance(snapshot, NodeSnapshot)
        assert (snapshot.instance_id, snapshot.worker_id, snapshot.address) == (
            a.instance_id,
            a.worker_id,
            a.address,
        )
        assert [p.instance_id for p in snapshot.peers] == [b.instance_id]
        # Each layer reports the one live stream from its own side.
        (mine,) = snapshot.streaming.senders
        assert (mine.handle, mine.state, mine.target) == (anchor.handle, "open", b.instance_id)
        assert mine.lane == sender.lane == 0
        (connection,) = [c for c in snapshot.transport.connections if c.outbound]
        # Lane 0 carries the stream's batches, CONTROL_LANE (15) the attach.
        assert connection.peer == b.instance_id and connection.open_lanes == (0, 15)
        assert snapshot.mux is not None and snapshot.mux.egress_slots(b.instance_id) == 1
        consumer = b.snapshot()
        (bound,) = consumer.streaming.bound_senders
        assert (bound.handle, bound.node) == (anchor.handle, a.instance_id)
        assert consumer.mux is not None
        assert consumer.mux.ingress_slots(a.instance_id) == {0: 1}
        assert "_anchor_attach" in consumer.messenger.handlers
        assert plain.snapshot().mux is None
        # Which twin of the record path runs: compiled, unless VELOMUX_PURE_PYTHON=1 chose
        # the pure one (the same answer as `velomux --version`).
        pure = os.environ.get("VELOMUX_PURE_PYTHON", "") == "1"
        assert snapshot.record_path == ("pure-python" if pure else "compiled")
        with pytest.raises(AttributeError):
            snapshot.peers = ()  # type: ignore[misc]  # frozen
        await sender.finalize()
        assert [item async for item in anchor] == []
        assert a.snapshot().streaming.senders == ()


async def test_a_node_that_closes_ends_its_open_anchors_as_cancelled_not_complete(
    make_credentials: MakeCredentials,
) -> None:
    async with open_node(make_credentials("b")) as b:
        anchor = b.create_anchor()
        async with open_node(make_credentials("a"), peers=[b.record]) as a:
            sender = await a.attach_anchor(anchor.handle)
            await sender.send("before")
            assert await anchor.next(timeout=20) == "before"
            await b.close()  # the consumer's own node goes first: the stream is cut
        with pytest.raises(StreamCancelled):
            await anchor.next(timeout=20)
