"""An ended stream is freed by its last reference, not left to the cyclic collector.

A frontend opens a stream per request, thousands a second. Each stream's objects on both
nodes (its anchor entry, ingress slot and sender record; its sender's state, channel and
egress slot; a per-stream stream's gate and receiver) refer to one another while it
lives; whatever pair still does once it ended stays in memory until a full collection,
and full collections then walk a heap that grows with the streams (each took tens of
milliseconds at 6,000 new streams a second, stalling both nodes). So every way a stream
opens and ends is checked here, with the collector off, on both record paths: what the
collector finds afterwards must not grow with the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from tests.conftest import StartNode
from velomux_quic.errors import SenderDropped
from velomux_quic.node import Node
from velomux_quic.streaming.control import PER_STREAM_KEY, StreamOpenTicket

STREAMS = 24
"""Streams counted per case; a stream that leaves a cycle leaves at least two objects."""

Opener = Callable[[Node, Node], Awaitable[tuple[Any, Any]]]


async def _attach(engine: Node, frontend: Node) -> tuple[Any, Any]:
    anchor = frontend.create_anchor()
    return anchor, await engine.attach_anchor(anchor.handle)


async def _ticket(engine: Node, frontend: Node) -> tuple[Any, Any]:
    anchor = frontend.create_anchor()
    ticket = StreamOpenTicket.decode(frontend.prebind_anchor(anchor.handle).encode())
    return anchor, await engine.open_anchor_stream(anchor.handle, ticket)


async def _per_stream(engine: Node, frontend: Node) -> tuple[Any, Any]:
    anchor = frontend.create_anchor()
    return anchor, await engine.anchors.attach_anchor(anchor.handle, offer=[PER_STREAM_KEY])


async def _same_node(engine: Node, frontend: Node) -> tuple[Any, Any]:
    anchor = frontend.create_anchor()
    return anchor, await frontend.attach_anchor(anchor.handle)


OPENERS: dict[str, Opener] = {
    "attach": _attach,
    "ticket": _ticket,
    "per-stream": _per_stream,
    "same-node": _same_node,
}


async def _finished(anchor: Any, sender: Any) -> None:
    for token in range(3):
        await sender.send(token)
    await sender.finalize()
    assert [item async for item in anchor] == [0, 1, 2]


async def _cancelled(anchor: Any, sender: Any) -> None:
    await sender.send(0)
    assert await anchor.next() == 0
    anchor.cancel()
    await sender.wait_cancelled()


async def _dropped(anchor: Any, sender: Any) -> None:
    await sender.send(0)
    await sender.aclose()
    assert await anchor.next() == 0
    with pytest.raises(SenderDropped):
        await anchor.next()


ENDS = {"finished": _finished, "cancelled": _cancelled, "dropped": _dropped}


@contextlib.contextmanager
def _cycles_found() -> Iterator[list[object]]:
    """The collector off while the block runs, then what one collection finds in cycles.

    Only the project's own objects are counted by the test: another test's leftovers
    (a failure's traceback that the runner lets go of meanwhile) may be found as well."""
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    found: list[object] = []
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()


@pytest.mark.parametrize("end", list(ENDS))
@pytest.mark.parametrize("opening", list(OPENERS))
async def test_an_ended_stream_leaves_nothing_to_the_cyclic_collector(
    start_nodes: StartNode, opening: str, end: str
) -> None:
    engine = await start_nodes("engine")
    frontend = await start_nodes("frontend")
    engine.add_peer(frontend.instance_id, frontend.address)
    frontend.add_peer(engine.instance_id, engine.address)
    open_stream, end_stream = OPENERS[opening], ENDS[end]

    async def streams(count: int) -> None:
        for _ in range(count):
            anchor, sender = await open_stream(engine, frontend)
            await end_stream(anchor, sender)
        await sender.retired()

    async with asyncio.timeout(60):
        await streams(4)  # the connection, the lanes and the caches the first ones make
        with _cycles_found() as found:
            await streams(STREAMS)
            for _ in range(20):  # the turns that forget what the streams' ends left
                await asyncio.sleep(0)
    ours = Counter(
        type(item).__qualname__
        for item in found
        if type(item).__module__.startswith("velomux_quic")
    )
    assert sum(ours.values()) < STREAMS, f"after {STREAMS} {opening} streams: {ours}"
