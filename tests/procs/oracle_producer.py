"""A producer node in its own process for the fault matrix: every item carries its oracle.

    python -m tests.procs.oracle_producer --credentials DIR --peer UUID@HOST:PORT \
        [--lanes N] [--idle-timeout S] [--health-check S]
        [--health-check-timeout S] [--no-mux]

Each item is ``[stream, seq, crc32(payload), payload]``, so the consumer can tell a lost,
duplicated, reordered, corrupted or misrouted item from a good one. The test drives it with
one JSON command per line on standard input:

* ``{"op": "stream", "streams": [[index, hi, lo], ...], "items": N, "interval": S,
  "sizes": [MIN, MAX], "seed": K}`` attaches one sender per anchor and sends ``N`` items
  (``N`` null: until ``finish``; ``"idle": true``: one item, then nothing until ``finish``),
  ``interval`` seconds apart, of random sizes. It answers ``{"attached": [...], "failed":
  [...]}`` once every attach settled and every attached stream sent its first item.
* ``{"op": "finish"}``: the open-ended streams send one last item and finalize.
* ``{"op": "metrics"}`` answers ``{"metrics": {name: value}}``, as the consumer does.

End of input closes the node and exits 0. One JSON line per stream (with a ``stream`` key)
goes to standard output as the stream ends (flushed, so the pipe keeps it through a SIGKILL
of this process for the streams that ended before it): how many items it sent, how it
retired or what error ended it, and when (``time.monotonic()``, which every process of a
Linux host shares).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
import zlib
from typing import Any

from tests.procs.oracle_consumer import metrics
from velomux_quic import (
    InstanceId,
    MessengerConfig,
    MuxConfig,
    Node,
    StreamAnchorHandle,
    StreamSender,
    TransportConfig,
)
from velomux_quic.programs.runtime import run


def oracle_item(stream: int, seq: int, payload: bytes) -> list[object]:
    """The item as it travels: who it belongs to, where it goes, and its checksum."""
    return [stream, seq, zlib.crc32(payload), payload]


class Producer:
    """The open streams of this process and the record of those that ended."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.finish = asyncio.Event()
        self.tasks: set[asyncio.Task[None]] = set()

    def write(self, line: dict[str, Any]) -> None:
        print(json.dumps(line), flush=True)

    async def attach(self, index: int, hi: int, lo: int) -> StreamSender | None:
        try:
            return await self.node.attach_anchor(StreamAnchorHandle.pack(hi, lo))
        except Exception as exc:  # recorded: the test decides whether it was allowed
            self.write(ended(index, 0, "attach", exc))
            return None

    async def stream(
        self,
        index: int,
        sender: StreamSender,
        command: dict[str, Any],
        first_sent: asyncio.Future[None],
    ) -> None:
        rng = random.Random(f"{command.get('seed', 0)}/{index}")
        low, high = command.get("sizes", [16, 64])
        items: int | None = command.get("items")
        interval: float = command.get("interval", 0.02)
        idle = bool(command.get("idle", False))
        sent = 0
        phase = "send"
        try:
            while items is None or sent < items:
                payload = rng.randbytes(rng.randint(low, high))
                await sender.send(oracle_item(index, sent, payload))
                sent += 1
                if not first_sent.done():
                    first_sent.set_result(None)
                if items is None and (idle or self.finish.is_set()):
                    if not self.finish.is_set():
                        await wait_first(self.finish.wait(), sender.wait_cancelled())
                    if sender.is_cancelled:
                        raise_cancelled()
                    payload = rng.randbytes(rng.randint(low, high))
                    await sender.send(oracle_item(index, sent, payload))
                    sent += 1
                    break
                if interval:
                    await asyncio.sleep(interval)  # the producer's pace, not synchronisation
            phase = "retire"
            outcome = await sender.finalize()
            self.write(
                {
                    "stream": index,
                    "sent": sent,
                    "phase": phase,
                    "outcome": outcome.name,
                    "at": time.monotonic(),
                }
            )
        except Exception as exc:
            self.write(ended(index, sent, phase, exc))
        finally:
            if not first_sent.done():
                first_sent.set_result(None)

    async def start(self, command: dict[str, Any]) -> dict[str, list[int]]:
        streams: list[list[int]] = command["streams"]
        senders = await asyncio.gather(*(self.attach(*entry) for entry in streams))
        attached, failed, firsts = [], [], []
        for (index, _, _), sender in zip(streams, senders, strict=True):
            if sender is None:
                failed.append(index)
                continue
            attached.append(index)
            first: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            firsts.append(first)
            task = asyncio.create_task(self.stream(index, sender, command, first))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        await asyncio.gather(*firsts)
        return {"attached": attached, "failed": failed}


class StreamEndedByConsumer(Exception):
    """The consumer cancelled or dropped an idle stream (seen through wait_cancelled)."""


def raise_cancelled() -> None:
    raise StreamEndedByConsumer("the consumer cancelled or dropped the stream")


async def wait_first(*waits: Any) -> None:
    tasks = [asyncio.ensure_future(wait) for wait in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def ended(index: int, sent: int, phase: str, exc: BaseException) -> dict[str, Any]:
    return {
        "stream": index,
        "sent": sent,
        "phase": phase,
        "outcome": type(exc).__name__,
        "message": str(exc)[:200],
        "at": time.monotonic(),
    }


async def main(args: argparse.Namespace) -> int:
    identity, _, address = args.peer.partition("@")
    host, _, port = address.rpartition(":")
    transport = TransportConfig(
        lanes=args.lanes,
        idle_timeout=args.idle_timeout,
        keep_alive_interval=min(5.0, args.idle_timeout / 4),
    )
    mux = MuxConfig(
        enabled=not args.no_mux,
        health_check_interval=args.health_check,
        health_check_timeout=args.health_check_timeout or args.health_check,
    )
    messenger = MessengerConfig(staging_threshold=args.staging_threshold)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with await Node.start(
        args.credentials, transport=transport, messenger=messenger, mux=mux
    ) as node:
        node.add_peer(InstanceId.parse(identity), (host, int(port)))
        producer = Producer(node)
        print(json.dumps({"instance": str(node.instance_id)}), flush=True)
        while line := await reader.readline():
            command = json.loads(line)
            if command["op"] == "stream":
                print(json.dumps(await producer.start(command)), flush=True)
            elif command["op"] == "finish":
                producer.finish.set()
                await asyncio.gather(*producer.tasks, return_exceptions=True)
                print(json.dumps({"finished": True}), flush=True)
            elif command["op"] == "metrics":
                print(json.dumps({"metrics": metrics(node)}), flush=True)
        for task in list(producer.tasks):
            task.cancel()
        await asyncio.gather(*producer.tasks, return_exceptions=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--peer", required=True)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--staging-threshold", type=int, default=256 * 1024)
    parser.add_argument("--idle-timeout", type=float, default=15.0)
    parser.add_argument("--health-check", type=float, default=5.0)
    parser.add_argument("--health-check-timeout", type=float, default=None)
    parser.add_argument("--no-mux", action="store_true")
    raise SystemExit(run(main(parser.parse_args())))
