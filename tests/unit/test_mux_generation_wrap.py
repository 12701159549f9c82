"""Generation wrap, sans-IO, with the real egress batcher and ingress table on one wire.

One stream's close arrives while one of its records is still in flight (the way a staged
singleton resolves outside the ordered lane), so its slot waits aside; then 300 streams
open and close on the same index (the free list is LIFO), so the 8-bit generation wraps
onto the id of the slot waiting aside. Whatever happens, no record may reach another
stream's consumer: every consumer reads only its own records, in order, or ends early
with Dropped.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

from typing import Any

from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.egress import EgressBatcher, EgressSlot
from velomux_quic.mux.ingress import IngressTable, InMemoryBindRegistry, MuxIngressStats
from velomux_quic.mux.protocol import CloseReason, LifecycleAction, decode_batch
from velomux_quic.streaming.frames import (
    FINALIZED,
    FrameKind,
    decode_frame,
    encode_item,
)

PEER = "producer"


class Replies:
    """The consumer's replies, applied straight to the producer's batcher."""

    def __init__(self, batcher: EgressBatcher) -> None:
        self.batcher = batcher

    def credit(self, slot_id: int, delta: int) -> None:
        self.batcher.on_credit(slot_id, delta, 0.0)

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self.batcher.on_peer_close(slot_id, reason)

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        self.batcher.on_peer_close(slot_id, reason)
        return True

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        raise AssertionError("no lifecycle in this test")


class Control:
    def credits(self, grants: list[tuple[int, int]]) -> None:
        raise AssertionError("the producer's batches carry no control for it")

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        raise AssertionError("the producer's batches carry no control for it")

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        raise AssertionError("the producer's batches carry no control for it")


class Harness:
    def __init__(self) -> None:
        config = MuxConfig()
        self.batcher = EgressBatcher(0, config)
        self.binds = InMemoryBindRegistry()
        self.stats = MuxIngressStats()
        self.table = IngressTable(
            PEER,
            0,
            config,
            registry=self.binds,
            replies=Replies(self.batcher),
            control=Control(),
            peer_budget=PeerBudget(config.peer_byte_budget),
            stats=self.stats,
        )
        self.consumers: dict[int, IngressSlot] = {}

    def open(self, stream: int) -> EgressSlot:
        consumer = IngressSlot(32, 1 << 20)
        self.binds.bind(1000 + stream, stream, consumer)
        self.consumers[stream] = consumer
        return self.batcher.open_slot(1000 + stream, stream)

    def batches(self) -> list[bytes]:
        self.batcher.kick()
        return [batch.payload for batch in self.batcher.poll(0.0)]

    def deliver(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            header, records = decode_batch(payload)
            self.table.handle_batch(header, records, 0.0)

    def read(self, stream: int) -> list[Any]:
        """What the stream's consumer reads: items, then how it ended."""
        out: list[Any] = []
        slot = self.consumers[stream]
        while (body := slot.take()) is not None:
            kind, value = decode_frame(body)
            out.append(value if kind is FrameKind.ITEM else kind)
        return out


def test_a_wrapped_generation_never_delivers_a_record_to_another_stream() -> None:
    h = Harness()
    # Stream 0: its OpenSlot arrives; its first record is "in flight" (held back), and the
    # batch with its second record, its terminal and its close arrives ahead of it.
    first = h.open(0)
    h.deliver(h.batches())
    h.batcher.offer(first, encode_item([0, 0]), 0.0)
    in_flight = h.batches()
    h.batcher.offer(first, encode_item([0, 1]), 0.0)
    h.batcher.offer_terminal(first, FINALIZED, 0.0)
    h.deliver(h.batches())
    assert h.read(0) == []  # everything waits behind the gap
    reused = set()
    for stream in range(1, 301):
        slot = h.open(stream)
        reused.add(slot.index)
        h.deliver(h.batches())  # its OpenSlot, in a flush of its own
        if slot.live:
            h.batcher.offer(slot, encode_item([stream, 0]), 0.0)
            h.batcher.offer(slot, encode_item([stream, 1]), 0.0)
            h.batcher.offer_terminal(slot, FINALIZED, 0.0)
        h.deliver(h.batches())
    assert reused == {first.index}  # every stream took the same index
    h.deliver(in_flight)  # the late record of stream 0 finally lands
    # The generation wrapped once onto the slot waiting aside: the chapter fails the old
    # stream (Dropped) and refuses the new one, so neither gets the other's records.
    assert h.stats.drops["slot_collision"] == 1
    wrapped = 256
    for stream in h.consumers:
        read = h.read(stream)
        items = [value for value in read if not isinstance(value, FrameKind)]
        assert all(value[0] == stream for value in items), (stream, read)
        if stream == 0:
            assert read == [FrameKind.DROPPED]
        elif stream == wrapped:
            assert read == [] and not h.consumers[stream].opened
        else:
            assert read == [[stream, 0], [stream, 1], FrameKind.FINALIZED], (stream, read)
    assert h.table.live_slots == 0
    assert h.batcher.live_slots == 0
