"""Instructions per record of the consumer's read and the producer's staging, in process.

Each arm runs its loop in a window that valgrind's callgrind counts (``perf/_callgrind.py``),
so the figure is the instructions the record path executes, whatever the machine's load;
it runs the same against another checkout (``--tree``) and on either record path
(``VELOMUX_PURE_PYTHON=1``), which is how a change to these paths is measured against the
code before it. The arms, over ``--streams`` streams and ``--rounds`` rounds of one 48-byte
token each:

* ``take``: a ``StreamAnchor``'s ``take_ready()`` per stream, over the mux's ingress slots
  as ``perf/ingress_bench.py`` fills them (the ingress itself is not counted);
* ``anext``: ``await anchor.__anext__()`` per stream over the same slots, driven without a
  loop since every item is ready (the read's awaitable, ended through the interpreter's
  send path);
* ``anext-wait``: a task per stream reading ``async for`` on an asyncio loop, each waiting
  for its item and woken by it (the wait, the wake-up and the task's step);
* ``try-send``: ``MuxChannel.try_send`` per stream into a real batcher and driver (the
  driver's poll is not counted);
* ``send-pass``: ``send_pass`` of one item per stream through the same channels (the
  sender's pass loop, which stages through the channel's ``try_send`` in C);
* ``sender-try-send``: ``StreamSender.try_send(item)`` per stream through the same
  channels: the item's encoding and the channel's ``try_send``;
* ``send``: ``await sender.send(item)`` per stream from one coroutine, driven without a
  loop since each finds room: the same work inside the coroutine a producer awaits, and
  that coroutine's cost;
* ``end-turn``: a decode loop's last pass, in one turn: each stream's last record
  (``try_send``) and its ``finalize()``; what the producer's turn pays before its records
  can leave;
* ``end-after``: the turns that follow until every terminal was written: the polls that
  pack the records and the terminals, and the terminals' staging where it waits for them.

    python perf/record_path_instructions.py
    python perf/record_path_instructions.py --tree <checkout before the change>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _callgrind import ENV_DIR, ClientRequests, read_window, run_in_tree  # noqa: E402

TOKEN = {"t": 12345, "s": 1, "p": "x" * 24}
"""About the 48-byte token frame of ``perf/tokens.py``."""

ARMS = (
    "take",
    "anext",
    "anext-wait",
    "try-send",
    "send-pass",
    "sender-try-send",
    "send",
    "end-turn",
    "end-after",
)


class Counter:
    """Callgrind's client requests, and the instructions of each arm per record."""

    def __init__(self, out_dir: Path) -> None:
        self.requests = ClientRequests()
        if not self.requests.on_valgrind():
            raise SystemExit("not on valgrind: run this script without --child")
        self.out_dir = out_dir
        self.results: dict[str, float] = {}


def _ready(coroutine: Coroutine[Any, Any, Any]) -> Any:
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise SystemExit("the read waited: the records were not ready")


def consumer_arms(counter: Counter, streams: int, rounds: int) -> None:
    from ingress_bench import Bench

    bench = Bench(streams)
    payloads = bench.batches(rounds * 2)

    # Only the reads are counted: ingress and the credit visit run with counting stopped.
    taken = 0

    def reads(read: Callable[[Any], Coroutine[Any, Any, Any]], batch: list[bytes]) -> None:
        nonlocal taken
        for payload in batch:
            bench.ingress(payload)
            counter.requests.start()
            for anchor in bench.anchors:
                _ready(read(anchor))
            counter.requests.stop()
            taken += read_window(counter.out_dir)
            bench.reconcile()

    async def take_ready(anchor: Any) -> Any:
        return await anchor.take_ready()

    async def anext(anchor: Any) -> Any:
        return await anchor.__anext__()

    for arm, read, batch in (
        ("take", take_ready, payloads[:rounds]),
        ("anext", anext, payloads[rounds:]),
    ):
        taken = 0
        reads(read, batch)
        counter.results[arm] = taken / (rounds * streams)


def wait_arm(counter: Counter, streams: int, rounds: int) -> None:
    from ingress_bench import Bench

    bench = Bench(streams)
    payloads = bench.batches(rounds)

    async def main() -> None:
        async def reader(anchor: Any) -> None:
            async for _ in anchor:
                pass

        tasks = [asyncio.ensure_future(reader(anchor)) for anchor in bench.anchors]
        for _ in range(3):
            await asyncio.sleep(0)  # every reader waits
        counter.requests.start()
        for payload in payloads:
            bench.ingress(payload)
            await asyncio.sleep(0)  # the readers run, read their item and wait again
            bench.reconcile()
        counter.requests.stop()
        counter.results["anext-wait"] = read_window(counter.out_dir) / (rounds * streams)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


