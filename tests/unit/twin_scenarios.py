"""Scenarios run by both twins of the record path, for the differential tests.

Each scenario takes plain JSON values (bytes as hex), drives the public API of one sans-IO
piece of the record path (the batch decoder and builder, an egress batcher, an ingress
table with its slots and their consumers, a whole pass staged by ``send_pass``'s loop) on an
explicit clock, and returns plain JSON values: every output, every error (type and message),
every counter. The test runs a scenario here and in a process of the other twin
(``tests/unit/twin_oracle.py``) and compares the two results whole.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from typing import Any, cast

from velomux_quic.mux.config import AutoFlush, MuxConfig
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.driver import MuxChannel
from velomux_quic.mux.egress import EgressBatcher
from velomux_quic.mux.ingress import IngressTable, InMemoryBindRegistry, RejectLane
from velomux_quic.mux.protocol import (
    BatchBuilder,
    CloseReason,
    LifecycleAction,
    decode_batch_owned,
)
from velomux_quic.recordpath import IMPLEMENTATION
from velomux_quic.streaming.frames import DROPPED, FINALIZED
from velomux_quic.streaming.sender import PassOutcome, send_pass

from .mux_rig import Rig

Json = Any


def _error(exc: BaseException) -> list[str]:
    return ["error", type(exc).__name__, str(exc)]


def decode(hexed: str) -> Json:
    """``decode_batch_owned`` of hostile bytes: the records, or the refusal."""
    try:
        header, records = decode_batch_owned(bytes.fromhex(hexed))
    except Exception as exc:
        return _error(exc)
    fields = [header.lane, header.record_count, header.peer_epoch, header.batch_seq]
    return ["ok", fields, [[t, s, q, b.hex()] for t, s, q, b in records]]


def build(cap: int, ops: list[list[Any]]) -> Json:
    """A BatchBuilder through ``add``/``add_data``/``add_credit``/``add_data_if_fits``/
    ``fits``/``finish``/``reset``, with out-of-range fields and bad bodies among them."""
    out: list[Json] = []
    try:
        builder = BatchBuilder(cap)
    except Exception as exc:
        return [_error(exc)]
    for op in ops:
        kind = op[0]
        try:
            if kind == "add":
                builder.add(op[1], op[2], op[3], bytes.fromhex(op[4]))
                out.append(["added", builder.size, builder.count])
            elif kind == "add_data":
                builder.add_data(op[1], op[2], bytes.fromhex(op[3]))
                out.append(["added", builder.size, builder.count])
            elif kind == "add_credit":
                builder.add_credit(op[1], op[2])
                out.append(["added", builder.size, builder.count])
            elif kind == "if_fits":
                out.append(["fits", builder.add_data_if_fits(op[1], op[2], bytes.fromhex(op[3]))])
            elif kind == "fits":
                out.append(["fits", builder.fits(op[1])])
            elif kind == "finish":
                out.append(["batch", builder.finish(op[1], op[2], op[3]).hex()])
            else:
                builder.reset()
                out.append(["reset", builder.size, builder.count])
        except Exception as exc:
            out.append(_error(exc))
    return out


# -- egress ---------------------------------------------------------------------------------


def _egress_state(batcher: EgressBatcher) -> Json:
    stats = batcher.stats
    snap = batcher.snapshot()
    return [
        stats.batches_sent,
        stats.records_sent,
        stats.credit_exhausted,
        stats.queue_full,
        list(stats.batch_size_buckets),
        list(stats.record_types),
        snap.live_slots,
        {state.name: count for state, count in snap.slot_states.items()},
        snap.queued_records,
        snap.withheld_records,
        snap.queued_bytes,
        batcher.queued_bytes,
        batcher.has_ready,
        batcher.next_deadline(),
    ]


def egress(config: dict[str, Any], ops: list[list[Any]]) -> Json:
    """An EgressBatcher driven through a sequence of producer, peer and poll operations;
    every return value, every batch written (bytes), every error and the counters."""
    linger = config.pop("linger", None)
    mux = MuxConfig(flush_policy=AutoFlush(max_linger=linger), **config)
    batcher = EgressBatcher(0, mux, epochs=itertools.count(7_000).__next__)
    slots: list[Any] = []
    out: list[Json] = []
    now = 0.0
    for op in ops:
        kind = op[0]
        now += 0.0005
        try:
            if kind == "open":
                slot = batcher.open_slot(op[1], op[2])
                slots.append(slot)
                out.append(["slot", slot.slot_id])
                continue
            if kind == "poll":
                batches = batcher.poll(now)
                out.append(
                    [
                        [b.payload.hex(), b.records, b.carries_data, len(b.guards), b.headers]
                        for b in batches
                    ]
                )
                continue
            if kind == "kick":
                batcher.kick()
                continue
            if kind == "reply_credit":
                batcher.reply_credit(op[1], op[2], now)
                continue
            if kind == "epoch_death":
                out.append(["closed", batcher.epoch_death()])
                continue
            if not slots:
                continue
            slot = slots[op[1] % len(slots)]
            if kind == "offer":
                body = b"\x81\xa4Item" + bytes([op[1] & 0xFF]) * op[2]
                out.append(["offer", batcher.offer(slot, body, now)])
            elif kind == "terminal":
                batcher.offer_terminal(slot, FINALIZED, now, guard=f"guard-{slot.slot_id}")
            elif kind == "credit":
                out.append(["credit", batcher.on_credit(slot.slot_id, op[2], now)])
            elif kind == "peer_close":
                out.append(["peer_close", batcher.on_peer_close(slot.slot_id, CloseReason(3))])
            elif kind == "cancel":
                batcher.cancel_slot(slot)
            elif kind == "lifecycle":
                batcher.on_lifecycle(slot.session_id, LifecycleAction(op[2]))
            out.append(
                [
                    "slot",
                    slot.state.name,
                    slot.credit,
                    slot.queued_bytes,
                    slot.next_seq,
                    slot.fenced,
                    slot.live,
                    slot.sendable,
                    batcher.has_room(slot),
                ]
            )
        except Exception as exc:
            out.append(_error(exc))
    out.append(_egress_state(batcher))
    return out


# -- ingress --------------------------------------------------------------------------------


class _Replies:
    """ReplySink and EgressControl together: every reply, in order."""

    def __init__(self, out: list[Json]) -> None:
        self.out = out
        self.rejects = RejectLane(16)

    def credit(self, slot_id: int, delta: int) -> None:
        self.out.append(["credit", slot_id, delta])

    def close(self, slot_id: int, reason: CloseReason) -> None:
        self.out.append(["close", slot_id, int(reason)])

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        self.out.append(["reject", slot_id, int(reason)])
        return self.rejects.offer(slot_id, reason)

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        self.out.append(["lifecycle", session, int(action)])

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        self.out.append(["closed_by_peer", slot_id, int(reason)])


class _Control(_Replies):
    def credits(self, grants: list[tuple[int, int]]) -> None:
        self.out.extend(["peer_credit", slot_id, delta] for slot_id, delta in grants)

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        self.out.append(["peer_lifecycle", session, int(action)])


def ingress(config: dict[str, Any], binds: int, steps: list[list[Any]]) -> Json:
    """An IngressTable fed raw batches (well formed or hostile, through the transport's
    decoder) and consumers that take from their slots between batches; what every consumer
    read, every reply, every counter."""
    mux = MuxConfig(**config)
    out: list[Json] = []
    registry = InMemoryBindRegistry()
    wakes: list[int] = [0]
    slots: list[IngressSlot] = []
    for index in range(binds):
        slot = IngressSlot(
            mux.initial_credit,
            mux.slot_byte_budget,
            wake=lambda: wakes.__setitem__(0, wakes[0] + 1),
            return_below=max(1, mux.initial_credit // 2),
        )
        registry.bind(100 + index, 200 + index, slot)
        slots.append(slot)
    doorbells: list[int] = [0]
    table = IngressTable(
        "peer",
        0,
        mux,
        registry=registry,
        replies=_Replies(out),
        control=_Control(out),
        peer_budget=PeerBudget(mux.peer_byte_budget),
        doorbell=lambda: doorbells.__setitem__(0, doorbells[0] + 1),
        clock=lambda: now,  # the scenario's time, so both twins time drop notices alike
    )
    now = 0.0
    for step in steps:
        now += 0.001
        kind = step[0]
        try:
            if kind == "batch":
                try:
                    header, records = decode_batch_owned(bytes.fromhex(step[1]))
                except Exception as exc:
                    out.append(_error(exc))
                    continue
                if step[2]:
                    table.handle_staged_batch(header, records, now)
                else:
                    table.handle_batch(header, records, now)
            elif kind == "take":
                slot = slots[step[1] % len(slots)]
                taken = []
                for _ in range(step[2]):
                    body = slot.take()
                    if body is None:
                        break
                    taken.append(body.hex())
                out.append(["took", taken, len(slot), slot.exhausted])
            elif kind == "withdraw":
                slots[step[1] % len(slots)].withdraw()
            elif kind == "visit":
                out.append(["visited", table.visit_dirty(now)])
            else:
                out.append(["swept", table.sweep(now)])
        except Exception as exc:
            out.append(_error(exc))
    stats = table.stats
    out.append(
        [
            stats.batches_received,
            stats.records_received,
            dict(stats.drops),
            stats.reader_stall,
            stats.generation_mismatch,
            stats.hold_overflow,
            stats.batch_seq_gaps,
            stats.held_records,
            stats.live_slots,
            stats.protocol_errors,
            stats.malformed_records,
            stats.control_refused,
            stats.refused_slots,
            stats.slot_limit,
            table.live_slots,
            wakes[0],
            doorbells[0],
            [
                [
                    s.granted,
                    s.data_delivered,
                    s.drained,
                    s.withheld_credit,
                    s.outstanding_credit,
                    s.bytes_buffered,
                    s.held_data,
                    s.held_bytes,
                    s.terminal,
                    s.closed,
                    s.withdrawn,
                    s.gap_waiting,
                    len(s),
                ]
                for s in slots
            ],
            repr(table.snapshot()),
        ]
    )
    return out


DROPPED_HEX = DROPPED.hex()


# -- a pass, through senders and their mux channels -----------------------------------------


class _Written:
    """The messenger's place: admits every batch at once and keeps its payload."""

    def __init__(self) -> None:
        self.payloads: list[str] = []

    def send_message_on_lane(
        self, peer: Any, lane: int, handler: str, payload: Any, **_: Any
    ) -> None:
        self.payloads.append(bytes(payload).hex())


