"""A bounded consumer that stops reading: its producer waits, other streams keep flowing.

Every mux stream has its own two bounds, both set by the consumer (here
``MuxConfig(initial_credit=8, slot_byte_budget=512)`` on the consumer node):

- **credit**: records the producer may have on the wire before the consumer reads them
  (``sender.credit`` counts it down; the consumer returns it as it reads);
- **the slot byte budget**: bytes a producer may stage locally beyond its credit
  (``sender.queued_bytes``); once they reach it, ``send`` waits.

Nothing else is held: each stream's records sit in that stream's own buffers, so a
consumer that stops reading one stream stalls that stream's producer and nobody else.

What it shows, on two streams from one producer node to one consumer node:

1. the slow stream's producer sends into a consumer that reads nothing: 8 records go out
   (credit 8 -> 0, 8 records buffered at the consumer), the next ones are staged until
   the budget is full, and then ``send(..., timeout=1.0)`` raises ``SendTimeout`` (a
   ``SendError``): the item was not taken, the stream goes on, the producer decides;
2. meanwhile a second stream to the same peer delivers all of its records;
3. the consumer reads again: credit comes back and a send that was waiting completes;
4. the producer's metrics counted it: ``velo_streaming_slot_credit_exhausted_total`` and
   ``velo_streaming_producer_send_backpressure_total``.

Run it with ``python examples/bounded_consumer.py [CERT_DIR]``. Only root imports.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from velomux_quic import MuxConfig, Node, SendError, SendTimeout, ensure_dev_cluster, open_node

CREDIT = 8
BUDGET = 512
SEND_TIMEOUT = 1.0
"""Long enough for the 8 credited records to reach the consumer even on a busy machine."""
FAST_RECORDS = 200


def ingress_buffered(consumer: Node) -> int:
    """Records delivered to the consumer node and not yet read by its application."""
    mux = consumer.snapshot().mux
    assert mux is not None, "the mux is on by default"
    return sum(lane.buffered_records for lane in mux.ingress.values())


def metric(node: Node, name: str) -> float:
    """One unlabelled sample from the node's Prometheus text (what a scrape reads)."""
    for line in node.metrics_text().splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


async def main(certs: Path) -> int:
    dirs = ensure_dev_cluster(certs, ("consumer", "producer"))
    async with (
        open_node(
            dirs["consumer"], mux=MuxConfig(initial_credit=CREDIT, slot_byte_budget=BUDGET)
        ) as consumer,
        open_node(dirs["producer"], peers=[consumer.record]) as producer,
    ):
        slow_anchor = consumer.create_anchor()
        fast_anchor = consumer.create_anchor()
        slow = await producer.attach_anchor(slow_anchor.handle)
        fast = await producer.attach_anchor(fast_anchor.handle)

        print(f"slow stream: credit {slow.credit} before the first send")
        sent = 0
        while True:  # the consumer reads nothing from slow_anchor yet
            try:
                await slow.send({"slow": sent}, timeout=SEND_TIMEOUT)
            except SendTimeout as error:
                assert isinstance(error, SendError)
                print(f"slow stream: send refused after {sent} records: {type(error).__name__}")
                print(f"  message: {error}")
                break
            sent += 1
        credit_left, staged, buffered = slow.credit, slow.queued_bytes, ingress_buffered(consumer)
        print(
            f"slow stream: credit {credit_left}, {staged} bytes staged at the "
            f"producer (budget {BUDGET}), {buffered} records buffered at the consumer"
        )
        waiting_send = asyncio.create_task(slow.send({"slow": sent}))  # waits for credit

        async def fast_stream() -> None:
            for index in range(FAST_RECORDS):
                await fast.send({"fast": index})
            fast.finalize()

        producing = asyncio.create_task(fast_stream())
        fast_items = [item async for item in fast_anchor]
        await producing
        fast_ok = fast_items == [{"fast": index} for index in range(FAST_RECORDS)]
        print(f"fast stream, same peer, meanwhile: {len(fast_items)} records delivered: {fast_ok}")
        print(f"slow stream's next send still waiting: {not waiting_send.done()}")

        slow_items = [await slow_anchor.next(timeout=10.0) for _ in range(sent + 1)]
        await asyncio.wait_for(waiting_send, timeout=10.0)
        slow.finalize()
        rest = [item async for item in slow_anchor]
        slow_ok = slow_items == [{"slow": index} for index in range(sent + 1)] and rest == []
        print(f"consumer read again: {len(slow_items)} slow records in order: {slow_ok}")

        exhausted = metric(producer, "velo_streaming_slot_credit_exhausted_total")
        waits = metric(producer, "velo_streaming_producer_send_backpressure_total")
        print(f"producer metrics: credit exhausted {exhausted:.0f}, sends that waited {waits:.0f}")

        stalled_as_bounded = credit_left == 0 and staged >= BUDGET and buffered == CREDIT
        ok = stalled_as_bounded and fast_ok and slow_ok and exhausted >= 1 and waits >= 1
        print("bounded consumer OK" if ok else "bounded consumer FAILED")
        return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1:
        sys.exit(asyncio.run(main(Path(sys.argv[1]))))
    with tempfile.TemporaryDirectory() as scratch:
        sys.exit(asyncio.run(main(Path(scratch))))
