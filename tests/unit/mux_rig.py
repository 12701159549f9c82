"""A real mux batcher and driver in memory, senders on its slots, and a recording messenger
double: what the sans-IO tests of a sender into the mux (``send_pass``, a terminal's
staging) decode and check against what was handed over."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar, cast

from prometheus_client.registry import CollectorRegistry

from velomux_quic import StreamSender
from velomux_quic.ids import InstanceId, StreamAnchorHandle
from velomux_quic.messenger import Messenger
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.driver import BatcherDriver, MuxChannel
from velomux_quic.mux.egress import EgressBatcher
from velomux_quic.mux.protocol import RecordType, decode_batch
from velomux_quic.streaming.frames import encode_item
from velomux_quic.streaming.metrics import StreamingMetrics
from velomux_quic.streaming.sender import SenderState

PEER = InstanceId.parse("00000000-0000-4000-8000-000000000001")

MessengerT = TypeVar("MessengerT")


class RecordingMessenger:
    """Admits every batch at once (returns None, as an inline send does) and keeps it; a
    batch the messenger would stage is pulled at once too (its release is ``pulled``)."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def send_message_on_lane(
        self,
        peer: InstanceId,
        lane: int,
        handler: str,
        payload: Any,
        headers: Any = None,
        on_staged_release: Callable[[str], None] | None = None,
    ) -> None:
        self.payloads.append(bytes(payload))
        if on_staged_release is not None:
            asyncio.get_running_loop().call_soon(on_staged_release, "pulled")


class Owner:
    def sender_finished(self, state: SenderState) -> None:
        pass

    def sender_retired(self, state: SenderState) -> None:
        pass


class Rig(Generic[MessengerT]):
    """One (peer, lane) batcher, its driver writing to ``messenger``, and senders on its
    slots."""

    def __init__(
        self,
        config: MuxConfig,
        messenger: MessengerT,
        epochs: Callable[[], int] | None = None,
    ) -> None:
        """``epochs``: the batcher's epoch source (its own default when None)."""
        self.messenger = messenger
        self.batcher = (
            EgressBatcher(0, config) if epochs is None else EgressBatcher(0, config, epochs=epochs)
        )
        self.driver = BatcherDriver(cast(Messenger, self.messenger), PEER, self.batcher)
        self.metrics = StreamingMetrics(CollectorRegistry(), lambda: 0)
        self.channels: list[MuxChannel] = []
        self.states: list[SenderState] = []
        """Each sender's state, in the order the senders were made."""

    def sender(self) -> StreamSender:
        index = len(self.channels)
        slot = self.batcher.open_slot(anchor_id=100 + index, session_id=200 + index)
        channel = MuxChannel(self.driver, slot)
        self.channels.append(channel)
        state = SenderState(
            Owner(),
            self.metrics,
            StreamAnchorHandle.pack(1, index + 1),
            channel,
            sender_stream_id=index,
            transport_key="messenger-mux-v2",
            target=PEER,
            heartbeat_interval=None,
        )
        channel.watch(state)
        self.states.append(state)
        self.driver.wake()  # its OpenSlot goes at the next wake, as the mux transport does
        return StreamSender(state)

    async def settle(self) -> None:
        """Let the driver's wakes (scheduled with call_soon) run."""
        for _ in range(5):
            await asyncio.sleep(0)


class RecordingRig(Rig[RecordingMessenger]):
    """A rig whose messenger admits and keeps every batch, and what it wrote, decoded."""

    def __init__(self, config: MuxConfig) -> None:
        super().__init__(config, RecordingMessenger())

    def data(self) -> dict[int, list[tuple[int, bytes]]]:
        """Per slot id, the (frame_seq, body) of every Data record written so far."""
        out: dict[int, list[tuple[int, bytes]]] = {}
        for payload in self.messenger.payloads:
            _, records = decode_batch(payload)
            for record_type, sid, seq, body in records:
                if record_type == RecordType.DATA:
                    out.setdefault(sid, []).append((seq, bytes(body)))
        return out

    def expect(self, items: Sequence[Sequence[Any]]) -> dict[int, list[tuple[int, bytes]]]:
        return {
            channel.slot.slot_id: [(n + 1, encode_item(item)) for n, item in enumerate(stream)]
            for channel, stream in zip(self.channels, items, strict=True)
            if stream
        }