def producer_arms(counter: Counter, streams: int, rounds: int) -> None:
    from prometheus_client.registry import CollectorRegistry

    from velomux_quic.ids import InstanceId, StreamAnchorHandle
    from velomux_quic.messenger import Messenger
    from velomux_quic.mux.config import MuxConfig
    from velomux_quic.mux.driver import BatcherDriver, MuxChannel
    from velomux_quic.mux.egress import EgressBatcher
    from velomux_quic.streaming.frames import encode_item
    from velomux_quic.streaming.metrics import StreamingMetrics
    from velomux_quic.streaming.sender import SenderState, StreamSender, send_pass

    peer = InstanceId.parse("00000000-0000-4000-8000-000000000001")

    class Messages:
        def send_message_on_lane(self, *args: Any, **kwargs: Any) -> None:
            return None

    class Owner:
        def sender_finished(self, state: Any) -> None:
            pass

        def sender_retired(self, state: Any) -> None:
            pass

    async def main() -> None:
        batcher = EgressBatcher(0, MuxConfig())  # its credit covers the rounds' records
        driver = BatcherDriver(cast(Messenger, Messages()), peer, batcher)
        metrics = StreamingMetrics(CollectorRegistry(), lambda: 0)
        channels = []
        senders = []
        for index in range(streams):
            # Credit for every arm's records: no consumer returns any here.
            slot = batcher.open_slot(anchor_id=100 + index, session_id=200 + index, credit=1024)
            channel = MuxChannel(driver, slot)
            state = SenderState(
                Owner(),
                metrics,
                StreamAnchorHandle.pack(1, index + 1),
                channel,
                sender_stream_id=index,
                transport_key="messenger-mux-v2",
                target=peer,
                heartbeat_interval=None,
            )
            channel.watch(state)
            channels.append(channel)
            senders.append(StreamSender(state))
        driver.wake()
        for _ in range(3):
            await asyncio.sleep(0)  # the OpenSlots are written
        body = encode_item(TOKEN)

        async def per_record(one_round: Callable[[], None]) -> float:
            """Instructions per record of ``rounds`` calls of ``one_round`` (a record on
            every stream), the driver's wake writing each round's batch in between."""
            counted = 0
            for _ in range(rounds):
                counter.requests.start()
                one_round()
                counter.requests.stop()
                counted += read_window(counter.out_dir)
                await asyncio.sleep(0)
            return counted / (rounds * streams)

        def try_sends() -> None:
            for channel in channels:
                if not channel.try_send(body):
                    raise SystemExit("a record was refused")

        counter.results["try-send"] = await per_record(try_sends)
        counted = 0
        pairs = [(sender, TOKEN) for sender in senders]
        for _ in range(rounds):
            counter.requests.start()
            outcome = await send_pass(pairs)
            counter.requests.stop()
            counted += read_window(counter.out_dir)
            if outcome.left:
                raise SystemExit("a pass left records over")
            await asyncio.sleep(0)
        counter.results["send-pass"] = counted / (rounds * streams)

        def sender_try_sends() -> None:
            for sender in senders:
                if not sender.try_send(TOKEN):
                    raise SystemExit("a record was refused")

        async def sends() -> None:
            # Awaited from a coroutine, as a producer does: the interpreter's await, not a
            # StopIteration per send (one per round, for this coroutine, is counted).
            for sender in senders:
                await sender.send(TOKEN)

        counter.results["sender-try-send"] = await per_record(sender_try_sends)
        counter.results["send"] = await per_record(lambda: _ready(sends()))
        counter.requests.start()
        for channel in channels:
            if not channel.try_send(body):
                raise SystemExit("a record was refused")
        retired = [sender.finalize() for sender in senders]
        counter.requests.stop()
        counter.results["end-turn"] = read_window(counter.out_dir) / streams
        counter.requests.start()
        for _ in range(100):  # a few turns: the terminals go in the batch after the records'
            if retired[-1].done():
                break
            await asyncio.sleep(0)
        counter.requests.stop()
        counter.results["end-after"] = read_window(counter.out_dir) / streams
        if not all(future.done() for future in retired):
            raise SystemExit("the terminals were not written")

    asyncio.run(main())


def child(streams: int, rounds: int) -> None:
    counter = Counter(Path(os.environ[ENV_DIR]))
    consumer_arms(counter, streams, rounds)
    wait_arm(counter, streams, rounds)
    producer_arms(counter, streams, rounds)
    from velomux_quic.recordpath import IMPLEMENTATION

    print(json.dumps({"record_path": IMPLEMENTATION, **counter.results}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tree", type=Path, default=None, help="a checkout to measure instead")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.streams, args.rounds)
        return
    tree = (args.tree or HERE.parent).resolve()
    result = run_in_tree(__file__, [f"--streams={args.streams}", f"--rounds={args.rounds}"], tree)
    print(f"{tree} ({result.pop('record_path')}): instructions per record")
    width = max(len(arm) for arm in ARMS)
    for arm in ARMS:
        print(f"  {arm:<{width}} {result[arm]:9,.0f}")


if __name__ == "__main__":
    main()
