"""Nanoseconds per record on the mux's receive path, in process (no sockets, no loop).

The shape ``perf/tokens.py`` measures on its frontend: one peer, one lane, ``--streams``
open slots (default 1,024), and per engine pass one batch holding one 48-byte token frame
per slot. Each slot is the consumer's :class:`IngressSlot` installed as the feed of a
real :class:`Inbox`, woken as the node wires it, so a record pays everything it pays on
a node between the QUIC payload and the consumer's item:

* ``ingress``: the transport's batch decode and ``IngressTable.handle_batch`` of one whole batch
  (slot lookup, sequencing, credit checks, the slot's append and the inbox wake-up);
* ``consumer``: every slot's record read back by its ``StreamAnchor``'s ``take_ready()``
  (the ``single-task`` consumer shape: the inbox, the slot's ``take``, which lists the
  slot dirty for credit, and ``decode_frame``), driven without a loop since it never
  has to wait;
* ``reconcile``: the doorbell visit that returns the drained credit.

The three take turns for ``--repeat`` rounds of ``--batches`` batches and the median and
best round of each are shown, in CPU time of the benchmark's thread (``thread_time_ns``),
which is steadier than end-to-end figures or wall time on a loaded machine. Only the
receive path is timed; the batches are encoded beforehand. No event loop runs, so a
wake-up costs the inbox's check, not a task switch (the reader's waits are not here).

    python perf/ingress_bench.py
    python perf/ingress_bench.py --streams 256 --batches 400 --repeat 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Coroutine
from typing import Any

from velomux_quic.ids import StreamAnchorHandle
from velomux_quic.mux.config import MuxConfig
from velomux_quic.mux.credit import IngressSlot, PeerBudget
from velomux_quic.mux.ingress import IngressTable, InMemoryBindRegistry, RejectLane
from velomux_quic.mux.protocol import (
    BatchHeader,
    CloseReason,
    EncodableRecord,
    LifecycleAction,
    RecordType,
    encode_batch,
    open_slot_body,
    slot_id,
)
from velomux_quic.streaming.anchor import AnchorEntry, StreamAnchor
from velomux_quic.streaming.frames import encode_item

try:  # the decoder the node's transport uses; a tree before it existed used decode_batch
    from velomux_quic.mux.protocol import decode_batch_owned as decode_for_ingress
except ImportError:  # pragma: no cover (comparing against an older tree)
    from velomux_quic.mux.protocol import decode_batch as decode_for_ingress  # type: ignore[assignment]
from velomux_quic.streaming.inbox import Inbox

TOKEN = {"t": 12345, "s": 1, "p": "x" * 24}
"""About the 48-byte token frame of ``perf/tokens.py``."""


class _Replies:
    """A ReplySink that only counts (the egress batcher is not what is measured)."""

    def __init__(self) -> None:
        self.granted = 0
        self.rejects = RejectLane(1024)

    def credit(self, slot_id: int, delta: int) -> None:
        self.granted += delta

    def close(self, slot_id: int, reason: CloseReason) -> None:
        raise AssertionError(f"slot {slot_id:#x} closed: {reason!r}")

    def reject(self, slot_id: int, reason: CloseReason) -> bool:
        raise AssertionError(f"slot {slot_id:#x} rejected: {reason!r}")

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        raise AssertionError("no lifecycle expected")


class _Control:
    def credit(self, slot_id: int, delta: int) -> None:
        raise AssertionError("no egress control expected")

    def closed_by_peer(self, slot_id: int, reason: CloseReason) -> None:
        raise AssertionError("no egress control expected")

    def lifecycle(self, session: int, action: LifecycleAction) -> None:
        raise AssertionError("no egress control expected")


class _Owner:
    """An AnchorOwner for anchors that are read, never ended, in this benchmark."""

    def anchor_dropped(self, local_id: int) -> None:
        pass

    def cancel_anchor(self, local_id: int) -> None:
        raise AssertionError("no anchor is cancelled here")

    def request_stop(self, local_id: int) -> None:
        raise AssertionError("no stop is requested here")

    def reader_ended(self, local_id: int) -> None:
        raise AssertionError("no stream ends here")

    def sender_detached(self, local_id: int, sender_id: int) -> None:
        raise AssertionError("no sender detaches here")

    def feed_exhausted(self, entry: AnchorEntry, sender_id: int | None) -> bool:
        return False


def _ready(coroutine: Coroutine[Any, Any, list[object]]) -> list[object]:
    """The result of a coroutine that completes without waiting (items were ready)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise SystemExit("take_ready waited: the records were not ready")