def _outcome(outcome: PassOutcome) -> Json:
    failed = [[index, type(exc).__name__, str(exc)] for index, exc in outcome.failed.items()]
    return ["outcome", outcome.taken, list(outcome.left), failed]


def passes(config: dict[str, Any], streams: int, steps: list[list[Any]]) -> Json:
    """Senders on mux channels of one batcher and its driver (a messenger that admits every
    batch at once), driven by passes of ``send_pass`` (items MessagePack cannot hold among
    them), single ``send``/``try_send`` calls, credit grants, finalized and cancelled
    streams, and the driver's wakes; every outcome, error, batch written and slot state."""
    return asyncio.run(_passes(config, streams, steps))


async def _passes(config: dict[str, Any], streams: int, steps: list[list[Any]]) -> Json:
    rig = Rig(MuxConfig(**config), _Written(), epochs=itertools.count(9_000).__next__)
    written, batcher, driver, metrics = rig.messenger, rig.batcher, rig.driver, rig.metrics
    senders = [rig.sender() for _ in range(streams)]
    states = rig.states
    out: list[Json] = []
    settle = rig.settle

    await settle()  # the OpenSlots
    for step in steps:
        kind = step[0]
        try:
            if kind == "pass":
                pairs = [(senders[i % streams], item) for i, item in step[1]]
                out.append(_outcome(await send_pass(pairs)))
            elif kind == "send":
                # A send that finds no room waits: what it did after the driver's next wakes.
                sending = asyncio.ensure_future(senders[step[1] % streams].send(step[2]))
                await settle()
                if not sending.done():
                    sending.cancel()
                    out.append(["send waits"])
                else:
                    sending.result()
                    out.append(["sent"])
            elif kind == "try_send":
                out.append(["try_send", senders[step[1] % streams].try_send(step[2])])
            elif kind == "credit":
                slot = cast(MuxChannel, states[step[1] % streams].channel).slot
                out.append(["credit", batcher.on_credit(slot.slot_id, step[2], driver.now())])
            elif kind == "finalize":
                senders[step[1] % streams].finalize()
            elif kind == "cancel":
                states[step[1] % streams].cancel()
            else:
                await settle()
        except Exception as exc:
            out.append(_error(exc))
    await settle()
    out.append(written.payloads)
    out.append([[s.state, s.credit, s.queued_bytes] for s in senders])
    out.append(metrics.producer_send_backpressure)
    driver.close()
    return out


SCENARIOS: dict[str, Callable[..., Json]] = {
    "decode": decode,
    "build": build,
    "egress": egress,
    "ingress": ingress,
    "passes": passes,
}


def implementation() -> str:
    return IMPLEMENTATION
