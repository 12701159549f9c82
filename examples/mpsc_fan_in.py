"""MPSC fan-in: four producers on two nodes write into one ``MpscAnchor`` on a third.

An MPSC anchor is one stream many producers attach to (``attach_mpsc_anchor``). The
consumer reads :class:`MpscItem` (``sender_id`` says which producer sent ``value``) and
:class:`MpscEvent` (a producer left: ``detached`` when it finalized, ``dropped`` when it
vanished; ``sender_error`` for a soft error it reported). One producer leaving does not end
the stream: the consumer decides when it has heard enough, here once every producer left.

What it shows, in order:

1. ``create_mpsc_anchor(max_senders=4)`` on the collector, four attaches from two
   worker nodes, and a fifth that is refused with ``MaxSendersReached``;
2. each producer's items arrive in its own order, interleaved with the others';
3. one producer reports a soft error (``send_err``: an ``MpscEvent``, the stream goes
   on), and one leaves without finalizing (``aclose``: a ``dropped`` event);
4. the collector cancels the anchor when all four are gone.

Run it with ``python examples/mpsc_fan_in.py [CERT_DIR]``. Only root imports.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from velomux_quic import (
    MaxSendersReached,
    MpscAnchor,
    MpscEvent,
    MpscItem,
    StreamSender,
    ensure_dev_cluster,
    open_node,
)

PRODUCERS = 4
ITEMS = 20


async def produce(sender: StreamSender, name: str, how_it_ends: str) -> None:
    """Send ITEMS numbered items, then leave the way ``how_it_ends`` says."""
    for index in range(ITEMS):
        await sender.send({"producer": name, "n": index})
        if how_it_ends == "soft-error" and index == ITEMS // 2:
            await sender.send_err(f"{name}: one item of the batch was skipped")
    if how_it_ends == "drop":
        await sender.aclose()  # leaves without a finalize: the consumer reads "dropped"
    else:
        await sender.finalize()


async def collect(anchor: MpscAnchor) -> tuple[dict[int, list[int]], list[MpscEvent]]:
    """Read until every producer has left; items by sender, and the events seen."""
    items: dict[int, list[int]] = defaultdict(list)
    events: list[MpscEvent] = []
    gone = 0
    async for record in anchor:
        if isinstance(record, MpscItem):
            items[record.sender_id].append(int(record.value["n"]))
        else:
            events.append(record)
            if record.kind in ("detached", "dropped"):
                gone += 1
                if gone == PRODUCERS:
                    break
    anchor.cancel()  # the fan-in is over: nobody else may attach
    return items, events


async def main(certs: Path) -> int:
    dirs = ensure_dev_cluster(certs, ("collector", "worker-a", "worker-b"))
    async with (
        open_node(dirs["collector"]) as collector,
        open_node(dirs["worker-a"], peers=[collector.record]) as worker_a,
        open_node(dirs["worker-b"], peers=[collector.record]) as worker_b,
    ):
        anchor = collector.create_mpsc_anchor(max_senders=PRODUCERS)
        senders = [
            await node.attach_mpsc_anchor(anchor.handle)
            for node in (worker_a, worker_a, worker_b, worker_b)
        ]
        print(f"{len(senders)} producers attached, sender ids {[s.sender_id for s in senders]}")
        try:
            await worker_b.attach_mpsc_anchor(anchor.handle)
        except MaxSendersReached as error:
            print(f"fifth attach refused: {type(error).__name__}")

        names = ["a0", "a1", "b0", "b1"]
        endings = ["finalize", "soft-error", "finalize", "drop"]
        reader = asyncio.create_task(collect(anchor))
        await asyncio.gather(
            *(produce(s, n, e) for s, n, e in zip(senders, names, endings, strict=True))
        )
        items, events = await asyncio.wait_for(reader, timeout=30.0)

        in_order = all(values == list(range(ITEMS)) for values in items.values())
        total = sum(len(values) for values in items.values())
        print(
            f"collector read {total} items from {len(items)} producers, "
            f"each in its order: {in_order}"
        )
        for sender, name in zip(senders, names, strict=True):
            print(
                f"  producer {name} (sender id {sender.sender_id}): "
                f"{len(items[sender.sender_id])} items"
            )
        kinds = sorted(event.kind for event in events)
        print(f"events: {kinds}")
        soft = [event.message for event in events if event.kind == "sender_error"]
        print(f"soft error: {soft[0] if soft else None}")
        ok = (
            in_order
            and total == PRODUCERS * ITEMS
            and kinds == ["detached", "detached", "detached", "dropped", "sender_error"]
        )
        print("mpsc fan-in OK" if ok else "mpsc fan-in FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(Path(sys.argv[1]))))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(asyncio.run(main(Path(scratch))))