class Bench:
    """One table with ``streams`` open slots, each read through its own inbox."""

    def __init__(self, streams: int) -> None:
        config = MuxConfig()
        self.streams = streams
        self.replies = _Replies()
        registry = InMemoryBindRegistry()
        self.table = IngressTable(
            "peer",
            0,
            config,
            registry=registry,
            replies=self.replies,
            control=_Control(),
            peer_budget=PeerBudget(config.peer_byte_budget),
        )
        self.anchors: list[StreamAnchor[object]] = []
        owner = _Owner()
        credit = config.initial_credit
        opens: list[EncodableRecord] = []
        for index in range(streams):
            inbox = Inbox(ordered=True)  # as the node makes a single-sender anchor's
            slot = IngressSlot(
                credit,
                config.slot_byte_budget,
                wake=inbox.wake,
                return_below=max(1, int(credit * config.credit_return_below)),
            )
            registry.bind(index + 1, index + 1, slot)
            inbox.install_feed(slot)
            entry = AnchorEntry(index + 1, StreamAnchorHandle.pack(1, index + 1), False, inbox, 1.0)
            self.anchors.append(StreamAnchor(owner, entry))
            opens.append(
                (
                    int(RecordType.OPEN_SLOT),
                    slot_id(index, 1),
                    0,
                    open_slot_body(index + 1, index + 1),
                )
            )
        self.batch_seq = 0
        self.frame_seq = 1
        self.clock = 0.0
        self._apply(encode_batch(self._header(len(opens)), opens))
        self.token = encode_item(TOKEN)

    def _header(self, count: int) -> BatchHeader:
        header = BatchHeader(0, count, 1, self.batch_seq)
        self.batch_seq += 1
        return header

    def _apply(self, payload: bytes) -> None:
        header, records = decode_for_ingress(payload)
        self.table.handle_batch(header, records, 0.0)

    def batches(self, count: int) -> list[bytes]:
        """The next ``count`` passes, one token per slot each, encoded."""
        data = int(RecordType.DATA)
        out = []
        for _ in range(count):
            seq = self.frame_seq
            self.frame_seq += 1
            records: list[EncodableRecord] = [
                (data, slot_id(index, 1), seq, self.token) for index in range(self.streams)
            ]
            out.append(encode_batch(self._header(len(records)), records))
        return out

    def ingress(self, payload: bytes) -> None:
        self._apply(payload)

    def consume(self) -> int:
        taken = 0
        for anchor in self.anchors:
            taken += len(_ready(anchor.take_ready()))
        return taken

    def reconcile(self) -> None:
        self.clock += 1.0  # past the visit floor: every call visits
        self.table.visit_dirty(self.clock)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--streams", type=int, default=1024, help="open slots (one token each per batch)"
    )
    parser.add_argument("--batches", type=int, default=200, help="batches per round")
    parser.add_argument("--repeat", type=int, default=7, help="rounds; median and best shown")
    args = parser.parse_args(argv)
    bench = Bench(args.streams)
    per_round = args.batches * args.streams
    clock = time.thread_time_ns  # CPU time of this thread: steadier than wall time under load
    rounds: dict[str, list[float]] = {"ingress": [], "consumer": [], "reconcile": []}
    for _ in range(args.repeat):
        payloads = bench.batches(args.batches)
        spent = dict.fromkeys(rounds, 0.0)
        for payload in payloads:
            start = clock()
            bench.ingress(payload)
            middle = clock()
            taken = bench.consume()
            end = clock()
            bench.reconcile()
            spent["reconcile"] += clock() - end
            spent["ingress"] += middle - start
            spent["consumer"] += end - middle
            if taken != args.streams:
                raise SystemExit(f"took {taken} records of {args.streams}")
        for name, total in spent.items():
            rounds[name].append(total / per_round)
    if bench.replies.granted == 0:
        raise SystemExit("no credit came back: the consumer side did not drain")
    print(
        f"{args.streams} slots, one {len(bench.token)}-byte item each per batch, "
        f"{args.batches} batches x {args.repeat} rounds (CPU ns per record)"
    )
    for name, values in rounds.items():
        print(f"  {name:<10} median {statistics.median(values):7.0f}   best {min(values):7.0f}")


if __name__ == "__main__":
    main()
