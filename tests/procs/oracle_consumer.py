"""A consumer node in its own process for the fault matrix: it checks every item's oracle.

    python -m tests.procs.oracle_consumer --credentials DIR \
        [--heartbeat S] [--idle-timeout S] [--port P] [--lanes N] [--no-mux]

Prints ``{"instance", "host", "port"}`` once it listens. Commands, one JSON line each on
standard input:

* ``{"op": "anchors", "first": K, "count": N, "read_delay": S, "cancel_after": M,
  "cancel_every": J}`` makes ``N`` anchors numbered from ``K`` and reads each in a task of
  its own (``read_delay`` seconds per item: a slow consumer; every ``J``-th anchor is
  cancelled after ``M`` items). It answers ``{"handles": [[index, hi, lo], ...]}``.
* ``{"op": "metrics"}`` answers ``{"metrics": {name: value}}``: every ``velo_`` series of
  the node, summed over its labels.

Every item must be ``[stream, seq, crc32(payload), payload]`` with ``stream`` the anchor's
own number and ``seq`` the next one expected; each stream's reader checks that and writes
one JSON line (with a ``stream`` key) to standard output as the stream ends: items taken,
the first violation of each kind (misrouted, corrupt, out of sequence), how it ended
(``finalized``, or the error's class name and message) and when (``time.monotonic()``,
shared by every process of the host), and when its last item came. End of input closes the
node and exits 0.
"""

# "The chapter" in this file is the Batched streaming chapter of the velo book, the
# design this library implements (docs/architecture.md says how it is built):
# https://github.com/ai-dynamo/velo/blob/main/docs/src/concepts/batched-streaming.md
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import zlib
from typing import Any

from velomux_quic import (
    MessengerConfig,
    MuxConfig,
    Node,
    StreamAnchor,
    StreamingConfig,
    TransportConfig,
)
from velomux_quic.programs.runtime import run


async def read(index: int, anchor: StreamAnchor[Any], command: dict[str, Any]) -> None:
    delay: float = command.get("read_delay", 0.0)
    cancel_every: int = command.get("cancel_every", 0)
    cancel_after: int | None = None
    if cancel_every and index % cancel_every == 0:
        cancel_after = command.get("cancel_after", 1)
    line: dict[str, Any] = {
        "stream": index,
        "items": 0,
        "misrouted": 0,
        "corrupt": 0,
        "out_of_sequence": 0,
        "first_violation": None,
        "last_item_at": None,
    }
    try:
        async for item in anchor:
            stream, seq, crc, payload = item
            kind = None
            if stream != index:
                kind = "misrouted"
            elif zlib.crc32(payload) != crc:
                kind = "corrupt"
            elif seq != line["items"]:
                kind = "out_of_sequence"
            if kind is not None:
                line[kind] += 1
                if line["first_violation"] is None:
                    line["first_violation"] = [kind, line["items"], stream, seq]
            line["items"] += 1
            line["last_item_at"] = time.monotonic()
            if cancel_after is not None and line["items"] >= cancel_after:
                anchor.cancel()
                line["end"] = "cancelled_here"
                break
            if delay:
                await asyncio.sleep(delay)  # the slow reader's pace, not synchronisation
        else:
            line["end"] = "finalized"
    except Exception as exc:  # the chapter's errors are what the record is for
        line["end"] = type(exc).__name__
        line["message"] = str(exc)[:200]
    line["at"] = time.monotonic()
    print(json.dumps(line), flush=True)


def metrics(node: Node) -> dict[str, float]:
    totals: dict[str, float] = {}
    for text in node.metrics_text().splitlines():
        if not text.startswith("velo_"):
            continue
        name = text.partition("{")[0].partition(" ")[0]
        totals[name] = totals.get(name, 0.0) + float(text.rpartition(" ")[2])
    return totals


async def main(args: argparse.Namespace) -> int:
    transport = TransportConfig(
        lanes=args.lanes,
        idle_timeout=args.idle_timeout,
        keep_alive_interval=min(5.0, args.idle_timeout / 4),
    )
    streaming = StreamingConfig(heartbeat_interval=args.heartbeat)
    mux = MuxConfig(enabled=not args.no_mux)
    messenger = MessengerConfig(staging_threshold=args.staging_threshold)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    readers: set[asyncio.Task[None]] = set()
    node = await Node.start(
        args.credentials,
        port=args.port,
        transport=transport,
        messenger=messenger,
        streaming=streaming,
        mux=mux,
    )
    async with node:
        host, port = node.address
        print(
            json.dumps({"instance": str(node.instance_id), "host": host, "port": port}), flush=True
        )
        while line := await reader.readline():
            command = json.loads(line)
            if command["op"] == "anchors":
                handles = []
                for index in range(command["first"], command["first"] + command["count"]):
                    anchor: StreamAnchor[Any] = node.create_anchor()
                    wire = anchor.handle.to_wire()
                    handles.append([index, wire["hi"], wire["lo"]])
                    task = asyncio.create_task(read(index, anchor, command))
                    readers.add(task)
                    task.add_done_callback(readers.discard)
                print(json.dumps({"handles": handles}), flush=True)
            elif command["op"] == "metrics":
                print(json.dumps({"metrics": metrics(node)}), flush=True)
        for task in list(readers):
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--credentials", required=True)
    parser.add_argument("--heartbeat", type=float, default=0.5)
    parser.add_argument("--idle-timeout", type=float, default=15.0)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--lanes", type=int, default=1)
    parser.add_argument("--staging-threshold", type=int, default=256 * 1024)
    parser.add_argument("--no-mux", action="store_true")
    raise SystemExit(run(main(parser.parse_args())))
